"""Workshop mode in a real browser: run a lesson and see its checked claim, move a knob on a
selected step and see the chart change (the round trip is recorded, not asserted), the presenter
view with guess / reveal and the QR code, and the phone width (390x844, no horizontal scroll)."""

import re
import time

import pytest

from bench.whatif_browser import WATCH_JS, change, open_step
from playground.knobs import KnobPanel
from playground import whatif_service
from playground.views.step import DEFAULT_PRESET

pytestmark = [pytest.mark.slow, pytest.mark.browser]


def test_open_and_run_a_lesson(page, live_app, artifacts):
    page.goto(live_app)
    page.wait_for_selector("#lessons-pick")
    assert page.locator("#tab-lessons").is_visible()  # the first tab on a fresh visit
    page.locator("#lessons-steps").get_by_text("Greedy always takes").wait_for()
    page.click("#lessons-run")
    page.wait_for_selector("#lesson-outcome-text", timeout=300_000)
    assert "Greedy gives the same text" in page.locator("#lessons-outcome").inner_text()
    assert page.locator("#lessons-status .dp-error").count() == 0
    page.screenshot(path=str(artifacts / "lessons-after-run.png"))  # docs/: tests/browser/test_screenshots_browser.py
    page.click("#lessons-open")
    page.wait_for_selector("#tab-compare:visible")


def test_whatif_knob_redraws_the_selected_step(page, live_app, artifacts):
    open_step(page, live_app)
    before = page.locator("#step-chart").inner_text()
    box = page.locator("#step-knob-temperature input[type=number]")
    # In the page: from the box's last input event to the chart's last change (what a person waits).
    page.evaluate(WATCH_JS)
    start = time.perf_counter()
    box.fill("3")
    box.press("Enter")
    page.wait_for_selector("#step-whatif-note:has-text('temperature = 3')", timeout=60_000)
    page.wait_for_function("(b) => document.querySelector('#step-chart').innerText !== b", arg=before)
    time.sleep(0.5)  # plotly may still be drawing: the last mutation counts
    in_page = page.evaluate("() => Math.round(window.dpT1 - window.dpT0)")
    with_playwright = (time.perf_counter() - start) * 1000
    print(f"what-if round trip: {in_page} ms in the page, {with_playwright:.0f} ms with Playwright")
    times = [round(change(page, value, settle_s=0.5)) for value in ("0.5", "1.5", "2")]  # kept logits reused
    print(f"what-if round trips with kept logits: {times} ms in the page")
    # The preset note is written in the page (knobs.MODIFIED_JS), as the server would write it.
    note = re.sub(r"<[^>]+>", "", KnobPanel._preset_note(DEFAULT_PRESET, True))
    assert page.locator("#step-preset-note").inner_text().strip() == note
    # Selecting the same step again shows the run's own chart, though the what-if drew into that plot.
    page.locator("#step-text .token").nth(2).click()
    page.wait_for_function("(b) => document.querySelector('#step-chart').innerText === b", arg=before, timeout=30_000)
    assert page.locator("#step-status .dp-error").count() == 0
    page.screenshot(path=str(artifacts / "step-whatif.png"), full_page=True)
    # The stage order is a knob too: dragging top-p above temperature redraws the step in that order.
    order_js = """() => [...document.querySelectorAll('#step-chart .annotation-text')]
        .map(e => e.textContent.toLowerCase()).join(' | ')"""
    shown = page.evaluate(order_js)
    assert 0 <= shown.find("temperature") < shown.find("top-p"), shown
    page.locator("#step-stage-list li[data-stage=top_p]").drag_to(
        page.locator("#step-stage-list li[data-stage=temperature]"), target_position={"x": 20, "y": 2})
    page.wait_for_function(f"() => {{ const t = ({order_js})(); return t.indexOf('top-p') >= 0 && "
                           "t.indexOf('top-p') < t.indexOf('temperature'); }", timeout=60_000)
    assert "stage_order" in page.locator("#step-whatif-note").inner_text()
    # Where the route cannot answer (DP_WHATIF_ROUTE=0, a model not loaded, ZeroGPU) the same what-if
    # runs as a Gradio event: the page presses the hidden fallback button.
    routes = whatif_service.services()
    try:
        for route in routes:
            route.direct = False
        box.fill("2.5")
        page.wait_for_selector("#step-whatif-note:has-text('temperature = 2.5')", timeout=60_000)
        page.wait_for_function("(b) => document.querySelector('#step-chart').innerText !== b", arg=before)
    finally:
        for route in routes:
            route.direct = True
    # A bad value is named in the note, and the chart keeps the last good what-if.
    shown = page.locator("#step-chart").inner_text()
    page.fill("#step-knob-top_k input[type=number]", "-3")
    page.wait_for_selector("#step-whatif-note .dp-error:has-text('top_k')", timeout=60_000)
    assert page.locator("#step-chart").inner_text() == shown


def test_presenter_guess_reveal_and_qr(projector_page, live_app, artifacts):
    page = projector_page
    page.goto(f"{live_app}/?lesson=temperature&present=1")
    page.wait_for_selector("#presenter:visible")
    page.wait_for_selector("#present-qr img[alt='QR code of the share link']")
    page.click("#present-run")  # the presenter overlay covers the tab's own Run button
    page.wait_for_selector("#present-chart .gtitle", timeout=300_000)
    size = page.evaluate("() => parseFloat(getComputedStyle(document.querySelector('#present-chart .ytick text')).fontSize)")
    assert size >= 18
    page.check("#present-guess input")
    page.wait_for_selector("#present-text .dp-present-token:has-text('?')")
    page.click("#present-reveal")
    page.wait_for_selector("#present-text:has-text('p = ')")
    page.click("#present-next")  # guess mode stays on: the next token is hidden again
    page.wait_for_selector("#present-text:has-text('Guess the next token')")
    page.uncheck("#present-guess input")
    page.wait_for_selector("#present-text:has-text('Step ')")
    page.screenshot(path=str(artifacts / "presenter-guess.png"))


def test_a_compare_lesson_opens_compare_with_its_lanes_filled(page, live_app):
    page.goto(f"{live_app}/?lesson=temperature")
    page.locator("#lessons-steps").get_by_text("Temperature divides every logit").wait_for()
    page.click("#lessons-open")
    page.wait_for_selector("#cmp-lane-2:visible")
    assert page.locator("#cmp-prompt textarea").input_value() == "Write one sentence about the moon."
    assert page.locator("#cmp-chat input").is_checked()
    assert not page.locator("#cmp-lane-3").is_visible()  # the lesson has three lanes
    page.wait_for_selector("#cmp-lane-2-header:has-text('sample · T 5 · seed 7 · 24 tokens')")
    assert page.locator("#cmp-lane-2-knob-temperature input").input_value() == "5"
    assert page.locator("#cmp-lane-1-knob-seed input").input_value() == "7"
    assert "T 0 (a greedy pick)" in page.locator("#cmp-lane-0-header").inner_text()
    assert page.locator("#lessons-status .dp-error, #cmp-status .dp-error").count() == 0
