"""Beam charts: legend names for every marker, 14 px text, the ended wording, readable headers."""

from __future__ import annotations

from engine.beam import BeamHypothesis, BeamTrace
from playground.charts import beam as charts


def hyp(reason: str) -> BeamHypothesis:
    return BeamHypothesis(token_ids=[1, 2], text="a b", sum_logprobs=-1.0, length=2, score=-0.5, finish_reason=reason, path=[0, 0])


def search(reasons: list[str], ended_by: str = "no_continuation") -> BeamTrace:
    return BeamTrace(num_beams=2, num_beam_groups=1, length_penalty=1.0, early_stopping=False, candidates_per_step=4,
                     hypotheses=[hyp(r) for r in reasons], ended_by=ended_by)


def test_ended_wording_says_which_limit():
    assert charts.ended_text(search(["max_new_tokens", "max_new_tokens"])) == "ended: every beam reached max_new_tokens"
    assert charts.ended_text(search(["eos", "max_new_tokens"])) == "ended: max_new_tokens reached"
    assert charts.ended_text(search(["eos", "eos"])) == "ended: every beam finished"
    assert charts.ended_text(search(["eos"], "early_stopping")) == "ended by early stopping"


def test_every_marker_status_has_a_legend_name_and_colours_are_visible():
    from test_step_charts import contrast

    assert set(charts.STATUS_NAMES) == set(charts.STATUS_COLOURS)
    assert "diamond" in charts.STATUS_NAMES["finished"] and "dot" in charts.STATUS_NAMES["kept"]
    for colour in [*charts.STATUS_COLOURS.values(), charts.WINNER]:
        assert contrast(colour) >= 3.0, colour  # graphics: WCAG AA 3:1


def test_headers_are_short_and_explained():
    assert len(charts.HYPOTHESES_HEADERS) == len(charts.HYPOTHESES_WIDTHS) == 7
    assert max(len(h) for h in charts.HYPOTHESES_HEADERS) <= 9  # no one-letter-per-line wrapping
    assert "found: the search's own rank" in charts.HYPOTHESES_NOTE and "nats" in charts.HYPOTHESES_NOTE
    assert "scroll" not in charts.TREE_TITLE  # gr.Plot cannot turn plotly's scrollZoom on
