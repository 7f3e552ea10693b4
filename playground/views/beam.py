"""Beam search: watch the search tree grow step by step, then compare the finished hypotheses, their
raw and length-normalised scores, and the greedy continuation of the same prompt.

The length-penalty slider re-ranks the finished hypotheses (score = sum log-prob / length ** lp), a
pure function of the trace: no model call. Per-user state is one ``BeamSession`` in gr.State.
API: ``/beam_trace`` returns the trace JSON (``beam.steps[].candidates[]``, ``beam.hypotheses``).
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Iterator

import gradio as gr

from engine import beam, decode
from engine.config import KNOBS, ConfigError, DecodingConfig
from engine.models import LoadedModel, ModelLoadError
from engine.presets import PresetError, load_preset
from engine.trace import Trace
from playground.charts import beam as charts

from ..knobs import PENALTY_KNOBS, KnobPanel
from ..shared import OutputSet, Shared, UserError, error_html, guarded, status_html

STREAM_EVERY_S = 0.4  # throttle tree redraws while the search runs
BEAM_KNOBS = ("num_beams", "length_penalty", "early_stopping", "num_return_sequences", "num_beam_groups",
              "diversity_penalty", "max_new_tokens", "stop")
DEFAULT_PROMPT = "The best way to learn a new language is"
DEFAULT_PRESET = "beam-4"


@dataclass
class BeamSession:
    trace: Trace | None = None
    greedy: Trace | None = None

    def beam(self) -> beam.BeamTrace | None:
        return self.trace.beam if self.trace is not None else None


@dataclass
class Outputs(OutputSet):
    """Component handles the handlers update, in one fixed order."""

    tree: Any
    summary: Any
    hypotheses: Any
    greedy: Any
    slider: Any
    winner: Any
    status: Any
    download: Any


def rerank_outputs(session: BeamSession | None, length_penalty: float, collapse: bool) -> list:
    """Tree (highlighting the re-ranked winner), table, greedy and winner notes: pure, no model."""
    search = session.beam() if session else None
    if search is None or not search.hypotheses:
        return [gr.update()] * 4
    best = charts.rerank(search.hypotheses, length_penalty)[0][0]
    return [charts.tree_figure(search, collapse, highlight=best),
            charts.hypotheses_rows(search, length_penalty),
            _greedy_markdown(session, length_penalty),
            charts.winner_note(search, length_penalty)]


def render(session: BeamSession, length_penalty: float, collapse: bool, status: str) -> list:
    """Every output for a finished run."""
    tree, rows, greedy, note = rerank_outputs(session, length_penalty, collapse)
    search = session.beam()
    return [tree, charts.step_summary(search), rows, greedy, gr.update(value=length_penalty), note, status,
            gr.update(value=_trace_file(session.trace))]


def _greedy_markdown(session: BeamSession, length_penalty: float) -> str:
    g = session.greedy
    if g is None:
        return ""
    logprobs = [math.log(max(s.chosen_prob, 1e-45)) for s in g.steps]
    return charts.greedy_note(g.generated_token_ids, g.text, logprobs, session.beam(), length_penalty)


def _trace_file(trace: Trace) -> str:
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="beam-trace-", delete=False, encoding="utf-8") as fh:
        fh.write(trace.to_json(indent=1))
        return fh.name


def _partial(lm: LoadedModel, config: DecodingConfig, steps: list[beam.BeamStep]) -> beam.BeamTrace:
    """A BeamTrace shell for the steps so far (no hypotheses yet)."""
    return beam.BeamTrace(config.num_beams, config.num_beam_groups, config.length_penalty, config.early_stopping,
                          beam.candidates_per_step(lm, config), steps=list(steps))


def stream_run(session: BeamSession, lm: LoadedModel, prompt: str, prompt_ids: list[int], config: DecodingConfig,
               chat: bool, collapse: bool) -> Iterator[list]:
    """Search, yielding throttled tree updates; then the greedy run; then every output."""
    steps: list[beam.BeamStep] = []
    last_yield, final = 0.0, None
    for record in beam.stream(lm, prompt_ids, config):
        if isinstance(record, beam.BeamTrace):
            final = record
            break
        steps.append(record)
        if time.perf_counter() - last_yield >= STREAM_EVERY_S:
            last_yield = time.perf_counter()
            partial = _partial(lm, config, steps)
            status = status_html(f"searching… step {len(steps)} / {config.max_new_tokens}")
            yield [charts.tree_figure(partial, collapse), charts.step_summary(partial)] + [gr.update()] * 4 + [
                status, gr.update(), session]
    session.trace = beam.assemble(lm, prompt, prompt_ids, config, final, chat)
    yield [charts.tree_figure(final, collapse), charts.step_summary(final)] + [gr.update()] * 4 + [
        status_html("search done; decoding greedily for comparison…"), gr.update(), session]
    session.greedy = decode.run(lm, prompt, config.replace(strategy="greedy"), chat=chat)
    done = (f"done: {len(final.steps)} steps, {len(final.hypotheses)} finished hypotheses. Hover a node for its "
            "scores; move the slider to re-rank.")
    yield render(session, config.length_penalty, collapse, status_html(done)) + [session]


def _error_outputs(message: str, session: BeamSession | None) -> list:
    return [gr.update()] * 6 + [error_html(message), gr.update(), session]



def build_tab(shared: Shared) -> None:
    session = gr.State(None, time_to_live=3600)
    lp = KNOBS["length_penalty"]
    with gr.Row(equal_height=False):
        with gr.Column(scale=1, min_width=330):
            prompt = gr.Textbox(DEFAULT_PROMPT, lines=4, label="Prompt", elem_id="beam-prompt")
            chat = gr.Checkbox(False, label="Chat template", elem_id="beam-chat",
                               info="Wrap the prompt in the model's chat template (instruct models end with EOS).")
            panel = KnobPanel(shared, BEAM_KNOBS + PENALTY_KNOBS, ["beam"], preset=DEFAULT_PRESET, stage_order=False,
                              prefix="beam-")
            with gr.Row():
                run = gr.Button("Search", variant="primary", elem_id="beam-run")
                stop = gr.Button("Stop", variant="stop", elem_id="beam-stop")
            status = gr.HTML("", elem_id="beam-status")
        with gr.Column(scale=2, min_width=480):
            collapse = gr.Checkbox(True, label="Collapse pruned candidates into one marker per beam",
                                   elem_id="beam-collapse")
            tree = gr.Plot(label="Search tree: drag to pan, box or scroll to zoom, hover a node", elem_id="beam-tree")
            summary = gr.Markdown(elem_id="beam-summary")
            slider = gr.Slider(lp.low, lp.high, value=lp.neutral, step=lp.step, label="Re-rank with length penalty",
                               info="score = sum log-prob / length ^ penalty; > 0 favours longer hypotheses",
                               elem_id="beam-rerank")
            winner = gr.Markdown(elem_id="beam-winner")
            hypotheses = gr.Dataframe(headers=charts.HYPOTHESES_HEADERS, value=[], interactive=False, wrap=True,
                                      label="Finished hypotheses, ranked at the slider's length penalty",
                                      elem_id="beam-hypotheses")
            greedy = gr.Markdown(elem_id="beam-greedy")
            download = gr.DownloadButton("Download trace JSON", elem_id="beam-download")
    out = Outputs(tree, summary, hypotheses, greedy, slider, winner, status, download)
    panel.wire()
    shared.extra["beam"] = {"panel": panel, "prompt": prompt, "chat": chat}
    _wire(shared, panel, session, prompt, chat, collapse, run, stop, out)


def _wire(shared: Shared, panel: KnobPanel, session, prompt, chat, collapse, run, stop, out: Outputs) -> None:
    outputs = out.all() + [session]

    def on_run(prompt_text, chat_on, collapse_on, model, quant, state, *values):
        state = BeamSession()
        try:
            config, lm, prompt_ids = shared.prepare(panel, values, model, quant, prompt_text, chat_on)
        except UserError as exc:
            yield _error_outputs(str(exc), state)
            return
        yield from _guarded(stream_run(state, lm, prompt_text, prompt_ids, config, chat_on, collapse_on), state)

    inputs = [prompt, chat, collapse, shared.model, shared.quantization, session, *panel.inputs]
    run_event = run.click(on_run, inputs, outputs, api_visibility="private", **shared.model_event)
    submit_event = prompt.submit(on_run, inputs, outputs, api_visibility="private", **shared.model_event)
    stop.click(lambda: status_html("stopped"), None, [out.status], cancels=[run_event, submit_event], queue=False)
    rerank_targets = [out.tree, out.hypotheses, out.greedy, out.winner]
    out.slider.change(rerank_outputs, [session, out.slider, collapse], rerank_targets, api_visibility="private",
                      queue=False)
    collapse.change(rerank_outputs, [session, out.slider, collapse], rerank_targets, api_visibility="private",
                    queue=False)

    def beam_trace_api(prompt: str, config: dict | None = None, preset: str = DEFAULT_PRESET, chat: bool = False,
                       model: str = "embedded", quantization: str = "none") -> dict:
        """Run beam search on the prompt and return the trace JSON: text = the winning hypothesis;
        beam.steps[].candidates[] (parent, token, token_id, logprob, score, normalized_score, status),
        beam.hypotheses[], beam.winner. ``preset``: a built-in preset; ``config``: knobs overriding it."""
        return beam_trace(shared, prompt, config, preset, chat, model, quantization)

    gr.api(beam_trace_api, api_name="beam_trace", **shared.model_event)


def _guarded(updates: Iterator[list], state: BeamSession) -> Iterator[list]:
    return guarded(updates, lambda message: _error_outputs(message, state), "search")


def beam_trace(shared: Shared, prompt: str, config: dict | None = None, preset: str = DEFAULT_PRESET,
               chat: bool = False, model: str = "embedded", quantization: str = "none") -> dict:
    """API: beam search -> trace JSON (the CLI's ``--json`` object, with ``beam``)."""
    try:
        base = load_preset(preset).config.to_dict(sparse=True) if preset else {}
        cfg = DecodingConfig.from_dict(base | dict(config or {}) | {"strategy": "beam"})
        lm = shared.lm(model, quantization)
        shared.encode_prompt(lm, prompt, chat)
        trace = beam.run(lm, prompt, cfg, chat=chat, registry=shared.registry)
    except (ConfigError, PresetError, UserError, ModelLoadError, ValueError) as exc:
        raise gr.Error(str(exc)) from None
    return json.loads(trace.to_json())
