"""Torch's CPU thread count, set in one place: the process's count (the CLI tools, the benches, the
tests, the Medusa trainer) and the scheduler's per-step count.

The engine and the benches call ``torch.set_num_threads`` only through here, so a reader finds in
this module every thread setting the program makes and why.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

import torch

# On CPU a step of a few rows runs faster on one thread than on two (2-core dev machine, 32 tokens:
# one lane 2.7 s vs 3.2 s, four Compare lanes 4.8 s vs 5.9 s), while 16 rows run 1.4x faster on two
# (forward 122 ms vs 174 ms). Steps of at most this many rows use one thread; prefills use them all.
FEW_ROWS = 8


def default_threads() -> int:
    """One thread per core, two at most: on a small shared machine more threads only contend
    (the tests' and the benches' default)."""
    return max(1, min(2, os.cpu_count() or 1))


def set_threads(n: int) -> int:
    """Set the process's CPU thread count to ``n`` (0: leave torch's default). Returns the count in
    effect. ValueError naming ``threads`` when n is negative."""
    if n < 0:
        raise ValueError(f"threads: must be 0 (torch's default) or more, got {n}")
    if n:
        torch.set_num_threads(n)
    return torch.get_num_threads()


@contextmanager
def threads(n: int) -> Iterator[None]:
    """``n`` CPU threads inside the block (n >= 1), the previous count restored after."""
    before = torch.get_num_threads()
    if n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def step_threads(device: torch.device, rows: int) -> Iterator[None]:
    """The scheduler's step: one CPU thread for at most ``FEW_ROWS`` rows (the caller's count
    restored after); GPUs and bigger batches keep the caller's count."""
    few = device.type == "cpu" and rows <= FEW_ROWS
    with threads(1 if few else torch.get_num_threads()):
        yield
