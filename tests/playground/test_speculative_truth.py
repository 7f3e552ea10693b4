"""Issue #27, the Speculative view tells the truth: the speed-up compares like with like (both runs'
time, token count and rate), the note on drafted special tokens says what the chips show, and in
greedy mode the target's own token is called its argmax, not a draw from the residual."""

from __future__ import annotations

import re

import pytest

from engine.strategies.speculative import DraftToken, ExtraToken, SpecRound, rounds_of
from engine.trace import TokenProb
from playground.charts import speculative as charts


def tp(token_id: int, token: str, prob: float) -> TokenProb:
    return TokenProb(token_id, token, prob)


def test_speed_up_names_both_token_counts_and_rates():
    # The numbers: 4,466 ms for 40 tokens against 3,068 ms for 25 tokens is 8.96 vs 8.15 tok/s.
    summary = {"tokens": 40, "rounds": 12, "total_ms": 4466.0, "baseline_ms": 3068.0, "baseline_tokens": 25,
               "speedup": (3068.0 / 25) / (4466.0 / 40), "baseline_same_tokens": False}
    text = charts.summary_markdown(summary)
    assert "speculative 4,466 ms for 40 tokens (9.0 tok/s)" in text
    assert "target-only 3,068 ms for 25 tokens (8.1 tok/s)" in text
    assert "**1.10× tokens/s**" in text and "0.93" not in text
    same = charts.summary_markdown(summary | {"baseline_tokens": 40, "baseline_same_tokens": True})
    assert "for 40 tokens (the same tokens)" in same
    assert "speed-up (tokens/s)" in charts.counters_html([], summary)


@pytest.mark.parametrize("summary", [
    {"tokens": 3, "total_ms": 0.0, "baseline_ms": 10.0, "baseline_tokens": 3, "speedup": float("nan")},
    {"tokens": 3, "total_ms": 10.0, "baseline_ms": 0.0, "baseline_tokens": 0, "speedup": float("inf")},
    {"tokens": 3, "total_ms": 12.0, "baseline_ms": 20.0, "speedup": 1.6},  # an older trace: no baseline_tokens
])
def test_speed_up_of_odd_summaries_never_shows_nan(summary):
    text = charts.summary_markdown(summary)
    assert "nan" not in text.lower() and "inf" not in text.lower()
    assert "target-only" in text


def special_rounds() -> list[SpecRound]:
    """Round 0 drafts ⟪im_start⟫, rejected (the target says 'Hi'); round 1 drafts ' there' and
    ⟪im_end⟫, both accepted: the run ends there (eos)."""
    start = DraftToken(0, 1, "<|im_start|>", q=1.0, p=1e-9, accept_prob=0.0, u=None, accepted=False,
                       q_top=[tp(1, "<|im_start|>", 1.0)], p_top=[tp(5, "Hi", 0.9)],
                       resampled=ExtraToken("resampled", 5, "Hi", 0.9, 0.9, [tp(5, "Hi", 0.9)]))
    there = DraftToken(0, 6, " there", q=1.0, p=0.8, accept_prob=1.0, u=None, accepted=True,
                       q_top=[tp(6, " there", 1.0)], p_top=[tp(6, " there", 0.8)])
    end = DraftToken(1, 2, "<|im_end|>", q=1.0, p=0.7, accept_prob=1.0, u=None, accepted=True,
                     q_top=[tp(2, "<|im_end|>", 1.0)], p_top=[tp(2, "<|im_end|>", 0.7)])
    return [SpecRound(0, 0, 1, [start], 0, None, [5], "Hi", 1.0, 2.0, 3.0),
            SpecRound(1, 1, 2, [there, end], 2, None, [6, 2], " there", 1.0, 2.0, 6.0, "eos")]


def chip_kinds(html: str) -> dict[str, str]:
    """The verdict each drafted special token's chip shows: its token text -> accepted | rejected."""
    return {token: kind for kind, token in re.findall(r'data-kind="(accepted|rejected)" title="draft (⟪[^⟫]*⟫)', html)}


def test_special_token_note_agrees_with_the_chips():
    rounds = special_rounds()
    html = charts.rounds_html(rounds, drafter="ngram")
    assert chip_kinds(html) == {"⟪im_start⟫": "rejected", "⟪im_end⟫": "accepted"}
    note = charts.special_drafts_note(rounds, "ngram")
    assert "rejected ⟪im_start⟫ (#0)" in note and "accepted ⟪im_end⟫ (#1 ends the answer)" in note
    assert "rejects them where they do not fit" not in note  # the old claim, false for ⟪im_end⟫
    only_end = rounds[1:]
    note = charts.special_drafts_note(only_end, "ngram")
    assert "rejected" not in note and "accepted ⟪im_end⟫" in note


def test_greedy_correction_is_called_the_targets_argmax():
    rounds = special_rounds()  # greedy: u is None, the corrections carry no draw
    fig = charts.residual_figure(rounds[0], 0)
    assert "argmax" in fig.layout.title.text and "residual" not in fig.layout.title.text
    html = charts.rounds_html(rounds)
    resampled_title = re.search(r'data-kind="resampled" title="([^"]*)"', html).group(1)
    assert "argmax" in resampled_title and "residual" not in resampled_title
    assert "argmax" in charts.acceptance_text(rounds[0], 0)
    # Sampling keeps the residual: the same round with a draw.
    rounds[0].drafted[0].resampled.draw = 0.3
    assert "residual" in charts.residual_figure(rounds[0], 0).layout.title.text


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_real_run_tells_the_truth(embedded, registry, temperature):
    """The view's default prompt through the runner: every drafted special token's verdict in the
    note is its chip's; the greedy run's figures never mention the residual; the speed line names
    both token counts."""
    from engine import runner
    from engine.runner import RunRequest
    from engine.presets import load_preset
    from playground.views.speculative import DEFAULT_PROMPT

    config = load_preset("speculative-ngram").config.replace(max_new_tokens=24, temperature=temperature, seed=5)
    greedy = config.is_greedy
    trace = runner.run(RunRequest(embedded, DEFAULT_PROMPT, config, chat=True, registry=registry, compare_baseline=True))
    rounds = rounds_of(trace)
    note = charts.special_drafts_note(rounds, config.drafter)
    for r in rounds:
        for d in r.drafted:
            if d.token.startswith("<|"):
                verdict = "accepted" if d.accepted else "rejected"
                assert re.search(rf"{verdict} [^.]*{re.escape(charts.readable(d.token))} \(#{r.index}\b", note), note
            if greedy and d.resampled is not None:
                assert "residual" not in charts.residual_figure(r, d.position).layout.title.text
    text = charts.summary_markdown(trace.summary)
    assert f"for {len(trace.generated_token_ids)} tokens" in text
    assert f"for {trace.summary['baseline_tokens']} tokens" in text
