"""Speculative: watch a drafter propose tokens and the target accept or reject them, round by round.

Rounds stream in as rows of chips (accepted / rejected / resampled / bonus). Clicking a chip (or
picking its position in the dropdown) shows p vs q for that position, the acceptance test written
out, and the residual distribution a rejected token was resampled from. Per-user state is one
``SpecSession`` in gr.State.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import gradio as gr

from engine import speculative
from engine.config import ConfigError, DecodingConfig
from engine.models import LoadedModel, ModelLoadError
from engine.presets import PresetError, load_preset
from engine.speculative import SpecRound
from engine.trace import Trace
from playground.charts import speculative as charts

from ..knobs import STAGE_KNOBS, KnobPanel
from ..shared import OutputSet, Shared, UserError, error_html, guarded, status_html

STREAM_EVERY_S = 0.25
RUN_KNOBS = ("seed", "max_new_tokens", "top_n", "stop")
SPEC_KNOBS = ("drafter", "num_draft_tokens", "ngram_size", "adaptive_k")
DEFAULT_PROMPT = ("Rewrite this with correct spelling: The quick brown fox jumpd over the lazy dog. "
                  "It was a sunny day in the forrest, and all the animals were playing near the river.")
# A click on a chip sends its (round, position) to Python; delegated so it survives re-renders.
CHIP_JS = """
const pick = (chip) => trigger('click', {round: Number(chip.dataset.round), pos: Number(chip.dataset.pos)});
element.addEventListener('click', (event) => {
  const chip = event.target.closest('[data-chip]');
  if (chip) pick(chip);
});
element.addEventListener('keydown', (event) => {
  const chip = event.target.closest('[data-chip]');
  if (chip && (event.key === 'Enter' || event.key === ' ')) { event.preventDefault(); pick(chip); }
});
"""


@dataclass
class SpecSession:
    rounds: list[SpecRound] = field(default_factory=list)
    trace: Trace | None = None
    selected: tuple[int, int] | None = None


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


def detail(session: SpecSession) -> list:
    """Dropdown value, explanation, p-vs-q figure and residual figure for the selected position."""
    sel = session.selected
    spec_round = charts.find_round(session.rounds, sel[0]) if sel else None
    if spec_round is None:
        return [gr.update(choices=charts.position_choices(session.rounds), value=None), "", None, None]
    pos = sel[1]
    return [gr.update(choices=charts.position_choices(session.rounds), value=f"{sel[0]}:{pos}"),
            charts.acceptance_text(spec_round, pos), charts.pq_figure(spec_round, pos), charts.residual_figure(spec_round, pos)]


def render(session: SpecSession, status: str = "", full: bool = True) -> list:
    summary = session.trace.summary if session.trace is not None else None
    head = [charts.counters_html(session.rounds, summary), charts.rounds_html(session.rounds, session.selected),
            charts.text_html(session.rounds)]
    if not full:
        return head + [gr.update()] * 4 + [charts.accepted_length_figure(session.rounds), gr.update(), status, gr.update()]
    download = gr.update(value=_trace_file(session.trace)) if session.trace is not None else gr.update()
    return (head + detail(session) + [charts.accepted_length_figure(session.rounds),
                                      charts.summary_markdown(summary or {}), status, download])


def _trace_file(trace: Trace) -> str:
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="spec-trace-", delete=False, encoding="utf-8") as fh:
        fh.write(trace.to_json(indent=1))
        return fh.name


def stream_run(shared: Shared, session: SpecSession, lm: LoadedModel, prompt: str, prompt_ids: list[int],
               config: DecodingConfig, chat: bool, compare: bool) -> Iterator[list]:
    """Draft and verify, yielding throttled updates; then (optionally) time a target-only run."""
    yield render(session, status_html(f"loading drafter {config.drafter}…"), full=False) + [session]
    drafter = speculative.make_drafter(lm, config, shared.registry)
    last = 0.0
    for spec_round in speculative.stream(lm, prompt_ids, config, drafter):
        session.rounds.append(spec_round)
        if time.perf_counter() - last >= STREAM_EVERY_S:
            last = time.perf_counter()
            tokens = sum(len(r.emitted_token_ids) for r in session.rounds)
            yield render(session, status_html(f"round {spec_round.index}: {tokens} / {config.max_new_tokens} tokens"),
                         full=False) + [session]
    session.trace = speculative.assemble(lm, prompt, prompt_ids, config, session.rounds, drafter, chat)
    if compare:
        yield render(session, status_html("timing a target-only run of the same settings…"), full=False) + [session]
        session.trace.summary |= speculative.compare_with_baseline(lm, prompt, config, session.trace, chat)
    session.selected = default_position(session.rounds)
    done = (f"done: {len(session.trace.generated_token_ids)} tokens in {len(session.rounds)} rounds, stopped by "
            f"{session.trace.stop_reason}. Click a chip to see its acceptance test.")
    yield render(session, status_html(done)) + [session]


def _error_outputs(message: str, session: SpecSession | None) -> list:
    return [gr.update()] * 9 + [error_html(message), gr.update(), session]


def _guarded(updates: Iterator[list], session: SpecSession) -> Iterator[list]:
    return guarded(updates, lambda message: _error_outputs(message, session), "generation")



def build_tab(shared: Shared) -> None:
    session = gr.State(None, time_to_live=3600)
    with gr.Row(equal_height=False):
        with gr.Column(scale=1, min_width=330):
            prompt = gr.Textbox(DEFAULT_PROMPT, lines=4, label="Prompt", elem_id="spec-prompt",
                                info="Speculation pays off when the output repeats the input: rewriting, extraction, code edits.")
            chat = gr.Checkbox(True, label="Chat template", elem_id="spec-chat")
            panel = KnobPanel(shared, SPEC_KNOBS + RUN_KNOBS + STAGE_KNOBS, ["speculative"], preset="speculative-ngram",
                              prefix="spec-")
            compare = gr.Checkbox(True, label="Compare with target-only", elem_id="spec-compare",
                                  info="Also time the same settings decoded by the target alone, in this process (speed-up).")
            with gr.Row():
                generate = gr.Button("Generate", variant="primary", elem_id="spec-generate")
                stop = gr.Button("Stop", variant="stop", elem_id="spec-stop")
            status = gr.HTML("", elem_id="spec-status")
        with gr.Column(scale=2, min_width=480):
            counters = gr.HTML(charts.counters_html([]), elem_id="spec-counters")
            rounds = gr.HTML(charts.rounds_html([]), js_on_load=CHIP_JS, elem_id="spec-rounds")
            text = gr.HTML(charts.text_html([]), elem_id="spec-text")
            position = gr.Dropdown([], label="Position (round : position in the round)", elem_id="spec-position")
            explain = gr.Markdown(elem_id="spec-explain")
            with gr.Row():
                pq = gr.Plot(label="p (target) vs q (drafter)", elem_id="spec-pq")
                residual = gr.Plot(label="Where the target's own token came from", elem_id="spec-residual")
            lengths = gr.Plot(label="Accepted length per round", elem_id="spec-lengths")
            summary = gr.Markdown(elem_id="spec-summary")
            download = gr.DownloadButton("Download trace JSON", elem_id="spec-download")
    out = Outputs(counters, rounds, text, position, explain, pq, residual, lengths, summary, status, download)
    panel.wire()
    shared.extra["speculative"] = {"panel": panel, "prompt": prompt, "chat": chat}
    _wire(shared, panel, session, prompt, chat, compare, generate, stop, out)


def _wire(shared: Shared, panel: KnobPanel, session, prompt, chat, compare, generate, stop, out: Outputs) -> None:
    outputs = out.all() + [session]

    def on_generate(prompt_text, chat_on, compare_on, model, quant, state, *values):
        state = SpecSession()
        try:
            config, lm, prompt_ids = shared.prepare(panel, values, model, quant, prompt_text, chat_on)
        except UserError as exc:
            yield _error_outputs(str(exc), state)
            return
        yield from _guarded(stream_run(shared, state, lm, prompt_text, prompt_ids, config, chat_on, compare_on), state)

    inputs = [prompt, chat, compare, shared.model, shared.quantization, session, *panel.inputs]
    gen_event = generate.click(on_generate, inputs, outputs, api_visibility="private", **shared.model_event)
    stop.click(lambda: status_html("stopped"), None, [out.status], cancels=[gen_event], queue=False)

    def select(state: SpecSession | None, position: tuple[int, int] | None) -> list:
        if state is None or position is None or charts.find_round(state.rounds, position[0]) is None:
            return [gr.update()] * len(outputs)
        state.selected = position
        return render(state, gr.update()) + [state]

    def on_chip(state, evt: gr.EventData):
        data = getattr(evt, "_data", None) or {}
        try:
            position = (int(data["round"]), int(data["pos"]))
        except (KeyError, TypeError, ValueError):
            return [gr.update()] * len(outputs)
        return select(state, position)

    out.rounds.click(on_chip, [session], outputs, api_visibility="private", queue=False)
    out.position.input(lambda s, v: select(s, charts.parse_position(v)), [session, out.position], outputs,
                       api_visibility="private", queue=False)

    def speculative_trace_api(prompt: str, config: dict | None = None, preset: str = "speculative-ngram",
                              chat: bool = False, model: str = "embedded", quantization: str = "none",
                              compare_baseline: bool = False) -> dict:
        """Run speculative decoding on the prompt and return the trace JSON (rounds[].drafted[] with q, p,
        accept_prob, u, accepted, resampled). ``preset``: a built-in preset; ``config``: knobs overriding it;
        ``compare_baseline``: also time a target-only run and report the speed-up in ``summary``."""
        return speculative_trace(shared, prompt, config, preset, chat, model, quantization, compare_baseline)

    gr.api(speculative_trace_api, api_name="speculative_trace", **shared.model_event)


def speculative_trace(shared: Shared, prompt: str, config: dict | None = None, preset: str = "speculative-ngram",
                      chat: bool = False, model: str = "embedded", quantization: str = "none",
                      compare_baseline: bool = False) -> dict:
    """API: speculative decoding -> trace JSON (the CLI's ``--json`` object, with rounds)."""
    try:
        base = load_preset(preset).config.to_dict(sparse=True) if preset else {"strategy": "speculative"}
        cfg = DecodingConfig.from_dict(base | dict(config or {}) | {"strategy": "speculative"})
        lm = shared.lm(model, quantization)
        shared.encode_prompt(lm, prompt, chat)
        trace = speculative.run(lm, prompt, cfg, chat=chat, registry=shared.registry, compare_baseline=compare_baseline)
    except (ConfigError, PresetError, UserError, ModelLoadError, ValueError) as exc:
        raise gr.Error(str(exc)) from None
    return json.loads(trace.to_json())
