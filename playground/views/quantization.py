"""Quantization & KV cache: switch between fp32, int8 and nf4 loading and see what changes
(memory, load time, speed, how far each next-token distribution drifts from fp32, where the text
first differs), and measure what the KV cache buys (speed, and its size against the formula).

Drift uses the header's model with the variants ticked here; the KV cache section uses the
header's model and quantization. No per-user state is kept beyond the outputs themselves.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Iterator

import gradio as gr

from engine import drift
from engine.control import RunControl
from engine.models import QUANTIZATIONS
from engine.trace import to_dict
from playground.charts import quantization as charts

from .. import downloads
from ..events import stop_button
from ..shared import OutputSet, Shared, UserError, error_html, status_html

DEFAULT_PROMPT = "Explain in two sentences why the sky is blue."
DRIFT_TOKENS = (1, 128, 20)  # slider minimum, maximum, default
KV_TOKENS = (2, 256, 48)


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
    """Updates for a (possibly partial) report; the download only once it is complete."""
    updates = {out.status: status_html(charts.drift_status(report)), out.table: charts.drift_rows(report),
               out.kl: charts.kl_figure(report), out.texts: charts.texts_html(report)}
    if final:
        updates[out.download] = downloads.json_file("quantization-report.json", to_dict(report))
    return updates


def drift_updates(out: DriftOutputs, shared: Shared, prompt: str, chat: bool, max_new_tokens: Any,
                  variants: list[str] | None, model: str, control: RunControl) -> Iterator[dict]:
    """Validate, then stream the drift report as each variant finishes."""
    chosen = drift.normalise_variants(variants or [])
    reference = shared.lm(model, "none")
    shared.encode_prompt(reference, prompt, chat)
    tokens = int(max_new_tokens or DRIFT_TOKENS[2])
    drift.greedy_config(tokens)  # validates the token budget
    yield {out.status: status_html("fp32 reference: greedy run…")}
    for report in drift.stream_drift(shared.registry, reference.source, prompt, chat, tokens, chosen):
        control.check()  # between variants: the engine's drift loop has no control of its own yet
        yield render_drift(out, report, final=not report.pending())


def kv_tokens(value: Any) -> int:
    """The KV report's token count, capped: its uncached pass costs time quadratic in the length."""
    low, high, default = KV_TOKENS
    tokens = default if value is None else value
    if not isinstance(tokens, (int, float)) or isinstance(tokens, bool) or not low <= tokens <= high:
        raise UserError(f"max_new_tokens: {value!r} is out of range for the KV cache report; allowed [{low}, {high}]")
    return int(tokens)


def kv_updates(out: KVOutputs, shared: Shared, prompt: str, chat: bool, max_new_tokens: Any, model: str,
               quantization: str, control: RunControl) -> Iterator[dict]:
    lm = shared.lm(model, quantization)
    shared.encode_prompt(lm, prompt, chat)
    tokens = kv_tokens(max_new_tokens)
    yield {out.status: status_html(f"greedy with and without the cache, {tokens} tokens each…")}
    report = drift.kv_cache_report(lm, prompt, chat, tokens)
    control.check()
    yield {out.status: status_html("done"), out.summary: charts.kv_summary_html(report), out.chart: charts.kv_figure(report)}


def build_tab(shared: Shared) -> None:
    gr.Markdown("Load the header's model as fp32, int8 and nf4 (bitsandbytes) and see what quantization changes. "
                "Each variant reads the fp32 model's greedy continuation in one forward; the chart shows how far its "
                "next-token distribution is from fp32's at every step (KL divergence).")
    with gr.Row(equal_height=False):
        with gr.Column(scale=1, min_width=330):
            prompt = gr.Textbox(DEFAULT_PROMPT, lines=4, label="Prompt", elem_id="quant-prompt")
            chat = gr.Checkbox(True, label="Chat template", elem_id="quant-chat")
            low, high, default = DRIFT_TOKENS
            tokens = gr.Slider(low, high, value=default, step=1, label="max_new_tokens (greedy)",
                               elem_id="quant-tokens")
            variants = gr.CheckboxGroup(list(QUANTIZATIONS), value=list(QUANTIZATIONS), label="Variants",
                                        info="none = fp32, the reference; int8 and nf4 load through bitsandbytes.",
                                        elem_id="quant-variants")
            with gr.Row():
                measure = gr.Button("Measure drift", variant="primary", elem_id="quant-measure")
                stop = gr.Button("Stop", variant="stop", elem_id="quant-stop")
            status = gr.HTML("", elem_id="quant-status")
        with gr.Column(scale=2, min_width=480):
            table = gr.Dataframe(headers=charts.DRIFT_HEADERS, value=[], interactive=False, wrap=True,
                                 label="Variants (load s: when first loaded)", elem_id="quant-table")
            kl = gr.Plot(label="KL from fp32 per step", elem_id="quant-kl")
            texts = gr.HTML(elem_id="quant-texts")
            download = gr.DownloadButton("Download report JSON", elem_id="quant-download")
    out = DriftOutputs(status, table, kl, texts, download)
    kv = _kv_section()
    _wire(shared, QuantInputs(prompt, chat, tokens, variants), measure, stop, out, kv)


@dataclass
class QuantInputs:
    prompt: gr.Textbox
    chat: gr.Checkbox
    tokens: gr.Slider
    variants: gr.CheckboxGroup


def _kv_section() -> dict[str, Any]:
    gr.Markdown("### KV cache\nGreedy decoding of the header's model with the KV cache (one new position per forward) "
                "against recomputing the whole sequence at every step, and the cache's size.")
    with gr.Row(equal_height=False):
        with gr.Column(scale=1, min_width=330):
            low, high, default = KV_TOKENS
            tokens = gr.Slider(low, high, value=default, step=1, label="max_new_tokens", elem_id="kv-tokens")
            run = gr.Button("Measure KV cache", variant="primary", elem_id="kv-measure")
            status = gr.HTML("", elem_id="kv-status")
        with gr.Column(scale=2, min_width=480):
            summary = gr.HTML(elem_id="kv-summary")
            chart = gr.Plot(label="ms per token vs position", elem_id="kv-chart")
    return {"tokens": tokens, "run": run, "out": KVOutputs(status, summary, chart)}


def _wire(shared: Shared, inp: QuantInputs, measure: gr.Button, stop: gr.Button, out: DriftOutputs,
          kv: dict[str, Any]) -> None:
    kv_out: KVOutputs = kv["out"]

    def on_measure(prompt: str, chat: bool, max_new: Any, picked: list[str] | None, model: str, *,
                   control: RunControl) -> Iterator[dict]:
        yield from drift_updates(out, shared, prompt, chat, max_new, picked, model, control)

    def on_kv(prompt: str, chat: bool, max_new: Any, model: str, quant: str, *, control: RunControl) -> Iterator[dict]:
        yield from kv_updates(kv_out, shared, prompt, chat, max_new, model, quant, control)

    drift_event = shared.events.on([measure.click], on_measure, [inp.prompt, inp.chat, inp.tokens, inp.variants,
                                                                 shared.model], out.all(),
                                   on_error=lambda message: {out.status: error_html(message)}, what="measurement")
    kv_event = shared.events.on([kv["run"].click], on_kv, [inp.prompt, inp.chat, kv["tokens"], shared.model,
                                                           shared.quantization], kv_out.all(),
                                on_error=lambda message: {kv_out.status: error_html(message)}, what="measurement")
    stop_button(stop, out.status, [drift_event, kv_event], status_html("stopped"))
    shared.events.api(functools.partial(quantization_report, shared), "quantization_report", what="measurement")
    shared.events.api(functools.partial(kv_cache_report, shared), "kv_cache_report", what="measurement")


def quantization_report(shared: Shared, prompt: str, chat: bool = False, max_new_tokens: int = 16,
                        variants: list[str] | None = None, model: str = "embedded", *, control: RunControl) -> dict:
    """Greedy fp32 reference, then per variant (none | int8 | nf4; all by default): memory, load
    seconds, tokens/s, per-step KL / total variation / top-1 agreement against fp32 under teacher
    forcing, its own greedy text and first divergence step."""
    chosen = drift.normalise_variants(list(QUANTIZATIONS) if variants is None else variants)
    reference = shared.lm(model, "none")
    shared.encode_prompt(reference, prompt, chat)
    report = drift.quantization_report(shared.registry, reference.source, prompt, chat, max_new_tokens, chosen)
    control.check()
    return to_dict(report)


def kv_cache_report(shared: Shared, prompt: str, chat: bool = False, max_new_tokens: int = 32, model: str = "embedded",
                    quantization: str = "none", *, control: RunControl) -> dict:
    """Greedy with vs without the KV cache: tokens/s each, ms per step, cache bytes per token
    measured against 2 × layers × kv_heads × head_dim × bytes per element."""
    lm = shared.lm(model, quantization)
    shared.encode_prompt(lm, prompt, chat)
    report = drift.kv_cache_report(lm, prompt, chat, kv_tokens(max_new_tokens))
    control.check()
    return to_dict(report)
