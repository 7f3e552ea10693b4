"""Metrics that compare decoding runs: pure functions of token sequences and traces.

Lane metrics (the compare view's table) use the *unprocessed* model's probability of each chosen
token (``StepTrace.raw_prob``), so runs with different stages are scored by the same yardstick.
``rep_n`` is Su et al.'s (2022) rep-n: the share of n-grams that repeat an earlier n-gram of the
same text (1 − distinct-n).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations
from typing import Hashable, Sequence

from engine.base.measures import MIN_PROB, common_prefix, mean_logprob, perplexity  # noqa: F401  (re-exported)
from engine.trace import StepTrace, Trace


def ngrams(tokens: Sequence[Hashable], n: int) -> list[tuple]:
    """All contiguous n-grams, in order."""
    if n < 1:
        raise ValueError(f"n: expected an integer >= 1, got {n!r}")
    return [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]


def distinct_n(tokens: Sequence[Hashable], n: int) -> float:
    """Distinct n-grams / all n-grams (Li et al. 2016); 0 when the text has no n-gram."""
    grams = ngrams(tokens, n)
    return len(set(grams)) / len(grams) if grams else 0.0


def rep_n(tokens: Sequence[Hashable], n: int = 4) -> float:
    """Share of n-grams that already occurred earlier in the text: 1 − distinct-n (0 if none)."""
    grams = ngrams(tokens, n)
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


@dataclass
class LaneMetrics:
    name: str
    tokens: int
    mean_raw_logprob: float  # nats per token, under the unprocessed model
    perplexity: float  # exp(-mean_raw_logprob)
    distinct_1: float
    distinct_2: float
    rep_4: float  # share of repeated 4-grams
    ttft_ms: float
    tokens_per_s: float
    stop_reason: str


def lane_metrics(trace: Trace, name: str = "") -> LaneMetrics:
    """Every number of one row of the compare table."""
    raw = [s.raw_prob for s in trace.steps]
    tokens = list(trace.generated_token_ids)
    return LaneMetrics(
        name=name or trace.strategy, tokens=len(tokens), mean_raw_logprob=mean_logprob(raw), perplexity=perplexity(raw),
        distinct_1=distinct_n(tokens, 1), distinct_2=distinct_n(tokens, 2), rep_4=rep_n(tokens, 4),
        ttft_ms=trace.timing.ttft_ms, tokens_per_s=trace.timing.tokens_per_s, stop_reason=trace.stop_reason,
    )


def entropy_series(steps: Sequence[StepTrace], raw: bool = False) -> list[float]:
    """Per-step entropy in nats: of the distribution the token was picked from, or of the raw model."""
    return [s.raw_entropy if raw else s.entropy for s in steps]


def first_divergence(sequences: Sequence[Sequence[Hashable]]) -> int | None:
    """The first position where the sequences do not all agree (a sequence that has ended disagrees
    with one that goes on); None when all are identical or there are fewer than two."""
    if len(sequences) < 2:
        return None
    longest = max(len(s) for s in sequences)
    for i in range(longest):
        column = {s[i] if i < len(s) else None for s in sequences}
        if len(column) > 1:
            return i
    return None


def jaccard(a: Sequence[Hashable], b: Sequence[Hashable]) -> float:
    """|set(a) ∩ set(b)| / |set(a) ∪ set(b)| (1 when both are empty)."""
    sa, sb = set(a), set(b)
    return len(sa & sb) / len(sa | sb) if sa | sb else 1.0


@dataclass
class SweepSpread:
    """How different the outputs of one preset are across seeds."""

    runs: int
    distinct_outputs: int  # different token sequences
    mean_token_overlap: float  # mean pairwise Jaccard of the token sets (1 = same vocabulary)
    mean_common_prefix: float  # mean pairwise shared-prefix length, in tokens
    mean_distinct_2: float  # within-text diversity, averaged over runs


def sweep_spread(sequences: Sequence[Sequence[Hashable]]) -> SweepSpread:
    """Spread of outputs from several seeds (pairwise means are 1 / full length for one run)."""
    if not sequences:
        raise ValueError("sequences: expected at least one run")
    pairs = list(combinations(sequences, 2))
    overlap = sum(jaccard(a, b) for a, b in pairs) / len(pairs) if pairs else 1.0
    prefix = sum(common_prefix(a, b) for a, b in pairs) / len(pairs) if pairs else float(len(sequences[0]))
    return SweepSpread(
        runs=len(sequences), distinct_outputs=len({tuple(s) for s in sequences}), mean_token_overlap=overlap,
        mean_common_prefix=prefix, mean_distinct_2=sum(distinct_n(s, 2) for s in sequences) / len(sequences),
    )
