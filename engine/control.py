"""RunControl: the cancellation flag and time limit that every model loop checks once per step.

A run ends early for two reasons: its user cancelled it (Stop, a closed tab, a cancelled API job)
or it ran past the per-request time limit. Loops call ``control.check()`` once per forward; it
raises ``RunStopped`` naming the reason, so a cancelled run frees its slot within one step.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from engine.settings import env_seconds

DEFAULT_REQUEST_SECONDS = 120.0


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
    _cancelled: threading.Event = field(default_factory=threading.Event, repr=False)

    def __getstate__(self) -> dict:
        """A copy for another process (a ZeroGPU worker gets its arguments pickled): the deadline
        and the start travel, the flag does not (a cancel reaches that process only through its
        own deadline; ``threading.Event`` cannot be pickled)."""
        return {"deadline_s": self.deadline_s, "started": self.started, "cancelled": self.cancelled}

    def __setstate__(self, state: dict) -> None:
        self.deadline_s, self.started = state["deadline_s"], state["started"]
        self._cancelled = threading.Event()
        if state["cancelled"]:
            self._cancelled.set()

    @classmethod
    def with_request_limit(cls) -> "RunControl":
        """A control with the deployment's per-request time limit (``DP_REQUEST_SECONDS``)."""
        return cls(deadline_s=request_seconds() or None)

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def timed_out(self) -> bool:
        return bool(self.deadline_s) and time.monotonic() - self.started > self.deadline_s

    def check(self) -> None:
        """Raise RunStopped if the run was cancelled or is past its time limit."""
        if self._cancelled.is_set():
            raise RunStopped("cancelled", "stopped: the run was cancelled")
        if self.timed_out:
            raise RunStopped("time_limit", f"stopped: the run went past the {self.deadline_s:g} s time limit "
                                           "(DP_REQUEST_SECONDS); ask for fewer tokens")


def check(control: RunControl | None) -> None:
    """``control.check()`` for an optional control."""
    if control is not None:
        control.check()
