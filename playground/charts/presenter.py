"""The presenter view's stage chart: a step's stage chart at projector size (moved here from
playground/panels/presenter.py so the what-if service draws it without importing a view)."""

from __future__ import annotations

import math

import plotly.graph_objects as go

from engine.trace import StepTrace

from . import step as charts
from .explain import LOCAL, Source
from .compare import legible_stage_chart  # a T=5 step's panels on their own scale, p filled in
from .step import NARROW_PX, PHONE_PX, panel_columns  # shared with the Step view's chart

BIG_FONT = 22  # px: token labels at projector distance (the issue asks >= 18 px at 1280x720)
PHONE_FONT = 16  # px: a phone is read at arm's length, and 22 px labels do not fit 2 panels in 390 px
WIDE_TICK_FONT = 18  # px: token labels when a panel has more than 7 bars (10 fit 720 px at 18, not at 22)
BAR_PX = 24  # px a bar on a narrow page (16 px labels with room between them)
CHAR_EM = 0.62  # a generous average glyph width of the chart font, in em (the room token labels need)


def step_chart(step: StepTrace, width: float | None = None, source: Source = LOCAL) -> go.Figure:
    """A step's stage chart at projector size, laid out for a page ``width`` px wide. Every bar
    keeps its token label (plotly would drop every other one where they crowd). Wide: no fixed
    height, the figure fills its box, which the page's CSS sizes to the free viewport. Narrow
    (< NARROW_PX): a fixed height of BAR_PX a bar that the overlay scrolls, two panels a row with
    the gap between them as wide as the token labels (else they lie over the left panel's bars),
    one a row on a phone (< PHONE_PX). ``layout.meta`` says which layout it is, so the page can ask
    for the other one on a resize. ``source``: where the numbers come from (``explain.source_of``)."""
    panels = len(step.stages) + (1 if step.draw is not None else 0)
    narrow = width is not None and width < NARROW_PX
    phone = width is not None and width < PHONE_PX
    columns = 1 if phone else panel_columns(panels, width)
    rows = math.ceil(panels / columns)
    bars = max(charts.panel_rows(step), default=1)
    font = PHONE_FONT if narrow else BIG_FONT
    tick_font = font if narrow or (rows == 1 and bars <= 7) else WIDE_TICK_FONT  # 10 bars fit 720 px at 18 px
    if narrow and width is not None:  # (narrow: a width was given)
        label_px = max((len(t) for t in charts.tick_labels(step)), default=4) * CHAR_EM * tick_font + 12
        gap = min(0.45, label_px / max(1.0, width - 40 - label_px)) if columns > 1 else 0.12
        fig = legible_stage_chart(step, source, columns=columns, gap_px=130, panel_px=int(bars * BAR_PX), column_gap=gap)
    else:
        fig = legible_stage_chart(step, source, columns=columns)
    fig.update_layout(font=dict(size=font), title_font_size=font + 4, legend_font_size=font - 2,
                      meta={"narrow": narrow, "phone": phone, "columns": columns},
                      margin=dict(l=10, r=20, t=110 + 40 * min(rows, 2), b=70))
    if narrow:  # a phone's height goes to the bars: no legend (the Step through view has it), less margin
        fig.update_layout(showlegend=False, margin=dict(l=4, r=8, t=100, b=10), autosize=True)
    else:
        fig.update_layout(height=None, autosize=True)
    fig.update_layout(title=dict(y=1, yanchor="top", pad=dict(t=24)))  # a smaller pad clips the first line
    fig.update_yaxes(tickfont=dict(size=tick_font), tickmode="linear", dtick=1)  # every category labelled
    fig.update_xaxes(tickfont=dict(size=font - 4))
    fig.update_annotations(font_size=font)
    return fig
