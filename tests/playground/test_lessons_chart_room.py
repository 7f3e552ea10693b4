"""Issue #27: each lesson's chart must *show* the stage it teaches. The temperature lesson charts its
T = 5 run, whose temperature panel flattens the raw distribution (the tiny model's 13% top token to
0.03%, the embedded model's 76% to 0.1%): on the one probability axis the raw panel sets, its bars
were slivers, and the chosen token, outside every panel's top-N, read "p not recorded" in the
temperature and final panels though the trace records its p (temperature is the only stage that
moves mass, so the final distribution is the temperature panel's). The Lessons view now draws its
step as Compare's inspector does (``charts.compare.legible_stage_chart``). Driven through the tab's
own handler (``on_run``) over the tiny random Llama, as tests/playground/test_lessons_room.py does."""

from __future__ import annotations

import pytest

from tests.helpers.lessons_room import run, shown_chart, tab  # noqa: F401  (tab: the Lessons tab fixture)

from engine.reports.lessons import selected_step
from playground.charts.compare import NOT_RECORDED, chosen_prob_at

VISIBLE = 0.3  # the tallest bar's least share of its own axis


def axis_suffix(i: int) -> str:
    """Panel i's axes in the figure JSON: x, x2, x3..."""
    return "" if i == 0 else str(i + 1)


def panel_bars(data: dict, i: int) -> list[dict]:
    """The bars drawn in stage panel i (legend-only swatches have no data)."""
    return [t for t in data["data"] if t.get("type") == "bar" and t.get("xaxis", "x") == f"x{axis_suffix(i)}"
            and any(x is not None for x in t.get("x") or [])]


def axis_span(data: dict, i: int, tallest: float) -> float:
    """The length of panel i's probability axis: its set range, else plotly's autorange, which
    runs from 0 (rangemode tozero) to the tallest bar."""
    axis = data["layout"][f"xaxis{axis_suffix(i)}"]
    if axis.get("range") is not None:
        low, high = axis["range"]
        return high - low
    assert axis.get("rangemode") == "tozero"
    return tallest


@pytest.fixture(scope="module")
def temperature_run(tab):  # noqa: F811
    updates = run(tab, "temperature")
    session = updates[1]["session"]
    trace = session.traces[session.shown]
    step = trace.steps[selected_step(trace, session.lesson.select_step)]
    fig = shown_chart(updates)
    assert fig is not None
    return session, step, fig.to_plotly_json()


def test_the_temperature_panel_of_the_lessons_chart_has_visible_bars(temperature_run):
    session, step, data = temperature_run
    assert session.lesson.runs[session.shown].name == "T = 5"
    names = [s.name for s in step.stages]
    assert "temperature" in names
    i = names.index("temperature")
    top = step.stages[i].top[0].prob
    assert top < 0.1 * step.stages[0].top[0].prob  # flat: on the raw panel's axis it would be a sliver
    bars = panel_bars(data, i)
    tallest = max(x for t in bars for x in t["x"] if x is not None)
    assert tallest == pytest.approx(top)
    span = axis_span(data, i, tallest)
    assert tallest >= VISIBLE * span, (tallest, span)
    # Its ticks carry enough decimals to read a 0.03% panel ("0%, 0%, 0%" in whole percent).
    fmt = data["layout"][f"xaxis{axis_suffix(i)}"].get("tickformat", ".0%")
    assert float(format(tallest / 2, fmt).rstrip("%")) > 0, fmt


def test_no_panel_of_the_lessons_chart_says_p_not_recorded_where_the_trace_knows_p(temperature_run):
    _, step, data = temperature_run
    titles = " ".join(str(a.get("text", "")) for a in data["layout"].get("annotations", []))
    assert NOT_RECORDED not in titles
    known = 0
    for i in range(len(step.stages)):
        prob = chosen_prob_at(step, i)
        if prob is None:
            continue
        known += 1
        texts = [x for t in panel_bars(data, i) for x in t.get("text") or []]
        assert NOT_RECORDED not in texts, (step.stages[i].name, texts)
        drawn = [x for t in panel_bars(data, i) for x in t["x"] if x is not None]
        assert any(x == pytest.approx(prob) for x in drawn), (step.stages[i].name, prob)  # the chosen token's bar
    assert known == len(step.stages)  # raw, temperature and final all record the chosen token's p


@pytest.mark.parametrize("width", [None, 1280, 390])
def test_the_presenters_chart_of_that_step_is_legible_too(temperature_run, width):
    """The presenter draws the same step at projector size (and narrow): its temperature panel too
    has its own scale with visible bars, and no panel says "p not recorded" where p is known."""
    from playground.panels import presenter

    _, step, _ = temperature_run
    data = presenter.step_chart(step, width).to_plotly_json()
    i = [s.name for s in step.stages].index("temperature")
    tallest = max(x for t in panel_bars(data, i) for x in t["x"] if x is not None)
    assert tallest >= VISIBLE * axis_span(data, i, tallest)
    titles = " ".join(str(a.get("text", "")) for a in data["layout"].get("annotations", []))
    assert NOT_RECORDED not in titles


@pytest.mark.parametrize("width, columns", [(None, 4), (1280, 4), (800, 2), (390, 1)])
def test_the_lessons_chart_is_one_row_on_a_projector_and_stacks_on_a_phone(temperature_run, width, columns):
    """Issue #35: the chart lies on a projector's first screen (one row, 370 px, every bar labelled)
    and, below the narrow width, is laid out as Step through's chart (two a row, one on a phone),
    its layout named in ``meta`` so the page asks again after a resize."""
    from playground.views.lessons import LESSON_ROW_PX, lesson_stage_chart

    _, step, _ = temperature_run
    panels = len(step.stages) + (1 if step.draw is not None else 0)
    assert panels == 4  # raw, temperature, final, the draw
    fig = lesson_stage_chart(step, width)
    assert fig.layout.meta["columns"] == columns
    assert fig.layout.meta["narrow"] == (width is not None and width < 900)
    assert fig.layout.meta["phone"] == (width is not None and width < 600)
    xs = sorted({round(fig.layout[f"xaxis{axis_suffix(i)}"].domain[0], 3) for i in range(panels)})
    assert len(xs) == columns  # panels side by side in that many columns
    if columns == 4:
        assert fig.layout.height == LESSON_ROW_PX
        assert all(fig.layout[f"yaxis{axis_suffix(i)}"].dtick == 1 for i in range(panels))  # every token labelled
