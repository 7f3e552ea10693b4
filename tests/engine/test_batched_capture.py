"""The batched capture (``core.advance_rows``: ``chain.traced_rows`` + ``core.pick_rows``) against
each row stepped alone, ``RunState.advance`` (its one-row case; test_core and test_decode check
that against an uncached loop and generate()): for runs with mixed knobs and seeds fed the same
next-token logits, every StepTrace is the same (tokens, picks, draws, kept counts, top lists,
removed lists, params) with floats within 1e-6, and every generator ends in the same state. The
logits come from an uncached forward of the tiny random Llama over each run's ids."""

from __future__ import annotations

import pytest
import torch

from engine import sampling
from engine.config import DecodingConfig
from engine.core import RunState, advance_rows

TOL = 1e-6

CONFIGS = [
    DecodingConfig(strategy="greedy", max_new_tokens=50),
    DecodingConfig(strategy="greedy", max_new_tokens=50, repetition_penalty=1.3),
    DecodingConfig(strategy="sample", seed=1, max_new_tokens=50, top_k=20),
    DecodingConfig(strategy="sample", seed=2, max_new_tokens=50, top_k=20),  # same chain as above: one shared call
    DecodingConfig(strategy="sample", seed=3, max_new_tokens=50, top_p=0.9, temperature=0.8),
    DecodingConfig(strategy="sample", seed=4, max_new_tokens=50, top_p=0.9, temperature=0.8),
    DecodingConfig(strategy="sample", seed=5, max_new_tokens=50, min_p=0.05),
    DecodingConfig(strategy="sample", seed=6, max_new_tokens=50, typical_p=0.9),
    DecodingConfig(strategy="sample", seed=7, max_new_tokens=50, repetition_penalty=1.2, frequency_penalty=0.5,
                   presence_penalty=0.3, top_k=50),
    DecodingConfig(strategy="sample", seed=8, max_new_tokens=50, mirostat=2, mirostat_tau=3.0),
    DecodingConfig(strategy="sample", seed=9, max_new_tokens=50, xtc_probability=0.5, xtc_threshold=0.01),
    DecodingConfig(strategy="sample", seed=10, max_new_tokens=50, top_k=3, top_n=8),  # kept < top_n
    DecodingConfig(strategy="sample", seed=11, max_new_tokens=50, top_n_sigma=1.5, top_n=4),
    DecodingConfig(strategy="sample", seed=12, max_new_tokens=50, min_new_tokens=5, top_p=0.95),
]
PROMPTS = ["Once upon a time", "The capital of France is", "def add(a, b):", "1, 2, 3, 4,", "Hello"]


def assert_same_step(a, b, label):
    assert (a.index, a.chosen_token_id, a.chosen_token, a.forced, a.finish_reason) == \
           (b.index, b.chosen_token_id, b.chosen_token, b.forced, b.finish_reason), label
    for x, y in [(a.chosen_prob, b.chosen_prob), (a.raw_prob, b.raw_prob), (a.entropy, b.entropy),
                 (a.raw_entropy, b.raw_entropy), (a.draw_low, b.draw_low), (a.draw_high, b.draw_high), (a.draw, b.draw)]:
        assert (x is None) == (y is None), label
        if x is not None:
            assert x == pytest.approx(y, abs=TOL), label
    assert [s.name for s in a.stages] == [s.name for s in b.stages], label
    for sa, sb in zip(a.stages, b.stages):
        where = (label, sa.name)
        assert sa.kept == sb.kept and sa.params == sb.params, where
        assert [t.token_id for t in sa.top] == [t.token_id for t in sb.top], where
        assert [t.token for t in sa.top] == [t.token for t in sb.top], where
        assert [t.prob for t in sa.top] == pytest.approx([t.prob for t in sb.top], abs=TOL), where
        assert [t.token_id for t in sa.removed] == [t.token_id for t in sb.removed], where
        for x, y in [(sa.mass_removed, sb.mass_removed), (sa.entropy, sb.entropy), (sa.tv_distance, sb.tv_distance)]:
            assert x == pytest.approx(y, abs=TOL), where


def next_logits(lm, states) -> torch.Tensor:
    """[B, V]: each run's next-token logits from an uncached forward over its own ids."""
    with torch.inference_mode():
        return torch.cat([lm.model(input_ids=s.ids).logits[:, -1, :].float() for s in states])


def pair(lm, configs, prompts):
    """Two identical sets of runs: one stepped alone, one stepped as a batch."""
    make = lambda: [RunState(lm, lm.encode(prompts[i % len(prompts)]), c) for i, c in enumerate(configs)]  # noqa: E731
    return make(), make()


def test_batched_capture_equals_each_row_alone(tiny_lm):
    solo, batched = pair(tiny_lm, CONFIGS, PROMPTS)
    for _ in range(6):
        logits = next_logits(tiny_lm, solo)
        expected = [s.advance(logits[b:b + 1]) for b, s in enumerate(solo)]
        got = advance_rows(batched, logits)
        for b, (x, y) in enumerate(zip(got, expected)):
            assert not isinstance(x, Exception), (b, x)
            assert_same_step(x, y, f"row {b} ({CONFIGS[b].active_stages()})")
    for s, t in zip(solo, batched):
        assert s.generated == t.generated
        assert torch.equal(s.ids, t.ids)
        if s.generator is not None:  # each row drew from its own generator exactly as alone
            assert torch.equal(s.generator.get_state(), t.generator.get_state())
    mirostat = [s for s in solo if s.config.mirostat][0].chain.stages[-1]
    assert mirostat.mu != 2 * 3.0  # μ moved, and the batched run's μ moved the same way (checked via params above)


def test_one_row_without_tokens_fails_alone(tiny_lm):
    """A NaN row raises NoTokensLeft for that run only (as ``advance`` raises it); the others step."""
    configs = [CONFIGS[0], CONFIGS[2], CONFIGS[4]]
    solo, batched = pair(tiny_lm, configs, PROMPTS)
    logits = next_logits(tiny_lm, solo).clone()
    logits[1] = float("nan")
    got = advance_rows(batched, logits)
    assert isinstance(got[1], sampling.NoTokensLeft)
    with pytest.raises(sampling.NoTokensLeft):
        solo[1].advance(logits[1:2])
    for b in (0, 2):
        assert_same_step(got[b], solo[b].advance(logits[b:b + 1]), f"row {b}")


def test_sample_rows_matches_sample_probs_by_hand():
    """Two rows of a 4-token distribution: the same winners and intervals as ``sample_probs`` with
    generators seeded alike; the interval [low, high) of the winner is the sorted CDF's, by hand."""
    probs = torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.25, 0.25, 0.25, 0.25]])
    rows = sampling.sample_rows(probs, [torch.Generator().manual_seed(s) for s in (3, 4)])
    alone = [sampling.sample_probs(probs[r], torch.Generator().manual_seed(s)) for r, s in ((0, 3), (1, 4))]
    assert rows == alone
    cdf_low = {1: 0.0, 3: 0.4, 2: 0.7, 0: 0.9}  # sorted by probability: 0.4, 0.3, 0.2, 0.1
    assert rows[0].low == pytest.approx(cdf_low[rows[0].token_id])
    assert rows[1].low == pytest.approx(0.25 * rows[1].token_id)  # ties: lower id first
    for p in rows + alone:
        assert p.low <= p.draw < p.high


def test_rows_with_tokens_agrees_with_has_tokens():
    inf, nan = float("inf"), float("nan")
    rows = torch.tensor([[0.0, 1.0, -inf], [-inf, -inf, -inf], [nan, 1.0, 2.0], [inf, 1.0, 2.0], [-inf, 3.0, -inf]])
    assert sampling.rows_with_tokens(rows) == [True, False, False, False, True]
    assert sampling.rows_with_tokens(rows) == [sampling.has_tokens(rows[r:r + 1]) for r in range(rows.shape[0])]


def test_entropy_rows_equals_entr_on_raw_truncated_and_edge_rows():
    """``chain.entropy_rows`` (the recorder's vectorized entropy) against its definition,
    ``torch.special.entr(p).sum(-1)``: a raw softmax row, a top-k-truncated one (exact zeros), a
    one-hot row, a row with subnormal probabilities, and a NaN row (NaN in both)."""
    from engine.chain import entropy_rows

    torch.manual_seed(0)
    logits = torch.randn(5, 4096) * 4
    logits[1, logits[1] < logits[1].topk(20).values[-1]] = -float("inf")  # top-k 20: 4076 exact zeros
    logits[2] = -float("inf")
    logits[2, 7] = 0.0  # one token left: entropy 0
    logits[3, :100] = logits[3].max() - 90.0  # p ~ e^-90 / Z: subnormal float32
    probs = torch.softmax(logits, dim=-1)
    probs[4, 3] = float("nan")
    want, got = torch.special.entr(probs).sum(-1), entropy_rows(probs)
    assert torch.isnan(got[4]) and torch.isnan(want[4])
    assert torch.allclose(got[:4], want[:4], atol=1e-6, rtol=0)
    assert got[2].item() == 0.0 and (probs[3, :100] > 0).any() and (probs[3, :100] < torch.finfo(torch.float32).tiny).all()


def test_the_draw_s_interval_starts_at_the_mass_sorted_before_the_winner():
    """A draw's ``low`` (its interval start) is the float64 sum of the probabilities sorted before the
    winner (higher p, or equal p and a lower id), in id order, over V and on a truncated row alike,
    against the same sum made from a stable sort."""
    torch.manual_seed(1)
    probs = torch.softmax(torch.randn(3, 1000) * 3, dim=-1)
    probs[1, 500:] = 0.0  # a truncated row races on its nonzero entries
    probs[1] /= probs[1].sum()
    probs[2, 7] = probs[2, 9] = probs[2, 11]  # a tie with the lowest id first
    for seed in range(20):
        for r, chosen in enumerate(sampling.sample_rows(probs, [torch.Generator().manual_seed(seed + 100 * r)
                                                                for r in range(3)])):
            row = probs[r]
            p = row[chosen.token_id]
            before = (row > p) | ((row == p) & (torch.arange(1000) < chosen.token_id))
            assert chosen.low == float(row[before].double().sum())
            order = torch.sort(row.double(), descending=True, stable=True).indices
            at = int((order == chosen.token_id).nonzero())
            assert chosen.low == pytest.approx(float(row.double()[order[:at]].sum()), abs=1e-12)
            assert chosen.high == chosen.low + chosen.prob and chosen.low <= chosen.draw < chosen.high + 1e-12