"""Shared by the tests: what tests/browser/test_remote_views_browser.py and the tests beside it use."""

from __future__ import annotations


__all__ = ['generate_six_tokens', 'open_on_the_server']


def open_on_the_server(page, url: str, listed: str, load: bool = True) -> None:
    """Open the app (``load``) and pick the listed server in the model box, as a person does."""
    if load:
        page.goto(url)
    page.click("#dp-model input")
    page.locator("ul[role=listbox] li", has_text=listed).first.click()
    page.wait_for_selector("#dp-model-status:has-text('a served model, step mode')", timeout=60_000)


def generate_six_tokens(page) -> None:
    """In Step through: a prompt, 6 tokens, Generate; wait for the run and its chart."""
    page.fill("#step-prompt textarea", "Name a colour of the sea.")
    page.fill("#step-knob-max_new_tokens input[type=number]", "6")
    page.locator("#step-knob-max_new_tokens input[type=number]").press("Enter")
    page.click("#step-generate")
    page.wait_for_selector("#step-status:has-text('done')", timeout=300_000)
    page.wait_for_selector("#step-chart .js-plotly-plot")
