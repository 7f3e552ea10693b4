"""Presets in a real browser (Debian chromium via Playwright): share links restore a view's controls,
bad links fall back to the defaults, user presets live in this browser's storage and survive a reload
and an app restart, imports keep the good presets."""

from __future__ import annotations

import json

import pytest

from engine.presets import builtin_presets
from engine.sharelink import ShareState, decode, encode

from tests.helpers.common import launch_local, open_tab
from tests.helpers.api import api_client

pytestmark = [pytest.mark.browser, pytest.mark.slow]

DEFAULT_PROMPT = "Write a haiku about the sea."  # the step view's default


def textbox(page, elem_id: str):
    return page.locator(f"#{elem_id} textarea, #{elem_id} input").first


def wait_value(page, elem_id: str, value: str) -> None:
    """Wait until a textbox/number input inside ``#elem_id`` holds ``value``."""
    page.wait_for_function(
        """([id, value]) => { const el = document.querySelector(`#${id} textarea, #${id} input`);
                             return el !== null && el.value === value; }""", arg=[elem_id, value], timeout=30_000)


def knob_value(page, name: str) -> str:
    return page.locator(f"#tab-step #step-knob-{name} input").first.input_value()


def visible_text(page, scope: str, text: str):
    return page.locator(scope).get_by_text(text, exact=True).filter(visible=True).first


def test_share_link_restores_view_prompt_preset_and_seed(live_app, page):
    state = ShareState("step", "Sharing is caring", builtin_presets()["creative"], seed=123, chat=False)
    page.goto(f"{live_app}/?share={encode(state)}")
    wait_value(page, "step-prompt", "Sharing is caring")
    assert knob_value(page, "temperature") == "1.2"
    assert knob_value(page, "top_k") == "50"
    assert knob_value(page, "seed") == "123"
    assert textbox(page, "step-preset").input_value() == "creative"
    assert not page.locator("#step-chat input[type=checkbox]").is_checked()  # the default is checked


@pytest.mark.parametrize("token", ["s1.garbage!!", "s1." + "A" * 7000, "v2.abc"])
def test_bad_link_warns_and_opens_the_defaults(live_app, page, token):
    page.goto(f"{live_app}/?share={token}")
    open_tab(page)
    page.get_by_text("could not be opened").first.wait_for(timeout=30_000)
    assert textbox(page, "step-prompt").input_value() == DEFAULT_PROMPT


def _copy_link(page) -> str:
    if page.locator("#step-copy-link").count():
        button, box = "#step-copy-link", "step-share-link"
    else:  # the app's shared "Share a link" row
        page.locator("#dp-share").click()
        button, box = "#dp-copy-link", "dp-share-link"
    page.locator(button).click()
    page.wait_for_function(
        f"(document.querySelector('#{box} textarea, #{box} input') || {{}}).value?.includes('share=s2.')",
        timeout=30_000)
    return textbox(page, box).input_value()


def test_copy_link_opens_the_same_state(live_app, page):
    page.goto(live_app)
    open_tab(page)
    textbox(page, "step-prompt").fill("Round trip: ünïcode & ?query#hash")
    seed = page.locator("#tab-step #step-knob-seed input").first
    seed.fill("77")
    seed.press("Enter")
    link = _copy_link(page)
    assert link.startswith(live_app) and "share=s2." in link
    other = page.context.new_page()
    other.goto(link)
    wait_value(other, "step-prompt", "Round trip: ünïcode & ?query#hash")
    assert knob_value(other, "seed") == "77"
    other.close()


def _open_presets_tab(page) -> None:
    page.get_by_role("tab", name="Presets").click()


def _save(page, name: str) -> None:
    textbox(page, "presets-save-name").fill(name)
    page.locator("#presets-save").click()
    page.get_by_text(f"Saved '{name}' in this browser.").wait_for(timeout=30_000)
    visible_text(page, "#presets-mine", name).wait_for(timeout=30_000)


def test_user_presets_save_rename_delete_and_survive_reload(live_app, page):
    page.goto(live_app)
    _open_presets_tab(page)
    _save(page, "My cool preset")
    page.reload()
    _open_presets_tab(page)
    visible_text(page, "#presets-mine", "My cool preset").wait_for(timeout=30_000)
    page.get_by_role("tab", name="Step through").click()  # the step view's picker lists it too
    page.locator("#step-preset input").click()
    assert "★ My cool preset" in page.locator("ul[role=listbox] li").all_inner_texts()
    page.keyboard.press("Escape")
    _open_presets_tab(page)
    page.locator("#presets-mine-pick input").click()
    page.locator("ul[role=listbox] li").filter(has_text="My cool preset").first.click()
    textbox(page, "presets-new-name").fill("Renamed preset")
    page.locator("#presets-rename").click()
    visible_text(page, "#presets-mine", "Renamed preset").wait_for(timeout=30_000)
    page.locator("#presets-mine-pick input").click()
    page.locator("ul[role=listbox] li").filter(has_text="Renamed preset").first.click()
    page.locator("#presets-delete").click()
    page.get_by_text("Deleted 'Renamed preset'.").wait_for(timeout=30_000)
    # Only the app's own keys: the presets, and the Step view's session owner (set once a run or the
    # page's example run is shown there).
    keys = set(page.evaluate("Object.keys(localStorage)"))
    assert "decoding-playground-user-presets" in keys
    assert keys <= {"decoding-playground-user-presets", "decoding-playground-owner"}, keys


def test_import_keeps_the_good_presets_and_exports(live_app, page, tmp_path):
    good = {"version": 1, "name": "Imported one", "description": "Cool.", "strategy": "sample", "temperature": 0.5}
    bad = {"name": "Broken", "temperature": 9}
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps([good, bad]))
    page.goto(live_app)
    _open_presets_tab(page)
    page.locator("#presets-import input[type=file]").set_input_files(str(path))
    page.get_by_text("Imported 1: Imported one.").wait_for(timeout=30_000)
    status = page.locator("#presets-status").inner_text()
    assert "preset 2 ('Broken'): temperature: 9.0 is out of range; allowed 0 or [0.01, 5]" in status
    visible_text(page, "#presets-mine", "Imported one").wait_for(timeout=30_000)
    page.locator("#presets-export-mine").click()  # and back out as a file
    page.locator("#presets-exported").get_by_text("my-presets", exact=True).wait_for(timeout=30_000)


def test_user_presets_survive_an_app_restart(registry, page):
    """Same origin (host and port), a new server process state: the browser's presets decrypt again."""
    from playground.app import build_app
    from tests.helpers.common import free_port

    port = free_port()
    first = build_app(registry)
    launch_local(first, port)
    url = first.local_url.rstrip("/")
    try:
        page.goto(url)
        _open_presets_tab(page)
        _save(page, "Kept across restarts")
    finally:
        first.close()
    second = build_app(registry)
    launch_local(second, port)
    try:
        page.goto(url)
        _open_presets_tab(page)
        visible_text(page, "#presets-mine", "Kept across restarts").wait_for(timeout=30_000)
    finally:
        second.close()


def test_api_endpoints(live_app):
    """The Presets tab's endpoints, as gradio_client sees them (no browser needed, but a live server)."""

    client = api_client(live_app)
    canonical = client.predict('{"name": " Mine ", "temperature": 1.0, "top_k": 3}', api_name="/preset_validate")
    assert canonical == {"version": 1, "name": "Mine", "description": "", "strategy": "sample", "top_k": 3}
    flags = client.predict(builtin_presets()["balanced"].to_json(), "llama.cpp", api_name="/preset_interop")
    assert flags["text"].startswith('--samplers "temperature;top_p" --temp 0.8 --top-p 0.9')
    query = client.predict("step", "Hi", builtin_presets()["wild"].to_json(), 5, None, api_name="/share_link")
    state = decode(query.removeprefix("?share="))
    assert (state.view, state.prompt, state.seed, state.preset.config.top_k) == ("step", "Hi", 5, 100)
    with pytest.raises(Exception, match="top_k: -1 is out of range"):
        client.predict('{"name": "x", "top_k": -1}', api_name="/preset_validate")
