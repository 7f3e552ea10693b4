"""RTN vs GPTQ vs AWQ vs NF4 vs int8: pure functions of MethodComparison / InsideLayer -> table
rows, plotly figures and sentences (every sentence is made from the numbers its chart draws)."""

from __future__ import annotations

import html

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from engine.numbers import percent
from engine.reports.quant_report import HeldoutScore, InsideLayer, MethodComparison
from .compare import with_phone_layout
from .quantization import colour, variant_label
from .step import FONT

MB = 1024 * 1024
COMPARE_HEADERS = ["variant", "method", "bits / weight", "held-out perplexity", "mean KL vs fp32 (nats)",
                   "top-1 vs fp32", "on disk MB", "in memory MB (as run)", "4-bit Linear weights + scales MB",
                   "made in s"]


def comparison_rows(report: MethodComparison) -> list[list]:
    """One row per measured variant (COMPARE_HEADERS), then one per failed variant."""
    rows = [[variant_label(r.variant), r.about, f"{r.bits_per_weight:.2f}", f"{r.perplexity:.1f}",
             "reference" if r.variant == "none" else f"{r.mean_kl:.3f}",
             "reference" if r.variant == "none" else percent(r.top1_agreement),
             f"{r.disk_bytes / MB:.0f}" if r.disk_bytes else "—", f"{r.memory_bytes / MB:.0f}",
             f"{r.packed_bytes / MB:.0f}" if r.packed_bytes else "—", f"{r.quantize_s:.0f}" if r.quantize_s else "—"]
            for r in report.rows]
    rows += [[variant_label(v), f"failed: {message}", *[""] * 8] for v, message in report.errors.items()]
    return rows


def _change(row: HeldoutScore, base: HeldoutScore) -> str:
    return f"{(row.perplexity - base.perplexity) / base.perplexity:+.1%}"


def comparison_sentence(report: MethodComparison) -> str:
    """What the table says about GPTQ and AWQ against round-to-nearest at each group size."""
    ref = report.row("none")
    parts = [f"fp32 perplexity {ref.perplexity:.1f} on {report.heldout_tokens} held-out tokens."] if ref else []
    for group in (64, 32):
        rtn = report.row(f"rtn-g{group}")
        if rtn is None:
            continue
        said = [f"group {group}: RTN {rtn.perplexity:.1f} (KL {rtn.mean_kl:.3f})"]
        for method in ("gptq", "awq"):
            row = report.row(f"{method}-g{group}")
            if row is not None:
                verdict = "beats" if row.perplexity < rtn.perplexity and row.mean_kl < rtn.mean_kl else "does not beat"
                said.append(f"{method.upper()} {row.perplexity:.1f} (KL {row.mean_kl:.3f}, {_change(row, rtn)} "
                            f"perplexity vs RTN: {verdict} RTN)")
        parts.append("; ".join(said) + ".")
    nf4 = report.row("nf4")
    if nf4 is not None:
        parts.append(f"NF4 (bitsandbytes, {nf4.bits_per_weight:.1f} bits) {nf4.perplexity:.1f} (KL {nf4.mean_kl:.3f}).")
    return " ".join(parts)


TITLES = ("held-out perplexity (lower is better)", "mean KL from fp32, nats (lower is better)")
ROW_PX = 24  # a variant's bar: its name, level, at 14 px on every layout


def comparison_figure(report: MethodComparison) -> go.Figure:
    """Held-out perplexity and mean KL from fp32, a horizontal bar per variant (its name level, at
    any width): the two side by side, sharing the names; in a box narrower than a phone's
    (compare.PHONE_LAYOUT_PX) one above the other, each with its names (the page swaps the
    layouts: compare.with_phone_layout). A phone's 326 px held both, names turned 40° over each other."""
    return with_phone_layout(_comparison(report, phone=False), _comparison(report, phone=True))


def _comparison(report: MethodComparison, phone: bool) -> go.Figure:
    rows = report.rows
    fig = make_subplots(rows=2 if phone else 1, cols=1 if phone else 2, subplot_titles=TITLES,
                        horizontal_spacing=0.06, vertical_spacing=90 / _height(len(rows), phone))
    names = [variant_label(r.variant) for r in rows]
    colours = [colour(r.variant) for r in rows]
    hover = [html.escape(f"{r.about} · {r.bits_per_weight:.2f} bits/weight") for r in rows]
    for i, (values, text, what) in enumerate((([r.perplexity for r in rows], [f"{r.perplexity:.1f}" for r in rows],
                                                "perplexity %{x:.1f}"),
                                               ([r.mean_kl for r in rows], [f"{r.mean_kl:.2f}" for r in rows],
                                                "KL %{x:.3f} nats"))):
        fig.add_trace(go.Bar(y=names, x=values, orientation="h", marker_color=colours, customdata=hover, text=text,
                             textposition="outside", cliponaxis=False,
                             hovertemplate="%{y}: " + what + "<br>%{customdata}<extra></extra>"),
                      row=i + 1 if phone else 1, col=1 if phone else i + 1)
    ref = report.row("none")
    if ref is not None:  # dotted: where fp32 is (its own bar is in the list too)
        fig.add_vline(x=ref.perplexity, line_dash="dot", line_color=colour("none"), row=1, col=1)
    top_ppl = max([r.perplexity for r in rows] or [1.0])
    top_kl = max([r.mean_kl for r in rows] or [0.1])
    fig.update_xaxes(range=[0, top_ppl * 1.25], row=1, col=1)  # room for the numbers beside the bars
    fig.update_xaxes(range=[0, max(top_kl, 0.01) * 1.3], row=2 if phone else 1, col=1 if phone else 2)
    fig.update_yaxes(autorange="reversed", tickmode="linear", dtick=1, automargin=True, tickfont={"size": FONT})
    if not phone:  # the right panel's bars are the left panel's rows: its names once, on the left
        fig.update_yaxes(matches="y", showticklabels=False, row=1, col=2)
    fig.update_xaxes(nticks=4, tickfont={"size": FONT})
    fig.update_layout(showlegend=False, height=_height(len(rows), phone), font={"size": FONT},
                      margin={"l": 10, "r": 30, "t": 40, "b": 30}, title={"text": "", "x": 0.01})  # b: the x ticks
    fig.update_annotations(font_size=FONT)
    return fig


def _height(variants: int, phone: bool) -> int:
    """The figure's height: a row per variant (twice on a phone, panels stacked), titles and ticks."""
    return (2 if phone else 1) * (max(variants, 2) * ROW_PX + 40) + (90 if phone else 0) + 70  # margins 40 + 30


def inside_sentence(report: InsideLayer) -> str:
    """The layer's mean errors per method and what AWQ's scales follow."""
    errors = "; ".join(f"{name}: weight {report.mean_weight_error[name]:.1%}, output {report.mean_output_error[name]:.1%}"
                       for name in report.methods)
    return (f"Layer {report.layer} {report.module}, group {report.group_size}, mean relative error per output channel "
            f"(weights; outputs on {report.input_tokens} held-out tokens): {errors}. AWQ's scales rank the input "
            f"channels like their mean |activation| (Spearman {report.scale_activation_correlation:+.2f}).")


def inside_figure(report: InsideLayer) -> go.Figure:
    """Per output channel: relative weight error (top) and relative output error (bottom), one line per method."""
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.12,
                        subplot_titles=("weight error ‖Ŵᵢ − Wᵢ‖ / ‖Wᵢ‖", "output error ‖(Ŵᵢ − Wᵢ)X‖ / ‖WᵢX‖"))
    for row, errors in ((1, report.weight_error), (2, report.output_error)):
        for name in report.methods:
            values = errors[name]
            fig.add_trace(go.Scatter(x=list(range(len(values))), y=values, mode="lines", name=name,
                                     legendgroup=name, showlegend=row == 1, line={"color": colour(name), "width": 1},
                                     hovertemplate=f"{name}<br>output channel %{{x}}: %{{y:.2%}}<extra></extra>"),
                          row, 1)
    fig.update_yaxes(tickformat=".0%", rangemode="tozero")
    fig.update_xaxes(title_text="output channel", row=2, col=1)
    fig.update_layout(height=460, font={"size": FONT}, margin={"l": 60, "r": 10, "t": 50, "b": 10},
                      legend={"orientation": "h", "x": 0, "y": -0.18, "yanchor": "top"})
    fig.update_annotations(font_size=FONT)
    return fig


def scales_figure(report: InsideLayer) -> go.Figure:
    """AWQ's scale of each input channel against that channel's mean |activation| (log-log)."""
    fig = go.Figure(go.Scatter(
        x=report.activation_mean_abs, y=report.awq_scales, mode="markers",
        marker={"color": colour("awq"), "size": 6, "opacity": 0.7},
        hovertemplate="input channel %{pointNumber}<br>mean |x| %{x:.3g}<br>AWQ scale %{y:.3g}<extra></extra>"))
    fig.update_layout(
        title={"text": f"AWQ scales vs activation size<br><sup>layer {report.layer} {report.module}: Spearman "
                       f"{report.scale_activation_correlation:+.2f}</sup>", "x": 0.01, "font": {"size": FONT + 2}},
        xaxis={"type": "log", "title": "mean |activation| of the input channel (calibration set)"},
        yaxis={"type": "log", "title": "AWQ scale s"}, height=420, font={"size": FONT},
        margin={"l": 60, "r": 10, "t": 70, "b": 10})
    return fig
