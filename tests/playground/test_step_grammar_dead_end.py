"""Step through's JSON example on a served model in step mode (issue #52), driven as a person
drives the page (the app's own Generate handler, tests/helpers/continue_compare.Page) against a fake
llama.cpp server whose top-N at step 0 holds no token a JSON object can start with (" t10", " t11",
...). The page said "done: 0 tokens, stopped by no_tokens_left… click any token" and nothing about
why; it now says that the grammar allows none of the server's top-N tokens at step 0 and offers
fast mode, where the server's own grammar constrains its sampler."""

from __future__ import annotations

import html
import json
from pathlib import Path

import pytest

from playground.views.step import FAST_MODE_HINT
from tests.helpers.fault_servers import TOP_IDS, FakeServer, piece
from tests.helpers.continue_compare import Page

pytestmark = pytest.mark.slow

JSON_PRESET = json.loads((Path(__file__).resolve().parents[2] / "presets" / "json-object.json").read_text())


@pytest.fixture(scope="module")
def served(registry, embedded):
    """(the app, the fake llama.cpp server it lists)."""
    from playground.app import build_app

    server = FakeServer("llamacpp")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DP_REMOTE_MODELS", server.spec)
        env.setenv("DP_EXAMPLES", "0")
        demo = build_app(registry)
    try:
        yield demo, server
    finally:
        server.close()


def test_a_grammar_that_allows_none_of_the_top_n_says_so_and_offers_fast_mode(served):
    demo, server = served
    assert not any(piece(t).lstrip().startswith("{") for t in TOP_IDS)  # the oracle: no top token opens an object
    page = Page(demo)
    page.set("dp-model", server.spec)
    page.set("step-remote-mode", "step")
    page.set("step-strategy", JSON_PRESET["strategy"])
    page.set("step-knob-grammar", JSON_PRESET["grammar"])
    page.set("step-knob-max_new_tokens", 8)
    page.set("step-prompt", "Describe a person as JSON.")
    page.fire("on_run", "step-text")
    status = html.unescape(page.shown("step-status"))
    assert "done: 0 tokens: step 0: the grammar allows none of the server's top" in status, status
    assert "no_tokens_left" not in status and "click any token" not in status, status
    assert FAST_MODE_HINT in status, status
    assert "⚠" not in status


def test_a_run_that_ends_otherwise_says_nothing_more(served):
    """The same server without a grammar: its greedy text, stopped by the token budget, no hint."""
    demo, server = served
    page = Page(demo)
    page.set("dp-model", server.spec)
    page.set("step-remote-mode", "step")
    page.set("step-strategy", "greedy")
    page.set("step-knob-grammar", "")
    page.set("step-knob-max_new_tokens", 4)
    page.set("step-prompt", "Count:")
    page.fire("on_run", "step-text")
    status = page.shown("step-status")
    assert status.startswith('<div class="dp-status">done: 4 tokens, stopped by max_new_tokens.'), status
    assert "fast mode" not in status
