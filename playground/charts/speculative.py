"""Speculative decoding charts: pure functions of SpecRounds -> HTML strings and plotly figures.

A *position* is (round index, position in the round): position i < K is the i-th drafted token's
acceptance test; position K (only when every draft passed) is the bonus token. No gradio here.
"""

from __future__ import annotations

import html
import math
import textwrap
from typing import Sequence

import plotly.graph_objects as go

from engine.strategies.speculative import DraftToken, ExtraToken, SpecRound
from engine.numbers import decimal, percent
from engine.trace import TokenProb

from . import glossary
from .step import tick_format
from .tokens import is_special, render_html
from .tokens import render as readable

# kind -> (text colour, background, label)
KINDS = {
    "accepted": ("#1b5e20", "#dff2e1", "accepted draft"),
    "rejected": ("#b71c1c", "#fde4e4", "rejected draft"),
    "resampled": ("#b34700", "#fff0dc", "resampled by the target"),
    "bonus": ("#0d47a1", "#e1edfc", "bonus token from the target"),
}
P_COLOUR = "#4c78a8"  # target
Q_COLOUR = "#b86e00"  # drafter (4:1 on white: a graphic, never text)
HIGHLIGHT = "#c4421a"
FONT = 14
STOP_NOTES = {"eos": "end of sequence", "stop_string": "stop string", "max_new_tokens": "max_new_tokens"}


# --- chips -------------------------------------------------------------------------------------
def _chip(kind: str, token: str, round_index: int, pos: int, title: str, selected: bool, emitted: bool = True) -> str:
    colour, background, _ = KINDS[kind]
    style = (f"display:inline-block;margin:2px;padding:1px 6px;border-radius:6px;cursor:pointer;"
             f"font-family:ui-monospace,monospace;font-size:{FONT}px;color:{colour};background:{background};"
             f"border:1px solid {colour}55;")
    if kind == "rejected":
        style += "text-decoration:line-through;"
    if not emitted:
        style += "opacity:0.45;"
    if selected:
        style += f"outline:2px solid {HIGHLIGHT};outline-offset:1px;"
    return (f'<span class="spec-chip spec-{kind}" role="button" tabindex="0" data-chip="1" data-round="{round_index}" '
            f'data-pos="{pos}" data-kind="{kind}" title="{html.escape(title)}" style="{style}">'
            f"{render_html(token)}</span>")


def extra_origin(x: ExtraToken) -> str:
    """Where the target's own token came from: in greedy mode (no draw) the target's argmax, else a
    draw from the residual normalise(max(0, p − q)) after a rejection, or from p for the bonus."""
    if x.draw is None:  # nothing was drawn: "resampled" would misname a greedy round's own token
        why = "the draft differed from it" if x.kind == "resampled" else "every draft was accepted"
        return f"the target's own token {readable(x.token)}: its argmax of p ({why})"
    what = "residual normalise(max(0, p − q))" if x.kind == "resampled" else "target distribution p"
    return f"{x.kind} {readable(x.token)} from the {what}"


def _draft_title(d: DraftToken) -> str:
    if d.u is None:
        verdict = "matches the target's argmax" if d.accepted else "differs from the target's argmax"
        return f"draft {readable(d.token)}: p={decimal(d.p)}, q={decimal(d.q)}; {verdict}"
    return f"draft {readable(d.token)}: p={decimal(d.p)}, q={decimal(d.q)}, accept with {decimal(d.accept_prob)}, u={decimal(d.u)}"


def round_label(r: SpecRound) -> str:
    """"#3 · K=4 · 2/3 accepted · +3 tokens"; a round that ended the run says why, and counts
    only the drafts up to the stop (a draft after it was never going to be used)."""
    n = len(r.drafted)
    added = len(r.emitted_token_ids)
    tokens = f"+{added} token" + ("" if added == 1 else "s")
    if r.finish_reason is None:
        return f"#{r.index} · K={r.k} · {r.num_accepted}/{n} accepted · {tokens}"
    used = min(n, added)
    accepted = sum(d.accepted for d in r.drafted[:used])
    return f"#{r.index} · K={r.k} · {accepted}/{used} accepted · {tokens} · stopped: {STOP_NOTES.get(r.finish_reason, r.finish_reason)}"


def round_chips(r: SpecRound, selected: tuple[int, int] | None = None) -> str:
    """One round: each drafted token as a chip (accepted / rejected), then the target's own token
    (resampled at the rejected position, or the bonus). Tokens cut by a stop are faded."""
    chips = []
    emitted = len(r.emitted_token_ids)
    for d in r.drafted:
        chips.append(_chip("accepted" if d.accepted else "rejected", d.token, r.index, d.position, _draft_title(d),
                           selected == (r.index, d.position), emitted=d.accepted and d.position < emitted))
        if d.resampled is not None:
            x = d.resampled
            chips.append(_chip("resampled", x.token, r.index, d.position, f"{extra_origin(x)} (p={decimal(x.p)})",
                               selected == (r.index, d.position), emitted=d.position < emitted))
    if r.bonus is not None:
        pos = len(r.drafted)
        chips.append(_chip("bonus", r.bonus.token, r.index, pos, f"{extra_origin(r.bonus)} (p={decimal(r.bonus.p)})",
                           selected == (r.index, pos), emitted=pos < emitted))
    timing = f"draft {r.draft_ms:.0f} ms · verify {r.verify_ms:.0f} ms · capture {r.capture_ms:.0f} ms"
    return (f'<div class="spec-round" data-round="{r.index}" style="margin:3px 0;line-height:1.9">'
            f'<span style="display:inline-block;min-width:15em;color:#555;font-size:{FONT}px" title="{timing}">'
            f"{html.escape(round_label(r))}</span>{''.join(chips)}</div>")


def legend_html() -> str:
    items = []
    for kind, (colour, background, label) in KINDS.items():
        items.append(f'<span style="margin-right:12px;font-size:{FONT}px"><span style="display:inline-block;width:10px;'
                     f'height:10px;border-radius:3px;background:{background};border:1px solid {colour}"></span> {label}</span>')
    items.append(f'<span style="font-size:{FONT}px;color:#333">⟪name⟫ = special token (chat template), not text</span>')
    return f'<div class="spec-legend">{"".join(items)}</div>'


def special_drafts_note(rounds: Sequence[SpecRound], drafter: str = "") -> str:
    """One line naming the rounds whose drafts hold special tokens (⟪im_start⟫...) and why they
    appear; "" when none do. The n-gram drafter builds its table from the prompt's token ids, and
    with the chat template on those include the template's control tokens, so it copies them too."""
    hits = [r.index for r in rounds if any(is_special(d.token) for d in r.drafted)]
    if not hits:
        return ""
    names = sorted({readable(d.token) for r in rounds for d in r.drafted if is_special(d.token)})
    where = ", ".join(f"#{i}" for i in hits[:6]) + (f" and {len(hits) - 6} more" if len(hits) > 6 else "")
    why = ("the n-gram drafter copies what followed the same tokens in the prompt, and the prompt's tokens include "
           "the chat template's control tokens" if drafter == "ngram" else
           "the drafter copies the chat template's control tokens it saw in the prompt")
    return (f"Round{'s' if len(hits) > 1 else ''} {where} drafted special tokens ({', '.join(names[:3])}): {why}. "
            + special_verdicts(rounds))


def special_verdicts(rounds: Sequence[SpecRound]) -> str:
    """What the target did with the drafted special tokens, as their chips show it: "The target
    rejected ⟪im_start⟫ (#0) and accepted ⟪im_end⟫ (#8: the end of the answer)"."""
    verdicts: dict[bool, list[str]] = {True: [], False: []}
    for r in rounds:
        for d in r.drafted:
            if is_special(d.token):
                end = " ends the answer" if d.accepted and r.finish_reason == "eos" and d is r.drafted[-1] else ""
                verdicts[d.accepted].append(f"{readable(d.token)} (#{r.index}{end})")
    parts = [f"{word} {', '.join(items[:4])}" + (f" and {len(items) - 4} more" if len(items) > 4 else "")
             for word, items in (("rejected", verdicts[False]), ("accepted", verdicts[True])) if items]
    return f"The target {' and '.join(parts)}."


def rounds_html(rounds: Sequence[SpecRound], selected: tuple[int, int] | None = None, limit: int = 200,
                drafter: str = "") -> str:
    """All rounds as rows of chips (the last ``limit`` rounds), with a legend and, when drafts hold
    special tokens, a one-line note on why. Chips carry data-round / data-pos so a click can
    select the position."""
    if not rounds:
        return '<div class="spec-rounds" style="color:#555">No rounds yet: press Generate.</div>'
    shown = list(rounds)[-limit:]
    hidden = len(rounds) - len(shown)
    note = f'<div style="color:#555;font-size:{FONT}px">{hidden} earlier rounds not shown</div>' if hidden else ""
    special = special_drafts_note(rounds, drafter)
    if special:
        note += f'<div class="spec-special-note" style="color:#333;font-size:{FONT}px">ℹ {html.escape(special)}</div>'
    rows = "".join(round_chips(r, selected) for r in shown)
    return f'<div class="spec-rounds">{legend_html()}{note}{rows}</div>'


def emitted_tokens(r: SpecRound) -> list[tuple[str, str]]:
    """(token text, kind) of the tokens the round added, in order (cut where a stop cut them).
    The end-of-sequence token that ended a run is left out: the text stops before it, as the
    other strategies' text does."""
    out = [(d.token, "accepted") for d in r.drafted if d.accepted][: r.num_accepted]
    extra = r.extra
    if extra is not None:
        out.append((extra.token, extra.kind))
    out = out[: len(r.emitted_token_ids)]
    return out[:-1] if r.finish_reason == "eos" and out else out


def text_html(rounds: Sequence[SpecRound]) -> str:
    """The generated text as it flowed: tokens the draft got right on green, the target's own
    tokens (resampled or bonus) on orange or blue."""
    spans = []
    for r in rounds:
        for token, kind in emitted_tokens(r):
            colour, background, label = KINDS[kind]
            text = render_html(token, flow=True)
            spans.append(f'<span class="spec-tok spec-tok-{kind}" title="round {r.index}: {label}" '
                         f'style="background:{background};border-bottom:2px solid {colour}">{text}</span>')
    body = "".join(spans) or '<span style="color:#555">The text appears here as rounds are accepted.</span>'
    return f'<div class="spec-text" style="white-space:pre-wrap;line-height:1.7;font-size:16px">{body}</div>'


# --- positions ---------------------------------------------------------------------------------
def position_choices(rounds: Sequence[SpecRound]) -> list[tuple[str, str]]:
    """(label, "round:pos") for every clickable position, for a dropdown."""
    out = []
    for r in rounds:
        for d in r.drafted:
            verdict = "✓" if d.accepted else f"✗ → {readable(d.resampled.token)}" if d.resampled else "✗"
            out.append((f"round {r.index} · pos {d.position}: {readable(d.token)} {verdict}", f"{r.index}:{d.position}"))
        if r.bonus is not None:
            out.append((f"round {r.index} · pos {len(r.drafted)}: bonus {readable(r.bonus.token)}", f"{r.index}:{len(r.drafted)}"))
    return out


def parse_position(value: str | None) -> tuple[int, int] | None:
    """"3:1" -> (3, 1); None for anything else."""
    if not value or ":" not in str(value):
        return None
    left, _, right = str(value).partition(":")
    if not (left.isdigit() and right.isdigit()):
        return None
    return int(left), int(right)


def find_round(rounds: Sequence[SpecRound], index: int) -> SpecRound | None:
    return next((r for r in rounds if r.index == index), None)


def acceptance_text(r: SpecRound, pos: int) -> str:
    """The acceptance test at a position, written out (markdown)."""
    if pos == len(r.drafted) and r.bonus is not None:
        b = r.bonus
        how = "the target's argmax" if b.draw is None else "sampled from the target's distribution p"
        why = (f"All {len(r.drafted)} drafts were accepted, so the target's next distribution comes free"
               if r.drafted else "The drafter proposed nothing this round, so the target decoded one token itself")
        return f"**Round {r.index}, bonus.** {why}: **{readable(b.token)}** was {how} (p = {decimal(b.p)})."
    if not 0 <= pos < len(r.drafted):
        return f"Round {r.index} has no position {pos}."
    d = r.drafted[pos]
    head = f"**Round {r.index}, position {pos}: draft {readable(d.token)}.** " + special_note(d.token)
    if d.u is None:
        best = readable(d.resampled.token) if d.resampled else readable(d.token)
        verdict = "accepted" if d.accepted else f"rejected; the target's argmax **{best}** is taken instead"
        return head + f"p = {decimal(d.p)}, q = {decimal(d.q)}. Greedy: accept while the draft equals the target's argmax ({best}) → {verdict}."
    line = (f"p={decimal(d.p, 2)}, q={decimal(d.q, 2)} → accept with {decimal(d.accept_prob, 2)}; u={decimal(d.u, 2)} → "
            f"{'accepted' if d.accepted else 'rejected'}")
    text = head + f"`{line}` (accept with probability min(1, p/q))."
    if d.resampled is not None:
        x = d.resampled
        text += (f" The target then resampled **{readable(x.token)}** from the residual normalise(max(0, p − q)), "
                 f"where it has probability {decimal(x.prob)} (p = {decimal(x.p)}).")
    return text


def special_note(token: str) -> str:
    """Why a special token (⟪im_start⟫...) is drafted at all: the n-gram drafter copies tokens
    from the prompt, and a chat prompt holds the template's control tokens."""
    if not is_special(token):
        return ""
    return (f"({readable(token)} is a special token: the n-gram drafter copies whatever followed the same tokens "
            "earlier, and with the chat template on the prompt holds such control tokens. Drafts stop at the "
            "end-of-sequence token.) ")


def _nonzero(top: Sequence[TokenProb]) -> list[TokenProb]:
    """Tokens with probability > 0 (older traces padded a point mass's top-N with zeros)."""
    return [t for t in top if t.prob > 0]


def _gloss(term: str) -> str:
    return html.escape(glossary.hover(term))


def _bar_labels(ids: Sequence[int], texts: dict[int, str]) -> list[str]:
    labels, seen = [], set()
    for i in ids:
        label = readable(texts[i])
        if label in seen:
            label = f"{label} #{i}"
        seen.add(label)
        labels.append(label)
    return labels


def pq_figure(r: SpecRound, pos: int) -> go.Figure:
    """p (target) vs q (drafter) for the position's top tokens; the drafted (or bonus) token's
    bars are outlined. Tokens outside a distribution's stored top-N have no bar for it."""
    fig = go.Figure()
    if pos < len(r.drafted):
        d = r.drafted[pos]
        p_top, q_top, mark = d.p_top, d.q_top, d.token_id
        title = f"round {r.index} · pos {pos}: draft {readable(d.token)} (p={decimal(d.p)}, q={decimal(d.q)})"
    elif r.bonus is not None:
        p_top, q_top, mark = r.bonus.top, [], r.bonus.token_id
        title = f"round {r.index} · bonus from p: {readable(r.bonus.token)}"
    else:
        return fig
    p_top, q_top = _nonzero(p_top), _nonzero(q_top)  # a point mass q has one token, not N
    texts = {t.token_id: t.token for t in [*p_top, *q_top]}
    ids = list(dict.fromkeys([t.token_id for t in p_top] + [t.token_id for t in q_top]))
    labels = _bar_labels(ids, texts)
    p_map = {t.token_id: t.prob for t in p_top}
    q_map = {t.token_id: t.prob for t in q_top}
    outline = dict(color=[HIGHLIGHT if i == mark else "rgba(0,0,0,0)" for i in ids], width=2.5)
    fig.add_trace(go.Bar(y=labels, x=[p_map.get(i) for i in ids], orientation="h", name="p (target)", marker_color=P_COLOUR,
                         marker_line=outline, hovertemplate="%{y}: p = %{x:.4f}<br>" + _gloss("p") + "<extra>target</extra>"))
    if q_top:
        fig.add_trace(go.Bar(y=labels, x=[q_map.get(i) for i in ids], orientation="h", name="q (drafter)", marker_color=Q_COLOUR,
                             marker_line=outline, hovertemplate="%{y}: q = %{x:.4f}<br>" + _gloss("q") + "<br>"
                             + _gloss("accept") + "<extra>drafter</extra>"))
    return _bars_layout(fig, title, len(ids))


def residual_figure(r: SpecRound, pos: int) -> go.Figure | None:
    """The distribution the round's last token came from: the residual after a rejection (with
    the resampled token highlighted), or p for the bonus. None for an accepted draft."""
    extra: ExtraToken | None = None
    if pos < len(r.drafted):
        extra = r.drafted[pos].resampled
    elif pos == len(r.drafted):
        extra = r.bonus
    if extra is None:
        return None
    top = _nonzero(extra.top)
    ids = [t.token_id for t in top]
    labels = _bar_labels(ids, {t.token_id: t.token for t in top})
    colours = [HIGHLIGHT if i == extra.token_id else P_COLOUR for i in ids]
    term = "residual" if extra.kind == "resampled" and extra.draw is not None else "p"
    fig = go.Figure(go.Bar(y=labels, x=[t.prob for t in top], orientation="h", marker_color=colours, showlegend=False,
                           hovertemplate="%{y}: %{x:.4f}<br>" + _gloss(term) + "<extra></extra>"))
    return _bars_layout(fig, extra_origin(extra), len(ids))


def _bars_layout(fig: go.Figure, title: str, n: int) -> go.Figure:
    """Shared look: 14 px text, the title wrapped onto short lines, the legend below the bars."""
    fig.update_yaxes(autorange="reversed", automargin=True, tickfont=dict(size=FONT))
    top = max((x for bar in fig.data for x in (bar.x or []) if isinstance(x, (int, float))), default=1.0)
    fig.update_xaxes(rangemode="tozero", tickformat=tick_format(top), tickfont=dict(size=FONT))  # 0.2%: not "0%, 0%"
    wrapped = "<br>".join(textwrap.wrap(title, 44, break_long_words=False))  # fits 390 px at 16 px
    lines = wrapped.count("<br>") + 1
    fig.update_layout(title=dict(text=wrapped, x=0.01, font=dict(size=FONT + 2)), barmode="group", template="plotly_white",
                      font=dict(size=FONT), height=max(260, 110 + 22 * lines + 30 * n),
                      margin=dict(l=10, r=10, t=30 + 22 * lines, b=40),
                      legend=dict(orientation="h", x=0, y=-0.12, yanchor="top"))
    return fig


# --- run-level ---------------------------------------------------------------------------------
def accepted_length_figure(rounds: Sequence[SpecRound]) -> go.Figure:
    """Per round: accepted drafts (stacked with the target's own token) against K."""
    xs = [r.index for r in rounds]
    fig = go.Figure()
    fig.add_trace(go.Bar(x=xs, y=[r.num_accepted for r in rounds], name="accepted drafts", marker_color=KINDS["accepted"][0],
                         hovertemplate="round %{x}: %{y} accepted<extra></extra>"))
    for kind in ("resampled", "bonus"):  # one trace (and legend entry) per colour drawn
        colour, _, label = KINDS[kind]
        fig.add_trace(go.Bar(x=xs, y=[1 if r.extra is not None and (r.bonus is not None) == (kind == "bonus") else 0
                                      for r in rounds], name=label, marker_color=colour,
                             hovertemplate="round %{x}: +1 from the target (" + kind + ")<extra></extra>"))
    fig.add_trace(go.Scatter(x=xs, y=[len(r.drafted) for r in rounds], mode="markers", name="drafted",
                             marker=dict(symbol="line-ew-open", size=14, color="#333", line=dict(width=2)),
                             hovertemplate="round %{x}: %{y} drafted<extra></extra>"))
    fig.update_layout(barmode="stack", template="plotly_white", height=320, margin=dict(l=10, r=10, t=20, b=10),
                      xaxis_title="round", yaxis_title="tokens", font=dict(size=FONT),
                      legend=dict(orientation="h", x=0, xanchor="left", y=-0.3, yanchor="top"))
    return fig


def counters(rounds: Sequence[SpecRound], summary: dict | None = None) -> dict[str, float]:
    """Live counters from the rounds so far; the speed-up comes from a finished run's summary
    (``speedup``: target-only time / speculative time, per token, same process)."""
    drafted = sum(len(r.drafted) for r in rounds)
    accepted = sum(r.num_accepted for r in rounds)
    tokens = sum(len(r.emitted_token_ids) for r in rounds)
    speedup = (summary or {}).get("speedup")
    return {
        "rounds": len(rounds),
        "tokens": tokens,
        "acceptance_rate": accepted / drafted if drafted else math.nan,
        "tokens_per_target_forward": tokens / len(rounds) if rounds else math.nan,
        "speedup": float(speedup) if speedup is not None else math.nan,
    }


def counters_html(rounds: Sequence[SpecRound], summary: dict | None = None) -> str:
    c = counters(rounds, summary)

    def box(label: str, value: str, elem: str) -> str:
        return (f'<div class="spec-counter" id="{elem}" style="display:inline-block;min-width:9em;margin:4px 10px 4px 0;'
                f'padding:6px 10px;border:1px solid #ddd;border-radius:8px"><div style="font-size:{FONT}px;color:#555">{label}</div>'
                f'<div style="font-size:20px;font-weight:600">{value}</div></div>')

    rate = "—" if math.isnan(c["acceptance_rate"]) else percent(c["acceptance_rate"])
    per = "—" if math.isnan(c["tokens_per_target_forward"]) else f"{c['tokens_per_target_forward']:.2f}"
    speed = "—" if math.isnan(c["speedup"]) else f"{c['speedup']:.2f}×"
    return ('<div class="spec-counters">'
            + box("acceptance rate", rate, "spec-acceptance")
            + box("tokens / target forward", per, "spec-per-forward")
            + box("speed-up (tokens/s) vs target-only", speed, "spec-speedup")
            + box("rounds · tokens", f"{c['rounds']} · {c['tokens']}", "spec-rounds-count")
            + "</div>")


def summary_markdown(summary: dict) -> str:
    """The finished run's summary in one paragraph."""
    if not summary:
        return ""
    text = (f"**{summary.get('tokens', 0)} tokens** in {summary.get('rounds', 0)} rounds with drafter "
            f"`{summary.get('drafter', '?')}` · accepted {summary.get('accepted', 0)}/{summary.get('drafted', 0)} drafts "
            f"({percent(summary.get('acceptance_rate', 0.0))}) · {summary.get('tokens_per_target_forward', 0.0):.2f} tokens per "
            f"target forward · {summary.get('target_forwards_saved', 0)} target forwards saved · {time_breakdown(summary)}")
    if "speedup" in summary:
        text += " · " + speed_comparison(summary)
    return text


def _rate(tokens: float, ms: float) -> str:
    return f"{tokens / (ms / 1000):.1f} tok/s" if ms > 0 else "— tok/s"


def speed_comparison(summary: dict) -> str:
    """Like with like: both runs' time, token count and tokens per second, then the ratio of the
    rates (``speedup`` is per token, so runs that stop at different lengths compare fairly).
    An older summary without ``baseline_tokens`` says what the ratio is instead."""
    spec_ms, spec_n = summary.get("total_ms", 0.0), summary.get("tokens", 0)
    base_ms, base_n = summary.get("baseline_ms", 0.0), summary.get("baseline_tokens")
    speedup = summary.get("speedup")
    ok = isinstance(speedup, (int, float)) and math.isfinite(speedup)
    ratio = f"**{speedup:.2f}× tokens/s**" if ok else "no ratio (a run took no time)"
    if base_n is None:
        return f"speculative {spec_ms:,.0f} ms vs target-only {base_ms:,.0f} ms: {ratio} (per token)"
    same = " (the same tokens)" if summary.get("baseline_same_tokens") else ""
    return (f"speculative {spec_ms:,.0f} ms for {spec_n:,} tokens ({_rate(spec_n, spec_ms)}) vs target-only "
            f"{base_ms:,.0f} ms for {base_n:,} tokens{same} ({_rate(base_n, base_ms)}): {ratio}")


BREAKDOWN = (("prefill_ms", "prefill"), ("draft_ms", "draft"), ("verify_ms", "verify (target forwards)"),
             ("capture_ms", "acceptance tests + trace capture"), ("other_ms", "other"))


def time_breakdown(summary: dict) -> str:
    """"time: prefill 80 + draft 2 + verify 900 + ... = total 1,100 ms", the parts adding up to
    the total (older summaries without the parts show draft, verify and the rest as other)."""
    total = summary.get("total_ms", 0.0)
    parts = {key: summary.get(key, 0.0) for key, _ in BREAKDOWN}
    if "other_ms" not in summary:
        parts["other_ms"] = max(0.0, total - sum(v for k, v in parts.items() if k != "other_ms"))
    terms = " + ".join(f"{label} {parts[key]:,.0f}" for key, label in BREAKDOWN if parts[key] >= 0.5 or key == "verify_ms")
    return f"time: {terms} = total {total:,.0f} ms"
