"""Search & heads and the memory panels in a real browser and through gradio_client (real server,
embedded model): MCTS tree, Medusa rounds, the KV calculator, and the new named endpoints."""

from pathlib import Path

import pytest
from tests.helpers.api import api_client

pytestmark = [pytest.mark.slow, pytest.mark.browser]
DOCS = Path(__file__).resolve().parents[2] / "docs"


def shot(page, selector: str, path: Path, height: int = 1100) -> None:
    """The top of ``selector``'s box (the knob column below it is long), scrolled into view."""
    page.locator(selector).scroll_into_view_if_needed()
    box = page.locator(selector).bounding_box()
    page.screenshot(path=str(path), full_page=True,
                    clip={"x": box["x"], "y": box["y"], "width": box["width"], "height": min(box["height"], height)})


def set_number(page, selector: str, value: str) -> None:
    page.fill(selector, value)
    page.locator(selector).press("Enter")


def test_mcts_tree_appears(page, live_app, artifacts):
    page.goto(live_app)
    page.click("button[role=tab]:has-text('Search & heads')")
    page.fill("#mcts-prompt textarea", "The capital of France is")
    set_number(page, "#mcts-knob-max_new_tokens input[type=number]", "3")
    set_number(page, "#mcts-knob-mcts_simulations input[type=number]", "6")
    page.click("#mcts-run")
    page.wait_for_selector("#mcts-status:has-text('done')", timeout=300_000)
    page.wait_for_selector("#mcts-tree .js-plotly-plot")
    assert page.locator("#mcts-tree .scatterlayer .point").count() >= 4  # root + its expanded children
    assert "greedy" in page.locator("#mcts-quality-table").inner_text()
    page.screenshot(path=str(artifacts / "mcts.png"), full_page=True)
    shot(page, "#search-mcts", artifacts / "mcts-view.png")  # docs/mcts.png: tests/browser/test_screenshots_browser.py


def test_medusa_rounds_appear(page, live_app, artifacts):
    page.goto(live_app)
    page.click("button[role=tab]:has-text('Search & heads')")
    page.click("button[role=tab]:has-text('Medusa')")
    set_number(page, "#medusa-knob-max_new_tokens input[type=number]", "16")
    page.click("#medusa-run")
    page.wait_for_selector("#medusa-status:has-text('done')", timeout=300_000)
    page.wait_for_selector("#medusa-tree .js-plotly-plot")
    assert "tokens per target forward" in page.locator("#medusa-summary").inner_text()
    shot(page, "#search-medusa", DOCS / "medusa.png")


def test_calculator_shows_half_a_megabyte_per_token_for_llama2_7b(page, live_app):
    page.goto(live_app)
    page.click("button[role=tab]:has-text('Quantization & KV cache')")
    result = page.locator("#calc-formula")
    result.scroll_into_view_if_needed()
    assert "524,288 bytes per token" in result.inner_text() and "0.5 MiB" in result.inner_text()
    page.locator("#calc-formula").locator("xpath=ancestor::div[contains(@class,'row')][1]").screenshot(
        path=str(DOCS / "memory.png"))


def test_named_endpoints_through_gradio_client(live_app):

    client = api_client(live_app)
    calc = client.predict("Llama-2-7B", 4096, 1, "fp16", "fp16", api_name="/kv_calculator")
    assert calc["estimate"]["kv_bytes_per_token"] == 524_288
    trace = client.predict("The capital of France is", {"max_new_tokens": 2, "mcts_simulations": 4},
                           api_name="/mcts_trace")
    assert trace["strategy"] == "mcts" and len(trace["extra"]["mcts"]) == 2
    trace = client.predict("Say hello.", {"max_new_tokens": 8}, "medusa", True, api_name="/medusa_trace")
    assert trace["summary"]["tokens_per_target_forward"] >= 1.0 and "speedup" in trace["summary"]
    report = client.predict("Say hello.", True, 6, ["dynamic", "quantized-int8"], 4, api_name="/kv_cache_kinds_report")
    assert [k["kind"] for k in report["kinds"]] == ["dynamic", "quantized-int8"]
