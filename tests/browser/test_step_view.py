"""The step-through view: its API endpoint through gradio_client, and a real browser session."""

import pytest

from tests.helpers.common import open_tab
from tests.helpers.api import api_client

pytestmark = pytest.mark.slow


def test_step_trace_api_matches_cli_schema(live_app):

    client = api_client(live_app)
    data = client.predict("The sky is", {"max_new_tokens": 5, "seed": 3}, "balanced", False, "embedded", "none",
                          api_name="/step_trace")
    assert data["strategy"] == "sample" and data["config"]["seed"] == 3
    assert len(data["steps"]) == len(data["generated_token_ids"]) <= 5
    assert [s["name"] for s in data["steps"][0]["stages"]] == ["raw", "temperature", "top_p", "final"]
    again = client.predict("The sky is", {"max_new_tokens": 5, "seed": 3}, "balanced", False, "embedded", "none",
                           api_name="/step_trace")
    assert again["generated_token_ids"] == data["generated_token_ids"]


def test_step_trace_api_rejects_bad_input_with_message(live_app):

    client = api_client(live_app)
    with pytest.raises(Exception, match="temperature"):
        client.predict("hi", {"temperature": 11}, "", False, "embedded", "none", api_name="/step_trace")
    with pytest.raises(Exception, match="prompt: empty"):
        client.predict("   ", {}, "", False, "embedded", "none", api_name="/step_trace")


@pytest.mark.browser
def test_generate_click_token_changes_chart(page, live_app, artifacts):
    page.goto(live_app)
    open_tab(page)
    page.fill("#step-prompt textarea", "Write one sentence about cats.")
    page.fill("#step-knob-max_new_tokens input[type=number]", "12")
    page.locator("#step-knob-max_new_tokens input[type=number]").press("Enter")
    page.click("#step-generate")
    page.wait_for_selector("#step-status:has-text('done')", timeout=300_000)
    tokens = page.locator("#step-text .token")
    assert tokens.count() >= 3
    page.wait_for_selector("#step-chart .js-plotly-plot")
    title_before = page.locator("#step-chart .gtitle").first.text_content()
    selected = page.locator("#step-index input[type=number]").input_value()
    assert title_before.startswith(f"step {selected}:")  # after a run: the most uncertain step
    other = 1 if selected == "2" else 2
    tokens.nth(other).click()
    page.wait_for_function(f"() => document.querySelector('#step-chart .gtitle')?.textContent.startsWith('step {other}:')")
    assert page.locator("#step-explain").inner_text().strip()  # the plain-language explanation is shown
    assert page.locator("#step-index input[type=number]").input_value() == str(other)
    page.screenshot(path=str(artifacts / "step-through.png"), full_page=True)


@pytest.mark.browser
def test_bad_input_shows_message_and_keeps_prompt(page, live_app):
    page.goto(live_app)
    open_tab(page)
    page.fill("#step-prompt textarea", "Keep me")
    page.fill("#step-knob-top_k input[type=number]", "-3")
    page.click("#step-generate")
    page.wait_for_selector("#step-status .dp-error", timeout=60_000)
    assert "top_k" in page.locator("#step-status").inner_text()
    assert page.locator("#step-prompt textarea").input_value() == "Keep me"
