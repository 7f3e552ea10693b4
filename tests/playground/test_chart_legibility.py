"""Issue #52, chart legibility, on the figures' own numbers (tests/browser/test_chart_legibility_browser.py
measures the same charts drawn): a presenter's panel holds at most the rows its box labels, the rest
of the tokens a stage removed summed in one "✕ N more" row; every bar labelled (plotly would label
every other one of a crowded axis); panel titles wrapped to the room between panels and below the
chart's own title; Step through's panels as tall as their labelled rows; the methods chart's
variants as level names on horizontal bars, with a phone layout; the methods table's columns
within a 1280 px page; the logit lens's cells light under their dark token text."""

from __future__ import annotations

import math

import pytest

from engine.trace import StageTrace, StepTrace, TokenProb
from playground.charts import presenter
from playground.charts import quant_methods
from playground.charts import step as charts
from playground.charts.inside import lens_figure
from playground.charts.tables import column_widths
from tests.helpers.quant_methods import _comparison

PAGE_PX = 1240  # a 1280 px page less its padding


def grammar_step(removed: int = 16) -> StepTrace:
    """A yes/no/maybe step 0: the model wanted other words; the grammar kept "yes", "no", "maybe"
    and removed ``removed`` tokens of the raw top-N, the chosen "no" among the kept."""
    words = [TokenProb(100 + i, f" w{i}", 0.5 / (i + 2)) for i in range(removed)]
    kept = [TokenProb(1, "yes", 0.5), TokenProb(2, "no", 0.3), TokenProb(3, "maybe", 0.2)]
    raw = StageTrace("raw", 49152, 0.0, 3.1, 0.0, words[:9] + [TokenProb(1, "yes", 0.02), TokenProb(2, "no", 0.01),
                                                              TokenProb(3, "maybe", 0.004)])
    grammar = StageTrace("grammar", 3, 0.966, 1.0, 0.966, kept, removed=words,
                         params={"grammar_kind": "regex", "allowed": 3, "complete": False, "ended": False,
                                 "off_grammar_at": None, "wanted_id": 100, "wanted_p": words[0].prob,
                                 "log_allowed_mass": math.log(0.034)})
    final = StageTrace("final", 3, 0.0, 1.0, 0.0, list(kept))
    return StepTrace(index=0, chosen_token_id=2, chosen_token="no", chosen_prob=0.3, raw_prob=0.01, draw=0.6,
                     draw_low=0.5, draw_high=0.8, entropy=1.0, raw_entropy=3.1, stages=[raw, grammar, final])


def panel_traces(fig, i: int) -> list:
    suffix = "" if i == 0 else str(i + 1)
    return [t for t in fig.data if t.type == "bar" and t.yaxis == f"y{suffix}" and any(x is not None for x in t.x)]


def test_a_capped_panel_sums_the_rest_of_the_removed_tokens_in_one_row():
    step = grammar_step(16)
    fig = charts.stage_chart(step, max_rows=10)
    kept, removed = panel_traces(fig, 1)  # the grammar's panel: its kept tokens, then the removed ones hatched
    assert list(kept.y) == ["yes", "no", "maybe"]
    shown = 10 - 3 - 1  # the rows the kept tokens leave, less the summing row
    assert list(removed.y) == [f"✕ ␣w{i}" for i in range(shown)] + [f"✕ {16 - shown} more"]
    rest = step.stages[1].removed[shown:]
    assert removed.x[-1] == pytest.approx(sum(t.prob for t in rest))
    assert sum(removed.x) == pytest.approx(sum(t.prob for t in step.stages[1].removed))  # no mass lost
    assert charts.panel_rows(step, 10)[1] == 10 == len(kept.y) + len(removed.y)
    assert charts.panel_rows(step)[1] == 19  # uncapped: every removed token its own row
    uncapped = panel_traces(charts.stage_chart(step), 1)[1]
    assert len(uncapped.y) == 16 and list(uncapped.x) == [t.prob for t in step.stages[1].removed]


def test_no_cap_when_the_removed_tokens_fit():
    step = grammar_step(4)
    assert charts.removed_rows(step.stages[1], step, 10) == 7
    assert list(panel_traces(charts.stage_chart(step, max_rows=10), 1)[1].y) == [f"✕ ␣w{i}" for i in range(4)]
    assert charts.removed_rows(step.stages[0], step, 10) is None  # raw removed nothing


@pytest.mark.parametrize("width", [None, 1280])
def test_the_presenters_panels_hold_what_their_box_labels_under_titles_that_fit(width):
    step = grammar_step(16)
    fig = presenter.step_chart(step, width)
    columns = fig.layout.meta["columns"]
    assert columns == 4  # raw, grammar, final and the draw in one row of a projector
    top = fig.layout.margin.t
    wrap = presenter.title_wrap(width, columns)
    titles = charts.panel_titles(step, wrap)
    assert [a.text for a in fig.layout.annotations][:4] == titles
    # the titles' lines under the chart's own title (its two lines and pad) and above the bars
    tallest = max(charts.title_px(t, presenter.TITLE_FONT / (charts.FONT + 1)) for t in titles)
    assert top >= presenter.TITLE_TOP_PX + tallest
    assert max(t.count("<br>") + 1 for t in titles) >= 4  # the grammar's title does wrap
    # a title line as wide as the pitch between panel middles, so it stops where its neighbour's starts
    pitch = 1280 * ((1 - (columns - 1) * 0.12) / columns + 0.12)
    assert wrap * presenter.TITLE_FONT * presenter.CHAR_EM <= pitch
    area = presenter.PRESENT_BOX_PX - top - presenter.BOTTOM_PX
    assert fig.layout.yaxis.tickfont.size >= 18  # projector-sized
    fit = int(area // (presenter.WIDE_TICK_FONT * presenter.ROW_EM))  # rows of 18 px labels
    assert sum(len(t.y) for t in panel_traces(fig, 1)) == fit  # the grammar's 19 rows capped to what fits
    shown = fit - 3 - 1  # the grammar kept 3; one row sums the rest
    assert list(panel_traces(fig, 1)[1].y)[-1] == f"✕ {16 - shown} more"
    assert all(fig.layout[name].tickmode == "linear" and fig.layout[name].dtick == 1
               for name in fig.layout if name.startswith("yaxis"))  # every bar labelled


def test_step_through_gives_every_row_its_label_height_and_the_titles_their_lines():
    step = grammar_step(16)
    fig = charts.fitted_stage_chart(step, 1280)
    titles = [a.text for a in fig.layout.annotations][:4]
    room = charts.chart_room(titles, 1, 4, max(charts.panel_rows(step)), None, 260)
    assert room.panel >= 19 * charts.ROW_PX  # the grammar panel's 19 rows, each its 14 px label
    assert fig.layout.margin.t >= charts.MAIN_TITLE_PX + max(charts.title_px(t) for t in titles)
    domain = fig.layout.yaxis2.domain
    plot_px = fig.layout.height - fig.layout.margin.t - fig.layout.margin.b
    assert (domain[1] - domain[0]) * plot_px >= 19 * charts.ROW_PX - 1
    assert fig.layout.yaxis2.tickmode == "linear" and fig.layout.yaxis2.dtick == 1
    phone = charts.fitted_stage_chart(step, 390)  # one column: the rows' gap holds the next title's lines
    heads = [charts.title_px(a.text) for a in phone.layout.annotations][:4]
    gaps = [phone.layout[f"yaxis{i + 1 if i else ''}"].domain[0] - phone.layout[f"yaxis{i + 2}"].domain[1]
            for i in range(3)]
    phone_plot = phone.layout.height - phone.layout.margin.t - phone.layout.margin.b
    assert all(g * phone_plot >= h + charts.XTICK_PX - 1 for g, h in zip(gaps, heads[1:]))


def test_the_methods_chart_has_level_names_and_a_phone_layout():
    report = _comparison()
    fig = quant_methods.comparison_figure(report)
    assert all(t.orientation == "h" for t in fig.data)
    names = [quant_methods.variant_label(r.variant) for r in report.rows]
    assert [list(t.y) for t in fig.data] == [names, names]
    assert not fig.layout.xaxis.tickangle and not fig.layout.yaxis.tickangle
    layouts = fig.layout.meta["layouts"]
    phone, wide = layouts["phone"], layouts["wide"]
    assert layouts["below"] == 560
    # wide: side by side, the right panel's rows the left's (names once); phone: one above the other, each named
    assert wide["xaxis"]["domain"][1] < wide["xaxis2"]["domain"][0] and wide["yaxis2"]["matches"] == "y"
    assert phone["yaxis"]["domain"][0] > phone["yaxis2"]["domain"][1]
    assert phone["yaxis2"].get("showticklabels", True)
    plot_px = phone["height"] - phone["margin"]["t"] - phone["margin"]["b"]
    for axis in ("yaxis", "yaxis2"):
        low, high = phone[axis]["domain"]
        assert (high - low) * plot_px >= len(names) * quant_methods.ROW_PX - 1  # a row per name at 14 px


def test_the_methods_table_fits_a_1280_px_page():
    rows = quant_methods.comparison_rows(_comparison())
    widths = column_widths(quant_methods.COMPARE_HEADERS, rows)
    assert sum(int(w.removesuffix("px")) for w in widths) <= PAGE_PX


def brightness(colour: str) -> float:
    """tinycolor's perceived brightness, 0-255: plotly writes a heatmap cell's text dark above 128."""
    r, g, b = (int(colour[i:i + 2], 16) for i in (1, 3, 5))
    return (r * 299 + g * 587 + b * 114) / 1000


def luminance(colour: str) -> float:
    def linear(c: int) -> float:
        c /= 255
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4
    r, g, b = (int(colour[i:i + 2], 16) for i in (1, 3, 5))
    return 0.2126 * linear(r) + 0.7152 * linear(g) + 0.0722 * linear(b)


def test_the_lens_cells_stay_light_under_dark_text():
    from types import SimpleNamespace

    layers = [SimpleNamespace(layer=i, top=[TokenProb(1, "a", 0.9), TokenProb(2, "b", 0.1)], chosen_prob=0.5,
                              chosen_rank=1, entropy=1.0) for i in range(3)]
    lens = SimpleNamespace(layers=layers, top_k=2, chosen_token="a", chosen_token_id=1)
    heat = lens_figure(lens).data[0]
    ends = [c for _, c in heat.colorscale]
    # every cell colour lies between the two ends: all light, so plotly writes every token dark (#444),
    # none in the mid-blue band where neither its dark nor its white text reads
    assert all(brightness(c) > 128 for c in ends)
    assert all((luminance(c) + 0.05) / (luminance("#444444") + 0.05) >= 4 for c in ends)
