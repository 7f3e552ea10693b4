"""Issue #37 in a real browser: the operator lists the real vLLM (DP_REMOTE_MODELS); a person picks it
in the model box and runs Step through, Compare, Beam search and Speculative on it."""

from __future__ import annotations

import pytest

from tests.helpers.common import launch_local
from tests.helpers.remote_views_browser import generate_six_tokens, open_on_the_server

pytestmark = [pytest.mark.vllm, pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(2400)]


@pytest.fixture(scope="module")
def vllm_app(vllm_server, registry, embedded):
    """The whole app, DP_REMOTE_MODELS listing the real vLLM; yields (URL, the model-box value, vLLM's /v1)."""
    from deploy.vllm_serve import remote_spec
    from playground.app import build_app

    listed = remote_spec(vllm_server)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DP_REMOTE_MODELS", listed)
        demo = build_app(registry)
    launch_local(demo)
    yield demo.local_url.rstrip("/"), listed, f"{vllm_server}/v1"
    demo.close()


def set_number(page, selector: str, value: int) -> None:
    page.fill(selector, str(value))
    page.locator(selector).press("Enter")


def test_step_compare_beam_and_speculative_run_on_vllm(page, vllm_app, artifacts):
    url, listed, api = vllm_app
    open_on_the_server(page, url, listed)
    served = f"openai:{api}"

    page.click("button[role=tab]:has-text('Step through')")
    generate_six_tokens(page)
    summary = page.locator("#step-summary").inner_text()
    assert f"Remote model {served}, step mode" in summary and "the server's top 100" in summary, summary
    texts = " ".join(page.eval_on_selector_all("#step-chart svg text", "els => els.map(e => e.textContent)"))
    assert "raw" in texts and "final" in texts, texts
    page.screenshot(path=str(artifacts / "vllm-step.png"), full_page=True)

    page.get_by_role("tab", name="Compare").click()
    page.fill("#cmp-prompt textarea", "Name a colour of the sea.")
    for lane in (0, 1):
        set_number(page, f"#cmp-lane-{lane}-knob-max_new_tokens input", 6)
    page.click("#cmp-run")
    page.wait_for_selector("#cmp-status:has-text('done:')", timeout=300_000)
    for lane in (0, 1):  # every lane ran on the header's model: the served vLLM
        assert f"on {served}" in page.locator(f"#cmp-lane-{lane}-status").inner_text()
    page.wait_for_function("() => document.querySelectorAll('#cmp-metrics [role=gridcell]').length >= 8")
    page.screenshot(path=str(artifacts / "vllm-compare.png"), full_page=True)

    page.get_by_role("tab", name="Beam search").click()
    page.fill("#beam-prompt textarea", "The capital of France is")
    set_number(page, "#beam-knob-max_new_tokens input[type=number]", 5)
    page.click("#beam-run")
    page.wait_for_selector("#beam-status:has-text('done')", timeout=300_000)
    page.wait_for_selector("#beam-tree .js-plotly-plot")
    assert page.locator("#beam-tree .scatterlayer .point").count() >= 5
    assert "Paris" in page.locator("#beam-hypotheses").inner_text() + page.locator("#beam-winner").inner_text()
    page.screenshot(path=str(artifacts / "vllm-beam.png"), full_page=True)

    page.get_by_role("tab", name="Speculative").click()
    page.fill("#spec-prompt textarea", "Monday, Tuesday, Wednesday, Thursday, Friday. Monday, Tuesday,")
    page.click("#spec-chat input")  # off: the prompt continues as text
    set_number(page, "#spec-knob-max_new_tokens input[type=number]", 10)
    page.click("#spec-generate")
    page.wait_for_selector("#spec-status:has-text('done')", timeout=300_000)
    summary = page.locator("#spec-summary").inner_text()
    assert f"Remote model {served}, step mode" in summary, summary
    assert "scores the drafts by prompt_logprobs (one request per round)" in summary, summary
    assert "×" in page.locator("#spec-speedup").inner_text()
    assert page.locator("#spec-rounds [data-chip]").count() >= 2
    page.screenshot(path=str(artifacts / "vllm-speculative.png"), full_page=True)
