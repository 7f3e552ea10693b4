"""Step-through chart builders are pure functions of a trace: checked on a hand-made 2-step trace."""

import dataclasses
import math

import pytest

from engine.trace import StageTrace, StepTrace, Timing, TokenProb, Trace
from playground.charts import step as charts
from tests.helpers.step_charts import contrast  # noqa: F401


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
    bars = [t for t in fig.data if t.type == "bar" and t.x != (None,)]  # legend swatches have no data
    # raw, top_k (+ its removed overlay), final, draw panel
    assert len(bars) == 5
    raw, topk, removed, final, draw = bars
    assert list(raw.y) == ["␣the", "␣a", "↵", "␣an"] and list(raw.x) == [0.5, 0.3, 0.15, 0.05]
    assert list(topk.marker.color) == [charts.BAR, charts.ACCENT]  # chosen token highlighted
    assert list(removed.y) == ["✕ ↵", "✕ ␣an"] and list(removed.x) == [0.15, 0.05]
    assert list(draw.base) == [0.0, 0.625] and list(draw.x) == [0.625, 0.375]
    u_line = fig.layout.shapes[0]
    assert (u_line.x0, u_line.x1) == (0.7, 0.7) and u_line.yref.endswith("domain")  # spans the panel
    titles = [a.text for a in fig.layout.annotations]
    assert "top-k: keep<br>the top 2<br><sup>kept 2 tokens</sup><br><sup>−20.0%</sup>" in titles  # short lines fit a phone
    assert "u = 0.700" in titles  # the u value is written beside its line


@pytest.mark.parametrize("columns", [1, 2, 3])
def test_each_panel_has_its_own_axes_in_a_grid_and_charts_share_no_layout(columns):
    """The chart is built as dicts over a cached grid: panel i's bars are on axes i + 1, the axes
    tile the page row by row, the u line sits on the draw panel, and no two charts share state."""
    step = make_step()
    fig = charts.stage_chart(step, columns=columns)
    panels = [t for t in fig.data if t.type == "bar" and t.x != (None,)]
    raw, topk, removed, final, draw = panels
    axes = [(t.xaxis, t.yaxis) for t in (raw, topk, final, draw)]
    assert axes == [("x", "y"), ("x2", "y2"), ("x3", "y3"), ("x4", "y4")]
    assert (removed.xaxis, removed.yaxis) == ("x2", "y2")  # the removed overlay on its stage's panel
    lefts = [fig.layout[f"xaxis{s}"].domain[0] for s in ("", "2", "3", "4")]
    tops = [fig.layout[f"yaxis{s}"].domain[1] for s in ("", "2", "3", "4")]
    for i in range(4):  # same column as panel i - columns, one row further down
        if i >= columns:
            assert lefts[i] == lefts[i - columns] and tops[i] < tops[i - columns]
    assert (fig.layout.shapes[0].xref, fig.layout.shapes[0].yref) == ("x4", "y4 domain")
    assert list(fig.layout.xaxis4.range) == [0, 1] and fig.layout.xaxis.range[1] < 1  # draw panel 0..1, stages shared
    fig.layout.xaxis.domain = [0.4, 0.5]  # a caller changing one figure...
    again = charts.stage_chart(step, columns=columns)
    assert again.layout.xaxis.domain[0] == lefts[0]  # ...changes no other


def test_greedy_step_has_no_draw_panel():
    fig = charts.stage_chart(make_step(draw=None))
    assert not fig.layout.shapes
    assert len([t for t in fig.data if t.type == "bar" and t.x != (None,)]) == 4


def test_run_chart_entropy_surprisal_in_nats_with_own_marker_colour():
    steps = [make_step(0), make_step(1)]
    fig = charts.run_chart(steps, selected=1)
    entropy, surprisal, marker = fig.data
    assert list(entropy.y) == pytest.approx([0.66] * 2)
    assert list(surprisal.y) == pytest.approx([-math.log(0.375)] * 2)  # 0.981 nats
    assert fig.layout.shapes[0].x0 == 1
    colours = {entropy.line.color, surprisal.line.color, fig.layout.shapes[0].line.color}
    assert len(colours) == 3 and marker.line.color == charts.MARKER
    assert fig.layout.legend.y < 0  # below the plot, clear of the component label


def test_token_highlights_scores():
    assert charts.token_highlights([make_step()]) == [(" a", -0.25)]  # 2 * 0.375 - 1
    # surprisal: -ln 0.375 = 0.981 nats -> 0.981 / 5 = 0.1962; the most surprising is the strongest
    assert charts.token_highlights([make_step()], "surprisal") == [(" a", 0.1962)]
    rare = dataclasses.replace(make_step(), chosen_prob=1e-4)  # 9.2 nats -> capped at 1
    assert charts.token_highlights([rare], "surprisal")[0][1] == 1.0
    newline = dataclasses.replace(make_step(), chosen_token="\n")
    assert charts.token_highlights([newline])[0][0] == "↵\n"  # visible chip, then the line break
    with pytest.raises(ValueError, match="colour_by: 'bits'"):
        charts.token_highlights([make_step()], "bits")
    assert "surprising (≥ 5 nats" in charts.colour_legend("surprisal")


def test_explain_step_names_stage_effects_and_draw():
    text = charts.explain_step(make_step())
    assert "Top-k 2 kept 2 tokens and removed 20.0% of the mass" in text  # the panel's subtitle says −20.0%
    assert "u = 0.700 fell in “␣a”" in text and "[0.625, 1.000)" in text
    # one line per stage from stage_notes, the same words the stage's own note gives
    from playground.charts.stage_notes import stage_note

    assert "Stage by stage:\n- " in text
    assert all(stage_note(stage) in text for stage in make_step().stages[1:-1])


def test_summary_and_alternatives():
    step = make_step()
    trace = Trace(model="m", strategy="sample", config={}, prompt="p", prompt_token_ids=[0], text=" a",
                  generated_token_ids=[2], stop_reason="max_new_tokens", steps=[step],
                  timing=Timing(100.0, 10.0, 100.0), summary={"tokens": 1, "mean_logprob": -1.0, "mean_raw_logprob": -1.2, "perplexity": 3.3})
    assert "**1 token**" in charts.summary_markdown(trace) and "perplexity 3.30" in charts.summary_markdown(trace)
    assert "stop: max_new_tokens reached" in charts.summary_markdown(trace)
    stopped = dataclasses.replace(trace, stop_reason="")
    assert "stop: stopped before the end" in charts.summary_markdown(stopped)
    assert "stop: running…" in charts.summary_markdown(stopped, running=True)
    alts = charts.alternatives(step)
    assert alts[0] == ("␣the  (raw 50.0%, final 62.5%)", 1)
    assert alts[1][0].endswith("← chosen") and alts[2] == ("↵  (raw 15.0%)", 3)


def test_stage_panels_share_one_probability_axis():
    """Shared: every stage panel spans 0 to the largest shown p (0.625) + 8%; the draw panel 0..1."""
    fig = charts.stage_chart(make_step())
    ranges = [fig.layout[f"xaxis{i}"].range for i in ("", "2", "3")]
    assert all(r == pytest.approx((0, 0.625 * 1.08)) for r in ranges)
    assert fig.layout.xaxis4.range == (0, 1)
    own = charts.stage_chart(make_step(), shared_axis=False)
    assert own.layout.xaxis.range is None and "own scale" in own.layout.title.text


def test_a_shared_axis_below_5_percent_writes_ticks_that_differ():
    """Issue #35: a flat T = 5 step's panels run 0-0.2%, whose whole-percent ticks all read "0%"."""
    flat = [tp(i, f"t{i}", 0.002 - i * 1e-4) for i in range(1, 11)]
    raw = StageTrace("raw", 49152, 0.0, 10.0, 0.0, flat)
    final = StageTrace("final", 49152, 0.0, 10.0, 0.0, flat)
    step = StepTrace(index=0, chosen_token_id=1, chosen_token="t1", chosen_prob=0.0019, raw_prob=0.0019, draw=None,
                     draw_low=None, draw_high=None, entropy=10.0, raw_entropy=10.0, stages=[raw, final])
    fig = charts.stage_chart(step)
    top = fig.layout.xaxis.range[1]
    for axis in (fig.layout.xaxis, fig.layout.xaxis2):
        ticks = [format(top * k / 3, axis.tickformat) for k in range(4)]  # d3's "%" format is Python's
        assert len(set(ticks)) == 4 and ticks[1] != "0%", ticks
    assert charts.stage_chart(make_step()).layout.xaxis.tickformat == ".0%"  # 0-67.5%: whole percent
    assert charts.tick_format(0.049) == ".1%" and charts.tick_format(0.0004) == ".3%"


def test_chosen_token_outside_top_n_is_drawn_after_a_gap_with_its_rank():
    """Chosen " Not" is in no stage's top list: raw shows raw_prob, final shows chosen_prob, the
    middle stage says its p is not recorded instead of inventing one."""
    step = dataclasses.replace(make_step(), chosen_token_id=9, chosen_token=" Not", chosen_prob=0.006, raw_prob=0.004,
                               draw=0.999, draw_low=0.994, draw_high=1.0)
    fig = charts.stage_chart(step)
    raw, topk, _removed, final = [t for t in fig.data if t.type == "bar" and t.x != (None,)][:4]
    assert list(raw.y[-2:]) == [charts.GAP, "␣Not (rank>4)"] and raw.x[-1] == 0.004
    assert list(topk.y[-1:]) == ["␣Not (rank>2)"] and topk.x[-1] == 0 and topk.text[-1] == "p not recorded"
    assert final.x[-1] == 0.006 and final.marker.color[-1] == charts.ACCENT and final.text[-1] == ""


def test_u_label_stays_visible_with_one_token_and_u_near_one():
    """top-k 1: one bar; u = 0.987 is written in the panel title and beside the line, anchored
    to the line's left so it cannot run off the right edge."""
    step = make_step(draw=0.987)
    step.stages = [step.stages[0], StageTrace("final", 1, 0.0, 0.0, 0.0, [tp(1, " the", 1.0)])]
    fig = charts.stage_chart(step)
    texts = [a.text for a in fig.layout.annotations]
    assert any("u = 0.987" in t and "landed" in t for t in texts)
    label = next(a for a in fig.layout.annotations if a.text == "u = 0.987")
    assert label.xanchor == "right"


def test_kept_is_singular_for_one_token_and_fonts_are_14px():
    stage = StageTrace("top_k", 1, 0.5, 0.0, 0.5, [tp(1, " the", 1.0)], params={"top_k": 1})
    assert "kept 1 token" in charts.stage_title(stage) and "tokens" not in charts.stage_title(stage)
    fig = charts.stage_chart(make_step())
    assert fig.layout.font.size >= 14 and fig.layout.yaxis.tickfont.size >= 14
    assert all(a.font.size >= 14 for a in fig.layout.annotations)


def test_titles_wrap_instead_of_running_into_each_other():
    stage = StageTrace("repetition_penalty", 10, 0.0, 1.0, 0.1, [], params={"repetition_penalty": 1.3})
    first_line = charts.stage_title(stage).split("<br>")[0]
    assert len(first_line) <= charts.TITLE_WRAP


def test_colours_have_wcag_aa_contrast_on_white():
    assert contrast("#767676") == pytest.approx(4.54, abs=0.01)  # the known AA grey
    for colour in (charts.ACCENT, charts.BAR, charts.REMOVED, charts.DRAW, charts.MARKER, charts.ENTROPY, charts.SURPRISAL):
        assert contrast(colour) >= 4.5, colour


def test_hovers_explain_terms_from_the_glossary():
    from playground.charts import glossary

    fig = charts.stage_chart(make_step())
    topk = [t for t in fig.data if t.type == "bar" and t.name == "top_k"][0]
    assert glossary.hover("kept") in topk.hovertemplate and glossary.hover("top-k") in topk.hovertemplate
    assert charts.plot_config()["scrollZoom"] is True


def test_draw_panel_shows_the_share_of_tokens_outside_the_top_n():
    """At T = 5 the top-N hold a sliver of the mass: the draw panel draws the rest of the
    vocabulary as one grey bar from the top-N's sum to 1, so a u past the top-N lands on a bar
    (before, the panel was an empty [0, 1] axis with slivers at 0)."""
    flat = [tp(i, f" t{i}", 0.002) for i in range(1, 4)]
    final = StageTrace("final", 49_000, 0.0, 10.7, 0.0, flat)
    raw = StageTrace("raw", 49_152, 0.0, 4.0, 0.0, [tp(1, " t1", 0.4), tp(2, " t2", 0.2), tp(3, " t3", 0.1)])
    temperature = StageTrace("temperature", 49_000, 0.0, 10.7, 0.5, flat, params={"temperature": 5.0})
    step = StepTrace(index=3, chosen_token_id=77, chosen_token=" far", chosen_prob=0.00002, raw_prob=1e-7, draw=0.61,
                     draw_low=0.60999, draw_high=0.61001, entropy=10.7, raw_entropy=4.0,
                     stages=[raw, temperature, final])
    fig = charts.stage_chart(step)
    draw = [t for t in fig.data if t.type == "bar" and t.x != (None,)][-1]
    assert draw.y[-1] == "other 48,997 tokens" and draw.marker.color[-1] == charts.REST
    assert draw.base[-1] == pytest.approx(0.006) and draw.x[-1] == pytest.approx(0.994)
    assert draw.base[-1] <= step.draw <= draw.base[-1] + draw.x[-1]  # u lands on it
    assert list(fig.layout.xaxis4.range) == [0, 1]
    # a step whose top-N hold (nearly) all the mass draws no such bar (test_stage_chart_bars_marks_and_draw)
