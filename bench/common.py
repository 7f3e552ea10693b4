"""Shared benchmark helpers: interleaved timing of two callables in one process, and a table."""

from __future__ import annotations

import statistics
import time
from typing import Callable


def interleaved(runs: dict[str, Callable[[], int]], repeats: int = 3, warmup: int = 1) -> dict[str, list[float]]:
    """Call each function in turn, ``repeats`` times (after ``warmup`` rounds); each returns the
    number of tokens it generated. Returns tokens/s per run name."""
    for _ in range(warmup):
        for fn in runs.values():
            fn()
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            start = time.perf_counter()
            tokens = fn()
            rates[name].append(tokens / (time.perf_counter() - start))
    return rates


def report(title: str, rates: dict[str, list[float]], baseline: str) -> float:
    """Print a table of median tokens/s and the ratio of the first run to ``baseline``."""
    medians = {name: statistics.median(v) for name, v in rates.items()}
    print(f"\n{title}")
    print(f"{'run':<40} {'median tok/s':>12} {'runs':>30}")
    for name, values in rates.items():
        print(f"{name:<40} {medians[name]:>12.2f} {', '.join(f'{v:.1f}' for v in values):>30}")
    ours = next(n for n in rates if n != baseline)
    ratio = medians[ours] / medians[baseline]
    print(f"ratio {ours} / {baseline} = {ratio:.3f}")
    return ratio
