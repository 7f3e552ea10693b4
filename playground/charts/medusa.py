"""Medusa charts: pure functions of MedusaRound records (engine.strategies.medusa) -> plotly figures.

``round_figure``: a round with a verified ``tree`` is drawn by ``tree_figure``: the nodes by depth
(column d: head d's candidates placed under their parent), edges parent -> child, each node coloured
by its status (accepted: on the emitted path, drawn thick; rejected; untested), and the target's own
token after the path. A round without one (a chain trace from before tree verification) is drawn
as a chain: column 0 is the round's first token (the
last committed one); column k holds head k's top candidates (top-1 first, at the top). The chain
the target verified links each head's top-1; each top-1 is coloured by its fate (accepted,
rejected, or never tested because an earlier head's was rejected); the target's own token (the
resampled correction or the bonus) is drawn after the last accepted one. ``accept_figure``: the
tokens each round emitted (accepted drafts + the target's token) against the round index, with the
run's tokens per target forward as a line. No gradio here.
"""

from __future__ import annotations

import html
from typing import Sequence

import plotly.graph_objects as go

from engine.strategies.medusa import MedusaRound, TreeNode
from engine.numbers import decimal

from .step import readable

FATES = {
    "accepted": "#2e7d32",
    "rejected": "#c62828",
    "untested": "#9e9e9e",
    "candidate": "#cfd8dc",
    "target": "#1565c0",
}


def fates(medusa_round: MedusaRound) -> list[str]:
    """Per head (in order): accepted | rejected | untested (its top-1's fate in the chain)."""
    out = []
    for i in range(len(medusa_round.proposals)):
        if i < len(medusa_round.drafted):
            out.append("accepted" if medusa_round.drafted[i].accepted else "rejected")
        else:
            out.append("untested")
    return out


def target_token(medusa_round: MedusaRound) -> tuple[int, str, str] | None:
    """The token the target itself added at the end of the round: (token id, text, kind)."""
    extra = medusa_round.extra
    return None if extra is None else (extra.token_id, extra.token, extra.kind)


def round_figure(medusa_round: MedusaRound, first_token: str = "") -> go.Figure:
    """One round as a tree (see the module docstring). ``first_token``: the text of the token fed
    first (the last committed one), for the root label."""
    if medusa_round.tree:
        return tree_figure(medusa_round, first_token)
    fig = go.Figure()
    fate = fates(medusa_round)
    accepted = medusa_round.num_accepted
    chain_x, chain_y = [0], [0]
    for k, proposal in enumerate(medusa_round.proposals, start=1):
        chain_x.append(k)
        chain_y.append(0)
        others = proposal.candidates[1:]
        if others:
            fig.add_trace(go.Scatter(
                x=[k] * len(others), y=[-(i + 1) for i in range(len(others))], mode="markers+text",
                marker=dict(size=12, color=FATES["candidate"]), text=[readable(c.token) for c in others],
                textposition="middle right", name="other candidates" if k == 1 else None, showlegend=k == 1,
                legendgroup="candidate", hovertext=[f"head {k} candidate {readable(c.token)}: p={decimal(c.prob)}" for c in others],
                hoverinfo="text"))
    fig.add_trace(go.Scatter(x=chain_x, y=chain_y, mode="lines", line=dict(color="#888888", width=2), hoverinfo="skip",
                             name="verified chain (each head's top-1)"))
    for name in ("accepted", "rejected", "untested"):
        ks = [k for k, f in enumerate(fate, start=1) if f == name]
        if not ks:
            continue
        props = [medusa_round.proposals[k - 1] for k in ks]
        fig.add_trace(go.Scatter(
            x=ks, y=[0] * len(ks), mode="markers+text", marker=dict(size=18, color=FATES[name], symbol="circle"),
            text=[readable(p.token) for p in props], textposition="top center", name=f"top-1 {name}",
            hovertext=[_hover(medusa_round, k) for k in ks], hoverinfo="text"))
    fig.add_trace(go.Scatter(x=[0], y=[0], mode="markers+text", marker=dict(size=16, color="#222222", symbol="square"),
                             text=[readable(first_token) if first_token else "fed"], textposition="top center",
                             name="first token fed", hoverinfo="skip"))
    extra = target_token(medusa_round)
    if extra is not None:
        x = accepted + 0.5
        fig.add_trace(go.Scatter(x=[x], y=[0.6], mode="markers+text", marker=dict(size=16, color=FATES["target"], symbol="diamond"),
                                 text=[readable(extra[1])], textposition="top center",
                                 name=f"target's {extra[2]} token",
                                 hovertext=[f"{extra[2]} token from the target: {html.escape(readable(extra[1]))}"], hoverinfo="text"))
    width = max(1, len(medusa_round.proposals))
    fig.update_layout(
        title=f"Round {medusa_round.index}: {accepted} of {len(medusa_round.drafted)} head tokens accepted, "
              f"{len(medusa_round.emitted_token_ids)} emitted for one target forward",
        height=340, margin=dict(l=30, r=30, t=60, b=40), plot_bgcolor="white", legend=dict(orientation="h", y=-0.15))
    fig.update_xaxes(tickvals=list(range(width + 1)), ticktext=["fed"] + [f"head {k}" for k in range(1, width + 1)],
                     range=[-0.5, width + 0.8], showgrid=False)
    fig.update_yaxes(visible=False, range=[-(max((len(p.candidates) for p in medusa_round.proposals), default=1)) - 0.5, 1.3])
    return fig


def tree_layout(tree: Sequence[TreeNode]) -> list[float]:
    """The y of each node (root: index -1, returned last): leaves one apart in depth-first order,
    a parent at the mean of its children, so no two edges cross. Tree order puts parents first."""
    children: dict[int, list[int]] = {}
    for node in tree:
        children.setdefault(node.parent, []).append(node.index)
    y: dict[int, float] = {}
    next_leaf = [0.0]

    def place(index: int) -> float:
        kids = children.get(index, [])
        if kids:
            y[index] = sum(place(k) for k in kids) / len(kids)
        else:
            y[index], next_leaf[0] = -next_leaf[0], next_leaf[0] + 1
        return y[index]

    place(-1)
    return [y[n.index] for n in tree] + [y[-1]]


def tree_figure(medusa_round: MedusaRound, first_token: str = "") -> go.Figure:
    """The verified tree of one round (see the module docstring)."""
    tree, path = medusa_round.tree, set(medusa_round.path)
    *ys, root_y = tree_layout(tree)
    fig = go.Figure()
    for on_path in (False, True):
        xs, yss = [], []
        for node in tree:
            if (node.index in path) == on_path:
                parent_y = root_y if node.parent < 0 else ys[node.parent]
                xs += [node.depth - 1, node.depth, None]
                yss += [parent_y, ys[node.index], None]
        line = dict(color=FATES["accepted"], width=4) if on_path else dict(color="#bbbbbb", width=1.5)
        fig.add_trace(go.Scatter(x=xs, y=yss, mode="lines", hoverinfo="skip", line=line,
                                 name="accepted path" if on_path else "tree edges"))
    for status in ("accepted", "rejected", "untested"):
        nodes = [n for n in tree if n.status == status]
        if nodes:
            fig.add_trace(go.Scatter(
                x=[n.depth for n in nodes], y=[ys[n.index] for n in nodes], mode="markers+text",
                marker=dict(size=16, color=FATES[status]), text=[readable(n.token) for n in nodes],
                textposition="middle right", name=status,
                hovertext=[f"head {n.depth} candidate {n.rank + 1}: <b>{html.escape(readable(n.token))}</b>, "
                           f"path score {n.score:.3f}, {status}" for n in nodes], hoverinfo="text"))
    add_root(fig, root_y, first_token)
    extra = target_token(medusa_round)
    if extra is not None:
        last_y = ys[medusa_round.path[-1]] if medusa_round.path else root_y
        add_target(fig, len(medusa_round.path) + 0.5, last_y + 0.5, extra[1], extra[2])
    title = (f"Round {medusa_round.index}: {len(path)} of {len(tree)} tree nodes accepted (one path), "
             f"{len(medusa_round.emitted_token_ids)} emitted for one target forward")
    return finish_tree(fig, title, ys, max((n.depth for n in tree), default=0), "head")


def add_root(fig: go.Figure, root_y: float, first_token: str) -> None:
    """A round tree's root: the token fed first (a black square at depth 0)."""
    fig.add_trace(go.Scatter(x=[0], y=[root_y], mode="markers+text",
                             marker=dict(size=16, color="#222222", symbol="square"),
                             text=[readable(first_token) if first_token else "fed"], textposition="top center",
                             name="first token fed", hoverinfo="skip"))


def add_target(fig: go.Figure, x: float, y: float, token: str, kind: str) -> None:
    """The target's own token after the accepted path (``kind``: resampled, bonus, ...)."""
    fig.add_trace(go.Scatter(x=[x], y=[y], mode="markers+text",
                             marker=dict(size=16, color=FATES["target"], symbol="diamond"),
                             text=[readable(token)], textposition="top center", name=f"target's {kind} token",
                             hovertext=[f"{kind} token from the target: {html.escape(readable(token))}"],
                             hoverinfo="text"))


def finish_tree(fig: go.Figure, title: str, ys: Sequence[float], depth: int, level: str) -> go.Figure:
    """A round tree's layout (Medusa's and EAGLE's): its height from the rows ``ys`` use, depth
    ticks named ``fed``, ``<level> 1`` ... ``<level> depth``, no y axis."""
    fig.update_layout(title=title, height=max(340, 28 * (1 + int(-min(ys, default=0)))),
                      margin=dict(l=30, r=30, t=60, b=40), plot_bgcolor="white", legend=dict(orientation="h", y=-0.15))
    fig.update_xaxes(tickvals=list(range(depth + 1)), ticktext=["fed"] + [f"{level} {k}" for k in range(1, depth + 1)],
                     range=[-0.5, depth + 0.9], showgrid=False)
    fig.update_yaxes(visible=False)
    return fig


def _hover(medusa_round: MedusaRound, k: int) -> str:
    proposal = medusa_round.proposals[k - 1]
    head_p = proposal.candidates[0].prob if proposal.candidates else float("nan")
    line = f"head {k} top-1 <b>{html.escape(readable(proposal.token))}</b> (head p={decimal(head_p)})"
    if k - 1 < len(medusa_round.drafted):
        d = medusa_round.drafted[k - 1]
        line += f"<br>target p={decimal(d.p)}, accept prob {decimal(d.accept_prob)}" + (f", u={decimal(d.u)}" if d.u is not None else "")
    return line


def accept_figure(rounds: Sequence[MedusaRound], tokens_per_forward: float | None = None) -> go.Figure:
    """Tokens emitted per round, split into accepted head tokens and the target's own token."""
    index = [r.index for r in rounds]
    heads = [r.num_accepted for r in rounds]
    target = [len(r.emitted_token_ids) - r.num_accepted for r in rounds]
    fig = go.Figure([
        go.Bar(x=index, y=target, name="target's token", marker_color=FATES["target"]),
        go.Bar(x=index, y=heads, name="accepted head tokens", marker_color=FATES["accepted"]),
    ])
    if tokens_per_forward is None and rounds:
        tokens_per_forward = sum(len(r.emitted_token_ids) for r in rounds) / len(rounds)
    if tokens_per_forward is not None:
        fig.add_hline(y=tokens_per_forward, line=dict(color="#222222", dash="dash"),
                      annotation_text=f"{tokens_per_forward:.2f} tokens per target forward")
    fig.update_layout(barmode="stack", title="Tokens per round (one target forward each)", xaxis_title="round",
                      yaxis_title="tokens", height=320, margin=dict(l=50, r=20, t=60, b=40), plot_bgcolor="white")
    return fig
