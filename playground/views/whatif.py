"""What if, on the Step-through view: move any stage knob (or the stage order) and the selected
step's stage chart is re-drawn at once from that step's raw logits, without generating again
(engine.explore). "Continue from here with these knobs" turns the what-if into a branch: the steps
before the selected one are the run's, the rest are generated under the new knobs.

Per-session state is one ``KeptLogits`` (one step's raw logits, [1, V] float32: bounded); it is
recomputed with one forward when the selected step (or the run, or the model) changes.

The re-drawn chart does not go through the chart's ``gr.Plot``: Gradio's Plot follows every new value
with ``Plotly.Plots.resize``, which waits 100 ms and lays the whole chart out again. The figure's JSON
goes into a hidden box and the page draws it into the same plot with one ``Plotly.react`` (DRAW_JS).
The view stamps every chart it sends the Plot (``step.revised``), so the Plot redraws the run's own
step after a what-if even when that figure equals the last one it drew.
API: ``/explore_step`` (trace JSON, step, knobs -> that step's ``stages`` in trace-JSON format).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import html
from dataclasses import dataclass
from typing import Any, Iterator

import gradio as gr
import torch

from engine import explore, runner
from engine.config import ConfigError, DecodingConfig
from engine.control import RunControl
from engine.models import LoadedModel
from engine.trace import Event, StageTrace, StepTrace, Trace, to_dict
from playground.charts import step as charts

from ..shared import Shared, UserError, error_html

WHATIF_CONCURRENCY = {"concurrency_id": "whatif", "concurrency_limit": 4}
# The what-if figure (JSON text) into Step through's chart, set up as Gradio's Plot sets up its own
# (responsive, autosize, a titled chart's top margin at least 100 px).
DRAW_JS = """(figure) => {
  const plot = document.querySelector('#step-chart .js-plotly-plot');
  if (!figure || !plot || !window.Plotly) return;
  const fig = JSON.parse(figure);
  const box = document.querySelector('#step-index input[type=number]');
  const step = fig.layout.meta ? fig.layout.meta.step : undefined;
  if (box && step !== undefined && Number(box.value) !== step) return;  // another step was selected meanwhile
  fig.layout.autosize = true;
  fig.layout.margin = fig.layout.margin || {};
  if (fig.layout.title) fig.layout.margin.t = Math.max(100, fig.layout.margin.t || 0);
  fig.layout.margin.autoexpand = true;
  window.Plotly.react(plot, fig.data, fig.layout, Object.assign({}, fig.config || {}, {responsive: true}));
}"""


@dataclass(frozen=True)
class KeptLogits:
    """One step's raw logits [1, V], keyed by what they depend on: the model and the step's context."""

    key: str
    logits: torch.Tensor


def context_key(model: str, quantization: str, trace: Trace, step: int) -> str:
    """A digest of (model, quantization, the token ids before ``step``): equal keys, equal raw logits."""
    ids = explore.step_context(trace, step)
    return hashlib.sha256(repr((model, quantization, ids)).encode()).hexdigest()


@torch.inference_mode()
def whatif_step(lm: LoadedModel, trace: Trace, step: int, knobs: dict, kept: KeptLogits | None,
                key: str) -> tuple[StepTrace, KeptLogits]:
    """Step ``step`` of ``trace`` with its stages re-processed under ``knobs`` (its chosen token and
    draw u stay the run's, so the chart shows where the same draw would land), and the kept logits."""
    if kept is None or kept.key != key:
        kept = KeptLogits(key, explore.raw_logits(lm, trace, step))
    stages = explore.explore_step(lm, trace, step, knobs, logits=kept.logits)
    return dataclasses.replace(trace.steps[step], stages=list(stages)), kept


def whatif_note(original: StepTrace, changed: StepTrace, knobs: dict, config: dict) -> str:
    """One line: which knobs differ from the run's, how many tokens survive, the top token now."""
    diff = {k: v for k, v in knobs.items() if config.get(k, v) != v and k not in ("max_new_tokens", "seed")}
    final = changed.stages[-1]
    top = final.top[0] if final.top else None
    chosen = next((t.prob for t in final.top if t.token_id == original.chosen_token_id), None)
    what = ", ".join(f"{k} = {v}" for k, v in diff.items()) or "the run's own knobs"
    parts = [f"**What if** ({html.escape(what)}): {charts.tokens_word(final.kept)} survive"]
    if top is not None:
        parts.append(f"most likely now {html.escape(repr(charts.readable(top.token)))} ({top.prob:.1%})")
    parts.append(f"the run's token {html.escape(repr(charts.readable(original.chosen_token)))} "
                 + (f"{chosen:.1%}" if chosen is not None else "outside the top tokens"))
    return "; ".join(parts) + "."


def continue_events(shared: Shared, lm: LoadedModel, parent: Trace, at: int, config: DecodingConfig,
                    control: RunControl) -> Iterator[Event]:
    """``parent``'s steps before ``at`` unchanged, then steps ``at``... generated under ``config``
    (batched scheduler, ``prefix`` = the parent's tokens before ``at``); the last event holds the
    Trace (``branch_of`` = ``at``, ``config`` = the new one)."""
    if config.strategy not in ("greedy", "sample"):
        raise UserError(f"strategy: only greedy and sampling continue from a step, got {config.strategy!r}")
    kept = list(parent.steps[:at])
    steps = list(kept)
    if kept:
        yield Event(steps=kept)
    source = shared.scheduler_for(lm).stream(parent.prompt_token_ids, config, prefix=parent.generated_token_ids[:at],
                                             force=None, control=control)
    for step in source:
        control.check()
        steps.append(step)
        yield Event(steps=[step])
    yield Event(trace=runner.partial_trace(lm, parent.prompt, parent.prompt_token_ids, config, steps, parent.chat,
                                           branch_of=at))


def explore_api(shared: Shared, trace: dict | str, step: int, knobs: dict | None = None, model: str = "embedded",
                quantization: str = "none", *, control: RunControl) -> list[dict]:
    """Step ``step`` of ``trace`` (a greedy or sampling trace JSON, e.g. from /step_trace)
    re-processed under ``knobs`` (knob values over the trace's own config); returns that step's
    ``stages`` list in trace-JSON format. With no knobs it reproduces the trace's own stages."""
    from .step import parent_trace

    lm = shared.lm(model, quantization)
    parsed = parent_trace(shared, lm, trace)
    if isinstance(step, bool) or not isinstance(step, int):
        raise ConfigError("step", f"expected an integer, got {step!r:.40}")
    control.check()
    with torch.inference_mode():
        stages: list[StageTrace] = explore.explore_step(lm, parsed, step, knobs)
    return to_dict(stages)


@dataclass
class WhatIfPanel:
    """The what-if row under the step chart: a note and the Continue button, plus the kept logits
    and the hidden box the re-drawn figure's JSON goes through (DRAW_JS)."""

    note: gr.Markdown
    continue_btn: gr.Button
    kept: gr.State
    figure: gr.Textbox

    @classmethod
    def build(cls) -> "WhatIfPanel":
        with gr.Row(elem_id="step-whatif"):
            note = gr.Markdown("*What if:* select a step, then move any knob on the left: the chart re-draws "
                               "that step under the new knobs, without generating again.", elem_id="step-whatif-note")
            button = gr.Button("Continue from here with these knobs", scale=0, min_width=200,
                               elem_id="step-whatif-continue")
        figure = gr.Textbox("", show_label=False, container=False, elem_id="step-whatif-figure",
                            elem_classes=["dp-hidden"])
        return cls(note, button, gr.State(None), figure)

    def wire(self, shared: Shared, view: Any, out: Any, colour_by: gr.Radio, stream_run: Any, own: Any,
             request_cls: Any) -> None:
        """Every stage knob and the stage order re-draw the selected step (UI only, no generation);
        Continue is a model event that streams the new branch into the view."""
        panel = view.panel
        triggers = [c.input for c in panel.inputs]
        from .step import page_width  # step imports this module

        inputs = [out.session, out.owner, out.step, shared.model, shared.quantization, self.kept, view.width,
                  *panel.inputs]

        def on_knob(state, owner, step, model, quant, kept, width, *values) -> dict:
            state = own(state, owner)
            trace = state.trace() if state is not None else None
            if trace is None or not trace.steps or trace.strategy not in ("greedy", "sample"):
                return {self.note: gr.skip(), self.figure: ""}  # nothing to draw
            at = max(0, min(int(step or 0), len(trace.steps) - 1))
            try:
                knobs = panel.values(*values)
                lm = shared.lm(model, quant)
                changed, kept = whatif_step(lm, trace, at, knobs, kept, context_key(model, quant, trace, at))
            except (UserError, ConfigError, ValueError) as exc:
                return {self.note: error_html(str(exc)), self.figure: ""}
            fig = charts.fitted_stage_chart(changed, page_width(width))
            fig.layout.meta = {**fig.layout.meta, "step": at}  # DRAW_JS draws it only while that step is selected
            return {self.figure: fig.to_json(), self.kept: kept,
                    self.note: whatif_note(trace.steps[at], changed, knobs, trace.config)}

        gr.on(triggers, on_knob, inputs, [self.figure, self.note, self.kept], api_visibility="private",
              trigger_mode="always_last", show_progress="hidden", **WHATIF_CONCURRENCY).success(
            None, [self.figure], None, js=DRAW_JS, queue=False, show_progress="hidden", api_visibility="private")

        def on_continue(model, quant, colour, state, owner, step, width, *values,
                        control: RunControl) -> Iterator[dict]:
            state = own(state, owner)
            if state is None or state.trace() is None or not state.trace().steps:
                raise UserError("continue: generate a run first")
            parent = state.trace()
            at = max(0, min(int(step or 0), len(parent.steps) - 1))
            config = panel.config(*values)
            lm = shared.lm(model, quant)
            req = request_cls(lm, parent.prompt, parent.prompt_token_ids, config, parent.chat, colour)
            events = continue_events(shared, lm, parent, at, config, control)
            yield from stream_run(out, shared, state, req, control, branch=(parent, at, None), events=events,
                                  width=page_width(width))

        shared.events.on([self.continue_btn.click], on_continue,
                         [shared.model, shared.quantization, colour_by, out.session, out.owner, out.step, view.width,
                          *panel.inputs],
                         out.all(), on_error=lambda message: {out.status: error_html(message)}, what="continue")
        shared.events.api(functools.partial(explore_api, shared), "explore_step", what="what-if")
