"""Step-through charts: pure functions of traces -> plotly figures, highlight data and text.

No gradio here; everything is unit-tested on hand-made traces.
"""

from __future__ import annotations

import math
from typing import Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from engine.trace import StageTrace, StepTrace, TokenProb, Trace

ACCENT = "#e4572e"  # the chosen token
BAR = "#4c78a8"
REMOVED = "#b8b8b8"
DRAW = "#222222"
PANELS_PER_ROW = 4

STAGE_TITLES = {
    "raw": "raw model",
    "final": "final",
    "temperature": "temperature",
    "top_k": "top-k",
    "top_p": "top-p",
    "min_p": "min-p",
    "typical_p": "typical",
    "epsilon": "ε-cutoff",
    "repetition_penalty": "repetition pen.",
    "frequency_penalty": "frequency pen.",
    "presence_penalty": "presence pen.",
    "no_repeat_ngram": "no-repeat n-gram",
    "constraints": "constraints",
    "contrast": "contrast (expert − amateur)",
}


def readable(token: str) -> str:
    """Make whitespace visible: ␣ for spaces, ↵ for newlines, ⇥ for tabs, ∅ for empty."""
    if token == "":
        return "∅"
    return token.replace(" ", "␣").replace("\n", "↵").replace("\t", "⇥").replace("\r", "⏎")


def stage_title(stage: StageTrace) -> str:
    params = ", ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in stage.params.values()
                       if not isinstance(v, list))
    name = STAGE_TITLES.get(stage.name, stage.name) + (f" {params}" if params else "")
    removed = f" · −{stage.mass_removed:.1%}" if stage.mass_removed > 0 else ""
    return f"{name}<br><sup>kept {stage.kept:,}{removed}</sup>"


def _unique_labels(tokens: Sequence[str], ids: Sequence[int]) -> list[str]:
    """Readable labels, disambiguated when two tokens render the same."""
    labels, seen = [], set()
    for text, token_id in zip(tokens, ids):
        label = readable(text)
        if label in seen:
            label = f"{label} #{token_id}"
        seen.add(label)
        labels.append(label)
    return labels


def _stage_traces(stage: StageTrace, chosen: int) -> list[go.Bar]:
    entries = list(stage.top)
    labels = _unique_labels([t.token for t in entries], [t.token_id for t in entries])
    colors = [ACCENT if t.token_id == chosen else BAR for t in entries]
    bars = [go.Bar(
        x=[t.prob for t in entries], y=labels, orientation="h", marker_color=colors, name=stage.name,
        customdata=[[t.token_id] for t in entries], showlegend=False,
        hovertemplate="%{y} (id %{customdata[0]})<br>p = %{x:.4%}<extra>" + stage.name + "</extra>",
    )]
    if stage.removed:
        rem_labels = _unique_labels([t.token for t in stage.removed], [t.token_id for t in stage.removed])
        bars.append(go.Bar(
            x=[t.prob for t in stage.removed], y=[f"✕ {lab}" for lab in rem_labels], orientation="h",
            marker=dict(color="rgba(0,0,0,0)", line=dict(color=REMOVED, width=1.5), pattern_shape="/"),
            name="removed", showlegend=False,
            hovertemplate="%{y}: removed here (had p = %{x:.4%})<extra>" + stage.name + "</extra>",
        ))
    return bars


def _draw_traces(step: StepTrace) -> list:
    """The inverse-CDF picture: each final top token owns [F(before), F(before) + p); u falls in
    the chosen token's interval."""
    final = step.stages[-1]
    entries = sorted(final.top, key=lambda t: (-t.prob, t.token_id))
    labels = _unique_labels([t.token for t in entries], [t.token_id for t in entries])
    bases, acc = [], 0.0
    for t in entries:
        bases.append(acc)
        acc += t.prob
    if step.chosen_token_id not in {t.token_id for t in entries} and step.draw_low is not None:
        labels.append(readable(step.chosen_token))
        bases.append(step.draw_low)
        entries.append(TokenProb(step.chosen_token_id, step.chosen_token, step.chosen_prob))
    colors = [ACCENT if t.token_id == step.chosen_token_id else BAR for t in entries]
    traces: list = [go.Bar(
        x=[t.prob for t in entries], base=bases, y=labels, orientation="h", marker_color=colors, showlegend=False,
        hovertemplate="%{y}: [%{base:.3f}, %{x:.3f} wide)<extra>cumulative</extra>",
    )]
    if step.draw is not None:
        traces.append(go.Scatter(
            x=[step.draw, step.draw], y=[labels[0], labels[-1]], mode="lines+text", showlegend=False,
            line=dict(color=DRAW, dash="dash", width=2), text=["", f"u = {step.draw:.3f}"], textposition="bottom right",
            hovertemplate=f"u = {step.draw:.4f}<extra>draw</extra>",
        ))
    return traces


def stage_chart(step: StepTrace) -> go.Figure:
    """Small multiples: the top-N tokens raw, after each stage in order, and final; tokens a stage
    removed are hatched; the chosen token is highlighted; the last panel shows where u landed."""
    panels = list(step.stages)
    with_draw = step.draw is not None
    count = len(panels) + (1 if with_draw else 0)
    cols = min(PANELS_PER_ROW, count)
    rows = math.ceil(count / cols)
    titles = [stage_title(s) for s in panels] + (["where the draw landed<br><sup>sorted cumulative</sup>"] if with_draw else [])
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=titles, horizontal_spacing=0.09, vertical_spacing=0.16 if rows > 1 else 0.1)
    for i, stage in enumerate(panels):
        for bar in _stage_traces(stage, step.chosen_token_id):
            fig.add_trace(bar, row=i // cols + 1, col=i % cols + 1)
    if with_draw:
        for trace in _draw_traces(step):
            fig.add_trace(trace, row=len(panels) // cols + 1, col=len(panels) % cols + 1)
    fig.update_yaxes(autorange="reversed", tickfont=dict(size=11), automargin=True)
    fig.update_xaxes(tickformat=".0%", rangemode="tozero")
    fig.update_layout(
        height=max(300, 270 * rows), margin=dict(l=10, r=10, t=60, b=20), bargap=0.25, barmode="overlay",
        title=dict(text=f"step {step.index}: chose {readable(step.chosen_token)!s} (p = {step.chosen_prob:.1%})", x=0.01),
        template="plotly_white",
    )
    return fig


def surprisal(step: StepTrace) -> float:
    """−log2 p of the chosen token under the final distribution, in bits."""
    return -math.log2(max(step.chosen_prob, 1e-45))


def run_chart(steps: Sequence[StepTrace], selected: int | None = None) -> go.Figure:
    """Entropy of the final distribution and surprisal of the chosen token, per step (bits)."""
    xs = [s.index for s in steps]
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=xs, y=[s.entropy / math.log(2) for s in steps], mode="lines+markers", name="entropy (bits)",
                             customdata=[[readable(s.chosen_token)] for s in steps],
                             hovertemplate="step %{x}: %{customdata[0]}<br>H = %{y:.2f} bits<extra></extra>"))
    fig.add_trace(go.Scatter(x=xs, y=[surprisal(s) for s in steps], mode="lines+markers", name="surprisal (bits)",
                             customdata=[[readable(s.chosen_token)] for s in steps],
                             hovertemplate="step %{x}: %{customdata[0]}<br>−log₂p = %{y:.2f} bits<extra></extra>"))
    if selected is not None and 0 <= selected < len(steps):
        fig.add_vline(x=selected, line_color=ACCENT, line_width=2, opacity=0.6)
    fig.update_layout(height=240, margin=dict(l=10, r=10, t=30, b=30), template="plotly_white",
                      legend=dict(orientation="h", y=1.15), xaxis_title="step", yaxis_rangemode="tozero")
    return fig


def token_highlights(steps: Sequence[StepTrace], colour_by: str = "probability") -> list[tuple[str, float]]:
    """(token text, score in [-1, 1]) pairs for gr.HighlightedText: confident tokens positive
    (probability >= 0.5 or low surprisal), unlikely picks negative."""
    out = []
    for s in steps:
        if colour_by == "surprisal":
            score = 1.0 - min(surprisal(s), 10.0) / 5.0  # 0 bits -> 1, 5 bits -> 0, >= 10 bits -> -1
        else:
            score = 2.0 * s.chosen_prob - 1.0
        out.append((s.chosen_token, round(max(-1.0, min(1.0, score)), 4)))
    return out


def explain_step(step: StepTrace) -> str:
    """One or two plain sentences about what the stages did at this step."""
    raw = step.stages[0]
    parts = []
    prev_top = raw.top[0] if raw.top else None
    for stage in step.stages[1:-1]:
        title = STAGE_TITLES.get(stage.name, stage.name)
        params = ", ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in stage.params.values() if not isinstance(v, list))
        label = f"{title} {params}".strip()
        top = stage.top[0] if stage.top else None
        if stage.mass_removed > 0:
            covered = 1.0 - stage.mass_removed
            parts.append(f"{label} kept {stage.kept:,} tokens covering {covered:.1%} of the mass")
        elif top is not None and prev_top is not None and top.token_id == prev_top.token_id and abs(top.prob - prev_top.prob) > 0.005:
            verb = "sharpened" if top.prob > prev_top.prob else "flattened"
            parts.append(f"{label} {verb} the top token “{readable(top.token)}” from {prev_top.prob:.0%} to {top.prob:.0%}")
        elif stage.tv_distance > 0.005:
            parts.append(f"{label} moved {stage.tv_distance:.1%} of the probability mass")
        else:
            parts.append(f"{label} changed nothing here")
        prev_top = top
    chosen = readable(step.chosen_token)
    if step.forced:
        pick = f"You picked “{chosen}” (p = {step.chosen_prob:.1%} after all stages)."
    elif step.draw is None:
        pick = f"Greedy took the most probable token “{chosen}” (p = {step.chosen_prob:.1%}; raw model {step.raw_prob:.1%})."
    else:
        pick = (f"The draw u = {step.draw:.3f} fell in “{chosen}”'s slice [{step.draw_low:.3f}, {step.draw_high:.3f}) "
                f"of the sorted cumulative distribution, so it was chosen (p = {step.chosen_prob:.1%}; raw model {step.raw_prob:.1%}).")
    head = ("; ".join(parts) + ". ") if parts else "No stage changed the raw distribution. "
    return head[0].upper() + head[1:] + pick


def summary_markdown(trace: Trace) -> str:
    s = trace.summary
    if not trace.steps:
        return "No tokens yet."
    return (
        f"**{s.get('tokens', len(trace.steps))} tokens** · stop: `{trace.stop_reason or 'running'}` · "
        f"mean log-prob {s.get('mean_logprob', float('nan')):.3f} (raw model {s.get('mean_raw_logprob', float('nan')):.3f}) · "
        f"perplexity {s.get('perplexity', float('nan')):.2f} · time to first token {trace.timing.ttft_ms:.0f} ms · "
        f"{trace.timing.tokens_per_s:.1f} tokens/s · {trace.model} ({trace.quantization}, {trace.device})"
    )


def alternatives(step: StepTrace, limit: int = 10) -> list[tuple[str, int]]:
    """(label, token id) choices for branching: the raw model's top tokens, with their final p."""
    final = {t.token_id: t.prob for t in step.stages[-1].top}
    out = []
    for t in step.stages[0].top[:limit]:
        mark = " ← chosen" if t.token_id == step.chosen_token_id else ""
        fp = final.get(t.token_id)
        after = f", final {fp:.1%}" if fp is not None else ""
        out.append((f"{readable(t.token)!s}  (raw {t.prob:.1%}{after}){mark}", t.token_id))
    return out
