"""Beam search in a real browser: run a search and see the tree, the hypotheses and the re-ranking."""

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.browser]


def test_run_beam_search_and_see_the_tree(page, live_app, artifacts):
    page.goto(live_app)
    page.click("button[role=tab]:has-text('Beam search')")
    page.fill("#beam-prompt textarea", "The capital of France is")
    page.fill("#beam-knob-max_new_tokens input[type=number]", "8")
    page.locator("#beam-knob-max_new_tokens input[type=number]").press("Enter")
    page.click("#beam-run")
    page.wait_for_selector("#beam-status:has-text('done')", timeout=300_000)
    page.wait_for_selector("#beam-tree .js-plotly-plot")
    # nodes are drawn as plotly markers; the tree has at least one per step of the winning path
    assert page.locator("#beam-tree .scatterlayer .point").count() >= 8
    assert "Paris" in page.locator("#beam-hypotheses").inner_text() + page.locator("#beam-winner").inner_text()
    assert page.locator("#beam-greedy").inner_text().strip()
    page.screenshot(path=str(artifacts / "beam.png"), full_page=True)
