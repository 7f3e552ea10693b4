"""Shared by the tests: what tests/remote/test_remote_views.py and the tests beside it use."""

from __future__ import annotations

import html
import socket
import pytest
from tests.helpers.continue_compare import Page

__all__ = ['compare_session', 'generate', 'pick', 'remote_page', 'served', 'shown']


def dead_url() -> str:
    """A 127.0.0.1 URL nothing listens on (a port just freed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


DEAD = f"llamacpp:{dead_url()}"


def shown(page: Page, elem_id: str) -> str:
    """What ``elem_id`` shows, as text (HTML entities read back)."""
    return html.unescape(page.shown(elem_id) or "")


# --- the page, over the real llama-server -----------------------------------------------------------
@pytest.fixture(scope="module")
def served(llama_server, registry, embedded):
    """(the app, the listed server's model-box value): DP_REMOTE_MODELS lists the real server and
    one where nothing listens."""
    from playground.app import build_app

    listed = f"llamacpp:{llama_server}"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DP_REMOTE_MODELS", f"{listed},{DEAD}")
        demo = build_app(registry)
    return demo, listed


def pick(page: Page, value: str) -> list[dict]:
    page.set("dp-model", value)
    return page.fire("on_model", "dp-model")


def generate(page: Page, prompt: str, tokens: int = 8, seed: int = 3, strategy: str = "sample") -> None:
    page.set("step-prompt", prompt)
    page.set("step-knob-max_new_tokens", tokens)
    page.set("step-knob-seed", seed)
    page.set("step-strategy", strategy)
    page.fire("on_run", "step-text")
    assert "done" in page.shown("step-status"), page.shown("step-status")


def remote_page(served) -> Page:
    demo, listed = served
    page = Page(demo)
    pick(page, listed)
    return page


def compare_session(page: Page):
    from playground.views.compare.lanes import CompareSession

    return next(v for v in page.values.values() if isinstance(v, CompareSession))
