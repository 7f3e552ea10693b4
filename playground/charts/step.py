"""Step-through charts: pure functions of traces -> plotly figures, highlight data and text.

Units: entropy and surprisal in nats (natural log), as everywhere in the app. Chart text is at
least 14 px; colours have WCAG AA contrast against white (text 4.5:1). No gradio here; everything
is unit-tested on hand-made traces.
"""

from __future__ import annotations

import itertools

import functools
import html
import json
import math
import textwrap
from dataclasses import dataclass
from typing import Any, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from engine.numbers import decimal, interval, percent
from engine.reports.uncertainty import HESITATION_ENTROPY, HESITATION_VARENTROPY, uncertainty_series
from engine.stages import grammar_cost
from engine.trace import StageTrace, StepTrace, TokenProb, Trace
from playground.page_js import PHONE_PX
from playground.page_js import PRESENT_NARROW_PX as NARROW_PX  # the page's script compares against these too

from . import glossary
from .explain import LOCAL, Source, explain_step, grammar_sentence, source_of, stage_moved, tokens_word  # noqa: F401 (the views' charts.*)
from .stage_notes import stage_heading
from .tokens import render as readable  # the one token rendering (␣ ↵ ⇥ ⟪special⟫)
from .tokens import render_flow
from .tokens import unique_labels as _unique_labels

ACCENT = "#c4421a"  # the chosen token (5.1:1 on white)
BAR = "#4c78a8"  # other tokens (4.6:1)
REMOVED = "#767676"  # outline of tokens a stage removed (4.5:1)
DRAW = "#222222"  # the u line
REST = "#c8c8c8"  # the draw panel's share of the tokens outside the top-N (a fill, no text on it)
REST_SHOWN = 0.005  # the draw panel draws that share when it is at least this wide
MARKER = "#6a1b9a"  # the selected step on the run chart (not a data line's colour)
VARENTROPY = "#2e7d32"  # the run chart's varentropy line
ENTROPY, SURPRISAL = "#4c78a8", "#a35d00"
PANELS_PER_ROW = 3
PHONE_GAP_PX = 100  # between a phone's rows: a panel's 3-4 title lines, nothing more
FONT = 14  # px, the smallest chart text
TITLE_WRAP = 14  # characters per subplot title line: titles wrap instead of overlapping at 390 px
SUP_WRAP = 18  # characters of the smaller "kept 56 tokens · −9.9%" line under it (else two lines)
SURPRISAL_CAP = 5.0  # nats: surprisal colouring saturates here (p ≈ 0.7%)
GAP = "⋯"  # the empty row between a panel's top-N and the chosen token drawn outside it
UNKNOWN_P = "p unknown"  # beside a served model's chosen token outside its raw top-N (NaN in the trace)

STAGE_GLOSSARY = {"temperature": "temperature", "top_k": "top-k", "top_p": "top-p", "min_p": "min-p",
                  "typical_p": "typical_p", "epsilon": "ε"}


def short_label(label: str, limit: int = 12) -> str:
    """A tick label cut to ``limit`` characters (…), so neighbouring panels never overlap."""
    return label if len(label) <= limit else label[: limit - 1] + "…"


def _wrap(text: str, width: int = TITLE_WRAP) -> str:
    return "<br>".join(textwrap.wrap(text, width, break_long_words=False)) or text


def kept_words(stage: StageTrace, source: Source = LOCAL) -> str:
    """What the panel says the stage kept: its count, or in fast mode what is known of it (the
    server's top-N; after its sampler, fewer than N non-zero is the exact count)."""
    if source.fast and (stage.name == "raw" or stage.kept >= (source.top_n or len(stage.top))):
        return f"server's top {source.top_n or len(stage.top)}"
    return f"kept {tokens_word(stage.kept)}"


def stage_title(stage: StageTrace, wrap: int = TITLE_WRAP, source: Source = LOCAL) -> str:
    """The stage and its knobs in words (wrapped to short lines), then what it kept and the mass
    it removed (or moved, when it removed none: a temperature)."""
    kept = kept_words(stage, source)
    removed = (f"−{percent(stage.mass_removed)}" if stage.mass_removed > 0
               else f"moved {percent(stage.tv_distance)}" if stage_moved(stage) else "")
    # One line when it fits a phone's panel, else the removed mass on a line of its own.
    if not removed or len(kept) + len(removed) + 3 > SUP_WRAP:
        note = f"<sup>{kept}</sup>" + (f"<br><sup>{removed}</sup>" if removed else "")
    else:
        note = f"<sup>{kept} · {removed}</sup>"
    return f"{_wrap(html.escape(stage_heading(stage), quote=False), wrap)}<br>{note}"


def _hover(stage: StageTrace) -> str:
    parts = [glossary.hover("kept")]
    if stage.mass_removed > 0:
        parts.append(glossary.hover("mass removed"))
    if stage.name in STAGE_GLOSSARY:
        parts.append(glossary.hover(STAGE_GLOSSARY[stage.name]))
    return "<br>".join(html.escape(p) for p in parts)


@dataclass(frozen=True)
class Outside:
    """The chosen token as a bar beside a stage's top-N: its text and its probability (None: unknown)."""

    token: str
    prob: float | None


def _chosen_outside(stage: StageTrace, step: StepTrace) -> Outside | None:
    """The chosen token as an extra bar when the stage's stored top-N misses it: its probability
    where the trace records it (raw: raw_prob; final: chosen_prob; a stage between them: its own
    chosen_prob), else None as the probability (a trace from before stages recorded it, or a
    served model's raw p outside its top-N: unknown, NaN in the trace)."""
    if any(t.token_id == step.chosen_token_id for t in stage.top):
        return None
    prob = step.raw_prob if stage.name == "raw" else step.chosen_prob if stage is step.stages[-1] else stage.chosen_prob
    return Outside(step.chosen_token, prob if prob is not None and math.isfinite(prob) else None)


def _missing_p(stage: StageTrace, step: StepTrace) -> str:
    """Beside a chosen token drawn outside a panel's top-N without its p: unknown (a served
    model's raw p below its top-N, NaN in the trace) or not recorded (an older trace)."""
    return UNKNOWN_P if stage.name == "raw" and math.isnan(step.raw_prob) else "p not recorded"


def _percents(values: Sequence[float | None]) -> list[list[str]]:
    """Each bar's p as the page writes it (engine.numbers.percent), for its hover."""
    return [[percent(v)] for v in values]


def removed_rows(stage: StageTrace, step: StepTrace, max_rows: int | None) -> int | None:
    """How many rows a panel of at most ``max_rows`` rows (None: no limit) gives the tokens the
    stage removed (one at least, when it removed any): what its top-N and the chosen token leave."""
    if max_rows is None or not stage.removed:
        return None
    used = len(stage.top) + (2 if _chosen_outside(stage, step) is not None else 0)
    return max(1, max_rows - used)


def _stage_traces(stage: StageTrace, step: StepTrace, max_rows: int | None = None) -> list[dict]:
    """The stage's top-N bars (chosen token in ACCENT), then a gap row and the chosen token when
    it is not among them (labelled with its rank bound), then the tokens it removed, hatched; past
    ``max_rows`` rows the last removed row sums the rest ("✕ 7 more": a projector's panel has room
    for about twelve labelled rows)."""
    entries = list(stage.top)
    labels = [short_label(x) for x in _unique_labels([t.token for t in entries], [t.token_id for t in entries])]
    colors = [ACCENT if t.token_id == step.chosen_token_id else BAR for t in entries]
    probs: list[float | None] = [t.prob for t in entries]
    texts = [""] * len(entries)
    outside = _chosen_outside(stage, step)
    known = list(probs)
    if outside is not None:
        labels += [GAP, f"{short_label(readable(outside.token))} (rank>{len(entries)})"]
        probs += [None, outside.prob or 0.0]
        known += [None, outside.prob]
        colors += [BAR, ACCENT]
        texts += ["", "" if outside.prob is not None else _missing_p(stage, step)]
    bars = [dict(
        type="bar", x=probs, y=labels, orientation="h", marker=dict(color=colors), name=stage.name, showlegend=False,
        text=texts, textposition="outside", textfont=dict(size=FONT, color=ACCENT), cliponaxis=False,
        customdata=_percents(known),
        hovertemplate="%{y}<br>p = %{customdata[0]}<br>" + _hover(stage) + "<extra>" + stage.name + "</extra>",
    )]
    if stage.removed:
        cap = removed_rows(stage, step, max_rows)
        shown = stage.removed if cap is None or cap >= len(stage.removed) else stage.removed[:cap - 1]
        rem_labels = [f"✕ {short_label(lab)}" for lab in
                      _unique_labels([t.token for t in shown], [t.token_id for t in shown])]
        probs_removed = [t.prob for t in shown]
        if len(shown) < len(stage.removed):
            rest = stage.removed[len(shown):]
            rem_labels.append(f"✕ {len(rest)} more")
            probs_removed.append(sum(t.prob for t in rest))
        bars.append(dict(
            type="bar", x=probs_removed, y=rem_labels,
            orientation="h",
            marker=dict(color="rgba(0,0,0,0)", line=dict(color=REMOVED, width=1.5), pattern=dict(shape="/")),
            name="removed", showlegend=False, customdata=_percents(probs_removed),
            hovertemplate="%{y}: removed here (had p = %{customdata[0]})<extra>" + stage.name + "</extra>",
        ))
    return bars


def _draw_traces(step: StepTrace) -> list[dict]:
    """The inverse-CDF picture: each final top token owns [F(before), F(before) + p); u falls in
    the chosen token's interval."""
    final = step.stages[-1]
    entries = sorted(final.top, key=lambda t: (-t.prob, t.token_id))
    labels = [short_label(x) for x in _unique_labels([t.token for t in entries], [t.token_id for t in entries])]
    bases, acc = [], 0.0
    for t in entries:
        bases.append(acc)
        acc += t.prob
    if step.chosen_token_id not in {t.token_id for t in entries} and step.draw_low is not None:
        labels.append(f"{short_label(readable(step.chosen_token))} (rank>{len(final.top)})")
        bases.append(step.draw_low)
        entries.append(TokenProb(step.chosen_token_id, step.chosen_token, step.chosen_prob))
    colors = [ACCENT if t.token_id == step.chosen_token_id else BAR for t in entries]
    rest = 1.0 - acc
    if rest > REST_SHOWN and final.kept > len(final.top):  # a flat distribution: u can land past the top-N
        others = final.kept - len(final.top)
        labels.append(f"other {tokens_word(others)}")
        bases.append(acc)
        entries.append(TokenProb(-1, "", rest))
        colors.append(REST)
    slices = [[interval(b, b + t.prob), percent(t.prob)] for b, t in zip(bases, entries)]
    return [dict(
        type="bar", x=[t.prob for t in entries], base=bases, y=labels, orientation="h", marker=dict(color=colors),
        showlegend=False, customdata=slices,
        hovertemplate="%{y}: %{customdata[0]}, %{customdata[1]} wide<br>" + html.escape(glossary.hover("u"))
                      + "<extra>cumulative</extra>",
    )]


def _u_line(u: float, axis: str) -> tuple[dict, dict]:
    """The draw as a dashed vertical line over the whole panel of ``axis`` ("" or "2", "3"...; a
    shape, so it shows even when the panel has one row), and its value written on the side with
    room (never clipped): the shape and the annotation."""
    right = u > 0.5
    shape = dict(type="line", x0=u, x1=u, xref=f"x{axis}", y0=0, y1=1, yref=f"y{axis} domain",
                 line=dict(color=DRAW, dash="dash", width=2))
    label = dict(text=f"u = {decimal(u)}", font=dict(size=FONT + 1, color=DRAW), bgcolor="rgba(255,255,255,0.85)",
                 xanchor="right" if right else "left", yanchor="top", showarrow=False, x=u, xref=f"x{axis}", y=1,
                 yref=f"y{axis} domain")
    return shape, label


def _legend_traces() -> list[dict]:
    """Legend-only entries (no data): what the colours and hatching mean."""
    swatch = dict(type="bar", x=[None], y=[None], orientation="h", hoverinfo="skip", xaxis="x", yaxis="y")
    return [dict(name="chosen token", marker=dict(color=ACCENT), **swatch),
            dict(name="other tokens (top-N)", marker=dict(color=BAR), **swatch),
            dict(name="removed by this stage", marker=dict(color="rgba(0,0,0,0)", line=dict(color=REMOVED, width=1.5),
                                                           pattern=dict(shape="/")), **swatch)]


@functools.lru_cache(maxsize=64)
def _grid(rows: int, cols: int, vertical_spacing: float,
          horizontal_spacing: float = 0.12) -> tuple[str, tuple[tuple[float, float], ...]]:
    """make_subplots' axes (domains and anchors, as JSON) and subplot-title positions for a grid,
    computed once per shape: the rest of a chart is built as plain dicts and validated once, since
    plotly's figure API re-validates on every update (~110 ms a chart against ~25 ms)."""
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=["·"] * (rows * cols), horizontal_spacing=horizontal_spacing,
                        vertical_spacing=vertical_spacing)
    layout = fig.to_plotly_json()["layout"]
    axes = {k: v for k, v in layout.items() if k.startswith(("xaxis", "yaxis"))}
    return json.dumps(axes), tuple((a["x"], a["y"]) for a in layout["annotations"])


def tick_format(top: float) -> str:
    """A probability axis's tick format for an axis from 0 to ``top``: whole percent from 5% up,
    else the decimals its ticks need (a 0-0.2% axis read "0%, 0%, 0%")."""
    if not 0 < top < 0.05:
        return ".0%"
    return f".{min(4, max(1, 1 - math.floor(math.log10(top * 100))))}%"


def _shared_range(panels: Sequence[StageTrace], step: StepTrace) -> float:
    """The largest probability any stage panel shows (the shared axis runs 0 to a bit above it;
    an unknown p, NaN, shows no bar)."""
    probs = [t.prob for s in panels for t in [*s.top, *s.removed]] + [step.raw_prob, step.chosen_prob]
    return min(1.0, max((p for p in probs if math.isfinite(p)), default=1.0) * 1.08)


TITLE_LINE_PX = 20  # a panel title's line at FONT + 1 px, as plotly spaces lines
SUP_LINE_PX = 15  # a <sup> line of it
MAIN_TITLE_PX = 70  # the chart's own title (a line and a <sup> line) from the figure's top, and a gap under it
XTICK_PX = 30  # a panel's x tick labels under its bars: the next row's titles start below them
ROW_PX = 20  # a token row: its FONT px label whole (plotly drops every other label of a crowded axis)


def title_px(title: str, scale: float = 1.0) -> float:
    """The height a panel title takes above its panel: its lines, <sup> ones smaller (``scale``:
    the title's font against FONT + 1 px)."""
    return scale * sum(SUP_LINE_PX if line.startswith("<sup>") else TITLE_LINE_PX for line in title.split("<br>"))


@dataclass(frozen=True)
class Room:
    """A stage chart's vertical layout in px: the top margin (the chart's title and the first row's
    panel titles), the gap between rows (a row's titles and the x ticks above them), a panel's height."""

    top: float
    gap: float
    panel: float

    def height(self, rows: int) -> int:
        """The figure's height for ``rows`` rows of panels, its 70 px bottom margin included."""
        return round(self.top + rows * self.panel + (rows - 1) * self.gap + 70)


def chart_room(titles: Sequence[str], rows: int, cols: int, bars: int, gap_px: int | None, panel_px: int) -> Room:
    """The room ``stage_chart`` gives: its usual layout (330 px a row, or ``panel_px`` + ``gap_px``),
    grown where a row's titles, or a panel's ``bars`` labelled rows of ROW_PX, need more. The
    yes/no/maybe grammar's panel held 19 rows in 220 px (every other label dropped, the chosen one
    among them) under a five-line title that ran into the chart's own."""
    heads = [max(title_px(t) for t in titles[r * cols:(r + 1) * cols]) for r in range(rows)]
    usual = max(360, (330 if gap_px is None else panel_px + gap_px) * rows + 120) - 180  # the plot area
    gap = (min(0.3, 0.5 / rows) * usual if gap_px is None else gap_px) if rows > 1 else 0.0
    return Room(top=max(110.0, MAIN_TITLE_PX + heads[0]),
                gap=max(gap, max(heads[1:], default=0) + XTICK_PX) if rows > 1 else 0.0,
                panel=max((usual - (rows - 1) * gap) / rows, bars * ROW_PX))


def stage_chart(step: StepTrace, shared_axis: bool = True, columns: int = PANELS_PER_ROW,
                gap_px: int | None = None, meta: dict | None = None, panel_px: int = 260,
                column_gap: float = 0.12, source: Source = LOCAL, title_wrap: int | None = None,
                max_rows: int | None = None) -> go.Figure:
    """Small multiples: the top-N tokens raw, after each stage in order, and final; tokens a stage
    removed are hatched; the chosen token is always drawn (after a gap when outside the top-N);
    the last panel shows where u landed. ``shared_axis``: every stage panel on one probability
    axis, so a stage's effect is bar length (False: each panel zoomed to its own scale).
    ``columns``: panels per row (1 or 2 suits a phone); ``gap_px``: the room between rows (None: a
    share of the height, which leaves tall single-column charts short panels); ``meta``: the
    layout's meta (what the page reads back); ``panel_px``: a panel's height when ``gap_px`` is
    given; ``column_gap``: the room between columns, a share of the width (their token labels sit in it);
    ``source``: where the numbers come from (``source_of``): a served model's top-N and the raw
    mass outside it (the tail) are said under the raw panel's title; in fast mode each panel says
    it holds the server's top-N, not a count of kept tokens. ``title_wrap``: characters a panel
    title's line holds (None: TITLE_WRAP, twice that in one column); ``max_rows``: rows a panel
    draws at most (``_stage_traces``). Every bar is labelled, the rows and titles given the room
    they need (``chart_room``)."""
    panels = list(step.stages)
    with_draw = step.draw is not None
    count = len(panels) + (1 if with_draw else 0)
    cols = max(1, min(columns, count))
    rows = math.ceil(count / cols)
    wrap = title_wrap or (TITLE_WRAP if cols > 1 else 2 * TITLE_WRAP)  # one column: a phone's width
    titles = panel_titles(step, wrap, source)
    room = chart_room(titles, rows, cols, max(panel_rows(step, max_rows), default=1), gap_px, panel_px)
    height = room.height(rows)
    spacing = round(room.gap / (height - room.top - 70), 4) if rows > 1 else 0.1
    axes_json, positions = _grid(rows, cols, spacing, column_gap if cols > 1 else 0.12)
    layout: dict = json.loads(axes_json)
    suffix = ["" if i == 0 else str(i + 1) for i in range(count)]  # panel i's axes: x, y, x2, y2...
    data: list[dict] = []
    for i, stage in enumerate(panels):
        data += [bar | dict(xaxis=f"x{suffix[i]}", yaxis=f"y{suffix[i]}")
                 for bar in _stage_traces(stage, step, max_rows)]
    annotations = [dict(font=dict(size=FONT + 1), showarrow=False, text=title, x=x, xanchor="center", xref="paper",
                        y=y, yanchor="bottom", yref="paper") for title, (x, y) in zip(titles, positions)]
    shapes = []
    for name, axis in layout.items():
        if name.startswith("yaxis"):
            axis.update(autorange="reversed", tickfont=dict(size=FONT), automargin=True, tickmode="linear", dtick=1)
        else:
            axis.update(tickformat=".0%", rangemode="tozero", tickfont=dict(size=FONT), nticks=3)
    if with_draw and step.draw is not None:
        axis = suffix[len(panels)]
        data += [bar | dict(xaxis=f"x{axis}", yaxis=f"y{axis}") for bar in _draw_traces(step)]
        shape, label = _u_line(step.draw, axis)
        shapes.append(shape)
        annotations.append(label)
        layout[f"xaxis{axis}"]["range"] = [0, 1]
    data += _legend_traces()
    if shared_axis:
        top = _shared_range(panels, step)
        for i in range(len(panels)):
            layout[f"xaxis{suffix[i]}"].update(range=[0, top], tickformat=tick_format(top))
    axis_note = "one probability axis for all stages" if shared_axis else "each panel on its own scale"
    layout.update(
        annotations=annotations, height=height, margin=dict(l=10, r=10, t=round(room.top), b=70), bargap=0.25,
        barmode="overlay",
        title=dict(text=f"step {step.index}: chose {html.escape(readable(step.chosen_token))} (p = {percent(step.chosen_prob)})"
                        f"<br><sup>{axis_note}</sup>", x=0.01, xanchor="left", yref="container",
                   y=1 - 16 / height,  # 12 px put its first line's box 3 px above the figure's top
                   yanchor="top", font=dict(size=FONT + 3)),
        template="plotly_white", font=dict(size=FONT),
        legend=dict(orientation="h", x=0, xanchor="left", yref="container", y=0, yanchor="bottom", font=dict(size=FONT)),
    )
    if shapes:
        layout["shapes"] = shapes
    if meta is not None:
        layout["meta"] = meta
    return go.Figure(dict(data=data, layout=layout))


def raw_tail(step: StepTrace, source: Source) -> float | None:
    """The raw probability outside a served model's top-N at this step: step mode records it; in
    fast mode the raw panel's top-N are the model's own probabilities, so it is 1 − their sum."""
    if source.mode == "step":
        return source.tail
    raw = step.stages[0] if step.stages else None
    if source.fast and raw is not None and raw.name == "raw" and raw.top:
        return max(0.0, 1.0 - sum(t.prob for t in raw.top))
    return None


def panel_titles(step: StepTrace, wrap: int, source: Source = LOCAL) -> list[str]:
    """Every panel's title (``stage_title``; a served model's top-N and tail under the raw one),
    then the draw panel's."""
    titles = [stage_title(s, wrap, source) for s in step.stages]
    tail = raw_tail(step, source)
    if tail is not None and titles:
        titles[0] += (f"<br><sup>tail {percent(tail)} not drawn</sup>" if source.fast
                      else f"<br><sup>server's top {source.top_n}; tail {percent(tail)} not drawn</sup>")
    if step.draw is not None:
        titles.append(f"where the draw<br>landed: u = {decimal(step.draw)}<br><sup>sorted cumulative</sup>")
    return titles


def panel_rows(step: StepTrace, max_rows: int | None = None) -> list[int]:
    """How many bars (token rows) each panel of ``stage_chart`` draws (``max_rows``: see
    ``_stage_traces``), the draw panel last."""
    counts = [len(s.top) + min(len(s.removed), removed_rows(s, step, max_rows) or len(s.removed))
              + (2 if _chosen_outside(s, step) is not None else 0) for s in step.stages]
    if step.draw is not None:
        counts.append(len(step.stages[-1].top) + (0 if any(t.token_id == step.chosen_token_id
                                                             for t in step.stages[-1].top) else 1))
    return counts


def tick_labels(step: StepTrace, max_rows: int | None = None) -> list[str]:
    """Every token label the chart's panels write on their y axes."""
    labels = []
    for trace in ([t for s in step.stages for t in _stage_traces(s, step, max_rows)]
                  + (_draw_traces(step) if step.draw is not None else [])):
        labels += [y for y in trace["y"] if y is not None]
    return labels


def panel_columns(panels: int, width: float | None) -> int:
    """Panels per row: all in one row (up to 4) on a wide screen, two a row below NARROW_PX
    (``width`` None: the page width is not known yet, so wide)."""
    if width is not None and width < NARROW_PX:
        return min(2, panels)
    return min(4, panels) if panels <= 4 else math.ceil(panels / math.ceil(panels / 4))


def fitted_stage_chart(step: StepTrace, width: float | None, source: Source = LOCAL) -> go.Figure:
    """``stage_chart`` for a page ``width`` px wide (None: not known yet): PANELS_PER_ROW a row,
    two below NARROW_PX, one below PHONE_PX (two panels in a phone's 390 px leave ~80 px of bars
    and every other token label). ``layout.meta`` says which layout it is, so the page asks for
    the other one after a resize (page_js). ``source``: see ``stage_chart``."""
    narrow = width is not None and width < NARROW_PX
    phone = width is not None and width < PHONE_PX
    count = len(step.stages) + (1 if step.draw is not None else 0)
    columns = 1 if phone else panel_columns(count, width) if narrow else PANELS_PER_ROW
    return stage_chart(step, columns=columns, gap_px=PHONE_GAP_PX if phone else None,
                       meta={"narrow": narrow, "phone": phone, "columns": columns}, source=source)


def surprisal(step: StepTrace) -> float:
    """−ln p of the chosen token under the final distribution, in nats."""
    return -math.log(max(step.chosen_prob, 1e-45))


def run_chart(steps: Sequence[StepTrace], selected: int | None = None) -> go.Figure:
    """Entropy of the final distribution and surprisal of the chosen token, per step (nats); the
    selected step as a vertical line in its own colour. Legend below the plot, clear of any label."""
    xs = [s.index for s in steps]
    tokens = [[html.escape(readable(s.chosen_token))] for s in steps]
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=xs, y=[s.entropy for s in steps], mode="lines+markers", name="entropy (nats)",
                             line=dict(color=ENTROPY), customdata=tokens,
                             hovertemplate="step %{x}: %{customdata[0]}<br>H = %{y:.2f} nats<br>"
                                           + html.escape(glossary.hover("entropy")) + "<extra></extra>"))
    fig.add_trace(go.Scatter(x=xs, y=[surprisal(s) for s in steps], mode="lines+markers", name="surprisal (nats)",
                             line=dict(color=SURPRISAL, dash="dot"), marker=dict(symbol="square"), customdata=tokens,
                             hovertemplate="step %{x}: %{customdata[0]}<br>−ln p = %{y:.2f} nats<br>"
                                           + html.escape(glossary.hover("surprisal")) + "<extra></extra>"))
    _uncertainty_traces(fig, steps, tokens)
    if selected is not None and 0 <= selected < len(steps):
        fig.add_vline(x=selected, line_color=MARKER, line_width=2, opacity=0.8)
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", name=f"selected step ({selected})",
                                 line=dict(color=MARKER, width=2), hoverinfo="skip"))
    fig.update_layout(height=300, margin=dict(l=10, r=10, t=20, b=10), template="plotly_white", font=dict(size=FONT),
                      legend=dict(orientation="h", x=0, y=-0.3, yanchor="top"), xaxis_title="step",
                      yaxis=dict(rangemode="tozero", title="nats"))
    return fig


def hesitation_steps(steps: Sequence[StepTrace]) -> list[int]:
    """The steps where the model hesitates: raw entropy and varentropy both above the thresholds of
    ``engine.reports.uncertainty`` (none for a trace without varentropy)."""
    return uncertainty_series(steps).hesitations


def _uncertainty_traces(fig: go.Figure, steps: Sequence[StepTrace], tokens: list) -> None:
    """The final distribution's varentropy per step and the hesitation steps (stars on the entropy
    line), where the trace recorded varentropy."""
    if not any(s.varentropy is not None for s in steps):
        return
    fig.add_trace(go.Scatter(x=[s.index for s in steps], y=[s.varentropy for s in steps], mode="lines",
                             name="varentropy (nats²)", line=dict(color=VARENTROPY, dash="dashdot"), customdata=tokens,
                             hovertemplate="step %{x}: %{customdata[0]}<br>V = %{y:.2f} nats²<extra></extra>"))
    marked = set(hesitation_steps(steps))
    if marked:
        shown = [s for s in steps if s.index in marked]
        fig.add_trace(go.Scatter(x=[s.index for s in shown], y=[s.entropy for s in shown], mode="markers",
                                 name=f"hesitation (raw H ≥ {HESITATION_ENTROPY:g}, V ≥ {HESITATION_VARENTROPY:g})",
                                 marker=dict(symbol="star", size=13, color=MARKER),
                                 hovertemplate="step %{x}: the model hesitates<extra></extra>"))


def highlight_text(token: str) -> str:
    """A token's text in the highlighted output: as written, but a newline shows as ↵ (then
    breaks the line) and special tokens as their badge, so every chip is visible and clickable."""
    return render_flow(token)


def token_highlights(steps: Sequence[StepTrace], colour_by: str = "probability") -> list[tuple[str, float]]:
    """(token text, score in [-1, 1]) pairs for gr.HighlightedText (negative purple, positive red,
    0 white). ``probability``: 2p − 1, so confident picks are red and unlikely ones purple.
    ``surprisal``: −ln p / SURPRISAL_CAP clipped to [0, 1], so the most surprising picks are the
    strongest red and expected ones white. See ``colour_legend``."""
    if colour_by not in ("probability", "surprisal"):
        raise ValueError(f"colour_by: {colour_by!r} is not one of 'probability', 'surprisal'")
    out = []
    for s in steps:
        if colour_by == "surprisal":
            score = min(surprisal(s), SURPRISAL_CAP) / SURPRISAL_CAP
        else:
            score = 2.0 * s.chosen_prob - 1.0
        out.append((highlight_text(s.chosen_token), round(max(-1.0, min(1.0, score)), 4)))
    return out


def colour_legend(colour_by: str = "probability") -> str:
    """HTML: what the token colours mean (the gradient gr.HighlightedText draws for scores)."""
    purple, red = "rgba(128, 90, 213, 1)", "rgba(239, 68, 60, 1)"
    if colour_by == "surprisal":
        gradient, left, right = f"white, {red}", "expected (0 nats)", f"surprising (≥ {SURPRISAL_CAP:g} nats, p ≤ {percent(math.exp(-SURPRISAL_CAP))})"
    else:
        gradient, left, right = f"{purple}, white, {red}", "unlikely pick (p ≈ 0)", "confident (p ≈ 1); white = p 0.5"
    bar = (f'<span style="display:inline-block;width:120px;height:12px;vertical-align:middle;margin:0 8px;'
           f'border:1px solid #767676;background:linear-gradient(to right, {gradient})"></span>')
    return (f'<div class="dp-colour-legend" style="font-size:14px;color:#333">Colour = {colour_by}: '
            f"{html.escape(left)}{bar}{html.escape(right)}</div>")


STOP_WORDS = {"eos": "end of sequence", "stop_string": "stop string", "max_new_tokens": "max_new_tokens reached",
              "cancelled": "stopped by you", "time_limit": "time limit reached"}


def stop_text(stop_reason: str | None, running: bool = False) -> str:
    """The stop reason in words: "running…" only while a run is going, "stopped" when it ended
    without a recorded reason (a Stop press)."""
    if stop_reason:
        return STOP_WORDS.get(stop_reason, stop_reason)
    return "running…" if running else "stopped before the end"


def summary_markdown(trace: Trace, running: bool = False) -> str:
    """One line: tokens, why it stopped, mean log-prob (nats), perplexity, speed, model.
    ``running``: the run is still streaming (else a trace without a stop reason was stopped).
    A value the run cannot know (a served model's raw p outside its top-N) reads "unknown"."""
    s = trace.summary
    if not trace.steps:
        return "No tokens yet."

    def number(key: str, digits: int) -> str:
        value = s.get(key)
        return f"{value:.{digits}f}" if isinstance(value, (int, float)) and math.isfinite(value) else "unknown"

    return (
        f"**{tokens_word(s.get('tokens', len(trace.steps)))}** · stop: {stop_text(trace.stop_reason, running)} · "
        f"mean log-prob {number('mean_logprob', 3)} nats (raw model {number('mean_raw_logprob', 3)}) · "
        f"perplexity {number('perplexity', 2)} · time to first token {trace.timing.ttft_ms:.0f} ms · "
        f"{trace.timing.tokens_per_s:.1f} tokens/s · {trace.model} ({trace.quantization}, {trace.device})"
        + grammar_cost_text(trace.steps)
    )


def grammar_cost_text(steps: Sequence[StepTrace]) -> str:
    """The run's grammar cost for the summary line (``engine.stages.grammar_cost``: the sum over steps
    of ln(allowed mass)), with what it means for the text's probability; "" without a grammar."""
    cost = grammar_cost(steps)
    if cost is None:
        return ""
    factor = math.exp(-cost) if -cost < 700 else math.inf
    times = f"{factor:,.3g}×" if math.isfinite(factor) else "more than 10^300×"
    return (f" · grammar cost {cost:.2f} nats (Σ ln allowed mass: the mask made this text {times} as likely as the "
            f"chain without it)")


def step_tail(trace: Trace, index: int) -> tuple[int, float] | None:
    """(top-N, tail mass) of step ``index`` on a served model in step mode: the raw probability
    outside the server's top-N, which every chart leaves out (renormalised over the top-N); None
    when unknown (a model loaded here, fast mode, a branch's steps before the branch)."""
    remote = trace.extra.get("remote") or {}
    tails = remote.get("tail_mass") or []
    i = index - (len(trace.steps) - len(tails))  # a branch's label covers only its new steps
    return (remote["top_n"], tails[i]) if 0 <= i < len(tails) else None


def tail_note(trace: Trace, index: int) -> str:
    """Step ``index``'s tail mass in words (``step_tail``); "" when unknown."""
    tail = step_tail(trace, index)
    if tail is None:
        return ""
    return (f"Outside the server's top {tail[0]} lay {percent(tail[1])} of the raw probability here (the tail): "
            "it is outside every chart, and no token there could be picked.")


def alternatives(step: StepTrace, limit: int = 10) -> list[tuple[str, int]]:
    """(label, token id) choices for branching: the raw model's top tokens, with their final p."""
    final = {t.token_id: t.prob for t in step.stages[-1].top}
    out = []
    for t in step.stages[0].top[:limit]:
        mark = " ← chosen" if t.token_id == step.chosen_token_id else ""
        fp = final.get(t.token_id)
        after = f", final {percent(fp)}" if fp is not None else ""
        out.append((f"{readable(t.token)!s}  (raw {percent(t.prob)}{after}){mark}", t.token_id))
    return out


def plot_config(scroll_zoom: bool = True) -> dict:
    """The plotly config a view passes to gr.Plot/the browser for these figures: scroll zooms
    (the beam tree's "scroll to zoom"), the mode bar shows, no logo, no network for images."""
    return {"scrollZoom": scroll_zoom, "displaylogo": False, "responsive": True,
            "toImageButtonOptions": {"format": "png", "scale": 2}}


_REVISION = itertools.count(1)


def revised(fig: Any) -> Any:
    """``fig`` with a new ``layout.meta["rev"]``: the what-if draws into the step chart behind its
    ``gr.Plot`` (whatif.DRAW_JS), so the Plot must redraw even a figure equal to the last one it got."""
    fig.layout.meta = {**(fig.layout.meta or {}), "rev": next(_REVISION)}
    return fig
