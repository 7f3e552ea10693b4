"""EAGLE charts: pure functions of EagleRound records (engine.strategies.eagle) -> plotly figures.

``tree_figure``: one round's draft tree, the root (the token fed first) at depth 0, each node at its
depth under its parent (``medusa.tree_layout``), labelled with its token and its draft confidence
(the head's probability of that token given its parent: the node's path score over its parent's),
coloured by what the target did with it (accepted: on the emitted path, drawn thick; rejected;
untested, under a node the walk never reached); a cross marks the depth where the target refused
every child, and a diamond the target's own token. ``calibration``: the tested nodes (accepted or
rejected) of a run binned by draft confidence, the fraction accepted per bin (EAGLE-2 grows its
tree where this curve says the head is right); ``calibration_figure`` draws it against the
diagonal. ``accept_figure``: each round's acceptance length (accepted draft nodes + the target's
own token) with the run's tokens per target forward as a line.
No gradio here.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Sequence

import plotly.graph_objects as go

from engine.strategies.eagle import EagleRound
from engine.strategies.medusa import TreeNode

from .medusa import FATES, add_root, add_target, finish_tree, tree_layout
from .step import readable

CALIBRATION_BINS = 5  # equal-width confidence bins over [0, 1]

__all__ = ["CALIBRATION_BINS", "Bin", "accept_figure", "calibration", "calibration_figure", "confidence",
           "tree_figure"]


def confidence(node: TreeNode, tree: Sequence[TreeNode]) -> float:
    """The head's probability of ``node``'s token given its parent (its path score over the parent's)."""
    parent = tree[node.parent].score if node.parent >= 0 else 1.0
    return min(1.0, node.score / parent) if parent > 0 else 0.0


def node_label(node: TreeNode, tree: Sequence[TreeNode]) -> str:
    return f"{readable(node.token)} {confidence(node, tree):.2f}"


def tree_figure(eagle_round: EagleRound, first_token: str = "") -> go.Figure:
    """The draft tree of one round (see the module docstring)."""
    tree, path = eagle_round.tree, set(eagle_round.path)
    *ys, root_y = tree_layout(tree)
    fig = go.Figure()
    for on_path in (False, True):
        xs: list[float | None] = []
        yss: list[float | None] = []
        for node in tree:
            if (node.index in path) == on_path:
                xs += [node.depth - 1, node.depth, None]
                yss += [root_y if node.parent < 0 else ys[node.parent], ys[node.index], None]
        line = dict(color=FATES["accepted"], width=4) if on_path else dict(color="#bbbbbb", width=1.5)
        fig.add_trace(go.Scatter(x=xs, y=yss, mode="lines", hoverinfo="skip", line=line,
                                 name="accepted path" if on_path else "tree edges"))
    for status in ("accepted", "rejected", "untested"):
        nodes = [n for n in tree if n.status == status]
        if nodes:
            fig.add_trace(go.Scatter(
                x=[n.depth for n in nodes], y=[ys[n.index] for n in nodes], mode="markers+text",
                marker=dict(size=16, color=FATES[status]), text=[node_label(n, tree) for n in nodes],
                textposition="middle right", name=status,
                hovertext=[f"depth {n.depth}: <b>{html.escape(readable(n.token))}</b>, draft confidence "
                           f"{confidence(n, tree):.3f}, path score {n.score:.3f}, {status}" for n in nodes],
                hoverinfo="text"))
    add_root(fig, root_y, first_token)
    last_y = ys[eagle_round.path[-1]] if eagle_round.path else root_y
    if eagle_round.refused_at:
        fig.add_trace(go.Scatter(x=[eagle_round.refused_at - 0.5], y=[last_y], mode="markers",
                                 marker=dict(size=14, color=FATES["rejected"], symbol="x"),
                                 name=f"target refused at depth {eagle_round.refused_at}", hoverinfo="name"))
    extra = eagle_round.extra
    if extra is not None:
        add_target(fig, len(eagle_round.path) + 0.5, last_y + 0.5, extra.token, extra.kind)
    refused = f", refused at depth {eagle_round.refused_at}" if eagle_round.refused_at else ", reached a leaf"
    title = (f"Round {eagle_round.index}: {len(path)} of {len(tree)} draft nodes accepted{refused}; "
             f"{len(eagle_round.emitted_token_ids)} emitted for one target forward")
    return finish_tree(fig, title, ys, max((n.depth for n in tree), default=0), "depth")


@dataclass(frozen=True)
class Bin:
    """Tested nodes whose draft confidence lies in [low, high): how many, how many the target
    accepted, and their mean confidence."""

    low: float
    high: float
    nodes: int
    accepted: int
    mean_confidence: float

    @property
    def accepted_share(self) -> float:
        return self.accepted / self.nodes


def calibration(rounds: Sequence[EagleRound], bins: int = CALIBRATION_BINS) -> list[Bin]:
    """The tested nodes of ``rounds`` binned by draft confidence (empty bins left out)."""
    groups: list[list[tuple[float, bool]]] = [[] for _ in range(bins)]
    for r in rounds:
        for node in r.tree:
            if node.status in ("accepted", "rejected"):
                c = confidence(node, r.tree)
                groups[min(int(c * bins), bins - 1)].append((c, node.status == "accepted"))
    return [Bin(i / bins, (i + 1) / bins, len(g), sum(a for _, a in g), sum(c for c, _ in g) / len(g))
            for i, g in enumerate(groups) if g]


def calibration_figure(rounds: Sequence[EagleRound], bins: int = CALIBRATION_BINS) -> go.Figure:
    """Fraction accepted per confidence bin against the bin's mean confidence, with the diagonal."""
    found = calibration(rounds, bins)
    fig = go.Figure([go.Scatter(x=[0, 1], y=[0, 1], mode="lines", line=dict(color="#888888", dash="dash"),
                                name="perfectly calibrated", hoverinfo="skip")])
    fig.add_trace(go.Scatter(
        x=[b.mean_confidence for b in found], y=[b.accepted_share for b in found], mode="markers+lines+text",
        marker=dict(size=[10 + min(20, b.nodes) for b in found], color=FATES["accepted"]),
        text=[f"{b.accepted}/{b.nodes}" for b in found], textposition="top center", name="accepted / tested",
        hovertext=[f"confidence {b.low:.1f}-{b.high:.1f}: {b.accepted} of {b.nodes} tested nodes accepted "
                   f"(mean confidence {b.mean_confidence:.2f})" for b in found], hoverinfo="text"))
    fig.update_layout(title="Draft confidence vs the target's acceptance (tested nodes, all rounds)",
                      xaxis_title="draft confidence (head's probability of the token)", yaxis_title="fraction accepted",
                      height=320, margin=dict(l=50, r=20, t=60, b=40), plot_bgcolor="white",
                      legend=dict(orientation="h", y=-0.25))
    fig.update_xaxes(range=[0, 1.05])
    fig.update_yaxes(range=[-0.05, 1.1])
    return fig


def accept_figure(rounds: Sequence[EagleRound], tokens_per_forward: float | None = None) -> go.Figure:
    """Tokens emitted per round: accepted draft nodes and the target's own token, stacked."""
    index = [r.index for r in rounds]
    fig = go.Figure([
        go.Bar(x=index, y=[len(r.emitted_token_ids) - r.num_accepted for r in rounds], name="target's token",
               marker_color=FATES["target"]),
        go.Bar(x=index, y=[r.num_accepted for r in rounds], name="accepted draft tokens", marker_color=FATES["accepted"]),
    ])
    if tokens_per_forward is None and rounds:
        tokens_per_forward = sum(len(r.emitted_token_ids) for r in rounds) / len(rounds)
    if tokens_per_forward is not None:
        fig.add_hline(y=tokens_per_forward, line=dict(color="#222222", dash="dash"),
                      annotation_text=f"{tokens_per_forward:.2f} tokens per target forward")
    fig.update_layout(barmode="stack", title="Acceptance length per round (one target forward each)",
                      xaxis_title="round", yaxis_title="tokens", height=320, margin=dict(l=50, r=20, t=60, b=40),
                      plot_bgcolor="white")
    return fig
