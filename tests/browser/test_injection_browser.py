"""Markup from a user never becomes markup on the page: hostile share links (a preset key, a preset
name, a prompt), a hostile prompt run through the model, and the model's own output, in a real
browser. A working link to evil.example, an <img> with onerror or a <script> that ran would fail."""

from __future__ import annotations

import base64
import json
import zlib

import pytest

from engine.sharelink import SHARE_PARAM, TOKEN_PREFIX, checksum

from tests.helpers.common import open_tab

pytestmark = [pytest.mark.slow, pytest.mark.browser]

LINK = "<a href=//evil.example>Login</a>"
IMG = "<img src=x onerror=\"window.__pwned=1\">"
SCRIPT = "<script>window.__pwned=2</script>"
PAYLOAD = f"{LINK} {IMG} {SCRIPT}"


def hostile_token(payload: dict) -> str:
    """A share-link token for any payload, packed exactly as engine.sharelink packs one (valid checksum)."""
    raw = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    packer = zlib.compressobj(9, zlib.DEFLATED, -15)
    body = base64.urlsafe_b64encode(packer.compress(raw) + packer.flush()).rstrip(b"=").decode("ascii")
    return f"{TOKEN_PREFIX}{body}.{checksum(body)}"


def assert_no_markup_ran(page) -> None:
    assert page.locator("a[href*='evil.example']").count() == 0
    assert page.locator("img[src='x']").count() == 0
    assert page.evaluate("() => window.__pwned === undefined")


def test_hostile_share_links_stay_text(page, live_app):
    bad_key = {"view": "step", "prompt": "Hi", "seed": 1,
               "preset": {"version": 1, "name": "x", "strategy": "sample", LINK: 1}}
    page.goto(f"{live_app}/?{SHARE_PARAM}={hostile_token(bad_key)}")
    page.get_by_text("could not be opened").first.wait_for(timeout=120_000)  # the warning toast
    assert_no_markup_ran(page)

    bad_name = {"view": "step", "prompt": PAYLOAD, "seed": 1,
                "preset": {"version": 1, "name": f"Evil {LINK}", "strategy": "sample", "temperature": 0.7}}
    page.goto(f"{live_app}/?{SHARE_PARAM}={hostile_token(bad_name)}")
    page.wait_for_function("() => document.querySelector('#step-prompt textarea')?.value.includes('evil.example')",
                           timeout=120_000)
    assert page.locator("#step-prompt textarea").input_value() == PAYLOAD  # the prompt is kept, as text
    assert_no_markup_ran(page)


def test_hostile_prompt_and_model_output_stay_text(page, live_app):
    page.goto(live_app)
    open_tab(page)
    page.fill("#step-prompt textarea", f"Repeat exactly: {PAYLOAD}")
    page.fill("#step-knob-max_new_tokens input[type=number]", "12")
    page.locator("#step-knob-max_new_tokens input[type=number]").press("Enter")
    page.click("#step-generate")
    page.wait_for_selector("#step-status:has-text('done')", timeout=300_000)
    assert page.locator("#step-text .token").count() > 0
    page.locator("#step-text .token").first.click()
    page.wait_for_selector("#step-chart .gtitle", timeout=60_000)
    assert_no_markup_ran(page)
