"""Memory charts: pure functions of engine.reports.drift.KVDriftReport and engine.reports.kv_arith estimates ->
table rows and plotly figures. No gradio here; unit-tested on hand-made data.

- ``kind_rows`` / ``KIND_HEADERS``: the KV-kind table (bytes per token measured vs formula, drift).
- ``measured_vs_formula``: "measured X vs formula Y (+Z%)" for a kind, with what makes them differ.
- ``memory_figure``: cache bytes over the run, one line per kind.
- ``bytes_per_token_figure``: bytes per token measured from the tensors next to the formula.
- ``kind_drift_figure``: KL per step (teacher-forced) per kind, first divergence marked.
- ``calculator_figure`` / ``calculator_rows``: KV cache and weights GB, MHA vs GQA vs MQA.
"""

from __future__ import annotations

from typing import Sequence

import plotly.graph_objects as go

from engine.reports.drift import KVDriftReport, KVKindDrift
from engine.reports.kv_arith import MemoryEstimate
from engine.numbers import percent

from .quantization import measured_vs_formula as compare_numbers

KB = 1024
KIND_COLUMN_WIDTHS = ["15%", "10%", "10%", "24%", "7%", "9%", "9%", "7%", "9%"]  # the comparison gets the room
COLOURS = {"dynamic": "#4c78a8", "quantized-int8": "#f58518", "quantized-int4": "#e45756"}
SLIDING_COLOUR = "#54a24b"
ATTENTION_COLOURS = {"mha": "#e45756", "gqa": "#4c78a8", "mqa": "#54a24b"}
LAYOUT = {"height": 340, "margin": {"l": 60, "r": 20, "t": 50, "b": 50}, "legend": {"orientation": "h", "y": -0.25}}

KIND_HEADERS = ["KV cache", "bytes / token, measured", "bytes / token, formula (long-term)",
                "measured vs formula", "tokens/s", "mean KL (nats)", "max KL", "top-1 agreement", "first divergence"]
CALCULATOR_HEADERS = ["model", "attention", "KV heads", "KV bytes / token", "KV cache GB", "weights GB", "total GB"]


def colour(kind: str) -> str:
    return COLOURS.get(kind, SLIDING_COLOUR if kind.startswith("sliding-") else "#555")


def _divergence(row: KVKindDrift) -> str:
    if row.kind == "dynamic":
        return "reference"
    return "never" if row.first_divergence is None else f"step {row.first_divergence}"


def _held_differently(k: KVKindDrift) -> str:
    """Why a kind's bytes per position differ from its long-term layout: positions still in the
    full-precision residual (quantized kinds), positions a sliding window no longer holds."""
    full = k.stored_positions - k.quantized_positions
    if k.kind.startswith("quantized-") and full > 0:
        if full >= k.cache_positions:
            return f"all {k.cache_positions} positions are in the full-precision residual (it outlasts the run)"
        return f"the last {full} of {k.cache_positions} positions are in the full-precision residual"
    if k.kind.startswith("sliding-") and k.stored_positions < k.cache_positions:
        return f"the window holds {k.stored_positions} of the {k.cache_positions} positions"
    return ""


def measured_vs_formula(k: KVKindDrift) -> str:
    """``measured X vs formula Y (+Z%)`` per position, from the kind's own numbers, then what the
    measurement holds that the long-term formula does not, and the whole cache's bytes against the
    formula applied to the positions it really holds (packed values, scales and zeros, residual)."""
    text = compare_numbers(k.bytes_per_token, k.formula_bytes_per_token)
    why = _held_differently(k)
    if why and round(k.bytes_per_token) != round(k.formula_bytes_per_token):
        text += f": {why}"
    if k.cache_bytes == k.formula_bytes:
        return text + f"; whole cache {k.cache_bytes:,} bytes = formula for the positions held"
    change = f" ({(k.cache_bytes - k.formula_bytes) / k.formula_bytes:+.1%})" if k.formula_bytes else ""
    return text + f"; whole cache {k.cache_bytes:,} bytes vs formula {k.formula_bytes:,} for the positions held{change}"


def kind_rows(report: KVDriftReport) -> list[list[str]]:
    """One row of display strings per measured kind (headers: KIND_HEADERS), then one per failure."""
    rows = []
    for k in report.kinds:
        rows.append([k.kind, f"{k.bytes_per_token:,.0f}", f"{k.formula_bytes_per_token:,.0f}",
                     measured_vs_formula(k), f"{k.tokens_per_s:.2f}", f"{k.mean_kl:.4g}", f"{k.max_kl:.4g}",
                     percent(k.top1_agreement), _divergence(k)])
    rows += [[kind, "", "", "", "", "", "", "", f"failed: {message}"] for kind, message in report.errors.items()]
    return rows


def memory_figure(report: KVDriftReport) -> go.Figure:
    """Cache KB against the positions the cache stands for, one line per kind (free-running runs):
    dynamic grows in a straight line, quantized kinds in steps (each residual flush), a sliding
    window levels off."""
    fig = go.Figure()
    for k in report.kinds:
        fig.add_trace(go.Scatter(x=k.memory_positions, y=[b / KB for b in k.memory_bytes], mode="lines", name=k.kind,
                                 line={"color": colour(k.kind), "shape": "hv"},
                                 hovertemplate="%{x} positions: %{y:,.1f} KB<extra>" + k.kind + "</extra>"))
    fig.update_layout(title="KV cache memory over the run", xaxis_title="positions (prompt + generated)",
                      yaxis_title="KB", yaxis={"rangemode": "tozero"}, **LAYOUT)
    return fig


def bytes_per_token_figure(report: KVDriftReport) -> go.Figure:
    """Per kind: bytes per position measured from the tensors at the end of the run (full-precision
    residual included) next to the formula for the kind's long-term layout."""
    kinds = [k.kind for k in report.kinds]
    fig = go.Figure()
    fig.add_trace(go.Bar(x=kinds, y=[k.bytes_per_token for k in report.kinds],
                         name="measured (cache tensors, full-precision residual included)",
                         marker={"color": [colour(k) for k in kinds]},
                         hovertemplate="%{x}: %{y:,.0f} bytes per position<extra>measured</extra>"))
    fig.add_trace(go.Bar(x=kinds, y=[k.formula_bytes_per_token for k in report.kinds], name="formula (long-term layout)",
                         marker={"color": "rgba(0,0,0,0)", "line": {"color": "#222", "width": 2}},
                         customdata=[k.formula for k in report.kinds],
                         hovertemplate="%{customdata}<extra>formula</extra>"))
    fig.update_layout(title="Bytes per token: measured vs formula", yaxis_title="bytes per position", barmode="group",
                      **LAYOUT)
    return fig


def kind_drift_figure(report: KVDriftReport) -> go.Figure:
    """KL(p_full || p_kind) per step, teacher-forced, one line per kind (dynamic left out: it is the
    yardstick); a diamond marks the free-running run's first divergence."""
    fig = go.Figure()
    for k in report.kinds:
        if k.kind == "dynamic":
            continue
        fig.add_trace(go.Scatter(x=[p.index for p in k.positions], y=[p.kl for p in k.positions], mode="lines+markers",
                                 name=k.kind, line={"color": colour(k.kind)},
                                 hovertemplate="step %{x}: KL %{y:.4g} nats<extra>" + k.kind + "</extra>"))
        at = k.first_divergence
        if at is not None and at < len(k.positions):
            fig.add_trace(go.Scatter(x=[at], y=[k.positions[at].kl], mode="markers", name=f"{k.kind} diverges",
                                     marker={"symbol": "diamond", "size": 13, "color": colour(k.kind),
                                             "line": {"color": "#222", "width": 1}},
                                     hovertemplate="own run leaves the reference at step %{x}<extra></extra>"))
    fig.update_layout(title="Drift per step against the full-precision cache (teacher-forced)",
                      xaxis_title="step", yaxis_title="KL (nats)", yaxis={"rangemode": "tozero"}, **LAYOUT)
    return fig


def calculator_rows(rows: Sequence[MemoryEstimate]) -> list[list[str]]:
    """Display strings (headers: CALCULATOR_HEADERS)."""
    return [[r.name, r.attention.upper(), str(r.kv_heads), f"{r.kv_bytes_per_token:,.0f}", f"{r.kv_cache_gb:,.2f}",
             f"{r.weights_gb:,.2f}", f"{r.total_gb:,.2f}"] for r in rows]


def calculator_figure(rows: Sequence[MemoryEstimate]) -> go.Figure:
    """Stacked bars per variant (MHA / GQA / MQA): weights GB, then KV cache GB on top."""
    names = [f"{r.attention.upper()} ({r.kv_heads} KV head{'' if r.kv_heads == 1 else 's'})" for r in rows]
    fig = go.Figure()
    fig.add_trace(go.Bar(x=names, y=[r.weights_gb for r in rows], name="weights", marker={"color": "#bab0ac"},
                         hovertemplate="%{x}: weights %{y:,.2f} GB<extra></extra>"))
    fig.add_trace(go.Bar(x=names, y=[r.kv_cache_gb for r in rows], name="KV cache",
                         marker={"color": [ATTENTION_COLOURS[r.attention] for r in rows]},
                         hovertemplate="%{x}: KV cache %{y:,.2f} GB<extra></extra>"))
    fig.update_layout(title="Memory: weights + KV cache", yaxis_title="GB", barmode="stack", **LAYOUT)
    return fig
