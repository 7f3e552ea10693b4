"""The app builder: header (model, quantization), one tab per view, the queue.

Views that are not present in this build are skipped, so each can be developed on its own.
"""

from __future__ import annotations

import importlib
import logging
import os

import gradio as gr

from engine.models import EMBEDDED, ModelRegistry

from .shared import Shared, default_concurrency, model_pickers, user_presets_state

log = logging.getLogger(__name__)

# (tab title, module under playground.views, elem id), in the design's order of importance.
VIEWS = (
    ("Step through", "step", "tab-step"),
    ("Compare", "compare", "tab-compare"),
    ("Beam search", "beam", "tab-beam"),
    ("Speculative", "speculative", "tab-speculative"),
    ("Quantization & KV cache", "quantization", "tab-quantization"),
    ("Presets", "presets", "tab-presets"),
)

CSS = """
.dp-error { color: #b00020; background: #fdecee; border-left: 4px solid #b00020; padding: 6px 10px; border-radius: 4px; }
.dp-status { color: #555; padding: 4px 2px; }
#step-text .textspan { cursor: pointer; }
footer { display: none !important; }
"""

INTRO = (
    "## Decoding Playground\n"
    "See how a language model turns probabilities into text: every token's distribution before and after each "
    "processing stage, beam search as a tree, speculative decoding round by round."
)


def available_views() -> list[tuple[str, object, str]]:
    views = []
    for title, name, elem_id in VIEWS:
        try:
            module = importlib.import_module(f"playground.views.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"playground.views.{name}":
                raise
            continue
        views.append((title, module, elem_id))
    return views


def build_app(registry: ModelRegistry | None = None, default_model: str = EMBEDDED) -> gr.Blocks:
    registry = registry or ModelRegistry()
    with gr.Blocks(title="Decoding Playground") as demo:
        gr.Markdown(INTRO)
        with gr.Row():
            model, quant = model_pickers(default_model)
        shared = Shared(registry=registry, model=model, quantization=quant, user_presets=user_presets_state(),
                        concurrency_limit=default_concurrency())
        with gr.Tabs(elem_id="dp-tabs") as tabs:
            for title, module, elem_id in available_views():
                with gr.Tab(title, id=elem_id, elem_id=elem_id):
                    module.build_tab(shared)
        shared.extra["tabs"] = tabs
        _wire_load(demo, shared)
    demo.queue(default_concurrency_limit=shared.concurrency_limit, max_size=int(os.environ.get("DP_QUEUE_SIZE", "64")))
    return demo


def _wire_load(demo: gr.Blocks, shared: Shared) -> None:
    """On page load: user presets into every picker, and a share link (if any) into its view."""
    try:
        from . import presets_ui
    except ImportError:
        presets_ui = None
    if presets_ui is not None and hasattr(presets_ui, "wire_share_link"):
        presets_ui.wire_share_link(demo, shared)


def launch_kwargs() -> dict:
    return {"css": CSS, "theme": gr.themes.Soft(), "footer_links": []}
