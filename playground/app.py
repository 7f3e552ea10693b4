"""The app builder: header (model, quantization), one tab per view, share links, the queue."""

from __future__ import annotations

import gradio as gr

from engine.models import EMBEDDED, ModelRegistry, model_policy
from engine.settings import env_int

from . import downloads, events, examples, page_js, share_links
from .events import ModelEvents
from .shared import PanelView, PlaygroundBlocks, Shared, model_pickers, user_presets_state
from .views import beam, compare, lessons, presets, quantization, search, speculative, step, whatif

# (tab title, view module, share-link view name), in the design's order of importance. A tab's id
# is "tab-<name>", which is what a share link selects.
VIEWS = (
    ("Step through", step, "step"),
    ("Compare", compare, "compare"),
    ("Beam search", beam, "beam"),
    ("Speculative", speculative, "speculative"),
    ("Search & heads", search, "search"),
    ("Quantization & KV cache", quantization, "quantization"),
    ("Presets", presets, "presets"),
)
DEFAULT_QUEUE_SIZE = 64

CSS = """
.dp-error { color: #b00020; background: #fdecee; border-left: 4px solid #b00020; padding: 6px 10px; border-radius: 4px; }
.dp-status { color: #555; padding: 4px 2px; }
#step-text .textspan { cursor: pointer; }
footer { display: none !important; }
.dp-presenter { font-size: 1.5rem; position: fixed !important; inset: 0; z-index: 1000; margin: 0 !important;
  padding: 10px 16px !important; background: var(--body-background-fill, #fff); overflow: auto;
  display: flex !important; flex-direction: column !important; flex-wrap: nowrap !important; gap: 8px !important; }
.dp-presenter > * { flex: 0 0 auto; }
#present-top { flex-wrap: nowrap; align-items: flex-start; }
#present-top > #present-text { flex: 1 1 auto; min-width: 0; }
#present-top > #present-qr { flex: 0 0 auto; min-width: 0; width: auto; max-width: 40%; }
#present-qr { cursor: zoom-in; }
#present-qr .dp-qr { margin: 0; display: flex; gap: 8px; align-items: flex-start; }
#present-qr .dp-qr img { width: 96px; height: 96px; }
#present-qr .dp-qr figcaption { max-width: 220px; font-size: .75rem; }
#present-qr.dp-qr-big { cursor: zoom-out; }
#present-qr.dp-qr-big .dp-qr img { width: min(60vh, 480px); height: min(60vh, 480px); }
#present-controls { flex-wrap: wrap; gap: 8px; }
#present-temperature { padding: 4px 8px !important; }
#present-temperature .wrap { display: flex; flex-direction: row !important; align-items: center; gap: 8px; flex-wrap: wrap; }
#present-temperature .head { margin: 0 !important; flex: 0 0 auto; gap: 6px; }
#present-temperature .slider_input_container { flex: 1 1 120px; min-width: 120px; }
#present-temperature .min_value, #present-temperature .max_value, #present-temperature .reset-button { display: none; }
#present-chart { flex: 1 1 0 !important; min-height: 280px; position: relative; padding: 0 !important; }
#present-chart [data-testid=plotly], #present-chart .js-plotly-plot { position: absolute !important; inset: 0; width: 100% !important; height: 100% !important; }
/* A narrow page's presenter chart has a fixed height (a bar's label never crowds the next); the overlay scrolls. */
@media (max-width: 899px) {
  #present-chart { flex: 0 0 auto !important; min-height: 0; }
  #present-chart [data-testid=plotly], #present-chart .js-plotly-plot { position: static !important; height: auto !important; }
}
/* A long beam search is wider than the page (STEP_PX a step): it scrolls sideways. */
#beam-tree [data-testid=plotly] { overflow-x: auto; max-width: 100%; }
.dp-present-text { font-size: 2rem; line-height: 1.3; overflow-wrap: anywhere; max-height: 30vh; overflow: auto; }
.dp-present-token { padding: 0 .3em; border-radius: 6px; background: #ffe08a; }
.dp-present-label { font-size: 1.1rem; color: #555; }
.dp-qr img { max-width: 100%; height: auto; }
.dp-qr figcaption { overflow-wrap: anywhere; font-size: .8rem; }
/* A plot's label sits above the figure, not floating over its title and legend. */
.block:has(> div .js-plotly-plot) > label[data-testid=block-label].float:not(.sr-only),
.block:has(.js-plotly-plot) > label[data-testid=block-label].float:not(.sr-only) { position: static !important; margin: 0 0 4px 0; }
@media (max-width: 600px) {
  .gradio-container { padding-left: 4px !important; padding-right: 4px !important; min-width: 0 !important; }
  .gradio-container .row { flex-wrap: wrap !important; }
  .gradio-container .column { min-width: 0 !important; flex-basis: 100% !important; }
  .js-plotly-plot, .plot-container { max-width: 100% !important; overflow-x: auto; }
  .dp-present-text { font-size: 1.3rem; }
  #present-top { flex-wrap: nowrap !important; }
  #present-qr .dp-qr img { width: 72px; height: 72px; }
  #present-qr .dp-qr figcaption { display: none; }
  #present-controls { gap: 4px !important; }
  #present-controls > * { min-width: 0 !important; flex: 1 1 30% !important; }
  #present-controls button { font-size: .9rem; padding: 4px 6px; min-height: 0; }
  #present-guess { padding: 4px !important; }
  #present-guess .label-text { font-size: .85rem; }
  /* Step through on a phone: prompt, Generate/Stop and status, then the output (tokens, chart), then
     the knobs. The left column dissolves into the row (display: contents) so its parts can be ordered. */
  .row:has(> .column > .form > #step-prompt) { flex-direction: column !important; align-items: stretch !important; }
  .column:has(> .form > #step-prompt) { display: contents !important; }
  .column:has(> .form > #step-prompt) > * { order: 2; }
  .column:has(> .form > #step-prompt) > .form:has(> #step-prompt),
  .column:has(> .form > #step-prompt) > .row:has(#step-generate),
  .column:has(> .form > #step-prompt) > #step-status { order: 0; }
  .row:has(> .column > .form > #step-prompt) > .column:not(:has(> .form > #step-prompt)) { order: 1; }
}
""" + page_js.CSS

INTRO = (
    "## Decoding Playground\n"
    "See how a language model turns probabilities into text: every token's distribution before and after each "
    "processing stage, beam search as a tree, speculative decoding round by round."
)


def queue_size() -> int:
    """Requests that may wait in the queue (env ``DP_QUEUE_SIZE``, default 64)."""
    return env_int("DP_QUEUE_SIZE", DEFAULT_QUEUE_SIZE)


def build_app(registry: ModelRegistry | None = None, default_model: str = EMBEDDED) -> gr.Blocks:
    registry = registry or ModelRegistry()
    policy = model_policy().with_models(default_model)
    downloads.use_private_cache()  # Gradio's copies of downloads in this process's private folder, not /tmp/gradio
    with PlaygroundBlocks(title="Decoding Playground", delete_cache=downloads.GRADIO_DELETE_CACHE) as demo:
        gr.Markdown(INTRO)
        with gr.Row():
            model, quant = model_pickers(default_model, policy.allowed)
        shared = Shared(registry=registry, model=model, quantization=quant, user_presets=user_presets_state(),
                        events=ModelEvents(), policy=policy)
        handles: list[PanelView] = []
        pages: dict = {}  # every view's handle by name (Compare's page is not a PanelView)
        with gr.Tabs(elem_id="dp-tabs") as tabs:
            with gr.Tab("Lessons", id="tab-lessons", elem_id="tab-lessons"):  # first: the entry point for newcomers
                lessons_tab = lessons.build_tab(shared)
            for title, module, name in VIEWS:
                with gr.Tab(title, id=f"tab-{name}", elem_id=f"tab-{name}"):
                    handle = module.build_tab(shared)
                    pages[name] = handle
                if isinstance(handle, PanelView):
                    handles.append(handle)
        share_links.wire_share_links(demo, tabs, handles, shared.user_presets)
        lessons_tab.wire_page(demo, tabs, handles, pages["compare"], pages["quantization"])
    whatif.serve(demo, pages["step"].whatif)
    downloads.remove_on_close(demo)
    demo.queue(default_concurrency_limit=shared.events.concurrency_limit, max_size=queue_size())
    # The views' example runs (first screens that already show a result), off the launch's path.
    examples.cache_for(registry).start(shared, default_model)
    return demo


def launch_kwargs() -> dict:
    return {"css": CSS, "theme": gr.themes.Soft(), "footer_links": [], "head": page_js.HEAD,
            "state_session_capacity": events.session_capacity(), "app_kwargs": {"routes": whatif.routes()}}
