"""Step through: type a prompt, generate token by token, click any token to see why it was chosen,
branch from any step with another token.

Per-user state is one ``StepSession`` in gr.State: at most ``MAX_RUNS`` traces (the original and
its branches) and nothing else; no KV cache is kept, so a branch costs one prefill through the
runner. API: ``/step_trace`` (run greedy/sampling) and ``/branch`` (continue a trace from a step
with another token) return trace JSON.

What if (panels/whatif.py's row under the step chart): a knob change re-draws the selected step under
the new knobs through the app's ``WhatIfService`` (the route, or when it cannot answer the same
service call as the hidden fallback button's event, ``Handlers.on_knob``); Continue streams the
branch under the new knobs into this view (``Handlers.on_continue``).
"""

from __future__ import annotations

import copy
import functools
import secrets
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import gradio as gr

from engine.base.seam import Model
from engine.reports import lessons as engine_lessons
from engine.reports.lessons import Lesson
from engine.config import DecodingConfig
from engine.control import RunControl, RunStopped
from engine.backends.registry import is_remote_source
from engine.strategies.served_decode import step_approximations
from engine import runner
from engine.trace import Trace
from playground.charts import step as charts
from playground.charts.remote import remote_markdown
from playground.charts.step import revised
from playground.charts import tokens as token_charts

from .. import downloads, examples, ids
from ..events import stop_button, zero_gpu
from ..knobs import STAGE_KNOBS, KnobPanel
from ..page_js import DRAW_JS, owner_js
from ..whatif_service import STAGE_STRATEGIES, KeptLogits, Registered, WhatIfService, register
from .. import stale
from ..panels.whatif import WHATIF_CONCURRENCY, WHATIF_INTRO, WhatIfPanel, continue_events, explore_api
from ..shared import SESSION_TTL_S, OutputSet, PanelView, Shared, UserError, error_html, status_html, throttle
from ..shared import REMOTE_MODE_LABEL, page_width, parent_trace, remote_mode_radio, with_mode

STREAM_EVERY_S = 0.25  # throttle UI updates while streaming
MAX_RUNS = 8  # runs kept per session: the original and the latest branches
RUN_KNOBS = ("seed", "max_new_tokens", "top_n", "stop")
DEFAULT_PROMPT = "Write a haiku about the sea."
STEP_STRATEGIES = ("greedy", "sample")
DEFAULT_PRESET = "balanced"
EMPTY_EXPLAIN = ("Press **Generate** (or Ctrl/Cmd+Enter in the prompt) to run it; then click any token to see the "
                 "distribution it was picked from, stage by stage.")


@dataclass
class StepSession(Registered):
    """``owner``: the page's secret (made by the page's script at load, sent by every event of the
    view: ``owned``). Gradio finds session state by a session hash alone; the owner check keeps a raw
    queue call that names another session's hash from reading or replacing that session's runs."""

    runs: list[Trace] = field(default_factory=list)
    current: int = 0
    owner: str = ""
    kept: KeptLogits | None = None  # the what-if's raw logits of one step (only WhatIfService touches it)
    whatif_key: str = ""  # the page's key for the what-if route (whatif_service.register)
    # runs[i]'s parent: the run it was branched or continued from (None: an original). The trace
    # itself, not an index: the list drops old branches, and the comparison must still be with it.
    parents: list[Trace | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.whatif_key = register(self)
        self.parents += [None] * (len(self.runs) - len(self.parents))

    def trace(self) -> Trace | None:
        return self.runs[self.current] if self.runs else None

    def whatif_trace(self) -> Trace | None:
        """The trace the what-if redraws: the run in view."""
        return self.trace()

    def owned_by(self, owner: Any) -> bool:
        return bool(self.owner) and isinstance(owner, str) and secrets.compare_digest(self.owner, owner)

    def add(self, trace: Trace, parent: Trace | None = None) -> None:
        """Show ``trace`` (branched from ``parent``) as the newest run; past MAX_RUNS the oldest
        branch is dropped."""
        self.parents += [None] * (len(self.runs) - len(self.parents))
        self.runs.append(trace)
        self.parents.append(parent)
        if len(self.runs) > MAX_RUNS:
            del self.runs[1], self.parents[1]
        self.current = len(self.runs) - 1

    def parent_of(self, index: int) -> Trace | None:
        """The run ``runs[index]`` was branched or continued from (None: an original)."""
        return self.parents[index] if 0 <= index < len(self.parents) else None

    def label_of(self, trace: Trace) -> str:
        """``trace``'s label in the Runs list, or, once the list dropped it, its own description."""
        index = next((i for i, t in enumerate(self.runs) if t is trace), None)
        if index is not None:
            return _run_label(index, trace)
        return "the " + _run_label(0, trace).split(" ", 1)[1] + " (no longer in the Runs list)"


@dataclass
class StepView(PanelView):
    """The Step view's handle: its PanelView, plus ``select_once``, a gr.State holding the step to
    select when the next run ends ("max_entropy" | "min_entropy" | an int; a lesson's "Open in its
    view" sets it, that run clears it), and ``width``, the page width (px) the page's script writes
    (the step chart goes two panels a row below charts.NARROW_PX, one below charts.PHONE_PX), and
    ``remote_mode``, the step | fast radio shown while a served model is picked."""

    select_once: Any = None
    width: Any = None
    remote_mode: Any = None

    def lesson_outputs(self) -> list:
        return [*super().lesson_outputs(), self.select_once]

    def lesson_updates(self, lesson: Lesson, stored: Any, allowed: Sequence[str] | None) -> tuple[dict, str]:
        """PanelView's, and the lesson's step to select once its run ends."""
        updates, button = super().lesson_updates(lesson, stored, allowed)
        return updates | {self.select_once: lesson.select_step}, button


@dataclass(frozen=True)
class StepRequest:
    """One validated run of the view: what to run and how to draw it."""

    lm: Model
    prompt: str
    prompt_ids: list[int]
    config: DecodingConfig
    chat: bool
    colour_by: str


def _run_label(i: int, trace: Trace) -> str:
    k = trace.branch_of
    if k is None:
        return f"#{i} original"
    # While a branch streams in, its forced token may not be there yet.
    token = charts.readable(trace.steps[k].chosen_token) if k < len(trace.steps) else "…"
    return f"#{i} branch at step {k}: {token!s}"


@dataclass
class Outputs(OutputSet):
    """Component handles the handlers update."""

    text: Any
    step: Any
    explain: Any
    chart: Any
    alternatives: Any
    runs: Any
    compare: Any
    over_run: Any
    summary: Any
    status: Any
    download: Any
    session: Any
    owner: Any  # hidden box: this page's secret, see StepSession (the page's script fills it in: ``owned``)
    whatif_key: Any  # hidden box: the session's what-if key (page_js.WHATIF_JS)
    # The what-if row's outputs (panels/whatif.py): every run and every redraw of the run's own step
    # puts them back, so no what-if of an earlier run or step stays beside the chart.
    whatif_note: Any
    whatif_figure: Any  # hidden box: the fallback event's figure (DRAW_JS)
    hesitations: Any = None  # the run's hesitation steps: picking one shows its stage chart


def owned(inputs: Sequence[Any], owner: Any) -> dict:
    """An event's ``js=`` keyword: the page's owner secret (page.js makes it as the page loads) put
    into ``inputs``' ``owner`` as the event is sent. The page holds it before any of its events can
    fire, so no event waits for an answer that brings it: a Generate pressed the moment the tab
    appears carries the same owner as the startup example's poll that may make the session first."""
    return {"js": owner_js(next(i for i, c in enumerate(inputs) if c is owner))}


def own(state: StepSession | None, owner: Any) -> StepSession | None:
    """``state`` if this page owns it, else None (as if there were no runs)."""
    return state if state is not None and state.owned_by(owner) else None


def token_legend(colour_by: str) -> str:
    """What the token colours mean, and how special tokens, spaces and newlines are written."""
    return charts.colour_legend(colour_by) + token_charts.legend_html()




def render(out: Outputs, session: StepSession, selected: int | None, colour_by: str, status: str = "",
           full: bool = True, width: float | None = None) -> dict:
    """Updates for the session's current run with step ``selected`` in view (``full``: every chart,
    the step chart laid out for a page ``width`` px wide; None: not known, wide)."""
    trace = session.trace()
    no_whatif = {out.whatif_note: WHATIF_INTRO, out.whatif_figure: ""}
    if trace is None or not trace.steps:
        return {out.text: [], out.alternatives: gr.update(choices=[]), out.summary: "", out.status: status,
                out.explain: "", out.chart: None, out.over_run: None, out.session: session,
                out.whatif_key: session.whatif_key} | no_whatif
    last = len(trace.steps) - 1
    sel = last if selected is None else max(0, min(int(selected), last))
    updates = {
        out.text: charts.token_highlights(trace.steps, colour_by),
        out.step: gr.update(maximum=max(1, last), value=sel),
        out.runs: gr.update(choices=[(_run_label(i, t), i) for i, t in enumerate(session.runs)], value=session.current),
        out.summary: "\n\n".join(filter(None, [charts.summary_markdown(trace, running=not full),
                                                 remote_markdown(trace)])),
        out.status: status,
        out.session: session,
        out.whatif_key: session.whatif_key,
    } | no_whatif
    if full:
        step = trace.steps[sel]
        chart = charts.fitted_stage_chart(step, width, charts.source_of(trace, sel))
        updates |= {out.explain: own_explain(trace, sel), out.chart: revised(chart),
                    out.alternatives: gr.update(choices=charts.alternatives(step), value=None),
                    out.compare: compare_markdown(session), out.over_run: charts.run_chart(trace.steps, sel),
                    out.download: downloads.trace_file(trace)}
        if out.hesitations is not None:
            updates[out.hesitations] = gr.update(choices=hesitation_choices(trace), value=None)
    return updates


def hesitation_choices(trace: Trace) -> list[tuple[str, int]]:
    """(label, step) of each step where the model hesitates (charts.hesitation_steps)."""
    return [(f"step {i}: {charts.readable(trace.steps[i].chosen_token)}", i) for i in charts.hesitation_steps(trace.steps)]


def own_explain(trace: Trace, at: int) -> str:
    """The explanation of step ``at`` as the run made it (no what-if)."""
    explain = charts.explain_step(trace.steps[at], source=charts.source_of(trace, at))
    return "\n\n".join(filter(None, [explain, charts.tail_note(trace, at)]))


def shared_prefix(a: Trace, b: Trace) -> int:
    """How many leading generated tokens ``a`` and ``b`` have in common."""
    ids_a, ids_b = [s.chosen_token_id for s in a.steps], [s.chosen_token_id for s in b.steps]
    return next((i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y), min(len(ids_a), len(ids_b)))


def compare_markdown(session: StepSession) -> str:
    """The run in view against the run it was branched (or continued) from: which run that is,
    their true shared prefix, and how each went on from there."""
    trace = session.trace()
    parent = session.parent_of(session.current)
    if trace is None or trace.branch_of is None or parent is None:
        return ""
    n = shared_prefix(trace, parent)

    def first(run: Trace) -> str:
        return repr(charts.readable(run.steps[n].chosen_token)) if n < len(run.steps) else "nothing (it ended)"

    def tail(run: Trace) -> str:
        return "".join(s.chosen_token for s in run.steps[n:])

    head = (f"**Compared with {session.label_of(parent)}**, the run this one was branched from at step "
            f"{trace.branch_of}.\n\n**Shared prefix** ({charts.tokens_word(n)}): "
            f"{''.join(s.chosen_token for s in trace.steps[:n])!s}")
    if n == len(trace.steps) == len(parent.steps):
        return head + "\n\n**Same tokens**: from here this branch chose exactly what that run chose."
    return (head + f"\n\n**That run** continued with {first(parent)}: {tail(parent)}\n\n"
            f"**This branch** took {first(trace)}: {tail(trace)}")


def stream_run(out: Outputs, shared: Shared, session: StepSession, req: StepRequest, control: RunControl,
               branch: tuple[Trace, int, int | None] | None = None, events: Iterator | None = None,
               select: str | int | None = None, width: float | None = None) -> Iterator[dict]:
    """Run ``req`` (or branch ``(parent, at, token)``) and yield throttled updates; the last one has
    every chart, on the branch's step, else on ``select`` (a lesson's: "max_entropy" | "min_entropy"
    | an int, see engine.reports.lessons.selected_step), else on the most uncertain step."""
    at = branch[1] if branch else None
    if events is not None:
        pass  # a what-if continuation (whatif.continue_events): the caller made the run's events
    elif branch:
        events = shared.branch(req.lm, branch[0], branch[1], branch[2], control=control)
    else:
        events = shared.stream(req.lm, req.prompt, req.config, chat=req.chat, prompt_ids=req.prompt_ids,
                               control=control)
    session.add(runner.partial_trace(req.lm, req.prompt, req.prompt_ids, req.config, [], req.chat, branch_of=at),
                parent=branch[0] if branch else None)
    # The new run, empty: the previous run's chart, explanation and comparison go at once (a Stop
    # or a failure mid-run leaves this run's tokens, not them).
    yield render(out, session, None, req.colour_by, status_html("generating…"), full=False) | {
        out.compare: "", out.download: None}
    index, steps = session.current, []
    try:
        for event, redraw in throttle(events, STREAM_EVERY_S):
            steps += event.steps
            if event.trace is not None:
                session.runs[index] = event.trace
            elif redraw:
                session.runs[index] = runner.partial_trace(req.lm, req.prompt, req.prompt_ids, req.config, steps,
                                                           req.chat, branch_of=at)
                note = f"generating… {len(steps) - (at or 0)} / {req.config.max_new_tokens} tokens"
                yield render(out, session, None, req.colour_by, status_html(note), full=False)
    except RunStopped as stopped:  # Stop or the time limit: the tokens so far stay, as a partial run
        session.runs[index] = runner.partial_trace(req.lm, req.prompt, req.prompt_ids, req.config, steps, req.chat,
                                                   branch_of=at)
        made = len(steps) - (at or 0)
        shown = None if not steps else at if at is not None else most_uncertain(steps)
        note = f"{stopped} after {made} of {req.config.max_new_tokens} tokens."
        if steps:
            note += " Click any token to inspect it."
        yield render(out, session, shown, req.colour_by, status_html(note), width=width)
        return
    final = session.runs[index]
    if at is not None:
        shown, what = at, f"step {at}, where it branched"
    elif select is not None:
        shown = engine_lessons.selected_step(final, select)
        what = f"the lesson's step {shown}"
    else:
        shown, what = most_uncertain(final.steps), "the most uncertain step"
    done = f"done: {len(steps)} tokens, stopped by {final.stop_reason}."
    why = ended_why(final)
    if why:
        done = f"done: {charts.tokens_word(len(steps))}: {why}"
    if steps:
        done += f" Showing {what}; click any token (or use ←/→) to inspect another."
    yield render(out, session, shown, req.colour_by, status_html(done), width=width)


FAST_MODE_HINT = ("In fast mode the server's own grammar constrains its sampler over its whole vocabulary: pick "
                  f"\"fast\" under \"{REMOTE_MODE_LABEL}\" and run it again.")


def ended_why(trace: Trace) -> str:
    """Why a run ended with nothing left to pick, in words ("" after any other end). A served
    model's step-mode trace carries the message of the stage that ended it (a grammar that allows
    none of the server's top-N tokens) beside its usual caveats (engine.backends.served_decode.stream);
    where a grammar did, fast mode is the way on (FAST_MODE_HINT)."""
    remote = trace.extra.get("remote") if isinstance(trace.extra, dict) else None
    if trace.stop_reason != "no_tokens_left" or not isinstance(remote, dict) or remote.get("mode") != "step":
        return ""
    config = DecodingConfig.from_dict({"strategy": trace.strategy, **trace.config})
    usual = step_approximations(config, int(remote.get("top_n") or 0))
    said = [a for a in remote.get("approximations") or [] if isinstance(a, str) and a not in usual]
    why = said[-1] if said else f"step {len(trace.steps)}: no token of the server's top {remote.get('top_n')} was left"
    return f"{why.rstrip('.')}. {FAST_MODE_HINT}" if config.grammar else f"{why.rstrip('.')}."


def lesson_select(value: Any) -> str | int | None:
    """A lesson's select_step as held in ``StepView.select_once``, or None (anything else)."""
    if value in ("max_entropy", "min_entropy"):
        return value
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def most_uncertain(steps: list) -> int:
    """The step with the highest entropy (the first of ties): the one whose chart teaches most."""
    return max(range(len(steps)), key=lambda i: (steps[i].entropy, -i)) if steps else 0


def build_tab(shared: Shared) -> StepView:
    """The Step-through tab; its knob panel's what-ifs go to ``shared.whatif`` (the app's service)."""
    whatif: WhatIfService = shared.whatif
    if whatif is None:
        raise RuntimeError("step.build_tab: shared.whatif is not set (playground.app.build_app sets it)")
    with gr.Row(equal_height=False):
        with gr.Column(scale=1, min_width=330):
            prompt = gr.Textbox(DEFAULT_PROMPT, lines=3, label="Prompt (Ctrl/Cmd+Enter runs it)", elem_id=ids.STEP_PROMPT)
            # The primary action right under the prompt: visible without scrolling at 1280x720.
            with gr.Row():
                generate = gr.Button("Generate", variant="primary", elem_id=ids.STEP_GENERATE)
                stop = gr.Button("Stop", variant="stop", elem_id="step-stop")
            status = gr.HTML("", elem_id="step-status")
            chat = gr.Checkbox(True, label="Chat template", info="Wrap the prompt in the model's chat template (instruct models).",
                               elem_id="step-chat")
            remote_mode = remote_mode_radio("step-remote-mode")
            panel = KnobPanel(shared, RUN_KNOBS + STAGE_KNOBS, ["sample", "greedy"], preset=DEFAULT_PRESET, prefix="step-")
        with gr.Column(scale=2, min_width=480):
            colour_by = gr.Radio(["probability", "surprisal"], value="probability", label="Colour tokens by", elem_id="step-colour")
            text = gr.HighlightedText(label="Generated text: click a token to inspect its step", combine_adjacent=False,
                                      show_legend=False, show_inline_category=False, interactive=False, elem_id=ids.STEP_TEXT)
            legend = gr.HTML(token_legend("probability"), elem_id="step-legend")
            colour_by.change(token_legend, colour_by, legend, queue=False, api_visibility="private")
            step_slider = gr.Slider(0, 1, value=0, step=1, label="Step", elem_id=ids.STEP_INDEX)
            explain = gr.Markdown(EMPTY_EXPLAIN, elem_id="step-explain")
            chart = gr.Plot(label="Distribution after each stage", elem_id=ids.STEP_CHART)
            width = gr.Number(None, show_label=False, elem_id=ids.STEP_WIDTH, elem_classes=["dp-hidden"])
            redraw = gr.Button("redraw", elem_id=ids.STEP_REDRAW, elem_classes=["dp-hidden"])
            what_if = WhatIfPanel.build()
            with gr.Row():
                alternatives = gr.Dropdown([], label="Branch: pick another token at this step", scale=3, elem_id="step-alt")
                branch_btn = gr.Button("Branch from here", scale=1, elem_id="step-branch")
            runs = gr.Radio([], label="Runs", elem_id="step-runs")
            compare = gr.Markdown(elem_id="step-compare")
            over_run = gr.Plot(label="Entropy and surprisal over the run", elem_id="step-over-run")
            hesitations = gr.Dropdown([], label="Hesitation steps (stars above): pick one to see its stages",
                                      elem_id="step-hesitations")
            summary = gr.Markdown(elem_id="step-summary")
            download = gr.DownloadButton("Download trace JSON", elem_id="step-download")
    out = Outputs(text, step_slider, explain, chart, alternatives, runs, compare, over_run, summary, status, download,
                  gr.State(None, time_to_live=SESSION_TTL_S),
                  gr.Textbox("", show_label=False, container=False, elem_id="step-owner", elem_classes=["dp-hidden"]),
                  what_if.key,
                  what_if.note, what_if.figure, hesitations)
    panel.wire()
    view = StepView("step", prompt, panel, chat, select_once=gr.State(None), width=width, remote_mode=remote_mode)
    # the mode radio is there only while the model box holds a served model
    shared.model.change(lambda m: gr.update(visible=isinstance(m, str) and is_remote_source(m)), shared.model,
                        remote_mode, queue=False, api_visibility="private")
    example = examples.ExampleRequest("step", DEFAULT_PROMPT, DEFAULT_PRESET, examples.fresh_config(panel), chat=True)
    examples.cache_for(shared.registry).want(example)
    whatif.use_panel(panel)
    handlers = Handlers(shared, view, out, colour_by, example, redraw, whatif, what_if)
    handlers.wire(generate, branch_btn, stop)
    handlers.wire_whatif()
    return view


@dataclass
class Handlers:
    """The view's event handlers; ``wire`` registers them."""

    shared: Shared
    view: StepView
    out: Outputs
    colour_by: gr.Radio
    example: examples.ExampleRequest | None = None
    redraw: gr.Button | None = None  # hidden; the page's script presses it when the chart's layout misses the width
    whatif: WhatIfService | None = None  # the app's what-if (wire_whatif)
    what_if: WhatIfPanel | None = None  # the what-if row under the chart

    def error(self, message: str) -> dict:
        """A branch's error: the run on screen is still the one in view (a failure after the branch
        started has already cleared it: stream_run)."""
        return {self.out.status: error_html(message)}

    def on_generate(self, prompt: str, chat: bool, model: str, quant: str, colour: str, state: StepSession | None,
                    owner: str, *values: Any, control: RunControl, select: str | int | None = None,
                    width: float | None = None, remote_mode: Any = "step") -> Iterator[dict]:
        """Run the prompt under the panel's knobs; the last update selects ``select`` (see stream_run).
        ``remote_mode``: step | fast, for a served model (``shared.with_mode``)."""
        if state is not None and not state.owned_by(owner):
            raise UserError("session: this session belongs to another page; reload the page")
        config, lm, prompt_ids = self.shared.prepare(self.view.panel, values, with_mode(model, remote_mode), quant,
                                                     prompt, chat)
        owner = owner if isinstance(owner, str) and len(owner) >= 32 else secrets.token_hex(16)
        session = StepSession(owner=owner)  # a new prompt starts a new list of runs
        yield {self.out.owner: owner}
        yield from stream_run(self.out, self.shared, session, StepRequest(lm, prompt, prompt_ids, config, chat, colour),
                              control, select=select, width=width)

    def on_run(self, select_once: Any, width: Any, remote_mode: Any, *args: Any, control: RunControl) -> Iterator[dict]:
        """Generate (the button, Ctrl/Cmd+Enter, a lesson's Open): ``on_generate`` of ``args``, ending
        on ``select_once``'s step when a lesson set it. It is cleared first, so it applies to this run
        only (a failed one too): the next Generate shows the most uncertain step again.
        ``remote_mode``: step | fast, for a served model (a model loaded here ignores it)."""
        yield {self.view.select_once: None}
        yield from self.on_generate(*args, control=control, select=lesson_select(select_once), width=page_width(width),
                                    remote_mode=remote_mode)

    def on_branch(self, model: str, quant: str, colour: str, state: StepSession | None, owner: str, at: Any,
                  token: Any, width: Any = None, *, control: RunControl) -> Iterator[dict]:
        state = own(state, owner)
        parent = state.trace() if state is not None else None
        if state is None or parent is None:
            raise UserError("branch: generate a run first")
        if token is None:
            raise UserError("branch: pick a token from the list first")
        lm = self.shared.lm(model, quant)
        req = StepRequest(lm, parent.prompt, parent.prompt_token_ids, DecodingConfig.from_dict(parent.config),
                          parent.chat, colour)
        yield from stream_run(self.out, self.shared, state, req, control, branch=(parent, int(at), int(token)),
                              width=page_width(width))

    def wire(self, generate: gr.Button, branch: gr.Button, stop: gr.Button) -> None:
        out, shared, events = self.out, self.shared, self.shared.events
        gen_inputs = [self.view.select_once, self.view.width, self.view.remote_mode, self.view.prompt, self.view.chat,
                      shared.model,
                      shared.quantization, self.colour_by, out.session, out.owner, *self.view.panel.inputs]
        gen_event = events.on([generate.click, self.view.prompt.submit], self.on_run, gen_inputs,
                              [*out.all(), self.view.select_once],
                              # a failed Generate also empties the what-if key: a knob moved then draws
                              # no what-if of the previous run into the cleared chart
                              # (the what-if note is a Markdown output: emptied with the rest)
                              on_error=stale.cleared(out.status, out.all(), also={out.whatif_key: "",
                                                                                  out.whatif_figure: ""}),
                              **owned(gen_inputs, out.owner))
        branch_inputs = [shared.model, shared.quantization, self.colour_by, out.session, out.owner, out.step,
                         out.alternatives, self.view.width]
        branch_event = events.on([branch.click], self.on_branch, branch_inputs, out.all(), on_error=self.error,
                                 **owned(branch_inputs, out.owner))
        stop_button(stop, out.status, [gen_event, branch_event], status_html("stopped"))
        self.wire_local()
        self.wire_example()
        events.api(functools.partial(step_trace, shared), "step_trace")
        events.api(functools.partial(branch_trace, shared), "branch", what="branch")

    def on_knob(self, state: StepSession | None, owner: str, step: Any, model: str, quant: str, width: Any,
                *values: Any) -> dict:
        """The what-if as a Gradio event (the route cannot answer: the model is not loaded, a ZeroGPU
        Space, ``DP_WHATIF_ROUTE=0``): the service's own answer, its figure through the hidden box."""
        panel, service = self.what_if, self.whatif
        if panel is None or service is None:
            raise RuntimeError("step: the what-if is not wired (wire_whatif)")
        state = own(state, owner)
        trace = state.trace() if state is not None else None
        if trace is None or not trace.steps or trace.strategy not in STAGE_STRATEGIES:
            return {panel.note: gr.skip(), panel.figure: ""}  # nothing to draw
        at = max(0, min(int(step or 0), len(trace.steps) - 1))
        answer = service.step_answer(state, trace, at, model, quant, width, list(values), load=True)
        if answer["figure"] is None:
            return {panel.note: answer["note"], panel.figure: ""}
        return {panel.figure: str(answer["figure"]), panel.note: answer["note"], self.out.explain: answer["explain"]}

    def on_continue(self, model: str, quant: str, colour: str, state: StepSession | None, owner: str, step: Any,
                    width: Any, *values: Any, control: RunControl) -> Iterator[dict]:
        """Continue from the selected step with the panel's knobs: a branch streamed into the view."""
        state = own(state, owner)
        parent = state.trace() if state is not None else None
        if state is None or parent is None or not parent.steps:
            raise UserError("continue: generate a run first")
        at = max(0, min(int(step or 0), len(parent.steps) - 1))
        config = self.view.panel.config(*values)
        lm = self.shared.lm(model, quant)
        req = StepRequest(lm, parent.prompt, parent.prompt_token_ids, config, parent.chat, colour)
        events = continue_events(self.shared, lm, parent, at, config, control)
        yield from stream_run(self.out, self.shared, state, req, control, branch=(parent, at, None), events=events,
                              width=page_width(width))

    def wire_whatif(self) -> None:
        """The what-if row: knob changes in the page (the route), the fallback event, Continue, and
        the ``/explore_step`` API."""
        out, shared, panel, what_if = self.out, self.shared, self.view.panel, self.what_if
        if what_if is None:
            raise RuntimeError("step: the what-if row was not built")
        what_if.wire_page(shared, panel, out.step, out.chart, out.explain, self.view.width)
        inputs = [out.session, out.owner, out.step, shared.model, shared.quantization, self.view.width, *panel.inputs]
        knob = gr.on([what_if.fallback.click], zero_gpu(self.on_knob), inputs, [what_if.figure, what_if.note, out.explain],
                     api_visibility="private", trigger_mode="always_last", show_progress="hidden", **WHATIF_CONCURRENCY,
                     **owned(inputs, out.owner))
        knob.success(None, [what_if.figure], None, js=DRAW_JS, queue=False, show_progress="hidden",
                     api_visibility="private")
        continued = [shared.model, shared.quantization, self.colour_by, out.session, out.owner, out.step,
                     self.view.width, *panel.inputs]
        shared.events.on([what_if.continue_btn.click], self.on_continue, continued, out.all(),
                         on_error=lambda message: {out.status: error_html(message)}, what="continue",
                         **owned(continued, out.owner))
        shared.events.api(functools.partial(explore_api, shared), "explore_step", what="what-if")

    def on_example(self, timer: gr.Timer, model: str, quant: str, colour: str, state: StepSession | None,
                   owner: str, prompt: str, chat: bool, *values: Any) -> dict:
        """A fresh page's first screen: the example run with its most uncertain step selected, once
        the startup thread has it. Polling stops once filled, once this page ran something, or once
        its prompt or knobs differ from the example's (edited, or filled by a share link)."""
        if self.example is None:
            raise RuntimeError("step: no example was asked for (wire_example)")
        fresh = state is None and examples.matches(self.example, prompt, chat, self.view.panel, values)
        done, example = examples.poll(self.shared.registry, self.example, timer, self.out.status, model, quant, fresh)
        if example is None:
            return done
        owner = owner if isinstance(owner, str) and len(owner) >= 32 else secrets.token_hex(16)
        session = StepSession(runs=[copy.deepcopy(example.trace)], owner=owner)  # a session may branch it
        note = ("An example run of this prompt with the default preset (the same as pressing Generate), showing its "
                "most uncertain step; click any token (or use ←/→) to inspect another.")
        return done | render(self.out, session, most_uncertain(example.trace.steps), colour, status_html(note)) | {
            self.out.owner: owner}

    def wire_example(self) -> None:
        """Poll for the startup example while the page has no run of its own (no model call)."""
        timer = gr.Timer(examples.POLL_S)
        out = self.out
        inputs = [self.shared.model, self.shared.quantization, self.colour_by, out.session, out.owner, self.view.prompt,
                  self.view.chat, *self.view.panel.inputs]
        timer.tick(functools.partial(self.on_example, timer), inputs, [*out.all(), timer], api_visibility="private",
                   queue=False, **owned(inputs, out.owner))

    def wire_local(self) -> None:
        """Events that only redraw the session's traces (no model): not queued, not API endpoints."""
        out = self.out
        local: dict[str, Any] = {"api_visibility": "private", "queue": False}

        def on_select(state: StepSession | None, owner: str, colour: str, width: Any, evt: gr.SelectData) -> dict:
            index = evt.index if isinstance(evt.index, int) else evt.index[0]
            return redraw(state, owner, index, colour, width)

        def redraw(state: StepSession | None, owner: str, index: Any, colour: str, width: Any) -> dict:
            state = own(state, owner)
            # (an empty dict would read as one value for all the outputs: Gradio refuses it)
            return {out.chart: gr.skip()} if state is None else render(out, state, index, colour, width=page_width(width))

        def on_pick_run(state: StepSession | None, owner: str, index: Any, colour: str, width: Any) -> dict:
            state = own(state, owner)
            if state is None or index is None or not 0 <= int(index) < len(state.runs):
                return {out.chart: gr.skip()}
            state.current = int(index)
            trace = state.trace()
            return render(out, state, (trace.branch_of if trace is not None else None) or 0, colour,
                          width=page_width(width))

        def on_width(state: StepSession | None, owner: str, index: Any, width: Any) -> dict:
            """The page crossed the narrow width (or the chart was laid out for the other one): the
            selected step's chart again, for this width, with its own explanation (a what-if drawn
            before is gone with the chart it was drawn into)."""
            state = own(state, owner)
            trace = state.trace() if state is not None else None
            if trace is None or not trace.steps:
                return {out.chart: gr.skip()}  # an empty dict would read as the chart's value
            at = max(0, min(int(index or 0), len(trace.steps) - 1))
            chart = charts.fitted_stage_chart(trace.steps[at], page_width(width), charts.source_of(trace, at))
            return {out.chart: revised(chart), out.explain: own_explain(trace, at), out.whatif_note: WHATIF_INTRO,
                    out.whatif_figure: ""}

        mine, width = [out.session, out.owner], self.view.width
        local |= owned(mine, out.owner)  # (the owner is second in every one's inputs)
        out.text.select(on_select, [*mine, self.colour_by, width], out.all(), **local)
        out.step.release(redraw, [*mine, out.step, self.colour_by, width], out.all(), **local)
        self.colour_by.change(redraw, [*mine, out.step, self.colour_by, width], out.all(), **local)
        out.runs.input(on_pick_run, [*mine, out.runs, self.colour_by, width], out.all(), **local)
        if out.hesitations is not None:
            out.hesitations.input(lambda state, owner, index, colour, w: {out.chart: gr.skip()} if index is None
                                  else redraw(state, owner, index, colour, w),
                                  [*mine, out.hesitations, self.colour_by, width], out.all(), **local)
        redrawn = [self.redraw.click] if self.redraw is not None else []
        gr.on([width.change, *redrawn], on_width, [*mine, out.step, width],
              [out.chart, out.explain, out.whatif_note, out.whatif_figure], **local)


def step_trace(shared: Shared, prompt: str, config: dict | None = None, preset: str = "", chat: bool = False,
               model: str = "embedded", quantization: str = "none", remote_mode: str = "step", *,
               control: RunControl) -> dict:
    """Run greedy or sampling on the prompt and return the trace JSON (same as the CLI's --json).
    ``preset``: a built-in preset name (or preset JSON); ``config``: knobs overriding it;
    ``remote_mode``: on a served model, "step" (our chain over its top-N) or "fast" (it samples)."""
    return shared.trace_json(prompt, config, preset, chat, with_mode(model, remote_mode, api=True), quantization,
                             strategies=STEP_STRATEGIES, default_strategy="sample", control=control)


def branch_trace(shared: Shared, parent: dict | str, step: int, token_id: int, model: str = "embedded",
                 quantization: str = "none", *, control: RunControl) -> dict:
    """Continue ``parent`` (a greedy or sampling trace JSON, e.g. from /step_trace) from step
    ``step`` with token ``token_id`` instead of the one it chose; returns the branch's trace JSON
    (``branch_of`` = ``step``; steps before it are the parent's)."""
    lm = shared.lm(model, quantization)
    trace = parent_trace(shared, lm, parent)
    return runner.collect(shared.branch(lm, trace, step, token_id, control=control)).to_dict()


