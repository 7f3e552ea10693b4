"""Issue #50, a hostile tester's listed servers: numbers a llama-server or an OpenAI-compatible server
may send that no model makes (log-probabilities past ``exp``'s range, positive, flat below any 1/V),
a vLLM /metrics page built to be held 900 times or read past its limit, histogram buckets that make
latencies negative, and a stream of keep-alive comments that never ends. Each as the tester found it,
through the real code path (a RemoteModel connected to a fake server on loopback, run by
engine.runner; /metrics through MetricsWatch): one line naming the field and the value, or a
correct reading, never a traceback; memory and bytes read within the documented bounds."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import random
import re
import sys
import time
import tracemalloc
import types
from typing import Callable, Iterator

import pytest

from engine import runner
from engine.backends import client, remote
from engine.backends.client import RemoteError, strict_loads
from engine.backends.served import RemoteSpec
from engine.config import DecodingConfig
from engine.control import RunControl, RunStopped
from engine.reports import vllm_metrics
from engine.reports.vllm_metrics import MetricsError, MetricsWatch
from engine.runner import RunRequest
from tests.helpers.fault_servers import TOP_IDS, FakeServer, Fault

CONFIG = DecodingConfig(strategy="greedy", max_new_tokens=8, top_n=5)
SERVER_NAME = {"llamacpp": "llama.cpp server", "openai": "OpenAI-compatible server"}
ALL_MODES = ("step", "step-per-token", "fast")  # step mode's streamed continuation, its one-token answers, fast


@pytest.fixture(params=("llamacpp", "openai"))
def server(request) -> Iterator[FakeServer]:
    fake = FakeServer(request.param)
    yield fake
    fake.close()


def model_on(server: FakeServer, mode: str, timeout_s: float = 10.0):
    """A RemoteModel over the fake server (``mode`` as tests/remote/test_fault_servers.py's ``model_on``)."""
    model = remote.connect_spec(RemoteSpec.parse(server.spec), timeout_s, "step" if mode == "step-per-token" else mode)
    return dataclasses.replace(model, verify=0) if mode == "step-per-token" else model


def run(model, control=None):
    return runner.run(RunRequest(model, "hi", CONFIG, control=control))


def one_line(call) -> str:
    """The one RemoteError line ``call()`` raises (anything else, a traceback's kind, fails the test)."""
    with pytest.raises(RemoteError) as caught:
        call()
    line = str(caught.value)
    assert "\n" not in line and len(line) < 400 and "Traceback" not in line, line
    return line


# --- 1. numbers past exp's range ------------------------------------------------------------------------
def probability_slot(backend: str, mode: str) -> bool:
    """Whether a value fault's "logprob" slot holds a probability there: llama-server's fast-mode stream
    sends its top-N after the sampler as probabilities (``post_sampling_probs``)."""
    return (backend, mode) == ("llamacpp", "fast")


def test_the_testers_flat_answer_below_exp_s_range_at_connect_is_one_line(server):
    """As found: every top log-probability -710 (all equal, below -709.78, where exp(-lp) overflows):
    connecting (which asks one top-N to see it is not flat) raised ``OverflowError: math range error``
    building its own error line. Now the top-N is refused where it is read, naming the field."""
    server.fault = Fault("value", "flat", "-710")
    line = one_line(lambda: model_on(server, "step"))
    path = "/completion" if server.backend == "llamacpp" else "/v1/completions"
    field = "completion_probabilities[0].top_logprobs" if server.backend == "llamacpp" else \
        "choices[0].logprobs.top_logprobs[0]"
    assert line == (f"{SERVER_NAME[server.backend]} {server.root}{path}: {field}: its most likely token has "
                    "log-probability -710, below log 2^-24 = -16.64: no distribution over a vocabulary is that flat")


@pytest.mark.parametrize("mode", ALL_MODES)
def test_a_flat_answer_below_exp_s_range_mid_run_is_one_line(server, mode):
    """The same answer from a server that answered well at connect, in every mode (llama-server's fast
    stream sends probabilities: 1e-309 each, whose logarithm is -711.5)."""
    model = model_on(server, mode)
    server.fault = Fault("value", "flat", "1e-309" if probability_slot(server.backend, mode) else "-710")
    line = one_line(lambda: run(model))
    assert line.startswith(f"{SERVER_NAME[server.backend]} {server.url}"), line
    assert re.search(r": (stream\[0\]\.)?(completion_probabilities|choices)\S*: its most likely token has "
                     r"log-probability -71[01]\.?\d*, below log 2\^-24", line), line


# (slot, raw JSON text, what the line says where the slot holds a log-probability, and where a probability)
HOSTILE_NUMBERS = [
    ("logprob", "-1e308", r"expected a log-probability of at least -10000 .*got -1e\+308",
     r"expected a probability in \[0, 1\], got -1e\+308"),
    ("logprob", "0.5", r"expected a log-probability \(a finite number <= 0\), got 0\.5", None),
    ("logprob", "3.5", r"expected a log-probability \(a finite number <= 0\), got 3\.5",
     r"expected a probability in \[0, 1\], got 3\.5"),
    ("logprob", "1e309", "the answer is not JSON", "the answer is not JSON"),
    ("logprob", "-1e309", "the answer is not JSON", "the answer is not JSON"),
    ("flat", "-1e308", r"expected a log-probability of at least -10000 .*got -1e\+308",
     r"expected a probability in \[0, 1\], got -1e\+308"),
]


def hostile_cases() -> list:
    """(backend, mode, slot, raw, what the line says) for every case where the number is wrong there."""
    cases = []
    for backend in SERVER_NAME:
        for mode in ALL_MODES:
            for at, raw, as_logprob, as_prob in HOSTILE_NUMBERS:
                says = as_prob if probability_slot(backend, mode) else as_logprob
                if says is not None:  # (a probability of 0.5 is a good one)
                    cases.append(pytest.param(backend, mode, at, raw, says, id=f"{backend}-{mode}-{at}={raw}"))
    return cases


@pytest.mark.parametrize("backend, mode, at, raw, says", hostile_cases())
def test_a_number_out_of_range_is_one_line_naming_the_field_and_the_value(backend, mode, at, raw, says):
    server = FakeServer(backend)
    try:
        model = model_on(server, mode)
        server.fault = Fault("value", at, raw)
        line = one_line(lambda: run(model))
    finally:
        server.close()
    assert line.startswith(f"{SERVER_NAME[backend]} {server.url}") and re.search(says, line), line
    if "not JSON" not in says:  # a value JSON can read: the line names its field
        assert re.search(r": (stream\[0\]\.)?(completion_probabilities|choices)\S*: ", line), line


def test_a_null_for_the_chosen_token_s_log_probability_is_one_line_on_an_openai_server():
    """-inf where the API has none: an OpenAI-compatible server's ``token_logprobs`` (llama-server's
    null is its probability 0 only in its own top-N)."""
    server = FakeServer("openai")
    try:
        for mode in ALL_MODES:
            model = model_on(server, mode)
            server.fault = Fault("value", "prob", "null")
            line = one_line(lambda: run(model))
            server.fault = None
            assert re.search(r"choices\[0\]\.logprobs\.token_logprobs\[0\]: expected a log-probability \(a finite "
                             r"number <= 0\), got None", line), (mode, line)
    finally:
        server.close()


@pytest.mark.parametrize("mode", ALL_MODES)
def test_one_log_probability_below_exp_s_range_is_a_probability_0(server, mode):
    """-710 for one token (1e-309 where the slot is a probability) is a good number: its probability is
    0 to a float (1e-309: a subnormal one). Step mode's greedy then picks the next token of the top-N
    (the fake's first is the one made 0); fast mode keeps the server's token, its top-N showing 0 for
    it; the trace is strict."""
    model = model_on(server, mode)
    slot_is_prob = probability_slot(server.backend, mode)
    # llama-server's fast mode also asks the raw top-N in a whole request: the fault is its stream's only
    server.fault = Fault("value", "logprob", "1e-309" if slot_is_prob else "-710",
                         only="stream" if slot_is_prob else "")
    trace = run(model)
    text = trace.to_json()
    assert "Infinity" not in text and "NaN" not in text
    strict_loads(text)
    if mode == "fast":  # the faulted answer is one token and the stream's end
        assert trace.generated_token_ids == [TOP_IDS[0]]
        shown = {t.token_id: t.prob for t in trace.steps[0].stages[-1].top}
        assert shown[TOP_IDS[0]] < 1e-300 and shown[TOP_IDS[1]] == pytest.approx(0.25)
    else:
        assert trace.generated_token_ids == [TOP_IDS[1]] * 8
        assert all(step.chosen_prob > 0 for step in trace.steps)


# --- 2. a vLLM's /metrics: what a watch holds, what it reads ---------------------------------------------
def metrics_page(step: int = 0, buckets: int = vllm_metrics.MAX_BUCKETS, pad_to: int = 0, histogram: str = "",
                 counts: Callable[[int], float] | None = None, setting_chars: int = 200_000) -> bytes:
    """A page vLLM's names fill as a hostile server may, still valid: every gauge and counter (growing with
    ``step``), each histogram with ``buckets`` bounds (different at each step, so no two samples share
    them) and cumulative counts (``counts(i)``: bucket i's, for ``histogram`` only), cache settings of
    ``setting_chars`` characters each, then other series up to ``pad_to`` bytes (under the 2 MiB limit)."""
    lines = [f"{name} {1 + step}" for name in (*vllm_metrics.GAUGES.values(), *vllm_metrics.COUNTERS.values())
             if name != "vllm:kv_cache_usage_perc"] + ["vllm:kv_cache_usage_perc 0.5"]
    for key, name in vllm_metrics.HISTOGRAMS.items():
        count = (counts if key == histogram and counts else (lambda i: float(i + step)))
        lines += [f'{name}_bucket{{engine="0",le="{0.001 * (i + 1) + step * 1e-9!r}"}} {count(i)!r}'
                  for i in range(buckets - 1)]
        last = count(buckets - 1)
        lines += [f'{name}_bucket{{engine="0",le="+Inf"}} {last!r}', f"{name}_count {last!r}",
                  f"{name}_sum {1.5 + step}"]
    settings = ",".join(f'{key}="{"9" * setting_chars}"' for key in vllm_metrics.CONFIG_KEYS)
    lines.append(f'vllm:cache_config_info{{{settings},engine="0"}} 1.0')
    page = ("\n".join(lines) + "\n").encode()
    other = b'vllm:other_total{engine="0",note="' + b"x" * 1000 + b'"} 1\n'
    return page + other * max(0, (pad_to - len(page)) // len(other))


def held_bytes(fill: Callable[[], None]) -> int:
    """The memory ``fill()`` leaves allocated (tracemalloc: what it made and still holds)."""
    gc.collect()
    tracemalloc.start()
    try:
        fill()
        gc.collect()
        return tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()


@pytest.fixture
def metrics_server() -> Iterator[FakeServer]:
    fake = FakeServer("openai")
    yield fake
    fake.close()


def test_a_near_limit_page_keeps_only_the_numbers_the_view_draws(metrics_server):
    """As found, a sample held the parsed page (1.9 MB each; 900 kept: 1.7 GB a server). A page of
    2 MiB less 1 KiB, every histogram at MAX_BUCKETS and 600 KB of cache settings: what a read keeps
    is at most SAMPLE_BOUND_BYTES, measured over 8 reads through the watch."""
    step = itertools.count()
    metrics_server.metrics = lambda: metrics_page(next(step), pad_to=vllm_metrics.MAX_METRICS_BYTES - 1024)
    assert vllm_metrics.MAX_METRICS_BYTES - 2048 < len(metrics_page(pad_to=vllm_metrics.MAX_METRICS_BYTES - 1024)) \
        <= vllm_metrics.MAX_METRICS_BYTES
    watch = MetricsWatch(metrics_server.root, min_interval_s=0.0)
    watch.sample()  # a first read makes what every read shares (the client's modules' caches), not measured
    reads = 8
    held = held_bytes(lambda: [watch.sample() for _ in range(reads)])
    samples = watch.history()
    assert len(samples) == reads + 1 and all(len(s.histograms) == 4 for s in samples)
    assert all(len(h.bounds) == vllm_metrics.MAX_BUCKETS for s in samples for h in s.histograms.values())
    assert samples[-1].config == dict.fromkeys(vllm_metrics.CONFIG_KEYS, "9" * vllm_metrics.MAX_CONFIG_CHARS)
    print(f"a near-limit page: {held / reads / 1024:.1f} KiB kept a read")
    assert held / reads <= vllm_metrics.SAMPLE_BOUND_BYTES


def kept_bytes(records: list) -> int:
    """The bytes of ``records`` and of every object they hold (each counted once; types and modules,
    which they only name, not counted): what keeping them costs."""
    seen: set[int] = set()
    todo, total = list(records), 0
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType, types.FunctionType)):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        todo.extend(gc.get_referents(obj))
    return total


@pytest.mark.slow  # SAMPLES_KEPT + 30 reads: ~10 s
def test_a_watch_holds_at_most_its_bound_however_many_reads(metrics_server):
    """SAMPLES_KEPT + 30 reads of the largest sample a page can make: the watch keeps SAMPLES_KEPT of
    them, in at most WATCH_BOUND_BYTES (docs/deployment.md's limits table). Measured as the bytes of
    the kept samples (tracemalloc over 930 reads costs a minute here; the test above measures a read
    with it)."""
    step = itertools.count()
    metrics_server.metrics = lambda: metrics_page(next(step), setting_chars=100)  # kept: their first 64
    watch = MetricsWatch(metrics_server.root, min_interval_s=0.0)
    for _ in range(vllm_metrics.SAMPLES_KEPT + 30):
        watch.sample()
    samples = watch.history()
    assert len(samples) == vllm_metrics.SAMPLES_KEPT and len({id(s) for s in samples}) == vllm_metrics.SAMPLES_KEPT
    held = kept_bytes(samples)
    print(f"{vllm_metrics.SAMPLES_KEPT} samples held: {held / 2**20:.1f} MiB "
          f"(bound {vllm_metrics.WATCH_BOUND_BYTES / 2**20:.1f} MiB)")
    assert held <= vllm_metrics.WATCH_BOUND_BYTES


def test_the_testers_page_of_20000_buckets_is_one_line(metrics_server):
    """The tester's page: one histogram of 20,000 buckets (19,900 here: the page's other lines and
    these within the 20,000-line limit; 1.3 MB) is refused, and nothing of it is kept."""
    page = metrics_page(buckets=8) + "".join(f'{TTFT}_bucket{{engine="1",le="{1000 + i}"}} {i}\n'
                                             for i in range(19_900)).encode()
    assert 1 << 20 < len(page) < vllm_metrics.MAX_METRICS_BYTES
    metrics_server.metrics = lambda: page
    watch = MetricsWatch(metrics_server.root, min_interval_s=0.0)
    with pytest.raises(MetricsError) as caught:
        watch.sample()
    assert str(caught.value) == (f"vLLM {metrics_server.root}/metrics: vllm:time_to_first_token_seconds has more "
                                 f"than {vllm_metrics.MAX_BUCKETS} buckets")
    assert watch.history() == []


@pytest.mark.parametrize("declared", [False, True], ids=["no-length", "content-length"])
def test_a_page_over_the_limit_is_read_no_further_than_the_limit(metrics_server, monkeypatch, declared):
    """As found, the client read 32 MiB (a JSON answer's limit) before the /metrics reader looked at the
    2 MiB one. A 200 MB page is now read to the 2 MiB limit (+ the client's last chunk) and no further:
    the bytes the client took from its socket, counted; the server's own count (what it could put in
    the sockets' buffers besides) far from 32 MiB. A declared length over the limit is not read at all."""
    got = []
    readinto = client.DeadlineReader.readinto

    def counted(self, buffer):
        got.append(readinto(self, buffer))
        return got[-1]

    monkeypatch.setattr(client.DeadlineReader, "readinto", counted)
    metrics_server.fault = Fault("declared_body" if declared else "huge_body", paths=("/metrics",))
    with pytest.raises(RemoteError) as caught:
        MetricsWatch(metrics_server.root).sample()
    assert str(caught.value).endswith("is over the 2 MiB limit") and "\n" not in str(caught.value)
    read = sum(got)
    time.sleep(0.3)  # the server's writes fail once the closed connection's buffers are full
    print(f"read {read:,} bytes; the server sent {metrics_server.sent:,}")
    assert read <= (64 << 10 if declared else vllm_metrics.MAX_METRICS_BYTES + (64 << 10))  # + headers, a chunk
    assert metrics_server.sent < 12 << 20  # the sockets' buffers hold a few MiB; 32 MiB was read before


def two_samples(first: bytes, last: bytes) -> tuple:
    return vllm_metrics.read_sample("s", first.decode(), 10.0), vllm_metrics.read_sample("s", last.decode(), 20.0)


TTFT = vllm_metrics.HISTOGRAMS["ttft"]


@pytest.mark.parametrize("bucket, says", [
    (f'{TTFT}_bucket{{le="-3200000"}} 1', "le='-3200000' = 1.0 is out of range"),  # the tester's p50 of -1.6e6 s
    (f'{TTFT}_bucket{{le="-Inf"}} 1', "le='-Inf' = 1.0 is out of range"),
    (f'{TTFT}_bucket{{le="1e300"}} 1', "le='1e300' = 1.0 is out of range"),
    (f'{TTFT}_bucket{{le="0.5"}} -2', "le='0.5' = -2.0 is out of range"),
    (f'{TTFT}_bucket{{le="0.5"}} 1e300', "le='0.5' = 1e+300 is out of range"),
    (f'{TTFT}_bucket{{le="0.0005"}} 1000', "buckets are not cumulative up to +Inf"),  # more below than above
])
def test_a_hostile_bucket_is_one_line(bucket, says):
    page = metrics_page(buckets=8).decode().replace(f"{TTFT}_sum", f"{bucket}\n{TTFT}_sum", 1)
    with pytest.raises(MetricsError) as caught:
        vllm_metrics.read_sample("http://h:1", page)
    assert str(caught.value) == f"vLLM http://h:1/metrics: {TTFT}_bucket {says}" or \
        str(caught.value) == f"vLLM http://h:1/metrics: {TTFT}'s {says}", str(caught.value)


def test_percentiles_and_means_are_never_negative_whatever_two_samples_hold():
    """Pairs of pages whose histograms pass every check, drawn at random (seeded): buckets that went
    down between the two reads, a sum that went down, counters that went back; each window's
    percentiles lie in [0, the largest finite bound], its means are >= 0, its hit rate in [0, 1]."""
    rng = random.Random(50)
    for _ in range(300):
        pages = []
        for _ in range(2):
            steps = [rng.choice((0.0, 0.0, 1.0, 7.0, 1e6)) for _ in range(8)]
            pages.append(metrics_page(rng.randrange(3), buckets=8, histogram="ttft", setting_chars=10,
                                      counts=lambda i, s=steps: float(sum(s[:i + 1]))))
        w = vllm_metrics.window(*two_samples(*pages))
        for stats in (w.ttft_s, w.itl_s, w.iteration_tokens):
            assert all(v is None or 0 <= v <= 0.008 + 1e-6 for k, v in stats.items() if k.startswith("p")), stats
            assert stats["mean"] is None or stats["mean"] >= 0, stats
        assert w.hit_rate is None or 0 <= w.hit_rate <= 1
        assert w.tokens_per_s is None or w.tokens_per_s >= 0


def test_buckets_that_went_down_read_as_a_restart():
    """A bucket lower than at the read before (with the count higher) is a restarted server (or a
    hostile one): the window is the later read alone, never a negative difference."""
    first, last = two_samples(metrics_page(0, buckets=4, histogram="ttft", counts=lambda i: [9.0, 9.0, 9.0, 9.0][i]),
                              metrics_page(0, buckets=4, histogram="ttft", counts=lambda i: [0.0, 1.0, 9.0, 12.0][i]))
    assert last.histograms["ttft"].minus(first.histograms["ttft"]) is last.histograms["ttft"]
    ttft = vllm_metrics.window(first, last).ttft_s  # ranks 6 and 11.4 of 12: in (0.002, 0.003] and +Inf
    assert ttft["count"] == 12 and ttft["p50"] == pytest.approx(0.002 + 0.001 * 5 / 8) and ttft["p95"] == 0.003


# --- 3. one deadline per request, whatever the server sends ------------------------------------------------
STREAMED = ("step", "fast")  # step mode's continuation and fast mode's generation are streams


@pytest.mark.parametrize("mode", STREAMED)
def test_keep_alive_comments_forever_end_at_the_request_s_timeout(server, mode):
    """As found: a server that answers a stream with ``: ping`` comments only, forever (one each
    PING_S). A comment is no event: the stream ends when its first event is due (the request's 1 s
    timeout here), with one line."""
    model = model_on(server, mode, timeout_s=1.0)
    server.fault = Fault("pings")
    start = time.perf_counter()
    line = one_line(lambda: run(model))
    took = time.perf_counter() - start
    assert line.startswith(f"{SERVER_NAME[server.backend]} {server.url}") and \
        line.endswith("no answer within the 1 s timeout"), line
    assert 0.9 < took < 3.0, took  # the deadline's own property (a 2 s margin for a loaded machine)


@pytest.mark.parametrize("mode", STREAMED)
def test_keep_alive_comments_forever_end_at_the_run_s_time_limit(server, mode):
    """The same server under a run's time limit shorter than the request's timeout (the app's
    DP_REQUEST_SECONDS): the run's one line, at its limit."""
    model = model_on(server, mode, timeout_s=30.0)
    server.fault = Fault("pings")
    start = time.perf_counter()
    with pytest.raises(RunStopped) as caught:
        run(model, RunControl(deadline_s=1.5))
    took = time.perf_counter() - start
    assert str(caught.value) == ("stopped: the run went past the 1.5 s time limit (DP_REQUEST_SECONDS); "
                                 "ask for fewer tokens")
    assert 1.4 < took < 3.5, took


@pytest.mark.parametrize("mode", STREAMED)
def test_events_without_a_token_forever_end_at_the_stream_s_deadline(server, mode):
    """Events that carry no token (an empty ``choices``, an empty ``completion_probabilities``), one
    each PING_S, forever: each is an event, so the stream is never quiet for its timeout, and
    before, each moved its deadline on (a run without a time limit read them until the line
    limit). The stream's own deadline, fixed at its start, ends it: 2 s here."""
    model = model_on(server, mode, timeout_s=1.0)
    model.api.client.stream_s = 2.0
    server.fault = Fault("empty")
    start = time.perf_counter()
    line = one_line(lambda: run(model))
    took = time.perf_counter() - start
    assert line.startswith(f"{SERVER_NAME[server.backend]} {server.url}") and \
        line.endswith("the stream did not end within its 2 s limit"), line
    assert 1.9 < took < 4.0, took
