"""Issue #27, what-if in a real browser: moving a knob re-titles the step chart with what the new
knobs would pick and rewrites the explanation under it, through the route (the page's script draws
the answer) and through the Gradio-event fallback; selecting the step again restores the run's own."""

from __future__ import annotations

import pytest

from bench.whatif_browser import open_step
from playground import whatif_service

pytestmark = [pytest.mark.slow, pytest.mark.browser]

TITLE = "() => document.querySelector('#step-chart .gtitle')?.textContent || ''"
EXPLAIN = "() => document.querySelector('#step-explain')?.innerText || ''"


def set_knob(page, name: str, value: str) -> None:
    box = page.locator(f"#step-knob-{name} input[type=number]")
    box.fill(value)
    box.press("Enter")


def test_knob_change_retitles_the_chart_and_rewrites_the_explanation(page, live_app, artifacts):
    open_step(page, live_app, step=2)
    own_title, own_explain = page.evaluate(TITLE), page.evaluate(EXPLAIN)
    assert own_title.startswith("step 2: chose") and not own_explain.startswith("What if")
    set_knob(page, "temperature", "3")
    page.wait_for_function(f"() => ({TITLE})().startsWith('step 2: what if')", timeout=60_000)
    page.wait_for_function(f"() => ({EXPLAIN})().startsWith('What if (temperature = 3')", timeout=60_000)
    title, explain = page.evaluate(TITLE), page.evaluate(EXPLAIN)
    assert "would choose" in title and "the run chose" in title
    assert "would" in explain and own_explain not in explain
    page.screenshot(path=str(artifacts / "step-whatif-title.png"), full_page=True)
    # The fallback path (the route cannot answer): the same title and explanation through on_knob.
    routes = whatif_service.services()
    try:
        for route in routes:
            route.direct = False
        set_knob(page, "temperature", "0.4")
        page.wait_for_function(f"() => ({EXPLAIN})().startsWith('What if (temperature = 0.4')", timeout=60_000)
        page.wait_for_function(f"() => ({TITLE})().startsWith('step 2: what if')", timeout=60_000)
    finally:
        for route in routes:
            route.direct = True
    # A bad value keeps the last what-if's title and explanation, and names the knob.
    shown = page.evaluate(EXPLAIN)
    set_knob(page, "top_k", "-3")
    page.wait_for_selector("#step-whatif-note .dp-error:has-text('top_k')", timeout=60_000)
    assert page.evaluate(EXPLAIN) == shown
    # Selecting the step again shows the run's own chart and explanation.
    page.locator("#step-text .token").nth(2).click()
    page.wait_for_function(f"() => ({TITLE})().startsWith('step 2: chose')", timeout=30_000)
    page.wait_for_function(f"() => !({EXPLAIN})().startsWith('What if')", timeout=30_000)
