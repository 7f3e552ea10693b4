"""Inside the model (issue #54): what no other playground shows on the same trace.

Generate a run under the knob panel (its chain may hold the watermark stage), then: the entropy and
varentropy of every step with the hesitation steps marked; the logit lens at any step (every
layer's read-out, from one forward of that step's prefix); every token's rank under the model
(GLTR), the run's text and a person's side by side; the green-list watermark's detector on the run
or any pasted text, and what washes the watermark out; the model's calibration on the held-out
text. Every sentence beside a chart is the report's own ``sentence()``, read from the numbers the
chart draws.

Per-user state is the last run's Trace in a gr.State. API: ``/logit_lens``, ``/token_ranks``,
``/watermark_detect``, ``/watermark_robustness``, ``/calibration_report`` (the model), and
``/hesitation_steps`` (a trace's own numbers, no model).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import gradio as gr

from engine.config import ConfigError, DecodingConfig, check_flag, check_text
from engine.control import RunControl
from engine.backends.quant_methods import HELDOUT
from engine.reports import calibration, lens, ranks, uncertainty
from engine.reports import watermark as wm
from engine.reports.lessons import Lesson
from engine.trace import Trace, to_dict, untrusted_trace
from playground.charts import inside as charts
from playground.charts import step as step_charts

from .. import ids
from ..assets import static_text
from ..events import data_api, stop_button
from ..knobs import STAGE_KNOBS, KnobPanel
from ..shared import SESSION_TTL_S, OutputSet, PanelView, Shared, UserError, error_html, page_width, parent_trace
from ..shared import status_html
from ..stale import cleared

NAME = "inside"
RUN_KNOBS = ("seed", "max_new_tokens", "top_n")
STRATEGIES = ("greedy", "sample")
DEFAULT_PROMPT = "Write two sentences about the history of salt."
DEFAULT_PRESET = "balanced"
GENERATE_ID, STOP_ID = "inside-generate", "inside-stop"
MAX_TEXT_CHARS = 8_000
HUMAN_TEXT = " ".join(HELDOUT.read_text(encoding="utf-8").split()[:80])  # a person's paragraph (the held-out text)
COLOUR_BY = ("rank (GLTR)", "watermark")
LENS_TOP = 5  # the lens chart's columns: five tokens a layer stay legible on a phone
COLOUR_MAP = {**charts.RANK_COLOURS, **charts.WATERMARK_COLOURS}
PICK_JS = static_text("inside_pick_step.js")  # a click on a step of the entropy chart opens its stage chart


# --- the API -----------------------------------------------------------------------------------------
def _text(key: str, value: Any, allow_empty: bool = False) -> str:
    try:
        return check_text(key, value, max_len=MAX_TEXT_CHARS, allow_empty=allow_empty)
    except ConfigError as exc:
        raise UserError(str(exc)) from None


def with_sentence(report: Any) -> dict:
    """A report's JSON with the sentence the view shows beside its chart."""
    return to_dict(report) | {"sentence": report.sentence()}


def logit_lens_api(shared: Shared, trace: dict | str, step: int, top_k: int = 10, model: str = "embedded",
                   quantization: str = "none", *, control: RunControl) -> dict:
    """Every layer's read-out at step ``step`` of ``trace`` (a greedy or sampling trace JSON): the
    final norm and LM head on each layer's residual stream, from one forward of that step's prefix."""
    lm = shared.lm(model, quantization)
    lens.require_lens(lm)
    return with_sentence(lens.trace_lens(lm, parent_trace(shared, lm, trace, "trace"), step, top_k, control=control))


def token_ranks_api(shared: Shared, text: str, context: str = "", chat: bool = False, model: str = "embedded",
                    quantization: str = "none", *, control: RunControl) -> dict:
    """Each token of ``text`` ranked under the model after ``context`` (its prompt; with ``chat``,
    in the chat template), teacher-forced in one forward: rank, p and GLTR bucket, and the histogram."""
    lm = shared.lm(model, quantization)
    text = _text("text", text)
    context = _text("context", context, allow_empty=True)
    context_ids = shared.encode_prompt(lm, context, chat) if context.strip() else []
    return with_sentence(ranks.rank_ids(lm, context_ids, lm.encode(text), control=control))


def watermark_detect_api(shared: Shared, text: str, watermark_gamma: float = 0.25, watermark_seeding: str = "lefthash",
                         watermark_key: int = 15485863, watermark_context: int = 1, z_threshold: float = 4.0,
                         ignore_repeated: bool = False, model: str = "embedded", quantization: str = "none", *,
                         control: RunControl) -> dict:
    """Each token of ``text`` (encoded with the model's tokenizer, no special tokens) green or red
    under the key, γ, seeding and context, the z-score and p-value over the text, and the tokens
    needed at its green rate to pass ``z_threshold``."""
    lm = shared.lm(model, quantization)
    key = wm.WatermarkKey(watermark_gamma, watermark_seeding, watermark_key, watermark_context)
    check_flag("ignore_repeated", ignore_repeated)
    ids = lm.encode(_text("text", text))
    return with_sentence(wm.detect(ids, lm.vocab_size, key, z_threshold, ignore_repeated, lm.token_text, control))


def watermark_robustness_api(shared: Shared, prompt: str, config: dict | None = None, preset: str = "",
                             chat: bool = False, edited_text: str = "", z_threshold: float = 4.0,
                             model: str = "embedded", quantization: str = "none", *, control: RunControl) -> dict:
    """Run the prompt with the watermark on (``config``'s ``watermark_delta`` > 0) and the variants
    that may wash it out (no watermark, temperatures, top-k before / after it, tokens replaced,
    ``edited_text``), each detected with the run's key; and the spike-entropy split of its steps."""
    cfg = shared.api_config(preset, config, default_strategy="sample", strategies=STRATEGIES)
    lm = shared.lm(model, quantization)
    prompt_ids = shared.encode_prompt(lm, prompt, chat)
    edited = _text("edited_text", edited_text, allow_empty=True)
    report = wm.robustness(lm, prompt_ids, cfg, _runner(shared, lm, prompt, prompt_ids, chat, control),
                           edited_text=edited or None, threshold=z_threshold, control=control)
    return with_sentence(report)


def _runner(shared: Shared, lm: Any, prompt: str, prompt_ids: list[int], chat: bool, control: RunControl):
    return lambda cfg: shared.run(lm, prompt, cfg, chat=chat, prompt_ids=prompt_ids, control=control)


def calibration_report_api(shared: Shared, bins: int = 10, model: str = "embedded", quantization: str = "none", *,
                           control: RunControl) -> dict:
    """The model's calibration on the held-out text: reliability bins, ECE and NLL at T = 1, at the
    temperature minimising the held-out NLL, and over a sweep of temperatures."""
    lm = shared.lm(model, quantization)
    return with_sentence(calibration.calibration_report(lm, bins=bins, control=control))


def hesitation_steps(trace: dict | str, entropy_threshold: float = uncertainty.HESITATION_ENTROPY,
                     varentropy_threshold: float = uncertainty.HESITATION_VARENTROPY, raw: bool = True) -> dict:
    """A trace's entropy and varentropy per step (``raw``: the model's own distribution, else the
    final one) and its hesitation steps (both above their thresholds); no model runs."""
    check_flag("raw", raw)
    return with_sentence(uncertainty.uncertainty_series(untrusted_trace(trace).steps, raw, entropy_threshold,
                                                        varentropy_threshold))


# --- the view ----------------------------------------------------------------------------------------
@dataclass
class InsideView(PanelView):
    """The view's handle (share links restore its prompt, chat and knobs); a lesson opens here and
    presses Generate. ``handlers``: its event handlers (the tests call them as the page does)."""

    handlers: Any = None

    def lesson_updates(self, lesson: Lesson, stored: Any, allowed: Sequence[str] | None) -> tuple[dict, str]:
        updates, _ = super().lesson_updates(lesson, stored, allowed)
        return updates, GENERATE_ID


@dataclass
class Outputs(OutputSet):
    status: Any
    text: Any
    legend: Any
    text_note: Any
    over_run: Any
    over_run_note: Any
    hesitations: Any
    lens_step: Any
    pick: Any
    stage_chart: Any
    stage_note: Any
    state: Any


def build_tab(shared: Shared) -> InsideView:
    gr.Markdown("Look inside the model on one run: how unsure it was at each step, where its answer forms layer by "
                "layer, how expected each token was, whether a watermark is in the text, and whether its confidence "
                "is honest.")
    with gr.Row(equal_height=False):
        with gr.Column(scale=1, min_width=330):
            prompt = gr.Textbox(DEFAULT_PROMPT, lines=3, label="Prompt", elem_id="inside-prompt")
            with gr.Row():
                generate = gr.Button("Generate", variant="primary", elem_id=GENERATE_ID)
                stop = gr.Button("Stop", variant="stop", elem_id=STOP_ID)
            status = gr.HTML("", elem_id="inside-status")
            chat = gr.Checkbox(True, label="Chat template", elem_id="inside-chat")
            panel = KnobPanel(shared, RUN_KNOBS + STAGE_KNOBS, list(STRATEGIES), preset=DEFAULT_PRESET, prefix="inside-")
        with gr.Column(scale=2, min_width=330):
            colour_by = gr.Radio(list(COLOUR_BY), value=COLOUR_BY[0], label="Colour the text by", elem_id="inside-colour")
            text = gr.HighlightedText(label="Generated text", combine_adjacent=False, show_legend=False,
                                      show_inline_category=False, color_map=COLOUR_MAP, interactive=False,
                                      elem_id="inside-text")
            legend = gr.HTML(charts.legend_html(charts.RANK_COLOURS, "rank of each token under the model"),
                             elem_id="inside-legend")
            text_note = gr.Markdown(elem_id="inside-text-note")
            over_run = gr.Plot(label="Entropy and varentropy over the run: click a step (a star: it hesitates) for "
                               "its stages", elem_id=ids.INSIDE_OVER_RUN)
            over_run_note = gr.Markdown(elem_id="inside-over-run-note")
            hesitations = gr.Dropdown([], label="Hesitation steps: pick one for its stages and its layers",
                                      elem_id="inside-hesitations")
            picked = Picked.build()
            lens_step = gr.Slider(0, 1, value=0, step=1, label="Step for the logit lens", elem_id="inside-lens-step")
            sections = Sections.build()  # right under the run, beside the knobs (a phone: after them)
    out = Outputs(status, text, legend, text_note, over_run, over_run_note, hesitations, lens_step, picked.pick,
                  picked.chart, picked.note, gr.State(None, time_to_live=SESSION_TTL_S))
    panel.wire()
    view = InsideView(NAME, prompt, panel, chat)
    view.handlers = Handlers(shared, view, out, sections, colour_by)
    runs = wire(view.handlers, generate)
    picked.wire(out)
    stop_button(stop, status, runs, status_html("stopped"))
    register_api(shared)
    return view


@dataclass
class Picked:
    """The picked step's stage chart (issue #54's point 5): a click on a step of the entropy chart
    (the page's script writes it into the hidden ``pick`` box) or a pick in the hesitation steps."""

    pick: Any
    width: Any
    chart: Any
    note: Any

    @classmethod
    def build(cls) -> "Picked":
        pick = gr.Number(None, show_label=False, elem_id=ids.INSIDE_PICK, elem_classes=["dp-hidden"])
        width = gr.Number(None, show_label=False, elem_id=ids.INSIDE_WIDTH, elem_classes=["dp-hidden"])
        note = gr.Markdown(elem_id="inside-stage-note")
        chart = gr.Plot(label="The picked step's stages", elem_id="inside-stage-chart")
        return cls(pick, width, chart, note)

    def wire(self, out: "Outputs") -> None:
        local: dict[str, Any] = {"api_visibility": "private", "queue": False}
        shown = [out.stage_chart, out.stage_note, out.lens_step]
        draw = functools.partial(picked_step, out)
        self.pick.change(draw, [out.state, self.pick, self.width], shown, **local)
        out.hesitations.input(draw, [out.state, out.hesitations, self.width], shown, **local)
        out.over_run.change(None, js=PICK_JS, **local)


def picked_step(out: "Outputs", run: "Run | None", step: Any, width: Any) -> dict:
    """Step ``step`` of the run: its stage chart laid out for the page ``width``, what its stages
    did, and the logit lens's step set to it (no update for no step or one the run lacks)."""
    if run is None or isinstance(step, bool) or step not in range(len(run.trace.steps)):  # (1.0 is step 1; nan none)
        return {out.stage_chart: gr.skip()}
    at, steps = int(step), run.trace.steps
    source = step_charts.source_of(run.trace, at)
    return {out.stage_chart: step_charts.fitted_stage_chart(steps[at], page_width(width), source),
            out.stage_note: f"**Step {at}** ({step_charts.readable(steps[at].chosen_token)}): "
                         + step_charts.explain_step(steps[at], source=source),
            out.lens_step: at}


@dataclass
class Sections:
    """The four sections under the run: the logit lens, ranks, the watermark, calibration."""

    lens_run: Any
    lens_chart: Any
    lens_note: Any
    human: Any
    rank_run: Any
    human_text: Any
    rank_chart: Any
    rank_note: Any
    check_text: Any
    threshold: Any
    detect_run: Any
    washout_run: Any
    detect_chart: Any
    detect_note: Any
    washout_table: Any
    washout_note: Any
    bins: Any
    calibration_run: Any
    calibration_chart: Any
    calibration_note: Any

    @classmethod
    def build(cls) -> "Sections":
        gr.Markdown("### Logit lens: where does the answer form?\nThe model's final norm and LM head read every "
                    "layer's residual stream at the chosen step (one forward of its prefix).", elem_id="inside-lens-intro")
        lens_run = gr.Button("Read every layer", elem_id="inside-lens-run")
        lens_note = gr.Markdown(elem_id="inside-lens-note")
        lens_chart = gr.Plot(label="Logit lens", elem_id="inside-lens-chart")
        gr.Markdown("### Every token's rank (GLTR)\nThe run's text and a person's, each read teacher-forced in one "
                    "forward: machine text lives in the top 10.", elem_id="inside-rank-intro")
        human = gr.Textbox(HUMAN_TEXT, lines=4, label="A person's text (or any text)", elem_id="inside-human")
        rank_run = gr.Button("Rank both texts", elem_id="inside-rank-run")
        human_text = gr.HighlightedText(label="The person's text by rank", combine_adjacent=False, show_legend=False,
                                        show_inline_category=False, color_map=charts.RANK_COLOURS, interactive=False,
                                        elem_id="inside-human-text")
        rank_note = gr.Markdown(elem_id="inside-rank-note")
        rank_chart = gr.Plot(label="Ranks: the run against the person", elem_id="inside-rank-chart")
        gr.Markdown("### Watermark detector\nGreen or red per token under the knob panel's watermark key (γ, seeding, "
                    "key, context); empty text: the run's.", elem_id="inside-watermark-intro")
        check = gr.Textbox("", lines=3, label="Text to check (edit the run's text to try to wash the mark out)",
                           elem_id="inside-check-text")
        threshold = gr.Number(wm.DEFAULT_THRESHOLD, label="z threshold", elem_id="inside-threshold")
        with gr.Row():
            detect_run = gr.Button("Detect", elem_id="inside-detect-run")
            washout_run = gr.Button("What washes it out?", elem_id="inside-washout-run")
        detect_note = gr.Markdown(elem_id="inside-detect-note")
        detect_chart = gr.Plot(label="z-score as the text goes on", elem_id="inside-detect-chart")
        washout_note = gr.Markdown(elem_id="inside-washout-note")
        washout_table = gr.Dataframe(headers=charts.ROBUST_HEADERS, value=[], interactive=False, wrap=True,
                                     label="What washes it out", elem_id="inside-washout-table")
        gr.Markdown("### Is the confidence honest? Calibration\nThe model reads the held-out text; the top token's "
                    "probability against how often it is right.", elem_id="inside-calibration-intro")
        bins = gr.Slider(2, calibration.MAX_BINS, value=calibration.DEFAULT_BINS, step=1, label="bins",
                         elem_id="inside-bins")
        calibration_run = gr.Button("Measure calibration", elem_id="inside-calibration-run")
        calibration_note = gr.Markdown(elem_id="inside-calibration-note")
        calibration_chart = gr.Plot(label="Reliability diagram", elem_id="inside-calibration-chart")
        return cls(lens_run, lens_chart, lens_note, human, rank_run, human_text, rank_chart, rank_note, check, threshold,
                   detect_run, washout_run, detect_chart, detect_note, washout_table, washout_note, bins,
                   calibration_run, calibration_chart, calibration_note)


def register_api(shared: Shared) -> None:
    events = shared.events
    events.api(functools.partial(logit_lens_api, shared), "logit_lens", what="logit lens")
    events.api(functools.partial(token_ranks_api, shared), "token_ranks", what="token ranks")
    events.api(functools.partial(watermark_detect_api, shared), "watermark_detect", what="watermark detection")
    events.api(functools.partial(watermark_robustness_api, shared), "watermark_robustness", what="measurement")
    events.api(functools.partial(calibration_report_api, shared), "calibration_report", what="measurement")
    data_api(hesitation_steps, "hesitation_steps", what="hesitation steps")


# --- the handlers ------------------------------------------------------------------------------------
@dataclass
class Run:
    """The session's last run and what was read of it (for recolouring without the model)."""

    trace: Trace
    config: DecodingConfig
    ranks: ranks.TokenRanks | None = None
    detection: wm.Detection | None = None


def text_updates(out: Outputs, run: Run | None, colour_by: str) -> dict:
    """The run's text coloured by rank or by watermark, its legend and its sentence."""
    if run is None:
        return {out.text: [], out.text_note: ""}
    if colour_by == COLOUR_BY[1] and run.detection is not None:
        return {out.text: charts.watermark_highlights(run.detection), out.text_note: run.detection.sentence(),
                out.legend: charts.legend_html(charts.WATERMARK_COLOURS, "the watermark's lists at each token")}
    if run.ranks is None:
        return {out.text: [], out.text_note: "Ranks need the model's every logit (not a served model's top-N)."}
    return {out.text: charts.rank_highlights(run.ranks), out.text_note: run.ranks.sentence(),
            out.legend: charts.legend_html(charts.RANK_COLOURS, "rank of each token under the model")}


@dataclass
class Handlers:
    """The view's event handlers; ``wire`` registers them."""

    shared: Shared
    view: InsideView
    out: Outputs
    sections: Sections
    colour_by: gr.Radio

    def on_generate(self, prompt: str, chat: bool, model: str, quant: str, colour_by: str, *values: Any,
                    control: RunControl) -> Iterator[dict]:
        """Run the prompt, then rank its tokens and detect its watermark (with the run's own key)."""
        out = self.out
        config, lm, prompt_ids = self.shared.prepare(self.view.panel, values, model, quant, prompt, chat)
        yield {out.status: status_html("generating…"), out.text: [], out.text_note: "", out.over_run: None,
               out.over_run_note: "", out.pick: None, out.stage_chart: None, out.stage_note: "",
               out.state: None}
        trace = self.shared.run(lm, prompt, config, chat=chat, prompt_ids=prompt_ids, control=control)
        yield {out.status: status_html("ranking the tokens…")}
        run = Run(trace, config)
        if lm.capabilities.full_logits and trace.generated_token_ids:
            run.ranks = ranks.rank_ids(lm, trace.prompt_token_ids, trace.generated_token_ids[:ranks.MAX_RANK_TOKENS],
                                       control=control)
        run.detection = wm.detect(trace.generated_token_ids, lm.vocab_size, wm.WatermarkKey.of(config),
                                  token_text=lm.token_text, control=control)
        series = uncertainty.uncertainty_series(trace.steps)
        last = max(0, len(trace.steps) - 1)
        start = series.hesitations[0] if series.hesitations else last
        yield text_updates(out, run, colour_by) | {
            out.status: status_html(f"done: {len(trace.steps)} tokens, stopped by {trace.stop_reason}."),
            out.over_run: charts.uncertainty_figure(series, start), out.over_run_note: series.sentence(),
            out.hesitations: gr.update(choices=[(f"step {s.index}: {s.token!r}", s.index) for s in series.steps
                                                if s.hesitant], value=None),
            out.lens_step: gr.update(maximum=max(1, last), value=start), out.state: run}

    def on_lens(self, run: Run | None, step: Any, model: str, quant: str, *, control: RunControl) -> Iterator[dict]:
        s = self.sections
        trace = _trace_of(run)
        lm = self.shared.lm(model, quant)
        lens.require_lens(lm)
        at = int(step) if isinstance(step, (int, float)) and not isinstance(step, bool) else step
        yield {self.out.status: status_html(f"reading every layer at step {at}…")}
        found = lens.trace_lens(lm, trace, at, LENS_TOP, control=control)
        yield {s.lens_chart: charts.lens_figure(found), s.lens_note: found.sentence(),
               self.out.status: status_html(f"logit lens: step {at}")}

    def on_ranks(self, run: Run | None, human: str, model: str, quant: str, *, control: RunControl) -> Iterator[dict]:
        s = self.sections
        lm = self.shared.lm(model, quant)
        ids = lm.encode(_text("text", human))
        yield {self.out.status: status_html("ranking…")}
        person = ranks.rank_ids(lm, [], ids, control=control)
        shown = [("the person's text", person)]
        if run is not None and run.ranks is not None:
            shown.insert(0, ("the run's text", run.ranks))
        note = " ".join(f"**{label}**: {r.sentence()}" for label, r in shown)
        yield {s.human_text: charts.rank_highlights(person), s.rank_chart: charts.rank_histogram(shown),
               s.rank_note: note, self.out.status: status_html("ranked")}

    def on_detect(self, run: Run | None, text: str, threshold: Any, model: str, quant: str, *values: Any,
                  control: RunControl) -> Iterator[dict]:
        s = self.sections
        lm = self.shared.lm(model, quant)
        key = wm.WatermarkKey.of(self.view.panel.config(*values))
        text = _text("text", text, allow_empty=True)
        ids = lm.encode(text) if text.strip() else _trace_of(run).generated_token_ids
        found = wm.detect(ids, lm.vocab_size, key, threshold, token_text=lm.token_text, control=control)
        yield {s.detect_chart: charts.detection_figure(found), s.detect_note: found.sentence(),
               self.out.status: status_html("detected")}

    def on_washout(self, run: Run | None, text: str, threshold: Any, model: str, quant: str, *,
                   control: RunControl) -> Iterator[dict]:
        s = self.sections
        run = _run_of(run)
        trace = run.trace
        lm = self.shared.lm(model, quant)
        edited = _text("text", text, allow_empty=True)
        yield {self.out.status: status_html("running the variants (about seven runs)…")}
        report = wm.robustness(lm, trace.prompt_token_ids, run.config,
                               _runner(self.shared, lm, trace.prompt, trace.prompt_token_ids, trace.chat, control),
                               edited_text=edited if edited.strip() else None, threshold=threshold, control=control)
        yield {s.washout_table: charts.robustness_rows(report), s.washout_note: report.sentence(),
               self.out.status: status_html("measured")}

    def on_calibration(self, bins: Any, model: str, quant: str, *, control: RunControl) -> Iterator[dict]:
        """The header's model on the held-out text; a quantized pick is measured beside fp32 (both
        loaded first: a 4-bit checkpoint not made yet is its one line before any forward)."""
        s = self.sections
        bins = int(bins) if isinstance(bins, float) and bins.is_integer() else bins
        picks = ["none", quant] if quant not in (None, "", "none") else ["none"]
        lms = [(pick, self.shared.lm(model, pick)) for pick in picks]
        reports = []
        for pick, lm in lms:
            yield {self.out.status: status_html(f"reading the held-out text ({pick})…")}
            reports.append(calibration.calibration_report(lm, bins=bins, control=control))
        note = " ".join(f"**{r.quantization if r.quantization != 'none' else 'fp32'}**: {r.sentence()}" for r in reports)
        yield {s.calibration_chart: charts.reliability_figure(reports[-1], reports[:-1]), s.calibration_note: note,
               self.out.status: status_html("measured")}


def _run_of(run: Run | None) -> Run:
    """The page's run (UserError before one was generated)."""
    if run is None or not run.trace.steps:
        raise UserError("generate a run first")
    return run


def _trace_of(run: Run | None) -> Trace:
    return _run_of(run).trace


def wire(handlers: Handlers, generate: gr.Button) -> list:
    """Register every model event; returns them (for Stop)."""
    h, out, s, shared = handlers, handlers.out, handlers.sections, handlers.shared
    panel, on = handlers.view.panel, shared.events.on
    models = [shared.model, shared.quantization]

    def failed(message: str) -> dict:
        return {out.status: error_html(message)}

    events = [
        on([generate.click, handlers.view.prompt.submit], h.on_generate,
           [handlers.view.prompt, handlers.view.chat, *models, handlers.colour_by, *panel.inputs],
           out.all(), on_error=cleared(out.status, out.all(), keep=[out.legend])),
        on([s.lens_run.click], h.on_lens, [out.state, out.lens_step, *models], [s.lens_chart, s.lens_note, out.status],
           on_error=failed, what="logit lens"),
        on([s.rank_run.click], h.on_ranks, [out.state, s.human, *models],
           [s.human_text, s.rank_chart, s.rank_note, out.status], on_error=failed, what="token ranks"),
        on([s.detect_run.click], h.on_detect, [out.state, s.check_text, s.threshold, *models, *panel.inputs],
           [s.detect_chart, s.detect_note, out.status], on_error=failed, what="watermark detection"),
        on([s.washout_run.click], h.on_washout, [out.state, s.check_text, s.threshold, *models],
           [s.washout_table, s.washout_note, out.status], on_error=failed, what="measurement"),
        on([s.calibration_run.click], h.on_calibration, [s.bins, *models],
           [s.calibration_chart, s.calibration_note, out.status], on_error=failed, what="measurement"),
    ]
    local: dict[str, Any] = {"api_visibility": "private", "queue": False}
    handlers.colour_by.change(lambda run, colour: text_updates(out, run, colour), [out.state, handlers.colour_by],
                              [out.text, out.text_note, out.legend], **local)
    return events
