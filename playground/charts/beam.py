"""Beam-search charts: pure functions of a BeamTrace -> tree layout, plotly figure, rankings.

The tree: the prompt is the root; each considered candidate is a node at x = its step, joined to
the node of the beam it extends. Rows come from a depth-first layout: leaves get consecutive rows
and a parent sits on the row of its first child, children ordered highlighted path first, then by
score, so the winning path is one straight line at the top and every lineage reads left to right.
Kept beams whose lineage later died out (no finished or dropped descendant) are drawn faint. Pruned
candidates of one parent can be collapsed into one small marker beside the parent's children
(``collapse_pruned``), which keeps 6 beams x 30 steps readable. No gradio here.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, field
from typing import Sequence

import plotly.graph_objects as go

from engine.strategies.beam import BeamHypothesis, BeamTrace
from engine.numbers import decimal

from . import glossary
from .step import FONT, readable

STATUS_COLOURS = {  # markers are graphics: at least 3:1 on white (WCAG AA for non-text)
    "root": "#222222",
    "kept": "#4c78a8",
    "pruned": "#8a8a8a",
    "collapsed": "#8a8a8a",
    "finished": "#2e7d32",
    "dropped": "#c05600",
}
STATUS_NAMES = {  # legend entries: what each marker means
    "kept": "kept beam (dot)",
    "finished": "finished hypothesis (diamond)",
    "dropped": "dropped: finished, not among the best",
    "pruned": "pruned candidate (small dot)",
    "collapsed": "pruned, collapsed (size = count)",  # short: the legend fits a phone's width
    "root": "prompt",
}
WINNER = "#c4421a"
# Short lines: one long line would be cut off at phone width.
TREE_TITLE = "Search tree<br><sup>drag to pan, box-zoom from the toolbar,</sup><br><sup>double-click to reset</sup>"
ROW_PX = 26  # vertical pixels per leaf row
COLLAPSED_OFFSET = 0.4  # a collapsed-pruned marker sits this far below its parent's row
# Long searches (24-64 steps) get wider, not denser: STEP_PX per step, the page scrolls sideways
# (app.CSS), and a token label is at most LABEL_CHARS characters (the full token is in the hover).
STEP_PX = 58
FIT_WIDTH = 370  # px: a tree this narrow fits a phone: it fills its box (labels placed for this width)
MAX_HEIGHT = 1700
MARGIN = {"l": 10, "r": 10, "t": 100, "b": 120}
WIDE_BOTTOM = 190  # px: a wider tree's legend is one column at the left (a phone sees it without scrolling)
LABEL_CHARS = 6
CHAR_PX = 0.62 * FONT  # a generous average glyph width of the chart font, for the label boxes
LABEL_PX = 1.3 * FONT  # a label's line height
LABEL_LIFT = 7  # px between a node's centre and the bottom of its label ("top center")


@dataclass
class TreeNode:
    """One drawn node. ``key``: "root", "t:i" (candidate i of step t) or "t:p<parent key>" (the
    collapsed pruned candidates of one parent at step t)."""

    key: str
    step: int  # -1 for the root
    y: float
    label: str
    status: str  # root | kept | pruned | finished | dropped | collapsed
    parent: str | None
    hover: str
    on_path: bool = False  # on the highlighted hypothesis' path
    dead_end: bool = False  # kept, but no finished or dropped node descends from it
    count: int = 1  # collapsed: how many pruned candidates
    children: list[str] = field(default_factory=list)


def rescore(sum_logprobs: float, length: int, length_penalty: float) -> float:
    """transformers' length-normalised score: sum_logprobs / length ** length_penalty."""
    return sum_logprobs / (length ** length_penalty)


def rerank(hypotheses: Sequence[BeamHypothesis], length_penalty: float) -> list[tuple[int, float]]:
    """(hypothesis index, score) best first, re-scored under another length penalty."""
    scored = [(i, rescore(h.sum_logprobs, h.length, length_penalty)) for i, h in enumerate(hypotheses)]
    return sorted(scored, key=lambda x: -x[1])


def _slot_maps(beam: BeamTrace) -> list[dict[int, int]]:
    """Per step: beam slot -> index of the candidate that took the slot."""
    return [{c.beam: i for i, c in enumerate(s.candidates) if c.beam is not None} for s in beam.steps]


def _hover(step: int, c, length_penalty: float) -> str:
    finish = f"<br>finished by {c.finish_reason}" if c.finish_reason else ""
    return (f"step {step} · <b>{html.escape(readable(c.token))}</b> (id {c.token_id})<br>"
            f"log-prob {c.logprob:.3f} (p={decimal(math.exp(max(c.logprob, -700)))})<br>"
            f"cumulative {c.score:.3f}<br>normalised {c.normalized_score:.3f} (÷ {step + 1}^{length_penalty:g})<br>"
            f"{c.status}, from beam {c.parent}{finish}")


def build_tree(beam: BeamTrace, collapse_pruned: bool = True, highlight: int | None = None,
               upto: int | None = None) -> dict[str, TreeNode]:
    """The tree's nodes by key, laid out. ``highlight``: index of the hypothesis whose path stands
    out (default: the winner). ``upto``: draw only steps < upto (a search in progress)."""
    steps = beam.steps if upto is None else beam.steps[:upto]
    nodes: dict[str, TreeNode] = {"root": TreeNode("root", -1, 0.0, "prompt", "root", None, "the prompt")}
    slots = _slot_maps(beam)
    for t, step in enumerate(steps):
        for i, c in enumerate(step.candidates):
            parent = "root" if t == 0 else f"{t - 1}:{slots[t - 1].get(c.parent, -1)}"
            if parent not in nodes:
                continue  # a parent outside the drawn steps (cannot happen in a consistent trace)
            if collapse_pruned and c.status == "pruned":
                _add_collapsed(nodes, t, parent, c, beam.length_penalty)
                continue
            key = f"{t}:{i}"
            nodes[key] = TreeNode(key, t, 0.0, readable(c.token), c.status, parent, _hover(t, c, beam.length_penalty))
            nodes[parent].children.append(key)
    _mark_path(nodes, beam, beam.winner if highlight is None else highlight, len(steps))
    _layout(nodes, len(steps) - 1)
    return nodes


def _add_collapsed(nodes: dict[str, TreeNode], t: int, parent: str, c, length_penalty: float) -> None:
    key = f"{t}:p{parent}"
    line = f"{html.escape(readable(c.token))} {c.logprob:.2f} (cum {c.score:.2f})"
    node = nodes.get(key)
    if node is None:
        nodes[key] = TreeNode(key, t, 0.0, "", "collapsed", parent,
                              f"step {t} · pruned children of this beam:<br>{line}", count=1)
        nodes[parent].children.append(key)
    else:
        node.count += 1
        node.hover += f"<br>{line}"


def _mark_path(nodes: dict[str, TreeNode], beam: BeamTrace, index: int | None, n_steps: int) -> None:
    if index is None or not 0 <= index < len(beam.hypotheses):
        return
    nodes["root"].on_path = True
    for t, ci in enumerate(beam.hypotheses[index].path[:n_steps]):
        node = nodes.get(f"{t}:{ci}")
        if node is not None:
            node.on_path = True


def _layout(nodes: dict[str, TreeNode], last_step: int) -> None:
    """Leaves (collapsed markers excepted) take consecutive rows in depth-first order, children
    on-path first, then best first; a parent sits on its first child's row. Also marks dead ends
    (beams on ``last_step`` are the search's frontier, alive)."""
    next_row = 0.0
    stack: list[tuple[str, bool]] = [("root", False)]
    while stack:  # iterative post-order: deep trees must not hit the recursion limit
        key, expanded = stack.pop()
        node = nodes[key]
        real = [k for k in node.children if nodes[k].status != "collapsed"]
        real.sort(key=lambda k: not nodes[k].on_path)  # stable: score order otherwise
        if not expanded:
            stack.append((key, True))
            stack.extend((k, False) for k in reversed(real))
            continue
        if real:
            node.y = nodes[real[0]].y
        else:
            node.y, next_row = next_row, next_row + 1
        for k in node.children:
            if nodes[k].status == "collapsed":
                nodes[k].y = node.y + COLLAPSED_OFFSET
        if node.status == "kept" and node.step < last_step:
            node.dead_end = all(nodes[k].status in ("pruned", "collapsed") or nodes[k].dead_end for k in node.children)


def leaf_rows(nodes: dict[str, TreeNode]) -> int:
    return int(max((n.y for n in nodes.values()), default=0)) + 1


def tree_figure(beam: BeamTrace, collapse_pruned: bool = True, highlight: int | None = None,
                upto: int | None = None) -> go.Figure:
    """The search tree as a plotly figure (pan to move, scroll or box to zoom)."""
    nodes = build_tree(beam, collapse_pruned, highlight, upto)
    labels = visible_labels(nodes)
    fig = go.Figure()
    for on_path in (False, True):
        xs, ys = [], []
        for n in nodes.values():
            if n.parent is not None and (n.on_path and nodes[n.parent].on_path) == on_path:
                xs += [nodes[n.parent].step, n.step, None]
                ys += [nodes[n.parent].y, n.y, None]
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", hoverinfo="skip", showlegend=False,
                                 line={"color": WINNER if on_path else "#9aa7b4", "width": 3 if on_path else 1}))
    for status in ("kept", "finished", "dropped", "pruned", "collapsed", "root"):
        group = [n for n in nodes.values() if n.status == status]
        if group:
            fig.add_trace(_node_trace(status, group, labels))
    path = [n for n in nodes.values() if n.on_path and n.status != "root"]
    if path:
        fig.add_trace(go.Scatter(x=[n.step for n in path], y=[n.y for n in path], mode="markers", name="winning path",
                                 hoverinfo="skip", marker={"size": 17, "color": "rgba(0,0,0,0)",
                                                           "line": {"color": WINNER, "width": 2.5}}))
    fig.update_layout(
        dragmode="pan", hovermode="closest", plot_bgcolor="white", font={"size": FONT},
        title={"text": TREE_TITLE, "x": 0.01, "font": {"size": FONT + 2}},
        xaxis={"title": "step", "zeroline": False, "dtick": 1, "gridcolor": "#eeeeee", "tickfont": {"size": FONT}},
        **_frame(nodes),
    )
    box, end = frame(nodes), max(path, key=lambda n: n.step, default=None)
    if end is not None and box.width > FIT_WIDTH:  # its box scrolls: the page shows the path's end first
        fig.update_layout(meta={"scroll_to": round(MARGIN["l"] + box.px(end.step, end.y)[0])})
    return fig


@dataclass(frozen=True)
class Frame:
    """Where the tree's steps and rows land in pixels: fixed width and height, fixed axis ranges."""

    width: int
    height: int
    x_range: tuple[float, float]
    y_range: tuple[float, float]  # reversed: the first row on top
    bottom: int = MARGIN["b"]  # px under the plot area (axis, legend)

    def px(self, step: float, row: float) -> tuple[float, float]:
        """A node's centre in pixels from the plot area's top-left corner."""
        plot_w = self.width - MARGIN["l"] - MARGIN["r"]
        plot_h = self.height - MARGIN["t"] - self.bottom
        x = (step - self.x_range[0]) / (self.x_range[1] - self.x_range[0]) * plot_w
        y = (row - self.y_range[1]) / (self.y_range[0] - self.y_range[1]) * plot_h
        return x, y


def frame(nodes: dict[str, TreeNode]) -> Frame:
    """The tree's frame: STEP_PX per step (at least FIT_WIDTH), ROW_PX per row (at most MAX_HEIGHT)."""
    last = max((n.step for n in nodes.values()), default=0)
    rows = leaf_rows(nodes)
    x_range = (-1.5, last + 0.5)
    width = int(max(FIT_WIDTH, (x_range[1] - x_range[0]) * STEP_PX + MARGIN["l"] + MARGIN["r"]))
    bottom = MARGIN["b"] if width <= FIT_WIDTH else WIDE_BOTTOM
    height = int(min(MAX_HEIGHT, max(460, MARGIN["t"] + bottom + ROW_PX * (rows + 1))))
    return Frame(width, height, x_range, (rows - 0.3, -0.9), bottom)  # room above row 0 for its labels


def _frame(nodes: dict[str, TreeNode]) -> dict:
    """A tree that fits FIT_WIDTH fills its box (wider on a desktop: labels only get more room);
    a wider one has a fixed width that its box scrolls, and its legend in one column at the left."""
    box = frame(nodes)
    fixed = box.width > FIT_WIDTH
    legend = {"orientation": "v" if fixed else "h", "x": 0, "yref": "container", "y": 0, "yanchor": "bottom",
              "font": {"size": FONT}}
    return {"width": box.width if fixed else None, "height": box.height, "autosize": not fixed,
            "margin": dict(MARGIN, b=box.bottom), "legend": legend,
            "xaxis_range": list(box.x_range), "yaxis": {"visible": False, "range": list(box.y_range)}}


def short_token(label: str) -> str:
    """A node's label cut to LABEL_CHARS characters (…)."""
    return label if len(label) <= LABEL_CHARS else label[: LABEL_CHARS - 1] + "…"


def label_box(box: Frame, node: TreeNode, text: str) -> tuple[float, float, float, float]:
    """The pixels (left, top, right, bottom) a label drawn "top center" over ``node`` covers."""
    x, y = box.px(node.step, node.y)
    half = len(text) * CHAR_PX / 2
    return x - half, y - LABEL_LIFT - LABEL_PX, x + half, y - LABEL_LIFT


def _overlap(a: tuple[float, float, float, float], b: tuple[float, float, float, float]) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def visible_labels(nodes: dict[str, TreeNode]) -> dict[str, str]:
    """Node key -> the label drawn: the winning path first, then finished, kept and dropped nodes
    step by step, each only where its box overlaps no label already placed (the rest: hover)."""
    box = frame(nodes)
    order = sorted((n for n in nodes.values() if n.status in ("kept", "finished", "dropped")),
                   key=lambda n: (not n.on_path, n.dead_end, n.status != "finished", n.step, n.y))
    placed: list[tuple[float, float, float, float]] = []
    shown: dict[str, str] = {}
    for node in order:
        text = short_token(node.label)
        rect = label_box(box, node, text)
        if text.strip() and not any(_overlap(rect, other) for other in placed):
            placed.append(rect)
            shown[node.key] = text
    return shown


def _node_trace(status: str, group: list[TreeNode], labels: dict[str, str]) -> go.Scatter:
    small = status in ("pruned", "collapsed")
    labelled = status in ("kept", "finished", "dropped")
    sizes = [min(14, 6 + 2 * n.count) if status == "collapsed" else (7 if small else 11) for n in group]
    opacity = [0.35 if n.dead_end else 1.0 for n in group]
    return go.Scatter(
        x=[n.step for n in group], y=[n.y for n in group], mode="markers+text" if labelled else "markers",
        name=STATUS_NAMES[status], text=[labels.get(n.key, "") for n in group] if labelled else None,
        textposition="top center", textfont={"size": FONT}, hovertext=[n.hover for n in group], hoverinfo="text",
        marker={"size": sizes, "color": STATUS_COLOURS[status], "opacity": opacity,
                "symbol": "diamond" if status == "finished" else "circle", "line": {"color": "white", "width": 1}},
    )


def hypotheses_rows(beam: BeamTrace, length_penalty: float) -> list[list]:
    """Table rows, ranked under ``length_penalty``: rank, search rank, text, tokens, sum log-prob,
    score at the search's penalty, score at ``length_penalty``."""
    rows = []
    for rank, (i, score) in enumerate(rerank(beam.hypotheses, length_penalty), start=1):
        h = beam.hypotheses[i]
        rows.append([rank, i + 1, h.text, len(h.token_ids), round(h.sum_logprobs, 4), round(h.score, 4),
                     round(score, 4)])
    return rows


HYPOTHESES_HEADERS = ["rank", "found", "text", "tokens", "log-prob", "score", "score now"]
HYPOTHESES_NOTE = ("rank: under the slider's length penalty · found: the search's own rank · log-prob: summed, in nats · "
                   "score: at the search's length penalty · score now: at the slider's. "
                   + glossary.hover("length penalty"))
HYPOTHESES_WIDTHS: list[str | int] = ["9%", "9%", "37%", "9%", "12%", "12%", "12%"]  # for gr.Dataframe(column_widths=...)


def winner_note(beam: BeamTrace, length_penalty: float) -> str:
    """Markdown: which hypothesis wins under ``length_penalty``, and whether that changed."""
    if not beam.hypotheses:
        return "No finished hypotheses yet."
    best, score = rerank(beam.hypotheses, length_penalty)[0]
    h = beam.hypotheses[best]
    head = (f"With length penalty **{length_penalty:g}** the best is hypothesis **#{best + 1}** "
            f"({len(h.token_ids)} tokens, score {score:.4f}).")
    if best == (beam.winner or 0):
        return head + f" Same winner as the search (length penalty {beam.length_penalty:g})."
    return (head + f" The search (length penalty {beam.length_penalty:g}) returned #{(beam.winner or 0) + 1}: "
            f"{'longer' if len(h.token_ids) > len(beam.hypotheses[beam.winner or 0].token_ids) else 'shorter'} "
            "sequences win now. "
            "(Re-ranking only the finished hypotheses: a search run with this penalty could have kept other beams.)")


def step_summary(beam: BeamTrace) -> str:
    """One line on the search: steps, candidates, statuses."""
    counts: dict[str, int] = {}
    for s in beam.steps:
        for c in s.candidates:
            counts[c.status] = counts.get(c.status, 0) + 1
    parts = ", ".join(f"{counts[k]} {k}" for k in ("kept", "pruned", "finished", "dropped") if k in counts)
    tail = f" · {ended_text(beam)}" if ended_text(beam) else ""
    return (f"{len(beam.steps)} steps · {beam.num_beams} beams · {beam.candidates_per_step} candidates per step"
            f"{' per group' if beam.num_beam_groups > 1 else ''} · {parts}{tail}")


def ended_text(beam: BeamTrace) -> str:
    """Why the search ended, in words: every beam at max_new_tokens is not "no beam could continue"."""
    if beam.ended_by == "early_stopping":
        return "ended by early stopping"
    if beam.ended_by == "no_continuation":  # the engine's catch-all: say which limit it was
        reasons = {h.finish_reason for h in beam.hypotheses}
        if reasons == {"max_new_tokens"}:
            return "ended: every beam reached max_new_tokens"
        if "max_new_tokens" in reasons:
            return "ended: max_new_tokens reached"
        return "ended: every beam finished"
    return ""


def greedy_note(greedy_ids: Sequence[int], greedy_text: str, greedy_logprobs: Sequence[float], beam: BeamTrace,
                length_penalty: float, length: int | None = None) -> str:
    """Markdown comparing the greedy continuation with the hypotheses under ``length_penalty``.
    ``greedy_logprobs``: the log-prob of each greedy token (same processors as the search);
    ``length``: what its score divides by, as the search's hypotheses' ``length`` (a remote search
    counts the prompt too, engine.strategies.remote_beam); its token count otherwise. Both say generated tokens."""
    if not greedy_ids:
        return "Greedy: no tokens."
    total = float(sum(greedy_logprobs))
    score = rescore(total, length or len(greedy_ids), length_penalty)
    better = sum(1 for _, s in rerank(beam.hypotheses, length_penalty) if s > score)
    same = next((i for i, h in enumerate(beam.hypotheses) if list(h.token_ids) == list(greedy_ids)), None)
    where = (f"it is hypothesis #{same + 1}" if same is not None
             else f"{better} of {len(beam.hypotheses)} hypotheses score higher")
    return (f"**Greedy** ({len(greedy_ids)} tokens, sum log-prob {total:.3f}, score {score:.4f} "
            f"at length penalty {length_penalty:g}; {where}):\n\n> {html.escape(greedy_text).replace(chr(10), ' ')}")
