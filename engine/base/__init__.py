"""The engine's base floor: what every room reads and no implementation. ``knobs`` (Knob,
ConfigError), ``stage_spec`` (StageSpec, the registry STAGES), ``strategy_spec`` (StrategySpec, the
registry STRATEGIES), ``seam`` (the Model and Cache interfaces, a model's Capabilities) and
``measures`` (common_prefix, mean log-probability, perplexity). Its modules import nothing from
engine/ but ``engine.numbers``; the floors are in docs/architecture.md and tests/project/test_import_graph.py."""
