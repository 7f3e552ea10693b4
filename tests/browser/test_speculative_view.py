"""Speculative view: the pure chart/HTML builders on a hand-made trace, then (slow) the API endpoint
and a real browser clicking a chip."""

from __future__ import annotations

import math
import re

import pytest

from engine.strategies.speculative import DraftToken, ExtraToken, SpecRound, rounds_of
from engine.trace import Timing, Trace
from playground.charts import speculative as charts
from tests.helpers.speculative_view import hand_rounds  # noqa: F401
from tests.helpers.api import api_client


def chips(html: str) -> list[tuple[str, str, str]]:
    """(kind, round, pos) of every chip, in order."""
    return re.findall(r'data-round="(\d+)" data-pos="(\d+)" data-kind="(\w+)"', html)


def test_rounds_html_has_one_chip_per_draft_plus_the_targets_token():
    html = charts.rounds_html(hand_rounds())
    assert chips(html) == [("0", "0", "accepted"), ("0", "1", "accepted"), ("0", "2", "rejected"), ("0", "2", "resampled"),
                           ("1", "0", "accepted"), ("1", "1", "accepted"), ("1", "2", "bonus")]
    assert html.count('class="spec-round"') == 2
    assert "line-through" in html  # the rejected draft is struck out
    assert "#0 · K=3 · 2/3 accepted · +3 tokens" in html


def test_selected_chip_is_outlined_and_tokens_are_escaped():
    html = charts.rounds_html(hand_rounds(), selected=(0, 2))
    outlined = re.findall(r'data-round="(\d)" data-pos="(\d)"[^>]*outline:2px', html)
    assert outlined == [("0", "2"), ("0", "2")]  # the rejected draft and its replacement
    rounds = hand_rounds()
    rounds[0].drafted[0].token = "<b>"
    html = charts.rounds_html(rounds)
    assert "&lt;b&gt;</span>" in html and "<b>" not in html


def test_text_flows_in_emitted_order_with_origin_colours():
    html = charts.text_html(hand_rounds())
    tokens = re.findall(r'class="spec-tok spec-tok-(\w+)"[^>]*>([^<]*)</span>', html)
    assert tokens == [("accepted", "The"), ("accepted", " cat"), ("resampled", " lay"),
                      ("accepted", " on"), ("accepted", " the"), ("bonus", " mat")]


def test_acceptance_test_written_out():
    rounds = hand_rounds()
    text = charts.acceptance_text(rounds[0], 2)
    assert "p=0.10, q=0.60 → accept with 0.17; u=0.90 → rejected" in text
    assert "resampled **␣lay**" in text and "probability 0.500" in text
    assert "p=0.40, q=0.50 → accept with 0.80; u=0.70 → accepted" in charts.acceptance_text(rounds[0], 1)
    assert "All 2 drafts were accepted" in charts.acceptance_text(rounds[1], 2)
    assert "sampled from the target's distribution p" in charts.acceptance_text(rounds[1], 2)
    miss = SpecRound(2, 6, 4, [], 0, rounds[1].bonus, [17], " mat", 0.1, 9.0, 70.0)  # the n-gram drafter found nothing
    assert "proposed nothing" in charts.acceptance_text(miss, 0)


def test_greedy_acceptance_text_names_the_argmax():
    rounds = hand_rounds()
    d = rounds[0].drafted[2]
    greedy = SpecRound(0, 0, 3, [DraftToken(0, d.token_id, d.token, d.q, d.p, 0.0, None, False, d.q_top, d.p_top,
                                            ExtraToken("resampled", 13, " lay", 0.3, 0.3, d.p_top))],
                       0, None, [13], " lay", 1.0, 1.0, 2.0)
    text = charts.acceptance_text(greedy, 0)
    assert "argmax" in text and "rejected" in text and "␣lay" in text


def test_p_vs_q_bars_cover_both_top_lists():
    fig = charts.pq_figure(hand_rounds()[0], 2)
    p_bar, q_bar = fig.data
    assert list(p_bar.y) == ["␣lay", "␣sat", "␣<b>"]  # p's top first, then q's tokens not already there
    assert list(p_bar.x) == [0.3, 0.1, 0.05]
    assert list(q_bar.x) == [0.1, 0.6, None]  # not in the drafter's stored top-N: no bar
    assert [c != "rgba(0,0,0,0)" for c in p_bar.marker.line.color] == [False, True, False]  # the draft is outlined
    bonus = charts.pq_figure(hand_rounds()[1], 2)
    assert len(bonus.data) == 1 and list(bonus.data[0].x) == [0.55, 0.2]


def test_residual_figure_only_where_the_target_chose():
    rounds = hand_rounds()
    assert charts.residual_figure(rounds[0], 0) is None  # accepted draft
    fig = charts.residual_figure(rounds[0], 2)
    assert list(fig.data[0].x) == [0.5, 0.25]
    assert list(fig.data[0].marker.color) == [charts.HIGHLIGHT, charts.P_COLOUR]
    assert "residual" in fig.layout.title.text
    assert "target distribution p" in charts.residual_figure(rounds[1], 2).layout.title.text


def test_accepted_length_chart_and_counters():
    rounds = hand_rounds()
    fig = charts.accepted_length_figure(rounds)
    assert list(fig.data[0].y) == [2, 2] and list(fig.data[3].y) == [3, 2]
    # the target's own token: resampled (orange) in round 0, the bonus (blue) in round 1, each in the legend
    assert [(t.name, list(t.y), t.marker.color) for t in fig.data[1:3]] == [
        ("resampled by the target", [1, 0], charts.KINDS["resampled"][0]),
        ("bonus token from the target", [0, 1], charts.KINDS["bonus"][0])]
    assert all(t.showlegend is not False for t in fig.data)
    c = charts.counters(rounds)
    assert c["acceptance_rate"] == pytest.approx(4 / 5) and c["tokens_per_target_forward"] == pytest.approx(3.0)
    assert math.isnan(c["speedup"])
    html = charts.counters_html(rounds, {"speedup": 1.7})
    assert "80.0%" in html and "3.00" in html and "1.70×" in html
    assert "—" in charts.counters_html([])


def test_positions_for_the_dropdown_round_trip():
    choices = charts.position_choices(hand_rounds())
    assert [v for _, v in choices] == ["0:0", "0:1", "0:2", "1:0", "1:1", "1:2"]
    assert "✗ → ␣lay" in choices[2][0] and "bonus ␣mat" in choices[5][0]
    assert charts.parse_position("1:2") == (1, 2)
    assert charts.parse_position("x") is None and charts.parse_position(None) is None


def test_builders_work_on_a_trace_read_back_from_json():
    trace = Trace("m", "speculative", {}, "p", [1], "The cat lay on the mat", [10, 11, 13, 15, 16, 17], "max_new_tokens",
                  [], Timing(0, 0, 0), rounds=hand_rounds())
    back = rounds_of(Trace.from_json(trace.to_json()))
    assert charts.rounds_html(back, (0, 2)) == charts.rounds_html(hand_rounds(), (0, 2))
    assert charts.acceptance_text(back[0], 2) == charts.acceptance_text(hand_rounds()[0], 2)


def test_summary_markdown_reports_the_speedup():
    summary = {"tokens": 6, "rounds": 2, "drafter": "ngram (n=3)", "accepted": 4, "drafted": 5, "acceptance_rate": 0.8,
               "tokens_per_target_forward": 3.0, "target_forwards_saved": 3, "draft_ms": 9.0, "verify_ms": 38.0,
               "total_ms": 55.0, "baseline_ms": 90.0, "baseline_tokens": 6, "speedup": 1.64, "baseline_same_tokens": True}
    text = charts.summary_markdown(summary)
    assert "4/5 drafts (80.0%)" in text and "**1.64× tokens/s**" in text and "6 tokens (the same tokens)" in text


def test_default_position_prefers_the_first_rejection():
    from playground.views.speculative import default_position

    assert default_position(hand_rounds()) == (0, 2)
    assert default_position(hand_rounds()[1:]) == (1, 0)
    assert default_position([]) is None


# --- through the app ----------------------------------------------------------------------------
@pytest.mark.slow
def test_speculative_trace_api(live_app):

    client = api_client(live_app)
    data = client.predict("Repeat exactly: one two three four five six seven eight.", {"max_new_tokens": 16},
                          "speculative-ngram", True, "embedded", "none", True, api_name="/speculative_trace")
    assert data["strategy"] == "speculative" and len(data["generated_token_ids"]) <= 16
    emitted = [t for r in data["rounds"] for t in r["emitted_token_ids"]]
    assert emitted == data["generated_token_ids"]
    assert {"acceptance_rate", "tokens_per_target_forward", "speedup", "baseline_ms"} <= set(data["summary"])
    assert data["summary"]["baseline_same_tokens"] is True  # greedy preset: same tokens as target-only
    with pytest.raises(Exception, match="drafter"):
        client.predict("hi", {"drafter": "bogus"}, "speculative-ngram", False, "embedded", "none", False,
                       api_name="/speculative_trace")


@pytest.mark.slow
@pytest.mark.browser
def test_generate_then_click_a_chip(page, live_app, artifacts):
    page.goto(live_app)
    page.get_by_role("tab", name="Speculative").click()
    page.fill("#spec-knob-max_new_tokens input[type=number]", "16")
    page.locator("#spec-knob-max_new_tokens input[type=number]").press("Enter")
    page.click("#spec-generate")
    page.wait_for_selector("#spec-status:has-text('done')", timeout=300_000)
    chips = page.locator("#spec-rounds [data-chip]")
    assert chips.count() >= 2
    assert page.locator("#spec-acceptance").inner_text().strip().endswith("%")
    shown = page.locator("#spec-explain").inner_text()
    for i in range(chips.count()):  # a chip other than the one selected by default
        chip = chips.nth(i)
        r, pos, kind = (chip.get_attribute(a) for a in ("data-round", "data-pos", "data-kind"))
        expected = f"Round {r}, bonus" if kind == "bonus" else f"Round {r}, position {pos}:"
        if expected not in shown:
            break
    chip.click()
    page.wait_for_function(f"() => document.querySelector('#spec-explain')?.innerText.includes({expected!r})")
    assert page.locator("#spec-position input").input_value().startswith(f"round {r} · pos {pos}")
    assert page.locator("#spec-pq .js-plotly-plot").count() == 1
    page.screenshot(path=str(artifacts / "speculative.png"), full_page=True)


def test_special_drafts_get_a_one_line_note_naming_the_rounds():
    rounds = hand_rounds()
    assert charts.special_drafts_note(rounds) == "" and "spec-special-note" not in charts.rounds_html(rounds)
    rounds[1].drafted[0].token = "<|im_start|>"  # what the n-gram drafter copies from a chat prompt
    note = charts.special_drafts_note(rounds, "ngram")
    assert note.startswith("Round #1 drafted special tokens (⟪im_start⟫)")
    assert "n-gram drafter" in note and "chat template" in note and "\n" not in note
    html = charts.rounds_html(rounds, drafter="ngram")
    assert html.count('class="spec-special-note"') == 1 and "&lt;|im_start|&gt;" not in html.split("spec-special-note")[1][:400]


def test_empty_states_say_what_to_do():
    from playground.views import speculative as view

    out = view.Outputs(*[f"spec.{f}" for f in view.Outputs.__dataclass_fields__])
    session = view.SpecSession(hand_rounds())
    assert view.detail(out, session)[out.explain] == view.PICK_A_TOKEN  # a run, nothing selected
    assert "click a round's token to see p vs q" in view.EMPTY_EXPLAIN  # before any run
    assert view.detail(out, view.SpecSession())[out.explain] == ""
    session.selected = view.default_position(session.rounds)
    shown = view.detail(out, session)
    assert shown[out.pq] is not None and shown[out.residual] is not None  # the first rejection, filled at once
    assert view.selection_note(session).startswith("Showing the first rejected draft")
    session.selected = (1, 0)
    assert view.selection_note(session).startswith("Showing the first drafted token")
