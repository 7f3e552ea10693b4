"""Serving charts: pure functions of engine.reports.serving / serving_demos / vllm_metrics records ->
HTML and plotly figures. Every figure's title says where its numbers come from and when; every
sentence is built from the same numbers as the chart beside it. No gradio here.

- ``cards_html``: the room's big numbers (rows, queue, tokens/s, TTFT, TPOT, KV bytes, waste, the fullest
  tick's KV positions three ways).
- ``rows_figure``, ``kv_figure``, ``latency_figure``, ``runs_figure``: the window's ticks and runs.
- ``layout_figure``: one tick's KV positions three ways (padded batch, paged blocks, reservation).
- ``batching_html`` / ``batching_figure``, ``paged_html``, ``prefix_html`` / ``prefix_figure``,
  ``chunked_html`` / ``chunked_figure``: the four demonstrations.
- ``vllm_cards_html`` / ``vllm_figure``: a served vLLM's window from its /metrics.
"""

from __future__ import annotations

import html
from typing import Any, Sequence

import numpy as np
import plotly.graph_objects as go

from engine.numbers import percent
from engine.reports.serving_demos import batching_verdict
from engine.reports.serving import SOURCE_COMPUTED, SOURCE_SCHEDULER, KVLayout, ServingSummary, utc
from engine.reports.vllm_metrics import SOURCE_VLLM, VllmSample, VllmWindow

FONT = {"size": 16}  # readable from the back of a room at 1280x720
LAYOUT = {"height": 360, "margin": {"l": 64, "r": 20, "t": 64, "b": 48}, "font": FONT,
          "legend": {"orientation": "h", "y": -0.22}}
CLOCK_AXIS = {"tickformat": "%H:%M:%S"}  # the window is minutes long: the date under each tick only crowds it
MAX_POINTS = 600  # a window's ticks are thinned to this many points per line (each bucket's largest kept)
MIB = 1 << 20
COLOURS = {"used": "#54a24b", "padded": "#4c78a8", "paged": "#f58518", "reserved": "#e45756", "queue": "#b279a2"}


def when(since: float, until: float) -> str:
    """The window in words: ``11:02:03–11:07:03 UTC``."""
    return f"{utc(since).removesuffix(' UTC')}–{utc(until)}"


def ms(value: float | None) -> str:
    return "–" if value is None else f"{value:,.0f} ms"


def title(text: str, source: str, at: str) -> dict:
    """A figure title of two lines: what it shows, then its source and time (smaller)."""
    return {"text": f"{html.escape(text)}<br><span style='font-size:12px'>{html.escape(source)} · {html.escape(at)}</span>",
            "x": 0, "xanchor": "left"}


def clock(values: Sequence[float]) -> np.ndarray:
    """Wall-clock times (time.time()) as UTC datetimes plotly draws on a time axis. A numpy array:
    plotly validates it as one array, where a list of 600 strings costs it half a second of CPU
    per figure (measured), which a page watching live would spend every 2 s."""
    return (np.asarray(values, dtype=float) * 1000).astype("datetime64[ms]")


def thin(xs: np.ndarray, ys: Sequence[float], limit: int = MAX_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """At most ``limit`` points: consecutive buckets, each drawn at its largest value (peaks stay)."""
    values = np.asarray(ys, dtype=float)
    if len(xs) <= limit:
        return xs, values
    size = -(-len(xs) // limit)
    keep = [i + int(np.argmax(values[i:i + size])) for i in range(0, len(xs), size)]
    return xs[keep], values[keep]


def card(value: str, label: str, source: str, key: str) -> str:
    return (f'<div class="dp-serving-card" data-key="{key}"><div class="dp-serving-value">{html.escape(value)}</div>'
            f'<div class="dp-serving-label">{html.escape(label)}</div>'
            f'<div class="dp-serving-source">{html.escape(source)}</div></div>')


# --- the room: our scheduler ---------------------------------------------------------------------------
def source_line(s: ServingSummary, model: str) -> str:
    return (f'<div class="dp-status" id="serving-window">Our scheduler on {html.escape(model)} · window '
            f'{when(s.since, s.taken_at)} · {s.ticks:,} ticks, {s.runs:,} runs ended</div>')


def cards_html(s: ServingSummary) -> str:
    """The window's big numbers, each with its source."""
    peak = s.peak
    waste = f"{percent(peak.waste(peak.padded))} → {percent(peak.waste(peak.paged))}" if peak else "–"
    cards = [
        card(f"{s.mean_rows:.1f} / {s.max_rows}", "rows per tick: mean / max", SOURCE_SCHEDULER, "rows"),
        card(f"{s.max_queued}", "most runs waiting for a row", SOURCE_SCHEDULER, "queue"),
        card(f"{s.tokens_per_s:,.1f}", "decode tokens/s while busy (all rows)", SOURCE_SCHEDULER, "tokens_per_s"),
        card(f"{ms(s.ttft_ms['p50'])} / {ms(s.ttft_ms['p95'])}", f"time to first token p50 / p95 ({s.ttft_ms['count']} runs)",
             SOURCE_SCHEDULER, "ttft"),
        card(f"{ms(s.tpot_ms['p50'])} / {ms(s.tpot_ms['p95'])}", f"time per output token p50 / p95 ({s.tpot_ms['count']} runs)",
             SOURCE_SCHEDULER, "tpot"),
        card(f"{s.kv_bytes_now / MIB:,.1f} MiB", "KV cache of the batch, last tick", SOURCE_COMPUTED, "kv"),
        card(waste, f"KV positions holding no token: padded batch → paged, block {peak.block if peak else 16}",
             SOURCE_COMPUTED, "waste"),
        card(f"{peak.padded:,} / {peak.paged:,} / {peak.reserved:,}" if peak else "–",
             "KV positions at the fullest tick: padded batch / paged / contiguous reservation"
             + (f" ({peak.used:,} hold a token)" if peak else ""), SOURCE_COMPUTED, "peak"),
    ]
    return f'<div class="dp-serving-cards" id="serving-cards-grid">{"".join(cards)}</div>'


def rows_figure(s: ServingSummary) -> go.Figure:
    """Rows in each tick's forward and runs waiting, over the window: continuous batching at work."""
    fig = go.Figure()
    times = clock(s.series.get("at", []))
    for key, name, colour in (("rows", "rows in the forward", COLOURS["padded"]), ("queued", "waiting for a row", COLOURS["queue"]),
                              ("prefilling", "long prompts being prefilled", COLOURS["paged"])):
        x, y = thin(times, s.series.get(key, []))
        fig.add_trace(go.Scatter(x=x, y=y, mode="lines", line={"shape": "hv", "color": colour}, name=name))
    fig.update_layout(**LAYOUT, title=title("Rows per tick: runs join and leave between forwards", SOURCE_SCHEDULER,
                                            when(s.since, s.taken_at)), yaxis_title="runs", xaxis=CLOCK_AXIS)
    return fig


def kv_figure(s: ServingSummary) -> go.Figure:
    """KV bytes of the left-padded batch at each tick, what paged blocks would hold, and what a
    contiguous reservation of each run's prompt + max_new_tokens would hold."""
    fig = go.Figure()
    times = clock(s.series.get("at", []))
    for key, name, colour in (("kv_bytes", "our left-padded batch", COLOURS["padded"]),
                              ("paged_bytes", "paged, 16-position blocks (computed)", COLOURS["paged"]),
                              ("reserved_bytes", "contiguous reservation (computed)", COLOURS["reserved"])):
        x, y = thin(times, [v / MIB for v in s.series.get(key, [])])
        fig.add_trace(go.Scatter(x=x, y=y, mode="lines", line={"shape": "hv", "color": colour}, name=name))
    fig.update_layout(**LAYOUT, title=title("KV cache in use (MiB)", SOURCE_COMPUTED, when(s.since, s.taken_at)),
                      yaxis_title="MiB", xaxis=CLOCK_AXIS)
    return fig


def latency_figure(s: ServingSummary) -> go.Figure:
    """Median and p95 time of a tick (and of its forward alone) by rows: a small model's forward
    costs little more for 16 rows than for one."""
    rows = sorted(s.tick_ms_by_rows)
    fig = go.Figure()
    fig.add_trace(go.Bar(x=rows, y=[s.forward_ms_by_rows[n]["p50"] for n in rows], name="forward p50",
                         marker_color=COLOURS["padded"]))
    fig.add_trace(go.Bar(x=rows, y=[s.tick_ms_by_rows[n]["p50"] for n in rows], name="whole tick p50",
                         marker_color=COLOURS["paged"]))
    fig.add_trace(go.Scatter(x=rows, y=[s.tick_ms_by_rows[n]["p95"] for n in rows], mode="markers", name="whole tick p95",
                             marker={"color": COLOURS["reserved"], "size": 10}))
    fig.update_layout(**LAYOUT, barmode="group", title=title("Tick latency vs batch size", SOURCE_SCHEDULER,
                                                             when(s.since, s.taken_at)),
                      xaxis={"title": "rows in the tick", "type": "category"}, yaxis_title="ms")
    return fig


def runs_figure(s: ServingSummary) -> go.Figure:
    """Each ended run's time to first token and time per output token, when it ended."""
    fig = go.Figure()
    times = clock(s.series.get("run_at", []))
    fig.add_trace(go.Scatter(x=times, y=np.asarray(s.series.get("ttft_ms", []), dtype=float), mode="markers",
                             name="time to first token", marker={"color": COLOURS["reserved"], "size": 9}))
    timed = [i for i, v in enumerate(s.series.get("tpot_ms", [])) if v is not None]  # one-token runs have no TPOT
    fig.add_trace(go.Scatter(x=times[timed], y=np.asarray([s.series["tpot_ms"][i] for i in timed], dtype=float),
                             mode="markers", name="time per output token",
                             marker={"color": COLOURS["padded"], "size": 9, "symbol": "diamond"}))
    fig.update_layout(**LAYOUT, title=title("Per run: TTFT and TPOT", SOURCE_SCHEDULER, when(s.since, s.taken_at)),
                      yaxis_title="ms", yaxis_type="log", xaxis=CLOCK_AXIS)
    return fig


def layout_figure(layout: KVLayout, at: str) -> go.Figure:
    """One tick's rows held three ways: positions holding tokens, and the rest (padding, the last
    block's unused part, the unused reservation)."""
    names = ["our left-padded batch", f"paged, block {layout.block}", "contiguous reservation"]
    held = [layout.padded, layout.paged, layout.reserved]
    fig = go.Figure()
    fig.add_trace(go.Bar(x=names, y=[layout.used] * 3, name="holding a token", marker_color=COLOURS["used"]))
    fig.add_trace(go.Bar(x=names, y=[h - layout.used for h in held], name="holding nothing",
                         marker_color=COLOURS["reserved"], text=[percent(layout.waste(h)) for h in held],
                         textposition="outside"))
    fig.update_layout(**LAYOUT, barmode="stack", yaxis_title="KV positions",
                      title=title(f"{layout.rows} rows, {layout.used:,} tokens", SOURCE_COMPUTED, at))
    return fig


# --- the demonstrations --------------------------------------------------------------------------------
def load_text(load: float | None) -> str:
    return "" if load is None else f" (load average {load:.1f} on this machine)"


def batching_html(d: Any) -> str:
    c, s = d.continuous, d.static
    return (f'<div class="dp-serving-result" id="demo-batching-text"><b>{d.requests} requests, {d.max_batch} rows</b>: '
            f'continuous batching <b>{c.tokens_per_s:,.1f} tokens/s</b>, mean wait <b>{c.mean_wait_s:,.1f} s</b>; '
            f'static batching <b>{s.tokens_per_s:,.1f} tokens/s</b>, mean wait <b>{s.mean_wait_s:,.1f} s</b>. '
            f'Rows computed: {c.row_steps:,} vs {s.row_steps:,} ({s.row_steps - c.row_steps:,} for requests already done). '
            f'Same tokens both ways: {d.same_tokens} of {d.requests}.'
            f'<p id="demo-batching-verdict">{html.escape(batching_verdict(d))}</p><small>measured: our scheduler and a '
            f'static batch of the same model, {utc(d.at)}{load_text(d.load)}</small></div>')


# The batching chart's panels: (title, the BatchingSide field, decimals). The top row is counted
# (the machine's other load does not change it), the bottom one timed; batching_verdict reads the same fields.
BATCHING_PANELS = (("row-steps computed (counted)", "row_steps", 0),
                   ("mean wait, decode forwards (counted)", "mean_wait_ticks", 1),
                   ("tokens/s (wall clock)", "tokens_per_s", 1), ("mean wait, s (wall clock)", "mean_wait_s", 1))


def batching_figure(d: Any) -> go.Figure:
    """Continuous vs static batching, four panels: what the scheduler counted above what the clock said."""
    from plotly.subplots import make_subplots

    sides = [d.continuous, d.static]
    fig = make_subplots(rows=2, cols=2, subplot_titles=[p[0] for p in BATCHING_PANELS], vertical_spacing=0.2)
    for i, (_, field, decimals) in enumerate(BATCHING_PANELS):
        values = [getattr(x, field) for x in sides]
        fig.add_trace(go.Bar(x=[x.name for x in sides], y=values, showlegend=False, cliponaxis=False,
                             marker_color=[COLOURS["used"], COLOURS["reserved"]], textposition="outside",
                             text=["–" if v is None else f"{v:,.{decimals}f}" for v in values]),
                      row=i // 2 + 1, col=i % 2 + 1)
    fig.update_layout(**(LAYOUT | {"height": 520, "margin": {"l": 56, "r": 20, "t": 96, "b": 40}}),
                      title=title("Continuous vs static batching", "measured: our scheduler", utc(d.at)))
    fig.update_annotations(font_size=14)
    return fig


def paged_html(d: Any) -> str:
    p = d.peak
    return (f'<div class="dp-serving-result" id="demo-paged-text"><b>{p.rows} rows holding {p.used:,} tokens</b> at the fullest '
            f'tick: our left-padded batch holds <b>{p.padded:,}</b> positions '
            f'({percent(p.waste(p.padded))} hold nothing), '
            f'paged blocks of {p.block} would hold <b>{p.paged:,}</b> ({p.paged_blocks:,} blocks, '
            f'{percent(p.waste(p.paged))} hold nothing), a contiguous reservation of prompt + max_new_tokens '
            f'per request '
            f'<b>{p.reserved:,}</b> ({percent(p.waste(p.reserved))} hold nothing). One position is '
            f'{p.bytes_per_position:,} bytes.<br><small>{SOURCE_COMPUTED}, {utc(d.at)}</small></div>')


def prefix_html(d: Any) -> str:
    a, b = d.shared, d.unshared
    return (f'<div class="dp-serving-result" id="demo-prefix-text"><b>{d.users} users</b> whose prompts share their first '
            f'<b>{d.shared_tokens}</b> tokens: prefilled with the shared prefix fed once, <b>{a.prefill_tokens:,}</b> '
            f'positions in {a.prefill_ms:,.0f} ms (first token p50 {ms(a.ttft_ms["p50"])}); each prompt whole, '
            f'<b>{b.prefill_tokens:,}</b> positions in {b.prefill_ms:,.0f} ms (p50 {ms(b.ttft_ms["p50"])}). Same tokens: '
            f'{d.same_tokens} of {d.users}. A paged cache sharing the prefix\'s full blocks would hold '
            f'<b>{d.paged_blocks["shared"]}</b> blocks of {d.block} instead of {d.paged_blocks["each"]} (computed).'
            f'<br><small>measured: our scheduler, {utc(d.at)}{load_text(d.load)}</small></div>')


def grouped_bars(names: Sequence[str], bars: Sequence[tuple[str, Sequence[float], str, str]], heading: dict,
                 **axes: Any) -> go.Figure:
    """Measured quantities side by side for each of ``names``: ``bars`` are (legend label, one value
    a name, colour, y axis), ``heading`` the figure's title (``title``); a bar on "y2" reads the right-hand scale, and each bar then keeps its own
    offset group so bars on the two scales stand beside each other, not on top."""
    fig = go.Figure()
    for label, values, colour, axis in bars:
        on_axis = {"yaxis": axis} if axis != "y" else {}
        fig.add_trace(go.Bar(x=names, y=values, name=label, marker_color=colour, **on_axis))
    fig.update_layout(**LAYOUT, barmode="group", title=heading, **axes)
    if any(axis != "y" for *_, axis in bars):
        for i, trace in enumerate(fig.data):
            trace.update(offsetgroup=i)
    return fig


def prefix_figure(d: Any) -> go.Figure:
    sides = [d.shared, d.unshared]
    return grouped_bars(["prefix fed once", "each prompt whole"],
                        [("positions prefilled", [x.prefill_tokens for x in sides], COLOURS["padded"], "y"),
                         ("prefill ms", [x.prefill_ms for x in sides], COLOURS["paged"], "y2")],
                        title("Prefix sharing", "measured: our scheduler", utc(d.at)),
                        yaxis={"title": "positions"}, yaxis2={"title": "ms", "overlaying": "y", "side": "right"})


def chunked_html(d: Any) -> str:
    a, b = d.one_forward, d.chunked
    return (f'<div class="dp-serving-result" id="demo-chunked-text">A <b>{d.long_prompt_tokens:,}-token</b> prompt arrives '
            f'while {d.decoding} users decode. Prefilled in one forward: the others got '
            f'<b>{sum(a.others_tokens_meanwhile)}</b> tokens while it was read, longest gap <b>{ms(a.others_gap_ms["max"])}</b>; '
            f'its first token after {ms(a.long_ttft_ms)}. In chunks of {d.chunk}: the others got '
            f'<b>{sum(b.others_tokens_meanwhile)}</b> tokens, longest gap <b>{ms(b.others_gap_ms["max"])}</b>; its first token '
            f'after {ms(b.long_ttft_ms)}. Same tokens both ways: {"yes" if d.same_tokens else "no"}.'
            f'<br><small>measured: our scheduler, {utc(d.at)}{load_text(d.load)}</small></div>')


def chunked_figure(d: Any) -> go.Figure:
    sides = [d.one_forward, d.chunked]
    return grouped_bars(["one forward", f"chunks of {d.chunk}"],
                        [("others' longest gap (ms)", [x.others_gap_ms["max"] or 0 for x in sides], COLOURS["reserved"],
                          "y"),
                         ("long prompt's first token (ms)", [x.long_ttft_ms for x in sides], COLOURS["padded"], "y")],
                        title("Chunked prefill", "measured: our scheduler", utc(d.at)), yaxis_title="ms")


# --- a served vLLM -------------------------------------------------------------------------------------
def vllm_cards_html(w: VllmWindow) -> str:
    rate = "–" if w.hit_rate is None else percent(w.hit_rate)
    tps = "–" if w.tokens_per_s is None else f"{w.tokens_per_s:,.1f}"
    cards = [
        card(f"{w.running:.0f} / {w.waiting:.0f}", "requests running / waiting", SOURCE_VLLM, "vllm-requests"),
        card(percent(w.kv_usage), f"KV blocks in use (block {w.config.get('block_size', '?')})", SOURCE_VLLM,
             "vllm-kv"),
        card(rate, f"prefix cache hits ({w.prefix_hits:,.0f} of {w.prefix_queries:,.0f} tokens)", SOURCE_VLLM,
             "vllm-hits"),
        card(f"{w.preemptions:,.0f}", "preemptions", SOURCE_VLLM, "vllm-preemptions"),
        card(tps, "generated tokens/s", SOURCE_VLLM, "vllm-tokens"),
        card(f"{ms(_s(w.ttft_s['p50']))} / {ms(_s(w.ttft_s['p95']))}", "time to first token p50 / p95 (bucket estimate)",
             SOURCE_VLLM, "vllm-ttft"),
        card(f"{ms(_s(w.itl_s['p50']))} / {ms(_s(w.itl_s['p95']))}", "inter-token latency p50 / p95 (bucket estimate)",
             SOURCE_VLLM, "vllm-itl"),
    ]
    since = "since the server started" if not w.since else when(w.since, w.until)
    return (f'<div class="dp-status" id="vllm-window">{html.escape(w.server)} · {since} · prefix caching '
            f'{html.escape(w.config.get("enable_prefix_caching", "?"))}</div>'
            f'<div class="dp-serving-cards">{"".join(cards)}</div>')


def _s(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def vllm_figure(samples: Sequence[VllmSample]) -> go.Figure:
    """Requests running and waiting and KV blocks in use, sample by sample."""
    fig = go.Figure()
    times = clock([s.at for s in samples])
    fig.add_trace(go.Scatter(x=times, y=np.array([s.running for s in samples], dtype=float), mode="lines",
                             name="running", line={"shape": "hv", "color": COLOURS["padded"]}))
    fig.add_trace(go.Scatter(x=times, y=np.array([s.waiting for s in samples], dtype=float), mode="lines",
                             name="waiting", line={"shape": "hv", "color": COLOURS["queue"]}))
    fig.add_trace(go.Scatter(x=times, y=np.array([100 * s.kv_usage for s in samples], dtype=float), mode="lines",
                             name="KV blocks in use (%)", line={"shape": "hv", "color": COLOURS["paged"]}, yaxis="y2"))
    at = when(samples[0].at, samples[-1].at) if samples else ""
    fig.update_layout(**LAYOUT, yaxis={"title": "requests"}, yaxis2={"title": "%", "overlaying": "y", "side": "right"},
                      xaxis=CLOCK_AXIS,
                      title=title("vLLM: requests and KV blocks", SOURCE_VLLM, at))
    return fig


def vllm_prefix_html(d: Any) -> str:
    m = d.metrics
    rate = "–" if m.hit_rate is None else percent(m.hit_rate)
    return (f'<div class="dp-serving-result" id="vllm-demo-prefix-text"><b>{d.users} users</b> sent the same '
            f'{d.prompt_tokens:,}-token text: its prefix cache found <b>{m.prefix_hits:,.0f} of {m.prefix_queries:,.0f}</b> '
            f'prompt tokens (<b>{rate}</b>; block {html.escape(m.config.get("block_size", "?"))}). First token: '
            f'<b>{ms(d.cold_ttft_ms)}</b> for the first user, <b>{ms(d.warm_ttft_ms["p50"])}</b> (p50) for the others: '
            f'{ms(d.saved_ms)} of prefill saved each.<br><small>{SOURCE_VLLM} and our client\'s clock, '
            f'{html.escape(d.server)}, {utc(d.at)}</small></div>')


def vllm_chunked_html(d: Any) -> str:
    verdict = {True: "in chunks: every user got a token per chunk while it was read",
               False: "in one step: the others waited for it",
               None: "(no other user streamed to tell)"}[d.chunked]
    return (f'<div class="dp-serving-result" id="vllm-demo-chunked-text">A <b>{d.long_prompt_tokens:,}-token</b> prompt '
            f'arrived while {d.decoding} users streamed: they got <b>{sum(d.others_tokens_meanwhile)}</b> tokens while it '
            f'was read, longest gap <b>{ms(d.others_gap_ms["max"])}</b>; its first token after {ms(d.long_ttft_ms)}. '
            f'The server read it <b>{verdict}</b>.'
            f'<br><small>{SOURCE_VLLM} and our client\'s clock, {html.escape(d.server)}, {utc(d.at)}</small></div>')
