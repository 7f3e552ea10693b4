"""The presenter view's stage chart: a step's stage chart at projector size (moved here from
playground/panels/presenter.py so the what-if service draws it without importing a view)."""

from __future__ import annotations

import math
import re

import plotly.graph_objects as go

from engine.trace import StepTrace

from . import step as charts
from .explain import LOCAL, Source
from .compare import legible_stage_chart  # a T=5 step's panels on their own scale, p filled in
from .step import FONT, NARROW_PX, PHONE_PX, TITLE_WRAP, panel_columns, title_px  # shared with the Step view's chart

BIG_FONT = 22  # px: token labels at projector distance (the issue asks >= 18 px at 1280x720)
PHONE_FONT = 16  # px: a phone is read at arm's length, and 22 px labels do not fit 2 panels in 390 px
WIDE_TICK_FONT = 18  # px: token labels when a panel has more than 7 bars (10 fit 720 px at 18, not at 22)
BAR_PX = 24  # px a bar on a narrow page (16 px labels with room between them)
CHAR_EM = 0.62  # a generous average glyph width of the chart font, in em (the room token labels need)
TITLE_FONT = 18  # px: the panels' titles on a projector, as large as their token labels
ROW_EM = 1.25  # a labelled bar's row, in em of its label: the label's box (~1.2 em) and a gap


PRESENT_BOX_PX = 460  # the chart's box on a 1280x720 projector: the height the overlay's controls leave
PRESENT_COLUMNS = 6  # a projector's panels in one row up to this many (two rows of 463 px left ~150 px a panel)
TITLE_TOP_PX = 90  # the chart's own title (its 26 px line and <sup> line, under its 24 px pad) and a gap
BOTTOM_PX = 40  # the x tick labels (no legend on a projector: the overlay names the chosen token)


def wide_columns(panels: int, width: float | None) -> int:
    """Panels a row on a wide page: all of them up to PRESENT_COLUMNS (the chart's height holds
    one row of labelled bars, not two), else as Step through lays them out."""
    return panels if panels <= PRESENT_COLUMNS else panel_columns(panels, width)


def title_wrap(width: float | None, columns: int, column_gap: float = 0.12) -> int:
    """Characters a panel title's line holds at TITLE_FONT: as wide as from one panel's middle to
    the next (its neighbour's title starts there), for a page ``width`` px wide (None: 1280)."""
    pitch = (width or 1280) * ((1 - (columns - 1) * column_gap) / columns + column_gap)
    return max(TITLE_WRAP, int(pitch / (TITLE_FONT * CHAR_EM)) - 1)


def right_margin(titles: list[str], columns: int, width: float | None, column_gap: float = 0.12) -> int:
    """The right margin (px) that holds the last column's titles, centred over a panel narrower than
    their lines (six panels at 1280 px: "where the draw landed" ran 11 px past the figure's edge)."""
    panel = ((width or 1280) - 30) * (1 - (columns - 1) * column_gap) / columns
    last = [t for i, t in enumerate(titles) if i % columns == columns - 1]
    line = max((len(re.sub("<[^>]+>", "", x)) for t in last for x in t.split("<br>")), default=0)
    return max(20, math.ceil(line * TITLE_FONT * CHAR_EM / 2 - panel / 2) + 4)


def step_chart(step: StepTrace, width: float | None = None, source: Source = LOCAL) -> go.Figure:
    """A step's stage chart at projector size, laid out for a page ``width`` px wide. Every bar
    keeps its token label (plotly would drop every other one where they crowd). Wide: the panels
    in one row (``wide_columns``), titles wrapped to the room between panels, their height in the
    top margin, at most as many rows a panel as PRESENT_BOX_PX holds labelled (the rest of the
    tokens a stage removed summed in one row); no fixed height, the figure fills its box, which
    the page's CSS sizes to the free viewport. Narrow (< NARROW_PX): a fixed height of BAR_PX a
    bar that the overlay scrolls, two panels a row with the gap between them as wide as the token
    labels (else they lie over the left panel's bars), one a row on a phone (< PHONE_PX).
    ``layout.meta`` says which layout it is, so the page can ask for the other one on a resize.
    ``source``: where the numbers come from (``explain.source_of``)."""
    panels = len(step.stages) + (1 if step.draw is not None else 0)
    if width is not None and width < NARROW_PX:
        return _narrow_chart(step, width, width < PHONE_PX, source)
    columns = wide_columns(panels, width)
    rows = math.ceil(panels / columns)
    wrap = title_wrap(width, columns)
    titles = charts.panel_titles(step, wrap, source)
    heads = [title_px(t, TITLE_FONT / (FONT + 1)) for t in titles]
    top = TITLE_TOP_PX + max(heads[:columns], default=0)
    area = (PRESENT_BOX_PX - top - BOTTOM_PX) / rows
    fit = max(1, int(area // (WIDE_TICK_FONT * ROW_EM)))
    bars = max(charts.panel_rows(step, fit), default=1)
    # never under 18 px: a top-N of 10 and the chosen token after a gap (12 rows, T 2.5) sit at ~20 px a
    # row, their label boxes meeting (tests/browser/test_chart_legibility_browser.py measures them drawn)
    tick_font = BIG_FONT if bars * BIG_FONT * ROW_EM <= area and bars <= 7 else WIDE_TICK_FONT
    fig = legible_stage_chart(step, source, columns=columns, title_wrap=wrap, max_rows=fit)
    fig.update_layout(font=dict(size=BIG_FONT), title_font_size=BIG_FONT + 4, showlegend=False,
                      meta={"narrow": False, "phone": False, "columns": columns},
                      margin=dict(l=10, r=right_margin(titles, columns, width), t=round(top), b=BOTTOM_PX),
                      height=None, autosize=True)
    fig.update_layout(title=dict(y=1, yanchor="top", pad=dict(t=24)))  # a smaller pad clips the first line
    fig.update_yaxes(tickfont=dict(size=tick_font), tickmode="linear", dtick=1)  # every category labelled
    fig.update_xaxes(tickfont=dict(size=BIG_FONT - 4))
    fig.update_annotations(font_size=TITLE_FONT)
    return fig


def _narrow_chart(step: StepTrace, width: float, phone: bool, source: Source) -> go.Figure:
    """``step_chart`` below NARROW_PX: two panels a row (one on a phone), BAR_PX a bar, scrolled."""
    panels = len(step.stages) + (1 if step.draw is not None else 0)
    columns = 1 if phone else panel_columns(panels, width)
    bars = max(charts.panel_rows(step), default=1)
    label_px = max((len(t) for t in charts.tick_labels(step)), default=4) * CHAR_EM * PHONE_FONT + 12
    gap = min(0.45, label_px / max(1.0, width - 40 - label_px)) if columns > 1 else 0.12
    fig = legible_stage_chart(step, source, columns=columns, gap_px=130, panel_px=int(bars * BAR_PX), column_gap=gap)
    fig.update_layout(font=dict(size=PHONE_FONT), title_font_size=PHONE_FONT + 4, legend_font_size=PHONE_FONT - 2,
                      meta={"narrow": True, "phone": phone, "columns": columns}, showlegend=False,
                      margin=dict(l=4, r=8, t=max(100, round(fig.layout.margin.t)), b=10), autosize=True)
    fig.update_layout(title=dict(y=1, yanchor="top", pad=dict(t=24)))  # a smaller pad clips the first line
    fig.update_yaxes(tickfont=dict(size=PHONE_FONT), tickmode="linear", dtick=1)  # every category labelled
    fig.update_xaxes(tickfont=dict(size=PHONE_FONT - 4))
    fig.update_annotations(font_size=PHONE_FONT)
    return fig
