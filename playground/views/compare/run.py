"""Running lanes through the runner: one model event drives them all at once (greedy/sampling lanes
share the batched scheduler's forwards)."""

from __future__ import annotations

import functools
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from engine import runner
from engine.config import DecodingConfig
from engine.control import RunControl, RunStopped
from engine.backends.local import LoadedModel
from engine.trace import Trace

from ...events import error_message
from ...shared import Shared, UserError, throttle
from .lanes import FAST_PREFIX, CompareSession

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


def concurrently(jobs: Sequence[Callable[[], Iterator[Trace]]], control: RunControl
                 ) -> Iterator[tuple[int, Trace | None, Exception | None]]:
    """Run every job at once, each in its own thread; yield (job index, trace, error) as they come,
    and (index, None, None) when a job ends. Greedy/sampling lanes then join the batched scheduler
    together and share its forwards, so 4 lanes take little more than one. Closing this generator
    (or a stopped run) cancels ``control``, which stops every job within one step."""
    results: queue.SimpleQueue = queue.SimpleQueue()

    def work(i: int, job: Callable[[], Iterator[Trace]]) -> None:
        try:
            for trace in job():
                results.put((i, trace, None))
        except Exception as exc:  # noqa: BLE001 (reported to the caller with its lane)
            results.put((i, None, exc))
        finally:
            results.put((i, None, None))

    threads = [threading.Thread(target=work, args=(i, job), daemon=True, name=f"dp-lane-{i}")
               for i, job in enumerate(jobs)]
    for thread in threads:
        thread.start()
    running = len(threads)
    try:
        while running:
            i, trace, error = results.get()
            if trace is None and error is None:  # the job's end marker
                running -= 1
            yield i, trace, error
    finally:
        if running:  # the consumer went away mid-run: stop the jobs too
            control.cancel()


@dataclass(frozen=True)
class LaneModel:
    """The model a lane runs on and the prompt's ids under its tokenizer (lanes may differ: our
    engine in one, a llama.cpp server the operator lists in another)."""

    lm: LoadedModel
    prompt_ids: list[int]


def lane_models(shared: Shared, picks: Sequence[tuple], model: str, quant: str, prompt: str,
                chat: bool) -> list[LaneModel]:
    """Each lane's model (``picks``: (lane name, its model pick[, its quantization])): its own pick,
    else the header's ``model``, in its own quantization (an API lane's, e.g. gptq-g64 beside
    awq-g64), else the header's ``quant``; each distinct model is loaded (or connected to) and the
    prompt encoded once. A lane's own pick that fails names the lane."""
    resolved: dict[tuple[Any, str], LaneModel] = {}
    models = []
    for name, pick, *own in picks:
        source, lane_quant = pick or model, (own[0] if own and own[0] else quant)
        if (source, lane_quant) not in resolved:
            try:
                resolved[source, lane_quant] = lane_model(shared, source, lane_quant, prompt, chat)
            except UserError as exc:
                raise UserError(f"{name}: {exc}" if pick or lane_quant != quant else str(exc)) from None
        models.append(resolved[source, lane_quant])
    return models


def lane_model(shared: Shared, source: Any, quant: str, prompt: str, chat: bool) -> LaneModel:
    """The model ``source`` names, connected or loaded, with the prompt's ids; ``fast:<served
    model>`` (FAST_PREFIX) runs that server in fast mode. UserError when it cannot."""
    fast = isinstance(source, str) and source.startswith(FAST_PREFIX)
    lm = shared.lm(source[len(FAST_PREFIX):] if fast else source, quant)
    if fast:
        if not lm.capabilities.served:
            raise UserError(f"model: {source[:80]!r}: fast mode needs a served model (the server's own sampler)")
        lm = lm.with_mode("fast")
    return LaneModel(lm, shared.encode_prompt(lm, prompt, chat))


def run_lanes(shared: Shared, models: Sequence[LaneModel], prompt: str, configs: Sequence[DecodingConfig],
              chat: bool, session: CompareSession, control: RunControl) -> Iterator[int]:
    """Run every lane (``configs[i]`` on ``models[i]``) at once, updating ``session``; yields the
    updated lane's index on each update. A failing lane records its error and the others still run;
    a stopped run stops them all."""
    jobs = [functools.partial(stream_lane, shared, m.lm, prompt, m.prompt_ids, config, chat, control)
            for m, config in zip(models, configs)]
    for i, trace, error in concurrently(jobs, control):
        if isinstance(error, RunStopped):
            raise error
        if error is not None:  # one lane's failure must not stop the others
            session.errors[i] = error_message(error, "lane")
        elif trace is not None:
            session.traces[i] = trace
        yield i


def run_sweep(shared: Shared, lm: LoadedModel, prompt: str, prompt_ids: list[int], config: DecodingConfig,
              seeds: Sequence[int], chat: bool, control: RunControl) -> Iterator[list[Trace]]:
    """One lane over several seeds, all at once; yields the finished traces (in seed order) as each ends."""
    jobs = [functools.partial(stream_lane, shared, lm, prompt, prompt_ids, config.replace(seed=seed), chat, control)
            for seed in seeds]
    finished: dict[int, Trace] = {}
    last: dict[int, Trace] = {}
    for i, trace, error in concurrently(jobs, control):
        if error is not None:
            raise error
        if trace is not None:
            last[i] = trace
        else:
            finished[i] = last[i]
            yield [finished[j] for j in sorted(finished)]
