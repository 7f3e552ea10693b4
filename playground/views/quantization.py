"""Quantization & KV cache: switch between fp32, int8 and nf4 loading and see what changes
(memory, load time, speed, how far each next-token distribution drifts from fp32, where the text
first differs), and measure what the KV cache buys (speed, and its size against the formula).

Drift uses the header's model with the variants ticked here; the KV cache section uses the
header's model and quantization. No per-user state is kept beyond the outputs themselves.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from typing import Any, Iterator

import gradio as gr

from engine import drift
from engine.config import ConfigError
from engine.models import QUANTIZATIONS, ModelLoadError
from engine.trace import to_dict
from playground.charts import quantization as charts

from ..shared import Shared, UserError, error_html, status_html

DEFAULT_PROMPT = "Explain in two sentences why the sky is blue."
DRIFT_TOKENS = (1, 128, 20)  # slider minimum, maximum, default
KV_TOKENS = (2, 256, 48)


@dataclass
class DriftOutputs:
    status: Any
    table: Any
    kl: Any
    texts: Any
    download: Any

    def all(self) -> list:
        return [self.status, self.table, self.kl, self.texts, self.download]


@dataclass
class KVOutputs:
    status: Any
    summary: Any
    chart: Any

    def all(self) -> list:
        return [self.status, self.summary, self.chart]


def _json_file(data: dict, prefix: str) -> str:
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix=prefix, delete=False, encoding="utf-8") as fh:
        json.dump(data, fh, indent=1, ensure_ascii=False)
        return fh.name


def render_drift(report: drift.DriftReport, final: bool) -> list:
    """Outputs for a (possibly partial) report; the download only once it is complete."""
    download = gr.update(value=_json_file(to_dict(report), "quantization-report-")) if final else gr.update()
    return [status_html(charts.drift_status(report)), charts.drift_rows(report), charts.kl_figure(report),
            charts.texts_html(report), download]


def drift_updates(shared: Shared, prompt: str, chat: bool, max_new_tokens: Any, variants: list[str] | None,
                  model: str) -> Iterator[list]:
    """Validate, then stream the drift report as each variant finishes."""
    try:
        chosen = drift.normalise_variants(variants or [])
        reference = shared.lm(model, "none")
        shared.encode_prompt(reference, prompt, chat)
        tokens = int(max_new_tokens or DRIFT_TOKENS[2])
        drift.greedy_config(tokens)  # validates the token budget
    except (UserError, ValueError) as exc:
        yield [error_html(str(exc))] + [gr.update()] * 4
        return
    yield [status_html("fp32 reference: greedy run…")] + [gr.update()] * 4
    report = None
    try:
        for report in drift.stream_drift(shared.registry, reference.source, prompt, chat, tokens, chosen):
            yield render_drift(report, final=not report.pending())
    except (ModelLoadError, ValueError) as exc:
        yield [error_html(str(exc))] + [gr.update()] * 4
    except Exception as exc:  # a model failure must not take the page down
        yield [error_html(f"measurement failed: {type(exc).__name__}: {exc}")] + [gr.update()] * 4


def kv_updates(shared: Shared, prompt: str, chat: bool, max_new_tokens: Any, model: str,
               quantization: str) -> Iterator[list]:
    try:
        lm = shared.lm(model, quantization)
        shared.encode_prompt(lm, prompt, chat)
        tokens = int(max_new_tokens or KV_TOKENS[2])
        drift.greedy_config(tokens)
    except (UserError, ValueError) as exc:
        yield [error_html(str(exc)), gr.update(), gr.update()]
        return
    yield [status_html(f"greedy with and without the cache, {tokens} tokens each…"), gr.update(), gr.update()]
    try:
        report = drift.kv_cache_report(lm, prompt, chat, tokens)
    except Exception as exc:  # a model failure must not take the page down
        yield [error_html(f"measurement failed: {type(exc).__name__}: {exc}"), gr.update(), gr.update()]
        return
    yield [status_html("done"), charts.kv_summary_html(report), charts.kv_figure(report)]


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
    _wire(shared, prompt, chat, tokens, variants, measure, stop, out, kv)


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


def _wire(shared: Shared, prompt, chat, tokens, variants, measure, stop, out: DriftOutputs, kv: dict[str, Any]) -> None:
    def on_measure(prompt_text, chat_on, max_new, picked, model):
        yield from drift_updates(shared, prompt_text, chat_on, max_new, picked, model)

    def on_kv(prompt_text, chat_on, max_new, model, quant):
        yield from kv_updates(shared, prompt_text, chat_on, max_new, model, quant)

    drift_event = measure.click(on_measure, [prompt, chat, tokens, variants, shared.model], out.all(),
                                api_visibility="private", **shared.model_event)
    kv_event = kv["run"].click(on_kv, [prompt, chat, kv["tokens"], shared.model, shared.quantization], kv["out"].all(),
                               api_visibility="private", **shared.model_event)
    stop.click(lambda: status_html("stopped"), None, [out.status], cancels=[drift_event, kv_event], queue=False)

    def quantization_report_api(prompt: str, chat: bool = False, max_new_tokens: int = 16,
                                variants: list[str] | None = None, model: str = "embedded") -> dict:
        """Greedy fp32 reference, then per variant (none | int8 | nf4; all by default): memory, load
        seconds, tokens/s, per-step KL / total variation / top-1 agreement against fp32 under teacher
        forcing, its own greedy text and first divergence step."""
        return quantization_report(shared, prompt, chat, max_new_tokens, variants, model)

    def kv_cache_report_api(prompt: str, chat: bool = False, max_new_tokens: int = 32, model: str = "embedded",
                            quantization: str = "none") -> dict:
        """Greedy with vs without the KV cache: tokens/s each, ms per step, cache bytes per token
        measured against 2 × layers × kv_heads × head_dim × bytes per element."""
        return kv_cache_report(shared, prompt, chat, max_new_tokens, model, quantization)

    gr.api(quantization_report_api, api_name="quantization_report", **shared.model_event)
    gr.api(kv_cache_report_api, api_name="kv_cache_report", **shared.model_event)


def quantization_report(shared: Shared, prompt: str, chat: bool = False, max_new_tokens: int = 16,
                        variants: list[str] | None = None, model: str = "embedded") -> dict:
    """API: the drift report JSON (engine.drift.DriftReport)."""
    try:
        chosen = drift.normalise_variants(list(QUANTIZATIONS) if variants is None else variants)
        reference = shared.lm(model, "none")
        shared.encode_prompt(reference, prompt, chat)
        report = drift.quantization_report(shared.registry, reference.source, prompt, chat, max_new_tokens, chosen)
    except (ConfigError, UserError, ModelLoadError, ValueError) as exc:
        raise gr.Error(str(exc)) from None
    return to_dict(report)


def kv_cache_report(shared: Shared, prompt: str, chat: bool = False, max_new_tokens: int = 32, model: str = "embedded",
                    quantization: str = "none") -> dict:
    """API: the KV cache report JSON (engine.drift.KVReport)."""
    try:
        lm = shared.lm(model, quantization)
        shared.encode_prompt(lm, prompt, chat)
        report = drift.kv_cache_report(lm, prompt, chat, max_new_tokens)
    except (ConfigError, UserError, ModelLoadError, ValueError) as exc:
        raise gr.Error(str(exc)) from None
    return to_dict(report)
