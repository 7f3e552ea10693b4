"""Issue #27, what-if in a real browser: moving a knob re-titles the step chart with what the new
knobs would pick and rewrites the explanation under it, through the route (the page's script draws
the answer) and through the Gradio-event fallback; selecting the step again restores the run's own.
Issue #35: a new run clears the what-if note, also when an answer comes back after the run started."""

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


INTRO = "What if: select a step"
NOTE = "() => document.querySelector('#step-whatif-note')?.innerText || ''"
# The page's route answers arrive DELAY_MS late (a busy server): a run started meanwhile must win.
DELAY_WHATIF_JS = """(ms) => {
    const real = window.fetch;
    window.dpLate = 0;
    window.fetch = (url, options) => {
        const body = options && typeof options.body === 'string' ? options.body : '';
        if (!String(url).includes('/dp/whatif') || body.includes('"prepare"')) return real(url, options);
        return new Promise(done => setTimeout(() => done(real(url, options).then(r => { window.dpLate += 1; return r; })), ms));
    };
}"""


def test_a_new_run_clears_the_what_if_note_also_when_an_answer_comes_late(page, live_app):
    """Issue #35: select a step, T = 1.5, change the prompt, Generate, click a token: the note named
    the old run's token. Now the new run puts the note back at once, a token clicked keeps it so, and
    a what-if answer that arrives after the new run started draws and says nothing."""
    open_step(page, live_app, step=2)
    set_knob(page, "temperature", "1.5")
    page.wait_for_function(f"() => ({NOTE})().startsWith('What if (temperature = 1.5')", timeout=60_000)
    page.wait_for_function(f"() => ({TITLE})().startsWith('step 2: what if')", timeout=60_000)
    old_note = page.evaluate(NOTE)

    page.fill("#step-prompt textarea", "Write the word MARKER twice.")
    page.click("#step-generate")
    page.wait_for_function(f"() => ({NOTE})().startsWith({INTRO!r})", timeout=30_000)  # at the run's first update
    page.wait_for_selector("#step-status:has-text('done')", timeout=300_000)
    assert page.evaluate(NOTE).startswith(INTRO) and page.evaluate(NOTE) != old_note
    page.locator("#step-text .token").nth(1).click()
    page.wait_for_function(f"() => ({TITLE})().startsWith('step 1: chose')", timeout=30_000)
    assert page.evaluate(NOTE).startswith(INTRO) and not page.evaluate(EXPLAIN).startswith("What if")

    # A knob moved, its answer delayed; Generate pressed before it comes back.
    page.evaluate(DELAY_WHATIF_JS, 20_000)  # longer than the run, even on a loaded machine
    set_knob(page, "temperature", "2.5")
    page.click("#step-generate")
    page.wait_for_selector("#step-status:has-text('done')", timeout=300_000)
    assert page.evaluate("() => window.dpLate") == 0  # the answer is still on its way after the run
    page.wait_for_function("() => window.dpLate >= 1", timeout=60_000)  # and then it arrives
    page.wait_for_timeout(800)
    assert page.evaluate(NOTE).startswith(INTRO), page.evaluate(NOTE)
    assert ": what if" not in page.evaluate(TITLE) and not page.evaluate(EXPLAIN).startswith("What if")
    # The next knob move is answered (late too) and drawn: only stale answers are dropped.
    set_knob(page, "temperature", "0.5")
    page.wait_for_function(f"() => ({NOTE})().startsWith('What if (temperature = 0.5')", timeout=90_000)
    page.wait_for_function(f"() => ({TITLE})().includes(': what if')", timeout=30_000)
