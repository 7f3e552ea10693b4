"""Issue #27 in a real browser, as a person sees it: the presenter labels every bar and its phone
panels never put token labels over another panel's bars, Esc on the enlarged QR code only shrinks
it; Step through on a phone shows the output right after the prompt and Generate; the beam tree's
default 64-step search is wider than the page (it scrolls) and its token labels never overlap."""

import json

import pytest

from playground.charts.step import PHONE_PX
from playground.views.lessons import lesson_token
from tests.helpers.common import browser_page, open_tab

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


# --- issue #35: the Lessons tab's chart and Compare's inspector on a phone and a projector ---------
# Every SVG text of the chart in ``sel`` (titles, panel titles and subtitles, the u label, tick
# labels, the legend) with its box; each y axis's categories and drawn tick labels; each bar's box.
CHART_TEXT_JS = """(sel) => {
  const plot = document.querySelector(sel + ' .js-plotly-plot');
  const r = e => { const b = e.getBoundingClientRect(); return [b.left, b.top, b.right, b.bottom]; };
  const texts = [...plot.querySelectorAll('svg text')].filter(e => e.textContent.trim() && e.getClientRects().length)
    .map(e => ({text: e.textContent.trim(), box: r(e), tick: !!e.closest('.xtick, .ytick, [class*=tick]')}))
    .filter(t => t.box[2] - t.box[0] > 0);
  const axes = {};
  for (const t of plot.data) {
    if (!t.y || t.y.every(y => y === null)) continue;  // the legend's swatches
    const axis = t.yaxis || 'y';
    axes[axis] = axes[axis] || {categories: new Set(), ticks: 0};
    t.y.forEach(y => axes[axis].categories.add(y));
  }
  const labelled = Object.fromEntries(Object.entries(axes).map(([axis, v]) => [axis, {categories: v.categories.size,
    ticks: [...plot.querySelectorAll(`g.${axis}tick text`)].filter(e => e.textContent.trim()).length}]));
  const bars = [];
  plot.querySelectorAll('.cartesianlayer .subplot').forEach(sub => {
    const name = [...sub.classList].find(c => /^x\\d*y\\d*$/.test(c));
    sub.querySelectorAll('.bars .point path').forEach(p => { const b = r(p); if (b[2] - b[0] > 1) bars.push({axis: name.slice(name.indexOf('y')), box: b}); });
  });
  const ticks = [...plot.querySelectorAll('.yaxislayer-above text')].filter(e => e.textContent.trim())
    .map(e => ({axis: [...e.parentElement.classList].find(c => /^y\\d*tick$/.test(c)).replace('tick', ''), box: r(e)}));
  return {texts, labelled, bars, ticks, edge: r(plot), shown: plot.layout.meta && plot.layout.meta.shown};
}"""


def chart_text_problems(page, sel: str, width: int) -> list[str]:
    """What a person would see wrong with the chart in ``sel``: two texts on each other (more than
    2 px each way), a text cut at the chart's sides, a bar without its token label, a token label
    over another panel's bars, or the wide layout on a phone."""
    seen = page.evaluate(CHART_TEXT_JS, sel)
    texts, (left, _, right, _) = seen["texts"], seen["edge"]
    problems = [f"cut: {t['text']!r}" for t in texts if t["box"][0] < left - 2 or t["box"][2] > right + 2]
    for i, a in enumerate(texts):
        for b in texts[i + 1:]:
            dx = min(a["box"][2], b["box"][2]) - max(a["box"][0], b["box"][0])
            dy = min(a["box"][3], b["box"][3]) - max(a["box"][1], b["box"][1])
            if dx > 2 and dy > 2:
                problems.append(f"overlap: {a['text']!r} / {b['text']!r}")
    problems += [f"{axis}: {v['ticks']} of {v['categories']} bars labelled" for axis, v in seen["labelled"].items()
                 if v["ticks"] != v["categories"]]
    problems += [f"{label['axis']} label over {bar['axis']} bars" for label in seen["ticks"] for bar in seen["bars"]
                 if bar["axis"] != label["axis"] and _overlaps(label["box"], bar["box"])]
    if seen["shown"] != ("phone" if width < 600 else "wide"):
        problems.append(f"layout {seen['shown']!r} at {width} px")
    return problems


SIZES = [(390, 844), (1280, 720)]


@pytest.mark.parametrize("lesson", ["temperature", "truncation"])
@pytest.mark.parametrize("size", SIZES, ids=["phone", "projector"])
def test_the_lessons_chart_has_no_text_on_text_and_every_bar_labelled(browser, live_app, artifacts, lesson, size):
    for page in browser_page(browser, *size, timeout_ms=300_000):
        page.goto(f"{live_app}/?lesson={lesson}")
        page.wait_for_selector("#lessons-pick")
        page.wait_for_function("() => document.querySelector('#lessons-steps')?.textContent.length > 0")
        page.click("#lessons-run")
        page.wait_for_selector("#lessons-outcome:has-text('✓'), #lessons-outcome:has-text('✗')")
        # the chart laid out for this page's width (views/lessons.py lesson_stage_chart's layout.meta)
        page.wait_for_function("() => document.querySelector('#lessons-chart .js-plotly-plot')?.layout?.meta?.phone"
                               f" === {'true' if size[0] < PHONE_PX else 'false'}")
        page.wait_for_timeout(500)
        page.locator("#lessons-chart").screenshot(path=str(artifacts / f"layout-lessons-{lesson}-{size[0]}.png"))
        assert chart_text_problems(page, "#lessons-chart", size[0]) == []


def _run_compare(page) -> None:
    page.locator("button[role=tab]", has_text="Compare").first.click()
    boxes = page.locator(".cmp-lane:visible [id$='knob-max_new_tokens'] input")
    for i in range(boxes.count()):
        boxes.nth(i).fill("5")
        boxes.nth(i).press("Enter")
    top_k = page.locator("#cmp-lane-1-knob-top_k input[type=number]")
    top_k.fill("20")  # lane 2 samples through top-k too: raw, temperature, top-k, top-p, final, the draw
    top_k.press("Enter")
    page.click("#cmp-run")
    page.wait_for_selector("#cmp-status:has-text('done:')", timeout=300_000)


def test_compare_s_inspector_chart_fits_a_phone_and_a_projector(browser, live_app, artifacts):
    """Each lane's first, middle and last token opened at 1280x720 and at 390x844 (the same page
    relaid out, then a token opened there): no text on text, every bar labelled."""
    for page in browser_page(browser, 1280, 720, timeout_ms=300_000):
        page.goto(live_app)
        page.wait_for_selector("#lessons-pick")
        _run_compare(page)
        problems = []
        for width, height in SIZES[::-1] + SIZES[:1]:
            page.set_viewport_size({"width": width, "height": height})
            for lane in (0, 1):
                tokens = page.locator(f"#cmp-lane-{lane}-text .token")
                steps = [i for i, t in enumerate(tokens.all_inner_texts()) if not t.startswith("⟶")]  # not the mark
                assert len(steps) >= 3
                for at in sorted({0, len(steps) // 2, len(steps) - 1}):
                    page.evaluate("() => { window.dpShown = document.querySelector('#cmp-inspect-chart .js-plotly-plot')?.layout; }")
                    tokens.nth(steps[at]).click()
                    want = "phone" if width < 600 else "wide"
                    page.wait_for_function(
                        "([at, want]) => { const p = document.querySelector('#cmp-inspect-chart .js-plotly-plot');"
                        " return p && p.layout !== window.dpShown && p.layout.meta?.shown === want"
                        " && p.layout.title.text.startsWith(`step ${at}:`); }", arg=[at, want])
                    page.wait_for_timeout(300)
                    problems += [f"{width} px, lane {lane + 1}, step {at}: {p}"
                                 for p in chart_text_problems(page, "#cmp-inspect-chart", width)]
            page.locator("#cmp-inspect-chart").screenshot(path=str(artifacts / f"layout-compare-inspect-{width}.png"))
        assert problems == []


# The beam tree's box: its scroll state, the hint over it, and where the winning path ends on screen.
TREE_BOX_JS = """() => {
  const block = document.querySelector('#beam-tree');
  const views = [...block.querySelectorAll('[data-testid=plotly], [data-testid=plotly] .plot-container')];
  const view = views.find(v => v.scrollWidth > v.clientWidth + 1) || views[0];  // a phone scrolls the inner one
  const plot = view.closest('.js-plotly-plot') || view.querySelector('.js-plotly-plot');  // Gradio's box is the plot
  const path = plot.data.findIndex(t => t.name === 'winning path');
  const traces = plot.querySelectorAll('.scatterlayer .trace');
  const points = [...traces[path].querySelectorAll('.point')].map(p => p.getBoundingClientRect());
  const end = points.reduce((a, b) => (b.left > a.left ? b : a));
  const box = view.getBoundingClientRect();
  return {scroll: view.scrollLeft, wide: view.scrollWidth > view.clientWidth + 1, flagged: block.hasAttribute('data-dp-scrolls'),
          hint: getComputedStyle(block, '::before').content, end: block.hasAttribute('data-dp-end'),
          winner: [end.left, end.right], box: [box.left, box.right]};
}"""


SCROLL_TREE_JS = """(to) => {
  const views = [...document.querySelectorAll('#beam-tree [data-testid=plotly], #beam-tree [data-testid=plotly] .plot-container')];
  const view = views.find(v => v.scrollWidth > v.clientWidth + 1);
  view.scrollLeft = to === 'end' ? view.scrollWidth : 0;
}"""


@pytest.mark.parametrize("size", SIZES, ids=["phone", "projector"])
def test_a_wide_beam_tree_says_it_scrolls_and_opens_at_the_winner_s_end(browser, live_app, artifacts, size):
    """The default 64-step search is ~3,800 px wide: its box says it scrolls sideways, opens scrolled
    to where the winning path ends (the finished hypotheses), and the shade goes at the far end."""
    for page in browser_page(browser, *size, timeout_ms=300_000):
        page.goto(live_app)
        page.wait_for_selector("#lessons-pick")
        open_tab(page, "Beam search")  # every view's tab is in the bar, wrapped on a phone (no menu)
        page.wait_for_selector("#beam-tree .js-plotly-plot .textpoint")  # the example search
        page.wait_for_function("() => document.querySelector('#beam-tree')?.hasAttribute('data-dp-scrolls')")
        page.wait_for_timeout(500)
        seen = page.evaluate(TREE_BOX_JS)
        page.locator("#beam-tree").screenshot(path=str(artifacts / f"layout-beam-scroll-{size[0]}.png"))
        assert seen["wide"] and seen["flagged"] and "scroll sideways" in seen["hint"], seen
        assert seen["scroll"] > 0 and seen["box"][0] <= seen["winner"][0] and seen["winner"][1] <= seen["box"][1], seen
        page.evaluate(SCROLL_TREE_JS, "end")
        page.wait_for_function("() => document.querySelector('#beam-tree').hasAttribute('data-dp-end')")
        page.evaluate(SCROLL_TREE_JS, "start")
        page.wait_for_timeout(600)  # a person's scrolling stays: the tree is not pulled back to the winner
        assert page.evaluate(TREE_BOX_JS)["scroll"] == 0
