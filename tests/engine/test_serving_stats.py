"""Issue #41: the scheduler's flight recorder (engine.reports.serving) against what the model's
forwards really held, and the two scheduler features it made visible: chunked prefill of a long
prompt between decode ticks and a shared prompt prefix fed once, both against their oracle
(``decode.stream`` run alone: same tokens, probabilities within float tolerance)."""

from __future__ import annotations

import threading
import time

import pytest

from bench.concurrency import percentile as bench_percentile
from engine.cache import KVCache
from engine.config import DecodingConfig
from engine.control import RunControl, RunStopped
from engine.reports.serving import RunRecord, ServingStats, Tick, blocks, kv_layout, percentile, summarise
from engine.scheduler import Scheduler, bytes_per_position, shared_prefix
from engine.strategies import decode
from tests.helpers.scheduler import assert_same_steps, run_concurrently
from tests.helpers.serving_stats import ForwardLog  # noqa: F401


def greedy(n: int, **knobs) -> DecodingConfig:
    return DecodingConfig(strategy="greedy", max_new_tokens=n, **knobs)


# --- the arithmetic, by hand -------------------------------------------------------------------------
def test_kv_layout_by_hand():
    # rows of 5, 16 and 17 real positions in a batch 17 wide, each reserving 40
    layout = kv_layout([5, 16, 17], width=17, reserved=120, bytes_per_position=10, block=16)
    assert (layout.used, layout.padded, layout.paged, layout.reserved) == (38, 51, 16 + 16 + 32, 120)
    assert layout.paged_blocks == 4
    assert layout.waste(layout.padded) == pytest.approx(13 / 51)
    assert layout.waste(layout.paged) == pytest.approx(26 / 64)
    assert layout.waste(0) == 0.0
    assert [blocks(n) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]
    assert kv_layout([4], 4, 2, 1).reserved == 4  # a reservation is never below what is used
    with pytest.raises(ValueError, match="block"):
        kv_layout([1], 1, 1, 1, block=0)


@pytest.mark.parametrize("values", [[3.0], [5.0, 1.0], [float(i) for i in range(1, 101)], [2.0, 2.0, 9.0, 1.0, 7.0]])
def test_percentile_is_the_bench_percentile(values):
    for q in (0, 50, 95, 100):
        assert percentile(values, q) == bench_percentile(values, q)


def tick(at: float, rows: int = 1, **fields) -> Tick:
    base = dict(queued=0, prefilling=0, width=4, lengths=(4,) * rows, reserved=8 * rows, prefill_tokens=0,
                prefill_saved=0, prefill_ms=1.0, forward_ms=2.0, step_ms=3.0)
    return Tick(at=at, rows=rows, **(base | fields))


def test_rings_are_bounded_and_windowed():
    stats = ServingStats(bytes_per_position=8, ticks=3, runs=2)
    for i in range(5):
        stats.add_tick(tick(100.0 + i))
        stats.add_run(RunRecord(100.0 + i, 4, 3, 10.0, 5.0, "length"))
    snap = stats.snapshot(now=104.0)
    assert [t.at for t in snap.ticks] == [102.0, 103.0, 104.0] and [r.at for r in snap.runs] == [103.0, 104.0]
    assert (snap.ticks_total, snap.runs_total) == (5, 5)
    assert [t.at for t in stats.snapshot(window_s=1.5, now=104.0).ticks] == [103.0, 104.0]
    with pytest.raises(ValueError, match="ring sizes"):
        ServingStats(8, ticks=0)


def test_summary_by_hand():
    stats = ServingStats(bytes_per_position=10)
    stats.add_tick(tick(10.0, rows=2, width=6, lengths=(6, 3), reserved=20))
    stats.add_tick(tick(12.0, rows=4, width=5, lengths=(5, 5, 2, 1), reserved=30, forward_ms=7.0))
    stats.add_run(RunRecord(11.0, 4, 5, 100.0, 20.0, "length"))
    stats.add_run(RunRecord(11.5, 4, 1, 300.0, None, "eos"))
    stats.add_run(RunRecord(11.6, 4, 0, None, None, "cancelled"))
    s = summarise(stats.snapshot(now=12.0))
    assert (s.ticks, s.runs, s.mean_rows, s.max_rows) == (2, 3, 3.0, 4)
    assert s.tokens_per_s == pytest.approx(6 / ((6.0 + 11.0) / 1000))  # 2 + 4 rows in the ticks' 6 + 11 ms
    assert s.ttft_ms == {"count": 2, "p50": 300.0, "p95": 300.0, "max": 300.0}  # nearest rank: round(1.5) = 2
    assert s.tpot_ms == {"count": 1, "p50": 20.0, "p95": 20.0, "max": 20.0}
    assert s.tick_ms_by_rows[4]["p50"] == 1.0 + 7.0 + 3.0 and s.forward_ms_by_rows[2]["p50"] == 2.0
    assert (s.peak.padded, s.peak.used, s.peak.paged) == (20, 13, 64)  # 4 x 5 beats 2 x 6
    assert s.kv_bytes_now == 4 * 5 * 10
    assert s.series["paged_bytes"] == [2 * 16 * 10, 4 * 16 * 10]


def test_recording_and_reading_from_many_threads():
    stats = ServingStats(bytes_per_position=1, ticks=64)

    def writer(k: int) -> None:
        for i in range(500):
            stats.add_tick(tick(float(k * 1000 + i)))

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    seen = [len(stats.snapshot().ticks) for _ in range(200)]
    for t in threads:
        t.join()
    assert max(seen) <= 64 and stats.snapshot().ticks_total == 2000


def test_each_tick_records_what_its_forward_held(tiny_lm):
    scheduler = Scheduler(tiny_lm, max_batch=8, prefill_chunk=0)
    log = ForwardLog(tiny_lm.model)
    try:
        jobs = [(tiny_lm.encode("a b c " * (i + 1)), greedy(6 + 3 * i)) for i in range(5)]
        run_concurrently(scheduler, jobs)
    finally:
        log.handle.remove()
    snap = scheduler.serving.snapshot()
    assert [(t.rows, t.lengths, t.width) for t in snap.ticks] == [c[:3] for c in log.calls]
    assert [t.rows * t.width * snap.bytes_per_position for t in snap.ticks] == [c[3] for c in log.calls]
    assert snap.bytes_per_position == bytes_per_position(tiny_lm) == 2 * 2 * 2 * 16 * 4  # K+V, layers, kv heads, head dim, fp32
    first = snap.ticks[0]  # sent together: all five rows in the first decode forward
    assert first.rows == 5 and first.reserved == sum(len(ids) + config.max_new_tokens for ids, config in jobs)
    assert first.prefill_tokens == sum(len(ids) for ids, _ in jobs)
    assert all(t.forward_ms > 0 and t.step_ms > 0 and t.prefill_ms >= 0 for t in snap.ticks)


def test_run_records_are_what_the_users_received(tiny_lm):
    scheduler = Scheduler(tiny_lm, max_batch=4)
    jobs = [(tiny_lm.encode(f"record {i}"), greedy(n)) for i, n in enumerate((1, 2, 7))]
    results, _ = run_concurrently(scheduler, jobs)
    records = sorted(scheduler.serving.snapshot().runs, key=lambda r: r.tokens)
    for record, steps in zip(records, sorted(results, key=len)):
        assert record.tokens == len(steps) and record.ttft_ms == steps[0].elapsed_ms
        assert record.reason == steps[-1].finish_reason == "max_new_tokens"
        expected = (steps[-1].elapsed_ms - steps[0].elapsed_ms) / (len(steps) - 1) if len(steps) > 1 else None
        assert record.tpot_ms == expected
        assert record.prompt_tokens == len(jobs[[len(s) for s in results].index(len(steps))][0])


def test_a_cancelled_run_is_recorded_with_its_reason(tiny_lm):
    scheduler = Scheduler(tiny_lm, max_batch=2)
    control = RunControl()
    stream = scheduler.stream(tiny_lm.encode("cancel me"), greedy(200), control=control)
    first = next(stream)
    control.cancel()
    with pytest.raises(RunStopped):
        for _ in stream:
            pass
    deadline = time.time() + 30
    while not scheduler.serving.snapshot().runs and time.time() < deadline:
        time.sleep(0.01)
    record = scheduler.serving.snapshot().runs[-1]
    assert record.reason == "cancelled" and record.tokens >= 1 and record.ttft_ms == first.elapsed_ms


# --- chunked prefill ---------------------------------------------------------------------------------
def test_chunked_prefill_equals_solo_and_lets_the_others_decode(tiny_lm):
    """A 300-token prompt arrives while two runs decode: read 64 tokens a tick, the others get a
    token every tick meanwhile, and every run's steps equal its solo run's."""
    scheduler = Scheduler(tiny_lm, max_batch=4, prefill_chunk=64)
    others = [(tiny_lm.encode(f"decoding user {i}"), greedy(30)) for i in range(2)]
    long = (tiny_lm.encode("a long prompt " * 100)[:300], greedy(5))
    arrivals: dict[int, list[float]] = {0: [], 1: []}
    outs: dict[int, list] = {}

    def other(i: int) -> None:
        outs[i] = []
        for step in scheduler.stream(*others[i]):
            outs[i].append(step)
            arrivals[i].append(time.perf_counter())

    threads = [threading.Thread(target=other, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    while min(len(arrivals[0]), len(arrivals[1])) < 2:
        time.sleep(0.001)
    sent = time.perf_counter()
    long_steps = []
    for step in scheduler.stream(*long):
        long_steps.append(step)
        if len(long_steps) == 1:
            first = time.perf_counter()
    for t in threads:
        t.join()
    chunks = -(-300 // 64)  # 5 chunk ticks: the others get a token in each of the first four at least
    for i in range(2):
        assert sum(sent < a <= first for a in arrivals[i]) >= chunks - 1
        assert_same_steps(outs[i], list(decode.stream(tiny_lm, *others[i])), f"other {i}")
    assert_same_steps(long_steps, list(decode.stream(tiny_lm, *long)), "long")
    fed = [t.prefill_tokens for t in scheduler.serving.snapshot().ticks if t.prefilling or t.prefill_tokens]
    assert max(fed) <= 64 and sum(fed) >= 300 - 64  # chunk by chunk (the last one may join with no row decoding)


def test_without_chunking_a_long_prompt_is_one_forward(tiny_lm):
    scheduler = Scheduler(tiny_lm, max_batch=4, prefill_chunk=0)
    long = tiny_lm.encode("a long prompt " * 100)[:300]
    run_concurrently(scheduler, [(tiny_lm.encode("short"), greedy(6)), (long, greedy(3))])
    ticks = scheduler.serving.snapshot().ticks
    assert ticks[0].prefill_tokens == 300 + len(tiny_lm.encode("short")) and all(t.prefilling == 0 for t in ticks)


def test_prefill_chunk_limits(tiny_lm, monkeypatch):
    monkeypatch.setenv("DP_PREFILL_CHUNK", "32")
    assert Scheduler(tiny_lm).prefill_chunk == 32
    monkeypatch.setenv("DP_PREFILL_CHUNK", "-1")
    with pytest.raises(ValueError, match="DP_PREFILL_CHUNK"):
        Scheduler(tiny_lm)
    with pytest.raises(ValueError, match="prefill_chunk"):
        Scheduler(tiny_lm, prefill_chunk=-3)


# --- a shared prompt prefix fed once -----------------------------------------------------------------
def test_shared_prefix_by_hand():
    assert shared_prefix([[1] * 20 + [2], [1] * 20 + [3, 4]]) == 20
    assert shared_prefix([[1] * 20, [1] * 20 + [3]]) == 19  # each row keeps a position of its own
    assert shared_prefix([[1] * 10 + [2], [1] * 10 + [3]]) == 0  # below MIN_SHARED_PREFIX
    assert shared_prefix([[1] * 30]) == 0


def test_shared_prefix_prefill_equals_solo_and_feeds_the_prefix_once(tiny_lm):
    base = tiny_lm.encode("the lesson everyone reads first " * 6)
    prompts = [base + tiny_lm.encode(f" question {i}" * (i + 1)) for i in range(4)]
    jobs = [(p, greedy(8)) for p in prompts] + [(prompts[1], DecodingConfig(strategy="sample", seed=7, max_new_tokens=8))]
    scheduler = Scheduler(tiny_lm, max_batch=8)
    results, _ = run_concurrently(scheduler, jobs)
    for (ids, config), steps in zip(jobs, results):
        assert_same_steps(steps, list(decode.stream(tiny_lm, ids, config)), str(len(ids)))
    shared = shared_prefix(prompts)
    assert shared >= len(base) - 1
    fed = sum(t.prefill_tokens for t in scheduler.serving.snapshot().ticks)
    saved = sum(t.prefill_saved for t in scheduler.serving.snapshot().ticks)
    assert fed == shared + sum(len(p) - shared for p in prompts)  # the repeated prompt is not fed again either
    assert fed + saved == sum(len(ids) for ids, _ in jobs)


def test_shared_prefix_can_be_switched_off(tiny_lm):
    prompts = [tiny_lm.encode("the lesson everyone reads first " * 6 + f" question {i}") for i in range(3)]
    scheduler = Scheduler(tiny_lm, max_batch=8, share_prefix=False)
    run_concurrently(scheduler, [(p, greedy(3)) for p in prompts])
    assert sum(t.prefill_tokens for t in scheduler.serving.snapshot().ticks) == sum(len(p) for p in prompts)


def test_padding_after_a_shared_prefix_keeps_positions(tiny_lm):
    """Rows whose rests differ in length are padded between the prefix and the rest: the cache's
    mask keeps each real position's number, so the logits equal an unpadded forward's."""
    base = tiny_lm.encode("shared words " * 12)
    rows = [base + [5, 6, 7], base + [9]]
    kv = KVCache(tiny_lm.model)
    scheduler = Scheduler(tiny_lm)
    logits, fed = scheduler._feed(kv, rows)
    assert fed == len(base) + 4
    for b, row in enumerate(rows):
        alone = KVCache(tiny_lm.model).sync(row)[0]
        assert (logits[b] - alone).abs().max() < 1e-4
