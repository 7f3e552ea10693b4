"""Shared by the tests: what tests/engine/test_mcts.py and the tests beside it use."""

from __future__ import annotations

from engine.control import RunControl

__all__ = ['StopAfter']


class StopAfter(RunControl):
    """A control that stops at its ``checks``-th check (one check per simulation): cancelled, or
    past its time limit (the start moved back, so the real deadline check fires)."""

    def __init__(self, checks: int, reason: str = "cancelled", deadline_s: float = 120.0):
        super().__init__(deadline_s=deadline_s)
        self.left, self.reason = checks, reason

    def check(self) -> None:
        self.left -= 1
        if self.left < 0 and self.reason == "cancelled":
            self.cancel()
        elif self.left < 0:
            self.started -= 3600
        super().check()
