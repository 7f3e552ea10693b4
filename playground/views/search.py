"""Search & heads: three strategies that look past the next token, each in its own mode.

- **MCTS**: before every token, PUCT simulations search a tree of continuations; the view draws the
  tree of any committed position (visits as size, Q as colour, the committed child outlined) and,
  once the run ends, sets MCTS against greedy and beam on the same prompt by the total raw
  log-prob of each output (one uncached forward each, the same yardstick for all three).
- **EAGLE**: per round, the draft tree the head grew (each node's draft confidence, the accepted
  path, where the target refused), tokens per round, the drafter's confidence against measured
  acceptance, the speed-up over target-only, and Medusa and n-gram on the same prompt beside it.
- **Medusa**: per round, each head's top candidates as a small tree, which the target accepted,
  tokens per round and per target forward, and the speed-up over target-only decoding of the
  same knobs measured in this process (``compare_baseline=True``).

Per-user state: one session dataclass per mode in gr.State (the finished trace). Every run goes
through ``Shared.stream`` / ``Shared.run``. API: ``/mcts_trace``, ``/medusa_trace`` and ``/eagle_trace`` return the
trace JSON.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Iterator, Sequence

import gradio as gr

from engine.base.seam import Model
from engine.config import ConfigError, DecodingConfig
from engine.control import RunControl, RunStopped
from engine.strategies.mcts import NOT_COMMITTED, MctsPosition, interrupted_of, positions_of, raw_logprob
from engine.strategies import eagle
from engine.strategies.eagle import EagleRound
from engine.strategies.medusa import MedusaRound, rounds_of
from engine.strategies.speculative import SpecRound
from engine.numbers import percent
from engine.trace import Trace
from playground.charts import eagle as eagle_charts
from playground.charts import mcts as mcts_charts
from playground.charts import medusa as medusa_charts

from .. import downloads
from ..events import stop_button
from ..knobs import SAMPLING_KNOBS, KnobPanel, strategy_knobs
from ..shared import SESSION_TTL_S, OutputSet, Shared, status_html, throttle
from ..stale import cleared

STREAM_EVERY_S = 0.5
DRAFTING_RUN_KNOBS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed")  # Medusa and EAGLE sample too
MCTS_KNOBS = (*strategy_knobs("mcts"), "max_new_tokens")
MEDUSA_KNOBS = (*strategy_knobs("medusa"), *DRAFTING_RUN_KNOBS)
EAGLE_KNOBS = (*strategy_knobs("eagle"), *DRAFTING_RUN_KNOBS)
MCTS_PRESET, MEDUSA_PRESET, EAGLE_PRESET = "mcts", "medusa", "eagle"
MCTS_PROMPT = "The capital of France is"
MEDUSA_PROMPT = "Write one sentence about the sea."
EAGLE_PROMPT = MEDUSA_PROMPT  # the same prompt: the two drafters side by side
COMPARE_BEAMS = 4  # beam width of the side-by-side run (the MCTS knobs have none)
VISIT_HEADERS = ["token", "prior", "visits", "Q", "committed"]


# --- MCTS ---------------------------------------------------------------------------------------
@dataclass
class MctsSession:
    """A finished (or running) MCTS run: its trees, trace and the side-by-side rows."""

    positions: list[MctsPosition] = field(default_factory=list)
    trace: Trace | None = None
    quality: list[tuple[str, float, int, str]] = field(default_factory=list)  # strategy, total, tokens, text


@dataclass
class MctsOutputs(OutputSet):
    status: Any
    text: Any
    position: Any
    tree: Any
    visits: Any
    quality: Any
    quality_table: Any
    download: Any
    session: Any


def position_choices(positions: list[MctsPosition]) -> list[tuple[str, int]]:
    """Picker entries: 'i: token' per committed position; a search a stop interrupted says so."""
    return [(f"{p.index}: (stopped after {p.simulations} simulations)" if p.chosen_token_id == NOT_COMMITTED
             else f"{p.index}: {mcts_charts.readable(p.chosen_token)}", p.index) for p in positions]


def visit_rows(position: MctsPosition) -> list[list[Any]]:
    """The root's children, most visited first (headers: VISIT_HEADERS)."""
    return [[r["token"], round(r["prior"], 4), r["visits"], round(r["q"], 4), "yes" if r["committed"] else ""]
            for r in mcts_charts.visit_table(position)]


def tree_updates(out: MctsOutputs, session: MctsSession | None, index: Any) -> dict:
    """Tree and visit table of position ``index`` (the last one when unset): pure, no model."""
    if session is None or not session.positions:
        return {}
    chosen = next((p for p in session.positions if p.index == index), session.positions[-1])
    return {out.tree: mcts_charts.tree_figure(chosen), out.visits: visit_rows(chosen)}


def quality_rows(lm: Model, prompt_ids: list[int], traces: dict[str, Trace]) -> list[tuple[str, float, int, str]]:
    """(strategy, total raw log-prob, tokens, text) per trace, scored by one uncached forward each."""
    return [(name, raw_logprob(lm, prompt_ids, t.generated_token_ids), len(t.generated_token_ids), t.text)
            for name, t in traces.items()]


def quality_table(rows: list[tuple[str, float, int, str]]) -> list[list[Any]]:
    return [[name, round(total, 3), tokens, round(total / max(tokens, 1), 3), text] for name, total, tokens, text in rows]


def mcts_render(out: MctsOutputs, session: MctsSession, status: str) -> dict:
    """Every output of a finished run."""
    rows = session.quality
    last = session.positions[-1].index if session.positions else None
    return tree_updates(out, session, last) | {
        out.status: status, out.text: session.trace.text if session.trace else "",
        out.position: gr.update(choices=position_choices(session.positions), value=last),
        out.quality: mcts_charts.quality_figure([(r[0], r[1], r[2]) for r in rows]) if rows else None,
        out.quality_table: quality_table(rows),
        out.download: downloads.trace_file(session.trace, "mcts-trace") if session.trace else None, out.session: session}


@dataclass(frozen=True)
class RunRequest:
    """One validated run."""

    lm: Model
    prompt: str
    prompt_ids: list[int]
    config: DecodingConfig
    chat: bool


def progress_updates(out: MctsOutputs, lm: Model, session: MctsSession, max_new_tokens: int) -> dict:
    """While searching: the text so far, the picker and the last tree (what Stop leaves on the page)."""
    last = session.positions[-1].index
    return tree_updates(out, session, None) | {
        out.text: lm.decode([p.chosen_token_id for p in session.positions]),
        out.position: gr.update(choices=position_choices(session.positions), value=last),
        out.status: status_html(f"searching… token {len(session.positions)} / {max_new_tokens}")}


def stopped_status(trace: Trace, max_new_tokens: int, control: RunControl) -> str:
    """A stopped run's status: why, after how many of the tokens asked for, and what is shown."""
    done = f"after {len(trace.generated_token_ids)} of {max_new_tokens} tokens"
    interrupted = interrupted_of(trace)
    searching = (f"; token {interrupted.index}'s search had run {interrupted.simulations} simulations"
                 if interrupted is not None and interrupted.simulations else "")
    if trace.summary.get("stopped") == "time_limit":
        limit = f" (the {control.deadline_s:g} s limit, DP_REQUEST_SECONDS)" if control.deadline_s else ""
        return (f"time limit reached {done}{limit}{searching}. Showing the partial trace: the tokens chosen so far "
                "and their search trees; ask for fewer tokens or simulations.")
    return f"stopped {done}{searching}. Showing the partial trace: the tokens chosen so far and their search trees."


def stream_mcts(out: MctsOutputs, shared: Shared, req: RunRequest, control: RunControl) -> Iterator[dict]:
    """Search token by token (throttled redraws of the text and tree), then greedy and beam for the
    side-by-side. A stopped run shows its partial trace and skips the side-by-side."""
    session = MctsSession()
    events = shared.stream(req.lm, req.prompt, req.config, chat=req.chat, prompt_ids=req.prompt_ids, control=control)
    for event, redraw in throttle(events, STREAM_EVERY_S):
        if event.trace is not None:
            session.trace = event.trace
        elif isinstance(event.record, MctsPosition):
            session.positions.append(event.record)
        if redraw and event.trace is None and session.positions:
            yield progress_updates(out, req.lm, session, req.config.max_new_tokens)
    trace = session.trace
    if trace is None:
        raise RuntimeError("stream ended without a trace")
    session.positions = positions_of(trace)
    if trace.summary.get("stopped"):
        interrupted = interrupted_of(trace)
        session.positions += [interrupted] if interrupted is not None else []
        yield mcts_render(out, session, status_html(stopped_status(trace, req.config.max_new_tokens, control)))
        return
    yield mcts_render(out, session, status_html("search finished; greedy and beam on the same prompt for comparison…"))
    traces, stopped = side_by_side(shared, req, trace, control)
    session.quality = quality_rows(req.lm, req.prompt_ids, traces)
    done = f"{len(session.positions)} tokens, {trace.summary.get('simulations', 0)} simulations"
    if stopped is not None:
        why = "time limit reached" if stopped.reason == "time_limit" else "stopped"
        yield mcts_render(out, session, status_html(
            f"MCTS done ({done}); {why} during the greedy and beam runs it is compared with, so the comparison "
            "shows only the runs that finished. Pick a position to see its search tree."))
        return
    yield mcts_render(out, session, status_html(f"done: {done}. Pick a position to see its search tree."))


def side_by_side(shared: Shared, req: RunRequest, trace: Trace,
                 control: RunControl) -> tuple[dict[str, Trace], RunStopped | None]:
    """The MCTS trace, then greedy and beam on the same prompt and knobs, as far as ``control``
    lets them run: the traces that finished and the stop that cut the rest (None when none did)."""
    traces = {"mcts": trace}
    for name, config in (("greedy", req.config.replace(strategy="greedy")),
                         (f"beam ({COMPARE_BEAMS})", req.config.replace(strategy="beam", num_beams=COMPARE_BEAMS))):
        try:
            traces[name] = shared.run(req.lm, req.prompt, config, chat=req.chat, prompt_ids=req.prompt_ids,
                                      control=control)
        except RunStopped as stop:
            return traces, stop
    return traces, None


def wire_run(shared: Shared, panel: KnobPanel, prompt: gr.Textbox, chat: gr.Checkbox, run: gr.Button,
             stop: gr.Button, out: Any, stream: Callable[..., Iterator[dict]], what: str) -> None:
    """Run (button or Enter in the prompt) validates the inputs and streams ``stream``'s updates
    into ``out``; Stop cancels it."""

    def on_run(prompt_text: str, chat_on: bool, model: str, quant: str, *values: Any,
               control: RunControl) -> Iterator[dict]:
        config, lm, prompt_ids = shared.prepare(panel, values, model, quant, prompt_text, chat_on)
        yield from stream(out, shared, RunRequest(lm, prompt_text, prompt_ids, config, chat_on), control)

    event = shared.events.on([run.click, prompt.submit], on_run,
                             [prompt, chat, shared.model, shared.quantization, *panel.inputs], out.all(),
                             on_error=cleared(out.status, out.all()), what=what)
    stop_button(stop, out.status, [event], status_html("stopped: the output shows what was generated before Stop"))


def _prompt_column(prefix: str, prompt_text: str, chat_on: bool) -> tuple[gr.Textbox, gr.Button, gr.Button, gr.HTML, gr.Checkbox]:
    """The left column's head, as in every view: the prompt, Generate and Stop right under it, the status."""
    prompt = gr.Textbox(prompt_text, lines=3, label="Prompt", elem_id=f"{prefix}-prompt")
    with gr.Row():
        run = gr.Button("Generate", variant="primary", elem_id=f"{prefix}-run")
        stop = gr.Button("Stop", variant="stop", elem_id=f"{prefix}-stop")
    status = gr.HTML("", elem_id=f"{prefix}-status")
    chat = gr.Checkbox(chat_on, label="Chat template", elem_id=f"{prefix}-chat")
    return prompt, run, stop, status, chat


def _mcts_mode(shared: Shared) -> None:
    with gr.Row(equal_height=False):
        with gr.Column(scale=1, min_width=330):
            prompt, run, stop, status, chat = _prompt_column("mcts", MCTS_PROMPT, False)
            panel = KnobPanel(shared, MCTS_KNOBS + SAMPLING_KNOBS, ["mcts"], preset=MCTS_PRESET, prefix="mcts-")
        with gr.Column(scale=2, min_width=480):
            text = gr.Textbox(label="MCTS output", lines=2, interactive=False, elem_id="mcts-text")
            position = gr.Dropdown([], label="Committed position", elem_id="mcts-position",
                                   info="Each generated token had its own search; pick one to see its tree.")
            tree = gr.Plot(label="Search tree: node size = visits, colour = Q; hover a node", elem_id="mcts-tree")
            visits = gr.Dataframe(headers=VISIT_HEADERS, value=[], interactive=False,
                                  label="The root's children (the committed one is the most visited)", elem_id="mcts-visits")
            quality = gr.Plot(label="MCTS vs greedy vs beam", elem_id="mcts-quality")
            table = gr.Dataframe(headers=["strategy", "total raw log-prob", "tokens", "mean per token", "text"], value=[],
                                 interactive=False, wrap=True, elem_id="mcts-quality-table")
            download = gr.DownloadButton("Download trace JSON", elem_id="mcts-download")
    out = MctsOutputs(status, text, position, tree, visits, quality, table, download,
                      gr.State(None, time_to_live=SESSION_TTL_S))
    panel.wire()

    wire_run(shared, panel, prompt, chat, run, stop, out, stream_mcts, "search")
    position.input(lambda session, index: tree_updates(out, session, index), [out.session, position], [out.tree, out.visits],
                   api_visibility="private", queue=False)
    shared.events.api(functools.partial(mcts_trace, shared), "mcts_trace", what="search")


def mcts_trace(shared: Shared, prompt: str, config: dict | None = None, preset: str = MCTS_PRESET, chat: bool = False,
               model: str = "embedded", quantization: str = "none", *, control: RunControl) -> dict:
    """Run MCTS decoding and return the trace JSON: steps[] as greedy traces have them, the search
    tree of each committed token under extra.mcts[] (nodes[]: token, prior, visits, q, values,
    children, committed), summary.simulations / search_forwards / total_raw_logprob. A run stopped by
    the time limit returns its partial trace: summary.stopped = "time_limit" (and stopped_message),
    the search under way under extra.mcts_interrupted.
    ``preset``: a built-in preset; ``config``: knobs overriding it."""
    return shared.trace_json(prompt, config, preset, chat, model, quantization, strategies=("mcts",), control=control)


# --- Medusa -------------------------------------------------------------------------------------
@dataclass
class MedusaSession:
    rounds: list[MedusaRound] = field(default_factory=list)
    trace: Trace | None = None
    first_tokens: list[str] = field(default_factory=list)  # per round: the token fed first


@dataclass
class MedusaOutputs(OutputSet):
    status: Any
    text: Any
    summary: Any
    round_picker: Any
    round_tree: Any
    accept: Any
    download: Any
    session: Any


def _number(value: Any, fmt: str) -> str:
    return "n/a" if not isinstance(value, (int, float)) or not math.isfinite(value) else format(value, fmt)


def _difference(summary: dict, name: str = "Medusa") -> str:
    """Why a ``name`` run's tokens differ from target-only's (engine.strategies.speculative.first_difference)."""
    n = summary.get("baseline_first_difference")
    if n is None:
        return "no (sampling: the same distribution, other draws)"
    if summary.get("baseline_rounding_tie"):
        return (f"from token {n} on, where the target's two best tokens tie within the model dtype's rounding "
                "(a forward of several positions rounds differently from a forward of one)")
    return f"**no: greedy {name} should equal target-only greedy, but token {n} differs**"


def medusa_summary(trace: Trace) -> str:
    """Tokens per target forward, the measured speed-up and each head's acceptance, in Markdown."""
    s = trace.summary
    heads = ", ".join(f"head {k}: {percent(a)}" for k, a in enumerate(s.get("head_acceptance", []), start=1)) or "none tested"
    same = s.get("baseline_same_tokens")
    lines = [
        f"**{_number(s.get('tokens_per_target_forward'), '.2f')} tokens per target forward** "
        f"over {len(trace.rounds or [])} rounds ({len(trace.generated_token_ids)} tokens).",
        f"**Speed-up vs target-only: {_number(s.get('speedup'), '.2f')}×** (target-only "
        f"{_number(s.get('baseline_tokens_per_s'), '.1f')} tok/s vs Medusa {_number(trace.timing.tokens_per_s, '.1f')} tok/s,"
        " measured in this process, one after the other).",
        f"Acceptance per head: {heads}.",
    ]
    if s.get("tree_width", 1) > 1 and "mean_tree_nodes" in s:
        cut = f", only paths with probability ≥ {s['tree_min_score']:g}" if s.get("tree_min_score") else ""
        lines.append(f"Verified tree: each head's top {s['tree_width']}, at most {s.get('tree_nodes')} nodes{cut}: "
                     f"{_number(s['mean_tree_nodes'], '.1f')} nodes per forward on average.")
    speedup = s.get("speedup")
    if isinstance(speedup, (int, float)) and math.isfinite(speedup) and speedup < 1:
        lines.append("Slower than target-only here: the verify forward of the whole tree costs more than the tokens "
                     "it saves on this hardware (on a CPU in float32 a forward of 7 positions costs ~1.6x one of 1). "
                     "Where extra positions are nearly free (a GPU, or bfloat16 on a CPU with AMX: DP_DTYPE=bfloat16) "
                     "Medusa is faster, and bigger trees pay off.")
    if same is not None:
        lines.append("Same tokens as target-only: " + ("yes" if same else _difference(s)))
    return "\n\n".join(lines)


def picked_round(out: Any, session: Any, index: Any, figure: Callable[[Any, str], Any]) -> dict:
    """Round ``index``'s tree (the last round when unknown) drawn by ``figure`` (Medusa's or EAGLE's):
    pure, no model. ``session``: a MedusaSession or an EagleSession (None: nothing run yet)."""
    if session is None or not session.rounds:
        return {}
    i = next((n for n, r in enumerate(session.rounds) if r.index == index), len(session.rounds) - 1)
    first = session.first_tokens[i] if i < len(session.first_tokens) else ""
    return {out.round_tree: figure(session.rounds[i], first)}


def round_updates(out: MedusaOutputs, session: MedusaSession | None, index: Any) -> dict:
    return picked_round(out, session, index, medusa_charts.round_figure)


def rounds_render(out: Any, session: Any, status: str, figure: Callable[[Any, str], Any],
                  accept_figure: Callable[..., Any], summary: Callable[[Trace], str], file_name: str) -> dict:
    """What Medusa's and EAGLE's finished runs show alike: the round that accepted most drafted tokens
    (the last one usually has no room to draft) picked and drawn, tokens per round, the round picker,
    and once the trace is there its text, ``summary`` and download."""
    best = max(session.rounds, key=lambda r: (r.num_accepted, -r.index)).index if session.rounds else None
    tpf = session.trace.summary.get("tokens_per_target_forward") if session.trace else None
    updates = picked_round(out, session, best, figure) | {
        out.status: status, out.accept: accept_figure(session.rounds, tpf),
        out.round_picker: gr.update(choices=[(f"round {r.index}: +{len(r.emitted_token_ids)}", r.index)
                                             for r in session.rounds], value=best), out.session: session}
    if session.trace is not None:
        updates |= {out.text: session.trace.text, out.summary: summary(session.trace),
                    out.download: downloads.trace_file(session.trace, file_name)}
    return updates


def first_tokens(lm: Model, trace: Trace, rounds: Sequence[SpecRound]) -> list[str]:
    """The token each round fed first: the last one emitted before it (the prompt's last token for round 0)."""
    tokens = [s.chosen_token for s in trace.steps]
    prompt_last = lm.token_text(trace.prompt_token_ids[-1])
    return [tokens[r.start - 1] if 0 < r.start <= len(tokens) else prompt_last for r in rounds]


def medusa_render(out: MedusaOutputs, session: MedusaSession, status: str) -> dict:
    return rounds_render(out, session, status, medusa_charts.round_figure, medusa_charts.accept_figure, medusa_summary,
                         "medusa-trace")


def stream_rounds(out: Any, shared: Shared, req: RunRequest, control: RunControl, session: Any,
                  kind: type[MedusaRound] | type[EagleRound], accept_figure: Callable[[Any], Any]
                  ) -> Generator[dict, None, Trace]:
    """A drafting run's rounds as they come (``kind``: Medusa's or EAGLE's records; throttled redraws of
    the text and ``accept_figure`` of the rounds so far), then its trace, with the target-only timing
    run (``compare_baseline``), returned and kept in ``session.trace``."""
    events = shared.stream(req.lm, req.prompt, req.config, chat=req.chat, prompt_ids=req.prompt_ids, control=control,
                           compare_baseline=True)
    text = ""
    for event, redraw in throttle(events, STREAM_EVERY_S):
        if event.trace is not None:
            session.trace = event.trace
        elif isinstance(event.record, kind):
            session.rounds.append(event.record)
            text += event.record.emitted_text
        if redraw and event.trace is None and session.rounds:
            yield {out.text: text, out.accept: accept_figure(session.rounds),
                   out.status: status_html(f"round {len(session.rounds)}…")}
    if session.trace is None:
        raise RuntimeError("stream ended without a trace")
    return session.trace


def stream_medusa(out: MedusaOutputs, shared: Shared, req: RunRequest, control: RunControl) -> Iterator[dict]:
    """Medusa rounds (throttled redraws), then the target-only timing run, then every output."""
    session = MedusaSession()
    trace = yield from stream_rounds(out, shared, req, control, session, MedusaRound, medusa_charts.accept_figure)
    session.rounds = rounds_of(trace)
    session.first_tokens = first_tokens(req.lm, trace, session.rounds)
    yield medusa_render(out, session, status_html("done: pick a round to see the heads' proposals."))


def _rounds_outputs(prefix: str, name: str, pick: str, tree_label: str, accept_label: str) -> tuple[Any, ...]:
    """The top of Medusa's and EAGLE's output column: the text, the summary, the round picker, the
    round's tree and the tokens per round (element ids ``<prefix>-text`` ... ``<prefix>-accept``)."""
    text = gr.Textbox(label=f"{name} output", lines=3, interactive=False, elem_id=f"{prefix}-text")
    summary = gr.Markdown(elem_id=f"{prefix}-summary")
    picker = gr.Dropdown([], label="Round", elem_id=f"{prefix}-round", info=f"One target forward per round; {pick}")
    tree = gr.Plot(label=tree_label, elem_id=f"{prefix}-tree")
    accept = gr.Plot(label=accept_label, elem_id=f"{prefix}-accept")
    return text, summary, picker, tree, accept


def _medusa_mode(shared: Shared) -> None:
    with gr.Row(equal_height=False):
        with gr.Column(scale=1, min_width=330):
            prompt, run, stop, status, chat = _prompt_column("medusa", MEDUSA_PROMPT, True)
            panel = KnobPanel(shared, MEDUSA_KNOBS, ["medusa"], preset=MEDUSA_PRESET, stage_order=False, prefix="medusa-")
        with gr.Column(scale=2, min_width=480):
            text, summary, picker, tree, accept = _rounds_outputs(
                "medusa", "Medusa", "pick one to see what each head proposed.",
                "The round's verified tree (accepted path thick; chain rounds: each head's top-1)", "Tokens per round")
            download = gr.DownloadButton("Download trace JSON", elem_id="medusa-download")
    out = MedusaOutputs(status, text, summary, picker, tree, accept, download, gr.State(None, time_to_live=SESSION_TTL_S))
    panel.wire()

    wire_run(shared, panel, prompt, chat, run, stop, out, stream_medusa, "generation")
    picker.input(lambda session, index: round_updates(out, session, index), [out.session, picker], [out.round_tree],
                 api_visibility="private", queue=False)
    shared.events.api(functools.partial(medusa_trace, shared), "medusa_trace")


def medusa_trace(shared: Shared, prompt: str, config: dict | None = None, preset: str = MEDUSA_PRESET,
                 chat: bool = False, compare_baseline: bool = True, model: str = "embedded",
                 quantization: str = "none", *, control: RunControl) -> dict:
    """Run Medusa decoding and return the trace JSON: rounds[] (drafted[] with p, accept_prob,
    accepted; proposals[] per head with its top candidates), summary.tokens_per_target_forward,
    summary.head_acceptance, and with ``compare_baseline`` summary.speedup over target-only."""
    return shared.trace_json(prompt, config, preset, chat, model, quantization, strategies=("medusa",), control=control,
                             compare_baseline=compare_baseline)


# --- EAGLE --------------------------------------------------------------------------------------
COMPARE_HEADERS = ["strategy", "tokens per target forward", "tok/s", "speed-up vs target-only", "same tokens as EAGLE"]
# The drafters set beside EAGLE on the same prompt and sampling knobs (medusa / ngram: their presets' own)
SIDE_BY_SIDE = (("Medusa", dict(strategy="medusa")), ("n-gram (prompt lookup)", dict(strategy="speculative", drafter="ngram")))


@dataclass
class EagleSession:
    rounds: list[EagleRound] = field(default_factory=list)
    trace: Trace | None = None
    first_tokens: list[str] = field(default_factory=list)  # per round: the token fed first (the root)
    compare: list[list[Any]] = field(default_factory=list)  # rows under COMPARE_HEADERS


@dataclass
class EagleOutputs(OutputSet):
    status: Any
    text: Any
    summary: Any
    round_picker: Any
    round_tree: Any
    accept: Any
    calibration: Any
    compare: Any
    download: Any
    session: Any


def eagle_summary(trace: Trace) -> str:
    """Tokens per target forward, the measured speed-up, the calibration and whether greedy EAGLE
    gave target-only's tokens, in Markdown, from the trace's own numbers."""
    s = trace.summary
    rounds = eagle.rounds_of(trace)
    lines = [
        f"**{_number(s.get('tokens_per_target_forward'), '.2f')} tokens per target forward** over {len(rounds)} "
        f"rounds ({len(trace.generated_token_ids)} tokens); the draft tree held "
        f"{_number(s.get('mean_tree_nodes'), '.1f')} nodes per round on average (at most {s.get('eagle_tokens')}, "
        f"{s.get('eagle_depth')} deep).",
        f"**Speed-up vs target-only: {_number(s.get('speedup'), '.2f')}×** (target-only "
        f"{_number(s.get('baseline_tokens_per_s'), '.1f')} tok/s vs EAGLE {_number(trace.timing.tokens_per_s, '.1f')} "
        "tok/s, measured in this process, one after the other).",
    ]
    bins = eagle_charts.calibration(rounds)
    if bins:
        shown = "; ".join(f"{b.low:.1f}–{b.high:.1f}: {b.accepted}/{b.nodes} accepted" for b in bins)
        lines.append(f"Draft confidence vs acceptance (tested nodes): {shown}.")
    same = s.get("baseline_same_tokens")
    if same is not None:
        lines.append("Same tokens as target-only: " + ("yes" if same else _difference(s, "EAGLE")))
    return "\n\n".join(lines)


def eagle_round_updates(out: EagleOutputs, session: EagleSession | None, index: Any) -> dict:
    """The draft tree of round ``index`` (the last one when unknown): pure, no model."""
    return picked_round(out, session, index, eagle_charts.tree_figure)


def eagle_render(out: EagleOutputs, session: EagleSession, status: str) -> dict:
    """Every output of a finished run (``rounds_render``), with the calibration and the side-by-side table."""
    return rounds_render(out, session, status, eagle_charts.tree_figure, eagle_charts.accept_figure, eagle_summary,
                         "eagle-trace") | {out.calibration: eagle_charts.calibration_figure(session.rounds),
                                           out.compare: session.compare}


def compare_row(name: str, trace: Trace, baseline_tokens_per_s: Any, reference: list[int]) -> list[Any]:
    """One side-by-side row: tokens per target forward, tok/s, its speed-up over the target-only run
    timed after EAGLE's, and whether its tokens equal EAGLE's."""
    tps = trace.timing.tokens_per_s
    ok = isinstance(baseline_tokens_per_s, (int, float)) and math.isfinite(baseline_tokens_per_s) and baseline_tokens_per_s > 0
    speedup = _number(tps / baseline_tokens_per_s, ".2f") + "×" if ok and math.isfinite(tps) else "n/a"
    same = "yes" if trace.generated_token_ids == reference else "no"
    return [name, _number(trace.summary.get("tokens_per_target_forward"), ".2f"), _number(tps, ".1f"), speedup, same]


def compare_rows(shared: Shared, req: RunRequest, trace: Trace, control: RunControl) -> list[list[Any]]:
    """EAGLE, target-only (from EAGLE's baseline), then Medusa and n-gram on the same prompt and
    sampling knobs; a drafter this model lacks (no Medusa heads) is a row saying why."""
    base = trace.summary.get("baseline_tokens_per_s")
    reference = list(trace.generated_token_ids)
    rows = [compare_row("EAGLE", trace, base, reference),
            ["target only", "1.00", _number(base, ".1f"), "1.00×", _same_word(trace.summary.get("baseline_same_tokens"))]]
    for name, knobs in SIDE_BY_SIDE:
        config = req.config.replace(**knobs)
        try:
            other = shared.run(req.lm, req.prompt, config, chat=req.chat, prompt_ids=req.prompt_ids, control=control)
        except ConfigError as exc:
            rows.append([name, f"n/a: {exc}", "", "", ""])
            continue
        rows.append(compare_row(name, other, base, reference))
    return rows


def _same_word(same: Any) -> str:
    return "n/a" if same is None else ("yes" if same else "no")


def stream_eagle(out: EagleOutputs, shared: Shared, req: RunRequest, control: RunControl) -> Iterator[dict]:
    """EAGLE rounds (throttled redraws), its target-only timing run, then Medusa and n-gram on the
    same prompt for the side-by-side table. A stop during the side-by-side keeps EAGLE's outputs."""
    session = EagleSession()
    trace = yield from stream_rounds(out, shared, req, control, session, EagleRound, eagle_charts.accept_figure)
    session.rounds = eagle.rounds_of(trace)
    session.first_tokens = first_tokens(req.lm, trace, session.rounds)
    yield eagle_render(out, session, status_html("EAGLE finished; Medusa and n-gram on the same prompt for comparison…"))
    try:
        session.compare = compare_rows(shared, req, trace, control)
    except RunStopped as stop:
        why = "time limit reached" if stop.reason == "time_limit" else "stopped"
        yield eagle_render(out, session, status_html(f"EAGLE done; {why} during the comparison runs. "
                                                      "Pick a round to see its draft tree."))
        return
    yield eagle_render(out, session, status_html("done: pick a round to see its draft tree."))


def _eagle_mode(shared: Shared) -> None:
    with gr.Row(equal_height=False):
        with gr.Column(scale=1, min_width=330):
            prompt, run, stop, status, chat = _prompt_column("eagle", EAGLE_PROMPT, True)
            panel = KnobPanel(shared, EAGLE_KNOBS, ["eagle"], preset=EAGLE_PRESET, stage_order=False, prefix="eagle-")
        with gr.Column(scale=2, min_width=480):
            text, summary, picker, tree, accept = _rounds_outputs(
                "eagle", "EAGLE", "pick one to see the tree the head grew.",
                "The round's draft tree: each node's token and draft confidence; accepted path thick",
                "Tokens per round (acceptance length)")
            calibration = gr.Plot(label="Draft confidence vs acceptance", elem_id="eagle-calibration")
            compare = gr.Dataframe(headers=COMPARE_HEADERS, value=[], interactive=False, wrap=True,
                                   label="Side by side on this prompt (one timed run each, against the one target-only run after EAGLE's)",
                                   elem_id="eagle-compare")
            download = gr.DownloadButton("Download trace JSON", elem_id="eagle-download")
    out = EagleOutputs(status, text, summary, picker, tree, accept, calibration, compare, download,
                       gr.State(None, time_to_live=SESSION_TTL_S))
    panel.wire()

    wire_run(shared, panel, prompt, chat, run, stop, out, stream_eagle, "generation")
    picker.input(lambda session, index: eagle_round_updates(out, session, index), [out.session, picker],
                 [out.round_tree], api_visibility="private", queue=False)
    shared.events.api(functools.partial(eagle_trace, shared), "eagle_trace")


def eagle_trace(shared: Shared, prompt: str, config: dict | None = None, preset: str = EAGLE_PRESET,
                chat: bool = False, compare_baseline: bool = True, model: str = "embedded",
                quantization: str = "none", *, control: RunControl) -> dict:
    """Run EAGLE decoding and return the trace JSON: rounds[] (the draft tree with each node's path
    score and status, the accepted path, refused_at), summary.tokens_per_target_forward,
    summary.depth_acceptance, and with ``compare_baseline`` summary.speedup over target-only."""
    return shared.trace_json(prompt, config, preset, chat, model, quantization, strategies=("eagle",), control=control,
                             compare_baseline=compare_baseline)


def build_tab(shared: Shared) -> None:
    gr.Markdown("Three strategies that look past the next token. **MCTS** searches a tree of continuations before "
                "committing each token (slow; it avoids locally likely dead ends). **Medusa** adds trained heads that "
                "guess the next few tokens from the model's own hidden state; one target forward checks them all. "
                "**EAGLE** drafts from the model's features with one small layer and grows a tree where it is sure.")
    with gr.Tabs():
        with gr.Tab("MCTS", id="search-mcts", elem_id="search-mcts"):
            _mcts_mode(shared)
        with gr.Tab("Medusa", id="search-medusa", elem_id="search-medusa"):
            _medusa_mode(shared)
        with gr.Tab("EAGLE", id="search-eagle", elem_id="search-eagle"):
            _eagle_mode(shared)
