"""The decoding engine (no UI): importing any part of it registers every stage and strategy
(``engine.stages``, ``engine.strategies``), so a config, a trace or the runner always sees them all."""

import engine.strategies  # noqa: F401  (registers every strategy; each imports engine.config, which registers the stages)
