"""Inside the model charts (issue #54): pure functions of the engine's reports -> plotly figures,
highlight data and table rows. Each figure's numbers are the report's own, the same ones its
``sentence()`` reads, so the words beside a chart say what it draws. No gradio here.
"""

from __future__ import annotations

import html
from typing import Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from engine.reports.calibration import CalibrationReport
from engine.reports.lens import LogitLens
from engine.reports.ranks import BEYOND, BUCKET_NAMES, UNRANKED, TokenRanks
from engine.reports.uncertainty import UncertaintySeries
from engine.reports.watermark import Detection, Robustness

from .step import ENTROPY, FONT, MARKER, SURPRISAL
from .tokens import render as readable
from .tokens import render_flow

# GLTR's colours (green, yellow, red, purple), darkened where text sits on them; >= 3:1 as fills
RANK_COLOURS = {"top-10": "#7fc97f", "top-100": "#f2d45c", "top-1000": "#f28e8e", BEYOND: "#c5a3e0",
                UNRANKED: "#e0e0e0"}
GREEN, RED, UNSCORED = "#7fc97f", "#f28e8e", "#e0e0e0"
WATERMARK_COLOURS = {"green": GREEN, "red": RED, "not scored": UNSCORED}
LAYOUT = dict(template="plotly_white", font=dict(size=FONT), margin=dict(l=10, r=10, t=30, b=10))
ROW_PX = 22  # a layer's row in the lens grid: one line of 14 px text and its gap
LENS_LINES_PX = 200


def rank_highlights(ranks: TokenRanks) -> list[tuple[str, str]]:
    """(token text, bucket) pairs for gr.HighlightedText with ``RANK_COLOURS``."""
    return [(render_flow(t.token), t.bucket) for t in ranks.tokens]


def watermark_highlights(found: Detection) -> list[tuple[str, str]]:
    """(token text, green | red | not scored) pairs for gr.HighlightedText with ``WATERMARK_COLOURS``."""
    return [(render_flow(t.token), "not scored" if not t.scored else "green" if t.green else "red")
            for t in found.tokens]


def lens_figure(lens: LogitLens) -> go.Figure:
    """Layers (rows, the embeddings at the bottom) × each layer's top tokens (columns, most likely
    first), coloured by probability, the followed token's cells outlined; under it the followed
    token's probability and the read-out's entropy by layer."""
    layers = [x.layer for x in lens.layers]
    grid = ROW_PX * len(layers)
    fig = make_subplots(rows=2, cols=1, row_heights=[grid, LENS_LINES_PX], vertical_spacing=90 / (grid + 400),
                        subplot_titles=(f"each layer's top {lens.top_k} (most likely first)",
                                        f"p of {readable(lens.chosen_token)} and entropy by layer"))
    z = [[t.prob for t in x.top] for x in lens.layers]
    text = [[html.escape(readable(t.token), quote=False) for t in x.top] for x in lens.layers]
    fig.add_trace(go.Heatmap(z=z, x=list(range(1, lens.top_k + 1)), y=layers, text=text, texttemplate="%{text}",
                             colorscale=[[0, "#ffffff"], [1, "#7fb2e5"]], zmin=0, zmax=1, showscale=False,
                             xgap=1, ygap=1,
                             hovertemplate="layer %{y}, rank %{x}: %{text}<br>p = %{z:.3f}<extra></extra>"), 1, 1)
    hits = [(rank_at, x.layer) for x in lens.layers for rank_at, t in enumerate(x.top, start=1)
            if t.token_id == lens.chosen_token_id]
    fig.add_trace(go.Scatter(x=[h[0] for h in hits], y=[h[1] for h in hits], mode="markers", name="the chosen token",
                             marker=dict(symbol="square-open", size=16, color=MARKER, line=dict(width=2)),
                             hoverinfo="skip"), 1, 1)
    fig.add_trace(go.Scatter(x=layers, y=[x.chosen_prob for x in lens.layers], mode="lines+markers", name="p (chosen)",
                             line=dict(color=SURPRISAL), customdata=[[x.chosen_rank] for x in lens.layers],
                             hovertemplate="layer %{x}: p = %{y:.3f}, rank %{customdata[0]:,}<extra></extra>"), 2, 1)
    fig.add_trace(go.Scatter(x=layers, y=[x.entropy for x in lens.layers], mode="lines", name="entropy (nats)",
                             line=dict(color=ENTROPY, dash="dot"),
                             hovertemplate="layer %{x}: H = %{y:.2f} nats<extra></extra>"), 2, 1)
    fig.update_yaxes(title="layer", dtick=max(1, len(layers) // 8), row=1, col=1)
    fig.update_xaxes(dtick=1, showticklabels=False, row=1, col=1)
    fig.update_yaxes(title="p / nats", rangemode="tozero", row=2, col=1)
    fig.update_xaxes(title="layer", row=2, col=1)
    fig.update_layout(height=grid + LENS_LINES_PX + 230, legend=dict(orientation="h", x=0, y=-0.06, yanchor="top"),
                      **LAYOUT)
    return fig


def rank_histogram(runs: Sequence[tuple[str, TokenRanks]]) -> go.Figure:
    """The share of each text's ranked tokens in each GLTR bucket, the texts side by side."""
    fig = go.Figure()
    for label, ranks in runs:
        fig.add_trace(go.Bar(x=list(BUCKET_NAMES), y=[ranks.share(b) for b in BUCKET_NAMES], name=label,
                             customdata=[[ranks.histogram.get(b, 0)] for b in BUCKET_NAMES],
                             hovertemplate="%{x}: %{y:.0%} (%{customdata[0]} tokens)<extra></extra>"))
    fig.update_layout(height=300, barmode="group", yaxis=dict(tickformat=".0%", title="share of tokens"),
                      xaxis_title="rank of the real token", legend=dict(orientation="h", x=0, y=-0.3, yanchor="top"),
                      **LAYOUT)
    return fig


def detection_figure(found: Detection) -> go.Figure:
    """The running z-score after each scored token, the threshold as a line."""
    xs = list(range(1, len(found.z_series) + 1))
    fig = go.Figure(go.Scatter(x=xs, y=found.z_series, mode="lines", name="z so far", line=dict(color=ENTROPY),
                               hovertemplate="after %{x} scored tokens: z = %{y:.2f}<extra></extra>"))
    fig.add_hline(y=found.threshold, line_dash="dash", line_color=SURPRISAL)
    fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", name=f"threshold z = {found.threshold:g}",
                             line=dict(color=SURPRISAL, dash="dash"), hoverinfo="skip"))
    fig.update_layout(height=280, xaxis_title="scored tokens", yaxis_title="z",
                      legend=dict(orientation="h", x=0, y=-0.35, yanchor="top"), **LAYOUT)
    return fig


ROBUST_HEADERS = ["case", "z", "green share", "scored tokens", "detected"]


def robustness_rows(report: Robustness) -> list[list[str]]:
    """One row per case of the wash-out report (``ROBUST_HEADERS``)."""
    return [[r.case, "—" if r.z is None else f"{r.z:.2f}",
             "—" if r.green_fraction is None else f"{r.green_fraction:.0%}", str(r.scored),
             "yes" if r.detected else "no"] for r in report.rows]


def reliability_figure(report: CalibrationReport, beside: Sequence[CalibrationReport] = ()) -> go.Figure:
    """The reliability diagram at T = 1 and at the best T (accuracy per confidence bin against the
    diagonal of a calibrated model), and under it the ECE (right axis) and NLL over the temperatures;
    ``beside``: other variants' T = 1 curves (fp32 beside a quantized model)."""
    fig = make_subplots(rows=2, cols=1, row_heights=[0.62, 0.38], vertical_spacing=0.2,
                        specs=[[{}], [{"secondary_y": True}]],
                        subplot_titles=("accuracy against confidence", "NLL and ECE by temperature"))
    fig.add_trace(go.Scatter(x=[0, 1], y=[0, 1], mode="lines", name="calibrated", line=dict(color="#767676", dash="dot"),
                             hoverinfo="skip"), 1, 1)
    for calibration, colour in ((report.at_one, SURPRISAL), (report.at_best, ENTROPY)):
        shown = [b for b in calibration.bins if b.count]
        fig.add_trace(go.Scatter(x=[b.confidence for b in shown], y=[b.accuracy for b in shown], mode="lines+markers",
                                 name=f"{_variant(report)}, T = {calibration.temperature:.2f} (ECE {calibration.ece:.3f})",
                                 line=dict(color=colour), marker=dict(size=[6 + 14 * (b.count / report.tokens) ** 0.5
                                                                            for b in shown]),
                                 customdata=[[b.count, b.low, b.high] for b in shown],
                                 hovertemplate="confidence %{x:.2f} (bin %{customdata[1]:.2f}–%{customdata[2]:.2f}, "
                                               "%{customdata[0]} positions): right %{y:.0%}<extra></extra>"), 1, 1)
    for other in beside:
        shown = [b for b in other.at_one.bins if b.count]
        fig.add_trace(go.Scatter(x=[b.confidence for b in shown], y=[b.accuracy for b in shown], mode="lines+markers",
                                 name=f"{_variant(other)}, T = 1 (ECE {other.at_one.ece:.3f})",
                                 line=dict(color="#5e5e5e", dash="dash"),
                                 hovertemplate="confidence %{x:.2f}: right %{y:.0%}<extra></extra>"), 1, 1)
    sweep = sorted([*report.sweep, report.at_best], key=lambda c: c.temperature)
    ts = [c.temperature for c in sweep]
    fig.add_trace(go.Scatter(x=ts, y=[c.nll for c in sweep], mode="lines+markers", name="NLL (nats)",
                             line=dict(color=ENTROPY, dash="dot"),
                             hovertemplate="T %{x:.2f}: NLL %{y:.3f} nats<extra></extra>"), 2, 1, secondary_y=False)
    fig.add_trace(go.Scatter(x=ts, y=[c.ece for c in sweep], mode="lines+markers", name="ECE (right axis)",
                             line=dict(color=MARKER), hovertemplate="T %{x:.2f}: ECE %{y:.3f}<extra></extra>"),
                  2, 1, secondary_y=True)
    fig.add_vline(x=report.best_temperature, line_color=ENTROPY, line_dash="dash", row=2, col=1)
    fig.update_xaxes(title="confidence (top token's p)", range=[0, 1], row=1, col=1)
    fig.update_yaxes(title="right", range=[0, 1], tickformat=".0%", row=1, col=1)
    fig.update_xaxes(title="temperature", type="log", row=2, col=1)
    fig.update_yaxes(title="NLL", row=2, col=1, secondary_y=False)
    fig.update_yaxes(title="ECE", rangemode="tozero", row=2, col=1, secondary_y=True)
    fig.update_layout(height=680, legend=dict(orientation="h", x=0, y=-0.12, yanchor="top"), **LAYOUT)
    return fig


def _variant(report: CalibrationReport) -> str:
    return "fp32" if report.quantization == "none" else report.quantization


def uncertainty_figure(series: UncertaintySeries, selected: int | None = None) -> go.Figure:
    """Entropy and varentropy per step, the hesitation steps marked (both above their thresholds)."""
    xs = [s.index for s in series.steps]
    tokens = [[html.escape(readable(s.token)), s.quadrant] for s in series.steps]
    which = "raw" if series.raw else "final"
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=xs, y=[s.entropy for s in series.steps], mode="lines+markers", name=f"{which} entropy (nats)",
                             line=dict(color=ENTROPY), customdata=tokens,
                             hovertemplate="step %{x}: %{customdata[0]}<br>H = %{y:.2f} nats (%{customdata[1]})"
                                           "<extra></extra>"))
    fig.add_trace(go.Scatter(x=xs, y=[s.varentropy for s in series.steps], mode="lines+markers",
                             name=f"{which} varentropy (nats²)", line=dict(color=SURPRISAL, dash="dot"),
                             marker=dict(symbol="square"), customdata=tokens,
                             hovertemplate="step %{x}: %{customdata[0]}<br>V = %{y:.2f} nats²<extra></extra>"))
    hesitant = [s for s in series.steps if s.hesitant]
    fig.add_trace(go.Scatter(x=[s.index for s in hesitant], y=[s.entropy for s in hesitant], mode="markers",
                             name="hesitation", marker=dict(symbol="star", size=14, color=MARKER),
                             hovertemplate="step %{x}: hesitates<extra></extra>"))
    if selected is not None:
        fig.add_vline(x=selected, line_color=MARKER, line_width=1, opacity=0.6)
    fig.update_layout(height=300, xaxis_title="step", yaxis=dict(rangemode="tozero"),
                      legend=dict(orientation="h", x=0, y=-0.3, yanchor="top"), **LAYOUT)
    return fig


def legend_html(colours: dict[str, str], title: str) -> str:
    """A one-line legend of coloured chips (what a highlight's categories mean)."""
    chips = "".join(f'<span style="display:inline-block;padding:0 6px;margin:0 4px;border-radius:3px;'
                    f'background:{c};color:#222">{html.escape(name)}</span>' for name, c in colours.items())
    return f'<div class="dp-colour-legend" style="font-size:14px;color:#333">{html.escape(title)}: {chips}</div>'
