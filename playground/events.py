"""The one place that registers events touching the model: the queue, one concurrency id and
limit, ZeroGPU wrapping, a per-request RunControl (cancellation + time limit) and the error guard.

**Local and served runs have separate slots** (``ModelSlots``). A run on a model loaded here takes
one of ``DP_CONCURRENCY`` local slots; a run on a served model (``DP_REMOTE_MODELS``) one of
``DP_SERVED_CONCURRENCY`` served slots; Gradio's limit for model events is their sum. A run takes
its slot when it resolves its model (``claim_model_slot``, called by ``Shared.lm``): a local run
waits for a free local slot (checking its control: Stop and the time limit still end it); a
served run never waits, and one more than the served slots is refused in one line. So however
many served runs are stuck on a slow server, they hold at most ``DP_SERVED_CONCURRENCY`` of
Gradio's slots, never a local one, and a local user is served as fast as without them. (The
wait is in the run's worker thread: Gradio's thread pool is sized for both pools, see
``thread_budget``.) A presenter's run (``RunControl.priority``) whose local slots are all taken by
the room takes the one kept for it (``PRESENTER_ROWS``, as the scheduler keeps a row), so it never
waits for a room's run to end.

The run's RunControl is the active control (``engine.control``) in its worker thread while it
runs: a served model's requests take their deadline from it, and its cancel (Stop, a closed tab,
a cancelled API job) shuts their sockets at once. API results are strict JSON (``finite``: a NaN
or infinity a run could not know, e.g. an echoed parent trace's, becomes null).

A model handler is a plain generator function of its input values plus a keyword-only
``control: RunControl``; it yields ``{component: value}`` updates and calls the runner with
``control``, which raises RunStopped within one step once the control is cancelled. The control is
cancelled when the run's generator is closed, its task is cancelled (Stop, a cancelled
gradio_client job) or Gradio stops iterating it after the client disconnected.

An API function is a plain function of typed arguments plus ``control``, returning JSON; errors
reach the client as one-line ``gr.Error`` messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import importlib.util
import inspect
import itertools
import logging
import threading
import time
import typing
from typing import Any, Callable, Iterator

import anyio
import gradio as gr
import torch

from engine.config import ConfigError, check_arguments
from engine.control import RunControl, RunStopped, run_under
from engine.backends.local import ModelLoadError
from engine.presets import PresetError
from engine.backends.client import RemoteError
from engine.scheduler import PRESENTER_ROWS, default_max_batch
from engine.settings import env_int, on_space
from engine.sharelink import ShareLinkError
from engine.trace import finite

MODEL_CONCURRENCY_ID = "model"
# Bad input and stopped runs: their message is shown as is. Anything else is a failure of ours.
DEFAULT_RUNS_PER_SESSION = 3
# A served model's RemoteError (engine.backends) names its server and what went wrong: shown as is too.
USER_ERRORS = (ValueError, ConfigError, ModelLoadError, PresetError, ShareLinkError, RunStopped, RemoteError)
# A served model's RemoteError is the server's fault, not ours: logged as one line, never with a traceback.
_DONE = object()
SKIP = gr.skip()
log = logging.getLogger(__name__)


def max_batch() -> int:
    """The batched scheduler's batch size: env ``DP_MAX_BATCH``, default 16 on CPU, 32 on GPU."""
    return default_max_batch(torch.device("cuda" if torch.cuda.is_available() else "cpu"))


DEFAULT_SESSIONS = 500


def session_capacity() -> int:
    """How many browser/API sessions the server keeps state for (env ``DP_SESSIONS``, default 500);
    the least recently used is dropped beyond it. Gradio keeps a copy of the page's configuration
    per session (about 1.5 MB for this app, measured by ``bench.sessions``), and its own default
    (10,000 sessions) would let a public deployment grow to ~15 GB."""
    return env_int("DP_SESSIONS", DEFAULT_SESSIONS)


def default_concurrency() -> int:
    """How many model events run at once: env ``DP_CONCURRENCY``, default the scheduler's batch
    size (greedy/sampling runs share batched forwards, so more than one per core pays off)."""
    return env_int("DP_CONCURRENCY", 0) or max_batch()


DEFAULT_SERVED_CONCURRENCY = 16
SLOT_POLL_S = 0.1  # how often a run waiting for a local slot checks its control


def served_concurrency() -> int:
    """How many runs on served models run at once (env ``DP_SERVED_CONCURRENCY``, default 16),
    besides the local ones: each mostly waits on its server's network, so a thread each is cheap."""
    return env_int("DP_SERVED_CONCURRENCY", DEFAULT_SERVED_CONCURRENCY)


def thread_budget(local: int, served: int) -> int:
    """Worker threads Gradio's pool needs (``launch(max_threads=...)``): one per model event of
    either pool, and Gradio's own 40 for everything else."""
    return local + served + 40


class ServedBusy(ValueError):
    """Every served slot is taken (``DP_SERVED_CONCURRENCY``)."""


class ModelSlots:
    """The pools of model-event slots: ``local`` (runs on models loaded here), ``served`` (runs on
    a served model) and ``presenter`` (local slots only a presenter's run takes, when every local
    one is busy). See the module doc."""

    def __init__(self, local: int, served: int, presenter: int = PRESENTER_ROWS):
        self.limits = {"local": local, "served": served, "presenter": presenter}
        self._free = {kind: threading.BoundedSemaphore(n) for kind, n in self.limits.items()}

    def acquire(self, kind: str, control: RunControl) -> str:
        """Take a ``kind`` slot and return the pool it came from: a local one waits (its control
        checked every SLOT_POLL_S; a presenter's run takes a ``presenter`` slot instead when one is
        free); a served one is refused at once (ServedBusy) when none is free."""
        free = self._free[kind]
        if kind == "served":
            if not free.acquire(blocking=False):
                raise ServedBusy(f"served models: {self.limits['served']} runs already use them "
                                 "(DP_SERVED_CONCURRENCY); try again in a moment")
            return kind
        while not free.acquire(timeout=SLOT_POLL_S):
            if control.priority and self._free["presenter"].acquire(blocking=False):
                return "presenter"
            control.check()
        return kind

    def release(self, kind: str) -> None:
        self._free[kind].release()

    def in_use(self, kind: str) -> int:
        """Slots of ``kind`` held now (for tests and the bench)."""
        return self.limits[kind] - self._free[kind]._value


class RunSlots:
    """The slots one run holds (at most one of each kind), released when the run ends."""

    def __init__(self, pool: ModelSlots, control: RunControl):
        self.pool, self.control = pool, control
        self._held: set[str] = set()
        self._lock = threading.Lock()

    def claim(self, served: bool) -> None:
        kind = "served" if served else "local"
        with self._lock:
            if kind in self._held or (kind == "local" and "presenter" in self._held):
                return
        taken = self.pool.acquire(kind, self.control)
        with self._lock:
            self._held.add(taken)

    def release(self) -> None:
        with self._lock:
            held, self._held = self._held, set()
        for kind in held:
            self.pool.release(kind)


_RUN_SLOTS: contextvars.ContextVar[RunSlots | None] = contextvars.ContextVar("run_slots", default=None)


def claim_model_slot(served: bool) -> None:
    """The run this thread works for takes a slot of its model's kind (once per kind; no-op
    outside a model event). Called where a run resolves its model (``Shared.lm``)."""
    slots = _RUN_SLOTS.get()
    if slots is not None:
        slots.claim(served)


def in_run(slots: RunSlots | None, control: RunControl, fn: Callable, *args: Any) -> Any:
    """``fn(*args)`` in the run's worker thread, with its slots and its control active."""
    token = _RUN_SLOTS.set(slots)
    try:
        return run_under(control, fn, *args)
    finally:
        _RUN_SLOTS.reset(token)


def zero_gpu_active() -> bool:
    """Whether this is a ZeroGPU Space (``zero_gpu`` wraps model events there)."""
    if not on_space():
        return False
    return importlib.util.find_spec("spaces") is not None


def zero_gpu(fn: Callable) -> Callable:
    """On a ZeroGPU Space (SPACE_ID set and ``spaces`` importable) ``fn`` runs under
    ``spaces.GPU(duration=...)`` (the request time limit, env ``DP_GPU_SECONDS``, default 120 s);
    everywhere else ``fn`` is returned unchanged."""
    if not on_space():
        return fn
    try:
        import spaces
    except ImportError:
        return fn
    return spaces.GPU(duration=env_int("DP_GPU_SECONDS", 120))(carrying_user_errors(fn))


class CarriedUserError(gr.Error):
    """A user's error raised inside a ZeroGPU worker. ``spaces`` sends only ``gr.Error``s back from
    its worker process with their message (any other exception arrives as "ZeroGPU worker error:
    <class name>"), so the worker raises this, keeping the message and whether the run was stopped."""

    def __init__(self, message: str, stopped: bool = False):
        super().__init__(message, print_exception=False)
        self.stopped = stopped

    def __reduce__(self):  # crosses the process boundary as its message and flag
        return (CarriedUserError, (self.message, self.stopped))


def carrying_user_errors(fn: Callable) -> Callable:
    """``fn`` (a function or a generator function) with USER_ERRORS raised as CarriedUserError."""

    def carried(exc: Exception) -> CarriedUserError:
        return CarriedUserError(str(exc), stopped=isinstance(exc, RunStopped))

    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def generator(*args: Any, **kwargs: Any) -> Iterator[Any]:
            try:
                yield from fn(*args, **kwargs)
            except USER_ERRORS as exc:
                raise carried(exc) from None
        return generator

    @functools.wraps(fn)
    def function(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except USER_ERRORS as exc:
            raise carried(exc) from None
    return function


MESSAGE_CHARS = 280  # an error message is one line of at most this many characters


def one_line(text: str, limit: int = MESSAGE_CHARS) -> str:
    """``text`` on one line (newlines and runs of spaces become one space), cut to ``limit``
    characters with an ellipsis: a message never echoes a whole 1 MB input back."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def error_message(exc: Exception, what: str) -> str:
    """The one-line message a failed handler shows: the user's own error as is, else what failed.
    User errors are logged as that one line; a failure of ours is logged with its traceback."""
    if isinstance(exc, (*USER_ERRORS, CarriedUserError)):
        message = one_line(exc.message if isinstance(exc, CarriedUserError) else str(exc))
        log.info("%s refused: %s", what, message)
        return message
    message = one_line(f"{what} failed: {type(exc).__name__}: {exc}")
    log.error("%s", message, exc_info=exc)
    return message


class SessionBusy(ValueError):
    """A session asked for more model requests at once than ``DP_RUNS_PER_SESSION`` allows."""


class SessionRuns:
    """Model requests in flight per session (a browser tab or an API client): at most ``limit``
    (env ``DP_RUNS_PER_SESSION``, default 3), so one page cannot take every row of the batch.
    It also keeps each run's RunControl under its event group, so a Stop button cancels that
    session's runs directly (``cancel``), within one step of the press."""

    def __init__(self, limit: int | None = None):
        self.limit = limit or env_int("DP_RUNS_PER_SESSION", DEFAULT_RUNS_PER_SESSION)
        self._lock = threading.Lock()
        self._running: dict[str, int] = {}
        self._controls: dict[tuple[str, str], list[RunControl]] = {}

    @contextlib.contextmanager
    def slot(self, session: str | None, control: RunControl | None = None, group: str | None = None) -> Iterator[None]:
        if not session:
            yield
            return
        key = (session, group or "")
        with self._lock:
            if self._running.get(session, 0) >= self.limit:
                raise SessionBusy(f"runs: this page already has {self.limit} runs in progress (DP_RUNS_PER_SESSION); "
                                  "wait for one to finish or press Stop")
            self._running[session] = self._running.get(session, 0) + 1
            if control is not None:
                self._controls.setdefault(key, []).append(control)
        try:
            yield
        finally:
            with self._lock:
                self._running[session] -= 1
                if not self._running[session]:
                    del self._running[session]
                if control is not None:
                    self._controls[key].remove(control)
                    if not self._controls[key]:
                        del self._controls[key]

    def active(self, session: str | None, group: str) -> int:
        """How many runs of ``session`` in event ``group`` are still in progress."""
        with self._lock:
            return len(self._controls.get((session or "", group), ()))

    def running(self, session: str) -> int:
        with self._lock:
            return self._running.get(session, 0)

    def cancel(self, session: str | None, group: str) -> int:
        """Cancel the runs of ``session`` in event ``group``; returns how many were running."""
        with self._lock:
            controls = list(self._controls.get((session or "", group), ()))
        for control in controls:
            control.cancel()
        return len(controls)


WATCH_S = 0.5  # how often a run checks that its client is still there


def _active_event(queue: Any, event_id: str) -> Any:
    for jobs in getattr(queue, "active_jobs", ()):
        for event in jobs or ():
            if getattr(event, "_id", None) == event_id:
                return event
    return None


def _gradio_queue() -> Any:
    """The queue of the Blocks handling this request (Gradio's private ``_queue``; None outside a
    request). The one place this module reads it: ``watch_client`` and ``waiting_runs``."""
    from gradio.context import LocalContext

    return getattr(LocalContext.blocks.get(None), "_queue", None)


async def watch_client(control: RunControl) -> None:
    """Cancel ``control`` once the request's client has gone (a closed tab, a dropped
    ``/gradio_api/call/...`` result stream). Gradio notices a closed stream only when it next writes
    to it, and then just marks the job not alive (a running function goes on); so while the run
    lasts this sends the client a heartbeat every WATCH_S (clients skip them) and cancels the run
    once Gradio has marked it dead."""
    from gradio.context import LocalContext
    from gradio.server_messages import HeartbeatMessage

    queue = _gradio_queue()
    event_id = LocalContext.event_id.get(None)
    if queue is None or not event_id:
        return
    while not control.cancelled:
        await asyncio.sleep(WATCH_S)
        event = _active_event(queue, event_id)
        if event is None:
            continue
        if not event.alive:
            control.cancel()
            return
        messages = queue.pending_messages_per_session.get(event.session_hash)
        if messages is not None:
            messages.put_nowait(HeartbeatMessage())


@contextlib.asynccontextmanager
async def watched(control: RunControl):
    """``watch_client`` for the duration of the block."""
    watcher = asyncio.ensure_future(watch_client(control))
    try:
        yield
    finally:
        watcher.cancel()


def _session() -> str | None:
    """The session hash of the request being handled (Gradio sets it in its LocalContext before it
    runs or resumes a handler; ChatInterface reads it the same way). None outside a request."""
    from gradio.context import LocalContext

    request = LocalContext.request.get(None)
    return getattr(request, "session_hash", None)


def toast_text(message: str) -> str:
    """A message for a toast, which renders HTML: no tag the user's input put in it survives
    (``<`` becomes ``&lt;``, so ``<a href=...>`` shows as text, not as a link)."""
    return message.replace("<", "&lt;")


def _without_control(fn: Callable, wrapper: Any) -> Callable:
    """``wrapper`` presented to Gradio with ``fn``'s name, doc, signature and type hints, minus
    the ``control`` parameter the wrapper supplies itself (``fn`` may be a functools.partial)."""
    target = fn.func if isinstance(fn, functools.partial) else fn
    try:
        hints = typing.get_type_hints(target)
    except (NameError, TypeError):
        hints = {}
    signature = inspect.signature(fn)
    params = [p.replace(annotation=hints.get(p.name, p.annotation))
              for p in signature.parameters.values() if p.name != "control"]
    wrapper.__signature__ = signature.replace(parameters=params,
                                              return_annotation=hints.get("return", signature.return_annotation))
    wrapper.__annotations__ = {k: v for k, v in hints.items() if k != "control" and k in
                               {p.name for p in params} | {"return"}}
    wrapper.__name__ = wrapper.__qualname__ = target.__name__
    wrapper.__doc__ = target.__doc__
    wrapper.__module__ = target.__module__
    return wrapper


def _next(updates: Iterator) -> Any:
    return next(updates, _DONE)


def is_skip(value: Any) -> bool:
    """Whether a row's value is ``gr.skip()`` (compared only as a dict: a DataFrame or an array
    would answer ``==`` element by element)."""
    return type(value) is dict and value == SKIP


def merged(earlier: Any, later: Any) -> Any:
    """Two updates as one, ``later`` winning: dicts by component, rows (lists) by position where
    ``later`` is not ``gr.skip()``."""
    if earlier is None:
        return later
    if isinstance(later, dict):
        return {**earlier, **later}
    return [old if is_skip(new) else new for old, new in zip(earlier, later)]


def as_rows(handler: Callable[..., Iterator[dict]], outputs: list) -> Callable[..., Iterator[list]]:
    """``handler`` with each ``{component: value}`` update turned into a list of plain values in
    ``outputs`` order (``gr.skip()`` for the untouched ones). Components cannot be pickled, and on
    ZeroGPU everything a handler yields crosses a process boundary."""

    def rows(*args: Any, **kwargs: Any) -> Iterator[list]:
        for update in handler(*args, **kwargs):
            yield [update.get(component, gr.skip()) for component in outputs]

    return rows


def streamed(handler: Callable[..., Iterator[dict]], on_error: Callable[..., dict], what: str,
             outputs: list | None = None, sessions: SessionRuns | None = None, group: str | None = None,
             slots: ModelSlots | None = None) -> Callable:
    """An async generator for Gradio that drives ``handler`` in a worker thread. Cancelling the
    task (or closing the generator) cancels the run's control at once, so the thread stops at its
    next step even though Gradio never resumes it. With ``outputs``, updates are yielded as lists
    in that order (see ``as_rows``), errors too. The run's control is kept in ``sessions`` under
    ``group``, for ``stop_button``; its model slot is taken from ``slots`` (None: no pools)."""
    gpu_handler = zero_gpu(as_rows(handler, outputs) if outputs is not None else handler)

    def error(exc: Exception, touched: set[int]) -> Any:
        # the output(s) that say the message (stale.cleared's status; a tuple: the lesson's overlay too)
        says = getattr(on_error, "status", None)
        says = says if isinstance(says, tuple) else (says,)
        stopped = isinstance(exc, RunStopped) or getattr(exc, "stopped", False)  # (CarriedUserError: from ZeroGPU)
        if stopped and says[0] is not None:  # a stopped run keeps what it showed
            update = on_error(error_message(exc, what), stopped=True)
            update = {c: v for c, v in update.items() if any(c is s for s in says) or id(c) not in touched}
        else:
            update = on_error(error_message(exc, what))
        return update if outputs is None else [update.get(component, gr.skip()) for component in outputs]

    def shown(update: Any) -> set[int]:
        """The outputs an update sets (ids of their components)."""
        if isinstance(update, dict):
            return {id(c) for c in update}
        return {id(c) for c, value in zip(outputs or (), update) if not is_skip(value)}

    sessions = sessions or SessionRuns()

    async def run(*args: Any, **kwargs: Any):
        control = RunControl.with_request_limit()
        run_slots = RunSlots(slots, control) if slots is not None else None
        held = None  # after Stop: the run's updates merged, sent as its last word (no "generating…" after "stopped")
        touched: set[int] = set()  # outputs this run has set: a stopped run's on_error leaves them as they are
        try:
            async with watched(control):
                with sessions.slot(_session(), control, group):
                    try:
                        updates = gpu_handler(*args, control=control, **kwargs)
                        while (update := await anyio.to_thread.run_sync(in_run, run_slots, control, _next, updates,
                                                                         abandon_on_cancel=True)) is not _DONE:
                            touched |= shown(update)
                            if control.cancelled:
                                held = merged(held, update)
                                continue
                            yield update
                    except Exception as exc:  # the page shows the message; it never crashes
                        held = merged(held, error(exc, touched))
                    finally:
                        control.cancel()
                        if run_slots is not None:
                            run_slots.release()
                    if held is not None:
                        # Still in the session's slot: Stop's ``settled`` waits until Gradio has taken this
                        # last word (it asks for the next update only once this one is on its way), so
                        # Gradio's cancel that follows can no longer cut it off.
                        yield held
        except Exception as exc:  # the session's slot refused (SessionBusy): the page shows why
            yield error(exc, touched)

    return _without_control(handler, run)


def api_endpoint(fn: Callable[..., Any], what: str, uses_model: bool = True,
                 sessions: SessionRuns | None = None, slots: ModelSlots | None = None) -> Callable:
    """An async API function for ``gr.api`` that runs ``fn`` in a worker thread with its own
    RunControl (cancelled with the request's task) and its model slot (from ``slots``); its
    result is strict JSON (``finite``); errors become one-line ``gr.Error``s.
    ``uses_model=False``: ``fn`` takes no ``control`` and needs no GPU."""
    gpu_fn = zero_gpu(fn) if uses_model else fn

    sessions = sessions or SessionRuns()

    async def endpoint(*args: Any, **kwargs: Any) -> Any:
        session = _session()
        control = RunControl.with_request_limit()
        run_slots = RunSlots(slots, control) if slots is not None and uses_model else None
        extra = {"control": control} if uses_model else {}
        call = functools.partial(gpu_fn, *args, **extra, **kwargs)
        try:
            check_arguments(fn, args, kwargs)  # types and nesting as annotated: "no" and NaN are not booleans
            async with watched(control):
                with sessions.slot(session if uses_model else None):
                    return finite(await anyio.to_thread.run_sync(in_run, run_slots, control, call,
                                                                 abandon_on_cancel=True))
        except Exception as exc:
            raise gr.Error(toast_text(error_message(exc, what)), print_exception=False) from None
        finally:
            control.cancel()
            if run_slots is not None:
                run_slots.release()

    return _without_control(fn, endpoint)


class ModelEvents:
    """Registers model events: every one shares one queue concurrency id, whose limit is the local
    slots (``concurrency_limit``) plus the served ones (``served_limit``) and the presenter's; each
    run then takes a slot of its model's kind (``slots``, see the module doc)."""

    def __init__(self, concurrency_limit: int | None = None, sessions: SessionRuns | None = None,
                 served_limit: int | None = None):
        self.concurrency_limit = concurrency_limit or default_concurrency()
        self.served_limit = served_limit or served_concurrency()
        self.slots = ModelSlots(self.concurrency_limit, self.served_limit)
        self.sessions = sessions or SessionRuns()
        self._groups = itertools.count()

    @property
    def _queue(self) -> dict[str, Any]:
        return {"concurrency_id": MODEL_CONCURRENCY_ID,
                "concurrency_limit": self.concurrency_limit + self.served_limit + PRESENTER_ROWS}

    @property
    def threads(self) -> int:
        """Gradio's worker threads this app needs (``thread_budget``)."""
        return thread_budget(self.concurrency_limit + PRESENTER_ROWS, self.served_limit)

    def on(self, triggers: list, handler: Callable[..., Iterator[dict]], inputs: list, outputs: list, *,
           on_error: Callable[[str], dict], what: str = "generation", js: str | None = None) -> Any:
        """Register ``handler`` (a generator of ``{component: value}`` updates taking ``control``)
        for every trigger (e.g. ``[button.click, prompt.submit]``); UI-only, not an API endpoint.
        ``js``: the page's function of the inputs, run as the event is sent (its result is sent).
        Returns the dependency, for ``stop_button``."""
        group = f"event-{next(self._groups)}"
        dependency = gr.on(triggers, streamed(handler, on_error, what, outputs, self.sessions, group, self.slots),
                           inputs, outputs, api_visibility="private", js=js, **self._queue)
        dependency.dp_stop = (self.sessions, group)
        return dependency

    def api(self, fn: Callable[..., Any], api_name: str, what: str = "generation") -> Any:
        """A named API endpoint returning JSON (``fn`` takes typed arguments and ``control``)."""
        return gr.api(api_endpoint(fn, what, sessions=self.sessions, slots=self.slots), api_name=api_name,
                      **self._queue)


def data_api(fn: Callable[..., Any], api_name: str, what: str = "request") -> Any:
    """A named API endpoint that never touches the model (presets, share links): the same error
    guard, no model queue."""
    return gr.api(api_endpoint(fn, what, uses_model=False), api_name=api_name)


def stop_runs(events: list, session: str | None) -> int:
    """Cancel ``session``'s runs of ``events`` (dependencies from ``ModelEvents.on``) at once."""
    return sum(runs.cancel(session, group) for runs, group in _run_groups(events))


STOP_SETTLE_S = 30.0  # after Stop, how long a running run's own last update may take before Gradio's cancel
STOP_SENT_S = 0.3  # after the run ended: Gradio's queue has its last update (taken before the run ends)


class NothingToCancel(gr.Error):
    """Stop's chain ends here: every run of the session ended on its own last word and none waits
    in the queue, so Gradio's ``cancels`` (which would drop a word still on its way) is not sent."""

    def __init__(self) -> None:
        super().__init__("nothing left to cancel", visible=False, print_exception=False)


def stop_button(button: gr.Button, status: Any, events: list, message: Any = "stopped",
                run_says: bool = False) -> None:
    """Stop: cancels this page's runs of ``events`` directly (each stops within one step and ends
    on its own "stopped" update, after any update already on its way). Gradio's ``cancels`` follows
    only where it is needed: a run of this page still waiting in the queue (it is taken off), or one
    that did not end within STOP_SETTLE_S. A cancel sent after a run had ended could still drop
    that run's last word on the page (the browser ignores what reaches it for a cancelled event):
    on a loaded page a Compare lane said "running… 31 / 256 tokens" for ever after Stop.
    ``status``: one output or a list; ``message``: what they show at once, or a function of their
    shown values returning that. ``run_says``: a cancelled run says "stopped" itself at once
    (Compare: within 50 ms), so the press shows ``message`` only when no run was cancelled; its
    reply could otherwise reach the page after the run's own last word and hide it. Not an API
    endpoint."""
    outputs = status if isinstance(status, list) else [status]

    async def stop(*shown: Any) -> Any:  # on the event loop: no wait for a worker thread
        if stop_runs(events, _session()) and run_says:
            return SKIP if len(outputs) == 1 else [SKIP] * len(outputs)
        return message(*shown) if callable(message) else message

    async def settle() -> None:
        session = _session()
        await settled(events, session)
        if not active_runs(events, session) and not waiting_runs(events, session):
            raise NothingToCancel()

    stop.__name__ = getattr(message, "__name__", "stop") if callable(message) else "stop"
    private: dict[str, Any] = {"queue": False, "api_visibility": "private"}
    button.click(stop, outputs if callable(message) else None, outputs, **private).then(
        settle, None, None, **private).success(None, None, None, cancels=events, **private)


async def settled(events: list, session: str | None, limit_s: float | None = None) -> float:
    """Wait until ``session``'s runs of ``events`` have ended and their last update has left
    (STOP_SETTLE_S at most, ``limit_s`` where given); returns the seconds waited."""
    start = time.monotonic()
    deadline = start + (STOP_SETTLE_S if limit_s is None else limit_s)
    while time.monotonic() < deadline and active_runs(events, session):
        await asyncio.sleep(0.05)
    await asyncio.sleep(STOP_SENT_S)  # the run's last update, yielded as its slot closed, reaches Gradio's queue
    return time.monotonic() - start


def waiting_runs(events: list, session: str | None) -> int:
    """How many of ``session``'s runs of ``events`` wait in Gradio's queue, not started yet (an
    event's dependency carries its function's id as ``"id"``; a queued job its function as ``fn``)."""
    queue = _gradio_queue()
    ids = {event.get("id") for event in events if isinstance(event, dict)}
    lines = list(getattr(queue, "event_queue_per_concurrency_id", {}).values())
    return sum(1 for line in lines for job in list(line.queue)
               if job.session_hash == session and getattr(job.fn, "_id", None) in ids)


def active_runs(events: list, session: str | None) -> int:
    """How many of ``session``'s runs of ``events`` are still in progress."""
    return sum(runs.active(session, group) for runs, group in _run_groups(events))


def _run_groups(events: list) -> Iterator[tuple[SessionRuns, str]]:
    """(the runs, the event group) of each of ``events`` that ``ModelEvents.on`` registered."""
    for event in events:
        runs, group = getattr(event, "dp_stop", (None, None))
        if runs is not None and group is not None:
            yield runs, group
