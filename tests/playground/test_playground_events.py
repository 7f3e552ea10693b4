"""The playground's wiring: the model-event helper (error guard, cancellation), branching at every
step through the step view's own handler and the /branch endpoint, downloads, and which events
are API endpoints."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import json
import time

import gradio as gr
import pytest

from engine.config import DecodingConfig
from engine.control import RunControl, RunStopped
from playground import downloads, events
from playground.shared import PanelView, Shared, UserError


# --- the event helper, without a server ---------------------------------------------------------


def run_async(coroutine):
    """asyncio.run in a thread of its own: a browser test's Playwright keeps an event loop running in
    this thread when the whole suite runs in one process."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def _drain(agen) -> list:
    async def collect():
        return [item async for item in agen]
    return run_async(collect())


def test_error_guard_shows_user_errors_as_is_and_names_other_failures():
    def bad_input(*, control):
        yield {"status": "working"}
        raise UserError("prompt: empty; type something")

    def broken(*, control):
        raise KeyError("boom")
        yield

    on_error = lambda message: {"status": message}  # noqa: E731
    assert _drain(events.streamed(bad_input, on_error, "generation")()) == [
        {"status": "working"}, {"status": "prompt: empty; type something"}]
    assert _drain(events.streamed(broken, on_error, "search")()) == [{"status": "search failed: KeyError: 'boom'"}]
    assert events.error_message(RunStopped("cancelled", "stopped: the run was cancelled"), "x") == \
        "stopped: the run was cancelled"


def test_closing_the_event_cancels_its_run_within_a_step():
    """Gradio stops a cancelled event by cancelling its task: the handler's control must be
    cancelled at once, so the worker thread stops at its next check instead of running on."""
    steps, seen = [], {}

    def handler(*, control: RunControl):
        seen["control"] = control
        for i in range(1000):
            control.check()
            time.sleep(0.02)  # one "forward"
            steps.append(i)
            if i % 5 == 0:
                yield {"step": i}

    async def main():
        agen = events.streamed(handler, lambda m: {"error": m}, "generation")()
        assert await agen.__anext__() == {"step": 0}
        task = asyncio.ensure_future(agen.__anext__())
        await asyncio.sleep(0.05)
        task.cancel()  # what Gradio does on Stop / a cancelled client job
        with pytest.raises(asyncio.CancelledError):
            await task
        await agen.aclose()

    run_async(main())
    assert seen["control"].cancelled
    at_cancel = len(steps)
    time.sleep(0.3)
    assert len(steps) <= at_cancel + 1  # the step in flight may finish; no more follow


def test_api_endpoint_hides_control_from_gradio_and_guards_errors():
    import gradio as gr

    def fn(shared: object, prompt: str, n: int = 3, *, control: RunControl) -> dict:
        """Doc."""
        if n < 0:
            raise ValueError("n: must be >= 0")
        return {"prompt": prompt, "n": n, "control": isinstance(control, RunControl)}

    endpoint = events.api_endpoint(functools.partial(fn, None), "run")
    assert list(inspect.signature(endpoint).parameters) == ["prompt", "n"]
    assert endpoint.__annotations__ == {"prompt": str, "n": int, "return": dict} and endpoint.__doc__ == "Doc."
    assert run_async(endpoint("hi", 2)) == {"prompt": "hi", "n": 2, "control": True}
    with pytest.raises(gr.Error, match="n: must be >= 0"):
        run_async(endpoint("hi", -1))


def test_concurrency_defaults_to_the_scheduler_batch(monkeypatch):
    monkeypatch.delenv("DP_CONCURRENCY", raising=False)
    monkeypatch.setenv("DP_MAX_BATCH", "12")
    assert events.default_concurrency() == 12
    monkeypatch.setenv("DP_CONCURRENCY", "3")
    assert events.default_concurrency() == 3
    monkeypatch.setenv("DP_CONCURRENCY", "zero")  # a bad value is refused, naming it (it used to mean the default)
    with pytest.raises(ValueError, match="DP_CONCURRENCY: expected an integer >= 1, got 'zero'"):
        events.default_concurrency()
    monkeypatch.setenv("DP_CONCURRENCY", "")
    monkeypatch.setenv("DP_MAX_BATCH", "0")  # one parser: events and the scheduler refuse it alike
    with pytest.raises(ValueError, match="DP_MAX_BATCH: expected an integer >= 1, got 0"):
        events.default_concurrency()


# --- downloads ----------------------------------------------------------------------------------


def test_downloads_live_in_one_directory_and_old_ones_are_deleted():
    import os
    from pathlib import Path

    first = Path(downloads.write_text("balanced.yaml", "a: 1\n"))
    second = Path(downloads.write_text("balanced.yaml", "a: 2\n"))
    assert first.name == second.name == "balanced.yaml" and first != second  # same name, no collision
    assert first.parent.parent == second.parent.parent == downloads.download_dir()
    old = time.time() - downloads.DOWNLOAD_TTL_S - 5
    os.utime(first.parent, (old, old))
    downloads.json_file("report.json", {"x": 1.5})
    assert not first.exists() and second.exists()  # writing a new file pruned the old one
    unknown = Path(downloads.json_file("unknown.json", {"x": float("nan"), "y": [float("inf"), 2.0]}))
    text = unknown.read_text()  # strict JSON only: what a run cannot know is null, never NaN / Infinity
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text, parse_constant=lambda name: pytest.fail(name)) == {"x": None, "y": [None, 2.0]}
    with pytest.raises(ValueError, match="name"):
        downloads.write_text("../escape.txt", "x")


# --- branching through the step view's own handler ----------------------------------------------


@pytest.fixture(scope="module")
def step_parts(registry, embedded):
    from playground.views import step

    shared = Shared(registry=registry, model=None, quantization=None, user_presets=None)
    out = step.Outputs(*step.Outputs.__dataclass_fields__)  # field names stand in for the components
    handlers = step.Handlers(shared, PanelView("step", None, None, None), out, None)
    config = DecodingConfig(strategy="sample", seed=5, max_new_tokens=6, temperature=0.8, top_k=20)
    parent = shared.run(embedded, "The sea is", config, chat=False, prompt_ids=embedded.encode("The sea is", False),
                        control=RunControl())
    return step, shared, out, handlers, parent


@pytest.mark.slow
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_branch_at_any_step_through_the_view_handler(step_parts, embedded, where):
    step, shared, out, handlers, parent = step_parts
    at = {"first": 0, "middle": len(parent.steps) // 2, "last": len(parent.steps) - 1}[where]
    token = next(t.token_id for t in parent.steps[at].stages[0].top if t.token_id != parent.generated_token_ids[at])
    session = step.StepSession(runs=[parent], owner="a" * 32)
    updates = list(handlers.on_branch("embedded", "none", "probability", session, "a" * 32, at, token,
                                      control=RunControl()))
    assert updates and out.status in updates[-1] and "done:" in updates[-1][out.status]
    branch = session.trace()
    assert branch.branch_of == at and len(session.runs) == 2
    assert branch.generated_token_ids[:at] == parent.generated_token_ids[:at]  # the kept prefix
    assert branch.generated_token_ids[at] == token and branch.steps[at].forced
    labels = [label for label, _ in updates[-1][out.runs]["choices"]]
    assert labels[1].startswith(f"#1 branch at step {at}:")
    # the same branch from the API function: same tokens (seeded), same JSON shape as the CLI's
    data = step.branch_trace(shared, parent.to_dict(), at, token, control=RunControl())
    assert data["generated_token_ids"] == branch.generated_token_ids and data["branch_of"] == at


def test_run_labels_while_a_branch_streams_in():
    from engine.trace import Timing, Trace
    from playground.views.step import _run_label

    partial = Trace("m", "sample", {}, "p", [1], "", [], "max_new_tokens", [], Timing(0, 0, 0), branch_of=3)
    assert _run_label(1, partial) == "#1 branch at step 3: …"  # no IndexError before the forced token arrives


def test_sessions_keep_a_bounded_number_of_runs():
    from engine.trace import Timing, Trace
    from playground.views.step import MAX_RUNS, StepSession

    session = StepSession()
    runs = [Trace("m", "sample", {}, f"p{i}", [1], "", [], "eos", [], Timing(0, 0, 0)) for i in range(MAX_RUNS + 3)]
    for run in runs:
        session.add(run)
    assert len(session.runs) == MAX_RUNS and session.runs[0] is runs[0]  # the original stays
    assert session.runs[-1] is runs[-1] and session.current == MAX_RUNS - 1
    assert not hasattr(session, "cache")  # no KV cache kept per session


def test_branch_api_rejects_a_bad_parent_naming_the_argument(registry, embedded):
    from playground.views.step import branch_trace

    shared = Shared(registry=registry, model=None, quantization=None, user_presets=None)
    with pytest.raises(UserError, match="parent: not a trace"):
        branch_trace(shared, "[1, 2]", 0, 5, control=RunControl())
    with pytest.raises(UserError, match="parent: not a trace"):
        branch_trace(shared, {"prompt": "x"}, 0, 5, control=RunControl())


def test_session_state_answers_only_its_own_page(step_parts):
    """A raw queue call naming another session's hash reaches its gr.State, but not its owner
    secret (kept in that page's browser storage): it can neither read nor replace its runs."""
    step, shared, out, handlers, parent = step_parts
    victim = step.StepSession(runs=[parent], owner="v" * 32)
    with pytest.raises(UserError, match="branch: generate a run first"):
        list(handlers.on_branch("embedded", "none", "probability", victim, "x" * 32, 0, 5, control=RunControl()))
    with pytest.raises(UserError, match="session: this session belongs to another page"):
        list(handlers.on_generate("hi", False, "embedded", "none", "probability", victim, "", control=RunControl()))
    assert step.own(victim, "x" * 32) is None and step.own(victim, None) is None
    assert step.own(victim, "v" * 32) is victim and len(victim.runs) == 1


def test_one_session_gets_at_most_its_runs_at_once():
    runs = events.SessionRuns(limit=2)
    with runs.slot("a"), runs.slot("a"):
        with pytest.raises(events.SessionBusy, match=r"runs: this page already has 2 runs in progress \(DP_RUNS_PER_SESSION\)"):
            with runs.slot("a"):
                pass
        with runs.slot("b"):  # another user is not affected
            assert runs.running("b") == 1
        assert runs.running("a") == 2
    assert runs.running("a") == 0
    with runs.slot("a"):  # the slots came back
        pass


def test_ui_updates_become_plain_rows_in_output_order():
    """What a ZeroGPU worker sends back must pickle: rows of values, never components."""
    import pickle

    a, b = gr.Textbox(), gr.Markdown()

    def handler(x, *, control):
        yield {b: f"got {x}"}

    agen = events.streamed(handler, lambda m: {a: m}, "generation", outputs=[a, b])("hi")
    rows = _drain(agen)
    assert rows == [[gr.skip(), "got hi"]]
    assert pickle.loads(pickle.dumps(rows)) == rows


def test_run_stopped_survives_the_trip_back_from_a_zerogpu_worker():
    """A ZeroGPU worker pickles its exception back: the reason and the user's message must survive."""
    import pickle

    from engine.control import RunStopped

    stop = pickle.loads(pickle.dumps(RunStopped("time_limit", "stopped: past the 5 s time limit")))
    assert isinstance(stop, RunStopped) and stop.reason == "time_limit"
    assert str(stop) == "stopped: past the 5 s time limit"


def test_sessions_kept_are_bounded(monkeypatch):
    """Gradio keeps a copy of the page config per session; DP_SESSIONS bounds how many (LRU)."""
    from playground.app import launch_kwargs

    monkeypatch.delenv("DP_SESSIONS", raising=False)
    assert launch_kwargs()["state_session_capacity"] == events.DEFAULT_SESSIONS == 500
    monkeypatch.setenv("DP_SESSIONS", "60")
    assert launch_kwargs()["state_session_capacity"] == 60
    monkeypatch.setenv("DP_SESSIONS", "-3")  # not a positive integer: refused, named
    with pytest.raises(ValueError, match="DP_SESSIONS: expected an integer >= 1, got -3"):
        launch_kwargs()


def test_errors_are_one_short_line_and_user_errors_log_no_traceback(caplog):
    """A 1 MB input echoed by a handler's message comes back (and is logged) as one line of at most
    MESSAGE_CHARS; a user error is logged without a traceback, a failure of ours with one."""
    import logging

    def refuses(shared: object, prompt: str, *, control: RunControl) -> dict:
        raise ValueError(f"prompt: not allowed:\n{prompt!r}")

    def breaks(shared: object, prompt: str, *, control: RunControl) -> dict:
        raise KeyError(prompt)

    huge = "x" * 1_000_000
    caplog.set_level(logging.INFO, logger="playground.events")
    with pytest.raises(gr.Error) as refused:
        run_async(events.api_endpoint(functools.partial(refuses, None), "run")(huge))
    assert refused.value.message.startswith("prompt: not allowed: 'xxx") and refused.value.print_exception is False
    assert len(refused.value.message) <= events.MESSAGE_CHARS and "\n" not in refused.value.message
    [record] = caplog.records
    assert record.exc_info is None and len(record.getMessage()) < 400 and "\n" not in record.getMessage()
    caplog.clear()
    with pytest.raises(gr.Error) as failed:
        run_async(events.api_endpoint(functools.partial(breaks, None), "run")(huge))
    assert failed.value.message.startswith("run failed: KeyError: 'xxx") and len(failed.value.message) <= events.MESSAGE_CHARS
    [record] = caplog.records
    assert record.levelno == logging.ERROR and record.exc_info is not None  # ours: the traceback is kept

    def handler(prompt: str, *, control: RunControl):
        yield {"out": "first"}
        raise ValueError(f"prompt: refused {prompt}")

    rows = run_async(_collect(events.streamed(handler, lambda message: {"status": message}, "generation"), huge))
    assert rows[0] == {"out": "first"} and rows[-1]["status"].startswith("prompt: refused xxx")
    assert len(rows[-1]["status"]) <= events.MESSAGE_CHARS


async def _collect(run, *args):
    return [update async for update in run(*args)]


def test_stop_cancels_only_that_pages_runs_and_the_run_ends_on_its_own_last_word(monkeypatch):
    """Stop reaches the run's control directly (session + event group): page A's Stop stops A's
    run within a step, page B's run and A's run of another event go on. After the press the page
    gets no more "generating…" updates, only the run's final one (merged with those held back)."""
    sessions = events.SessionRuns(limit=5)
    gate = {"A": __import__("threading").Event()}
    session_of = {}
    monkeypatch.setattr(events, "_session", lambda: session_of["now"])

    def handler(name: str, *, control: RunControl):
        for i in range(200):
            try:
                control.check()
            except RunStopped as stopped:
                yield {"status": f"{stopped} after {i}", "tokens": i}
                return
            yield {"status": f"generating… {i}", "tokens": i}
            if i == 3:
                gate[name].set() if name in gate else None
            time.sleep(0.01)
        yield {"status": "done"}

    step = events.streamed(handler, lambda m: {"status": m}, "generation", sessions=sessions, group="step")
    other = events.streamed(handler, lambda m: {"status": m}, "generation", sessions=sessions, group="beam")

    async def both():
        async def drive(run, session, name, stop_at=None):
            session_of["now"] = session
            rows = []
            async for row in run(name):
                rows.append(row)
                if stop_at is not None and row.get("tokens") == stop_at:
                    assert events.stop_runs([_Dep(sessions, "step")], "page-A") == 1
            return rows
        return await asyncio.gather(drive(step, "page-A", "A", stop_at=5), drive(step, "page-B", "B"),
                                    drive(other, "page-A", "C"))

    a, b, c = run_async(both())
    assert a[-1]["status"].startswith("stopped: the run was cancelled after") and a[-1]["tokens"] <= 7
    assert all(not row["status"].startswith("generating") for row in a[a.index(next(r for r in a if r.get("tokens") == 5)) + 1:])
    assert b[-1] == {"status": "done"} and c[-1] == {"status": "done"}  # another page, another event: untouched
    assert sessions.cancel("page-A", "step") == 0  # nothing left registered


class _Dep:
    def __init__(self, runs, group):
        self.dp_stop = (runs, group)


def test_held_rows_merge_arrays_and_frames_without_comparing_them():
    """Rows after Stop are merged by position (gr.skip() keeps the earlier value); values such as a
    DataFrame or an array are never compared with ``==`` (ambiguous truth value)."""
    import numpy as np
    import pandas as pd

    frame, array = pd.DataFrame({"a": [1, 2]}), np.arange(3)
    assert events.is_skip(gr.skip()) and not events.is_skip(frame) and not events.is_skip(array)
    assert not events.is_skip(gr.update(visible=False))
    row = events.merged([frame, "x", gr.skip()], [gr.skip(), array, "z"])
    assert row[0] is frame and row[1] is array and row[2] == "z"


def test_a_users_error_crosses_the_zerogpu_worker_with_its_message():
    """spaces sends only gr.Errors back from its worker process (pickled); the rest arrive as a class name.
    carrying_user_errors turns the user's errors into CarriedUserError, which keeps message and stop flag."""
    import pickle  # only to reproduce the worker's boundary in this test; the app never unpickles

    def refuses(kind):
        raise {"bad": ValueError("temperature: expected a number >= 0, got -1"),
               "stop": RunStopped("cancelled", "stopped"), "bug": KeyError("x")}[kind]

    def yields_then_refuses():
        yield 1
        raise UserError("prompt: empty")

    carried = events.carrying_user_errors(refuses)
    with pytest.raises(events.CarriedUserError) as bad:
        carried("bad")
    back = pickle.loads(pickle.dumps(bad.value))
    assert isinstance(back, gr.Error) and back.stopped is False
    assert events.error_message(back, "step") == "temperature: expected a number >= 0, got -1"
    with pytest.raises(events.CarriedUserError) as stopped:
        carried("stop")
    assert pickle.loads(pickle.dumps(stopped.value)).stopped is True
    with pytest.raises(KeyError):  # our own failures stay what they are (logged with a traceback)
        carried("bug")
    generator = events.carrying_user_errors(yields_then_refuses)
    assert inspect.isgeneratorfunction(generator)  # spaces picks its generator mode from this
    items = generator()
    assert next(items) == 1
    with pytest.raises(events.CarriedUserError, match="prompt: empty"):
        next(items)


def test_gradios_cancel_after_stop_waits_for_the_run_to_end():
    """Stop's chain gives the run's last update time to leave before Gradio's ``cancels`` fires: a
    fixed 2 s grace cut off a slow last update (a lane said "running…" for ever on a loaded page).
    ``settled`` returns once the session's runs of the events have ended, and never waits past its
    limit for a run that does not end."""
    import asyncio
    import threading

    sessions = events.SessionRuns(limit=5)

    class Event:  # a dependency as ModelEvents.on returns it
        dp_stop = (sessions, "step")

    ended = threading.Event()

    def settle(args: tuple, **kwargs) -> float:
        """``events.settled`` on an event loop of its own thread (the browser tests' Playwright keeps one
        running in the main thread: asyncio.run cannot start there)."""
        out: list = []
        waiter = threading.Thread(target=lambda: out.append(asyncio.run(events.settled(*args, **kwargs))))
        waiter.start()
        waiter.join()
        return out[0]

    def run(session: str, seconds: float) -> None:
        with sessions.slot(session, RunControl(), "step"):
            time.sleep(seconds)
        ended.set()

    def started(session: str) -> None:
        deadline = time.monotonic() + 10
        while not events.active_runs([Event()], session) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert events.active_runs([Event()], session) == 1

    threading.Thread(target=run, args=("a", 0.6), daemon=True).start()
    started("a")
    assert events.active_runs([Event()], "b") == 0
    waited = settle(([Event()], "a"))
    assert ended.is_set() and waited >= events.STOP_SENT_S, waited  # it waited for the run's end, then the update
    assert settle(([Event()], "b")) < events.STOP_SENT_S + 2.0  # no run: at once
    threading.Thread(target=run, args=("a", 30.0), daemon=True).start()
    started("a")
    assert settle(([Event()], "a"), limit_s=0.3) < 0.3 + events.STOP_SENT_S + 5.0  # bounded


def test_a_stopped_run_counts_as_running_until_gradio_has_taken_its_last_word(monkeypatch):
    """Stop's chain fires Gradio's ``cancels`` once the session's runs have ended (``settled``). A run
    stopped mid-way ends on one held update ("stopped after N"); it must still count as running
    until Gradio has taken that update, or the cancel could cut it off: a Compare lane then said
    "running… 154 / 256 tokens" for ever after Stop (CI, the whole suite, a loaded page)."""
    import threading

    sessions = events.SessionRuns(limit=5)
    monkeypatch.setattr(events, "_session", lambda: "page-A")
    stopped_at = threading.Event()

    def handler(*, control: RunControl):
        for i in range(500):
            try:
                control.check()
            except RunStopped:
                yield {"status": f"stopped after {i}"}
                return
            yield {"status": f"running… {i}"}
            if i == 3:
                stopped_at.set()
            time.sleep(0.01)

    run = events.streamed(handler, lambda m: {"status": m}, "generation", sessions=sessions, group="cmp")

    async def drive():
        agen, rows = run(), []
        while not stopped_at.is_set():
            rows.append(await agen.__anext__())
        assert events.stop_runs([_Dep(sessions, "cmp")], "page-A") == 1  # the Stop press
        while not rows[-1]["status"].startswith("stopped"):
            rows.append(await agen.__anext__())
            # Until Gradio asks for the update after the last word, the run is still in progress.
            assert events.active_runs([_Dep(sessions, "cmp")], "page-A") == 1, rows[-1]
        with pytest.raises(StopAsyncIteration):
            await agen.__anext__()
        assert events.active_runs([_Dep(sessions, "cmp")], "page-A") == 0
        return rows

    rows = run_async(drive())
    assert rows[-1]["status"].startswith("stopped after") and not any(
        r["status"].startswith("running") for r in rows[rows.index(rows[-1]):])

    busy = events.SessionRuns(limit=1)  # a refused slot is still one clear update, not a crash
    with busy.slot("page-A", RunControl(), "cmp"):
        refused = _drain(events.streamed(handler, lambda m: {"status": m}, "generation", sessions=busy, group="cmp")())
    assert len(refused) == 1 and "runs in progress" in refused[0]["status"], refused


def test_stop_cancels_through_gradio_only_what_waits_in_its_queue():
    """Stop's chain sends Gradio's ``cancels`` only for a run of the page still queued (or stuck):
    ``waiting_runs`` counts the session's jobs of the Stop's events in Gradio's queue, by the
    event's function id, and no other page's or other event's."""
    from types import SimpleNamespace as NS

    from gradio.context import LocalContext

    def job(session: str, fn_id: int):
        return NS(session_hash=session, fn=NS(_id=fn_id))

    line = NS(queue=[job("page-A", 7), job("page-A", 9), job("page-B", 7), job("page-A", 7)])
    blocks = NS(_queue=NS(event_queue_per_concurrency_id={"model": line, "default": NS(queue=[job("page-A", 3)])}))
    run_event, other_event = {"id": 7}, {"id": 3}
    token = LocalContext.blocks.set(blocks)
    try:
        assert events.waiting_runs([run_event], "page-A") == 2
        assert events.waiting_runs([run_event, other_event], "page-A") == 3
        assert events.waiting_runs([run_event], "page-C") == 0
        line.queue.clear()  # started or gone: nothing for Gradio to cancel
        assert events.waiting_runs([run_event], "page-A") == 0
    finally:
        LocalContext.blocks.reset(token)
    assert events.waiting_runs([run_event], "page-A") == 0  # outside a request: no queue
    error = events.NothingToCancel()
    assert isinstance(error, gr.Error) and error.visible is False  # the chain stops without a toast
    with gr.Blocks() as demo:  # a real event's dependency names its function's id as a queued job's fn has it
        box = gr.Textbox()
        dependency = gr.on([box.submit], lambda text: text, box, box)
    assert {f._id for f in demo.fns.values()} == {dependency["id"]}
