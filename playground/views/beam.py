"""Beam search: watch the search tree grow step by step, then compare the finished hypotheses, their
raw and length-normalised scores, and the greedy continuation of the same prompt.

The length-penalty slider re-ranks the finished hypotheses (score = sum log-prob / length ** lp), a
pure function of the trace: no model call. Per-user state is one ``BeamSession`` in gr.State.
API: ``/beam_trace`` returns the trace JSON (``beam.steps[].candidates[]``, ``beam.hypotheses``).
"""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple

import gradio as gr
import plotly.graph_objects as go

from engine.base.seam import Model
from engine.strategies import beam, remote_beam
from engine.config import KNOBS, DecodingConfig
from engine.control import RunControl
from engine.trace import Trace
from playground.charts import beam as charts
from playground.charts.remote import remote_markdown

from .. import downloads, examples, ids
from ..events import stop_button
from ..knobs import PENALTY_KNOBS, KnobPanel, strategy_knobs
from ..shared import SESSION_TTL_S, OutputSet, PanelView, Shared, status_html, throttle
from .. import stale

STREAM_EVERY_S = 0.4  # throttle tree redraws while the search runs
BEAM_KNOBS = (*strategy_knobs("beam"), "max_new_tokens", "stop")
DEFAULT_PROMPT = "The best way to learn a new language is"
DEFAULT_PRESET = "beam-4"
EMPTY_SUMMARY = ("Press **Search** (or Ctrl/Cmd+Enter in the prompt) to grow the search tree; then hover a node for its "
                 "scores and move the slider to re-rank the finished hypotheses.")


@dataclass
class BeamSession:
    trace: Trace | None = None
    greedy: Trace | None = None

    def beam(self) -> beam.BeamTrace | None:
        return self.trace.beam if self.trace is not None else None


@dataclass
class Outputs(OutputSet):
    """Component handles the handlers update."""

    tree: Any
    summary: Any
    hypotheses: Any
    greedy: Any
    slider: Any
    winner: Any
    status: Any
    download: Any
    session: Any


class Reranked(NamedTuple):
    """What a new length penalty (or the tree's collapse) redraws, each named as its output in
    ``Outputs`` (``rerank_updates`` keys them by component)."""

    tree: go.Figure  # highlighting the re-ranked winner
    hypotheses: list  # the table's rows
    greedy: str  # greedy's note beside the search
    winner: str


def rerank_outputs(session: BeamSession | None, length_penalty: float, collapse: bool) -> Reranked | None:
    """The re-ranked outputs: pure, no model; None when there is nothing to re-rank."""
    search = session.beam() if session else None
    if session is None or search is None or not search.hypotheses:
        return None
    best = charts.rerank(search.hypotheses, length_penalty)[0][0]
    return Reranked(tree=charts.tree_figure(search, collapse, highlight=best),
                    hypotheses=charts.hypotheses_rows(search, length_penalty),
                    greedy=_greedy_markdown(session, length_penalty),
                    winner=charts.winner_note(search, length_penalty))


def render(out: Outputs, session: BeamSession, length_penalty: float, collapse: bool, status: str) -> dict:
    """Every output for a finished run."""
    search = session.beam()
    if search is None:
        raise ValueError("beam: the run holds no search to draw")
    return rerank_updates(out, session, length_penalty, collapse) | {
        out.summary: "\n\n".join(filter(None, [charts.step_summary(search), remote_markdown(session.trace)])),
        out.slider: gr.update(value=length_penalty), out.status: status,
        out.download: downloads.trace_file(session.trace, "beam-trace"), out.session: session}


def rerank_targets(out: Outputs) -> list:
    """The outputs ``Reranked`` names."""
    return [getattr(out, name) for name in Reranked._fields]


def rerank_updates(out: Outputs, session: BeamSession | None, length_penalty: float, collapse: bool) -> dict:
    """``rerank_outputs`` keyed by component (the tree skipped when there is nothing to re-rank:
    an empty dict would read as one value for every output)."""
    reranked = rerank_outputs(session, length_penalty, collapse)
    if reranked is None:
        return {out.tree: gr.skip()}
    return {getattr(out, name): value for name, value in reranked._asdict().items()}


def _greedy_markdown(session: BeamSession, length_penalty: float) -> str:
    g, search = session.greedy, session.beam()
    if g is None or search is None:
        return ""
    logprobs = [math.log(max(s.chosen_prob, 1e-45)) for s in g.steps]
    return charts.greedy_note(g.generated_token_ids, g.text, logprobs, search, length_penalty,
                              _score_length(session.trace, g))


def _score_length(search: Trace | None, greedy: Trace) -> int | None:
    """What greedy's score divides by to stand beside the search's hypotheses: a remote search's
    (vLLM's) length counts the prompt too; None (its token count) for our own search."""
    if search is None or not search.extra.get("remote"):
        return None
    eos = greedy.generated_token_ids[-1:] if greedy.stop_reason == "eos" else []
    return remote_beam.sequence_length(len(search.prompt_token_ids), greedy.generated_token_ids, eos)


def _partial(lm: Model, config: DecodingConfig, steps: list[beam.BeamStep]) -> beam.BeamTrace:
    """A BeamTrace shell for the steps so far (no hypotheses yet)."""
    return beam.BeamTrace(config.num_beams, config.num_beam_groups, config.length_penalty, config.early_stopping,
                          beam.candidates_per_step(lm, config), steps=list(steps))


@dataclass(frozen=True)
class BeamRequest:
    """One validated search: what to run and how to draw it."""

    lm: Model
    prompt: str
    prompt_ids: list[int]
    config: DecodingConfig
    chat: bool
    collapse: bool


def stream_run(out: Outputs, shared: Shared, session: BeamSession, req: BeamRequest,
               control: RunControl) -> Iterator[dict]:
    """Search, yielding throttled tree updates; then the greedy run; then every output."""
    steps: list[beam.BeamStep] = []
    # The previous search's tree, hypotheses, greedy text and download go at once (a Stop leaves this search's tree)
    yield {out.tree: None, out.summary: "", out.hypotheses: None, out.greedy: "", out.winner: "", out.download: None,
           out.status: status_html("searching…")}
    events = shared.stream(req.lm, req.prompt, req.config, chat=req.chat, prompt_ids=req.prompt_ids, control=control)
    for event, redraw in throttle(events, STREAM_EVERY_S):
        if event.trace is not None:
            session.trace = event.trace
        elif event.record is not None:
            steps.append(event.record)
        if redraw and event.trace is None:
            partial = _partial(req.lm, req.config, steps)
            yield {out.tree: charts.tree_figure(partial, req.collapse), out.summary: charts.step_summary(partial),
                   out.status: status_html(f"searching… step {len(steps)} / {req.config.max_new_tokens}")}
    final = session.beam()
    if final is None:
        raise ValueError("beam: the run ended without its search")
    yield {out.tree: charts.tree_figure(final, req.collapse), out.summary: charts.step_summary(final),
           out.status: status_html("search finished; decoding greedily for comparison…"), out.session: session}
    session.greedy = shared.run(req.lm, req.prompt, req.config.replace(strategy="greedy"), chat=req.chat,
                                prompt_ids=req.prompt_ids, control=control)
    done = (f"done: {len(final.steps)} steps, {len(final.hypotheses)} finished hypotheses. Hover a node for its "
            "scores; move the slider to re-rank.")
    yield render(out, session, req.config.length_penalty, req.collapse, status_html(done))


def build_tab(shared: Shared) -> PanelView:
    lp = KNOBS["length_penalty"]
    with gr.Row(equal_height=False):
        with gr.Column(scale=1, min_width=330):
            prompt = gr.Textbox(DEFAULT_PROMPT, lines=3, label="Prompt (Ctrl/Cmd+Enter runs it)", elem_id=ids.BEAM_PROMPT)
            with gr.Row():  # the primary action right under the prompt
                run = gr.Button("Search", variant="primary", elem_id=ids.BEAM_RUN)
                stop = gr.Button("Stop", variant="stop", elem_id="beam-stop")
            status = gr.HTML("", elem_id="beam-status")
            chat = gr.Checkbox(False, label="Chat template", elem_id="beam-chat",
                               info="Wrap the prompt in the model's chat template (instruct models end with EOS).")
            panel = KnobPanel(shared, BEAM_KNOBS + PENALTY_KNOBS, ["beam"], preset=DEFAULT_PRESET, stage_order=False,
                              prefix="beam-")
        with gr.Column(scale=2, min_width=480):
            collapse = gr.Checkbox(True, label="Collapse pruned candidates into one marker per beam",
                                   elem_id="beam-collapse")
            tree = gr.Plot(label="Search tree: drag to pan, box or scroll to zoom, hover a node", elem_id=ids.BEAM_TREE)
            summary = gr.Markdown(EMPTY_SUMMARY, elem_id="beam-summary")
            slider = gr.Slider(lp.low, lp.high, value=lp.neutral, step=lp.step, label="Re-rank with length penalty",
                               info="score = sum log-prob / length ^ penalty; > 0 favours longer hypotheses",
                               elem_id="beam-rerank")
            winner = gr.Markdown(elem_id="beam-winner")
            hypotheses = gr.Dataframe(headers=charts.HYPOTHESES_HEADERS, value=[], interactive=False, wrap=True,
                                      label="Finished hypotheses, ranked at the slider's length penalty",
                                      column_widths=charts.HYPOTHESES_WIDTHS, elem_id="beam-hypotheses")
            gr.Markdown(f"<small>{charts.HYPOTHESES_NOTE}</small>", elem_id="beam-hypotheses-note")
            greedy = gr.Markdown(elem_id="beam-greedy")
            download = gr.DownloadButton("Download trace JSON", elem_id="beam-download")
    out = Outputs(tree, summary, hypotheses, greedy, slider, winner, status, download,
                  gr.State(None, time_to_live=SESSION_TTL_S))
    panel.wire()
    view = PanelView("beam", prompt, panel, chat)
    _wire(shared, view, out, collapse, run, stop)
    example = examples.ExampleRequest("beam", DEFAULT_PROMPT, DEFAULT_PRESET, examples.fresh_config(panel), chat=False,
                                      with_greedy=True)  # the view compares the winner with greedy
    examples.cache_for(shared.registry).want(example)
    examples.wire_poll(shared, view, out, collapse, functools.partial(on_example, shared, view, out, example))
    return view


def on_example(shared: Shared, view: PanelView, out: Outputs, example: examples.ExampleRequest, timer: gr.Timer,
               model: str, quant: str, collapse_on: bool, state: BeamSession | None, prompt: str, chat: bool,
               *values: Any) -> dict:
    """A fresh page's first screen: the example search's tree, once the startup thread has it.
    Polling stops once filled, once this page searched, or once its prompt or knobs differ."""
    fresh = state is None and examples.matches(example, prompt, chat, view.panel, values)
    done, found = examples.poll(shared.registry, example, timer, out.status, model, quant, fresh)
    if found is None:
        return done
    session = BeamSession(copy.deepcopy(found.trace), copy.deepcopy(found.greedy))
    note = ("An example search of this prompt with the default preset (the same as pressing Search). Hover a node for "
            "its scores; move the slider to re-rank.")
    return done | render(out, session, example.config.length_penalty, collapse_on, status_html(note))


def _wire(shared: Shared, view: PanelView, out: Outputs, collapse: gr.Checkbox, run: gr.Button, stop: gr.Button) -> None:
    def on_run(prompt: str, chat: bool, collapse_on: bool, model: str, quant: str, *values: Any,
               control: RunControl) -> Iterator[dict]:
        config, lm, prompt_ids = shared.prepare(view.panel, values, model, quant, prompt, chat)
        yield from stream_run(out, shared, BeamSession(), BeamRequest(lm, prompt, prompt_ids, config, chat, collapse_on),
                              control)

    inputs = [view.prompt, view.chat, collapse, shared.model, shared.quantization, *view.panel.inputs]
    run_event = shared.events.on([run.click, view.prompt.submit], on_run, inputs, out.all(),
                                 on_error=stale.cleared(out.status, out.all()), what="search")
    stop_button(stop, out.status, [run_event], status_html("stopped"))
    for trigger in (out.slider.change, collapse.change):
        trigger(lambda session, lp, c: rerank_updates(out, session, lp, c), [out.session, out.slider, collapse],
                rerank_targets(out), api_visibility="private", queue=False)
    shared.events.api(functools.partial(beam_trace, shared), "beam_trace", what="search")


def beam_trace(shared: Shared, prompt: str, config: dict | None = None, preset: str = DEFAULT_PRESET,
               chat: bool = False, model: str = "embedded", quantization: str = "none", *,
               control: RunControl) -> dict:
    """Run beam search on the prompt and return the trace JSON: text = the winning hypothesis;
    beam.steps[].candidates[] (parent, token, token_id, logprob, score, normalized_score, status),
    beam.hypotheses[], beam.winner. ``preset``: a built-in preset; ``config``: knobs overriding it."""
    return shared.trace_json(prompt, config, preset, chat, model, quantization, strategies=("beam",), control=control)
