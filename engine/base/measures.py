"""Measures of token sequences that every floor uses (the cache's shared prefix, a trace's summary,
the strategies' records): pure functions, no engine import. ``engine.reports.metrics`` builds the
Compare view's measures on them."""

from __future__ import annotations

import math
from typing import Hashable, Sequence

MIN_PROB = 1e-45  # log of a zero probability is clamped here, not -inf


def mean_logprob(probs: Sequence[float]) -> float:
    """Mean natural log of the probabilities (nan for an empty run)."""
    if not probs:
        return math.nan
    return sum(math.log(max(p, MIN_PROB)) for p in probs) / len(probs)


def perplexity(probs: Sequence[float]) -> float:
    """exp(−mean log p): the model's average branching factor along this text."""
    mean = mean_logprob(probs)
    return math.exp(-mean) if not math.isnan(mean) else math.nan


def common_prefix(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    """Length of the longest shared prefix."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
