"""Stop in a real browser (issue #27): a 512-token Step-through run stops within about one step of
the press, no token streams in after it, and the status ends on "stopped" and stays there."""

import pytest

from tests.helpers.common import open_tab

# `alone`: how soon the page says stopped is measured on a quiet machine (make test's one-process phase)
pytestmark = [pytest.mark.slow, pytest.mark.browser, pytest.mark.alone]

TOKENS = "() => document.querySelectorAll('#step-text .token').length"
STATUS = "() => document.querySelector('#step-status').innerText"


@pytest.mark.parametrize("after", [1, 2])
def test_stop_ends_a_512_token_run_at_once_and_says_stopped(page, live_app, after):
    page.goto(live_app)
    open_tab(page)
    page.fill("#step-prompt textarea", "Write a long story about the sea.")
    page.click("#step-group-penalties")  # the accordion holding min_new_tokens
    for knob in ("max_new_tokens", "min_new_tokens"):  # 512 tokens, no early end
        page.fill(f"#step-knob-{knob} input[type=number]", "512")
        page.locator(f"#step-knob-{knob} input[type=number]").press("Enter")
    page.click("#step-generate")
    page.wait_for_selector("#step-status:has-text('generating… ')", timeout=300_000)
    page.wait_for_function(f"() => ({TOKENS})() >= {8 * after}", timeout=300_000)  # early, then later in the run
    page.click("#step-stop")
    page.wait_for_function(f"() => ({STATUS})().trim().startsWith('stopped')", timeout=30_000)
    at_stop = page.evaluate(TOKENS)  # on screen when the page first says stopped
    seen = []
    final_word = "stopped: the run was cancelled"
    for _ in range(120):  # until the run's own last word arrives (a loaded machine: seconds), 30 s at most
        page.wait_for_timeout(250)
        seen.append((page.evaluate(TOKENS), page.evaluate(STATUS)))
        if seen[-1][1].startswith(final_word):
            break
    for _ in range(12):  # then 3 s more: nothing changes after it
        page.wait_for_timeout(250)
        seen.append((page.evaluate(TOKENS), page.evaluate(STATUS)))
    assert all(status.strip().startswith("stopped") for _, status in seen), seen  # never flips back
    final_count, final_status = seen[-1]
    assert final_status.startswith(f"stopped: the run was cancelled after {final_count} of 512 tokens"), seen
    assert [count for count, _ in seen[-12:]] == [final_count] * 12, seen  # nothing streams in after the end
    # the steps made while the press travelled and the ones a throttled update had not shown yet:
    # a handful, never the ~50 tokens (11-18 s) of before
    assert at_stop <= final_count <= at_stop + 6, (at_stop, seen)
    # The partial run stays inspectable: a token click selects it, the chart is drawn.
    page.locator("#step-text .token").nth(final_count // 2).click()
    page.wait_for_function("() => document.querySelector('#step-chart .gtitle')?.textContent"
                           f".startsWith('step {final_count // 2}:')")
