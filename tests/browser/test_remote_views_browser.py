"""Issue #29 in a real browser: pick the llama.cpp server the operator lists in the model box,
generate in Step through, and see the stage chart, the approximations line and the tail mass."""

from __future__ import annotations

import pytest

from tests.helpers.common import launch_local
from tests.helpers.screenshots_browser import DOCS
from tests.helpers.remote_llamacpp import server_test
from tests.helpers.remote_views_browser import generate_six_tokens, open_on_the_server  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.browser]


@pytest.fixture(scope="module")
def served_app(llama_server, registry, embedded):
    """The whole app, DP_REMOTE_MODELS listing the real llama-server; yields (URL, the model-box value)."""
    from playground.app import build_app

    listed = f"llamacpp:{llama_server}"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DP_REMOTE_MODELS", listed)
        demo = build_app(registry)
    launch_local(demo)
    yield demo.local_url.rstrip("/"), listed
    demo.close()


@server_test
def test_pick_the_server_generate_and_see_the_chart_and_the_approximations(page, served_app, artifacts):
    url, listed = served_app
    open_on_the_server(page, url, listed)
    page.click("button[role=tab]:has-text('Step through')")
    generate_six_tokens(page)
    summary = page.locator("#step-summary").inner_text()
    assert f"Remote model {listed}, step mode" in summary and "Approximations:" in summary
    assert "the raw distribution is the server's top 100, renormalised" in summary
    explain = page.locator("#step-explain").inner_text()
    assert "Outside the server's top 100 lay" in explain and "(the tail): it is outside every chart" in explain
    texts = " ".join(page.eval_on_selector_all("#step-chart svg text", "els => els.map(e => e.textContent)"))
    assert "raw" in texts and "final" in texts, texts  # raw -> each stage -> final, over the top-N
    assert "server's top 100; tail" in texts and "not drawn" in texts, texts  # the tail mass, under raw's title
    page.screenshot(path=str(artifacts / "remote-step.png"), full_page=True)
    # docs/remote.md's picture: the model box, the run and its chart, the approximations line
    width = page.evaluate("document.documentElement.scrollWidth")
    page.screenshot(path=str(DOCS / "remote-step.png"), full_page=True, clip=dict(x=0, y=0, width=width, height=2760))


@server_test
def test_speculative_on_the_server_click_a_round_s_chip(page, served_app, artifacts):
    url, listed = served_app
    open_on_the_server(page, url, listed)
    page.get_by_role("tab", name="Speculative").click()
    page.fill("#spec-prompt textarea", "Monday, Tuesday, Wednesday, Thursday, Friday. Monday, Tuesday,")
    page.click("#spec-chat input")  # off: the prompt continues as text
    page.fill("#spec-knob-max_new_tokens input[type=number]", "12")
    page.locator("#spec-knob-max_new_tokens input[type=number]").press("Enter")
    page.click("#spec-generate")
    page.wait_for_selector("#spec-status:has-text('done')", timeout=300_000)
    assert page.locator("#spec-knob-drafter textarea, #spec-knob-drafter input").first.input_value() == "ngram"
    summary = page.locator("#spec-summary").inner_text()
    assert f"Remote model {listed}, step mode" in summary and "scores the drafts by one request per position" in summary
    assert "×" in page.locator("#spec-speedup").inner_text()  # vs the server's target alone, one request per token
    chips = page.locator("#spec-rounds [data-chip]")
    assert chips.count() >= 3
    last = chips.nth(chips.count() - 1)  # the last round's last chip
    r, pos, kind = (last.get_attribute(a) for a in ("data-round", "data-pos", "data-kind"))
    expected = f"Round {r}, bonus" if kind == "bonus" else f"Round {r}, position {pos}:"
    last.click()
    page.wait_for_function(f"() => document.querySelector('#spec-explain')?.innerText.includes({expected!r})")
    assert page.locator("#spec-pq .js-plotly-plot").count() == 1
    page.screenshot(path=str(artifacts / "remote-speculative.png"), full_page=True)
    # docs/remote.md's picture: rounds, the clicked chip's p vs q, the remote summary
    bottom = page.evaluate("document.querySelector('#spec-summary').getBoundingClientRect().bottom + window.scrollY")
    width = page.evaluate("document.documentElement.scrollWidth")
    page.screenshot(path=str(DOCS / "remote-speculative.png"), full_page=True,
                    clip=dict(x=0, y=0, width=width, height=bottom + 40))


@server_test
def test_the_fast_mode_radio_appears_for_the_server_and_the_server_samples(page, served_app):
    url, listed = served_app
    page.goto(url)
    page.click("button[role=tab]:has-text('Step through')")
    assert not page.locator("#step-remote-mode").is_visible()  # the embedded model: no such choice
    open_on_the_server(page, url, listed, load=False)
    page.wait_for_selector("#step-remote-mode", state="visible")
    page.locator("#step-remote-mode label", has_text="fast").click()
    generate_six_tokens(page)
    summary = page.locator("#step-summary").inner_text()
    assert f"Remote model {listed}, fast mode" in summary and "the server sampled" in summary, summary
    texts = " ".join(page.eval_on_selector_all("#step-chart svg text", "els => els.map(e => e.textContent)"))
    assert "raw" in texts and "final" in texts, texts  # the server's own two lists
