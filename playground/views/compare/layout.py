"""The Compare page: a fixed pool of MAX_LANES lane columns shown or hidden (every event is wired
once, which Gradio 6 handles robustly), the shared prompt row, results, inspector, seed sweep."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import gradio as gr

from engine.config import KNOBS, STRATEGIES
from playground.charts import compare as charts

from ... import ids
from ...knobs import compact_knob_component
from ...shared import SESSION_TTL_S, UserError, remote_mode_radio
from ...user_presets import preset_choices
from .lanes import (
    LANE_KNOBS, LANE_PRESETS, MAX_LANES, MAX_SWEEP_SEEDS, MIN_LANES, LaneSpec, default_spec, lane_config,
    lane_name, spec_from_preset,
)

DEFAULT_PROMPT = "Once upon a time, in a small village by the sea,"


@dataclass
class LaneWidgets:
    column: Any
    header: Any  # the lane's settings in words
    preset: Any
    strategy: Any
    knobs: dict[str, Any]  # LANE_KNOBS name -> its number box
    more: Any  # the other knobs, a JSON object
    duplicate: Any
    remove: Any
    status: Any
    text: Any
    model: Any = None  # the lane's model pick (engine.backends.served.ModelPick's value; "" the header's model),
    # hidden: what the handlers, links and lessons read and write; a person sets it with ``source`` and ``mode``
    source: Any = None  # the Model box: "" (the header's model) or a model the header offers
    mode: Any = None  # a served model's step | fast radio (playground.shared.remote_mode_radio, as in Step through)


    @property
    def controls(self) -> list:
        """The lane's settings controls, in LANE_FIELDS order."""
        return [self.preset, self.strategy, *(self.knobs[n] for n in LANE_KNOBS), self.more]


@dataclass
class InspectPanel:
    """One lane's step: its explanation and stage chart."""

    lane: Any
    step: Any
    explain: Any
    chart: Any


@dataclass
class SweepPanel:
    lane: Any
    seeds: Any
    run: Any
    status: Any
    summary: Any
    table: Any


@dataclass
class Page:
    """Component handles, grouped as the handlers read and update them."""

    prompt: Any
    chat: Any
    run: Any
    add: Any
    stop: Any
    status: Any
    lanes: list[LaneWidgets]
    divergence: Any
    metrics: Any
    entropy_kind: Any
    entropy: Any
    inspect: InspectPanel
    sweep: SweepPanel
    count: Any  # gr.State: how many lanes are shown
    session: Any  # gr.State: CompareSession

    @property
    def lane_values(self) -> list:
        """Every lane's settings controls (LANE_FIELDS), flat, in lane order."""
        return [c for lane in self.lanes for c in lane.controls]

    @property
    def lane_models(self) -> list:
        """Every lane's model picker, in lane order."""
        return [lane.model for lane in self.lanes]

    @property
    def spec_outputs(self) -> list:
        return [c for lane in self.lanes for c in (lane.column, lane.header, *lane.controls)]

    @property
    def result_outputs(self) -> list:
        lanes = [c for lane in self.lanes for c in (lane.status, lane.text)]
        return lanes + [self.divergence, self.metrics, self.entropy, self.inspect.lane, self.sweep.lane]

    @property
    def run_outputs(self) -> list:
        """What a run updates: the results, and the inspector's explanation and chart (a new run
        empties them: they showed a step of the previous run)."""
        return self.result_outputs + [self.inspect.explain, self.inspect.chart]


HEADER_MODEL = "the header's model"



def strategy_choices() -> list[str]:
    """Every registered strategy, in registration order (engine/strategies: a new one appears here)."""
    return list(STRATEGIES)

def lane_model_choices(offered: Sequence[str]) -> list[tuple[str, str]]:
    """A lane's Model box: the header's model and every offered model (a served one's mode is the
    radio beside it, as in Step through)."""
    return [(HEADER_MODEL, ""), *((m, m) for m in offered)]


def _lane_column(i: int, spec: LaneSpec | None, offered: Sequence[str]) -> LaneWidgets:
    spec = spec or default_spec([])
    prefix = f"cmp-lane-{i}-"
    with gr.Column(visible=i < MIN_LANES, min_width=280, elem_id=f"cmp-lane-{i}", elem_classes=["cmp-lane"]) as column:
        header = gr.HTML(charts.lane_header(lane_name(i), *summary_of(spec)), elem_id=f"{prefix}header")
        source = gr.Dropdown(lane_model_choices(offered), value="", label="Model", elem_id=f"{prefix}source",
                             info="e.g. one lane on a llama.cpp server the operator lists, another on the embedded "
                                  "model, same knobs")
        mode = remote_mode_radio(f"{prefix}mode")
        model = gr.Textbox("", show_label=False, container=False, elem_id=f"{prefix}model", elem_classes=["dp-hidden"])
        with gr.Row():
            preset = gr.Dropdown(preset_choices([]), value=spec.preset, label="Preset", elem_id=f"{prefix}preset",
                                 min_width=120)
            strategy = gr.Dropdown(strategy_choices(), value=spec.strategy, label="Strategy", elem_id=f"{prefix}strategy",
                                   min_width=120)
        knobs = {}
        for pair in zip(LANE_KNOBS[::2], LANE_KNOBS[1::2]):  # two number boxes a row keeps a lane narrow
            with gr.Row():
                for name in pair:
                    knobs[name] = compact_knob_component(KNOBS[name], spec.knob(name), prefix, spec.strategy)
        with gr.Accordion("More knobs", open=bool(spec.more), elem_id=f"{prefix}more-box"):
            more = gr.Textbox(spec.more, lines=2, max_lines=8, label="Other knobs (JSON object)",
                              placeholder='{"repetition_penalty": 1.3}', elem_id=f"{prefix}more",
                              info="Any knob of the Step view by its name, e.g. repetition_penalty, typical_p, "
                                   "num_beams; same ranges and messages.")
        with gr.Row():
            duplicate = gr.Button("Duplicate", size="sm", elem_id=f"{prefix}duplicate")
            remove = gr.Button("Remove", size="sm", elem_id=f"{prefix}remove")
        status = gr.HTML("", elem_id=f"{prefix}status")
        text = gr.HighlightedText(label="Output (click a token to open its step)", combine_adjacent=False,
                                  show_legend=False, show_inline_category=False, interactive=False,
                                  elem_id=f"{prefix}text")
    return LaneWidgets(column, header, preset, strategy, knobs, more, duplicate, remove, status, text, model, source,
                       mode)


def summary_of(spec: LaneSpec) -> tuple[str, bool]:
    """(the lane's settings in words, False), or (the validation message, True)."""
    try:
        return charts.lane_summary(lane_config(spec, "settings")), False
    except UserError as exc:
        return str(exc), True


def _inspect_panel() -> InspectPanel:
    with gr.Accordion("Inspect a token", open=True):
        with gr.Row():
            lane = gr.Dropdown([lane_name(i) for i in range(MIN_LANES)], value=lane_name(0), label="Lane",
                               elem_id="cmp-inspect-lane", scale=1)
            step = gr.Slider(0, 1, value=0, step=1, label="Step", elem_id="cmp-inspect-step", scale=3)
        explain = gr.Markdown(elem_id="cmp-inspect-explain")
        chart = gr.Plot(label="Distribution after each stage", elem_id="cmp-inspect-chart")
    return InspectPanel(lane, step, explain, chart)


def _sweep_panel() -> SweepPanel:
    with gr.Accordion("Seed sweep: how random is a lane?", open=False):
        with gr.Row():
            lane = gr.Dropdown([lane_name(i) for i in range(MIN_LANES)], value=lane_name(1), label="Lane",
                               elem_id="cmp-sweep-lane")
            seeds = gr.Slider(2, MAX_SWEEP_SEEDS, value=5, step=1, label="Seeds (from the lane's seed on)",
                              elem_id="cmp-sweep-seeds")
            run = gr.Button("Run seed sweep", elem_id="cmp-sweep-run")
        status = gr.HTML("", elem_id="cmp-sweep-status")
        summary = gr.Markdown(elem_id="cmp-sweep-summary")
        table = gr.Dataframe(headers=charts.SWEEP_HEADERS, value=[], interactive=False, wrap=True,
                             elem_id="cmp-sweep-table")
    return SweepPanel(lane, seeds, run, status, summary, table)


def build_page(offered: Sequence[str] = ()) -> Page:
    """Lay the page out (inside the app's gr.Tab) and return its handles; ``offered``: the models a
    lane may pick instead of the header's (the model policy's list)."""
    starts = [spec_from_preset(p) for p in LANE_PRESETS[:MIN_LANES]]
    with gr.Row():
        prompt = gr.Textbox(DEFAULT_PROMPT, lines=3, label="Prompt (shared by all lanes)", elem_id=ids.CMP_PROMPT,
                            scale=3)
        chat = gr.Checkbox(False, label="Chat template", elem_id="cmp-chat", scale=1)
    with gr.Row():
        run = gr.Button("Run all lanes", variant="primary", elem_id=ids.CMP_RUN)
        add = gr.Button("Add lane", elem_id="cmp-add")
        stop = gr.Button("Stop", variant="stop", elem_id="cmp-stop")
    status = gr.HTML("", elem_id="cmp-status")
    with gr.Row(equal_height=False):
        lanes = [_lane_column(i, starts[i] if i < len(starts) else None, offered) for i in range(MAX_LANES)]
    divergence = gr.Markdown(elem_id="cmp-divergence")
    metrics = gr.Dataframe(headers=charts.METRIC_HEADERS, value=[], interactive=False, wrap=True, elem_id="cmp-metrics",
                           column_widths=charts.METRIC_COLUMN_WIDTHS,
                           label="Per-lane metrics (log-prob and perplexity under the unprocessed model)")
    gr.Markdown(f"<small>{charts.metrics_glossary()}</small>", elem_id="cmp-metrics-glossary")
    entropy_kind = gr.Radio(["picked-from distribution", "raw model"], value="picked-from distribution",
                            label="Entropy of", elem_id="cmp-entropy-kind")
    entropy = gr.Plot(label="Entropy per step", elem_id="cmp-entropy")
    return Page(prompt, chat, run, add, stop, status, lanes, divergence, metrics, entropy_kind, entropy,
                _inspect_panel(), _sweep_panel(), gr.State(MIN_LANES), gr.State(None, time_to_live=SESSION_TTL_S))
