"""Running lanes through the runner: one model event drives them all at once, each lane in a thread
of its own (greedy/sampling lanes share the batched scheduler's forwards; a served model's lane
waits on its server without holding the others up).

The lanes' threads only record (``LaneRun``); the run's own thread reads every lane's record at
each redraw (``follow``) and writes the page's session from them (``record``), so each lane's
status is drawn from its own state at every update. A Stop (or the time limit) is seen by that
thread within POLL_S, whatever the lanes are doing: it marks every unfinished lane stopped with the
tokens it has, and ends the run without waiting for a lane blocked on a server's answer (that lane
stops at its next token or request: engine.runner closes a stopped run's stream).
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from engine import runner
from engine.base.seam import Model
from engine.config import DecodingConfig
from engine.control import RunControl, RunStopped, run_under
from engine.core import closing_stream
from engine.backends.client import RemoteError
from engine.trace import Event, StepTrace, Trace

from ...events import error_message
from ...shared import Shared, UserError
from .lanes import DONE, FAILED, RUNNING, STOPPED, CompareSession

# At most this often a redraw while lanes run (a lane that ends redraws at once). Every update costs
# the browser work in proportion to the whole app's components (Gradio refreshes every loading status
# per message: 0.6-0.9 s of main thread per update on a loaded 2-core machine), so a page updated
# faster than it can draw lags the server, and a Stop pressed on it lands late.
STREAM_EVERY_S = 0.5
POLL_S = 0.05  # how often the run's thread looks at its control while waiting for the lanes
# After a Stop or the time limit: how long the last redraw may wait on a served lane's server for its
# text (a partial trace decodes the tokens there); past it the lane keeps the tokens it last drew.
LAST_DRAW_S = 3.0


@dataclass
class LaneRun:
    """One lane's run as its thread records it: the steps so far, the records so far (a beam
    search's steps: its tokens come at the end), then the whole trace, or the error that ended it."""

    steps: list[StepTrace] = field(default_factory=list)
    records: int = 0
    trace: Trace | None = None
    error: Exception | None = None
    ended: bool = False

    @property
    def made(self) -> int:
        return max(len(self.steps), self.records)


def drive(run: LaneRun, events: Callable[[], Iterator[Event]], ended: queue.SimpleQueue, i: int) -> None:
    """Lane ``i``'s thread: record its events in ``run``; put ``i`` on ``ended`` when it ends."""
    try:
        with closing_stream(events()) as stream:  # an error of ours closes the run's stream (and a server's request)
            for event in stream:
                run.steps.extend(event.steps)  # one C call: the run's thread may copy the list at any time
                if event.record is not None and not event.steps:
                    run.records += 1
                if event.trace is not None:
                    run.trace = event.trace
    except Exception as exc:  # noqa: BLE001 (reported with its lane; the other lanes run on)
        run.error = exc.with_traceback(None)  # keeps no frame (nor a server's open response) alive
    finally:
        run.ended = True
        ended.put(i)


def start(jobs: Sequence[Callable[[], Iterator[Event]]]) -> tuple[list[LaneRun], queue.SimpleQueue]:
    """Every job in a daemon thread of its own; (their records, the queue their ends go on)."""
    runs, ended = [LaneRun() for _ in jobs], queue.SimpleQueue[int]()
    for i, job in enumerate(jobs):
        threading.Thread(target=drive, args=(runs[i], job, ended, i), daemon=True, name=f"dp-lane-{i}").start()
    return runs, ended


def follow(runs: Sequence[LaneRun], ended: queue.SimpleQueue, control: RunControl,
           every_s: float = STREAM_EVERY_S) -> Iterator[None]:
    """Yield whenever the lanes have something to redraw: at most every ``every_s`` while they run,
    at once when a lane ends; return when every lane has ended. ``control`` is checked every
    POLL_S: a Stop or the time limit raises RunStopped here at once."""
    left, last = len(runs), time.monotonic()
    while left:
        control.check()
        try:
            ended.get(timeout=POLL_S)
            left -= 1
            while left:  # lanes that ended together: one redraw
                ended.get_nowait()
                left -= 1
        except queue.Empty:
            if time.monotonic() - last < every_s:
                continue
        last = time.monotonic()
        yield


@dataclass(frozen=True)
class LaneModel:
    """The model a lane runs on and the prompt's ids under its tokenizer (lanes may differ: our
    engine in one, a llama.cpp server the operator lists in another)."""

    lm: Model
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
    model>`` (engine.backends.served.ModelPick, read by ``Shared.lm``) runs that server in fast mode.
    UserError when it cannot."""
    lm = shared.lm(source, quant)
    return LaneModel(lm, shared.encode_prompt(lm, prompt, chat))


def lane_stream(shared: Shared, model: LaneModel, prompt: str, config: DecodingConfig, chat: bool,
                control: RunControl) -> Callable[[], Iterator[Event]]:
    """A lane's job: its run's events, made in the lane's thread (a refusal is that lane's error)."""
    return functools.partial(shared.stream, model.lm, prompt, config, chat=chat, prompt_ids=model.prompt_ids,
                             control=control)


def run_lanes(shared: Shared, models: Sequence[LaneModel], prompt: str, configs: Sequence[DecodingConfig],
              chat: bool, session: CompareSession, control: RunControl) -> Iterator[None]:
    """Run every lane (``configs[i]`` on ``models[i]``) at once, writing ``session`` from every
    lane's own record before each yield (a redraw). A failing lane records its error and the others
    still run. A Stop or the time limit marks every unfinished lane stopped, with its tokens so far,
    and raises RunStopped at once; closing the generator mid-run cancels ``control``."""
    runs, ended = start([lane_stream(shared, m, prompt, c, chat, control) for m, c in zip(models, configs)])
    drawn: dict[int, int] = {}  # lane -> how many steps its partial trace in the session holds
    write = functools.partial(record, session, runs, drawn, lambda i, steps: runner.partial_trace(
        models[i].lm, prompt, models[i].prompt_ids, configs[i], steps, chat))
    session.phases, session.progress, session.stopped = [RUNNING] * len(runs), [0] * len(runs), ""
    shown = None  # what the last redraw showed of every lane: a redraw with nothing new is not sent
    try:
        for _ in follow(runs, ended, control):
            now = [(len(run.steps), run.records, run.ended) for run in runs]
            if now != shown:
                shown = now
                write("")
                yield
        if any(isinstance(run.error, RunStopped) for run in runs):
            # Every lane ended on the Stop before ``follow`` looked at the control again (their ends
            # came in one wait): the run was stopped, not done ("done: 2 of 2 lanes ran" beside two
            # "stopped after 15 of 128 tokens" lanes, on a loaded machine).
            control.check()
    except RunStopped as stopped:
        # The run's own control is cancelled (or past its limit), and a served lane's partial trace asks
        # its server for the text: the last redraw runs under a short control of its own.
        run_under(RunControl(deadline_s=LAST_DRAW_S), write, stopped.reason)
        raise
    finally:
        if not all(run.ended for run in runs):  # stopped, or the consumer went away: the lanes stop too
            control.cancel()


def record(session: CompareSession, runs: Sequence[LaneRun], drawn: dict[int, int],
           partial: Callable[[int, list[StepTrace]], Trace], stopped: str) -> None:
    """Write every lane's state into ``session`` from its own record: ended lanes DONE, FAILED or
    STOPPED, the others RUNNING with a partial trace of their steps so far; ``stopped`` (the run's
    RunStopped reason, or ""): the run ended early, so every unfinished lane is STOPPED."""
    session.stopped = stopped
    for i, run in enumerate(runs):
        ended, error = run.ended, run.error  # read once: the lane's thread may end meanwhile
        if ended and error is None and run.trace is None:
            error = RuntimeError("the run ended without its trace")
        if ended and error is None and run.trace is not None:
            session.phases[i], session.traces[i] = DONE, run.trace
            continue
        steps = list(run.steps)
        if len(steps) != drawn.get(i):
            try:
                session.traces[i], drawn[i] = (partial(i, steps) if steps else None), len(steps)
            except (RunStopped, RemoteError):  # a served lane's text comes from its server: Stop, limit, or a fault
                steps = steps[:drawn.get(i, 0)]  # the lane keeps what it last drew, and says that count
        session.progress[i] = max(len(steps), run.records)  # the snapshot's count: status and text agree
        if ended and error is not None and not isinstance(error, RunStopped):
            session.phases[i], session.errors[i] = FAILED, error_message(error, "lane")
        elif stopped or isinstance(error, RunStopped):
            session.phases[i] = STOPPED
        else:
            session.phases[i] = RUNNING


def run_sweep(shared: Shared, lm: Model, prompt: str, prompt_ids: list[int], config: DecodingConfig,
              seeds: Sequence[int], chat: bool, control: RunControl) -> Iterator[list[Trace]]:
    """One lane over several seeds, all at once; yields the finished traces (in seed order) as runs
    end. A failed run raises its error; a Stop or the time limit raises RunStopped at once."""
    model = LaneModel(lm, prompt_ids)
    runs, ended = start([lane_stream(shared, model, prompt, config.replace(seed=seed), chat, control)
                         for seed in seeds])
    try:
        count = 0
        for _ in follow(runs, ended, control):
            failed = next((run.error for run in runs if run.ended and run.error is not None), None)
            if failed is not None:
                raise failed
            finished = [run.trace for run in runs if run.ended and run.trace is not None]
            if len(finished) > count:
                count = len(finished)
                yield finished
    finally:
        if not all(run.ended for run in runs):
            control.cancel()
