"""Each lesson's runs and checked outcome, computed once per deployment (issue #52: with a room's runs
on the machine a presenter's lesson took minutes; its result does not change from one press to the
next). A lesson's runs are seeded and its check is deterministic, so the first run that checks its
claim (``Outcome.ok``) is kept, keyed by the lesson's whole definition and the model and quantization
it ran on; "Run it live" runs it again and keeps the new one. A failed check is never kept (a missing
checkpoint or a stopped run must not stick)."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

from engine.reports.lessons import Lesson, Outcome
from engine.trace import Trace

KEPT = 64  # results kept (least recently used dropped): 11 built-in lessons on a few models


@dataclass(frozen=True)
class LessonResult:
    """A lesson's traces (read-only: every page showing them shares them) and its check's outcome."""

    traces: tuple[Trace, ...]
    outcome: Outcome
    at: float  # time.time() when it was computed


def result_key(lesson: Lesson, model: str, quantization: str) -> str:
    """The lesson's whole definition (a pasted lesson with the built-in id but other runs is another
    key), the model and the quantization."""
    text = json.dumps([lesson.to_dict(), model, quantization], sort_keys=True, ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


class LessonResults:
    """Thread-safe store of ``LessonResult`` by ``result_key`` (one per app)."""

    def __init__(self, kept: int = KEPT) -> None:
        if kept < 1:
            raise ValueError(f"kept: must be >= 1, got {kept}")
        self.kept = kept
        self._lock = threading.Lock()
        self._results: OrderedDict[str, LessonResult] = OrderedDict()

    def clear(self) -> None:
        with self._lock:
            self._results.clear()

    def get(self, key: str) -> LessonResult | None:
        with self._lock:
            result = self._results.get(key)
            if result is not None:
                self._results.move_to_end(key)
            return result

    def put(self, key: str, traces: Sequence[Trace], outcome: Outcome) -> LessonResult | None:
        """Keep a checked result (``outcome.ok``); a failed one is not kept (None)."""
        if not outcome.ok:
            return None
        result = LessonResult(tuple(traces), outcome, time.time())
        with self._lock:
            self._results[key] = result
            self._results.move_to_end(key)
            while len(self._results) > self.kept:
                self._results.popitem(last=False)
        return result


RESULTS = LessonResults()  # the deployment's
