"""Quantization & KV cache: switch between fp32, int8 and nf4 loading (bitsandbytes) and the 4-bit
RTN / GPTQ / AWQ checkpoints made here (engine.backends.quant_methods) and see what changes (memory, load
time, speed, how far each next-token distribution drifts from fp32, where the text first differs,
held-out perplexity); compare the 4-bit methods on held-out text and look inside one layer; and
measure what the KV cache buys (speed, and its size against the formula).

Drift uses the header's model with the variants ticked here; the KV cache section uses the
header's model and quantization. No per-user state is kept beyond the outputs themselves.
"""

from __future__ import annotations

import functools
import html
from dataclasses import dataclass
from typing import Any, ClassVar, Iterator, Sequence

import gradio as gr

from engine.reports import drift, kv_arith, quant_report
from engine.config import KNOBS
from engine.control import RunControl
from engine.backends.local import BNB_QUANTIZATIONS, QUANTIZATIONS
from engine.reports.lessons import Lesson
from engine.trace import to_dict
from playground.charts import memory as memory_charts
from playground.charts import quant_methods as method_charts
from playground.charts import quantization as charts
from playground.charts.tables import column_widths

from .. import downloads, ids
from ..events import data_api, stop_button
from ..shared import OutputSet, Shared, UserError, error_html, require, status_html
from ..stale import cleared

DEFAULT_PROMPT = "Explain in two sentences why the sky is blue."
DRIFT_TOKENS = (1, 128, 20)  # slider minimum, maximum, default
KV_TOKENS = (2, 256, 48)
KIND_TOKENS = (2, drift.MAX_KV_DRIFT_TOKENS, 40)
DEFAULT_KINDS = ("dynamic", "quantized-int8", "quantized-int4")
SLIDING = "sliding-<N>"  # the checkbox; N comes from the window input
DEFAULT_RESIDUAL = 8  # small, so a short run already shows the quantized part (the engine's default is 32)
CUSTOM = "custom"
RUNNING = "…"  # ends every in-progress status of this tab, and no finished one
KINDS_INTRO = ("### KV cache kinds\n\nThe header's model decodes the prompt with each kind of KV cache. "
               + drift.KV_DRIFT_METHOD)


def sized(headers: list[str], rows: list[list]) -> dict:
    """A table's update: its rows, and column widths that hold each one's longest word whole."""
    return gr.update(value=rows, column_widths=column_widths(headers, rows))


@dataclass
class DriftOutputs(OutputSet):
    status: Any
    table: Any
    kl: Any
    texts: Any
    download: Any


@dataclass
class KVOutputs(OutputSet):
    status: Any
    summary: Any
    chart: Any


def render_drift(out: DriftOutputs, report: drift.DriftReport, final: bool) -> dict:
    """Updates for a (possibly partial) report; the download once it is complete or stopped (then
    its JSON says so in ``stopped``)."""
    updates = {out.status: status_html(charts.drift_status(report)), out.table: sized(charts.DRIFT_HEADERS, charts.drift_rows(report)),
               out.kl: charts.kl_figure(report), out.texts: charts.texts_html(report)}
    if final:
        updates[out.download] = downloads.json_file("quantization-report.json", to_dict(report))
    return updates


@dataclass(frozen=True)
class Measure:
    """One measurement's inputs as the page holds them, before validation: the prompt box, chat, the
    section's token budget and the header's model and quantization."""

    prompt: Any
    chat: Any
    max_new_tokens: Any
    model: Any
    quantization: Any = "none"


def drift_updates(out: DriftOutputs, shared: Shared, measure: Measure, variants: list[str] | None,
                  control: RunControl) -> Iterator[dict]:
    """Validate, then stream the drift report as each variant finishes (against the fp32 model:
    ``measure.quantization`` is not read)."""
    prompt, chat = measure.prompt, measure.chat
    chosen = drift.normalise_variants(variants or [])
    reference = shared.lm(measure.model, "none")
    require(reference, "quantization")
    shared.encode_prompt(reference, prompt, chat)
    tokens = int(measure.max_new_tokens or DRIFT_TOKENS[2])
    drift.greedy_config(tokens)  # validates the token budget
    # the previous report goes at once: its table and charts must not pass for this run's
    yield {out.status: status_html("fp32 reference: greedy run…"), out.table: [], out.kl: None, out.texts: "",
           out.download: None}
    for report in drift.stream_drift(shared.registry, reference.source, prompt, chat, tokens, chosen, control=control):
        yield render_drift(out, report, final=not report.pending() or bool(report.stopped))


def kv_tokens(value: Any) -> int:
    """The KV report's token count, capped: its uncached pass costs time quadratic in the length."""
    low, high, default = KV_TOKENS
    tokens = default if value is None else value
    if not isinstance(tokens, (int, float)) or isinstance(tokens, bool) or not low <= tokens <= high:
        raise UserError(f"max_new_tokens: {value!r} is out of range for the KV cache report; allowed [{low}, {high}]")
    return int(tokens)


def kv_updates(out: KVOutputs, shared: Shared, measure: Measure, control: RunControl) -> Iterator[dict]:
    """Validate, then run the KV cache report (greedy with and without the cache)."""
    prompt, chat = measure.prompt, measure.chat
    lm = shared.lm(measure.model, measure.quantization)
    require(lm, "KV cache")
    shared.encode_prompt(lm, prompt, chat)
    tokens = kv_tokens(measure.max_new_tokens)
    yield {out.status: status_html(f"greedy with and without the cache, {tokens} tokens each…"), out.summary: "",
           out.chart: None}
    report = drift.kv_cache_report(lm, prompt, chat, tokens, control=control)
    done = f"{report.stopped} · partial report" if report.stopped else "done"
    yield {out.status: status_html(done), out.summary: charts.kv_summary_html(report), out.chart: charts.kv_figure(report)}


@dataclass
class QuantPage:
    """The tab's handle for lessons: "Open in its view" fills the prompt, chat and token budget of
    the drift or the KV cache section and names the section's own run button."""

    prompt: gr.Textbox
    chat: gr.Checkbox
    tokens: gr.Slider  # drift's max_new_tokens
    kv_tokens: gr.Slider  # the KV cache section's

    name: ClassVar[str] = "quantization"  # a LessonTarget (shared.LessonTarget)

    def components(self) -> list:
        return [self.prompt, self.chat, self.tokens, self.kv_tokens]

    def lesson_outputs(self) -> list:
        return self.components()

    def lesson_updates(self, lesson: Lesson, stored: Any = None,
                       allowed: Sequence[str] | None = None) -> tuple[dict, str]:
        """A lesson of this tab: its prompt, chat and budget (the check's, else the preset's) in the
        section it teaches (the KV cache one for a ``kv_cache_same`` check, the 4-bit methods' one for
        ``gptq_vs_awq``), and that section's button."""
        check = lesson.check or {}
        budget = check.get("max_new_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool):  # a pasted lesson's check may say anything
            budget = lesson.runs[0].config.max_new_tokens
        section = {"kv_cache_same": "kv", "gptq_vs_awq": "methods"}.get(check.get("kind") or "", "drift")
        return self.open_lesson(lesson.prompt, lesson.chat, budget, section)

    def open_lesson(self, prompt: str, chat: bool, max_new_tokens: int, section: str) -> tuple[dict, str]:
        """Updates for a lesson of this tab (``section``: drift | kv | methods) and the id of the
        button that runs it; the budget is clamped to that section's slider (the 4-bit methods'
        comparison reads the held-out text: no budget)."""
        kv = section == "kv"
        low, high, _ = KV_TOKENS if kv else DRIFT_TOKENS
        budget = min(max(int(max_new_tokens), low), high)
        updates = {self.prompt: prompt, self.chat: chat, (self.kv_tokens if kv else self.tokens): budget}
        return updates, {"kv": ids.KV_MEASURE, "methods": ids.METHODS_MEASURE}.get(section, ids.QUANT_MEASURE)


def build_tab(shared: Shared) -> QuantPage:
    gr.Markdown("Load the header's model as fp32, int8 and nf4 (bitsandbytes) or as a 4-bit RTN / GPTQ / AWQ checkpoint "
                "made here, and see what quantization changes. Each variant reads the fp32 model's greedy continuation in "
                "one forward; the chart shows how far its next-token distribution is from fp32's at every step (KL "
                "divergence).")
    with gr.Row(equal_height=False):
        with gr.Column(scale=1, min_width=330):
            prompt = gr.Textbox(DEFAULT_PROMPT, lines=4, label="Prompt", elem_id=ids.QUANT_PROMPT)
            chat = gr.Checkbox(True, label="Chat template", elem_id="quant-chat")
            low, high, default = DRIFT_TOKENS
            tokens = gr.Slider(low, high, value=default, step=1, label="max_new_tokens (greedy)",
                               elem_id="quant-tokens")
            variants = gr.CheckboxGroup(list(QUANTIZATIONS), value=list(BNB_QUANTIZATIONS), label="Variants",
                                        info="none = fp32, the reference; int8 and nf4 load through bitsandbytes; "
                                             "rtn/gptq/awq-g64/g32 are 4-bit checkpoints made here (make quantize), "
                                             "dequantized at load (no 4-bit CPU kernel).",
                                        elem_id="quant-variants")
            with gr.Row():
                measure = gr.Button("Measure drift", variant="primary", elem_id=ids.QUANT_MEASURE)
                stop = gr.Button("Stop", variant="stop", elem_id="quant-stop")
            status = gr.HTML("", elem_id="quant-status")
        with gr.Column(scale=2, min_width=480):
            table = gr.Dataframe(headers=charts.DRIFT_HEADERS, value=[], interactive=False, wrap=True,
                                 column_widths=column_widths(charts.DRIFT_HEADERS, []),
                                 label="Variants", elem_id="quant-table")
            gr.Markdown(f"<small>{charts.DRIFT_NOTE}</small>", elem_id="quant-drift-note")
            kl = gr.Plot(label="KL from fp32 per step", elem_id="quant-kl")
            texts = gr.HTML(elem_id="quant-texts")
            download = gr.DownloadButton("Download report JSON", elem_id="quant-download")
    out = DriftOutputs(status, table, kl, texts, download)
    kv = _kv_section()
    runs = _wire(shared, QuantInputs(prompt, chat, tokens, variants), measure, out, kv)
    runs.append(_kinds_section(shared, prompt, chat))
    runs.extend(_methods_section(shared))
    _stop_button(stop, runs)
    _calculator_section()
    return QuantPage(prompt, chat, tokens, kv["tokens"])


@dataclass
class QuantInputs:
    prompt: gr.Textbox
    chat: gr.Checkbox
    tokens: gr.Slider
    variants: gr.CheckboxGroup


def _kv_section() -> dict[str, Any]:
    gr.Markdown("### KV cache\nGreedy decoding of the header's model with the KV cache (one new position per forward) "
                "against recomputing the whole sequence at every step, and the cache's size.", elem_id=ids.KV_SECTION)
    with gr.Row(equal_height=False):
        with gr.Column(scale=1, min_width=330):
            low, high, default = KV_TOKENS
            tokens = gr.Slider(low, high, value=default, step=1, label="max_new_tokens", elem_id="kv-tokens")
            run = gr.Button("Measure KV cache", variant="primary", elem_id=ids.KV_MEASURE)
            status = gr.HTML("", elem_id="kv-status")
        with gr.Column(scale=2, min_width=480):
            summary = gr.HTML(elem_id="kv-summary")
            chart = gr.Plot(label="ms per token vs position", elem_id="kv-chart")
    return {"tokens": tokens, "run": run, "out": KVOutputs(status, summary, chart)}


def _wire(shared: Shared, inp: QuantInputs, measure: gr.Button, out: DriftOutputs,
          kv: dict[str, Any]) -> list[tuple[Any, Any]]:
    """Register the drift and KV cache runs and their API endpoints; returns (event, status) of each run."""
    kv_out: KVOutputs = kv["out"]

    def on_measure(prompt: str, chat: bool, max_new: Any, picked: list[str] | None, model: str, *,
                   control: RunControl) -> Iterator[dict]:
        yield from drift_updates(out, shared, Measure(prompt, chat, max_new, model), picked, control)

    def on_kv(prompt: str, chat: bool, max_new: Any, model: str, quant: str, *, control: RunControl) -> Iterator[dict]:
        yield from kv_updates(kv_out, shared, Measure(prompt, chat, max_new, model, quant), control)

    drift_event = shared.events.on([measure.click], on_measure, [inp.prompt, inp.chat, inp.tokens, inp.variants,
                                                                 shared.model], out.all(),
                                   on_error=cleared(out.status, out.all()), what="measurement")
    kv_event = shared.events.on([kv["run"].click], on_kv, [inp.prompt, inp.chat, kv["tokens"], shared.model,
                                                           shared.quantization], kv_out.all(),
                                on_error=cleared(kv_out.status, kv_out.all()), what="measurement")
    shared.events.api(functools.partial(quantization_report, shared), "quantization_report", what="measurement")
    shared.events.api(functools.partial(kv_cache_report, shared), "kv_cache_report", what="measurement")
    return [(drift_event, out.status), (kv_event, kv_out.status)]


def stopped_statuses(*shown: Any) -> list:
    """Stop's update of each section's status: "stopped" where a run was in progress (every
    in-progress status of this tab ends its sentence with RUNNING), the others left as they are (a
    finished report keeps its "done", an error its message)."""
    return [status_html("stopped") if isinstance(s, str) and RUNNING in s and "dp-error" not in s else gr.skip()
            for s in shown]


def _stop_button(button: gr.Button, runs: list[tuple[Any, Any]]) -> None:
    """The tab's one Stop: cancels every run of the tab (drift, KV cache, KV kinds; each stops within
    one forward and shows what it measured, marked partial) and says "stopped" at once in the status
    of each section that was running."""
    stop_button(button, [status for _, status in runs], [event for event, _ in runs], stopped_statuses)


def quantization_report(shared: Shared, prompt: str, chat: bool = False, max_new_tokens: int = 16,
                        variants: list[str] | None = None, model: str = "embedded", *, control: RunControl) -> dict:
    """Greedy fp32 reference, then per variant (none | int8 | nf4 by default; or any 4-bit
    checkpoint: rtn-g64 | gptq-g64 | awq-g64 | rtn-g32 | ... | gptq-g64-code | awq-g64-code): memory, load
    seconds, tokens/s, per-step KL / total variation / top-1 agreement against fp32 under teacher
    forcing, its own greedy text and first divergence step, held-out perplexity."""
    chosen = drift.normalise_variants(list(BNB_QUANTIZATIONS) if variants is None else variants)
    reference = shared.lm(model, "none")
    require(reference, "quantization")
    shared.encode_prompt(reference, prompt, chat)
    report = drift.quantization_report(shared.registry, reference.source, prompt, chat, max_new_tokens, chosen,
                                       control=control)
    return to_dict(report)


def kv_cache_report(shared: Shared, prompt: str, chat: bool = False, max_new_tokens: int = 32, model: str = "embedded",
                    quantization: str = "none", *, control: RunControl) -> dict:
    """Greedy with vs without the KV cache: tokens/s each, ms per step, cache bytes per token
    measured against 2 × layers × kv_heads × head_dim × bytes per element."""
    lm = shared.lm(model, quantization)
    require(lm, "KV cache")
    shared.encode_prompt(lm, prompt, chat)
    report = drift.kv_cache_report(lm, prompt, chat, kv_tokens(max_new_tokens), control=control)
    return to_dict(report)


# --- KV cache kinds: dynamic / quantized-int8 / quantized-int4 / sliding-<N> ------------------------
@dataclass
class KindOutputs(OutputSet):
    status: Any
    table: Any
    memory: Any
    per_token: Any
    drift: Any
    download: Any


def kind_names(picked: list[str] | None, window: Any) -> list[str]:
    """The ticked kinds, ``sliding-<N>`` filled in with the window (ValueError naming a bad one)."""
    names = []
    for kind in picked or []:
        if not isinstance(kind, str):
            raise UserError(f"kinds: expected names of KV cache kinds, got {str(kind)[:40]!r}")
        if kind == SLIDING:
            if isinstance(window, float) and window.is_integer():
                window = int(window)
            if isinstance(window, bool) or not isinstance(window, int) or window < 1:
                raise UserError(f"sliding window: expected a positive whole number of positions, got {window!r}")
            kind = f"sliding-{window}"
        names.append(kind)
    if not names:
        raise UserError("kinds: tick at least one KV cache kind")
    return names


def kind_tokens(value: Any) -> int:
    low, high, default = KIND_TOKENS
    tokens = default if value is None else value
    if not isinstance(tokens, (int, float)) or isinstance(tokens, bool) or not low <= tokens <= high:
        raise UserError(f"max_new_tokens: {value!r} is out of range for the KV kinds report; allowed [{low}, {high}]")
    return int(tokens)


def residual(value: Any) -> int:
    knob = KNOBS["kv_residual_length"]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not knob.low <= value <= knob.high:
        raise UserError(f"kv_residual_length: {value!r} is out of range; allowed {knob.range_text()}")
    return value


def render_kinds(out: KindOutputs, report: drift.KVDriftReport, final: bool) -> dict:
    done = len(report.kinds) + len(report.errors)
    if report.stopped:
        message = f"{report.stopped} · partial report: {done} of {len(report.requested)} kinds measured"
    elif final:
        message = f"done: {done} kinds, {report.max_new_tokens} greedy tokens" + (f" ({report.note})" if report.note else "")
    else:
        message = f"measured {done} of {len(report.requested)} kinds…"
    updates = {out.status: status_html(message), out.table: sized(memory_charts.KIND_HEADERS, memory_charts.kind_rows(report))}
    if report.kinds:
        updates |= {out.memory: memory_charts.memory_figure(report), out.per_token: memory_charts.bytes_per_token_figure(report),
                    out.drift: memory_charts.kind_drift_figure(report)}
    if final:
        updates[out.download] = downloads.json_file("kv-cache-kinds-report.json", to_dict(report))
    return updates


def kinds_updates(out: KindOutputs, shared: Shared, measure: Measure, picked: list[str] | None, window: Any,
                  residual_length: Any, control: RunControl) -> Iterator[dict]:
    """Validate, then stream the KV kinds report as each kind finishes."""
    prompt, chat = measure.prompt, measure.chat
    kinds, tokens, res = kind_names(picked, window), kind_tokens(measure.max_new_tokens), residual(residual_length)
    lm = shared.lm(measure.model, measure.quantization)
    require(lm, "KV cache")
    shared.encode_prompt(lm, prompt, chat)
    yield {out.status: status_html("full-precision reference: greedy run…"), out.table: [], out.memory: None,
           out.per_token: None, out.drift: None, out.download: None}
    for report in drift.stream_kv_drift(lm, prompt, chat, tokens, kinds, res, control=control):
        measured = len(report.kinds) + len(report.errors)
        yield render_kinds(out, report, final=measured == len(report.requested) or bool(report.stopped))


def _kinds_section(shared: Shared, prompt: gr.Textbox, chat: gr.Checkbox) -> tuple[Any, Any]:
    """The KV cache kinds section and its API endpoint; returns its run's (event, status)."""
    gr.Markdown(KINDS_INTRO, elem_id="kinds-intro")
    with gr.Row(equal_height=False):
        with gr.Column(scale=1, min_width=330):
            kinds = gr.CheckboxGroup([*DEFAULT_KINDS, SLIDING], value=list(DEFAULT_KINDS), label="KV cache kinds",
                                     info="dynamic is the full-precision yardstick; quantized kinds use HQQ.",
                                     elem_id="kinds-kinds")
            window = gr.Number(16, precision=0, label="N of sliding-<N> (positions kept)", elem_id="kinds-window")
            knob = KNOBS["kv_residual_length"]
            res = gr.Slider(knob.low, 256, value=DEFAULT_RESIDUAL, step=1, label="kv_residual_length",
                            info=knob.doc + " Larger than the run: nothing is quantized, no saving.", elem_id="kinds-residual")
            low, high, default = KIND_TOKENS
            tokens = gr.Slider(low, high, value=default, step=1, label="max_new_tokens (greedy)", elem_id="kinds-tokens")
            run = gr.Button("Measure KV cache kinds", variant="primary", elem_id="kinds-measure")
            status = gr.HTML("", elem_id="kinds-status")
        with gr.Column(scale=2, min_width=480):
            table = gr.Dataframe(headers=memory_charts.KIND_HEADERS, value=[], interactive=False, wrap=True,
                                 column_widths=column_widths(memory_charts.KIND_HEADERS, []),
                                 label="Per kind: bytes (teacher-forced pass), tokens/s (free-running), drift vs dynamic",
                                 elem_id="kinds-table")
            memory = gr.Plot(label="Cache memory over the run (free-running)", elem_id="kinds-memory")
            per_token = gr.Plot(label="Bytes per token: measured vs formula", elem_id="kinds-per-token")
            drift_plot = gr.Plot(label="KL per step against the full-precision cache (teacher-forced)", elem_id="kinds-drift")
            download = gr.DownloadButton("Download report JSON", elem_id="kinds-download")
    out = KindOutputs(status, table, memory, per_token, drift_plot, download)

    def on_run(prompt_text: str, chat_on: bool, max_new: Any, picked: list[str] | None, n: Any, res_len: Any,
               model: str, quant: str, *, control: RunControl) -> Iterator[dict]:
        yield from kinds_updates(out, shared, Measure(prompt_text, chat_on, max_new, model, quant), picked, n, res_len,
                                 control)

    event = shared.events.on([run.click], on_run, [prompt, chat, tokens, kinds, window, res, shared.model,
                                                   shared.quantization], out.all(),
                             on_error=cleared(out.status, out.all()), what="measurement")
    shared.events.api(functools.partial(kv_cache_kinds_report, shared), "kv_cache_kinds_report", what="measurement")
    return event, out.status


def kv_cache_kinds_report(shared: Shared, prompt: str, chat: bool = False, max_new_tokens: int = 32,
                          kinds: list[str] | None = None, residual_length: int = 32, model: str = "embedded",
                          quantization: str = "none", *, control: RunControl) -> dict:
    """Per KV cache kind (dynamic | quantized-int8 | quantized-int4 | sliding-<N>; default the
    first three): bytes per token measured from the cache tensors vs the formula, cache bytes over
    the run, tokens/s, and drift against the full-precision cache (teacher-forced KL, top-1
    agreement; free-running first divergence). ``residual_length``: kv_residual_length."""
    lm = shared.lm(model, quantization)
    require(lm, "KV cache")
    shared.encode_prompt(lm, prompt, chat)
    report = drift.kv_drift_report(lm, prompt, chat, kind_tokens(max_new_tokens), list(kinds or DEFAULT_KINDS),
                                   residual(residual_length), control=control)
    return to_dict(report)


# --- RTN vs GPTQ vs AWQ vs NF4 vs int8: held-out text, and inside one layer ---------------------------
METHODS_INTRO = (
    "### 4-bit methods: RTN vs GPTQ vs AWQ\n\nThe embedded model's 4-bit checkpoints (W4A16: 4-bit weights, one scale "
    "per group of input channels, made here with llm-compressor from a calibration set shipped in the repo; group 128, "
    "the papers' setting, does not divide this model's hidden size 576, so groups of 64 and 32) beside bitsandbytes' "
    "NF4 and int8. " + quant_report.METHOD + " Here each checkpoint's 4-bit weights are dequantized once, at load, "
    "to float32 (no 4-bit kernel on this CPU). vLLM runs them packed: `python -m deploy.vllm_serve --checkpoint "
    "gptq-g64` serves one at bfloat16 (its CPU 4-bit kernel refuses float32), and its top-100 matches this load to "
    "bfloat16 rounding (docs/quantization.md).")
INSIDE_INTRO = (
    "#### Inside one layer\nThe float weight W of one Linear against each method's effective 4-bit weight Ŵ (AWQ's "
    "scales folded back out), per output channel: the weight error, and the error of the layer's output on the "
    "held-out text's inputs X, which is what GPTQ minimises (on its calibration inputs). Right: AWQ's scale of each "
    "input channel against that channel's mean |activation|: AWQ protects the channels that carry large activations.")


@dataclass
class MethodOutputs(OutputSet):
    status: Any
    sentence: Any
    table: Any
    chart: Any
    download: Any


@dataclass
class InsideOutputs(OutputSet):
    status: Any
    sentence: Any
    errors: Any
    scales: Any


def render_methods(out: MethodOutputs, report: quant_report.MethodComparison, final: bool) -> dict:
    done = len(report.rows) + len(report.errors)
    message = (f"{report.stopped} · partial: {done} of {len(report.requested)} variants" if report.stopped
               else "done" if final else f"measured {done} of {len(report.requested)} variants{RUNNING}")
    updates = {out.status: status_html(message), out.sentence: html.escape(method_charts.comparison_sentence(report)),
               out.table: sized(method_charts.COMPARE_HEADERS, method_charts.comparison_rows(report)),
               out.chart: method_charts.comparison_figure(report)}
    if final:
        updates[out.download] = downloads.json_file("quantization-methods.json", to_dict(report))
    return updates


def methods_updates(out: MethodOutputs, shared: Shared, picked: list[str] | None, model: str,
                    control: RunControl) -> Iterator[dict]:
    chosen = quant_report.normalise(picked or [])
    reference = shared.lm(model, "none")
    require(reference, "quantization")
    yield {out.status: status_html(f"fp32 reads the held-out text{RUNNING}"), out.sentence: "", out.table: [],
           out.chart: None, out.download: None}
    for report in quant_report.stream_comparison(shared.registry, reference.source, chosen, control=control):
        yield render_methods(out, report, final=not report.pending() or bool(report.stopped))


def inside_updates(out: InsideOutputs, shared: Shared, layer: Any, module: str, group: Any, model: str,
                   control: RunControl) -> Iterator[dict]:
    reference = shared.lm(model, "none")
    require(reference, "quantization")
    yield {out.status: status_html(f"loading RTN, GPTQ and AWQ, reading the held-out text{RUNNING}"), out.sentence: "",
           out.errors: None, out.scales: None}
    report = quant_report.inside_layer(shared.registry, reference.source, _whole(layer), module, _whole(group),
                                       control=control)
    yield {out.status: status_html("done"), out.sentence: html.escape(method_charts.inside_sentence(report)),
           out.errors: method_charts.inside_figure(report), out.scales: method_charts.scales_figure(report)}


def _whole(value: Any) -> Any:
    """A float with no fraction (a slider's value) as an int; anything else as it is, for the engine to refuse."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _methods_section(shared: Shared) -> list[tuple[Any, Any]]:
    """The 4-bit methods' comparison and the inside-one-layer section, with their API endpoints."""
    gr.Markdown(METHODS_INTRO, elem_id=ids.METHODS_SECTION)
    with gr.Row(equal_height=False):
        with gr.Column(scale=1, min_width=330):
            picked = gr.CheckboxGroup(list(QUANTIZATIONS[1:]), value=list(quant_report.COMPARED[1:]),
                                      label="Variants (fp32 is always the reference)", elem_id="methods-variants")
            run = gr.Button("Compare methods", variant="primary", elem_id=ids.METHODS_MEASURE)
            status = gr.HTML("", elem_id="methods-status")
        with gr.Column(scale=2, min_width=480):
            sentence = gr.HTML(elem_id="methods-sentence")
            chart = gr.Plot(label="RTN vs GPTQ vs AWQ vs NF4 vs int8", elem_id="methods-chart")
            download = gr.DownloadButton("Download report JSON", elem_id="methods-download")
    # the page's whole width: its ten columns, each as wide as its longest word (sized), fit 1280 px
    table = gr.Dataframe(headers=method_charts.COMPARE_HEADERS, value=[], interactive=False, wrap=True,
                         column_widths=column_widths(method_charts.COMPARE_HEADERS, []),
                         label="Held-out text: perplexity and drift; bytes", elem_id="methods-table")
    out = MethodOutputs(status, sentence, table, chart, download)
    gr.Markdown(INSIDE_INTRO, elem_id="inside-intro")
    with gr.Row(equal_height=False):
        with gr.Column(scale=1, min_width=330):
            layer = gr.Slider(0, 29, value=15, step=1, label="layer", elem_id="inside-layer")
            module = gr.Radio(list(quant_report.LAYER_MODULES), value="q_proj", label="Linear", elem_id="inside-module")
            group = gr.Radio([64, 32], value=64, label="group size", elem_id="inside-group")
            inside_run = gr.Button("Look inside", variant="primary", elem_id="inside-measure")
            inside_status = gr.HTML("", elem_id="inside-status")
        with gr.Column(scale=2, min_width=480):
            inside_sentence = gr.HTML(elem_id="inside-sentence")
            errors = gr.Plot(label="Error per output channel", elem_id="inside-errors")
            scales = gr.Plot(label="AWQ scales vs activations", elem_id="inside-scales")
    inside = InsideOutputs(inside_status, inside_sentence, errors, scales)

    def on_methods(chosen: list[str] | None, model: str, *, control: RunControl) -> Iterator[dict]:
        yield from methods_updates(out, shared, chosen, model, control)

    def on_inside(at: Any, which: str, size: Any, model: str, *, control: RunControl) -> Iterator[dict]:
        yield from inside_updates(inside, shared, at, which, size, model, control)

    methods_event = shared.events.on([run.click], on_methods, [picked, shared.model], out.all(),
                                     on_error=cleared(out.status, out.all()), what="measurement")
    inside_event = shared.events.on([inside_run.click], on_inside, [layer, module, group, shared.model], inside.all(),
                                    on_error=cleared(inside.status, inside.all()), what="measurement")
    shared.events.api(functools.partial(quantization_methods_report, shared), "quantization_methods_report",
                      what="measurement")
    shared.events.api(functools.partial(quantization_inside_layer, shared), "quantization_inside_layer",
                      what="measurement")
    return [(methods_event, out.status), (inside_event, inside.status)]


def quantization_methods_report(shared: Shared, variants: list[str] | None = None, model: str = "embedded", *,
                                control: RunControl) -> dict:
    """The held-out comparison: fp32, then per variant (default: int8, nf4, rtn/gptq/awq at groups 64 and 32)
    perplexity on the held-out text, mean KL and top-1 agreement against fp32, bits per weight, bytes on
    disk, in memory and what a 4-bit kernel would keep, load and quantization seconds."""
    chosen = quant_report.normalise(variants)
    reference = shared.lm(model, "none")
    require(reference, "quantization")
    return to_dict(quant_report.compare_methods(shared.registry, reference.source, chosen, control=control))


def quantization_inside_layer(shared: Shared, layer: int = 15, module: str = "q_proj", group_size: int = 64,
                              model: str = "embedded", *, control: RunControl) -> dict:
    """One Linear (``module``: q_proj | gate_proj) of one decoder layer under RTN, GPTQ and AWQ at
    ``group_size`` (64 | 32): relative weight and output error per output channel, AWQ's scales
    and the mean |activation| of each input channel."""
    reference = shared.lm(model, "none")
    require(reference, "quantization")
    return to_dict(quant_report.inside_layer(shared.registry, reference.source, layer, module, group_size,
                                             control=control))


# --- the calculator: KV cache and weights of real models ------------------------------------------
def _count(key: str, value: Any, high: int) -> int:
    """A whole number in [1, high] (a float with no fraction counts); ValueError naming ``key``."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
        raise ValueError(f"{key}: expected a whole number in [1, {high:,}], got {kv_arith.shown(value)}")
    return value


def architecture(name: str, layers: Any = None, heads: Any = None, kv_heads: Any = None, head_dim: Any = None,
                 parameters_b: Any = None) -> kv_arith.Architecture:
    """A well-known architecture by name, or ``custom`` from the typed numbers (parameters in billions).
    Errors name the calculator's API arguments (``architecture_name``, ``layers``, ...)."""
    known = kv_arith.load_architectures()
    if not isinstance(name, str) or name not in [*known, CUSTOM]:
        raise ValueError(f"architecture_name: expected one of {' | '.join([*known, CUSTOM])}, "
                         f"got {kv_arith.shown(name)}")
    if name != CUSTOM:
        return known[name]
    if isinstance(parameters_b, bool) or not isinstance(parameters_b, (int, float)) or not 1e-9 <= parameters_b <= 1e5:
        raise ValueError(f"parameters_b: expected billions of parameters in [1e-09, 100000], "
                         f"got {kv_arith.shown(parameters_b)}")
    return kv_arith.Architecture("custom", _count("layers", layers, kv_arith.MAX_LAYERS),
                                 _count("heads", heads, kv_arith.MAX_HEADS),
                                 _count("kv_heads", kv_heads, kv_arith.MAX_HEADS),
                                 _count("head_dim", head_dim, kv_arith.MAX_HEAD_DIM), round(parameters_b * 1e9))


def kv_calculator(architecture_name: str = "Llama-2-7B", context: int = 4096, batch: int = 1, kv_dtype: str = "fp16",
                  weights_dtype: str = "fp16", layers: int | None = None, heads: int | None = None,
                  kv_heads: int | None = None, head_dim: int | None = None, parameters_b: float | None = None) -> dict:
    """KV cache and weights memory of a model: ``architecture_name`` (Llama-2-7B, Llama-3-8B,
    Llama-3-70B, Mistral-7B, Qwen2.5-7B) or ``custom`` with layers / heads / kv_heads / head_dim /
    parameters_b. KV bytes per token = 2 × layers × kv_heads × head_dim × bytes; GB are 1e9 bytes.
    ``attention``: the same model as MHA, its own GQA (if any) and MQA side by side."""
    arch = architecture(architecture_name, layers, heads, kv_heads, head_dim, parameters_b)
    kv_arith.dtype_bytes(kv_dtype, "kv_dtype")
    kv_arith.dtype_bytes(weights_dtype, "weights_dtype")
    tokens, batch = _count("context", context, kv_arith.MAX_TOKENS), _count("batch", batch, kv_arith.MAX_BATCH)
    mine = kv_arith.estimate(arch, tokens, batch, kv_dtype, weights_dtype)
    return {"architecture": to_dict(arch), "context": tokens, "batch": batch, "kv_dtype": kv_dtype,
            "weights_dtype": weights_dtype, "estimate": to_dict(mine),
            "kv_mb_per_token": mine.kv_bytes_per_token / 2**20,
            "formula": (f"2 × {arch.layers} layers × {arch.kv_heads} KV heads × {arch.head_dim} head dim × "
                        f"{kv_arith.dtype_bytes(kv_dtype):g} bytes = {mine.kv_bytes_per_token:,.0f} bytes per token"),
            "attention": [to_dict(e) for e in kv_arith.compare_attention(arch, tokens, batch, kv_dtype, weights_dtype)],
            "note": kv_arith.LECTURE_SLIP}


@dataclass
class CalcOutputs(OutputSet):
    formula: Any
    table: Any
    chart: Any


def calculator_updates(out: CalcOutputs, *values: Any) -> dict:
    """The calculator's outputs for its inputs, or the error in place of the formula."""
    try:
        data = kv_calculator(*values)
    except ValueError as exc:
        return {out.formula: error_html(str(exc))}
    rows = [kv_arith.MemoryEstimate(**e) for e in data["attention"]]
    text = (f"<b>KV cache per token:</b> {data['formula']} ({data['kv_mb_per_token']:.3g} MiB) · "
            f"<b>{data['estimate']['kv_cache_gb']:,.2f} GB</b> for {data['context']:,} tokens × batch {data['batch']}; "
            f"weights {data['estimate']['weights_gb']:,.2f} GB.<br><small>{data['note']}</small>")
    return {out.formula: f'<div class="dp-status" id="calc-result">{text}</div>',
            out.table: sized(memory_charts.CALCULATOR_HEADERS, memory_charts.calculator_rows(rows)),
            out.chart: memory_charts.calculator_figure(rows)}


def _calculator_section() -> None:
    gr.Markdown("### KV cache calculator\nKV cache bytes = 2 (K and V) × layers × KV heads × head dim × bytes × tokens × "
                "batch. Grouped-query (GQA) and multi-query (MQA) attention shrink it by sharing KV heads.")
    names = [*kv_arith.load_architectures(), CUSTOM]
    with gr.Row(equal_height=False):
        with gr.Column(scale=1, min_width=330):
            arch = gr.Dropdown(names, value=names[0], label="Architecture", elem_id="calc-arch",
                               info="Config values from each model's config.json (engine/assets/architectures.json); "
                                    "'custom' uses the numbers below.")
            with gr.Row():
                context = gr.Number(4096, precision=0, label="context (tokens)", elem_id="calc-context")
                batch = gr.Number(1, precision=0, label="batch", elem_id="calc-batch")
            with gr.Row():
                kv_dtype = gr.Dropdown(list(kv_arith.DTYPE_BYTES), value="fp16", label="KV dtype", elem_id="calc-kv-dtype")
                w_dtype = gr.Dropdown(list(kv_arith.DTYPE_BYTES), value="fp16", label="weights dtype",
                                      elem_id="calc-w-dtype")
            with gr.Accordion("custom architecture", open=False):
                custom = [gr.Number(v, precision=0, label=label, elem_id=f"calc-{key}") for key, label, v in
                          (("layers", "layers", 32), ("heads", "query heads", 32), ("kv-heads", "KV heads", 8),
                           ("head-dim", "head dim", 128))]
                params = gr.Number(7.0, label="parameters (billions)", elem_id="calc-params")
        first = calculator_updates(CalcOutputs("formula", "table", "chart"), names[0], 4096, 1, "fp16", "fp16")
        with gr.Column(scale=2, min_width=480):
            formula = gr.HTML(first["formula"], elem_id="calc-formula")
            table = gr.Dataframe(first["table"]["value"], headers=memory_charts.CALCULATOR_HEADERS, interactive=False,
                                 column_widths=first["table"]["column_widths"], wrap=True,
                                 label="MHA vs GQA vs MQA (weights kept as the real model's)", elem_id="calc-table")
            chart = gr.Plot(first["chart"], label="weights + KV cache", elem_id="calc-chart")
    out = CalcOutputs(formula, table, chart)
    inputs: list[Any] = [arch, context, batch, kv_dtype, w_dtype, *custom, params]  # components of several kinds
    for component in inputs:
        component.change(lambda *v: calculator_updates(out, *v), inputs, out.all(), api_visibility="private", queue=False)
    data_api(kv_calculator, "kv_calculator", what="calculation")
