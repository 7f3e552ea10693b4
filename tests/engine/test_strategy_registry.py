"""#28, one point: one entry point for every strategy. ``runner.stream`` looks the strategy up in
its spec (``engine.base.strategy_spec.STRATEGIES``: each strategy registers a ``StrategySpec`` whose
``stream`` is ``fn(ctx: RunContext) -> Iterator[Event]``) instead of an if/elif over the modules."""

from __future__ import annotations

import ast
import dataclasses
import inspect

from engine import runner
from engine.core import RunContext
from engine.base import strategy_spec
from engine.runner import RunRequest
from engine.config import STRATEGIES, DecodingConfig


def test_every_strategy_has_one_registered_stream():
    assert set(strategy_spec.STRATEGIES) == set(STRATEGIES)
    assert all(callable(spec.stream) for spec in strategy_spec.STRATEGIES.values())


def test_stream_dispatches_through_the_registry_not_an_if_chain():
    body = ast.parse(inspect.getsource(runner.stream)).body[0]
    tests = [node for node in ast.walk(body) if isinstance(node, ast.Compare)
             and any(isinstance(side, ast.Attribute) and side.attr == "strategy" for side in [node.left, *node.comparators])]
    assert tests == []


def test_a_registered_stream_is_what_runs(tiny_lm, monkeypatch):
    """Replacing a strategy's entry (as adding one would) changes what runner.run runs; the context
    carries the prompt, the encoded ids, the knobs and the control."""
    seen = []
    real = strategy_spec.STRATEGIES["greedy"]

    def spy(ctx: RunContext):
        seen.append(ctx)
        yield from real.stream(ctx)

    monkeypatch.setitem(strategy_spec.STRATEGIES, "greedy", dataclasses.replace(real, stream=spy))
    config = DecodingConfig(strategy="greedy", max_new_tokens=3)
    trace = runner.run(RunRequest(tiny_lm, "hello there", config))
    [ctx] = seen
    assert ctx.prompt == "hello there" and ctx.ids == tiny_lm.encode("hello there", False) and ctx.config is config
    assert len(trace.generated_token_ids) == 3
    monkeypatch.setitem(strategy_spec.STRATEGIES, "greedy", real)
    assert runner.run(RunRequest(tiny_lm, "hello there", config)).generated_token_ids == trace.generated_token_ids


def test_branch_is_one_path_through_stream():
    """runner.branch writes no continuation of its own: it replays the kept steps and calls
    ``stream(..., prefix=, force=)``, never decode or the scheduler directly."""
    calls = {ast.unparse(node.func) for fn in (runner.branch, runner._branch_events)  # its events: _branch_events
             for node in ast.walk(ast.parse(inspect.getsource(fn).strip())) if isinstance(node, ast.Call)}
    assert "stream" in calls and not any(c.startswith(("decode.", "scheduler.", "batched")) for c in calls)
