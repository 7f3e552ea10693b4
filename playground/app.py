"""The app builder: header (model, quantization), one tab per view, share links, the queue."""

from __future__ import annotations

import os

import gradio as gr
from starlette.middleware import Middleware

from engine.backends.local import EMBEDDED
from engine.backends.registry import ModelRegistry, model_policy
from engine.settings import env_int

from . import downloads, events, examples, page_js, share_links, whatif_service
from .assets import static_text
from .events import ModelEvents
from .shared import LessonTarget, PanelView, PlaygroundBlocks, Shared, model_pickers, user_presets_state
from .shared import wire_model_check
from .views import beam, compare, inside, lessons, presets, quantization, search, serving, speculative, step
from .whatif_service import WhatIfService

# (tab title, view module, share-link view name), in the design's order of importance. A tab's id
# is "tab-<name>", which is what a share link selects.
VIEWS = (
    ("Step through", step, "step"),
    ("Compare", compare, "compare"),
    ("Beam search", beam, "beam"),
    ("Speculative", speculative, "speculative"),
    ("Search & heads", search, "search"),
    ("Inside the model", inside, "inside"),
    ("Quantization & KV cache", quantization, "quantization"),
    ("Serving", serving, "serving"),
    ("Presets", presets, "presets"),
)
DEFAULT_QUEUE_SIZE = 64

CSS = static_text("app.css") + "\n" + page_js.CSS  # the page's layout: playground/static/app.css

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
        wire_model_check(shared)
        whatif = shared.whatif = WhatIfService(shared)  # the app's one what-if: Step through's knobs, the presenter's slider
        handles: list[PanelView] = []
        pages: dict = {}  # every view's handle by name (Compare's page is not a PanelView)
        # wrap: every view's tab stays in the bar (a menu hid the last ones at 1400 px and on a projector)
        with gr.Tabs(elem_id="dp-tabs", overflow_behavior="wrap") as tabs:
            with gr.Tab("Lessons", id="tab-lessons", elem_id="tab-lessons"):  # first: the entry point for newcomers
                lessons_tab = lessons.build_tab(shared)
            for title, module, name in VIEWS:
                with gr.Tab(title, id=f"tab-{name}", elem_id=f"tab-{name}"):
                    handle = module.build_tab(shared)
                    pages[name] = handle
                if isinstance(handle, PanelView):
                    handles.append(handle)
        share_links.wire_share_links(demo, tabs, handles, shared.user_presets)
        lessons_tab.wire_page(demo, tabs, lesson_targets(pages))
    whatif_service.serve(demo, whatif)
    downloads.remove_on_close(demo)
    quiet_queue_analytics()
    share_links.allow_long_request_heads()
    demo.queue(default_concurrency_limit=shared.events.concurrency_limit, max_size=queue_size())
    # The views' example runs (first screens that already show a result), off the launch's path.
    examples.cache_for(registry).start(shared, default_model)
    return demo


# Gradio's queue, after every event, summarises its last GRADIO_ANALYTICS_MAX_EVENTS events (a pandas
# DataFrame, a groupby, percentiles: 17 ms of the server's CPU per event at 100 kept events, 35 ms at
# 10,000, its default) for its /monitoring page, every GRADIO_ANALYTICS_CACHE_FREQUENCY events (default
# 1). A room sends thousands of events; the app turns /monitoring off (``launch_kwargs``), so nothing reads
# the summary: it is made once per this many events instead. An operator's own setting wins.
ANALYTICS_EVERY = 1_000_000
ANALYTICS_KEPT = 1_000


def quiet_queue_analytics() -> None:
    """Gradio's queue reads both settings when ``demo.queue`` builds it."""
    os.environ.setdefault("GRADIO_ANALYTICS_CACHE_FREQUENCY", str(ANALYTICS_EVERY))
    os.environ.setdefault("GRADIO_ANALYTICS_MAX_EVENTS", str(ANALYTICS_KEPT))


def lesson_targets(pages: dict) -> list[LessonTarget]:
    """The pages a lesson's "Open in its view" fills: every view handle that is a LessonTarget, and
    Compare's page through its adapter (the Lessons tab imports no view: this is where they meet)."""
    targets = [page for page in pages.values() if isinstance(page, LessonTarget)]
    return targets + [compare.lesson_target(pages["compare"])]


def launch_kwargs() -> dict:
    """``demo.launch``'s arguments; ``max_threads``: Gradio's worker pool holds both model-slot
    pools (``events.thread_budget``), so runs stuck on a served model never starve local ones."""
    return {"css": CSS, "theme": gr.themes.Soft(), "footer_links": [], "head": page_js.HEAD,
            "state_session_capacity": events.session_capacity(),
            "app_kwargs": {"routes": whatif_service.routes(), "middleware": [Middleware(share_links.LinkTooLong)]},
            "max_threads": events.thread_budget(events.default_concurrency(), events.served_concurrency()),
            # Gradio's /monitoring (on by default): its /monitoring/summary answers anyone with every
            # endpoint's request counts and timings; a room's app has no use for it
            "enable_monitoring": False}
