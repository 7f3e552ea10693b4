"""docs/architecture.md's "Add a view" recipe, followed with a toy: a module with ``build_tab(shared)``
whose Run goes through ``shared.events.on`` and ``shared.run``, and whose endpoint is
``shared.events.api``; one line added to ``VIEWS``. With nothing else changed, the app has its tab,
its Run event draws the run (the embedded model's greedy, equal to the runner's own), bad input is one
line in its status, and its endpoint answers a real gradio_client session."""

from __future__ import annotations

import functools
import types

import gradio as gr
import pytest

from engine import runner
from engine.config import DecodingConfig
from engine.control import RunControl
from playground import app, stale
from playground.shared import Shared
from tests.helpers.api import api_client
from tests.helpers.common import launch_local
from tests.helpers.continue_compare import Page

pytestmark = pytest.mark.slow

PROMPT = "The tide came in"
CONFIG = DecodingConfig(strategy="greedy", max_new_tokens=6)


def toy_trace(shared: Shared, prompt: str, model: str = "embedded", *, control: RunControl) -> dict:
    """The toy's endpoint: the greedy run's trace JSON."""
    return shared.trace_json(prompt, {"max_new_tokens": CONFIG.max_new_tokens}, "", False, model, "none",
                             strategies=("greedy",), control=control)


def build_tab(shared: Shared) -> None:
    prompt = gr.Textbox(PROMPT, elem_id="toy-prompt")
    run = gr.Button("Greedy", elem_id="toy-run")
    status = gr.Markdown(elem_id="toy-status")
    text = gr.Textbox(elem_id="toy-text")

    def on_run(prompt_text: str, model: str, quant: str, *, control: RunControl):
        yield {status: "running…", text: ""}
        lm = shared.lm(model, quant)
        trace = shared.run(lm, prompt_text, CONFIG, chat=False, prompt_ids=shared.encode_prompt(lm, prompt_text, False),
                           control=control)
        yield {status: f"done: {len(trace.steps)} tokens", text: trace.text}

    shared.events.on([run.click], on_run, [prompt, shared.model, shared.quantization], [status, text],
                     on_error=stale.cleared(status, [status, text]))
    shared.events.api(functools.partial(toy_trace, shared), "toy_trace")


TOY = types.SimpleNamespace(build_tab=build_tab)  # what app.py reads of a view module


@pytest.fixture(scope="module")
def toy_app(registry):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(app, "VIEWS", (*app.VIEWS, ("Toy", TOY, "toy")))
        demo = app.build_app(registry)
    yield demo
    demo.close()


def test_the_toy_view_gets_its_tab_and_its_run_draws_the_runners_greedy(toy_app, embedded):
    tab = next(b for b in toy_app.blocks.values() if getattr(b, "elem_id", None) == "tab-toy")
    assert tab.label == "Toy"
    page = Page(toy_app)
    shown = page.fire("on_run", "toy-status")
    oracle = runner.run(runner.RunRequest(embedded, PROMPT, CONFIG))
    assert shown[0]["toy-status"] == "running…" and shown[0]["toy-text"] == ""
    assert shown[-1] == {"toy-status": "done: 6 tokens", "toy-text": oracle.text}


def test_bad_input_is_one_line_in_the_toy_status_and_the_prompt_is_kept(toy_app):
    page = Page(toy_app)
    page.set("toy-prompt", "\ud800")
    shown = page.fire("on_run", "toy-status")
    line = shown[-1]["toy-status"]
    assert "prompt" in line and "\n" not in line.strip() and "Traceback" not in line
    assert page.get(page.block("toy-prompt")) == "\ud800"


def test_the_toy_endpoint_answers_a_gradio_client_session(toy_app, embedded):
    launch_local(toy_app)
    answer = api_client(toy_app.local_url.rstrip("/")).predict(PROMPT, "embedded", api_name="/toy_trace")
    oracle = runner.run(runner.RunRequest(embedded, PROMPT, CONFIG))
    assert answer["text"] == oracle.text and answer["strategy"] == "greedy"
    assert [s["chosen_token_id"] for s in answer["steps"]] == [s.chosen_token_id for s in oracle.steps]
