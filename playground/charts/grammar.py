"""The grammar's distortion (engine.reports.distortion) as a chart: for each string of the grammar,
how often masked decoding writes it beside how likely the model finds it as a whole reply (the
model conditioned on the grammar). Pure: a report in, a figure out."""

from __future__ import annotations

import html

import plotly.graph_objects as go

from engine.reports.distortion import DistortionReport

from .step import ACCENT, BAR, FONT, short_label
from .tokens import render as readable

EXACT = "the model, conditioned on the grammar"
MASKED = "masked decoding (what the grammar stage samples)"


def distortion_figure(report: DistortionReport, limit: int = 12) -> go.Figure:
    """Grouped bars per string (most likely under the model first, at most ``limit``): the exact
    conditional probability and masked decoding's, with the total variation in the title."""
    shown = report.strings[:limit]
    labels = [short_label(readable(s.text) or "(empty)", 16) for s in shown]
    fig = go.Figure()
    for name, values, colour in ((EXACT, [s.exact for s in shown], BAR), (MASKED, [s.masked for s in shown], ACCENT)):
        fig.add_trace(go.Bar(y=labels, x=values, name=name, orientation="h", marker_color=colour,
                             text=[f"{v:.0%}" for v in values], textposition="outside", cliponaxis=False,
                             textfont=dict(size=FONT), hovertemplate="%{y}: %{x:.2%}<extra>" + html.escape(name)
                             + "</extra>"))
    more = f" · {len(report.strings) - limit} more not shown" if len(report.strings) > limit else ""
    title = (f"What masking costs: total variation {report.total_variation:.2f}<br><sup>unconstrained, the model writes "
             f"one of these and stops with p = {report.allowed_mass:.1e}{more}</sup>")
    fig.update_layout(title=dict(text=title, x=0.01, font=dict(size=FONT + 2)), barmode="group", template="plotly_white",
                      font=dict(size=FONT), height=max(320, 150 + 70 * len(shown)), margin=dict(l=10, r=30, t=80, b=40),
                      legend=dict(orientation="h", x=0, y=-0.12, yanchor="top", font=dict(size=FONT)),
                      xaxis=dict(tickformat=".0%", range=[0, 1.1], tickfont=dict(size=FONT)))
    fig.update_yaxes(autorange="reversed", automargin=True, tickfont=dict(size=FONT))
    return fig
