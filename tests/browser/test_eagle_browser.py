"""The EAGLE section of Search & heads in a real browser (real server, embedded model, shipped
head) on a phone and a projector: run it, see the draft tree, the summary and the side-by-side;
/eagle_trace through gradio_client."""

import pytest

from tests.helpers.api import api_client
from tests.helpers.common import browser_page, open_tab

pytestmark = [pytest.mark.slow, pytest.mark.browser]


@pytest.fixture(params=[(390, 844), (1280, 720)], ids=["phone", "projector"])
def sized_page(browser, request):
    yield from browser_page(browser, *request.param)


def test_eagle_draws_its_tree_and_summary(sized_page, live_app, artifacts):
    page = sized_page
    width = page.viewport_size["width"]
    page.goto(live_app)
    open_tab(page, "Search & heads")
    page.click("button[role=tab]:has-text('EAGLE')")
    page.fill("#eagle-knob-max_new_tokens input[type=number]", "12")
    page.locator("#eagle-knob-max_new_tokens input[type=number]").press("Enter")
    page.click("#eagle-run")
    page.wait_for_selector("#eagle-status:has-text('done:')", timeout=300_000)
    page.wait_for_selector("#eagle-tree .js-plotly-plot")
    assert page.locator("#eagle-tree .scatterlayer .point").count() >= 2  # the root and at least one draft node
    assert "draft nodes accepted" in page.locator("#eagle-tree").inner_text()
    summary = page.locator("#eagle-summary").inner_text()
    assert "tokens per target forward" in summary and "Same tokens as target-only: yes" in summary
    table = page.locator("#eagle-compare").inner_text()
    assert "Medusa" in table and "n-gram" in table
    page.wait_for_selector("#eagle-calibration .js-plotly-plot")
    assert page.evaluate("() => document.scrollingElement.scrollWidth") <= width + 1
    page.screenshot(path=str(artifacts / f"eagle-{width}.png"), full_page=True)


def test_eagle_trace_through_gradio_client(live_app):
    trace = api_client(live_app).predict("Say hello.", {"max_new_tokens": 8}, "eagle", True, api_name="/eagle_trace")
    assert trace["strategy"] == "eagle" and trace["summary"]["baseline_same_tokens"] is True
    assert sum(len(r["emitted_token_ids"]) for r in trace["rounds"]) == len(trace["generated_token_ids"])
    assert trace["summary"]["tokens_per_target_forward"] == pytest.approx(len(trace["generated_token_ids"]) / len(trace["rounds"]))
    assert all(n["status"] in ("accepted", "rejected", "untested") for r in trace["rounds"] for n in r["tree"])
