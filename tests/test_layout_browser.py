"""Issue #27 in a real browser, as a person sees it: the presenter labels every bar and its phone
panels never put token labels over another panel's bars, Esc on the enlarged QR code only shrinks
it; Step through on a phone shows the output right after the prompt and Generate; the beam tree's
default 64-step search is wider than the page (it scrolls) and its token labels never overlap."""

import json

import pytest

from playground.views.lessons import lesson_token
from tests.conftest import browser_page, open_tab

pytestmark = [pytest.mark.slow, pytest.mark.browser]

LESSON = {"version": 1, "id": "layout-test", "title": "Temperature 0.8", "view": "step", "chat": False,
          "prompt": "The capital of France is", "select_step": 0,
          "preset": {"version": 1, "name": "T 0.8", "strategy": "sample", "temperature": 0.8, "seed": 1,
                     "max_new_tokens": 4},
          "steps": ["Temperature 0.8 sharpens the distribution.", "Step through the four tokens."]}

# Per y axis of the presenter's chart: the categories its bars use, and the tick labels drawn.
AXIS_LABELS = """() => {
  const plot = document.querySelector('#present-chart .js-plotly-plot');
  const out = {};
  for (const t of plot.data) {
    if (!t.y || t.y[0] === null) continue;  // the legend's swatches
    const axis = (t.yaxis || 'y');
    out[axis] = out[axis] || {categories: new Set(), ticks: 0};
    t.y.forEach(y => out[axis].categories.add(y));
  }
  return Object.fromEntries(Object.entries(out).map(([axis, v]) => [axis, {
    categories: v.categories.size,
    ticks: [...plot.querySelectorAll(`g.${axis}tick text`)].filter(e => e.textContent.trim()).length}]));
}"""
# Every tick label's box and every bar's box, with its subplot (x2y2...).
BOXES = """() => {
  const plot = document.querySelector('#present-chart .js-plotly-plot');
  const r = e => { const b = e.getBoundingClientRect(); return [b.left, b.top, b.right, b.bottom]; };
  const labels = [...plot.querySelectorAll('.yaxislayer-above text')].filter(e => e.textContent.trim())
    .map(e => ({axis: [...e.parentElement.classList].find(c => /^y\\d*tick$/.test(c)).replace('tick', ''), box: r(e)}));
  const bars = [];
  plot.querySelectorAll('.cartesianlayer .subplot').forEach(sub => {
    const name = [...sub.classList].find(c => /^x\\d*y\\d*$/.test(c));
    sub.querySelectorAll('.bars .point path').forEach(p => { const b = r(p); if (b[2] - b[0] > 1) bars.push({axis: name.slice(name.indexOf('y')), box: b}); });
  });
  return {labels, bars};
}"""


def _overlaps(a, b) -> bool:
    return a[0] < b[2] - 0.5 and b[0] < a[2] - 0.5 and a[1] < b[3] - 0.5 and b[1] < a[3] - 0.5


def _open_presenter(page, live_app):
    page.goto(f"{live_app}/?lesson={lesson_token(json.dumps(LESSON))}&present=1")
    page.wait_for_selector("#presenter:visible")
    page.click("#present-run")
    page.wait_for_selector("#present-chart .gtitle", timeout=300_000)


def _assert_every_bar_labelled(page):
    axes = page.evaluate(AXIS_LABELS)
    assert len(axes) >= 3
    for axis, seen in axes.items():
        assert seen["ticks"] == seen["categories"], (axis, seen)  # was every other one


@pytest.fixture
def phone_page(browser):
    yield from browser_page(browser, 390, 844)


def test_presenter_labels_every_bar_and_esc_closes_only_the_big_qr(projector_page, live_app, artifacts):
    page = projector_page
    _open_presenter(page, live_app)
    page.wait_for_timeout(500)
    _assert_every_bar_labelled(page)
    page.screenshot(path=str(artifacts / "layout-presenter-1280.png"))
    page.click("#present-qr")
    page.wait_for_selector("#present-qr.dp-qr-big")
    page.keyboard.press("Escape")
    page.wait_for_selector("#present-qr:not(.dp-qr-big)")
    page.wait_for_timeout(500)
    assert page.locator("#presenter").is_visible()  # still presenting
    page.keyboard.press("Escape")  # a second Esc leaves, as before
    page.wait_for_selector("#presenter", state="detached")


def test_presenter_on_a_phone_labels_every_bar_clear_of_other_panels(phone_page, live_app, artifacts):
    page = phone_page
    _open_presenter(page, live_app)
    page.wait_for_function("() => document.querySelector('#present-chart .js-plotly-plot')?.layout?.meta?.narrow === true")
    page.wait_for_timeout(800)
    _assert_every_bar_labelled(page)
    boxes = page.evaluate(BOXES)
    assert boxes["labels"] and boxes["bars"]
    for label in boxes["labels"]:
        for bar in boxes["bars"]:
            assert not _overlaps(label["box"], bar["box"]), (label, bar)  # the issue: panel 2's labels on panel 1's bars
        assert label["box"][0] >= 0 and label["box"][2] <= 390
    ordered = sorted(boxes["labels"], key=lambda b: (b["axis"], b["box"][1]))
    for a, b in zip(ordered, ordered[1:]):
        assert a["axis"] != b["axis"] or not _overlaps(a["box"], b["box"]), (a, b)  # no label on another
    page.screenshot(path=str(artifacts / "layout-presenter-390.png"), full_page=True)


def test_step_through_on_a_phone_shows_the_output_before_the_knobs(phone_page, live_app, artifacts):
    """390x844: the tokens and the chart came after every knob and the stage list (y ~ 5,000);
    now prompt, Generate/Stop, then the output, then the knobs."""
    page = phone_page
    page.goto(live_app)
    open_tab(page)
    page.wait_for_selector("#step-chart .js-plotly-plot", timeout=300_000)  # the example run

    def top(selector: str) -> float:
        return page.locator(selector).first.bounding_box()["y"]

    prompt, generate, tokens, chart = top("#step-prompt"), top("#step-generate"), top("#step-text"), top("#step-chart")
    knobs = min(top("#step-chat"), top("#step-stage-list"), top("[id^=step-group-]"))
    assert prompt < generate < tokens < chart < knobs, (prompt, generate, tokens, chart, knobs)
    assert tokens < generate + 600  # right after the buttons, not below the knobs
    assert chart < 2200  # was ~5,990
    page.screenshot(path=str(artifacts / "layout-step-390.png"), full_page=True)


def test_beam_default_tree_scrolls_sideways_and_its_labels_never_overlap(projector_page, live_app, artifacts):
    page = projector_page
    page.goto(live_app)
    open_tab(page, "Beam search")
    page.wait_for_selector("#beam-tree .js-plotly-plot .textpoint", timeout=300_000)  # the example search
    page.wait_for_timeout(500)
    box = page.locator("#beam-tree [data-testid=plotly]")
    sizes = box.evaluate("e => [e.scrollWidth, e.clientWidth, getComputedStyle(e).overflowX]")
    steps = page.evaluate("() => Math.max(...document.querySelector('#beam-tree .js-plotly-plot').data.flatMap(t => (t.x || []).filter(x => x !== null)))")
    if steps >= 24:
        assert sizes[0] > sizes[1] and sizes[2] == "auto", sizes  # wider than the page: it scrolls
    labels = page.evaluate("""() => [...document.querySelectorAll('#beam-tree .textpoint text')]
        .filter(e => e.textContent.trim()).map(e => { const b = e.getBoundingClientRect(); return [b.left, b.top, b.right, b.bottom]; })""")
    assert len(labels) >= steps
    for i, a in enumerate(labels):
        for b in labels[i + 1:]:
            assert not _overlaps(a, b), (a, b)
    page.screenshot(path=str(artifacts / "layout-beam-1280.png"))
