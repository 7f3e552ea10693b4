"""Shared by the tests: what tests/playground/test_batching_counts.py and the tests beside it use."""

from __future__ import annotations

import contextlib
import subprocess
import sys

__all__ = ['busy_processes']


BUSY = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end:\n    pass\n"


@contextlib.contextmanager
def busy_processes(count: int, seconds: float):
    """``count`` processes spinning for at most ``seconds`` (the room's load, made by the test)."""
    procs = [subprocess.Popen([sys.executable, "-c", BUSY.format(s=seconds)]) for _ in range(count)]
    try:
        yield
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
