"""Running lanes through the runner (one model event drives them all, one after another)."""

from __future__ import annotations

from typing import Iterator, Sequence

from engine import runner
from engine.config import DecodingConfig
from engine.control import RunControl, RunStopped
from engine.models import LoadedModel
from engine.trace import Trace

from ...events import error_message
from ...shared import Shared, throttle
from .lanes import CompareSession

STREAM_EVERY_S = 0.25


def stream_lane(shared: Shared, lm: LoadedModel, prompt: str, prompt_ids: list[int], config: DecodingConfig,
                chat: bool, control: RunControl) -> Iterator[Trace]:
    """Partial traces while the lane runs (throttled; none for beam search, whose output is only
    known at the end), then the whole trace."""
    steps = []
    events = shared.stream(lm, prompt, config, chat=chat, prompt_ids=prompt_ids, control=control)
    for event, redraw in throttle(events, STREAM_EVERY_S):
        steps += event.steps
        if event.trace is not None:
            yield event.trace
        elif redraw and steps:
            yield runner.partial_trace(lm, prompt, prompt_ids, config, steps, chat)


def run_lanes(shared: Shared, lm: LoadedModel, prompt: str, prompt_ids: list[int], configs: Sequence[DecodingConfig],
              chat: bool, session: CompareSession, control: RunControl) -> Iterator[int]:
    """Run every lane in turn, updating ``session``; yields the running lane's index on each update.
    A failing lane records its error and the others still run; a stopped run stops them all."""
    for i, config in enumerate(configs):
        try:
            for trace in stream_lane(shared, lm, prompt, prompt_ids, config, chat, control):
                session.traces[i] = trace
                yield i
        except RunStopped:
            raise
        except Exception as exc:  # one lane's failure must not stop the others
            session.errors[i] = error_message(exc, "lane")
        yield i


def run_sweep(shared: Shared, lm: LoadedModel, prompt: str, prompt_ids: list[int], config: DecodingConfig,
              seeds: Sequence[int], chat: bool, control: RunControl) -> Iterator[list[Trace]]:
    """One lane over several seeds; yields the finished traces after each seed."""
    traces: list[Trace] = []
    for seed in seeds:
        *_, trace = stream_lane(shared, lm, prompt, prompt_ids, config.replace(seed=seed), chat, control)
        traces.append(trace)
        yield traces
