"""Quantization & KV cache charts: pure functions of DriftReport / KVReport -> table rows, plotly
figures and HTML. No gradio here; unit-tested on hand-made reports.
"""

from __future__ import annotations

import html
from typing import Sequence

import plotly.graph_objects as go

from engine.reports.drift import DriftReport, KVReport, VariantDrift
from engine.numbers import percent
from . import glossary
from .step import FONT
from .tokens import render as readable
from .tokens import render_html

MB = 1024 * 1024
# text colours too: >= 4.5:1 on white; one colour per method (both group sizes share it, g32 dashed)
COLOURS = {"none": "#4c78a8", "int8": "#a35d00", "nf4": "#b71c1c", "rtn": "#5e5e5e", "gptq": "#2e7d32", "awq": "#6a3d9a"}
CACHED, UNCACHED = "#4c78a8", "#b71c1c"
DIVERGED_BG = "#fde4e4"

DRIFT_HEADERS = ["variant", "memory MB", "load s", "tokens/s", "mean KL (nats)", "max KL (nats)",
                 "top-1 agreement (teacher-forced)", "held-out perplexity", "own text leaves fp32 (free-running)"]
DRIFT_NOTE = (glossary.hover("teacher-forced") + ". " + glossary.hover("free-running") + ". "
              + glossary.hover("KL(p‖q)") + ". Load time: a variant already in memory shows the time of its first load.")


def variant_label(quantization: str) -> str:
    return "fp32 (none)" if quantization == "none" else quantization


def colour(quantization: str) -> str:
    """The variant's method colour (rtn-g64 and rtn-g32 share rtn's)."""
    return COLOURS.get(quantization, COLOURS.get(quantization.split("-")[0], "#555"))


def _divergence_cell(v: VariantDrift) -> str:
    if v.quantization == "none":
        return "reference"
    return "never" if v.first_divergence is None else f"at step {v.first_divergence}"


def drift_rows(report: DriftReport) -> list[list]:
    """One row of display strings per measured variant (headers: DRIFT_HEADERS), then one per failed variant."""
    rows = [[variant_label(v.quantization), f"{v.memory_bytes / MB:.1f}",
             f"in memory (first load {v.load_s:.1f})" if v.was_loaded else f"{v.load_s:.1f}", f"{v.tokens_per_s:.2f}",
             f"{v.mean_kl:.4g}", f"{v.max_kl:.4g}", percent(v.top1_agreement),
             f"{v.heldout_perplexity:.1f}" if v.heldout_perplexity else "—", _divergence_cell(v)] for v in report.variants]
    rows += [[variant_label(q), "", "", "", "", "", "", "", f"failed: {message}"] for q, message in report.errors.items()]
    return rows


def kl_figure(report: DriftReport) -> go.Figure:
    """KL(p_fp32 || p_variant) per step of the reference continuation, one line per variant;
    a diamond marks where the variant's own greedy text first left the reference."""
    fig = go.Figure()
    labels = [f"{i}: {readable(t)}" for i, t in enumerate(report.reference_tokens)]
    for v in report.variants:
        hue = colour(v.quantization)
        fig.add_trace(go.Scatter(
            x=[p.index for p in v.positions], y=[p.kl for p in v.positions], mode="lines+markers",
            name=variant_label(v.quantization), line={"color": hue, "dash": "dash" if "-g32" in v.quantization else None},
            customdata=labels,
            hovertemplate="step %{customdata}<br>KL %{y:.4g} nats<br>" + html.escape(glossary.hover("KL(p‖q)"))
                          + "<extra>" + variant_label(v.quantization) + "</extra>",
        ))
        at = v.first_divergence
        if at is not None and at < len(v.positions):
            fig.add_trace(go.Scatter(
                x=[at], y=[v.positions[at].kl], mode="markers",
                name=f"{variant_label(v.quantization)}: own text leaves fp32 here",
                marker={"symbol": "diamond", "size": 13, "color": hue, "line": {"color": "#222", "width": 1}},
                hovertemplate=f"own greedy text leaves the reference at step {at}<extra></extra>",
            ))
    fig.update_layout(title={"text": "Drift from fp32 at each step<br><sup>teacher-forced: every variant reads "
                                     "the fp32 text</sup>", "x": 0.01, "font": {"size": FONT + 2}},
                      xaxis_title="step of the fp32 continuation", yaxis_title="KL(p_fp32 ‖ p_variant), nats",
                      height=420, margin={"l": 60, "r": 20, "t": 80, "b": 10}, font={"size": FONT},
                      legend={"orientation": "h", "x": 0, "y": -0.25, "yanchor": "top"}, yaxis={"rangemode": "tozero"})
    return fig


def _token_spans(tokens: Sequence[str], divergence: int | None) -> str:
    """Tokens as spans; from ``divergence`` on they are shaded, and a ▶ marks the point."""
    spans = []
    for i, token in enumerate(tokens):
        text = render_html(token, flow=True)
        if divergence is not None and i == divergence:
            spans.append(f'<span class="q-diverge" title="first token that differs from fp32 (step {i})" '
                         f'style="color:#b71c1c;font-weight:bold">▶</span>')
        if divergence is not None and i >= divergence:
            spans.append(f'<span class="q-after" style="background:{DIVERGED_BG}">{text}</span>')
        else:
            spans.append(f"<span>{text}</span>")
    return "".join(spans)


def texts_html(report: DriftReport) -> str:
    """Each variant's own greedy continuation side by side; the part after its first divergence
    from the fp32 text is shaded and the point is marked ▶."""
    if not report.variants:
        return '<div class="q-texts"><i>No variant measured yet.</i></div>'
    columns = []
    for v in report.variants:
        note = ("reference" if v.quantization == "none"
                else "same text as fp32 (free-running)" if v.first_divergence is None
                else f"own text leaves fp32 at step {v.first_divergence} (free-running); "
                     f"top-1 agreement {percent(v.top1_agreement)} is teacher-forced")
        columns.append(
            f'<div class="q-text" data-variant="{html.escape(v.quantization)}" style="flex:1;min-width:220px;'
            f'border:1px solid #ddd;border-radius:6px;padding:8px">'
            f'<div style="font-weight:bold;color:{colour(v.quantization)}">'
            f"{html.escape(variant_label(v.quantization))}"
            f' <span style="font-weight:normal;color:#555;font-size:{FONT}px">· {note}</span></div>'
            f'<div style="white-space:pre-wrap;font-family:ui-monospace,monospace;font-size:{FONT}px">'
            f"{_token_spans(v.tokens, v.first_divergence)}</div></div>"
        )
    return f'<div class="q-texts" style="display:flex;gap:8px;flex-wrap:wrap">{"".join(columns)}</div>'


def drift_status(report: DriftReport) -> str:
    """A one-line progress message while the report streams."""
    pending = report.pending()
    done = len(report.variants) + len(report.errors)
    if report.stopped:
        return (f"{report.stopped} · partial report: {done} of {len(report.requested)} variant(s) measured "
                f"({', '.join(pending)} not measured)")
    if not pending:
        return f"done: {done} variant(s) over {len(report.reference_token_ids)} reference tokens"
    return (f"fp32 reference: {len(report.reference_token_ids)} tokens · measuring {pending[0]} "
            f"(load, one teacher-forced forward, own greedy run)… {done} of {len(report.requested)} measured")


def kv_figure(report: KVReport) -> go.Figure:
    """Milliseconds per generated token against the sequence length the model read: the cached
    loop stays flat, the uncached one grows with the length."""
    x = [s.position for s in report.steps]
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=x, y=[s.uncached_ms for s in report.steps], mode="lines+markers",
                             name="no cache (recompute)", line={"color": UNCACHED},
                             hovertemplate="length %{x}: %{y:.1f} ms<extra>no cache</extra>"))
    fig.add_trace(go.Scatter(x=x, y=[s.cached_ms for s in report.steps], mode="lines+markers", name="KV cache",
                             line={"color": CACHED}, hovertemplate="length %{x}: %{y:.1f} ms<extra>KV cache</extra>"))
    fig.update_layout(title={"text": "Time per token as the sequence grows<br><sup>the first cached step includes "
                                     "the prefill</sup>", "x": 0.01, "font": {"size": FONT + 2}},
                      xaxis_title="sequence length read (prompt + generated)", yaxis_title="ms per token", height=400,
                      margin={"l": 60, "r": 20, "t": 80, "b": 10}, font={"size": FONT},
                      legend={"orientation": "h", "x": 0, "y": -0.25, "yanchor": "top"}, yaxis={"rangemode": "tozero"})
    return fig


def _first_mismatch(report: KVReport) -> int:
    pairs = zip(report.generated_token_ids, report.uncached_token_ids)
    shorter = min(len(report.generated_token_ids), len(report.uncached_token_ids))
    return next((i for i, (a, b) in enumerate(pairs) if a != b), shorter)


def measured_vs_formula(measured: float, formula: float) -> str:
    """``measured X = formula Y`` when they agree to the byte, else ``measured X vs formula Y (+Z%)``."""
    if round(measured) == round(formula):
        return f"measured {measured:,.0f} = formula {formula:,.0f}"
    change = f" ({(measured - formula) / formula:+.1%})" if formula else ""
    return f"measured {measured:,.0f} vs formula {formula:,.0f}{change}"


def kv_summary_html(report: KVReport) -> str:
    """Speed (cached vs uncached), the cache's size, and bytes per token measured vs the formula."""
    check = measured_vs_formula(report.bytes_per_token, report.formula_bytes_per_token)
    stopped = "" if not report.stopped else (
        f'<p class="q-kv-stopped"><b>Partial report:</b> {html.escape(report.stopped)}. The speeds compare the '
        f"{len(report.uncached_token_ids)} tokens both loops ran.</p>")
    warn = "" if report.tokens_equal else (
        '<p style="color:#b00020">⚠ the two loops picked different tokens from step '
        f"{_first_mismatch(report)} on: int8 quantizes activations per forward, so one new position and the whole "
        "sequence round differently (in fp32 only a near-tie does this).</p>")
    return (
        f'<div class="q-kv">'
        f"<p><b>KV cache:</b> {report.cached_tokens_per_s:.1f} tokens/s · <b>no cache:</b> "
        f"{report.uncached_tokens_per_s:.1f} tokens/s · speed-up <b>{report.speedup:.2f}×</b> "
        f"over {len(report.generated_token_ids)} tokens after a {report.prompt_tokens}-token prompt "
        f"({html.escape(report.model)}, {html.escape(report.quantization)}, {html.escape(report.device)}).</p>"
        f"<p><b>Cache size:</b> {report.cache_bytes / MB:.2f} MB for {report.cache_positions} positions · "
        f"<b>bytes per token: {check}</b>, the formula being "
        f"{html.escape(report.formula)} (keys and values, {html.escape(report.dtype)}); measured = the cache's "
        f"key and value tensors divided by the positions they hold.</p>"
        f"{stopped}{warn}</div>"
    )
