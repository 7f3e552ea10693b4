"""The first minute of a new user, in a real browser at 1280x720: Generate is on the first screen
of every view, Ctrl+Enter in the prompt runs it, a first token and a non-empty chart appear; the
stage list reorders by drag; an out-of-range slider value is refused with the typed value named.
Time to interactive and time to first token are printed as a record (no timed assertion)."""

import json
import time

import pytest

from tests.helpers.common import browser_page

pytestmark = [pytest.mark.slow, pytest.mark.browser]

VIEWS = (("Step through", "#step-generate"), ("Compare", "#cmp-run"), ("Beam search", "#beam-run"),
         ("Speculative", "#spec-generate"))


@pytest.fixture
def small_page(browser):
    yield from browser_page(browser, 1280, 720, timeout_ms=120_000)


def open_step(page) -> None:
    page.click("button[role=tab]:has-text('Step through')")


def in_first_screen(page, selector: str) -> bool:
    box = page.locator(selector).bounding_box()
    return box is not None and box["y"] >= 0 and box["y"] + box["height"] <= 720 and box["x"] + box["width"] <= 1280


def test_generate_on_first_screen_and_ctrl_enter_runs(small_page, live_app, artifacts):
    page = small_page
    start = time.perf_counter()
    page.goto(live_app)
    page.locator("button[role=tab]").first.wait_for(state="visible")  # the Lessons tab may come first
    record = {"first_tab_s": time.perf_counter() - start}
    # Inactive tabs are not mounted (gr.Tab's render_children=False): Step's controls come on select.
    assert page.locator("#step-generate").count() == 0
    open_step(page)
    page.locator("#step-generate").wait_for(state="visible")
    page.wait_for_function("() => !document.querySelector('#step-generate').disabled")
    record["time_to_interactive_s"] = time.perf_counter() - start
    print(f"\ntime to interactive: {record['time_to_interactive_s']:.2f} s (first tab {record['first_tab_s']:.2f} s)")
    for title, button in VIEWS:
        page.click(f"button[role=tab]:has-text('{title}')")
        page.locator(button).wait_for(state="visible")
        assert in_first_screen(page, button), f"{title}: {button} is below the first screen"
    page.click("button[role=tab]:has-text('Step through')")
    page.fill("#step-knob-max_new_tokens input[type=number]", "8")
    page.locator("#step-knob-max_new_tokens input[type=number]").press("Enter")
    page.locator("#step-prompt textarea").focus()
    start = time.perf_counter()
    page.keyboard.press("Control+Enter")
    # The page may already show the example run: wait for this run's own first token.
    page.wait_for_function("() => /generating… [1-9]|done: /.test(document.querySelector('#step-status')?.innerText)",
                           timeout=300_000)
    page.locator("#step-text .token").first.wait_for()
    record["time_to_first_token_s"] = time.perf_counter() - start
    print(f"time to first token: {record['time_to_first_token_s']:.2f} s")
    (artifacts / "first-minute.json").write_text(json.dumps({k: round(v, 2) for k, v in record.items()}))
    page.wait_for_selector("#step-status:has-text('done')", timeout=300_000)
    page.wait_for_selector("#step-chart .main-svg .bars, #step-chart .main-svg .trace", timeout=60_000)
    assert page.locator("#step-status .dp-error").count() == 0


def tokens_text(page, selector: str) -> str:
    return "".join(page.locator(selector).all_inner_texts())


def test_first_screens_show_the_example_runs(small_page, live_app):
    """Before pressing anything: Step through shows the startup example at its most uncertain step
    (the same text Generate then produces), Beam its tree, Speculative p vs q of the first rejected
    draft and where the target's token came from."""
    page = small_page
    page.goto(live_app)
    open_step(page)
    page.wait_for_selector("#step-status:has-text('example run')", timeout=300_000)
    page.wait_for_selector("#step-chart .js-plotly-plot")
    assert page.locator("#step-over-run .js-plotly-plot").count() == 1
    explain = page.locator("#step-explain").inner_text()
    assert explain.strip() and "Press Generate" not in explain  # the step's explanation, not the empty state
    example = tokens_text(page, "#step-text .token")
    assert len(example) > 20
    page.click("button[role=tab]:has-text('Beam search')")
    page.wait_for_selector("#beam-status:has-text('example search')", timeout=300_000)
    page.wait_for_selector("#beam-tree .js-plotly-plot")
    assert page.locator("#beam-hypotheses tbody tr").count() >= 1
    page.click("button[role=tab]:has-text('Speculative')")
    page.wait_for_selector("#spec-status:has-text('example run')", timeout=300_000)
    page.wait_for_selector("#spec-pq .js-plotly-plot")
    page.wait_for_selector("#spec-residual .js-plotly-plot")
    assert "rejected" in page.locator("#spec-explain").inner_text()
    assert page.locator("#spec-rounds [data-chip][style*='outline']").count() >= 1  # the selected chip
    page.click("button[role=tab]:has-text('Step through')")
    page.click("#step-generate")  # the example is what Generate gives with the page untouched
    page.wait_for_selector("#step-status:has-text('done')", timeout=300_000)
    assert tokens_text(page, "#step-text .token") == example


def test_drag_a_stage_changes_the_chart_panel_order(page, live_app):
    page.goto(live_app)
    open_step(page)
    page.fill("#step-knob-max_new_tokens input[type=number]", "3")
    page.locator("#step-knob-max_new_tokens input[type=number]").press("Enter")
    names = page.locator("#step-stage-list li .dp-stage-name")
    order = names.all_inner_texts()
    assert order.index("temperature") < order.index("top_p")
    page.locator("#step-stage-list li[data-stage=top_p]").drag_to(page.locator("#step-stage-list li[data-stage=temperature]"),
                                                                 target_position={"x": 20, "y": 2})
    from engine.config import STAGE_NAMES

    moved = ", ".join([*STAGE_NAMES[:STAGE_NAMES.index("temperature")], "top_p"])  # the default order, top_p moved up
    page.wait_for_function("prefix => document.querySelector('#step-stage-order textarea').value.startsWith(prefix)", arg=moved)
    page.wait_for_selector("#step-preset-note:has-text('modified')")  # a reorder is an edit of the preset
    page.click("#step-generate")
    page.wait_for_selector("#step-status:has-text('done')", timeout=300_000)
    page.wait_for_selector("#step-chart .annotation-text")
    joined = " | ".join(page.locator("#step-chart .annotation-text").all_text_contents()).lower()
    assert 0 <= joined.find("top-p") < joined.find("temperature"), joined


def test_keyboard_moves_a_stage(page, live_app):
    page.goto(live_app)
    open_step(page)
    page.locator("#step-stage-list li[data-stage=top_k] .dp-up").focus()
    page.keyboard.press("Enter")
    value = page.locator("#step-stage-order textarea").input_value()
    assert value.split(", ").index("top_k") == value.split(", ").index("top_n_sigma") - 1


def test_out_of_range_slider_value_is_refused_with_the_value_named(page, live_app):
    page.goto(live_app)
    open_step(page)
    box = page.locator("#step-knob-temperature input[type=number]")
    box.fill("999")
    box.press("Enter")
    page.wait_for_selector("#step-knob-temperature .dp-refused")
    assert "999" in page.locator("#step-knob-temperature .dp-refused").inner_text()
