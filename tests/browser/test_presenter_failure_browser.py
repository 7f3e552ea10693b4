"""The presenter view when a lesson's run fails (issue #52), in a real browser at 1280x720: a
lesson whose grammar has a typo, and a lesson that runs into the time limit. The overlay stood blank
over the page (the one-line error was under it, in the Lessons tab's status) and the time limit said
"ask for fewer tokens", which a lesson cannot do. Now the overlay itself shows the one line, where
the presenter sees it, with advice a lesson can follow."""

import json

import pytest

from playground.views.lessons import lesson_token

pytestmark = [pytest.mark.slow, pytest.mark.browser]

TEXT = "#present-text"


def lesson(name: str, preset: dict) -> dict:
    return {"version": 1, "id": name, "title": name.replace("-", " "), "view": "step", "chat": False,
            "prompt": "The answer is", "select_step": 0,
            "preset": {"version": 1, "name": name, "strategy": "sample", "seed": 1, **preset},
            "steps": ["What the lesson shows.", "Step through it."]}


def run_in_presenter(page, url: str, lesson_json: dict) -> str:
    """Open ``lesson_json``'s link in the presenter view, press its Run, wait for the overlay's
    failure box; returns the overlay's text."""
    page.goto(f"{url}/?lesson={lesson_token(json.dumps(lesson_json))}&present=1")
    page.wait_for_selector("#presenter:visible")
    page.click("#present-run")  # the overlay covers the Lessons tab's own Run button
    page.wait_for_selector(f"{TEXT} .dp-present-failed", timeout=300_000)
    return page.locator(TEXT).inner_text()


def assert_seen(page, selector: str) -> None:
    """``selector`` is on the screen and nothing lies over its middle (the overlay, not the page under it)."""
    box = page.locator(selector).bounding_box()
    assert box and box["y"] >= 0 and box["y"] + box["height"] <= 720 and box["x"] + box["width"] <= 1280, box
    on_top = page.evaluate("([x, y, sel]) => !!document.elementFromPoint(x, y)?.closest(sel)",
                           [box["x"] + box["width"] / 2, box["y"] + box["height"] / 2, selector])
    assert on_top, f"{selector} is covered"


def test_a_bad_grammar_shows_its_one_line_in_the_overlay(projector_page, live_app):
    page = projector_page
    text = run_in_presenter(page, live_app, lesson("bad-grammar", {"max_new_tokens": 4, "grammar": "root ::= (",
                                                                   "grammar_kind": "gbnf"}))
    status = page.locator("#lessons-status").inner_text()  # the Lessons tab's own line, under the overlay
    line = page.locator(f"{TEXT} .dp-error").inner_text()
    assert line.startswith("⚠ ") and "grammar" in line.lower() and "\n" not in line.strip(), line
    assert line.removeprefix("⚠ ").strip() in status, (line, status)  # the same one line
    assert "fix what the line names in the lesson's JSON" in text, text
    assert "fewer tokens" not in text
    assert_seen(page, f"{TEXT} .dp-error")
    assert page.locator("#present-chart .js-plotly-plot").count() == 0  # no chart of an earlier run
    page.set_viewport_size({"width": 390, "height": 844})  # the page sends its new width: the line stays
    page.wait_for_function("() => document.querySelector('#present-width input')?.value === '390'")
    page.wait_for_timeout(1000)  # the width's event answered
    assert page.locator(f"{TEXT} .dp-error").inner_text() == line
    assert page.evaluate("() => document.documentElement.scrollWidth") <= 390


def test_the_time_limit_says_what_a_lesson_can_do(projector_page, live_app, monkeypatch):
    monkeypatch.setenv("DP_REQUEST_SECONDS", "3")  # read per request: this test's runs only
    page = projector_page
    text = run_in_presenter(page, live_app, lesson("long-run", {"max_new_tokens": 512, "min_new_tokens": 512}))
    assert "stopped: the run went past the 3 s time limit" in text, text
    assert "Run the lesson again" in text and "fewer tokens" not in text, text
    assert "fewer tokens" not in page.locator("#lessons-status").inner_text()
    assert_seen(page, f"{TEXT} .dp-status")
