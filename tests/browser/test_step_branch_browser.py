"""Branching in a real browser: generate, then branch from the first, a middle and the last step
(each from the original run) with another token; every branch streams in without an error."""

import pytest

from tests.helpers.common import open_tab

pytestmark = [pytest.mark.slow, pytest.mark.browser]


def test_branch_from_first_middle_and_last_step(page, live_app, artifacts):
    page.goto(live_app)
    open_tab(page)
    page.fill("#step-prompt textarea", "Once upon a time, in a small village by the sea,")
    page.fill("#step-knob-max_new_tokens input[type=number]", "6")
    page.locator("#step-knob-max_new_tokens input[type=number]").press("Enter")
    page.click("#step-generate")
    page.wait_for_selector("#step-status:has-text('done')", timeout=300_000)
    tokens = page.locator("#step-text .token")
    last = tokens.count() - 1
    assert last >= 2
    for n, at in enumerate((0, last // 2, last), start=1):
        page.locator("#step-runs label").filter(has_text="#0 original").click()
        page.wait_for_function("() => document.querySelector('#step-compare')?.innerText.trim() === ''")
        tokens.nth(at).click()
        page.wait_for_function(f"() => document.querySelector('#step-chart .gtitle')?.textContent"
                               f".startsWith('step {at}:')")
        page.locator("#step-alt input").click()
        page.locator("ul[role=listbox] li").nth(1).click()  # the second most likely token: not the one chosen
        page.click("#step-branch")
        page.locator("#step-runs label").filter(has_text=f"#{n} branch at step {at}:").wait_for(timeout=300_000)
        page.wait_for_selector("#step-status:has-text('done')", timeout=300_000)
        assert page.locator("#step-status .dp-error").count() == 0
        assert "This branch" in page.locator("#step-compare").inner_text()
    page.screenshot(path=str(artifacts / "step-branches.png"), full_page=True)
