"""Speculative: EOS ends the text and the drafts, zero-probability tokens are not charted, the
time breakdown adds up (and does not count the caller's time), round labels after a stop."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from engine.config import DecodingConfig
from engine.strategies.speculative import (Draft, DraftToken, NgramDrafter, SpecRound, assemble, cut_at_eos, rounds, top_tokens)
from engine.trace import TokenProb
from playground.charts import speculative as charts

GREEDY = DecodingConfig(strategy="speculative", temperature=0.0, max_new_tokens=12, num_draft_tokens=4, drafter="ngram")
PROMPT = "a b c d e f g a b c d e f g a b c"


def draft_token(pos, token_id, token, accepted=True):
    return DraftToken(pos, token_id, token, q=1.0, p=0.9 if accepted else 0.0, accept_prob=0.9, u=None, accepted=accepted,
                      q_top=[TokenProb(token_id, token, 1.0), TokenProb(7, "<gh_stars>", 0.0)],
                      p_top=[TokenProb(token_id, token, 0.9), TokenProb(8, "<reponame>", 0.0)])


def test_cut_at_eos_keeps_the_eos_and_drops_what_follows():
    q = [torch.tensor([0.1]), torch.tensor([0.2]), torch.tensor([0.3])]
    cut = cut_at_eos(Draft([5, 2, 7], q), eos_ids=(2,))
    assert cut.tokens == [5, 2] and [float(x) for x in cut.q] == [pytest.approx(0.1), pytest.approx(0.2)]
    assert cut_at_eos(Draft([5, 6], None), (2,)).tokens == [5, 6]


def test_top_tokens_leave_out_zero_probabilities():
    point_mass = torch.nn.functional.one_hot(torch.tensor(3), 10).float()
    assert [(t.token_id, t.prob) for t in top_tokens(point_mass, 5, str)] == [(3, 1.0)]


def test_pq_figure_lists_no_zero_probability_tokens():
    r = SpecRound(0, 0, 1, [draft_token(0, 5, " the")], 1, None, [5], " the", 1.0, 2.0, 3.0)
    fig = charts.pq_figure(r, 0)
    assert [list(bar.y) for bar in fig.data] == [["␣the"], ["␣the"]]


def test_eos_is_not_in_the_text_and_the_label_counts_up_to_the_stop():
    """Drafts [x, EOS, y] all accepted, the run ends at EOS: text " x", label 2/2 accepted."""
    drafted = [draft_token(0, 5, " x"), draft_token(1, 2, "<|im_end|>"), draft_token(2, 6, " y")]
    r = SpecRound(3, 0, 3, drafted, 3, None, [5, 2], " x", 1.0, 2.0, 3.0, finish_reason="eos")
    assert charts.emitted_tokens(r) == [(" x", "accepted")]
    assert "<|im_end|>" not in charts.text_html([r]) and "im_end" not in charts.text_html([r])
    assert charts.round_label(r) == "#3 · K=3 · 2/2 accepted · +2 tokens · stopped: end of sequence"
    assert "special token" in charts.acceptance_text(r, 1)
    chip = charts.rounds_html([r])
    assert 'class="dp-special"' in chip and "&lt;|im_end|&gt;</span>" not in chip.split("title=")[0]


def test_time_breakdown_adds_up():
    summary = {"prefill_ms": 100.0, "draft_ms": 2.0, "verify_ms": 800.0, "capture_ms": 90.0, "other_ms": 8.0, "total_ms": 1000.0}
    assert charts.time_breakdown(summary) == ("time: prefill 100 + draft 2 + verify (target forwards) 800 + "
                                              "acceptance tests + trace capture 90 + other 8 = total 1,000 ms")
    old = {"draft_ms": 2.0, "verify_ms": 800.0, "total_ms": 1000.0}  # a trace from before the breakdown
    assert charts.time_breakdown(old).endswith("verify (target forwards) 800 + other 198 = total 1,000 ms")


def test_engine_breakdown_sums_to_total_and_ignores_the_callers_time(tiny_lm):
    """A caller that sleeps 50 ms per round: that time is not in total_ms, and the parts add up."""
    ids = tiny_lm.encode(PROMPT)
    drafter = NgramDrafter(3)
    collected = []
    for r in rounds(tiny_lm, ids, GREEDY, drafter):
        collected.append(r)
        time.sleep(0.05)
    summary = assemble(tiny_lm, PROMPT, ids, GREEDY, collected, drafter, False).summary
    parts = sum(summary[k] for k in ("prefill_ms", "draft_ms", "verify_ms", "capture_ms", "other_ms"))
    assert parts == pytest.approx(summary["total_ms"])
    engine_ms = sum(r.verify_ms + r.capture_ms for r in collected) + summary["prefill_ms"]
    assert summary["total_ms"] < 50 * len(collected) + engine_ms
    assert summary["other_ms"] < 50 and collected[0].prefill_ms > 0 and all(r.prefill_ms == 0 for r in collected[1:])


def test_ngram_drafts_stop_at_eos(tiny_lm):
    """With a token of the prompt made EOS, no round tests a draft after an EOS draft."""
    ids = tiny_lm.encode(PROMPT)
    eos = ids[len(ids) // 2]
    lm = dataclasses.replace(tiny_lm, eos_token_ids=(eos,), _token_text={})
    for r in rounds(lm, ids, GREEDY.replace(max_new_tokens=24), NgramDrafter(3)):
        tokens = [d.token_id for d in r.drafted]
        assert eos not in tokens[:-1]
