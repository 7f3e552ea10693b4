"""What if, on the Step-through view: move any stage knob (or the stage order) and the selected
step's stage chart is re-drawn at once from that step's raw logits, without generating again.
"Continue from here with these knobs" turns the what-if into a branch: the steps before the
selected one are the run's, the rest are generated under the new knobs.

This module is the view's part: the what-if row under the step chart and its page wiring. The
what-if itself (the kept logits, the computation, the chart, the route) is the app's
``WhatIfService`` (playground/whatif_service.py); the Step view's handlers call it.

The step chart has two writers: its ``gr.Plot`` (the run's own step: a run, a token or a run picked,
a new page width) and the page's what-if draw (page_js: one ``Plotly.react`` of the service's
answer, whichever transport brought it; the Plot is not used there because it follows every new
value with ``Plotly.Plots.resize``, a 100 ms timer and a second layout). The view stamps every chart
it sends the Plot (``charts.step.revised``), so the Plot redraws the run's own step after a what-if
even when that figure equals the last one it drew.
API: ``/explore_step`` (trace JSON, step, knobs -> that step's ``stages`` in trace-JSON format).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import gradio as gr
import torch

from engine import explore, runner
from engine.base.seam import Model
from engine.config import ConfigError, DecodingConfig
from engine.control import RunControl
from engine.trace import Event, StageTrace, Trace, to_dict

from .. import ids
from ..page_js import PREPARE_JS, WHATIF_JS
from ..shared import Shared, parent_trace

WHATIF_CONCURRENCY = {"concurrency_id": "whatif", "concurrency_limit": 4}  # the fallback event's
# The what-if note with no what-if shown: a new run, another step or the run's own chart redrawn.
WHATIF_INTRO = ("*What if:* select a step, then move any knob on the left: the chart re-draws that step under the new "
                "knobs, without generating again.")


def continue_events(shared: Shared, lm: Model, parent: Trace, at: int, config: DecodingConfig,
                    control: RunControl) -> Iterator[Event]:
    """``parent``'s steps before ``at`` unchanged, then steps ``at``... generated under ``config``:
    the runner's own continuation (``runner.branch`` with no forced token, the app's batched
    scheduler), with its guards and stop rules; the last event holds the Trace (``branch_of`` =
    ``at``, ``config`` = the new one). A strategy that cannot continue raises here (the runner's check)."""
    return runner.branch(lm, parent, at, None, config=config, control=control, scheduler=shared.scheduler_for(lm))


def explore_api(shared: Shared, trace: dict | str, step: int, knobs: dict | None = None, model: str = "embedded",
                quantization: str = "none", *, control: RunControl) -> list[dict]:
    """Step ``step`` of ``trace`` (a greedy or sampling trace JSON, e.g. from /step_trace)
    re-processed under ``knobs`` (knob values over the trace's own config); returns that step's
    ``stages`` list in trace-JSON format. With no knobs it reproduces the trace's own stages."""

    lm = shared.lm(model, quantization)
    parsed = parent_trace(shared, lm, trace, "trace")
    if isinstance(step, bool) or not isinstance(step, int):
        raise ConfigError("step", f"expected an integer, got {step!r:.40}")
    control.check()
    with torch.inference_mode():
        stages: list[StageTrace] = explore.explore_step(lm, parsed, step, knobs)
    return to_dict(stages)


@dataclass
class WhatIfPanel:
    """The what-if row under the step chart: a note and the Continue button, plus the hidden
    what-if key (WHATIF_JS), the fallback button and the box its answer's figure goes through (DRAW_JS)."""

    note: gr.Markdown
    continue_btn: gr.Button
    figure: gr.Textbox
    key: gr.Textbox
    fallback: gr.Button

    @classmethod
    def build(cls) -> "WhatIfPanel":
        with gr.Row(elem_id="step-whatif"):
            note = gr.Markdown(WHATIF_INTRO, elem_id="step-whatif-note")
            button = gr.Button("Continue from here with these knobs", scale=0, min_width=200,
                               elem_id="step-whatif-continue")
        hidden: dict[str, Any] = {"show_label": False, "container": False, "elem_classes": ["dp-hidden"]}
        figure = gr.Textbox("", elem_id="step-whatif-figure", **hidden)
        key = gr.Textbox("", elem_id="step-whatif-key", **hidden)
        fallback = gr.Button("what if", elem_id=ids.STEP_WHATIF_FALLBACK, elem_classes=["dp-hidden"])
        return cls(note, button, figure, key, fallback)

    def wire_page(self, shared: Shared, panel: Any, step: gr.Slider, chart: gr.Plot, explain: gr.Markdown,
                  width: gr.Number) -> None:
        """Every stage knob and the stage order post the selected step to the route (WHATIF_JS; UI
        only, no generation); a newly drawn step chart asks the route to keep that step's logits."""
        # The stage order's hidden box is written by the page's sortable list, which Gradio does not
        # see as the box's input event: its change (any new value) is the trigger there.
        triggers = [c.change if c is panel.stage_order else c.input for c in panel.inputs]
        gr.on(triggers, None, [self.key, self.note, explain, step, shared.model, shared.quantization, width,
                               *panel.inputs], [self.note, explain], js=WHATIF_JS, api_visibility="private",
              trigger_mode="always_last", show_progress="hidden", queue=False)
        chart.change(None, [self.key, step, shared.model, shared.quantization], None, js=PREPARE_JS,
                     api_visibility="private", trigger_mode="always_last", show_progress="hidden", queue=False)
