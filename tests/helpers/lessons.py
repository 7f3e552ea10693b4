"""Shared by the tests: what tests/playground/test_lessons.py and the tests beside it use."""

from __future__ import annotations

from engine.reports.lessons import (builtin_lessons)

__all__ = ['CHECKPOINT_LESSONS']


# The lessons whose check loads the 4-bit checkpoints (made, or waited for, by deploy/quantize.sh): their tests are
# marked `quantized`, so make test runs them in its one-process phase, after the background quantization.
CHECKPOINT_LESSONS = frozenset(i for i, lesson in builtin_lessons().items() if lesson.check["kind"] == "gptq_vs_awq")
