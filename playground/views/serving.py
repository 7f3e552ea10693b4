"""Serving: what the batched scheduler does with the room's requests, live, and four one-click
demonstrations of what a serving engine is about (continuous batching, paged KV blocks, prefix
sharing, chunked prefill), on our scheduler and, where the operator lists one, on a served vLLM
read through its /metrics (issue #41).

The live part reads the scheduler's flight recorder (engine.reports.serving: every tick and every
ended run of the header's model, whoever ran them) over a window; it never loads a model and runs
no forward, so it is not a model event. It refreshes on "Refresh", or every LIVE_S seconds while
"Watch live" is ticked (off by default: a room of phones does not poll unless asked). "New window"
starts this page's window now (a presenter's clean slate before a demonstration). A served vLLM is
picked from the operator's list only (DP_REMOTE_MODELS' openai: servers); its /metrics is read at
most once a second whatever the number of pages (engine.reports.vllm_metrics.MetricsWatch).

The demonstrations are model events (playground/events.py): each runs greedy requests on a
private scheduler of the header's model, one demonstration at a time per server (a second press
anywhere gets one line saying so), and shows its measured outcome with where and when it was measured.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import gradio as gr

from engine.backends.client import RemoteError
from engine.control import RunControl
from engine.reports import serving_demos as demos
from engine.reports.serving import summarise, utc
from engine.reports.vllm_metrics import MetricsWatches, window
from engine.runner import RUNS
from engine.trace import to_dict
from playground.charts import serving as charts

from ..events import data_api
from ..shared import OutputSet, Shared, UserError, error_html, status_html
from ..stale import cleared

WINDOWS = {"last minute": 60.0, "last 5 minutes": 300.0, "last 15 minutes": 900.0}
DEFAULT_WINDOW = "last 5 minutes"
LIVE_S = 2.0
MAX_WINDOW_S = 3600.0
INTRO = ("Every greedy and sampling run of the room goes through one **batched scheduler** per model: each tick, "
         "runs join and leave and all rows advance in one forward. Here is what it did, measured tick by tick, and "
         "what the same rows would need in a **paged KV cache** (computed from their lengths). Tick *Watch live* "
         "while the room works, or press a demonstration.")
DEMOS: dict[str, tuple[str, str, Callable]] = {
    "batching": ("Continuous vs static batching",
                 "8 requests of different lengths, 4 rows: the scheduler refills a row as soon as it frees; a static "
                 "batch computes every row until the longest is done.", demos.batching_demo),
    "paged": ("Paged KV blocks",
              "8 requests of different lengths: the positions our left-padded batch holds, 16-position blocks, "
              "and a contiguous reservation of each request's prompt + max_new_tokens.", demos.paged_demo),
    "prefix": ("Prefix sharing",
               "8 users send the lesson's long text plus a question each: their common prefix fed once, or each "
               "prompt whole.", demos.prefix_demo),
    "chunked": ("Chunked prefill",
                "3 users decode; a 600-token prompt arrives: read in one forward, or in chunks of 128 between "
                "their decode ticks.", demos.chunked_demo),
}
VLLM_DEMOS: dict[str, tuple[str, str, Callable]] = {
    "prefix": ("Prefix sharing on vLLM", "6 users send the same long text (new each time) one after another: its "
               "prefix cache's hits and the first-token time it saves.", demos.vllm_prefix_demo),
    "chunked": ("Chunked prefill on vLLM", "3 users stream; a long prompt arrives: their gaps, and whether the "
                "server cut it into chunks (its largest engine step).", demos.vllm_chunked_demo),
}


@dataclass
class LiveOutputs(OutputSet):
    status: Any
    cards: Any
    rows: Any
    kv: Any
    latency: Any
    runs: Any


@dataclass
class ResultOutputs(OutputSet):
    status: Any
    text: Any
    plot: Any


def window_seconds(label: Any, start: Any, now: float) -> float:
    """The window's length: the picked one, cut to the page's "New window" start."""
    if not isinstance(label, str) or label not in WINDOWS:
        raise UserError(f"window: expected one of {', '.join(WINDOWS)}, got {str(label)[:60]!r}")
    seconds = WINDOWS[label]
    if isinstance(start, (int, float)) and not isinstance(start, bool) and 0 < start <= now:
        seconds = min(seconds, now - start)
    return seconds


def room_summary(shared: Shared, model: Any, quantization: Any, window_s: float):
    """(summary, None) for the header's model's scheduler, or (None, why there is none)."""
    lm = shared.loaded_lm(model, quantization)
    if lm is None:
        return None, f"{model}: not loaded yet: no run has used it since the server started"
    scheduler = shared.scheduler_for(lm)
    if scheduler is None:  # its server batches the requests, not our scheduler
        return None, f"{model}: a served model; its server batches the requests (see 'A served vLLM' below)"
    return summarise(scheduler.serving.snapshot(window_s)), None


def live_updates(out: LiveOutputs, shared: Shared, model: Any, quantization: Any, label: Any, start: Any) -> dict:
    """The room's window: the source line, the big numbers and the four charts."""
    try:
        summary, why = room_summary(shared, model, quantization, window_seconds(label, start, time.time()))
    except UserError as exc:
        return {out.status: error_html(str(exc))}
    if summary is None:
        return {out.status: status_html(why), out.cards: "", out.rows: None, out.kv: None, out.latency: None,
                out.runs: None}
    return {out.status: charts.source_line(summary, str(model)), out.cards: charts.cards_html(summary),
            out.rows: charts.rows_figure(summary), out.kv: charts.kv_figure(summary),
            out.latency: charts.latency_figure(summary), out.runs: charts.runs_figure(summary)}


def serving_stats(shared: Shared, model: str = "embedded", quantization: str = "none", window_s: float = 300.0,
                  series: bool = False) -> dict:
    """The header model's scheduler over the last ``window_s`` seconds (at most 3600): ticks, runs,
    rows per tick, tokens/s, TTFT and TPOT percentiles (ms), tick latency by rows, the KV layouts
    at the fullest tick (our padded batch, paged blocks of 16, contiguous reservation); ``series``:
    the per-tick and per-run values too. ``available`` false with ``why`` when there is no scheduler."""
    if isinstance(window_s, bool) or not isinstance(window_s, (int, float)) or not 0 < window_s <= MAX_WINDOW_S:
        raise UserError(f"window_s: expected seconds in (0, {MAX_WINDOW_S:g}], got {window_s!r}")
    summary, why = room_summary(shared, model, quantization, float(window_s))
    if summary is None:
        return {"available": False, "why": why}
    data = to_dict(summary)
    if not series:
        data.pop("series")
    return {"available": True, "source": "our scheduler", **data}


@contextlib.contextmanager
def one_at_a_time(busy: threading.Lock, title: str) -> Iterator[None]:
    """Hold the server's demonstration slot, or refuse in one line when another page holds it."""
    if not busy.acquire(blocking=False):
        raise UserError(f"{title}: another demonstration is running on this server; press again when it ends")
    try:
        yield
    finally:
        busy.release()


def local_model(shared: Shared, model: Any, quantization: Any, title: str) -> Any:
    """The header's model, loaded here (a served one is refused: these run on our scheduler)."""
    lm = shared.lm(model, quantization)
    if not lm.capabilities.scheduled:  # the demonstrations run on our scheduler
        raise UserError(f"{title}: runs on our scheduler; {str(model)[:80]} is a served model (see its own "
                        "demonstrations below)")
    return lm


def demo_name(name: Any, names: dict) -> str:
    if not isinstance(name, str) or name not in names:
        raise UserError(f"name: expected one of {' | '.join(names)}, got {str(name)[:60]!r}")
    return name


def demo_updates(out: ResultOutputs, shared: Shared, busy: threading.Lock, name: str, model: Any, quantization: Any,
                 control: RunControl) -> Iterator[dict]:
    """Run one demonstration on the header's model and show its outcome."""
    title, _, run = DEMOS[name]
    lm = local_model(shared, model, quantization, title)
    with one_at_a_time(busy, title):
        yield {out.status: status_html(f"{title}: running on {lm.name}…"), out.text: "", out.plot: None}
        result = run(lm, control, runs=RUNS)
    yield {out.status: status_html(f"{title}: done at {utc(result.at)}"), out.text: DEMO_HTML[name](result),
           out.plot: DEMO_FIGURE[name](result)}


DEMO_HTML = {"batching": charts.batching_html, "paged": charts.paged_html, "prefix": charts.prefix_html,
             "chunked": charts.chunked_html}
DEMO_FIGURE = {"batching": charts.batching_figure, "paged": lambda d: charts.layout_figure(d.peak, utc(d.at)),
               "prefix": charts.prefix_figure, "chunked": charts.chunked_figure}


def serving_demo(shared: Shared, busy: threading.Lock, name: str, model: str = "embedded", quantization: str = "none", *,
                 control: RunControl) -> dict:
    """Run one demonstration (batching | paged | prefix | chunked) on the model's own private
    scheduler; its measured outcome, with every variant's tokens."""
    name = demo_name(name, DEMOS)
    title, _, run = DEMOS[name]
    lm = local_model(shared, model, quantization, title)
    with one_at_a_time(busy, title):
        return to_dict(run(lm, control, runs=RUNS))


# --- a served vLLM -------------------------------------------------------------------------------------
def vllm_updates(cards: Any, plot: Any, watches: MetricsWatches, server: Any, label: Any, start: Any) -> dict:
    """The listed server's window: its big numbers and its requests and KV blocks over time."""
    try:
        watch = watches.get(server)
        last = watch.sample()
    except (ValueError, RemoteError) as exc:
        return {cards: error_html(str(exc))}
    try:
        seconds = window_seconds(label, start, time.time())
    except UserError as exc:
        return {cards: error_html(str(exc))}
    history = watch.history(seconds)
    return {cards: charts.vllm_cards_html(window(history[0] if len(history) > 1 else None, last)),
            plot: charts.vllm_figure(history)}


def vllm_metrics(watches: MetricsWatches, server: str, window_s: float = 300.0) -> dict:
    """A listed vLLM server's /metrics over the last ``window_s`` seconds of this app's reads of it
    (counters as differences; percentiles estimated from its histograms), or since it started
    when there is no earlier read."""
    if isinstance(window_s, bool) or not isinstance(window_s, (int, float)) or not 0 < window_s <= MAX_WINDOW_S:
        raise UserError(f"window_s: expected seconds in (0, {MAX_WINDOW_S:g}], got {window_s!r}")
    watch = watches.get(server)
    last = watch.sample()
    history = watch.history(float(window_s))
    return {"source": "vLLM's /metrics", **to_dict(window(history[0] if len(history) > 1 else None, last))}


def vllm_demo_updates(out: ResultOutputs, watches: MetricsWatches, busy: threading.Lock, name: str, server: Any,
                      control: RunControl) -> Iterator[dict]:
    title, _, run = VLLM_DEMOS[name]
    watch = watches.get(server)
    with one_at_a_time(busy, title):
        yield {out.status: status_html(f"{title}: running on {watch.server}…"), out.text: ""}
        result = run(watch, control)
    yield {out.status: status_html(f"{title}: done at {utc(result.at)}"), out.text: VLLM_HTML[name](result)}


VLLM_HTML = {"prefix": charts.vllm_prefix_html, "chunked": charts.vllm_chunked_html}


def vllm_demo(watches: MetricsWatches, busy: threading.Lock, name: str, server: str, *, control: RunControl) -> dict:
    """Run one demonstration (prefix | chunked) on a vLLM server the operator lists; its measured outcome."""
    name = demo_name(name, VLLM_DEMOS)
    watch = watches.get(server)
    with one_at_a_time(busy, VLLM_DEMOS[name][0]):
        return to_dict(VLLM_DEMOS[name][2](watch, control))


# --- the tab -------------------------------------------------------------------------------------------
def build_tab(shared: Shared) -> None:
    gr.Markdown(INTRO, elem_id="serving-intro")
    with gr.Row(equal_height=True):
        label = gr.Dropdown(list(WINDOWS), value=DEFAULT_WINDOW, label="Window", elem_id="serving-window-pick",
                            scale=2, min_width=160)
        refresh = gr.Button("Refresh", elem_id="serving-refresh", scale=1, min_width=100)
        live = gr.Checkbox(False, label=f"Watch live (every {LIVE_S:g} s)", elem_id="serving-live", scale=1, min_width=160)
        new_window = gr.Button("New window", elem_id="serving-new-window", scale=1, min_width=120)
    start = gr.State(None)  # this page's "New window" time (time.time()), or None
    status = gr.HTML("", elem_id="serving-status")
    cards = gr.HTML("", elem_id="serving-cards")
    with gr.Row(equal_height=False):
        rows = gr.Plot(label="rows per tick", elem_id="serving-rows", min_width=420)
        kv = gr.Plot(label="KV cache in use", elem_id="serving-kv", min_width=420)
    with gr.Row(equal_height=False):
        latency = gr.Plot(label="tick latency vs rows", elem_id="serving-latency", min_width=420)
        runs = gr.Plot(label="TTFT and TPOT per run", elem_id="serving-runs", min_width=420)
    out = LiveOutputs(status, cards, rows, kv, latency, runs)
    timer = gr.Timer(LIVE_S, active=False)
    busy = threading.Lock()
    _demo_section(shared, busy)
    vllm = _vllm_section(shared)
    _wire_live(shared, out, label, start, refresh, live, new_window, timer, vllm)
    shared.events.api(functools.partial(serving_demo, shared, busy), "serving_demo", what="demonstration")
    data_api(functools.partial(serving_stats, shared), "serving_stats", what="serving stats")


def _wire_live(shared: Shared, out: LiveOutputs, label: Any, start: Any, refresh: Any, live: Any, new_window: Any,
               timer: Any, vllm: dict) -> None:
    inputs = [shared.model, shared.quantization, label, start]
    outputs = out.all()
    if vllm:
        inputs, outputs = inputs + [vllm["server"]], outputs + [vllm["cards"], vllm["plot"]]

    def on_refresh(model: Any, quantization: Any, picked: Any, since: Any, server: Any = None) -> dict:
        updates = live_updates(out, shared, model, quantization, picked, since)
        if vllm:
            updates |= vllm_updates(vllm["cards"], vllm["plot"], vllm["watches"], server, picked, since)
        return updates

    private: dict[str, Any] = {"api_visibility": "private", "queue": False}
    gr.on([refresh.click, timer.tick, label.change], on_refresh, inputs, outputs, **private)
    live.change(lambda on: gr.Timer(active=bool(on)), live, timer, **private)
    new_window.click(lambda: time.time(), None, start, **private).then(on_refresh, inputs, outputs, **private)


def _demo_section(shared: Shared, busy: threading.Lock) -> None:
    gr.Markdown("### Demonstrations\nEach runs greedy requests on a private scheduler of the header's model (the "
                "room's runs are not counted in it), one demonstration at a time on this server.", elem_id="serving-demos")
    names = list(DEMOS)
    for pair in (names[:2], names[2:]):
        with gr.Row(equal_height=False):
            for name in pair:
                with gr.Column(min_width=420):
                    title, what, _ = DEMOS[name]
                    button = gr.Button(title, variant="primary", elem_id=f"demo-{name}-run")
                    gr.Markdown(f"<small>{what}</small>")
                    out = ResultOutputs(gr.HTML("", elem_id=f"demo-{name}-status"), gr.HTML("", elem_id=f"demo-{name}-result"),
                                        gr.Plot(label=title, elem_id=f"demo-{name}-plot"))
                    shared.events.on([button.click], _demo_handler(out, shared, busy, name),
                                     [shared.model, shared.quantization], out.all(),
                                     on_error=cleared(out.status, out.all()), what="demonstration")


def _demo_handler(out: ResultOutputs, shared: Shared, busy: threading.Lock, name: str) -> Callable[..., Iterator[dict]]:
    def on_demo(model: Any, quantization: Any, *, control: RunControl) -> Iterator[dict]:
        yield from demo_updates(out, shared, busy, name, model, quantization, control)

    return on_demo


def _vllm_demo_handler(out: ResultOutputs, watches: MetricsWatches, busy: threading.Lock,
                       name: str) -> Callable[..., Iterator[dict]]:
    def on_demo(server: Any, *, control: RunControl) -> Iterator[dict]:
        yield from vllm_demo_updates(out, watches, busy, name, server, control)

    return on_demo


def _vllm_section(shared: Shared) -> dict:
    """The served vLLM part, when the operator lists one (else nothing is drawn): the server, its
    numbers and chart, and its two demonstrations."""
    watches = MetricsWatches()
    if not watches.servers:
        return {}
    gr.Markdown("### A served vLLM\nThe same quantities read from its Prometheus /metrics (the operator's servers only).",
                elem_id="vllm-intro")
    server = gr.Dropdown(list(watches.servers), value=watches.servers[0], label="vLLM server", elem_id="vllm-server")
    cards = gr.HTML("", elem_id="vllm-cards")
    plot = gr.Plot(label="vLLM: requests and KV blocks", elem_id="vllm-plot")
    busy = threading.Lock()
    with gr.Row(equal_height=False):
        for name, (title, what, _) in VLLM_DEMOS.items():
            with gr.Column(min_width=420):
                button = gr.Button(title, variant="primary", elem_id=f"vllm-demo-{name}-run")
                gr.Markdown(f"<small>{what}</small>")
                out = ResultOutputs(gr.HTML("", elem_id=f"vllm-demo-{name}-status"),
                                    gr.HTML("", elem_id=f"vllm-demo-{name}-result"), None)
                shared.events.on([button.click], _vllm_demo_handler(out, watches, busy, name), [server],
                                 [out.status, out.text],
                                 on_error=cleared(out.status, [out.status, out.text]), what="demonstration")
    shared.events.api(functools.partial(vllm_demo, watches, busy), "vllm_demo", what="demonstration")
    data_api(functools.partial(vllm_metrics, watches), "vllm_metrics", what="vLLM metrics")
    return {"server": server, "cards": cards, "plot": plot, "watches": watches}
