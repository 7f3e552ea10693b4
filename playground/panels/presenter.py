"""Presenter view: one step at a time of the lesson's run, full screen (an overlay over the page,
the chart taking the free height and width), fonts readable from the back of a room (chart token
labels >= 18 px), Next / Previous token (buttons and the left/right arrow keys), "guess the next
token" (the chosen token hidden until Reveal), and a QR code of the share link (click to enlarge).

Shown by the toggle on the Lessons tab or the URL flag ``?present=1``; Exit (or Esc) leaves it.
Pure helpers (``presenter_chart``, ``context_html``; ``step_chart`` is charts.presenter's, which
the what-if service draws the temperature slider's answer with) take a trace; the panel only wires
them. The slider posts to the app's what-if route (playground/whatif_service.py).
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from typing import Any

import gradio as gr
import plotly.graph_objects as go

from engine.config import KNOBS
from engine.control import TIME_LIMIT_ADVICE
from engine.numbers import percent
from engine.trace import Trace
from playground import ids, qr
from playground.charts import step as charts
from playground.charts.explain import source_of
from playground.charts.presenter import step_chart  # the what-if service draws the slider's chart with it too
from playground.charts.step import revised

from ..assets import static_text
from ..page_js import PRESENTER_JS, PRESENTER_PREPARE_JS

PRESENT_PARAM = "present"

# Left/right arrows press Previous/Next and Esc presses Exit while the presenter view is shown and
# no text field has focus (page load; the page's other keys live in playground/page_js.py). Esc on
# the enlarged QR code only shrinks it back (a second Esc exits).
ARROW_KEYS_JS = static_text("presenter_keys.js")
# Exit unticks the Lessons tab's presenter toggle (its change event hides this view); Run presses
# the tab's own Run and check, which the overlay covers.
EXIT_JS = static_text("presenter_exit.js")
RUN_JS = static_text("presenter_run.js")


def presenter_chart(trace: Trace, index: int, width: float | None = None) -> go.Figure:
    """Step ``index``'s stage chart at projector size (``step_chart``)."""
    return step_chart(trace.steps[index], width, source_of(trace, index))


def temperature_slider() -> gr.Slider:
    """The what-if slider: the temperature knob's own range and step (engine.config.KNOBS, the one
    place for bounds), so any run's temperature can be shown and tried."""
    knob = KNOBS["temperature"]
    return gr.Slider(knob.low, knob.high, value=knob.neutral, step=knob.step, label="What if: temperature",
                     elem_id="present-temperature", min_width=200)


def run_temperature(trace: Trace) -> float:
    """The temperature ``trace`` ran at (its config's; the knob's neutral value where the config
    leaves it out or holds something else), within the knob's range."""
    knob = KNOBS["temperature"]
    value = trace.config.get("temperature", knob.neutral)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return knob.neutral
    return min(max(float(value), knob.low), knob.high)


def context_html(trace: Trace, index: int, hidden: bool, lesson_step: int | None = None) -> str:
    """The text up to step ``index`` and its token: a box with "?" while the guess is on; the label
    names ``lesson_step``, the step the lesson's chart shows (None: none), so the presenter can step to it."""
    before = html.escape("".join(s.chosen_token for s in trace.steps[:index]))
    step = trace.steps[index]
    token = "?" if hidden else html.escape(charts.readable(step.chosen_token))
    prob = "" if hidden else f' <small>p = {percent(step.chosen_prob)}</small>'
    label = "Guess the next token, then press Reveal." if hidden else f"Step {index} of {len(trace.steps) - 1}"
    if lesson_step is not None and not hidden:
        label += " · the lesson's step" if lesson_step == index else f" · the lesson's step is {lesson_step}"
    return (f'<div class="dp-present-text"><span>{before}</span><mark class="dp-present-token">{token}</mark>{prob}'
            f'<p class="dp-present-label" data-step="{index}" data-hidden="{int(hidden)}">{label}</p></div>')


def failure_advice(message: str, stopped: bool = False) -> str:
    """What a presenter can do about a lesson run that ended with ``message`` (the one line the
    page shows; ``stopped``: Stop or the time limit). A lesson's runs are fixed, so the time limit's
    usual "ask for fewer tokens" is no advice here."""
    if stopped and "time limit" in message:
        return ("Run the lesson again: the room's runs share this machine, and a second run often finishes in "
                "time; the operator can raise the limit (DP_REQUEST_SECONDS).")
    if stopped:
        return "Run the lesson again to see it whole."
    if message.startswith("lesson failed: "):  # a fault of ours (events.error_message), not the lesson's
        return "Run the lesson again; if it fails again, pick another lesson (Exit or Esc leaves the presenter view)."
    return ("The lesson cannot run as written: fix what the line names in the lesson's JSON, or pick another "
            "lesson, then run it again (Exit or Esc leaves the presenter view).")


def lesson_line(message: str) -> str:
    """``message`` without the time limit's advice, which a lesson cannot follow (``failure_advice``)."""
    return message.removesuffix(f"; {TIME_LIMIT_ADVICE}")


def failure_html(message: str, stopped: bool = False) -> str:
    """The overlay's text after a failed or stopped lesson run: the one line and what to do."""
    line = html.escape(lesson_line(message))
    said = f'<div class="dp-status">{line}</div>' if stopped else f'<div class="dp-error" role="alert">⚠ {line}</div>'
    return (f'<div class="dp-present-text dp-present-failed">{said}'
            f'<p class="dp-present-label">{html.escape(failure_advice(message, stopped))}</p></div>')


def qr_block(base_url: str, query: str) -> str:
    """The QR code of ``base_url`` + ``query`` (the lesson's link with the presenter flag), or why not."""
    if not base_url:
        return ""
    try:
        return qr.qr_html(f"{base_url}?{query}", size_px=280)
    except ValueError as exc:
        return f'<p class="dp-status">{html.escape(str(exc))}</p>'


@dataclass
class PresenterPanel:
    """The presenter overlay: context text and QR code, Exit / Run / Previous / Next / guess /
    Reveal, the big chart. Hidden: ``width``, the page width the page's script writes, and
    ``redraw``, which the script presses when the chart was laid out for another width."""

    column: gr.Column
    text: gr.HTML
    chart: gr.Plot
    prev: gr.Button
    next: gr.Button
    guess: gr.Checkbox
    reveal: gr.Button
    qr: gr.HTML
    index: gr.State
    width: gr.Number
    exit: gr.Button
    run: gr.Button
    redraw: gr.Button
    temperature: gr.Slider  # the what-if: this step at another temperature (page_js.PRESENTER_JS)
    key: gr.Textbox  # hidden: the lesson session's what-if key

    @classmethod
    def build(cls) -> "PresenterPanel":
        with gr.Column(visible=False, elem_id=ids.PRESENTER, elem_classes=["dp-presenter"]) as column:
            with gr.Row(elem_id="present-top"):
                text = gr.HTML(elem_id=ids.PRESENT_TEXT)
                code = gr.HTML(elem_id=ids.PRESENT_QR)
            with gr.Row(elem_id="present-controls"):
                exit_btn = gr.Button("✕ Exit", elem_id=ids.PRESENT_EXIT, min_width=80, size="sm")
                run = gr.Button("Run the lesson", elem_id=ids.PRESENT_RUN, min_width=110, size="sm")
                prev = gr.Button("◀ Previous token", elem_id=ids.PRESENT_PREV, min_width=120)
                nxt = gr.Button("Next token ▶", variant="primary", elem_id=ids.PRESENT_NEXT, min_width=120)
                guess = gr.Checkbox(False, label="Guess the next token (hide it)", elem_id="present-guess", min_width=160)
                reveal = gr.Button("Reveal", elem_id="present-reveal", min_width=100)
                temperature = temperature_slider()
            chart = gr.Plot(show_label=False, elem_id=ids.PRESENT_CHART)
            width = gr.Number(None, show_label=False, elem_id=ids.PRESENT_WIDTH, elem_classes=["dp-hidden"])
            redraw = gr.Button("redraw", elem_id=ids.PRESENT_REDRAW, elem_classes=["dp-hidden"])
            key = gr.Textbox("", show_label=False, container=False, elem_id="present-key", elem_classes=["dp-hidden"])
        return cls(column, text, chart, prev, nxt, guess, reveal, code, gr.State(0), width, exit_btn, run, redraw,
                   temperature, key)

    def show(self, trace: Trace | None, index: int, hidden: bool, width: float | None = None,
             lesson_step: int | None = None) -> dict:
        """Updates drawing step ``index`` of ``trace`` for a page ``width`` px wide (None: wide);
        the chart stays empty while the guess is on; ``lesson_step``: see ``context_html``."""
        if trace is None or not trace.steps:
            return {self.text: '<p class="dp-status">Run a lesson first (Run the lesson): its steps appear '
                               'here one at a time.</p>', self.chart: None, self.index: 0}
        index = max(0, min(int(index), len(trace.steps) - 1))
        return {self.text: context_html(trace, index, hidden, lesson_step), self.index: index,
                self.temperature: run_temperature(trace),
                self.chart: None if hidden else revised(presenter_chart(trace, index, width))}

    def failed(self, message: str, stopped: bool = False) -> dict:
        """Updates showing a failed or stopped lesson run in the overlay (``failure_html``), which
        would otherwise stand blank over the page's own status line; no step is shown (index None)."""
        return {self.text: failure_html(message, stopped), self.chart: None, self.index: None}

    def wire(self, trace_of: Any, state: gr.State, model: Any, quantization: Any, step_of: Any = None) -> None:
        """``trace_of(state)``: the trace the presenter steps through (the lesson's shown run);
        ``step_of(state)``: the lesson's step in it (None: not said); ``model``, ``quantization``:
        the header's pickers (the what-if uses the loaded model)."""
        local: dict[str, Any] = {"api_visibility": "private", "queue": False}
        outputs = [self.text, self.chart, self.index, self.temperature]

        def move(by: int):
            def handler(session: Any, index: int | None, hidden: bool, width: float | None) -> dict:
                marked = step_of(session) if step_of is not None else None
                return self.show(trace_of(session), (index or 0) + by, hidden, width or None, marked)
            return handler

        def relaid(session: Any, index: int | None, hidden: bool, width: float | None) -> dict:
            """The shown step for the new width; a failure's line (index None: ``failed``) stays."""
            return {self.chart: gr.skip()} if index is None else move(0)(session, index, hidden, width)

        inputs = [state, self.index, self.guess, self.width]
        self.prev.click(move(-1), inputs, outputs, **local)
        self.next.click(move(+1), inputs, outputs, **local)
        self.guess.change(move(0), inputs, outputs, **local)
        gr.on([self.width.change, self.redraw.click], relaid, inputs, outputs, **local)  # page resized / relaid out
        self.reveal.click(move(0), [state, self.index, gr.State(False), self.width], outputs, **local)
        self.temperature.input(None, [self.key, model, quantization, self.width, self.temperature], None,
                               js=PRESENTER_JS, trigger_mode="always_last", show_progress="hidden", **local)
        self.chart.change(None, [self.key, model, quantization], None, js=PRESENTER_PREPARE_JS,
                          trigger_mode="always_last", show_progress="hidden", **local)
        self.exit.click(None, js=EXIT_JS, **local)
        self.run.click(None, js=RUN_JS, **local)
