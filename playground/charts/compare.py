"""Compare-view builders: pure functions of traces and metrics -> plotly figures, table rows and
short texts. No gradio here; unit-tested on hand-made traces (tests/browser/test_compare_view.py)."""

from __future__ import annotations

import html
import math
from typing import Any, Sequence

import plotly.graph_objects as go

from engine.config import KNOBS, SAMPLING_ONLY_STAGES, DecodingConfig
from engine.strategies.contrastive import ContrastStep, SearchStep
from engine.reports.metrics import LaneMetrics, SweepSpread, entropy_series, first_divergence
from engine.numbers import percent
from engine.trace import StepTrace, Trace

from . import glossary
from .explain import LOCAL, Source, source_of  # noqa: F401 (the Lessons view's chart reads it here)
from .step import FONT, PHONE_GAP_PX, panel_rows, readable, stage_chart, stop_text, token_highlights
from .tables import column_widths

LANE_COLOURS = ("#4c78a8", "#c4421a", "#3b7d2f", "#8e5a9b", "#a35d00", "#0f7c8c")  # each >= 4.5:1 on white
# A header's hyphen is U+2011 (non-breaking): the header cell wrapped "log-prob" at its hyphen
METRIC_HEADERS = ["lane", "strategy", "tokens", "mean log\u2011prob (raw, nats)", "perplexity", "distinct\u20111", "distinct\u20112",
                  "rep\u20114", "first token (ms)", "tokens/s", "stop"]
# The widest cell each column can hold ("contrastive", "no_tokens_left", a 6-digit perplexity): the
# column widths hold them and the headers' words whole (1,093 px: the table fits 1280 px, and scrolls
# sideways in a phone's 390 px, saying so), so nothing wraps mid-word.
METRIC_WIDEST = ["Lane 6", "contrastive search", "1024", "-12.345", "123456.78", "0.123", "0.123", "0.123", "12345",
                 "123.4", "no_tokens_left"]
METRIC_COLUMN_WIDTHS = column_widths(METRIC_HEADERS, [METRIC_WIDEST])
SWEEP_HEADERS = ["seed", "tokens", "mean log-prob (raw)", "text"]


# Words for a lane's header; any other knob is named by its key with spaces.
SHORT_NAMES = {"temperature": "T", "top_k": "top-k", "top_p": "top-p", "min_p": "min-p", "typical_p": "typical-p",
               "stage_order": "stage order"}
MAX_HEADER_KNOBS = 6


def _word_value(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        text = " → ".join(str(v) for v in value) if all(isinstance(v, str) and v.isidentifier() for v in value) \
            else ", ".join(repr(v) for v in value)
    elif isinstance(value, dict):
        text = ", ".join(f"{k} {v:+g}" if isinstance(v, (int, float)) else f"{k} {v}" for k, v in value.items())
    else:
        text = str(value)
    return text if len(text) <= 40 else text[:39] + "…"


def lane_summary(cfg: DecodingConfig) -> str:
    """A lane in words, e.g. "sample · T 0.8 · top-p 0.9 · seed 1 · 32 tokens": the strategy, its
    non-neutral knobs (the sampling-only ones left out where the pick is greedy, which ignores
    them), the seed where a draw uses it, and the token budget."""
    strategy = cfg.strategy.replace("_", " ")
    parts = [f"{strategy} at T 0 (a greedy pick)" if cfg.is_greedy and cfg.strategy != "greedy" else strategy]
    knobs = []
    for key, value in cfg.to_dict(sparse=True).items():
        knob = KNOBS.get(key)
        ignored = cfg.is_greedy and knob is not None and knob.stage in SAMPLING_ONLY_STAGES
        if key in ("strategy", "seed", "max_new_tokens") or ignored:
            continue
        knobs.append(f"{SHORT_NAMES.get(key, key.replace('_', ' '))} {_word_value(value)}")
    parts += knobs[:MAX_HEADER_KNOBS]
    if len(knobs) > MAX_HEADER_KNOBS:
        parts.append(f"+{len(knobs) - MAX_HEADER_KNOBS} more knobs")
    if not cfg.is_greedy:
        parts.append(f"seed {cfg.seed}")
    parts.append(f"{cfg.max_new_tokens} tokens")
    return " · ".join(parts)


def lane_header(name: str, summary: str, error: bool = False) -> str:
    """The lane's title line: its name and its settings in words (or what is wrong with them)."""
    body = f'<span class="dp-error">⚠ {html.escape(summary)}</span>' if error else html.escape(summary)
    return f'<div class="cmp-lane-header"><b>{html.escape(name)}</b> · {body}</div>'


def lane_colour(i: int) -> str:
    return LANE_COLOURS[i % len(LANE_COLOURS)]


def _num(value: float, digits: int) -> float | str:
    """Rounded for the table; nan (no tokens) shows as a dash."""
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else round(value, digits)


def metrics_rows(metrics: Sequence[LaneMetrics], strategies: Sequence[str]) -> list[list]:
    """One row per lane, in ``METRIC_HEADERS`` order (the strategy in words: "contrastive search"
    wraps at its space in a narrow column)."""
    return [[m.name, strategy.replace("_", " "), m.tokens, _num(m.mean_raw_logprob, 3), _num(m.perplexity, 2),
             _num(m.distinct_1, 3), _num(m.distinct_2, 3), _num(m.rep_4, 3), _num(m.ttft_ms, 0), _num(m.tokens_per_s, 1),
             m.stop_reason or "–"]
            for m, strategy in zip(metrics, strategies)]


def metrics_glossary() -> str:
    """One line under the metrics table explaining its less obvious columns."""
    return glossary.glossary_line(["log-prob", "perplexity", "distinct-1", "distinct-2", "rep-4"])


def picks_greedily(trace: Trace) -> bool:
    """Whether the lane's pick is greedy (the greedy strategy, or temperature 0): no draw, the
    argmax (the best score) is taken."""
    return DecodingConfig.from_dict({"strategy": trace.strategy, **trace.config}).is_greedy


def lane_entropies(steps: Sequence[StepTrace], raw: bool = False, greedy: bool = False) -> list[float]:
    """A lane's per-step entropy in nats: the raw model's, or that of the distribution its token was
    picked from. A greedy pick takes the argmax, so it picks from a one-hot distribution: 0 nats at
    every step, whatever the final distribution's entropy (which a draw would have picked from)."""
    if greedy and not raw:
        return [0.0] * len(steps)
    return list(entropy_series(steps, raw))


def entropy_chart(names: Sequence[str], lanes: Sequence[Sequence[StepTrace]], divergence: int | None = None,
                  raw: bool = False, greedy: Sequence[bool] = ()) -> go.Figure:
    """Per-step entropy (nats) of each lane, overlaid; a vertical line where the lanes diverge.
    ``raw``: the unprocessed model's entropy along each lane's own text, else the entropy of the
    distribution each token was picked from; ``greedy[i]``: lane i picks greedily (its picked-from
    distribution is one-hot: 0 nats)."""
    fig = go.Figure()
    for i, (name, steps) in enumerate(zip(names, lanes)):
        fig.add_trace(go.Scatter(
            x=[s.index for s in steps], y=lane_entropies(steps, raw, i < len(greedy) and greedy[i]),
            mode="lines+markers",
            name=name, line=dict(color=lane_colour(i)), customdata=[[readable(s.chosen_token)] for s in steps],
            hovertemplate=f"{html.escape(name)} · step %{{x}}: %{{customdata[0]}}<br>"
                          "H = %{y:.2f} nats<br>" + html.escape(glossary.hover("entropy")) + "<extra></extra>",
        ))
    if divergence is not None:
        fig.add_vline(x=divergence, line_color="#222", line_dash="dash", opacity=0.6,
                      annotation_text=f"diverge at step {divergence}", annotation_position="top left",
                      annotation_font_size=FONT)
    longest = max((len(steps) for steps in lanes), default=0)
    fig.update_xaxes(tick0=0, dtick=max(1, math.ceil(longest / 12)))  # whole steps only
    which = "raw model" if raw else "picked-from distribution"
    fig.update_layout(height=340, margin=dict(l=10, r=10, t=70, b=10), template="plotly_white", font=dict(size=FONT),
                      title=dict(text=f"Entropy per step<br><sup>{which}, nats</sup>", x=0.01, font=dict(size=FONT + 2)),
                      xaxis_title="step", yaxis=dict(rangemode="tozero", title="nats"),
                      legend=dict(orientation="h", x=0, y=-0.3, yanchor="top"))
    return fig


def divergence_markdown(names: Sequence[str], traces: Sequence[Trace], at: int | None) -> str:
    """Where the lanes part ways, and what each lane chose there."""
    if len(traces) < 2:
        return ""
    if at is None:
        return f"All {len(traces)} lanes produced the same {len(traces[0].steps)} tokens."
    shared = "".join(s.chosen_token for s in traces[0].steps[:at])
    picks = []
    for name, trace in zip(names, traces):
        pick = f"`{readable(trace.steps[at].chosen_token)}`" if at < len(trace.steps) else "*(stopped)*"
        picks.append(f"{name} {pick}")
    prefix = f" after {html.escape(repr(shared))}" if shared else ""
    return f"**Lanes diverge at step {at}**{prefix}: " + " · ".join(picks)


def lane_status(name: str, trace: Trace | None, max_new_tokens: int, phase: str = "", note: str = "",
                made: int | None = None, why: str = "") -> str:
    """A lane's one-line status from its own ``phase`` ("waiting", "running", "done", "stopped";
    "" reads as done with a trace, waiting without): running… with its tokens so far (``made``,
    else its trace's), stopped after them (``why``: a reason other than the Stop button, e.g.
    "at the time limit"), or done with its stop reason and speed. ``note`` is HTML already."""
    made = made if made is not None else len(trace.steps) if trace else 0
    label = html.escape(name)
    if phase == "running":
        return f'<div class="dp-status">{label}: running… {made} / {max_new_tokens} tokens{note}</div>'
    if phase == "stopped":
        why = f" {html.escape(why)}" if why else ""
        return f'<div class="dp-status">{label}: stopped{why} after {made} of {max_new_tokens} tokens{note}</div>'
    if trace is None or phase == "waiting":
        return f'<div class="dp-status">{label}: waiting{note}</div>'
    return (f'<div class="dp-status">{label}: {len(trace.steps)} tokens, stop: {stop_text(trace.stop_reason)}, '
            f'{trace.timing.tokens_per_s:.1f} tok/s{note}</div>')


def lane_source(trace: Trace) -> str:
    """Where a lane's tokens came from, in words: its model, and the server and mode of a served one
    (a local model's quantization where it is not none)."""
    remote = trace.extra.get("remote") if isinstance(trace.extra, dict) else None
    if isinstance(remote, dict) and remote.get("url"):
        return f"{trace.model} ({remote.get('mode', 'step')} mode on {remote['url']})"
    return trace.model + (f" ({trace.quantization})" if trace.quantization not in ("", "none") else "")


def same_text_groups(traces: Sequence[Trace]) -> list[list[int]]:
    """The indices of lanes that wrote the same tokens, a group per text (two lanes or more), in
    the order of their first lane."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, trace in enumerate(traces):
        if trace.steps:
            groups.setdefault(tuple(trace.generated_token_ids), []).append(i)
    return [group for group in groups.values() if len(group) > 1]


def _names(names: Sequence[str]) -> str:
    escaped = [html.escape(n) for n in names]
    return " and ".join(escaped) if len(escaped) < 3 else ", ".join(escaped[:-1]) + " and " + escaped[-1]


def ignored_by_greedy(key: str) -> bool:
    """Whether a greedy pick ignores knob ``key`` between lanes that all pick greedily: a
    sampling-only stage's, or the strategy (greedy, or sampling at T 0)."""
    knob = KNOBS.get(key)
    return key == "strategy" or (knob is not None and knob.stage in SAMPLING_ONLY_STAGES)


def same_text_reason(traces: Sequence[Trace]) -> str:
    """Why lanes that wrote the same tokens did, from their traces: "" when there is nothing to
    explain (one model, one config: the same run again). Greedy picks draw nothing: the same
    most likely token at every step (the same weights, where the models differ; knobs that did not
    change it). Draws: every step cut to one token, or one seed drawing the same u each step."""
    configs = [{k: v for k, v in t.config.items() if k != "seed"} for t in traces]
    knobs = sorted({k for c in configs for k in c if any(c.get(k) != o.get(k) for o in configs)})
    sources = list(dict.fromkeys(lane_source(t) for t in traces))
    greedy = [picks_greedily(t) for t in traces]
    seeds = {t.config.get("seed", 0) for t, g in zip(traces, greedy) if not g}
    if len(sources) == 1 and not knobs and len(seeds) <= 1:
        return ""  # the same model, knobs and seed: the same run again
    steps = min(len(t.steps) for t in traces)
    single = sum(1 for i in range(steps) if all(t.steps[i].stages and t.steps[i].stages[-1].kept == 1 for t in traces))
    differ = f"their knobs differ ({', '.join(knobs)}), but no difference changed the pick at any step; " if knobs else ""
    models = "; ".join(html.escape(s) for s in sources) if len(sources) > 1 else ""
    if all(greedy):
        why = "all pick greedily, so nothing is drawn: each step takes the most likely token"
        if knobs and all(ignored_by_greedy(k) for k in knobs):
            differ = f"their knobs differ only in ones a greedy pick ignores ({', '.join(knobs)}); "
        quantized = len({t.quantization for t in traces}) > 1  # a copy of other weights: a near-tie may flip
        return differ + why + (f", and the models ({models}) put the same token first at every step, as the same "
                               "weights do" + (" (a quantized copy can pick another token at a near-tie)"
                                                if quantized else "") if models else "")
    if single == steps:
        why = "at every step their stages (top-p, top-k, min-p...) cut the choice to one token, so there was nothing to draw"
    elif any(greedy):
        why = (f"the sampled lanes' draws landed on the most likely token at every step, the one the greedy lanes take "
               f"({single} of {steps} steps had only one token left)")
    elif len(seeds) == 1:
        why = (f"they share a seed, so each step drew the same u, and it landed in the same token every time "
               f"({single} of {steps} steps had only one token left); try another seed")
    else:
        return ""  # other seeds, other draws: a coincidence this page cannot explain
    return differ + why + (f"; the models ({models}) gave distributions close enough for that, as the same "
                           "weights do" if models else "")


def same_text_note(names: Sequence[str], traces: Sequence[Trace]) -> str:
    """One sentence per group of lanes that wrote the same text, saying the true reason
    (``same_text_reason``); "" when no lanes did, or when they are the same run again."""
    notes = []
    for group in same_text_groups(traces):
        why = same_text_reason([traces[i] for i in group])
        if why:
            notes.append(f"**{_names([names[i] for i in group])} wrote the same text:** {why}.")
    return "\n\n".join(notes)


def served_modes_note(names: Sequence[str], traces: Sequence[Trace]) -> str:
    """When a step-mode lane and a fast-mode lane on one server, both picking greedily with the
    same knobs (the seed aside), part ways: one line per such pair naming the step, both picks,
    the server's p of each in step mode (its raw top-N) and the likely reason. "" when none do."""
    notes = []
    for i in range(len(traces)):
        for j in range(i + 1, len(traces)):
            at = parting_step(traces[i], traces[j])
            if at is not None:
                step, fast = (i, j) if traces[i].extra["remote"]["mode"] == "step" else (j, i)
                notes.append(_parting_line(names[step], names[fast], traces[step], traces[fast], at))
    return "\n\n".join(notes)


def parting_step(a: Trace, b: Trace) -> int | None:
    """The step where two greedy lanes with the same knobs on one server, one in step mode and
    one in fast mode, part ways while both ran; None when they do not (or are no such pair)."""
    ra, rb = a.extra.get("remote"), b.extra.get("remote")
    if not ra or not rb or ra.get("url") != rb.get("url") or {ra.get("mode"), rb.get("mode")} != {"step", "fast"}:
        return None
    knobs = [{k: v for k, v in t.config.items() if k != "seed"} for t in (a, b)]
    if a.strategy != b.strategy or knobs[0] != knobs[1] or not (picks_greedily(a) and picks_greedily(b)):
        return None
    at = first_divergence([a.generated_token_ids, b.generated_token_ids])
    return at if at is not None and at < min(len(a.steps), len(b.steps)) else None  # not: one ended first


def _parting_line(step_name: str, fast_name: str, step: Trace, fast: Trace, at: int) -> str:
    ours, theirs = step.steps[at], fast.steps[at]
    raw = {t.token_id: t.prob for t in ours.stages[0].top} if ours.stages else {}
    probs = ""
    if ours.chosen_token_id in raw and theirs.chosen_token_id in raw:
        a, b = raw[ours.chosen_token_id], raw[theirs.chosen_token_id]
        probs = (f" (the server's p in step mode: {100 * a:.3g}% vs {100 * b:.3g}%"
                 + (", a near-tie)" if abs(a - b) < 0.05 else ")"))
    return (f"**{html.escape(step_name)} (step mode) and {html.escape(fast_name)} (fast mode) part ways at step {at}** "
            f"although both pick greedily with the same knobs on {html.escape(str(step.model))}: step mode took "
            f"`{readable(ours.chosen_token)}`, fast mode `{readable(theirs.chosen_token)}`{probs}. Likely reason: "
            "llama-server's default (4 slots sharing one KV cache) computes a request's probabilities differently "
            "while other requests run beside it, as this page's lanes do, so greedy's pick can change; a server "
            "started with one slot (`-np 1`, as `make remote` does) gives both modes the same tokens.")


def sweep_markdown(lane: str, seeds: Sequence[int], spread: SweepSpread) -> str:
    """The spread of one lane over several seeds, in words a reader can check against the table."""
    return (f"**{html.escape(lane)} over {spread.runs} seeds** ({seeds[0]}–{seeds[-1]}): "
            f"**{spread.distinct_outputs}** distinct outputs · mean pairwise token overlap (Jaccard) "
            f"{spread.mean_token_overlap:.2f} · mean shared prefix {spread.mean_common_prefix:.1f} tokens · "
            f"mean distinct-2 {spread.mean_distinct_2:.2f}")


def sweep_rows(seeds: Sequence[int], traces: Sequence[Trace], mean_logprobs: Sequence[float]) -> list[list]:
    return [[seed, len(t.steps), _num(lp, 3), t.text] for seed, t, lp in zip(seeds, traces, mean_logprobs)]


# A stage panel whose tallest bar is under this share of the one axis all panels would share gets
# its own scale (T = 5 flattens a 76% token to 0.1%: on a 0-82% axis its panels look empty).
SLIVER = 0.1
SAME = 1e-9  # total variation below which a stage left the distribution as it was
NOT_RECORDED = "p not recorded"


def chosen_prob_at(step: StepTrace, i: int, source: Source = LOCAL) -> float | None:
    """The chosen token's probability after stage ``i`` (0: raw, the last: final) as the trace
    records it: raw_prob where no stage up to i moved any mass, chosen_prob where no stage after i
    did (final is the last stage's distribution); None where only the stage's top-N is stored.
    Fast mode (``source``): the server's sampler sits between raw and final, unrecorded, so raw
    is raw_prob and final chosen_prob (None where unknown: NaN)."""
    stages, last = step.stages, len(step.stages) - 1
    if source.fast:
        prob = step.raw_prob if stages[i].name == "raw" else step.chosen_prob
        return prob if math.isfinite(prob) else None
    if 0 < i < last and stages[i].chosen_prob is not None:  # recorded where the stage's top-N misses it
        return stages[i].chosen_prob
    if i == last or all(s.tv_distance <= SAME and s.mass_removed <= 0 for s in stages[i + 1:last]):
        return step.chosen_prob
    if all(s.tv_distance <= SAME and s.mass_removed <= 0 for s in stages[1:i + 1]):
        return step.raw_prob
    return None


def _panel_peaks(step: StepTrace, source: Source = LOCAL) -> list[float]:
    """The tallest bar of each stage panel (its top-N, removed tokens and the chosen token)."""
    peaks = []
    for i, stage in enumerate(step.stages):
        chosen = chosen_prob_at(step, i, source)
        peaks.append(max([t.prob for t in [*stage.top, *stage.removed]] + ([chosen] if chosen is not None else []),
                         default=0.0))
    return peaks


def one_axis_readable(step: StepTrace, source: Source = LOCAL) -> bool:
    """Whether every stage panel's bars stay readable on one probability axis shared by all."""
    peaks = _panel_peaks(step, source)
    return min(peaks, default=1.0) >= SLIVER * max(peaks, default=1.0)


def legible_stage_chart(step: StepTrace, source: Source = LOCAL, **layout: Any) -> go.Figure:
    """``stage_chart`` of a step (``layout``: its layout arguments, e.g. ``columns``) with every
    panel on one probability axis unless that draws some panel as slivers (then each on its own
    scale), and the chosen token's p written in every stage where the trace records it
    (``chosen_prob_at``) though the stage's top-N misses it: a stage equal to the final
    distribution (a lone temperature, T = 5) or to the raw one. Compare's inspector and the
    Lessons view's chart draw steps with it. ``source``: where the numbers come from (a served
    model, fast mode: ``explain.source_of``)."""
    shared = one_axis_readable(step, source)
    fig = stage_chart(step, shared_axis=shared, source=source, **layout)
    if not shared:  # a 0.1% panel's ticks read "0%, 0%, 0%" in whole percent
        for i, peak in enumerate(_panel_peaks(step, source)):
            digits = max(0, math.ceil(-math.log10(peak)) - 1) if 0 < peak < 1 else 0
            fig.layout[f"xaxis{i + 1 if i else ''}"].tickformat = f".{min(digits, 4)}%"
    for bar in fig.data:
        if bar.type != "bar" or not bar.text or bar.text[-1] != NOT_RECORDED:
            continue
        axis = bar.xaxis[1:]  # "x" is panel 0, "x2" panel 1...
        prob = chosen_prob_at(step, int(axis) - 1 if axis else 0, source)
        if prob is not None:
            bar.x = (*bar.x[:-1], prob)
            bar.text = (*bar.text[:-1], "")
            bar.customdata = (*bar.customdata[:-1], [percent(prob)])
    return fig


PHONE_LAYOUT_PX = 560  # a chart box narrower than this (a phone's 390 px page) shows the phone layout
PHONE_BAR_PX = 24  # px a bar in the phone layout: every token label fits, one per bar


def with_phone_layout(wide: go.Figure, phone: go.Figure) -> go.Figure:
    """``wide`` carrying ``phone``'s layout for a box narrower than PHONE_LAYOUT_PX: the page's
    script (static/page.js, ``fitLayouts``) swaps the one its box's width needs, so a view that
    does not know the page's width (the Lessons tab, Compare's inspector) still lays a chart out
    for a phone. ``layout.meta``: ``layouts`` (both, without their template) and ``shown``."""
    def bare(fig: go.Figure) -> dict:
        layout = fig.to_plotly_json()["layout"]
        layout.pop("template", None)
        layout.pop("meta", None)
        return layout

    layouts = {"below": PHONE_LAYOUT_PX, "phone": bare(phone), "wide": bare(wide)}
    wide.layout.meta = {**(wide.layout.meta or {}), "shown": "wide", "layouts": layouts}
    return wide


def responsive_stage_chart(step: StepTrace, source: Source = LOCAL) -> go.Figure:
    """``legible_stage_chart`` of a step, three panels a row, with a phone layout (one panel a row,
    PHONE_BAR_PX a bar, every bar labelled, titles on full-width lines): Compare's inspector and
    the Lessons tab draw steps with it."""
    bars = max(panel_rows(step), default=1)
    phone = legible_stage_chart(step, source, columns=1, gap_px=PHONE_GAP_PX, panel_px=max(160, bars * PHONE_BAR_PX))
    phone.update_yaxes(tickmode="linear", dtick=1)  # plotly would label every other bar of a crowded panel
    phone.update_layout(margin=dict(l=4, r=12, t=110, b=70))
    wide = legible_stage_chart(step, source)
    for fig in (wide, phone):  # turned 90°, "0.05%" reaches into the next panel's title; plotly keeps the
        fig.update_xaxes(tickangle=0)  # angle it chose for one layout in the other, so neither may turn
    return with_phone_layout(wide, phone)


inspect_chart = responsive_stage_chart  # the stage chart of one lane's step in Compare's inspector


DIVERGE_MARK = "⟶ lanes differ from here:"


def lane_highlights(steps: Sequence[StepTrace], divergence: int | None = None) -> list[tuple[str, float | None]]:
    """Tokens coloured by probability (as in the step-through view), with DIVERGE_MARK (words, no
    colour) before the first step where the lanes diverge."""
    items: list[tuple[str, float | None]] = list(token_highlights(steps))
    if divergence is not None and divergence <= len(items):
        items.insert(divergence, (DIVERGE_MARK, None))
    return items


def clicked_step(index: int, divergence: int | None = None) -> int:
    """The step of a clicked highlight (undoing the mark inserted by ``lane_highlights``)."""
    if divergence is not None and index >= divergence:
        return max(divergence, index - 1)
    return index


def record_markdown(record: SearchStep | ContrastStep) -> str:
    """A contrastive-search or contrastive-decoding step record as a small table (chosen token ←)."""
    if isinstance(record, SearchStep):
        head = (f"Contrastive search, α = {record.alpha:g}: score = (1 − α)·p − α·(max cosine similarity "
                f"with the context)\n\n| token | p | degeneration penalty | score |\n|---|---|---|---|")
        rows = [f"| {_cell(c.token)}{_mark(c, record)} | {c.prob:.4f} | {c.penalty:.4f} | "
                f"{'masked' if c.score is None else f'{c.score:.4f}'} |" for c in record.candidates]
    else:
        head = (f"Contrastive decoding, α = {record.alpha:g}: {record.plausible} plausible tokens "
                f"(p_expert ≥ {record.threshold_prob:.4f}); score = log p_expert − log p_amateur\n\n"
                f"| token | log p expert | log p amateur | score |\n|---|---|---|---|")
        rows = [f"| {_cell(c.token)}{_mark(c, record)} | {c.expert_logprob:.3f} | {c.amateur_logprob:.3f} | "
                f"{'implausible' if c.score is None else f'{c.score:.3f}'} |" for c in record.candidates]
    return "\n".join([head, *rows])


def _mark(candidate: Any, record: Any) -> str:
    return " ←" if candidate.token_id == record.chosen_token_id else ""


def _cell(token: str) -> str:
    """A token as inline code in a Markdown table cell (pipes and backticks would break it)."""
    return "`" + readable(token).replace("`", "ˋ").replace("|", "¦") + "`"
