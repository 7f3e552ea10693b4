"""Issue #41: the Serving view's handlers on the embedded model and the real scheduler. Each
demonstration's claim is checked against what can be counted (tokens, positions, row-steps, the
forwards' own masks), never against a stopwatch: the times it shows are measurements, and
bench/serving.py prints them. Plus the live window, hostile input, two pages at once."""

from __future__ import annotations

import threading

import gradio as gr
import pytest

from engine.control import RunControl
from engine.reports.serving import blocks, percentile
from engine.strategies import decode
from engine.config import DecodingConfig
from playground.charts import serving as charts
from playground.shared import UserError
from playground.views import serving as view
from tests.helpers.serving_stats import ForwardLog

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shared(registry, embedded):
    """A real Shared over the session's registry (the embedded model loaded in it)."""
    from playground.shared import Shared, model_pickers, user_presets_state

    with gr.Blocks():
        model, quant = model_pickers()
        return Shared(registry=registry, model=model, quantization=quant, user_presets=user_presets_state())


def demo(shared, name: str) -> dict:
    return view.serving_demo(shared, threading.Lock(), name, control=RunControl())


def test_continuous_batching_computes_only_live_rows_and_answers_early(shared):
    d = demo(shared, "batching")
    c, s = d["continuous"], d["static"]
    assert d["same_tokens"] == d["requests"] == 8 and d["tokens"]["continuous"] == d["tokens"]["static"]
    lengths = [len(t) for t in d["tokens"]["continuous"]]
    assert c["row_steps"] == sum(n - 1 for n in lengths)  # each row computed once per token after its first
    waves = [lengths[i:i + d["max_batch"]] for i in range(0, len(lengths), d["max_batch"])]
    assert s["row_steps"] == sum(len(w) * (max(w) - 1) for w in waves)  # every row until its wave's longest
    assert s["forwards"] == sum(max(w) - 1 for w in waves)
    assert s["row_steps"] > c["row_steps"]
    for w in range(len(waves)):  # static: a wave's requests are all answered when its longest is done
        waits = s["waits_s"][w * d["max_batch"]:(w + 1) * d["max_batch"]]
        assert max(waits) == min(waits)
    first = waves[0]  # continuous: in the first rows, every shorter request is answered before the longest
    longest = first.index(max(first))
    assert all(c["waits_s"][i] < c["waits_s"][longest] for i, n in enumerate(first) if n < first[longest])
    assert c["tokens"] == s["tokens"] == sum(lengths)


def test_paged_blocks_hold_what_the_rows_need(shared, embedded):
    log = ForwardLog(embedded.model)
    try:
        d = demo(shared, "paged")
    finally:
        log.handle.remove()
    peak, lengths = d["peak"], d["lengths"]
    assert any(call[1] == tuple(lengths) and call[2] == d["width"] for call in log.calls)  # what that forward's mask said
    assert peak["used"] == sum(lengths) and peak["padded"] == len(lengths) * d["width"]
    assert peak["paged"] == 16 * sum(blocks(n) for n in lengths) and peak["paged"] - peak["used"] < 16 * len(lengths)
    assert peak["padded"] > peak["paged"] and peak["reserved"] > peak["paged"]  # the claim: paging wastes least
    assert peak["padded"] == max(d["series"]["padded"])


def test_prefix_sharing_feeds_the_shared_prefix_once_with_the_same_tokens(shared, embedded):
    d = demo(shared, "prefix")
    prompts = [embedded.encode(view.demos.LESSON + view.demos.QUESTIONS[i % 8] + f" (user {i})") for i in range(8)]
    assert d["prompt_tokens"] == [len(p) for p in prompts]
    shared_tokens = min(next(k for k, (a, b) in enumerate(zip(prompts[0], p)) if a != b) for p in prompts[1:])
    assert d["shared_tokens"] == shared_tokens > 100
    assert d["unshared"]["prefill_tokens"] == sum(len(p) for p in prompts)
    assert d["shared"]["prefill_tokens"] == shared_tokens + sum(len(p) - shared_tokens for p in prompts)
    assert d["same_tokens"] == 8 and d["tokens"]["shared"] == d["tokens"]["unshared"]
    solo = [s.chosen_token_id for s in decode.stream(embedded, prompts[3], DecodingConfig(strategy="greedy", max_new_tokens=4))]
    assert d["tokens"]["shared"][3] == solo
    full = shared_tokens // 16
    assert d["paged_blocks"] == {"each": sum(blocks(len(p)) for p in prompts),
                                 "shared": full + sum(blocks(len(p) - 16 * full) for p in prompts)}


# `alone` (make test's one-process phase): the window is wall-clock, from the long prompt's send to its first
# token, and on a machine shared with the other worker a token made before the long forward can reach its reader
# thread inside the window (one two-worker run saw more than one).
@pytest.mark.alone
def test_chunked_prefill_keeps_the_others_decoding_with_the_same_tokens(shared, embedded):
    d = demo(shared, "chunked")
    one, chunked = d["one_forward"], d["chunked"]
    assert d["same_tokens"] and one["long_tokens"] == chunked["long_tokens"]
    assert all(n <= 1 for n in one["others_tokens_meanwhile"])  # one forward: nobody moves while it is read
    chunks = -(-d["long_prompt_tokens"] // d["chunk"])
    assert all(n >= chunks - 2 for n in chunked["others_tokens_meanwhile"])  # a token per chunk tick
    long = view.demos.story_prompt(embedded, 3, words=600)
    solo = [s.chosen_token_id for s in decode.stream(embedded, long, DecodingConfig(strategy="greedy", max_new_tokens=4))]
    assert chunked["long_tokens"] == solo and len(long) == d["long_prompt_tokens"]


def test_the_handler_shows_the_demonstrations_own_numbers(shared):
    out = view.ResultOutputs("status", "text", "plot")
    updates = list(view.demo_updates(out, shared, threading.Lock(), "paged", "embedded", "none", RunControl()))
    assert "running" in updates[0]["status"] and updates[0]["text"] == ""
    last = updates[-1]
    bars = {trace.name: list(trace.y) for trace in last["plot"].data}
    used, nothing = bars["holding a token"][0], bars["holding nothing"]
    padded, paged, reserved = used + nothing[0], used + nothing[1], used + nothing[2]
    for number in (f"{used:,}", f"{padded:,}", f"{paged:,}", f"{reserved:,}"):
        assert f"<b>{number}</b>" in last["text"] or f"{number} tokens" in last["text"]
    assert "computed from our scheduler" in last["text"] and "UTC" in last["status"]


def test_the_live_window_shows_the_rooms_runs(shared, embedded):
    out = view.LiveOutputs(*"status cards rows kv latency runs".split())
    start = __import__("time").time()
    traces = []

    def user(i: int) -> None:
        ids = embedded.encode(f"Room user {i} asks about the moon.")
        traces.append(shared.run(embedded, "", DecodingConfig(strategy="sample", seed=i, max_new_tokens=6), chat=False,
                                 prompt_ids=ids, control=RunControl()))

    threads = [threading.Thread(target=user, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    updates = view.live_updates(out, shared, "embedded", "none", "last minute", start)
    ttft = [t.steps[0].elapsed_ms for t in traces]
    tpot = [(t.steps[-1].elapsed_ms - t.steps[0].elapsed_ms) / (len(t.steps) - 1) for t in traces]
    assert "4 runs ended" in updates["status"]
    assert f"{percentile(ttft, 50):,.0f} ms / {percentile(ttft, 95):,.0f} ms" in updates["cards"]
    assert f"{percentile(tpot, 50):,.0f} ms / {percentile(tpot, 95):,.0f} ms" in updates["cards"]
    stats = view.serving_stats(shared, window_s=60.0)
    assert stats["available"] and stats["runs"] >= 4 and "series" not in stats
    other = view.live_updates(out, shared, "embedded", "none", "last minute", __import__("time").time())
    assert "0 runs ended" in other["status"]  # another page's fresh window: its own, not this one's


@pytest.mark.parametrize("label", [None, 5, "last hour", "<b>x</b>", "\ud800", "x" * 5000])
def test_a_bad_window_is_one_line(shared, label):
    out = view.LiveOutputs(*"status cards rows kv latency runs".split())
    updates = view.live_updates(out, shared, "embedded", "none", label, None)
    assert updates["status"].startswith('<div class="dp-error"') and "window:" in updates["status"]
    assert "<b>x</b>" not in updates["status"] and len(updates["status"]) < 500


@pytest.mark.parametrize("window_s", [0, -1, float("nan"), float("inf"), 1e9, True, "60", None])
def test_serving_stats_refuses_a_bad_window(shared, window_s):
    with pytest.raises(UserError, match="^window_s: "):
        view.serving_stats(shared, window_s=window_s)


@pytest.mark.parametrize("name", ["", "static", None, 3, "<script>", "\ud800"])
def test_serving_demo_refuses_a_bad_name(shared, name):
    with pytest.raises(UserError, match="^name: expected one of batching | paged | prefix | chunked"):
        view.serving_demo(shared, threading.Lock(), name, control=RunControl())


def test_one_demonstration_at_a_time(shared):
    busy = threading.Lock()
    busy.acquire()  # another page's demonstration holds the server's slot
    try:
        with pytest.raises(UserError, match="another demonstration is running"):
            view.serving_demo(shared, busy, "paged", control=RunControl())
        out = view.ResultOutputs("status", "text", "plot")
        with pytest.raises(UserError, match="another demonstration is running"):
            list(view.demo_updates(out, shared, busy, "prefix", "embedded", "none", RunControl()))
    finally:
        busy.release()


def test_a_stopped_demonstration_stops(shared):
    control = RunControl()
    control.cancel()
    with pytest.raises(Exception, match="cancel"):
        view.serving_demo(shared, threading.Lock(), "batching", control=control)


def test_the_vllm_part_refuses_unlisted_servers(shared):
    watches = view.MetricsWatches(("http://127.0.0.1:9",))
    updates = view.vllm_updates("cards", "plot", watches, "http://evil.example", "last minute", None)
    assert "is not a vLLM server the operator lists" in updates["cards"]
    updates = view.vllm_updates("cards", "plot", watches, "http://127.0.0.1:9", "last minute", None)
    assert "cannot connect" in updates["cards"] and updates["cards"].startswith('<div class="dp-error"')
    with pytest.raises(ValueError, match="not a vLLM server"):
        view.vllm_metrics(watches, "http://evil.example")
    with pytest.raises(UserError, match="^name: "):
        view.vllm_demo(watches, threading.Lock(), "batching", "http://127.0.0.1:9", control=RunControl())


def test_charts_say_where_and_when():
    from engine.reports.serving import RunRecord, ServingStats, Tick, summarise

    stats = ServingStats(100)
    stats.add_tick(Tick(1000.0, 2, 1, 0, 8, (8, 3), 40, 11, 0, 1.0, 2.0, 3.0))
    stats.add_run(RunRecord(1000.5, 3, 5, 40.0, 10.0, "eos"))
    s = summarise(stats.snapshot(now=1001.0))
    for fig in (charts.rows_figure(s), charts.kv_figure(s), charts.latency_figure(s), charts.runs_figure(s)):
        text = fig.layout.title.text
        assert "UTC" in text and ("measured: our scheduler" in text or "computed from" in text)
        fig.to_json()  # plotly's strict JSON
    assert "00:16:40–00:16:41 UTC" in charts.source_line(s, "<b>m</b>") and "&lt;b&gt;m" in charts.source_line(s, "<b>m</b>")


def test_the_live_kv_figure_and_card_show_the_three_layouts_by_hand():
    from engine.reports.serving import ServingStats, Tick, summarise

    stats = ServingStats(100)  # rows of 8 and 3 positions in a batch 8 wide, each reserving 20
    stats.add_tick(Tick(1000.0, 2, 0, 0, 8, (8, 3), 40, 0, 0, 1.0, 2.0, 3.0))
    s = summarise(stats.snapshot(now=1001.0))
    lines = {trace.name: list(trace.y) for trace in charts.kv_figure(s).data}
    mib = 1 << 20
    assert lines == {"our left-padded batch": [16 * 100 / mib], "paged, 16-position blocks (computed)": [32 * 100 / mib],
                     "contiguous reservation (computed)": [40 * 100 / mib]}
    html = charts.cards_html(s)
    assert '<div class="dp-serving-value">16 / 32 / 40</div>' in html and "(11 hold a token)" in html
    # 5 of 16 padded positions, 21 of 32 paged ones hold nothing (written by engine.numbers.percent)
    assert "31.2% → 65.6%" in html
