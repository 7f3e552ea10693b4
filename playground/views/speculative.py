"""Speculative: watch a drafter propose tokens and the target accept or reject them, round by round.

Rounds stream in as rows of chips (accepted / rejected / resampled / bonus). Clicking a chip (or
picking its position in the dropdown) shows p vs q for that position, the acceptance test written
out, and the residual distribution a rejected token was resampled from. Per-user state is one
``SpecSession`` in gr.State.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field
from typing import Any, Iterator

import gradio as gr

from engine.base.seam import Model
from engine.config import DecodingConfig
from engine.control import RunControl
from engine.strategies.speculative import SpecRound, rounds_of
from engine.trace import Trace
from playground.charts import speculative as charts
from playground.charts.remote import remote_markdown

from .. import downloads, examples, ids
from ..assets import static_text
from ..events import stop_button
from ..knobs import STAGE_KNOBS, KnobPanel, strategy_knobs
from ..shared import SESSION_TTL_S, OutputSet, PanelView, Shared, status_html, throttle
from .. import stale

STREAM_EVERY_S = 0.25
RUN_KNOBS = ("seed", "max_new_tokens", "top_n", "stop")
SPEC_KNOBS = strategy_knobs("speculative")
DEFAULT_PRESET = "speculative-ngram"
PICK_A_TOKEN = "Click a round's token (a chip above) or pick a position to see p vs q and its acceptance test."
EMPTY_EXPLAIN = ("Press **Generate** (or Ctrl/Cmd+Enter in the prompt) to run it; then click a round's token to see "
                 "p vs q and its acceptance test.")
DEFAULT_PROMPT = ("Rewrite this with correct spelling: The quick brown fox jumpd over the lazy dog. "
                  "It was a sunny day in the forrest, and all the animals were playing near the river.")
# A click on a chip sends its (round, position) to Python; delegated so it survives re-renders.
CHIP_JS = static_text("speculative_chips.js")


@dataclass
class SpecSession:
    rounds: list[SpecRound] = field(default_factory=list)
    trace: Trace | None = None
    selected: tuple[int, int] | None = None
    drafter: str = ""  # the run's drafter, for the note on drafted special tokens


@dataclass
class Outputs(OutputSet):
    counters: Any
    rounds: Any
    text: Any
    position: Any
    explain: Any
    pq: Any
    residual: Any
    lengths: Any
    summary: Any
    status: Any
    download: Any
    session: Any


def default_position(rounds: list[SpecRound]) -> tuple[int, int] | None:
    """The first rejection if there is one (the interesting case), else the first drafted token."""
    for r in rounds:
        for d in r.drafted:
            if not d.accepted:
                return r.index, d.position
    for r in rounds:
        if r.drafted or r.bonus is not None:
            return r.index, 0
    return None


def selection_note(session: SpecSession) -> str:
    """What the selected position is and what to do next."""
    sel = session.selected
    spec_round = charts.find_round(session.rounds, sel[0]) if sel else None
    if sel is None or spec_round is None:
        return "Click a chip to see its acceptance test."
    rejected = sel[1] < len(spec_round.drafted) and not spec_round.drafted[sel[1]].accepted
    what = "the first rejected draft" if rejected else "the first drafted token (every draft was accepted)"
    return f"Showing {what}; click any other chip to see its acceptance test."


def detail(out: Outputs, session: SpecSession) -> dict:
    """Dropdown, explanation, p-vs-q figure and residual figure for the selected position."""
    sel = session.selected
    spec_round = charts.find_round(session.rounds, sel[0]) if sel else None
    choices = charts.position_choices(session.rounds)
    if sel is None or spec_round is None:
        explain = PICK_A_TOKEN if session.rounds else ""
        return {out.position: gr.update(choices=choices, value=None), out.explain: explain, out.pq: None,
                out.residual: None}
    pos = sel[1]
    return {out.position: gr.update(choices=choices, value=f"{sel[0]}:{pos}"),
            out.explain: charts.acceptance_text(spec_round, pos), out.pq: charts.pq_figure(spec_round, pos),
            out.residual: charts.residual_figure(spec_round, pos)}


def render(out: Outputs, session: SpecSession, status: str | None = None, full: bool = True) -> dict:
    """Updates for the rounds so far (``full``: the selected position's detail, summary and download too)."""
    summary = session.trace.summary if session.trace is not None else None
    updates = {out.counters: charts.counters_html(session.rounds, summary),
               out.rounds: charts.rounds_html(session.rounds, session.selected, drafter=session.drafter),
               out.text: charts.text_html(session.rounds), out.lengths: charts.accepted_length_figure(session.rounds),
               out.session: session}
    if status is not None:
        updates[out.status] = status
    if full:
        updates |= detail(out, session) | {out.summary: "\n\n".join(filter(None, [
            charts.summary_markdown(summary or {}), remote_markdown(session.trace)]))}
        if session.trace is not None:
            updates[out.download] = downloads.trace_file(session.trace, "spec-trace")
    return updates


@dataclass(frozen=True)
class SpecRequest:
    """One validated run: what to run and whether to time a target-only baseline too."""

    lm: Model
    prompt: str
    prompt_ids: list[int]
    config: DecodingConfig
    chat: bool
    compare: bool


def stream_run(out: Outputs, shared: Shared, session: SpecSession, req: SpecRequest,
               control: RunControl) -> Iterator[dict]:
    """Draft and verify, yielding throttled updates; the runner times the target-only run if asked."""
    session.drafter = req.config.drafter
    # full: the previous run's p-vs-q, residual, summary and download go at once (a Stop leaves this run's rounds)
    yield render(out, session, status_html(f"loading drafter {req.config.drafter}…")) | {out.download: None}
    events = shared.stream(req.lm, req.prompt, req.config, chat=req.chat, prompt_ids=req.prompt_ids, control=control,
                           compare_baseline=req.compare)
    for event, redraw in throttle(events, STREAM_EVERY_S):
        if event.trace is not None:
            session.trace = event.trace
        elif event.record is not None:
            session.rounds.append(event.record)
            if redraw:
                tokens = sum(len(r.emitted_token_ids) for r in session.rounds)
                note = f"round {event.record.index}: {tokens} / {req.config.max_new_tokens} tokens"
                if req.compare and tokens >= req.config.max_new_tokens:
                    note += "; then timing a target-only run of the same settings…"
                yield render(out, session, status_html(note), full=False)
    session.selected = default_position(session.rounds)  # the first rejection: p vs q shows something at once
    if session.trace is None:
        raise RuntimeError("stream ended without a trace")
    done = (f"done: {len(session.trace.generated_token_ids)} tokens in {len(session.rounds)} rounds, stopped by "
            f"{session.trace.stop_reason}. {selection_note(session)}")
    yield render(out, session, status_html(done))


def build_tab(shared: Shared) -> PanelView:
    with gr.Row(equal_height=False):
        with gr.Column(scale=1, min_width=330):
            prompt = gr.Textbox(DEFAULT_PROMPT, lines=3, label="Prompt (Ctrl/Cmd+Enter runs it)", elem_id=ids.SPEC_PROMPT,
                                info="Speculation pays off when the output repeats the input: rewriting, extraction, code edits.")
            with gr.Row():  # the primary action right under the prompt
                generate = gr.Button("Generate", variant="primary", elem_id=ids.SPEC_GENERATE)
                stop = gr.Button("Stop", variant="stop", elem_id="spec-stop")
            status = gr.HTML("", elem_id="spec-status")
            chat = gr.Checkbox(True, label="Chat template", elem_id="spec-chat")
            panel = KnobPanel(shared, SPEC_KNOBS + RUN_KNOBS + STAGE_KNOBS, ["speculative"], preset=DEFAULT_PRESET,
                              prefix="spec-")
            compare = gr.Checkbox(True, label="Compare with target-only", elem_id="spec-compare",
                                  info="Also time the same settings decoded by the target alone (speed-up): in this process, "
                                       "or on a served target in step mode, one request per token.")
        with gr.Column(scale=2, min_width=480):
            counters = gr.HTML(charts.counters_html([]), elem_id="spec-counters")
            rounds = gr.HTML(charts.rounds_html([]), js_on_load=CHIP_JS, elem_id="spec-rounds")
            text = gr.HTML(charts.text_html([]), elem_id="spec-text")
            position = gr.Dropdown([], label="Position (round : position in the round)", elem_id="spec-position")
            explain = gr.Markdown(EMPTY_EXPLAIN, elem_id="spec-explain")
            with gr.Row():
                pq = gr.Plot(label="p (target) vs q (drafter)", elem_id="spec-pq")
                residual = gr.Plot(label="Where the target's own token came from", elem_id="spec-residual")
            lengths = gr.Plot(label="Accepted length per round", elem_id="spec-lengths")
            summary = gr.Markdown(elem_id="spec-summary")
            download = gr.DownloadButton("Download trace JSON", elem_id="spec-download")
    out = Outputs(counters, rounds, text, position, explain, pq, residual, lengths, summary, status, download,
                  gr.State(None, time_to_live=SESSION_TTL_S))
    panel.wire()
    view = PanelView("speculative", prompt, panel, chat)
    _wire(shared, view, out, compare, generate, stop)
    example = examples.ExampleRequest("speculative", DEFAULT_PROMPT, DEFAULT_PRESET, examples.fresh_config(panel),
                                      chat=True, compare_baseline=True)  # the checkboxes' defaults
    examples.cache_for(shared.registry).want(example)
    examples.wire_poll(shared, view, out, compare, functools.partial(on_example, shared, view, out, example))
    return view


def example_session(example: examples.Example) -> SpecSession:
    """A session showing an example run, its first rejected draft selected (a copy: sessions change it)."""
    trace = copy.deepcopy(example.trace)
    rounds = rounds_of(trace)
    return SpecSession(rounds, trace, default_position(rounds), example.request.config.drafter)


def on_example(shared: Shared, view: PanelView, out: Outputs, example: examples.ExampleRequest, timer: gr.Timer,
               model: str, quant: str, compare_on: bool, state: SpecSession | None, prompt: str, chat: bool,
               *values: Any) -> dict:
    """A fresh page's first screen: the example run with its first rejected draft selected, once
    the startup thread has it. Polling stops once filled, once this page ran, or once its inputs differ."""
    fresh = state is None and compare_on and examples.matches(example, prompt, chat, view.panel, values)
    done, found = examples.poll(shared.registry, example, timer, out.status, model, quant, fresh)
    if found is None:
        return done
    session = example_session(found)
    note = f"An example run of this prompt with the default preset (the same as pressing Generate). {selection_note(session)}"
    return done | render(out, session, status_html(note))


def _wire(shared: Shared, view: PanelView, out: Outputs, compare: gr.Checkbox, generate: gr.Button,
          stop: gr.Button) -> None:
    def on_generate(prompt: str, chat: bool, compare_on: bool, model: str, quant: str, *values: Any,
                    control: RunControl) -> Iterator[dict]:
        config, lm, prompt_ids = shared.prepare(view.panel, values, model, quant, prompt, chat)
        yield from stream_run(out, shared, SpecSession(), SpecRequest(lm, prompt, prompt_ids, config, chat, compare_on),
                              control)

    inputs = [view.prompt, view.chat, compare, shared.model, shared.quantization, *view.panel.inputs]
    gen_event = shared.events.on([generate.click], on_generate, inputs, out.all(),
                                 on_error=stale.cleared(out.status, out.all()))
    stop_button(stop, out.status, [gen_event], status_html("stopped"))

    def select(state: SpecSession | None, position: tuple[int, int] | None) -> dict:
        if state is None or position is None or charts.find_round(state.rounds, position[0]) is None:
            return {}
        state.selected = position
        return render(out, state)

    def on_chip(state: SpecSession | None, evt: gr.EventData) -> dict:
        try:  # the chip's data, sent by CHIP_JS's trigger('click', {round, pos})
            position = (int(getattr(evt, "round")), int(getattr(evt, "pos")))
        except (AttributeError, TypeError, ValueError):
            return {}
        return select(state, position)

    local: dict[str, Any] = {"api_visibility": "private", "queue": False}
    out.rounds.click(on_chip, [out.session], out.all(), **local)
    out.position.input(lambda s, v: select(s, charts.parse_position(v)), [out.session, out.position], out.all(), **local)
    shared.events.api(functools.partial(speculative_trace, shared), "speculative_trace")


def speculative_trace(shared: Shared, prompt: str, config: dict | None = None, preset: str = "speculative-ngram",
                      chat: bool = False, model: str = "embedded", quantization: str = "none",
                      compare_baseline: bool = False, *, control: RunControl) -> dict:
    """Run speculative decoding on the prompt and return the trace JSON (rounds[].drafted[] with q, p,
    accept_prob, u, accepted, resampled). ``preset``: a built-in preset; ``config``: knobs overriding it;
    ``compare_baseline``: also time a target-only run and report the speed-up in ``summary``."""
    return shared.trace_json(prompt, config, preset, chat, model, quantization, strategies=("speculative",),
                             control=control, compare_baseline=compare_baseline)
