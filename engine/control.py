"""RunControl: the cancellation flag and time limit that every model loop checks once per step.

A run ends early for two reasons: its user cancelled it (Stop, a closed tab, a cancelled API job)
or it ran past the per-request time limit. Loops call ``control.check()`` once per forward; it
raises ``RunStopped`` naming the reason, so a cancelled run frees its slot within one step.

A run that waits on something outside this process (a served model's HTTP request) cannot check
between forwards, so the control also carries:

- **its deadline** (``deadline()``: a ``time.monotonic()`` instant, ``remaining()``: seconds left),
  from which such a wait derives its own timeouts, so a blocked read ends when the run's time is up;
- **closers** (``on_cancel(closer)`` returns a function that unregisters it): ``cancel()``, from
  any thread, calls each registered closer once (e.g. shutting down an open socket), so a run
  blocked in a read stops at once instead of at its next step. A closer registered after the
  cancel is called at once. Closers must be quick and must not raise (an exception is logged);
- **the active control** (``active_control()``): the control of the run the current thread is
  working for, set around each step by ``under`` / ``run_under`` (``engine.runner.stream`` and the
  playground's event helper use them), so code deep below a run (the HTTP client) finds the
  deadline and registers its closer without every signature passing the control down.
"""

from __future__ import annotations

import contextvars
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, TypeVar

from engine.settings import env_seconds

DEFAULT_REQUEST_SECONDS = 120.0
T = TypeVar("T")
log = logging.getLogger(__name__)


TIME_LIMIT_ADVICE = "ask for fewer tokens"  # the time limit's advice (a lesson, whose runs are fixed, gives its own)


def request_seconds() -> float:
    """The per-request time limit in seconds (env ``DP_REQUEST_SECONDS``, default 120; 0 = none)."""
    return env_seconds("DP_REQUEST_SECONDS", DEFAULT_REQUEST_SECONDS)


class RunStopped(RuntimeError):
    """A run was stopped before it finished. ``reason``: "cancelled" | "time_limit"."""

    def __init__(self, reason: str, message: str):
        self.reason = reason
        super().__init__(message)

    def __reduce__(self):
        """Picklable with its reason and message (a ZeroGPU worker sends its exceptions back pickled)."""
        return type(self), (self.reason, str(self))


@dataclass
class RunControl:
    """Shared between the run's owner (who may cancel) and the loop (which checks).
    ``deadline_s``: seconds from creation after which ``check`` raises; None or 0 means no limit."""

    deadline_s: float | None = None
    started: float = field(default_factory=time.monotonic)
    priority: bool = False  # a presenter's run: the scheduler queues it first and gives it its reserved row
    _cancelled: threading.Event = field(default_factory=threading.Event, repr=False)
    _closers: dict[int, Callable[[], None]] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _keys: Iterator[int] = field(default_factory=itertools.count, repr=False)

    def __getstate__(self) -> dict:
        """A copy for another process (a ZeroGPU worker gets its arguments pickled): the deadline
        and the start travel, the flag does not (a cancel reaches that process only through its
        own deadline; ``threading.Event`` cannot be pickled); nor do closers (they close this
        process's sockets)."""
        return {"deadline_s": self.deadline_s, "started": self.started, "cancelled": self.cancelled,
                "priority": self.priority}

    def __setstate__(self, state: dict) -> None:
        self.deadline_s, self.started = state["deadline_s"], state["started"]
        self.priority = bool(state.get("priority", False))
        self._cancelled = threading.Event()
        self._closers, self._lock, self._keys = {}, threading.Lock(), itertools.count()
        if state["cancelled"]:
            self._cancelled.set()

    @classmethod
    def with_request_limit(cls) -> "RunControl":
        """A control with the deployment's per-request time limit (``DP_REQUEST_SECONDS``)."""
        return cls(deadline_s=request_seconds() or None)

    def cancel(self) -> None:
        """Set the flag and call every registered closer (each once; safe from any thread)."""
        with self._lock:
            self._cancelled.set()
            closers, self._closers = list(self._closers.values()), {}
        for closer in closers:
            _close_quietly(closer)

    def on_cancel(self, closer: Callable[[], None]) -> Callable[[], None]:
        """Call ``closer`` when the run is cancelled (at once if it already is); returns a function
        that unregisters it (call it once the thing it closes is closed anyway)."""
        with self._lock:
            if not self._cancelled.is_set():
                key = next(self._keys)
                self._closers[key] = closer
                return lambda: self._forget(key)
        _close_quietly(closer)
        return lambda: None

    def _forget(self, key: int) -> None:
        with self._lock:
            self._closers.pop(key, None)

    def deadline(self) -> float | None:
        """The ``time.monotonic()`` instant the run's time limit ends; None without a limit."""
        return self.started + self.deadline_s if self.deadline_s else None

    def remaining(self) -> float | None:
        """Seconds left before the time limit (0 once past it); None without a limit."""
        deadline = self.deadline()
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def time_limit_error(self) -> "RunStopped":
        """The RunStopped of a run past its time limit (``check`` raises it)."""
        return RunStopped("time_limit", f"stopped: the run went past the {self.deadline_s:g} s time limit "
                                        f"(DP_REQUEST_SECONDS); {TIME_LIMIT_ADVICE}")

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def timed_out(self) -> bool:
        return self.deadline_s is not None and self.deadline_s > 0 and time.monotonic() - self.started > self.deadline_s

    def check(self) -> None:
        """Raise RunStopped if the run was cancelled or is past its time limit."""
        if self._cancelled.is_set():
            raise RunStopped("cancelled", "stopped: the run was cancelled")
        if self.timed_out:
            raise self.time_limit_error()


def check(control: RunControl | None) -> None:
    """``control.check()`` for an optional control."""
    if control is not None:
        control.check()


def _close_quietly(closer: Callable[[], None]) -> None:
    """Call a closer; a failure is logged, never raised (cancel must reach every closer)."""
    try:
        closer()
    except Exception:  # noqa: BLE001 (a closer of ours failed: log it, go on with the others)
        log.exception("a run's closer failed")


_ACTIVE: contextvars.ContextVar["RunControl | None"] = contextvars.ContextVar("active_run_control", default=None)


def active_control() -> RunControl | None:
    """The control of the run this thread is working for (set by ``under`` / ``run_under``)."""
    return _ACTIVE.get()


def run_under(control: RunControl | None, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` with ``control`` as the active control (the previous one restored after)."""
    token = _ACTIVE.set(control)
    try:
        return fn(*args)
    finally:
        _ACTIVE.reset(token)


def under(control: RunControl | None, source: Iterator[T]) -> Iterator[T]:
    """The items of ``source``, each computed with ``control`` active (set around every ``next``,
    so it holds whichever thread resumes the generator, and never leaks into the caller's
    context between items). ``control`` None: the active control the caller has is kept."""
    if control is None:
        yield from source
        return
    try:
        while True:
            try:
                item = run_under(control, next, source)
            except StopIteration:
                return
            yield item
    finally:
        run_under(control, _close, source)


def _close(source: Iterator) -> None:
    close = getattr(source, "close", None)
    if close is not None:
        close()
