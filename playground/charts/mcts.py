"""MCTS charts: pure functions of MctsPosition records (engine.strategies.mcts) -> layout and plotly figures.

The search tree of one committed position: the root (the text so far) on the left, a column per
depth; node size grows with visits, colour is Q (the mean raw log-prob of the simulations through
the node), the committed child and the root are outlined, the edge to the committed child is
drawn thick. Rows come from a depth-first layout: leaves get consecutive rows, a parent sits at
the mean row of its children, children ordered committed first, then by visits. No gradio here.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from typing import Sequence

import plotly.graph_objects as go

from engine.strategies.mcts import NOT_COMMITTED, MctsNode, MctsPosition
from engine.numbers import decimal

from .step import ACCENT, readable

EDGE = "#b0b0b0"
UNVISITED = "#d9d9d9"
COLOURSCALE = "Viridis"
MAX_MARKER = 40  # px, the most visited node
MIN_MARKER = 8


@dataclass
class LaidNode:
    """A node placed for drawing: x = depth, y = row."""

    node: MctsNode
    x: int
    y: float


def layout(position: MctsPosition, show_unvisited: bool = True) -> list[LaidNode]:
    """Depth-first rows: leaves take consecutive rows, a parent the mean of its children's."""
    nodes = position.nodes
    placed: dict[int, LaidNode] = {}
    next_row = [0.0]

    def visit(node: MctsNode) -> float:
        kids = [nodes[c] for c in node.children if show_unvisited or nodes[c].visits > 0]
        kids.sort(key=lambda n: (not n.committed, -n.visits, -n.prior))
        if kids:
            rows = [visit(k) for k in kids]
            y = sum(rows) / len(rows)
        else:
            y = next_row[0]
            next_row[0] += 1
        placed[node.id] = LaidNode(node, node.depth, y)
        return y

    visit(nodes[0])
    return sorted(placed.values(), key=lambda p: p.node.id)


def marker_size(visits: int, most: int) -> float:
    """Area proportional to visits, between MIN_MARKER and MAX_MARKER pixels across."""
    if most <= 0:
        return MIN_MARKER
    return MIN_MARKER + (MAX_MARKER - MIN_MARKER) * math.sqrt(visits / most)


def _label(node: MctsNode) -> str:
    return "root" if node.parent is None else readable(node.token)


def _hover(node: MctsNode) -> str:
    if node.parent is None:
        return f"root · {node.visits} simulations"
    values = ", ".join(f"{v:.2f}" for v in node.values[:6]) + (" …" if len(node.values) > 6 else "")
    return (f"<b>{html.escape(readable(node.token))}</b> (id {node.token_id}) · depth {node.depth}<br>"
            f"prior {decimal(node.prior)} · raw log-prob {node.logprob:.3f}<br>"
            f"visits {node.visits} · Q {decimal(node.q)}<br>rollout values: {values or 'none'}")


def _edges(laid: dict[int, LaidNode], committed_only: bool) -> tuple[list, list]:
    xs, ys = [], []
    for p in laid.values():
        parent = p.node.parent
        if parent is None or parent not in laid or p.node.committed != committed_only:
            continue
        xs += [laid[parent].x, p.x, None]
        ys += [laid[parent].y, p.y, None]
    return xs, ys


def interrupted(position: MctsPosition) -> bool:
    """A search a stopped run left unfinished: nothing committed."""
    return position.chosen_token_id == NOT_COMMITTED


def _title(position: MctsPosition) -> str:
    head = f"Token {position.index}: {position.simulations} simulations, {position.forwards} forwards"
    if interrupted(position):
        return f"{head}, stopped before committing"
    return f"{head} → {html.escape(readable(position.chosen_token))}"


def tree_figure(position: MctsPosition, show_unvisited: bool = True) -> go.Figure:
    """The search tree of one position (see the module docstring)."""
    laid = {p.node.id: p for p in layout(position, show_unvisited)}
    visited = [p for p in laid.values() if p.node.visits > 0 and p.node.parent is not None]
    most = max((p.node.visits for p in visited), default=0)
    fig = go.Figure()
    xs, ys = _edges(laid, committed_only=False)
    fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", line=dict(color=EDGE, width=1), hoverinfo="skip", name="search edge"))
    xs, ys = _edges(laid, committed_only=True)
    if not interrupted(position):
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", line=dict(color=ACCENT, width=4), hoverinfo="skip",
                                 name=f"committed: {readable(position.chosen_token)}"))
    unvisited = [p for p in laid.values() if p.node.visits == 0]
    if unvisited:
        fig.add_trace(go.Scatter(
            x=[p.x for p in unvisited], y=[p.y for p in unvisited], mode="markers+text", name="expanded, not visited",
            marker=dict(size=MIN_MARKER, color=UNVISITED), text=[_label(p.node) for p in unvisited],
            textposition="middle right", hovertext=[_hover(p.node) for p in unvisited], hoverinfo="text"))
    q = [p.node.q for p in visited]
    fig.add_trace(go.Scatter(
        x=[p.x for p in visited], y=[p.y for p in visited], mode="markers+text", name="visited (size: visits)",
        marker=dict(size=[marker_size(p.node.visits, most) for p in visited], color=q, colorscale=COLOURSCALE,
                    cmin=min(q, default=-1.0), cmax=max(q, default=0.0), showscale=bool(q),
                    colorbar=dict(title="Q (mean raw<br>log-prob)", x=1.02),
                    line=dict(color=[ACCENT if p.node.committed else "white" for p in visited], width=[3 if p.node.committed else 1 for p in visited])),
        text=[_label(p.node) for p in visited], textposition="middle right",
        hovertext=[_hover(p.node) for p in visited], hoverinfo="text"))
    root = laid[0]
    fig.add_trace(go.Scatter(x=[root.x], y=[root.y], mode="markers+text", name="root (text so far)",
                             marker=dict(size=MIN_MARKER + 6, color="#222222", symbol="square"), text=["root"],
                             textposition="middle left", hovertext=[_hover(root.node)], hoverinfo="text"))
    rows = max((p.y for p in laid.values()), default=0) + 1
    fig.update_layout(
        title=_title(position),
        height=max(320, int(26 * rows) + 140), margin=dict(l=40, r=40, t=60, b=40), plot_bgcolor="white",
        legend=dict(orientation="h", y=-0.08), hoverlabel=dict(align="left"))
    # "depth" goes into the tick labels: an axis title sits where the legend below wraps on a phone.
    fig.update_xaxes(tickprefix="depth ", dtick=1, range=[-0.5, max(p.x for p in laid.values()) + 0.8], showgrid=False)
    fig.update_yaxes(visible=False, autorange="reversed")
    return fig


def visit_table(position: MctsPosition) -> list[dict]:
    """The root's children, most visited first: token, prior, visits, Q, committed."""
    root = position.nodes[0]
    kids = sorted((position.nodes[c] for c in root.children), key=lambda n: (-n.visits, -n.q))
    return [{"token": readable(n.token), "token_id": n.token_id, "prior": n.prior, "visits": n.visits, "q": n.q,
             "committed": n.committed} for n in kids]


def quality_figure(rows: Sequence[tuple[str, float, int]]) -> go.Figure:
    """MCTS vs greedy vs beam (or any runs) on one prompt: ``rows`` are (strategy, total raw
    log-prob of its output, tokens). Bars show the total; the hover adds the per-token mean."""
    names = [r[0] for r in rows]
    totals = [r[1] for r in rows]
    best = max(totals, default=0.0)
    fig = go.Figure(go.Bar(
        x=names, y=totals, marker_color=[ACCENT if t == best else "#4c78a8" for t in totals],
        text=[f"{t:.2f}" for t in totals], textposition="outside",
        hovertext=[f"{n}: total {t:.3f} over {k} tokens (mean {t / max(k, 1):.3f})" for n, t, k in rows], hoverinfo="text"))
    fig.update_layout(title="Total log-prob of each output<br><sup>under the raw model; higher is better</sup>",
                      yaxis_title="sum of raw log-probs", height=360, margin=dict(l=60, r=20, t=60, b=40),
                      plot_bgcolor="white")
    return fig
