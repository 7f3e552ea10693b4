"""Step-through chart builders are pure functions of a trace: checked on a hand-made 2-step trace."""

import math

import pytest

from engine.trace import StageTrace, StepTrace, Timing, TokenProb, Trace
from playground.charts import step as charts


def tp(i, text, p):
    return TokenProb(i, text, p)


def make_step(index=0, draw=0.7):
    raw = StageTrace("raw", 4, 0.0, 1.2, 0.0, [tp(1, " the", 0.5), tp(2, " a", 0.3), tp(3, "\n", 0.15), tp(4, " an", 0.05)])
    topk = StageTrace("top_k", 2, 0.2, 0.66, 0.2, [tp(1, " the", 0.625), tp(2, " a", 0.375)],
                      removed=[tp(3, "\n", 0.15), tp(4, " an", 0.05)], params={"top_k": 2})
    final = StageTrace("final", 2, 0.0, 0.66, 0.0, [tp(1, " the", 0.625), tp(2, " a", 0.375)])
    return StepTrace(index=index, chosen_token_id=2, chosen_token=" a", chosen_prob=0.375, raw_prob=0.3, draw=draw,
                     draw_low=0.625, draw_high=1.0, entropy=0.66, raw_entropy=1.2, stages=[raw, topk, final])


def test_readable_makes_whitespace_visible():
    assert charts.readable(" the\n\t") == "␣the↵⇥"
    assert charts.readable("") == "∅"


def test_stage_chart_bars_marks_and_draw():
    fig = charts.stage_chart(make_step())
    bars = [t for t in fig.data if t.type == "bar"]
    # raw, top_k (+ its removed overlay), final, draw panel
    assert len(bars) == 5
    raw, topk, removed, final, draw = bars
    assert list(raw.y) == ["␣the", "␣a", "↵", "␣an"] and list(raw.x) == [0.5, 0.3, 0.15, 0.05]
    assert list(topk.marker.color) == [charts.BAR, charts.ACCENT]  # chosen token highlighted
    assert list(removed.y) == ["✕ ↵", "✕ ␣an"] and list(removed.x) == [0.15, 0.05]
    assert list(draw.base) == [0.0, 0.625] and list(draw.x) == [0.625, 0.375]
    u_line = [t for t in fig.data if t.type == "scatter"][0]
    assert list(u_line.x) == [0.7, 0.7]
    titles = [a.text for a in fig.layout.annotations]
    assert "top-k 2<br><sup>kept 2 · −20.0%</sup>" in titles


def test_greedy_step_has_no_draw_panel():
    fig = charts.stage_chart(make_step(draw=None))
    assert not [t for t in fig.data if t.type == "scatter"]
    assert len([t for t in fig.data if t.type == "bar"]) == 4


def test_run_chart_entropy_surprisal_in_bits():
    steps = [make_step(0), make_step(1)]
    fig = charts.run_chart(steps, selected=1)
    entropy, surprisal = fig.data
    assert list(entropy.y) == pytest.approx([0.66 / math.log(2)] * 2)
    assert list(surprisal.y) == pytest.approx([-math.log2(0.375)] * 2)
    assert fig.layout.shapes[0].x0 == 1


def test_token_highlights_scores():
    assert charts.token_highlights([make_step()]) == [(" a", -0.25)]  # 2 * 0.375 - 1


def test_explain_step_names_stage_effects_and_draw():
    text = charts.explain_step(make_step())
    assert "Top-k 2 kept 2 tokens covering 80.0% of the mass" in text
    assert "u = 0.700 fell in “␣a”" in text and "[0.625, 1.000)" in text


def test_summary_and_alternatives():
    step = make_step()
    trace = Trace(model="m", strategy="sample", config={}, prompt="p", prompt_token_ids=[0], text=" a",
                  generated_token_ids=[2], stop_reason="max_new_tokens", steps=[step],
                  timing=Timing(100.0, 10.0, 100.0), summary={"tokens": 1, "mean_logprob": -1.0, "mean_raw_logprob": -1.2, "perplexity": 3.3})
    assert "**1 tokens**" in charts.summary_markdown(trace) and "perplexity 3.30" in charts.summary_markdown(trace)
    alts = charts.alternatives(step)
    assert alts[0] == ("␣the  (raw 50.0%, final 62.5%)", 1)
    assert alts[1][0].endswith("← chosen") and alts[2] == ("↵  (raw 15.0%)", 3)
