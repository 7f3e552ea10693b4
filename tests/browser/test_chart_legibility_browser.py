"""Issue #52, chart legibility, measured where plotly lays the text out (chromium): at 1280x720 and
390x844 no two text labels of a chart overlap (tick labels, panel titles, the chart's title, the
numbers beside bars) and every bar of every panel has its token label. The charts: the Step
through chart and the presenter's of the embedded model's steps that crowded them (a sampled step at
T 2.5 under top-k and top-p: five stage panels and the draw; a yes/no/maybe grammar step: 19 rows in
its grammar panel under a five-line title), the quantization methods chart (a report of six
variants, wide and in its phone layout), and the presenter view itself (?present=1) on a lesson run."""

from __future__ import annotations

import json

import plotly
import pytest

from engine import runner
from engine.config import DecodingConfig
from engine.runner import RunRequest
from engine.trace import StepTrace
from playground.charts import presenter
from playground.charts import quant_methods
from playground.charts import step as charts
from playground.views.lessons import lesson_token
from tests.helpers.presenter_browser import LESSON, wait_for_step
from tests.helpers.quant_methods import _comparison

pytestmark = [pytest.mark.slow, pytest.mark.browser]

SIZES = ((1280, 720), (390, 844))
SLACK_PX = 1  # two boxes touching at an edge (rounding) do not overlap

# Every visible text of the rendered chart, its box, and each panel's tick labels with the
# categories its bars draw (plotly's own data: gd._fullData).
MEASURE_JS = """(root) => {
  const gd = root.classList.contains('js-plotly-plot') ? root : root.querySelector('.js-plotly-plot');
  const texts = [];
  gd.querySelectorAll('text').forEach(t => {
    const r = t.getBoundingClientRect();
    const s = getComputedStyle(t);
    if (!t.textContent.trim() || r.width === 0 || s.display === 'none' || s.visibility === 'hidden'
        || s.opacity === '0' || t.closest('.hoverlayer, .legend')) return;
    texts.push({text: t.textContent, x: r.x, y: r.y, w: r.width, h: r.height});
  });
  const svg = gd.querySelector('.main-svg').getBoundingClientRect();
  const outside = texts.filter(t => t.x < svg.x - 1 || t.x + t.w > svg.x + svg.width + 1
                                    || t.y < svg.y - 1 || t.y + t.h > svg.y + svg.height + 1)
    .map(t => `${t.text} at ${Math.round(t.x)},${Math.round(t.y)} ${Math.round(t.w)}x${Math.round(t.h)}`
              + ` in ${svg.width}x${svg.height}`);
  const panels = {};
  gd._fullData.filter(d => d.type === 'bar').forEach(d => {
    const cats = (d.orientation === 'h' ? d.y : d.x) || [];
    const axis = d.orientation === 'h' ? d.yaxis : d.xaxis;
    const key = d.xaxis + d.yaxis;
    panels[key] = panels[key] || {cats: new Set(), ticks: [], axis: axis};
    cats.filter(c => c !== null && c !== undefined && String(c).trim()).forEach(c => panels[key].cats.add(String(c)));
  });
  const out = {};
  for (const [key, p] of Object.entries(panels)) {
    const ax = gd._fullLayout[p.axis[0] + 'axis' + p.axis.slice(1)];
    // an axis that matches another and hides its labels shares that one's (the methods chart's right panel)
    const labelled = !ax.showticklabels && ax.matches ? ax.matches : p.axis;
    const ticks = [...gd.querySelectorAll(`.${labelled}tick text`)]  // plotly's class: y2tick for axis y2
      .map(t => t.textContent).filter(t => t.trim());
    out[key] = {cats: [...p.cats], ticks: ticks};
  }
  return {texts: texts, panels: out, outside: outside};
}"""


def overlaps(texts: list[dict]) -> list[tuple[str, str]]:
    """The pairs of text boxes that cover each other by more than SLACK_PX both ways."""
    hits = []
    for i, a in enumerate(texts):
        for b in texts[i + 1:]:
            dx = min(a["x"] + a["w"], b["x"] + b["w"]) - max(a["x"], b["x"])
            dy = min(a["y"] + a["h"], b["y"] + b["h"]) - max(a["y"], b["y"])
            if dx > SLACK_PX and dy > SLACK_PX:
                hits.append((a["text"], b["text"]))
    return hits


def assert_legible(measured: dict, what: str) -> None:
    assert measured["texts"], what
    assert overlaps(measured["texts"]) == [], what
    assert measured["outside"] == [], what  # none cut off at the chart's edges
    assert measured["panels"], what
    for key, panel in measured["panels"].items():  # a tick label for every bar's category, none dropped
        assert sorted(panel["ticks"]) == sorted(panel["cats"]), (what, key)


def render(page, fig_json: dict, width: int, height: int) -> dict:
    """``fig_json`` drawn by plotly.js in a ``width`` x ``height`` px box (a figure's own height
    wins where it has one), measured with MEASURE_JS."""
    page.evaluate("""([fig, w, h]) => {
      document.body.innerHTML = '';
      const box = document.createElement('div');
      box.id = 'box';
      box.style.cssText = `width:${w}px;height:${h}px;margin:0;padding:0`;
      document.body.appendChild(box);
      return Plotly.newPlot(box, fig.data, fig.layout, {responsive: false});
    }""", [fig_json, width, height])
    return page.evaluate(MEASURE_JS, page.locator("#box").element_handle())


@pytest.fixture(scope="module")
def plotly_page(browser):
    context = browser.new_context(viewport={"width": 1280, "height": 720})
    pg = context.new_page()
    pg.set_content("<html><body style='margin:0'></body></html>")
    pg.add_script_tag(content=plotly.offline.get_plotlyjs())
    yield pg
    context.close()


@pytest.fixture(scope="module")
def crowded_steps(embedded) -> dict[str, StepTrace]:
    hot = runner.run(RunRequest(embedded, "The capital of France is",
                                DecodingConfig(strategy="sample", temperature=2.5, top_k=20, top_p=0.9, seed=1,
                                               max_new_tokens=1)))
    grammar = runner.run(RunRequest(embedded, "Is the sea blue? Answer yes, no or maybe.",
                                    DecodingConfig(strategy="sample", seed=1, grammar="yes|no|maybe",
                                                   grammar_kind="regex", max_new_tokens=1), chat=True))
    steps = {"T 2.5": hot.steps[0], "yes/no/maybe": grammar.steps[0]}
    assert len(steps["T 2.5"].stages) == 5 and steps["T 2.5"].draw is not None  # five stage panels and the draw
    assert max(charts.panel_rows(steps["yes/no/maybe"])) >= 15  # the grammar panel that crowded
    return steps


def plain(fig) -> dict:
    return json.loads(fig.to_json())


@pytest.mark.parametrize("width, height", SIZES)
def test_step_through_and_presenter_charts_label_every_bar_without_overlap(plotly_page, crowded_steps, width,
                                                                          height):
    for name, step in crowded_steps.items():
        fitted = plain(charts.fitted_stage_chart(step, width))
        assert_legible(render(plotly_page, fitted, width - 40, height), f"step through, {name}, {width}")
        shown = plain(presenter.step_chart(step, width))
        box = presenter.PRESENT_BOX_PX if width >= presenter.NARROW_PX else height
        assert_legible(render(plotly_page, shown, width, box), f"presenter, {name}, {width}")


@pytest.mark.parametrize("width, height", SIZES)
def test_the_methods_chart_labels_every_variant_without_overlap(plotly_page, width, height):
    fig = plain(quant_methods.comparison_figure(_comparison()))
    layouts = fig["layout"]["meta"]["layouts"]
    box = width - 40 if width < 600 else width * 2 // 3  # the chart's column beside the knobs
    shown = "phone" if box < layouts["below"] else "wide"
    assert shown == ("phone" if width < 600 else "wide")
    measured = render(plotly_page, {"data": fig["data"], "layout": layouts[shown]}, box, height)
    assert_legible(measured, f"methods, {width}")
    names = [t for t in measured["texts"] if t["text"] in ("fp32 (none)", "gptq-g64")]
    assert names and all(t["h"] < 2 * t["w"] for t in names)  # level, not turned


@pytest.mark.parametrize("width, height", SIZES)
def test_the_presenter_view_labels_every_bar_without_overlap(browser, live_app, width, height):
    context = browser.new_context(viewport={"width": width, "height": height})
    page = context.new_page()
    page.set_default_timeout(60_000)
    try:
        page.goto(f"{live_app}/?lesson={lesson_token(json.dumps(LESSON))}&present=1")
        page.wait_for_selector("#presenter:visible")
        page.click("#present-run")
        page.wait_for_selector("#present-chart .gtitle", timeout=300_000)
        wait_for_step(page, 0)
        narrow = width < presenter.NARROW_PX
        page.wait_for_function("(n) => document.querySelector('#present-chart .js-plotly-plot')?.layout?.meta?.narrow"
                               " === n", arg=narrow)
        page.wait_for_timeout(500)  # the redraw for the page's width settles
        assert_legible(page.evaluate(MEASURE_JS, page.locator("#present-chart").element_handle()),
                       f"presenter view, {width}")
    finally:
        context.close()
