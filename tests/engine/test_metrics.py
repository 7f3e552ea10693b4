"""Lane metrics on hand-made token sequences and traces: every expected value is worked out in the
comment beside it."""

from __future__ import annotations

import math

import pytest

from engine.reports.metrics import (common_prefix, distinct_n, entropy_series, first_divergence, jaccard, lane_metrics, mean_logprob, ngrams, perplexity, rep_n, sweep_spread)
from engine.trace import StageTrace, StepTrace, Timing, Trace


def step(index: int, token: int, raw_prob: float, entropy: float = 1.0, raw_entropy: float = 2.0) -> StepTrace:
    stage = StageTrace("raw", 10, 0.0, raw_entropy, 0.0, [])
    return StepTrace(index, token, f"t{token}", raw_prob, raw_prob, None, None, None, entropy, raw_entropy, [stage])


def trace_of(tokens: list[int], raw_probs: list[float]) -> Trace:
    steps = [step(i, t, p, entropy=0.5 * i, raw_entropy=float(i)) for i, (t, p) in enumerate(zip(tokens, raw_probs))]
    return Trace("m", "sample", {}, "p", [0], "", tokens, "max_new_tokens", steps, Timing(100.0, 30.0, 200.0))


def test_ngrams_and_distinct():
    tokens = [1, 2, 1, 2, 1, 2]
    assert ngrams(tokens, 2) == [(1, 2), (2, 1), (1, 2), (2, 1), (1, 2)]
    assert distinct_n(tokens, 1) == pytest.approx(2 / 6)  # {1, 2} out of 6 unigrams
    assert distinct_n(tokens, 2) == pytest.approx(2 / 5)  # {(1,2), (2,1)} out of 5 bigrams
    assert rep_n(tokens, 4) == pytest.approx(1 / 3)  # 4-grams 1212, 2121, 1212: one repeats
    assert distinct_n([5, 6, 7], 2) == 1.0 and rep_n([5, 6, 7], 4) == 0.0  # no 4-gram at all -> 0
    assert distinct_n([], 1) == 0.0
    with pytest.raises(ValueError, match="n: expected an integer >= 1, got 0"):
        ngrams(tokens, 0)


def test_logprob_and_perplexity():
    assert mean_logprob([0.5, 0.25]) == pytest.approx(-1.5 * math.log(2))  # (ln 1/2 + ln 1/4) / 2
    assert perplexity([0.5, 0.25]) == pytest.approx(2 ** 1.5)
    assert perplexity([1.0, 1.0]) == 1.0
    assert math.isnan(mean_logprob([])) and math.isnan(perplexity([]))
    assert math.isfinite(mean_logprob([0.0]))  # a zero probability is clamped, not -inf


def test_lane_metrics_on_a_hand_made_trace():
    metrics = lane_metrics(trace_of([1, 1, 1], [0.5, 0.25, 1.0]), name="lane A")
    assert metrics.name == "lane A" and metrics.tokens == 3
    assert metrics.mean_raw_logprob == pytest.approx(-math.log(2))  # (ln 1/2 + ln 1/4 + 0) / 3 = -ln 2
    assert metrics.perplexity == pytest.approx(2.0)
    assert metrics.distinct_1 == pytest.approx(1 / 3)  # one distinct token of three
    assert metrics.distinct_2 == pytest.approx(1 / 2)  # (1,1) twice
    assert metrics.rep_4 == 0.0
    assert (metrics.ttft_ms, metrics.tokens_per_s, metrics.stop_reason) == (100.0, 30.0, "max_new_tokens")


def test_entropy_series_picks_final_or_raw():
    steps = trace_of([4, 5, 6], [0.5, 0.5, 0.5]).steps
    assert entropy_series(steps) == [0.0, 0.5, 1.0]
    assert entropy_series(steps, raw=True) == [0.0, 1.0, 2.0]


def test_first_divergence():
    assert first_divergence([[1, 2, 3], [1, 2, 4], [1, 2, 3]]) == 2
    assert first_divergence([[7], [8]]) == 0
    assert first_divergence([[1, 2], [1, 2, 3]]) == 2  # one lane stopped, the other went on
    assert first_divergence([[1, 2], [1, 2]]) is None
    assert first_divergence([[1, 2]]) is None


def test_overlap_helpers_and_sweep_spread():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert jaccard([1, 2, 3], [1, 4, 5]) == pytest.approx(1 / 5)  # {1} of {1,2,3,4,5}
    assert jaccard([], []) == 1.0
    spread = sweep_spread([[1, 2, 3], [1, 2, 3], [1, 4, 5]])
    assert spread.runs == 3 and spread.distinct_outputs == 2
    # pairs: (a, a) overlap 1, prefix 3; (a, c) twice: overlap 1/5, prefix 1
    assert spread.mean_token_overlap == pytest.approx((1 + 0.2 + 0.2) / 3)
    assert spread.mean_common_prefix == pytest.approx(5 / 3)
    assert spread.mean_distinct_2 == 1.0
    single = sweep_spread([[9, 9]])
    assert (single.distinct_outputs, single.mean_token_overlap, single.mean_common_prefix) == (1, 1.0, 2.0)
    with pytest.raises(ValueError, match="at least one run"):
        sweep_spread([])
