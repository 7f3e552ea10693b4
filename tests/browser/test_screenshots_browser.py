"""Every view in a real browser at 1280x720 and 390x844 (one app, one page, one short run per
strategy on the embedded model, a lesson run and checked, a Compare token opened in the inspector):
at phone width the page never scrolls sideways and no two chart texts overlap (titles, panel
titles, annotations, legends and tick labels); the screenshots go to docs/<view>.png and
docs/<view>-phone.png (the README's)."""

from pathlib import Path

import pytest

from tests.helpers.common import open_tab
from tests.helpers.screenshots_browser import DOCS, phone_problems  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.browser]
DESKTOP, PHONE = {"width": 1280, "height": 720}, {"width": 390, "height": 844}
RUN_TIMEOUT = 300_000

def set_number(page, selector: str, value: str) -> None:
    page.fill(selector, value)
    page.locator(selector).press("Enter")


def run_lesson(page):
    page.click("#lessons-run")
    page.wait_for_selector("#lessons-outcome:has-text('✓'), #lessons-outcome:has-text('✗')", timeout=RUN_TIMEOUT)
    page.wait_for_selector("#lessons-chart .js-plotly-plot .gtitle")


def run_step(page):
    set_number(page, "#step-knob-max_new_tokens input[type=number]", "4")
    page.click("#step-generate")
    page.wait_for_selector("#step-status:has-text('done')", timeout=RUN_TIMEOUT)
    page.locator("#step-text .token").nth(1).click()
    page.wait_for_function("() => document.querySelector('#step-chart .gtitle')?.textContent.startsWith('step 1:')")


def run_beam(page):
    page.fill("#beam-prompt textarea", "The capital of France is")
    set_number(page, "#beam-knob-max_new_tokens input[type=number]", "4")
    page.click("#beam-run")
    page.wait_for_selector("#beam-status:has-text('done')", timeout=RUN_TIMEOUT)
    page.wait_for_selector("#beam-tree .js-plotly-plot")


def run_speculative(page):
    set_number(page, "#spec-knob-max_new_tokens input[type=number]", "8")
    page.click("#spec-generate")
    page.wait_for_selector("#spec-status:has-text('done')", timeout=RUN_TIMEOUT)
    page.wait_for_selector("#spec-pq .js-plotly-plot")


def run_compare(page):
    boxes = page.locator(".cmp-lane:visible [id$='knob-max_new_tokens'] input")
    for i in range(boxes.count()):
        boxes.nth(i).fill("4")
        boxes.nth(i).press("Enter")
    page.click("#cmp-run")
    page.wait_for_selector("#cmp-status:has-text('done:')", timeout=RUN_TIMEOUT)
    page.wait_for_selector("#cmp-entropy .js-plotly-plot")
    page.locator("#cmp-lane-1-text .token").nth(2).click()  # the inspector draws that step's panels
    page.wait_for_selector("#cmp-inspect-chart .js-plotly-plot .gtitle")


def run_mcts(page):
    page.fill("#mcts-prompt textarea", "The capital of France is")
    set_number(page, "#mcts-knob-max_new_tokens input[type=number]", "2")
    set_number(page, "#mcts-knob-mcts_simulations input[type=number]", "4")
    page.click("#mcts-run")
    page.wait_for_selector("#mcts-status:has-text('done')", timeout=RUN_TIMEOUT)
    page.wait_for_selector("#mcts-tree .js-plotly-plot")


# (docs name, tab title, the run that fills it or None, what the desktop and the phone screenshots
# scroll to the top: a phone stacks the knobs above the results): every tab of the page, in order.
VIEWS = (
    ("lessons", "Lessons", run_lesson, "#dp-tabs", "#lessons-chart"),
    ("step-through", "Step through", run_step, "#step-text", "#step-chart"),
    ("compare", "Compare", run_compare, "#cmp-status", "#cmp-inspect-chart"),
    ("beam", "Beam search", run_beam, "#beam-status", "#beam-tree"),
    ("speculative", "Speculative", run_speculative, "#spec-status", "#spec-rounds"),
    ("mcts", "Search & heads", run_mcts, "#mcts-status", "#mcts-tree"),
    ("quantization", "Quantization & KV cache", None, "#dp-tabs", "#dp-tabs"),
    ("presets", "Presets", None, "#dp-tabs", "#dp-tabs"),
)


# Every shown chart that says which layout it has (layout.meta: "phone" from the server's layouts
# by page width, "shown" from the page's own swap) has its phone layout.
PHONE_LAID_OUT_JS = """() => [...document.querySelectorAll('.js-plotly-plot')].filter(p => p.getClientRects().length)
  .every(p => { const m = (p.layout && p.layout.meta) || {};
                return (m.phone === undefined || m.phone === true) && (m.shown === undefined || m.shown === 'phone'); })"""


def shoot(page, anchor: str, path: Path) -> None:
    """The viewport with ``anchor`` (the view's result) scrolled to its top."""
    page.wait_for_timeout(400)  # plotly relays out on the resize / tab switch
    page.evaluate("(sel) => document.querySelector(sel)?.scrollIntoView({block: 'start'})", anchor)
    page.mouse.move(0, 0)  # a pointer left over a chart shows plotly's hover toolbar on its title
    page.wait_for_timeout(200)
    page.screenshot(path=str(path))


def test_every_view_at_desktop_and_phone_width(browser, live_app):
    context = browser.new_context(viewport=DESKTOP)
    page = context.new_page()
    page.set_default_timeout(60_000)
    page.goto(f"{live_app}/?lesson=temperature")
    page.wait_for_selector("#lessons-pick")
    problems = []
    for name, title, run, anchor, phone_anchor in VIEWS:
        page.set_viewport_size(DESKTOP)  # the tabs all show at desktop width (a phone folds them into ⋯)
        open_tab(page, title)
        if run is not None:
            run(page)
        shoot(page, anchor, DOCS / f"{name}.png")
        page.set_viewport_size(PHONE)  # the same page and results, relaid out
        page.wait_for_function(PHONE_LAID_OUT_JS)  # a chart the server lays out for the width: redrawn
        shoot(page, phone_anchor, DOCS / f"{name}-phone.png")  # first, so a failure can be looked at
        problems += phone_problems(page, name)
    context.close()
    assert problems == []


def test_presenter_at_desktop_and_phone_width(browser, live_app):
    context = browser.new_context(viewport=DESKTOP)
    page = context.new_page()
    page.set_default_timeout(60_000)
    page.goto(f"{live_app}/?lesson=truncation&present=1")  # its top-p lane, sampled (4 panels), from step 0
    page.click("#present-run")
    page.wait_for_selector("#present-text .dp-present-label:has-text('Step ')", timeout=RUN_TIMEOUT)
    page.wait_for_selector("#present-chart .gtitle")
    page.screenshot(path=str(DOCS / "presenter.png"))
    page.set_viewport_size(PHONE)
    page.wait_for_function("() => document.querySelector('#present-chart .js-plotly-plot')?.layout?.meta?.narrow === true")
    page.wait_for_timeout(300)
    page.screenshot(path=str(DOCS / "presenter-phone.png"))
    assert phone_problems(page, "presenter") == []
    context.close()
