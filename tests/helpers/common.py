"""Shared by the tests: what tests/conftest.py and the tests beside it use."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator
import pytest
import torch
from engine.backends.registry import ModelRegistry

__all__ = ['ARTIFACTS', 'CHROMIUM_ARGS', 'ROOT', 'VLLM_TEST_ARGS', 'browser_page', 'forwards_after_stop', 'free_port', 'make_tiny_llama', 'open_tab', 'serve_llama', 'shared_over', 'wait_for_a_quiet_room']


ROOT = Path(__file__).resolve().parents[2]


ARTIFACTS = ROOT / "test-artifacts"


def make_tiny_llama(vocab_size: int = 49152, seed: int = 0, layers: int = 2, hidden: int = 64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    # Spread the logits so sampling has some structure (random init gives near-uniform outputs).
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_local(demo, port: int | None = None) -> str:
    """``demo.launch`` on a loopback port (``free_port()`` unless given) with the app's launch settings;
    returns its URL. Tried up to 3 times: Gradio checks its own URL with one HEAD of 3 s
    (``gradio.networking.url_ok``) and on a timeout gives up with "When localhost is not accessible, a
    shareable link must be created", which a loaded 2-core CI machine hit once (a browser test beside it)."""
    from playground.app import launch_kwargs

    for attempt in range(3):
        try:
            demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=port or free_port(), quiet=True,
                        **launch_kwargs())
            return demo.local_url.rstrip("/")
        except ValueError as exc:
            if "localhost is not accessible" not in str(exc) or attempt == 2:
                raise
            demo.close()
    raise AssertionError("unreachable")


def shared_over(lm):
    """A real Shared (inside an open gr.Blocks) whose registry always gives ``lm``: the model
    pickers and user presets are real components."""
    from playground.shared import Shared, model_pickers, user_presets_state

    class OneModel(ModelRegistry):
        def get(self, spec, progress=None, *, key="model"):
            return lm

    model, quant = model_pickers()
    return Shared(registry=OneModel(), model=model, quantization=quant, user_presets=user_presets_state())


def forwards_after_stop(forwards: list, stop, started_at: int = 4, settle_s: float = 1.5) -> tuple[int, int, int]:
    """Wait until ``forwards`` reached ``started_at`` (the run started), call ``stop()`` (cancel the
    job, drop the stream), then count: (at the stop, ``settle_s`` later, ``2 * settle_s`` later)."""
    import time

    deadline = time.time() + 120
    while forwards[0] < started_at and time.time() < deadline:
        time.sleep(0.02)
    assert forwards[0] >= started_at, "the run never started"
    stop()
    at_stop = forwards[0]
    time.sleep(settle_s)
    after = forwards[0]
    time.sleep(settle_s)
    return at_stop, after, forwards[0]


CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]


def browser_page(browser, width: int, height: int, timeout_ms: int = 60_000):
    """For a fixture to ``yield from``: a page of a fresh context at width x height, closed after
    the test (also when it fails)."""
    context = browser.new_context(viewport={"width": width, "height": height})
    pg = context.new_page()
    pg.set_default_timeout(timeout_ms)
    try:
        yield pg
    finally:
        context.close()


TAB_CLICK_MS = 180_000  # a tab's first click renders the whole view in the page's main thread


def open_tab(page, title: str = "Step through") -> None:
    """Click a view's tab (the Lessons tab is the one a fresh visit opens on). The click returns once
    the page has handled it, and the first click on a tab renders its view: on the two cores shared
    with the other worker, the background builds and the app, one took over the pages' 60 s (a
    cold make test, the tab found, "performing click action"), so it has its own longer limit."""
    page.locator("button[role=tab]", has_text=title).first.click(timeout=TAB_CLICK_MS)


@contextlib.contextmanager
def serve_llama(binary: Path, *extra: str, log_name: str = "llama-server.log") -> Iterator[str]:
    """A real llama-server serving the embedded GGUF on a free 127.0.0.1 port (``extra``: more of its
    flags); yields its URL once /health answers, stops it after."""
    import subprocess
    import time
    import urllib.request

    from engine.backends.local import gguf_path

    port = free_port()
    ARTIFACTS.mkdir(exist_ok=True)
    log = open(ARTIFACTS / log_name, "w")
    server = subprocess.Popen([str(binary), "-m", str(gguf_path()), "--host", "127.0.0.1", "--port",
                               str(port), "-c", "2048", "-t", "2", "-np", "1", *extra], stdout=log,
                              stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    try:
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.time() > deadline:
                pytest.fail(f"llama-server did not come up on {url} (exit {server.poll()}; log: {log_name})",
                            pytrace=False)
            time.sleep(0.2)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


# Flags the live tests add to deploy/vllm_serve.py's: a keep-alive comment after 1 s idle (a long
# prefill sends some), so the client is seen reading past them.
VLLM_TEST_ARGS = ("--sse-keep-alive-interval", "1")


def wait_for_a_quiet_room(url: str, limit_s: float = 180.0) -> None:
    """Wait until the app's scheduler on the embedded model has ticked for nobody over the last
    ``bench.room.QUIET_S`` seconds: a run another test left going (a page closed mid-run finishes its
    step) must not land in a window a test is about to count (``bench.room.serving_stats`` refuses
    a window whose lead holds another run's ticks)."""
    from bench.room import quiet_room

    try:
        quiet_room(url, limit_s=limit_s)
    except RuntimeError as exc:
        raise AssertionError(str(exc)) from None
