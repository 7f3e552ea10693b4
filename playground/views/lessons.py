"""Lessons (the first tab): the guided lessons of engine.reports.lessons, each 2-5 steps of text and a ready
configuration. "Run and check" runs the lesson on the model, selects its step
(``lessons.selected_step``) and shows the outcome sentence its check verifies
(``lessons.evaluate``); "Open in its view" puts the prompt and preset into the lesson's view
(a Compare lesson: every lane, each with its run's configuration), then presses the view's own run
button (page_js.OPEN_RUN_JS), so the view shows the lesson's run; Step through then selects the
lesson's step, once (``StepView.select_once``). Each page a lesson opens in is a ``shared.LessonTarget``
the app hands over (this tab imports no other view).
A presenter can paste their own lesson JSON and share it by link (``?lesson=<token>``, with
``&present=1`` for the presenter view). API: ``/lessons`` lists the built-in lessons.
"""

from __future__ import annotations

import base64
import functools
import html
import json
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import gradio as gr

import plotly.graph_objects as go

from engine.strategies import contrastive
from engine.reports import lessons as engine_lessons
from engine.control import RunControl, RunStopped
from engine.reports.distortion import DistortionReport
from engine.reports.drift import DriftReport, KVReport
from engine.reports.lessons import Lesson, LessonError, Outcome, parse_lesson_json
from engine.reports.lesson_results import RESULTS, LessonResult, LessonResults, result_key
from engine.strategies.speculative import rounds_of
from engine.reports.quant_report import MethodComparison
from engine.runner import RUNS
from engine.trace import StepTrace, Trace
from playground.charts import beam as beam_charts
from playground.charts import compare as compare_charts
from playground.charts import grammar as grammar_charts
from playground.charts import quant_methods as method_charts
from playground.charts import quantization as quant_charts
from playground.charts import speculative as spec_charts
from playground.charts.explain import LOCAL, Source
from playground.charts.step import NARROW_PX, PHONE_GAP_PX, PHONE_PX, panel_rows
from playground.charts.tokens import render as readable

from ..events import data_api, stop_button
from ..assets import static_text
from .. import checkpoint_maker, ids
from ..page_js import LESSON_PARAM, LESSON_READY_JS, OPEN_RUN_JS
from ..shared import CheckedRegistry, LessonTarget, Shared, UserError, error_html, page_width, status_html
from ..panels.presenter import ARROW_KEYS_JS, PRESENT_PARAM, PresenterPanel, failure_advice, lesson_line, qr_block
from ..stale import Cleared, cleared
from ..whatif_service import KeptLogits, Registered, register

TOKEN_PREFIX = "l1."
MAX_TOKEN_CHARS = 6_000
MAX_LESSON_BYTES = 32_768
# The page's address without its query (the base of a lesson's link), read on page load.
BASE_URL_JS = static_text("lessons_base_url.js")


# --- lessons in links -------------------------------------------------------------------------
def lesson_token(text: str) -> str:
    """A URL-safe token carrying a lesson's JSON text (raw deflate + base64url)."""
    packer = zlib.compressobj(9, zlib.DEFLATED, -15)
    packed = packer.compress(text.encode("utf-8")) + packer.flush()
    token = TOKEN_PREFIX + base64.urlsafe_b64encode(packed).decode("ascii").rstrip("=")
    if len(token) > MAX_TOKEN_CHARS:
        raise UserError(f"lesson: {len(token):,} characters is too long for a link (limit {MAX_TOKEN_CHARS:,})")
    return token


def lesson_from_token(token: Any, offered: Mapping[str, Lesson] | None = None) -> Lesson:
    """A lesson id (``offered``: the lessons this app offers; default the built-in ones and those the
    environment's servers allow), or a token from ``lesson_token``, as a validated Lesson (LessonError if bad)."""
    if not isinstance(token, str) or len(token) > MAX_TOKEN_CHARS:
        raise LessonError("lesson: the link's lesson is not text or is too long")
    builtin = engine_lessons.available_lessons() if offered is None else offered
    if token in builtin:
        return builtin[token]
    if not token.startswith(TOKEN_PREFIX):
        raise LessonError(f"lesson: no built-in lesson is called {token[:40]!r}")
    body = token[len(TOKEN_PREFIX):]
    try:
        unpacker = zlib.decompressobj(-15)
        raw = unpacker.decompress(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)), MAX_LESSON_BYTES + 1)
    except (ValueError, zlib.error):
        raise LessonError("lesson: the link is damaged; was it copied whole?") from None
    if len(raw) > MAX_LESSON_BYTES or not unpacker.eof:
        raise LessonError("lesson: the link is damaged or over the size limit")
    return parse_lesson_json(raw)


def steps_html(lesson: Lesson) -> str:
    """The lesson's title, steps, prompt and runs as plain text in HTML: a lesson (pasted, or from a
    link) is data, so Markdown images and links, and HTML tags, show as the characters they are."""
    steps = "".join(f"<li>{html.escape(s)}</li>" for s in lesson.steps)
    runs = ", ".join(html.escape(p.name) for p in lesson.runs)
    return (f'<div class="dp-lesson-steps"><h3>{html.escape(lesson.title)}</h3><ol>{steps}</ol>'
            f"<small>Opens the <b>{html.escape(lesson.view)}</b> view · prompt: {html.escape(repr(lesson.prompt))}"
            f" · runs: {runs}</small></div>")


# --- running ----------------------------------------------------------------------------------
@dataclass
class LessonSession(Registered):
    """One page's lesson: the Lesson, its runs' traces once run, and the check's outcome."""

    lesson: Lesson
    traces: list[Trace] = field(default_factory=list)
    outcome: Outcome | None = None
    kept: KeptLogits | None = None  # the presenter what-if's raw logits of one step
    whatif_key: str = ""  # the page's key for the what-if route (whatif.register)

    def __post_init__(self) -> None:
        self.whatif_key = register(self)

    shown: int = 0  # the run whose chart teaches the lesson's stage (shown_run)

    def first(self) -> Trace | None:
        return self.traces[0] if self.traces else None

    def shown_trace(self) -> Trace | None:
        """The run the chart and the presenter show (shown_run), if it has stage panels to step through."""
        if not 0 <= self.shown < len(self.traces):
            return None
        trace = self.traces[self.shown]
        return trace if trace.steps and trace.steps[0].stages else None

    def whatif_trace(self) -> Trace | None:
        """The trace the presenter's what-if redraws: the shown run."""
        return self.shown_trace()

    def chart(self, width: float | None = None) -> go.Figure | None:
        """What the tab's chart shows once the lesson ran: the check's report where it made one,
        else the shown run's chart at the lesson's step (``run_chart``), for a page ``width`` px wide."""
        report = report_chart(self.outcome) if self.outcome is not None else None
        if report is not None or not self.traces:
            return report
        trace = self.traces[self.shown]
        return run_chart(self.lesson, trace, engine_lessons.selected_step(trace, self.lesson.select_step), width)

    def lesson_step(self) -> int | None:
        """The step of the shown run the lesson's chart shows (``lessons.selected_step``), if any."""
        trace = self.shown_trace()
        return None if trace is None else engine_lessons.selected_step(trace, self.lesson.select_step)


# The checks that load 4-bit checkpoints made here: kind -> the variants they load.
CHECKPOINT_CHECKS = {"gptq_vs_awq": engine_lessons.GPTQ_VS_AWQ}
CHECKPOINT_POLL_S = 2.0


def wait_for_checkpoints(kind: str | None, control: RunControl, status: Any) -> Iterator[dict]:
    """Make the checkpoints a check of ``kind`` loads, on first need (``checkpoint_maker``: in the
    background, niced, resumable), showing "step k of n, about N min left" in ``status`` until they
    are made. The wait is not the run's: its time limit counts from when they are there. Stop ends
    the wait (the maker goes on: the next click finds more made); a failed maker is a UserError."""
    maker = checkpoint_maker.ensure(CHECKPOINT_CHECKS[kind]) if kind in CHECKPOINT_CHECKS else None
    if maker is None:
        return
    while not (progress := maker.progress()).done:
        if progress.error:
            raise UserError(progress.sentence())
        if control.cancelled:
            raise RunStopped("cancelled", "stopped: the checkpoints go on being made in the background")
        yield {status: status_html(progress.sentence() + "…")}
        time.sleep(CHECKPOINT_POLL_S)
    control.started = time.monotonic()


def outcome_html(outcome: Outcome) -> str:
    mark, cls = ("✓", "dp-status") if outcome.ok else ("✗ not shown on this run:", "dp-error")
    return f'<div class="{cls}" id="lesson-outcome-text">{mark} {html.escape(outcome.summary)}</div>'


def runs_html(lesson: Lesson, traces: Sequence[Trace]) -> str:
    """Each run's name and generated text, as plain text (model output is not Markdown either)."""
    return "".join(f'<p class="dp-lesson-run" style="white-space: pre-wrap"><b>{html.escape(p.name)}</b>: '
                   f"{html.escape(''.join(s.chosen_token for s in t.steps))}</p>" for p, t in zip(lesson.runs, traces))


NEUTRAL_PANELS = ("raw", "final")


def shown_run(traces: Sequence[Trace], select: str | int, taught: int | None = None) -> int:
    """The run whose chart shows the stage the lesson teaches: ``taught``, the run its check is
    about (``lessons.taught_run``: the truncation lesson's top-p lane), where that run has stage
    panels; else a contrastive run (its scores are the lesson), else the one with the most stages at
    its selected step that not every run has (temperature in a temperature lesson, the penalty in a
    penalties lesson), else the first with a draw (sampling), else the first. A stage every run
    shares (min_new_tokens on both lanes) teaches nothing."""
    if taught is not None and 0 <= taught < len(traces) and traces[taught].steps and traces[taught].steps[0].stages:
        return taught

    def names(trace: Trace) -> set[str]:
        if not trace.steps:
            return set()
        step = trace.steps[engine_lessons.selected_step(trace, select)]
        return {s.name for s in step.stages} - set(NEUTRAL_PANELS)

    sets = [names(t) for t in traces]
    common = set.intersection(*sets) if sets else set()
    draws = [bool(t.steps) and t.steps[engine_lessons.selected_step(t, select)].draw is not None for t in traces]
    keys = [(t.strategy in contrastive.STRATEGIES, len(n - common), d) for t, n, d in zip(traces, sets, draws)]
    return keys.index(max(keys)) if keys else 0


def contrastive_figure(trace: Trace, at: int) -> go.Figure | None:
    """Contrastive search at step ``at``: each top-k candidate's probability, degeneration penalty
    (its largest cosine similarity with the context) and score; the chosen token is outlined."""
    records = contrastive.records(trace)
    record = records[at] if 0 <= at < len(records) else None
    if not isinstance(record, contrastive.SearchStep):
        return None
    cands = record.candidates
    labels = [f"{readable(c.token)} #{i}" if [readable(d.token) for d in cands].count(readable(c.token)) > 1
              else readable(c.token) for i, c in enumerate(cands)]
    outline = dict(color=["#111" if c.token_id == record.chosen_token_id else "rgba(0,0,0,0)" for c in cands], width=2.5)
    fig = go.Figure()
    for name, values, colour in (("p", [c.prob for c in cands], "#4c78a8"),
                                 ("degeneration penalty", [c.penalty for c in cands], "#e45756"),
                                 ("score", [c.score for c in cands], "#54a24b")):
        fig.add_trace(go.Bar(y=labels, x=values, name=name, orientation="h", marker_color=colour, marker_line=outline))
    title = (f"contrastive search, step {at}: score = (1 − α)·p − α·penalty, α = {record.alpha:g}"
             f"<br><sup>the chosen token is outlined</sup>")
    fig.update_layout(title=dict(text=title, x=0.01), barmode="group", template="plotly_white",
                      height=max(300, 140 + 60 * len(cands)), margin=dict(l=10, r=10, t=80, b=40),
                      legend=dict(orientation="h", x=0, y=-0.1, yanchor="top"))
    fig.update_yaxes(autorange="reversed", automargin=True)
    return fig


def run_chart(lesson: Lesson, trace: Trace, at: int, width: float | None = None) -> go.Figure | None:
    """The chart of what the lesson teaches, from its shown run: the beam tree, the speculative
    rounds, contrastive search's scores, or the step's stage panels, legible as in Compare's
    inspector (``legible_stage_chart``: T = 5's flat temperature panel on its own scale, the chosen
    token's p written where the trace records it, the served model's numbers as its mode has them:
    ``source_of``), laid out for a page ``width`` px wide (None:
    not known, wide). None: nothing to draw yet (a Quantization & KV cache lesson draws its check's
    report, ``report_chart``). Each fits a projector's first screen (``first_screen``) but the beam
    tree, whose nodes need their room (its top row, the winner's path, is on the first screen, and it pans)."""
    if trace.beam is not None:
        return beam_charts.tree_figure(trace.beam)
    if trace.rounds:
        return first_screen(spec_charts.accepted_length_figure(rounds_of(trace)))
    if trace.strategy == "contrastive_search":
        figure = contrastive_figure(trace, at)
        return None if figure is None else first_screen(figure)
    if lesson.view == "quantization" or not trace.steps or not trace.steps[at].stages:
        return None
    return lesson_stage_chart(trace.steps[at], width, compare_charts.source_of(trace, at))


# A one-row stage chart's height and bottom margin (x ticks and legend): its title, panel titles,
# 10-12 bars and legend fit a projector's first screen (1280x720) below the page's header.
LESSON_ROW_PX, LESSON_TOP_PX, LESSON_BOTTOM_PX = 370, 100, 45
LESSON_TITLE_PX = 18  # the title's top anchor below the chart's top: its first line is not clipped


def first_screen(fig: go.Figure) -> go.Figure:
    """``fig`` at most LESSON_ROW_PX tall: below the page's header on a projector's first screen."""
    if fig.layout.height is None or fig.layout.height > LESSON_ROW_PX:
        fig.update_layout(height=LESSON_ROW_PX)
    return fig


def lesson_stage_chart(step: StepTrace, width: float | None = None, source: Source = LOCAL) -> go.Figure:
    """Step ``step``'s ``legible_stage_chart`` for a page ``width`` px wide (None: not known, wide):
    up to four panels in one row on a wide page (the panels a lesson compares side by side, short
    enough for a projector's first screen below the page's header); as Step through's chart below
    NARROW_PX, two a row, and one a row on a phone. ``layout.meta`` says which layout it is, so the
    page asks for the other one after a resize (page_js). ``source``: see ``legible_stage_chart``."""
    panels = len(step.stages) + (1 if step.draw is not None else 0)
    narrow, phone = width is not None and width < NARROW_PX, width is not None and width < PHONE_PX
    columns = 1 if phone else min(2 if narrow else 4, panels)
    # ("shown": which layout, named as compare_charts.with_phone_layout names its own)
    meta = {"narrow": narrow, "phone": phone, "columns": columns, "shown": "phone" if phone else "wide"}
    # A phone's panels get PHONE_BAR_PX a bar, so every token label fits (compare_charts' phone layout).
    panel_px = max(160, max(panel_rows(step), default=1) * compare_charts.PHONE_BAR_PX) if phone else 260
    fig = compare_charts.legible_stage_chart(step, source, columns=columns, gap_px=PHONE_GAP_PX if phone else None,
                                             meta=meta, panel_px=panel_px)
    fig.update_xaxes(tickangle=0)  # turned 90°, "0.05%" reaches into the next panel's title
    if phone or (not narrow and panels <= 4):
        fig.update_yaxes(tickmode="linear", dtick=1)  # every bar keeps its token label (plotly skips every other)
    if not narrow and panels <= 4:
        # (the title's place is kept in pixels from the top: the figure set it for its own height)
        fig.update_layout(height=LESSON_ROW_PX, margin_t=LESSON_TOP_PX, margin_b=LESSON_BOTTOM_PX,
                          title_y=1 - LESSON_TITLE_PX / LESSON_ROW_PX)
    return fig


def report_chart(outcome: Outcome) -> go.Figure | None:
    """The check's own measurement, where it made one: drift (KL per step), the KV cache report, or
    the grammar's distortion (masked decoding against the model conditioned on the grammar)."""
    if isinstance(outcome.report, DistortionReport):
        return grammar_charts.distortion_figure(outcome.report)
    if isinstance(outcome.report, DriftReport):
        return first_screen(quant_charts.kl_figure(outcome.report))
    if isinstance(outcome.report, KVReport):
        return first_screen(quant_charts.kv_figure(outcome.report))
    if isinstance(outcome.report, MethodComparison):
        return first_screen(method_charts.comparison_figure(outcome.report))
    return None


NO_PRESENTER_STEPS = ('<p class="dp-status">This lesson\'s chart is not a token\'s stage chart (see it beside the '
                      "lesson's steps); the presenter view steps through token charts.</p>")


def list_lessons() -> list[dict]:
    """Every lesson offered here as ``Lesson.to_dict()`` (id, title, view, preset, prompt, steps...): the
    built-in ones, and those whose servers the operator lists (engine.reports.lessons.available_lessons)."""
    return [lesson.to_dict() for lesson in engine_lessons.available_lessons().values()]


@dataclass(frozen=True)
class LessonFailure:
    """``LessonsTab.failed``'s ``on_error``: ``cleared``'s update with the lesson's line and advice, and
    the presenter's overlay. ``status``: where events.streamed writes a stopped run's line (both)."""

    base: Cleared
    box: gr.HTML
    presenter: PresenterPanel

    @property
    def status(self) -> tuple:
        return (self.box, self.presenter.text)

    def __call__(self, message: str, stopped: bool = False) -> dict:
        update = self.base(lesson_line(message), stopped)
        update[self.box] += status_html(failure_advice(message, stopped))
        return update | self.presenter.failed(message, stopped)


@dataclass
class LessonsTab:
    """The tab's components; ``wire_page`` needs the pages a lesson opens in, so the app calls it last."""

    shared: Shared
    pick: gr.Dropdown
    steps: gr.HTML
    open_btn: gr.Button
    run_btn: gr.Button
    status: gr.HTML
    outcome: gr.HTML
    texts: gr.HTML
    chart: gr.Plot
    custom: gr.Textbox
    load_btn: gr.Button
    link: gr.Textbox
    present: gr.Checkbox
    base_url: gr.Textbox
    presenter: PresenterPanel
    session: gr.State
    open_run: gr.Textbox  # hidden: the run button "Open in its view" presses ("" none)
    stop_btn: gr.Button
    width: gr.Number  # hidden: the page width (px) the page's script writes (the chart's layout)
    redraw: gr.Button  # hidden: pressed by the page's script when the chart was laid out for another width
    live_btn: gr.Button  # "Run it live": the lesson run again, not this deployment's kept result
    results: LessonResults | None = None  # the deployment's checked results (None: every press runs)

    @property
    def offered(self) -> dict[str, Lesson]:
        """The lessons this app offers: the built-in ones and those its listed servers allow (the model
        policy's list, fixed when the app was built; the environment's where there is none)."""
        return engine_lessons.available_lessons(offered=self.allowed)

    @property
    def allowed(self) -> Sequence[str] | None:
        policy = getattr(self.shared, "policy", None)
        return policy.allowed if policy is not None else None

    def current(self, session: LessonSession | None, choice: str) -> Lesson:
        if session is not None and (choice == session.lesson.id or choice is None):
            return session.lesson
        return lesson_from_token(choice or "", self.offered)

    def on_run(self, choice: str, session: LessonSession | None, model: str, quant: str, width: Any = None,
               present: Any = False, *, control: RunControl, live: bool = False) -> Iterator[dict]:
        """Run the lesson's runs, draw its chart (for a page ``width`` px wide) and the presenter's
        first step, then run its check. A result this deployment already checked (``results``) is
        shown at once, unless ``live`` ("Run it live"). A presenter's runs (``present``: the
        presenter view is on) go first on the scheduler, in its reserved row (``RunControl.priority``)."""
        lesson = self.current(session, choice)
        control.priority = bool(present)
        # The previous lesson's chart and texts go at once: a Stop or an error must not leave them as this run's.
        yield {self.status: status_html(f"running {len(lesson.runs)} run(s)…"), self.outcome: "", self.texts: "",
               self.chart: None, self.presenter.chart: None, self.presenter.text: ""}
        key = result_key(lesson, str(model), str(quant))
        results = self.results if isinstance(self.results, LessonResults) else None  # (a test's stand-in: none)
        kept = results.get(key) if results is not None and not live else None
        if kept is not None:
            yield self.kept_updates(lesson, kept, width)
            return
        lm = self.shared.lm(model, quant)
        traces = [self.shared.run(run_lm, lesson.prompt, p.config, chat=lesson.chat, control=control,
                                  prompt_ids=self.shared.encode_prompt(run_lm, lesson.prompt, lesson.chat))
                  for p, run_lm in zip(lesson.runs, self.run_models(lesson, lm, model, quant))]
        updates = self.shown_updates(lesson, traces, width)
        session = updates[self.session]
        yield updates
        kind = (lesson.check or {}).get("kind")
        lacking = engine_lessons.check_unavailable(kind, lm.capabilities)
        if lacking is not None:
            yield {self.status: status_html(f"done; lesson check: not available for a served model ({lacking})")}
            return
        yield from wait_for_checkpoints(kind, control, self.status)
        registry = CheckedRegistry(self.shared.registry, self.shared.policy)
        session.outcome = outcome = engine_lessons.evaluate(lm, lesson, traces, registry, runs=RUNS)
        if results is not None:
            results.put(key, traces, outcome)
        done = {self.outcome: outcome_html(outcome), self.status: status_html("done")}
        report = report_chart(session.outcome)
        yield done | ({self.chart: report} if report is not None else {})

    def on_run_live(self, choice: str, session: LessonSession | None, model: str, quant: str, width: Any = None,
                    present: Any = False, *, control: RunControl) -> Iterator[dict]:
        """"Run it live": ``on_run`` without the kept result (and the new one kept)."""
        yield from self.on_run(choice, session, model, quant, width, present, control=control, live=True)

    def shown_updates(self, lesson: Lesson, traces: list[Trace], width: Any, outcome: Outcome | None = None) -> dict:
        """A new LessonSession of ``traces`` (its check's ``outcome`` when known): the runs' texts, the
        chart, the selected step and the presenter's first step."""
        shown = shown_run(traces, lesson.select_step, engine_lessons.taught_run(lesson))
        session = LessonSession(lesson, traces, outcome=outcome, shown=shown)
        trace = traces[shown]
        at = engine_lessons.selected_step(trace, lesson.select_step)
        which = f"the run {lesson.runs[shown].name!r}" if len(traces) > 1 else "the run"
        updates = {self.texts: runs_html(lesson, traces), self.session: session,
                   self.presenter.key: session.whatif_key, self.chart: session.chart(page_width(width)),
                   self.status: status_html(f"step {at} of {which} selected; checking the claim…")}
        if session.shown_trace() is not None:  # the presenter starts at the run's first token; Next walks on
            updates |= self.presenter.show(trace, 0, False, lesson_step=at)
        else:
            updates |= {self.presenter.text: NO_PRESENTER_STEPS, self.presenter.chart: None, self.presenter.index: 0}
        return updates

    def kept_updates(self, lesson: Lesson, kept: LessonResult, width: Any) -> dict:
        """This deployment's checked result of the lesson, shown at once."""
        at = time.strftime("%H:%M:%S UTC", time.gmtime(kept.at))
        return self.shown_updates(lesson, list(kept.traces), width, kept.outcome) | {
            self.outcome: outcome_html(kept.outcome),
            self.status: status_html(f"done: this deployment's checked result, computed at {at} (Run it live runs "
                                     "it again)")}

    def on_width(self, session: LessonSession | None, width: Any) -> dict:
        """The page crossed a layout width (or the chart was laid out for another one): the lesson's
        chart again, for this width."""
        if not isinstance(session, LessonSession) or not session.traces:
            return {self.chart: gr.skip()}
        return {self.chart: session.chart(page_width(width))}

    def run_models(self, lesson: Lesson, lm: Any, model: str, quant: str) -> list[Any]:
        """The model of each run: ``lm`` (the page's), or the operator's server a lesson's ``models``
        name (through the policy; fast mode after ``fast:``). UserError when one is not listed."""
        try:
            sources = engine_lessons.run_sources(lesson, model, offered=self.allowed)
        except LessonError as exc:
            raise UserError(str(exc)) from None
        picked = {source: self.shared.lm(source, quant) for source in set(sources) if source != model}
        return [lm if source == model else picked[source] for source in sources]

    # --- wiring -----------------------------------------------------------------------------------
    def on_pick(self, choice: str, session: LessonSession | None) -> dict:
        try:
            lesson = self.current(session, choice)
        except LessonError as exc:
            return {self.status: error_html(str(exc))}
        return {self.steps: steps_html(lesson), self.status: "", self.outcome: ""}

    def on_load_custom(self, text: str, session: LessonSession | None) -> dict:
        """A pasted lesson JSON: validated (the error names the key), then shown and offered."""
        try:
            lesson = parse_lesson_json(text or "")
        except LessonError as exc:
            return {self.status: error_html(str(exc))}
        choices = [(l.title, l.id) for l in engine_lessons.builtin_lessons().values() if l.id != lesson.id]
        return {self.session: LessonSession(lesson), self.steps: steps_html(lesson), self.outcome: "",
                self.pick: gr.update(choices=[*choices, (f"{lesson.title} (yours)", lesson.id)], value=lesson.id),
                self.status: status_html("lesson loaded: press Run and check")}

    def on_link(self, choice: str, session: LessonSession | None, custom: str, base_url: str) -> dict:
        """The lesson's share link (a built-in by id, a pasted one carried whole) and its QR code."""
        try:
            lesson = self.current(session, choice)
            builtin = engine_lessons.builtin_lessons().get(lesson.id)
            # A shared lesson (opened from a link) has no pasted text: its token is rebuilt from the lesson.
            value = lesson.id if builtin == lesson else lesson_token(json.dumps(lesson.to_file_dict(), ensure_ascii=False))
        except (LessonError, UserError) as exc:
            return {self.link: "", self.status: error_html(str(exc))}
        query = f"{LESSON_PARAM}={value}"
        return {self.link: f"{base_url}?{query}" if base_url else f"?{query}",
                self.presenter.qr: qr_block(base_url, f"{query}&{PRESENT_PARAM}=1")}

    def failed(self, outputs: list) -> Callable[..., dict]:
        """A lesson run's ``on_error``: ``cleared``'s, with the line and a lesson's advice
        (presenter.failure_advice: its runs are fixed, so never "ask for fewer tokens") in the status
        and in the presenter's overlay, which would otherwise stand blank over the status."""
        return LessonFailure(cleared(self.status, outputs), self.status, self.presenter)

    def wire(self) -> None:
        local: dict[str, Any] = {"api_visibility": "private", "queue": False}
        self.pick.change(self.on_pick, [self.pick, self.session], [self.steps, self.status, self.outcome], **local)
        self.load_btn.click(self.on_load_custom, [self.custom, self.session],
                            [self.session, self.steps, self.outcome, self.pick, self.status], **local)
        link_io = ([self.pick, self.session, self.custom, self.base_url], [self.link, self.presenter.qr, self.status])
        gr.on([self.pick.change, self.base_url.change, self.load_btn.click], self.on_link, *link_io, **local)
        self.present.change(lambda on: gr.update(visible=bool(on)), [self.present], [self.presenter.column], **local)
        outputs = [self.status, self.outcome, self.texts, self.chart, self.session, self.presenter.text,
                   self.presenter.chart, self.presenter.index, self.presenter.temperature, self.presenter.key]
        inputs = [self.pick, self.session, self.shared.model, self.shared.quantization, self.width, self.present]
        runs = [self.shared.events.on([self.run_btn.click], self.on_run, inputs, outputs,
                                      on_error=self.failed(outputs), what="lesson")]
        if self.live_btn is not None:
            runs.append(self.shared.events.on([self.live_btn.click], self.on_run_live, inputs, outputs,
                                              on_error=self.failed(outputs), what="lesson"))
        gr.on([self.width.change, self.redraw.click], self.on_width, [self.session, self.width], [self.chart], **local)
        if self.stop_btn is not None:
            stop_button(self.stop_btn, self.status, runs, status_html("stopped"))
        self.presenter.wire(lambda s: s.shown_trace() if isinstance(s, LessonSession) else None, self.session,
                            self.shared.model, self.shared.quantization,
                            step_of=lambda s: s.lesson_step() if isinstance(s, LessonSession) else None)
        data_api(list_lessons, "lessons")

    def wire_page(self, demo: gr.Blocks, tabs: gr.Tabs, targets: Sequence[LessonTarget]) -> None:
        """Page load: ``?lesson=`` opens that lesson, ``?present=1`` the presenter view; Open fills the
        lesson's view (``targets``: the pages a lesson opens in, handed over by the app), switches to
        its tab and runs it there."""
        demo.load(None, None, [self.base_url], js=BASE_URL_JS, api_visibility="private")
        demo.load(None, js=ARROW_KEYS_JS, api_visibility="private")
        link_io = ([self.pick, self.session, self.custom, self.base_url], [self.link, self.presenter.qr, self.status])
        # The link and QR code follow the lesson the page opened with (a shared one has no pasted text).
        # Not queued: a link's lesson replaces the first one as soon as the page is up; until then
        # page.js hides the lessons' text and holds Open and Run (LESSON_READY_JS ends the hold).
        query = demo.load(self.on_query, None, [self.session, self.pick, self.steps, self.present, self.status],
                          api_visibility="private", queue=False)
        query.then(None, js=LESSON_READY_JS, api_visibility="private", queue=False)
        query.then(self.on_link, *link_io, api_visibility="private", queue=False)
        by_name = {target.name: target for target in targets}
        outputs = [tabs, self.status, self.open_run] + [c for t in by_name.values() for c in t.lesson_outputs()]
        on_open = functools.partial(self.on_open, tabs, by_name)
        # Filled first (not queued), then the view's own run button is pressed in the page: the run,
        # its streaming, Stop and errors are the view's, and a failed run keeps the lesson's prompt.
        self.open_btn.click(on_open, [self.pick, self.session, self.shared.user_presets], outputs,
                            api_visibility="private", queue=False
                            ).then(None, [self.open_run], None, js=OPEN_RUN_JS, api_visibility="private", queue=False)

    def on_open(self, tabs: gr.Tabs, targets: Mapping[str, LessonTarget], choice: str,
                session: LessonSession | None, stored: Any) -> dict:
        """Updates filling the lesson's view (its LessonTarget in ``targets``, by name), switching to
        its tab and naming its run button in ``open_run``."""
        try:
            lesson = self.current(session, choice)
            target = targets.get(lesson.view)
            updates, button = target.lesson_updates(lesson, stored, self.allowed) if target is not None else ({}, "")
        except (LessonError, UserError) as exc:
            return {self.status: error_html(str(exc)), self.open_run: ""}
        runs = "; ".join(f"{p.name} ({p.config.strategy})" for p in lesson.runs)
        note = status_html(f"opened in {lesson.view} and running it: prompt {lesson.prompt!r}; runs: {runs}")
        if not updates:  # a view with no handle to fill: running its own prompt would mislead
            note = status_html(f"opened {lesson.view}: run it there with the lesson's prompt {lesson.prompt!r}")
        return updates | {tabs: gr.Tabs(selected=f"tab-{lesson.view}"), self.status: note,
                          self.open_run: button if updates else ""}

    def on_query(self, request: gr.Request) -> dict:
        params: Mapping[str, str] = dict(request.query_params) if request is not None else {}
        updates: dict = {self.present: params.get(PRESENT_PARAM) == "1"}
        if LESSON_PARAM not in params:
            return updates
        try:
            lesson = lesson_from_token(params[LESSON_PARAM], self.offered)
        except LessonError as exc:
            return updates | {self.status: error_html(f"This lesson link could not be opened ({exc}).")}
        choices = [(l.title, l.id) for l in self.offered.values()]
        if lesson.id not in dict((v, k) for k, v in choices):
            choices.append((f"{lesson.title} (shared)", lesson.id))
        return updates | {self.session: LessonSession(lesson), self.steps: steps_html(lesson),
                          self.pick: gr.update(choices=choices, value=lesson.id)}


def build_tab(shared: Shared) -> LessonsTab:
    """The Lessons tab: pick, read, run and check a lesson; the presenter view lives here too."""
    lessons = engine_lessons.available_lessons(offered=shared.policy.allowed)
    first = next(iter(lessons.values()))
    # The intro heads the left column, so the right one (the chart) starts at the tab's top.
    with gr.Row(equal_height=False):
        with gr.Column(scale=1, min_width=300):
            gr.Markdown("Short guided tours of one decoding idea each. Pick a lesson, read its steps, press **Run and "
                        "check** (or **Open in its view** to explore it there).", elem_id="lessons-intro")
            pick = gr.Dropdown([(l.title, l.id) for l in lessons.values()], value=first.id, label="Lesson",
                               elem_id="lessons-pick")
            # The buttons sit above the steps, so Run and check is on the first screen whatever the lesson's length.
            with gr.Row():
                run_btn = gr.Button("Run and check", variant="primary", elem_id=ids.LESSONS_RUN, min_width=120)
                stop_btn = gr.Button("Stop", elem_id="lessons-stop", min_width=70, scale=0)
                open_btn = gr.Button("Open in its view", elem_id=ids.LESSONS_OPEN, min_width=120)
                live_btn = gr.Button("Run it live", elem_id="lessons-run-live", min_width=100, scale=0)
            status = gr.HTML("", elem_id="lessons-status")
            steps = gr.HTML(steps_html(first), elem_id="lessons-steps")
            present = gr.Checkbox(False, label="Presenter view (large, one step at a time)", elem_id=ids.LESSONS_PRESENT)
            with gr.Accordion("Your own lesson (JSON) and its link", open=False, elem_id="lessons-custom-box"):
                custom = gr.Textbox(lines=6, label="Lesson JSON (format: presets/lessons/*.json)", elem_id="lessons-json")
                load_btn = gr.Button("Load lesson", elem_id="lessons-load")
                link = gr.Textbox(label="Link to this lesson", interactive=False, elem_id="lessons-link")
            base_url = gr.Textbox(visible=False, elem_id="lessons-base-url")
            open_run = gr.Textbox(visible=False, elem_id="lessons-open-run")
        with gr.Column(scale=2, min_width=300):
            presenter = PresenterPanel.build()
            # The chart first, with no label above it (its title says what it shows): on a
            # projector's first screen (1280x720) whatever the length of the runs' texts.
            chart = gr.Plot(label="What the lesson shows", show_label=False, elem_id=ids.LESSONS_CHART)
            width = gr.Number(None, show_label=False, elem_id=ids.LESSONS_WIDTH, elem_classes=["dp-hidden"])
            redraw = gr.Button("redraw", elem_id=ids.LESSONS_REDRAW, elem_classes=["dp-hidden"])
            outcome = gr.HTML("", elem_id="lessons-outcome")
            texts = gr.HTML(elem_id="lessons-texts")
    tab = LessonsTab(shared, pick, steps, open_btn, run_btn, status, outcome, texts, chart, custom, load_btn, link,
                     present, base_url, presenter, gr.State(None), open_run, stop_btn, width, redraw, live_btn, RESULTS)
    tab.wire()
    return tab
