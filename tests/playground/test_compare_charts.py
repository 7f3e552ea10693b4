"""Compare charts: one unit (nats), an explained divergence mark, and a note when two lanes with
the same seed but different knobs write the same text (hand-made traces)."""

from __future__ import annotations

from engine.trace import StageTrace, StepTrace, Timing, TokenProb, Trace
from playground.charts import compare as charts


def step(i: int, kept: int) -> StepTrace:
    final = StageTrace("final", kept, 0.0, 0.0, 0.0, [TokenProb(5, " a", 1.0 if kept == 1 else 0.6)])
    return StepTrace(i, 5, " a", 1.0, 0.5, 0.3, 0.0, 1.0, 0.0, 0.7, [final])


def lane(config: dict, kept: list[int]) -> Trace:
    steps = [step(i, k) for i, k in enumerate(kept)]
    return Trace("m", "sample", config, "p", [1], " a" * len(steps), [5] * len(steps), "max_new_tokens", steps,
                 Timing(1.0, 1.0, 1.0))


def test_same_text_note_explains_a_single_token_cut():
    creative = lane({"strategy": "sample", "temperature": 0.9, "top_p": 0.05}, [1, 1])
    wild = lane({"strategy": "sample", "temperature": 1.5, "top_p": 0.05}, [1, 1])
    note = charts.same_text_note(["creative", "wild"], [creative, wild])
    assert "creative and wild wrote the same text" in note and "cut the choice to one token" in note


def test_same_text_note_explains_a_shared_draw_and_stays_quiet_otherwise():
    a = lane({"strategy": "sample", "temperature": 0.9}, [40, 1])
    b = lane({"strategy": "sample", "temperature": 1.5}, [900, 1])
    assert "each step drew the same u" in charts.same_text_note(["A", "B"], [a, b])
    assert "(1 of 2 steps had only one token left)" in charts.same_text_note(["A", "B"], [a, b])
    other_seed = lane({"strategy": "sample", "temperature": 1.5, "seed": 3}, [900, 1])
    assert charts.same_text_note(["A", "B"], [a, other_seed]) == ""
    assert charts.same_text_note(["A", "A again"], [a, a]) == ""  # same knobs: nothing to explain


def test_divergence_mark_is_words_and_units_are_nats():
    assert "◆" not in charts.DIVERGE_MARK and "differ" in charts.DIVERGE_MARK
    fig = charts.entropy_chart(["A"], [lane({}, [2, 2]).steps])
    assert "nats" in fig.layout.title.text and "bits" not in fig.data[0].hovertemplate
    assert fig.layout.legend.y < 0 and fig.layout.font.size >= 14
    assert "rep-4: the share" in charts.metrics_glossary() and "(raw, nats)" in charts.METRIC_HEADERS[3]


def test_lane_colours_have_aa_contrast():
    from tests.helpers.step_charts import contrast

    assert all(contrast(c) >= 4.5 for c in charts.LANE_COLOURS)
