"""A served vLLM seen through its Prometheus ``/metrics`` (issue #41): the same quantities the
Serving view shows for our scheduler (requests running and waiting, KV cache use, time to first
token, inter-token latency, tokens per engine step) plus its prefix cache (queries and hits, in
tokens) and preemptions.

Only servers the operator lists (``DP_REMOTE_MODELS``, ``openai:`` entries: ``operator_servers``)
are read, never an address from a page; each through ``MetricsClient``, the bounded JSON client of
engine.backends.client reading text (its timeout, no redirects where the client refuses them,
and at most ``MAX_METRICS_BYTES`` read: the client stops reading there), at most once per
``MIN_INTERVAL_S`` per server however many pages look (``MetricsWatch``). What a server answers is
untrusted: the text is parsed line by line with a bound on lines, every value must be a number in
``[0, MAX_VALUE]`` (``+Inf`` only as a bucket's bound; every quantity here is a count, a time or a
fraction: none is negative), a histogram has at most ``MAX_BUCKETS`` buckets whose cumulative counts
never decrease, and a server without vLLM's metrics is named as such; each is one MetricsError line.

What is kept of a read is a ``VllmSample``: the gauges, counters, histograms (bounds and counts) and
the three cache settings the view draws, never the page; at most ``SAMPLE_BOUND_BYTES`` each, whatever
the page held, so a watch's ``SAMPLES_KEPT`` samples hold at most ``WATCH_BOUND_BYTES``
(tests/remote/test_hostile_servers.py measures them).

Counters and histograms are cumulative since the server started, so the view shows differences
between two samples: a prefix-cache hit rate over the window is Δhits / Δqueries, and percentiles
come from the histograms' bucket differences, interpolated inside a bucket as Prometheus'
``histogram_quantile`` does (so they are estimates to a bucket's width: the view says so).
"""

from __future__ import annotations

import collections
import math
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from engine.backends.client import JsonClient, RemoteError
from engine.backends.served import allowed_remote_models

MAX_METRICS_BYTES = 2 << 20  # vLLM 0.32's page is ~55 KB with one model
MAX_LINES = 20_000
MAX_BUCKETS = 64  # one histogram's distinct bounds (vLLM 0.32's have 14-23)
MAX_VALUE = 1e18  # a count no server reaches (1e18 tokens at 1e9 a second: 30 years); sums of 20,000 stay finite
CONFIG_KEYS = ("block_size", "enable_prefix_caching", "num_gpu_blocks")  # vllm:cache_config_info's labels shown
MAX_CONFIG_CHARS = 64  # each of them, as kept
SAMPLE_BOUND_BYTES = 24 << 10  # what one VllmSample may hold (MAX_BUCKETS in each of the four histograms)
MIN_INTERVAL_S = 1.0
SAMPLES_KEPT = 900  # 15 minutes at one sample a second
WATCH_BOUND_BYTES = SAMPLES_KEPT * SAMPLE_BOUND_BYTES  # 21.1 MiB a listed server, at most
DEFAULT_TIMEOUT_S = 3.0
SOURCE_VLLM = "measured: vLLM's /metrics"
_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+-?\d+)?$")
# a label's value: runs of plain characters and escapes, possessive (a 2 MiB value is one match, never backtracked)
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]++|\\.)*+)"\s*(,|$)')


class MetricsError(RemoteError):
    """A server's /metrics is unreachable, too large, malformed, or not vLLM's (one line)."""


def parse_labels(text: str, where: str) -> dict[str, str]:
    labels, at = {}, 0
    while at < len(text):
        match = _LABEL.match(text, at)
        if match is None:
            raise MetricsError(f"{where}: a label set is malformed: {text[at:at + 60]!r}")
        labels[match.group(1)] = match.group(2).replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")
        at = match.end()
    return labels


def parse_prometheus(text: str, where: str = "metrics") -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text format: ``{name: [(labels, value), ...]}``; comments skipped. MetricsError
    (one line) for a malformed line or more than MAX_LINES lines."""
    lines = text.splitlines()
    if len(lines) > MAX_LINES:
        raise MetricsError(f"{where}: {len(lines):,} lines, over the {MAX_LINES:,}-line limit")
    series: dict[str, list[tuple[dict[str, str], float]]] = collections.defaultdict(list)
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line)
        if match is None:
            raise MetricsError(f"{where}: line {number} is not a Prometheus sample: {line[:80]!r}")
        try:
            value = float(match.group(4))
        except ValueError:
            raise MetricsError(f"{where}: line {number}: {match.group(4)[:40]!r} is not a number") from None
        series[match.group(1)].append((parse_labels(match.group(3) or "", where), value))
    return dict(series)


# --- what a sample holds -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Histogram:
    """A cumulative histogram: upper bounds (the last +Inf) with their cumulative counts, summed
    over every label set (engines, models)."""

    bounds: tuple[float, ...]
    counts: tuple[float, ...]
    total: float  # _sum
    count: float  # _count

    def minus(self, earlier: "Histogram | None") -> "Histogram":
        """What was observed between ``earlier`` and this (a restarted server: this alone). Any
        bucket, the count or the sum lower than before means a restart: cumulative numbers only grow,
        and a difference is never negative."""
        if earlier is None or earlier.bounds != self.bounds or earlier.count > self.count \
                or earlier.total > self.total or any(b > a for a, b in zip(self.counts, earlier.counts)):
            return self
        return Histogram(self.bounds, tuple(a - b for a, b in zip(self.counts, earlier.counts)),
                         self.total - earlier.total, self.count - earlier.count)

    def quantile(self, q: float) -> float | None:
        """Prometheus' histogram_quantile: the bucket holding rank q × count, linearly inside it
        (None when empty; the last finite bound when the rank falls in +Inf)."""
        if not self.count:
            return None
        rank, lower, below = q * self.count, 0.0, 0.0
        for bound, cumulative in zip(self.bounds, self.counts):
            if cumulative >= rank:
                if math.isinf(bound):
                    return lower
                inside = cumulative - below
                return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
            lower, below = bound, cumulative
        return lower

    def mean(self) -> float | None:
        return self.total / self.count if self.count else None


GAUGES = {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
          "kv_usage": "vllm:kv_cache_usage_perc"}
COUNTERS = {"prefix_queries": "vllm:prefix_cache_queries_total", "prefix_hits": "vllm:prefix_cache_hits_total",
            "preemptions": "vllm:num_preemptions_total", "prompt_tokens": "vllm:prompt_tokens_total",
            "generation_tokens": "vllm:generation_tokens_total", "requests": "vllm:request_success_total"}
HISTOGRAMS = {"ttft": "vllm:time_to_first_token_seconds", "itl": "vllm:inter_token_latency_seconds",
              "iteration_tokens": "vllm:iteration_tokens_total", "prefill": "vllm:request_prefill_time_seconds"}


@dataclass(frozen=True, slots=True)
class VllmSample:
    """One read of a vLLM server's /metrics: the numbers the view draws (at most
    SAMPLE_BOUND_BYTES, whatever the page held)."""

    server: str
    at: float  # wall clock (time.time())
    running: float
    waiting: float
    kv_usage: float  # the fraction of KV blocks in use, 0..1 (vLLM's name says "perc")
    prefix_queries: float  # prompt tokens looked up in the prefix cache, since start
    prefix_hits: float  # of which found
    preemptions: float
    prompt_tokens: float
    generation_tokens: float
    requests: float
    histograms: dict[str, Histogram] = field(default_factory=dict)
    config: dict[str, str] = field(default_factory=dict)  # CONFIG_KEYS of vllm:cache_config_info's labels


def _one_value(series: dict, name: str, where: str, *, fraction: bool = False) -> float:
    """The sum over label sets of a gauge or counter; each in [0, MAX_VALUE] (a fraction: at most 1)."""
    if name not in series:
        raise MetricsError(f"{where}: no {name} (is this vLLM's /metrics?)")
    total = 0.0
    for _, value in series[name]:
        if not 0 <= value <= (1 if fraction else MAX_VALUE):  # (NaN too)
            raise MetricsError(f"{where}: {name} = {value!r} is out of range")
        total += value
    return min(total, 1.0) if fraction else total


def _histogram(series: dict, name: str, where: str) -> Histogram | None:
    """A histogram summed over label sets; MetricsError (one line) for a bound that is not a time or a
    count (negative, NaN: every histogram here measures seconds or tokens), a count out of range, more
    than MAX_BUCKETS bounds, or cumulative counts that decrease or do not end at +Inf."""
    buckets: dict[float, float] = collections.defaultdict(float)
    for labels, value in series.get(name + "_bucket", []):
        le = labels.get("le", "")
        try:
            bound = float(le)
        except ValueError:
            raise MetricsError(f"{where}: {name}_bucket has a bad le={le[:40]!r}") from None
        if not (0 <= bound <= MAX_VALUE or bound == math.inf) or not 0 <= value <= MAX_VALUE:
            raise MetricsError(f"{where}: {name}_bucket le={le[:40]!r} = {value!r} is out of range")
        buckets[bound] += value
        if len(buckets) > MAX_BUCKETS:
            raise MetricsError(f"{where}: {name} has more than {MAX_BUCKETS} buckets")
    if not buckets:
        return None
    bounds = tuple(sorted(buckets))
    counts = tuple(buckets[b] for b in bounds)
    if any(b < a for a, b in zip(counts, counts[1:])) or not math.isinf(bounds[-1]):
        raise MetricsError(f"{where}: {name}'s buckets are not cumulative up to +Inf")
    return Histogram(bounds, counts, _one_value(series, name + "_sum", where), _one_value(series, name + "_count", where))


def read_sample(server: str, text: str, at: float | None = None) -> VllmSample:
    """A VllmSample of /metrics ``text``; MetricsError naming ``server`` and what is wrong."""
    where = f"vLLM {server}/metrics"
    series = parse_prometheus(text, where)
    values = {key: _one_value(series, name, where, fraction=key == "kv_usage") for key, name in GAUGES.items()}
    values |= {key: _one_value(series, name, where) for key, name in COUNTERS.items()}
    histograms = {key: h for key, name in HISTOGRAMS.items() if (h := _histogram(series, name, where)) is not None}
    labels = series.get("vllm:cache_config_info", [({}, 0.0)])[0][0]
    config = {key: labels[key][:MAX_CONFIG_CHARS] for key in CONFIG_KEYS if key in labels}
    return VllmSample(server=server, at=time.time() if at is None else at, histograms=histograms, config=config,
                      **values)


# --- the poll ------------------------------------------------------------------------------------------
def metrics_url(api_url: str) -> str:
    """The server root of an OpenAI-compatible API URL (``http://host:8000/v1`` -> ``http://host:8000``)."""
    url = api_url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def operator_servers(environ: Any = None) -> tuple[str, ...]:
    """The server roots of the operator's ``openai:`` models (DP_REMOTE_MODELS), in their order."""
    return tuple(dict.fromkeys(metrics_url(spec.url) for spec in allowed_remote_models(environ)
                               if spec.backend == "openai"))


class MetricsClient(JsonClient):
    """engine.backends.client's JsonClient (its timeout and error lines) reading a text answer of
    at most MAX_METRICS_BYTES instead of JSON: its reads stop at that limit (+ 1 byte)."""

    max_body_bytes = MAX_METRICS_BYTES

    def _parse(self, text: bytes, where: str) -> Any:
        return text.decode("utf-8", "replace")


class MetricsWatch:
    """Samples of one listed server's /metrics: at most one request per ``min_interval_s``
    whoever asks (a room of phones on the Serving view costs the server one read a second), the
    last ``keep`` kept for the view's window. Thread-safe."""

    def __init__(self, server: str, timeout_s: float = DEFAULT_TIMEOUT_S, min_interval_s: float = MIN_INTERVAL_S,
                 keep: int = SAMPLES_KEPT):
        self.server = server
        self.client = MetricsClient(server, timeout_s=timeout_s, server="vLLM")
        self.min_interval_s = min_interval_s
        self._lock = threading.Lock()
        self._samples: collections.deque[VllmSample] = collections.deque(maxlen=keep)
        self._last_try = -math.inf

    def sample(self, fresh: bool = False) -> VllmSample:
        """The newest sample, read now unless one was read (or tried) within ``min_interval_s``
        (``fresh``: wait out the interval and read: a demonstration's before and after).
        MetricsError / RemoteError (one line) when the read fails."""
        with self._lock:
            wait = self.min_interval_s - (time.monotonic() - self._last_try)
            if fresh and wait > 0:
                time.sleep(wait)
            elif wait > 0 and self._samples:
                return self._samples[-1]
            self._last_try = time.monotonic()
            sample = read_sample(self.server, self.client.get("/metrics"))
            self._samples.append(sample)
            return sample

    def history(self, window_s: float | None = None) -> list[VllmSample]:
        """The samples of the last ``window_s`` seconds (None: all kept), oldest first."""
        since = time.time() - window_s if window_s is not None else -math.inf
        with self._lock:
            return [s for s in self._samples if s.at >= since]


class MetricsWatches:
    """One MetricsWatch per listed server (created on first use); a server the operator does not
    list is refused with one line naming the argument."""

    def __init__(self, servers: tuple[str, ...] | None = None):
        self.servers = operator_servers() if servers is None else servers
        self._lock = threading.Lock()
        self._watches: dict[str, MetricsWatch] = {}

    def get(self, server: Any) -> MetricsWatch:
        if not isinstance(server, str) or server not in self.servers:
            shown = server[:80] if isinstance(server, str) else type(server).__name__
            listed = ", ".join(self.servers) or "none (DP_REMOTE_MODELS has no openai: server)"
            raise ValueError(f"server: {shown!r} is not a vLLM server the operator lists; listed: {listed}")
        with self._lock:
            return self._watches.setdefault(server, MetricsWatch(server))


# --- the window's figures -----------------------------------------------------------------------------
@dataclass
class VllmWindow:
    """Two samples' difference: what the server did between ``since`` and ``until``."""

    server: str
    since: float
    until: float
    running: float  # now
    waiting: float
    kv_usage: float
    prefix_queries: float  # in the window (tokens)
    prefix_hits: float
    hit_rate: float | None
    preemptions: float
    generation_tokens: float
    tokens_per_s: float | None
    ttft_s: dict[str, float | None]  # p50, p95, mean: bucket estimates
    itl_s: dict[str, float | None]
    iteration_tokens: dict[str, float | None]
    largest_step: list[float | None] | None  # [low, high]: the bucket of the window's biggest engine step (tokens); high None: +Inf
    config: dict[str, str]


def _quantiles(histogram: Histogram | None) -> dict[str, float | None]:
    if histogram is None:
        return {"count": 0, "p50": None, "p95": None, "mean": None}
    return {"count": histogram.count, "p50": histogram.quantile(0.5), "p95": histogram.quantile(0.95),
            "mean": histogram.mean()}


def largest_bucket(histogram: Histogram | None) -> list[float | None] | None:
    """[low, high] of the bucket holding the histogram's largest observation (high None for +Inf)."""
    if histogram is None or not histogram.count:
        return None
    for i, cumulative in enumerate(histogram.counts):
        if cumulative >= histogram.count:
            high = histogram.bounds[i]
            return [histogram.bounds[i - 1] if i else 0.0, None if math.isinf(high) else high]
    return None


def window(first: VllmSample | None, last: VllmSample) -> VllmWindow:
    """What happened between ``first`` (None or a restarted server: since the server started) and ``last``."""
    if first is not None and any(getattr(first, key) > getattr(last, key) for key in COUNTERS):
        first = None  # a counter went back: the server restarted in between
    delta = {key: getattr(last, key) - (getattr(first, key) if first else 0.0)
             for key in ("prefix_queries", "prefix_hits", "preemptions", "generation_tokens")}
    hist = {key: h.minus(first.histograms.get(key) if first else None) for key, h in last.histograms.items()}
    span = last.at - first.at if first is not None else 0.0
    return VllmWindow(
        server=last.server, since=first.at if first else 0.0, until=last.at, running=last.running, waiting=last.waiting,
        kv_usage=last.kv_usage,
        hit_rate=min(1.0, delta["prefix_hits"] / delta["prefix_queries"]) if delta["prefix_queries"] else None,
        tokens_per_s=delta["generation_tokens"] / span if span > 0 else None, ttft_s=_quantiles(hist.get("ttft")),
        itl_s=_quantiles(hist.get("itl")), iteration_tokens=_quantiles(hist.get("iteration_tokens")),
        largest_step=largest_bucket(hist.get("iteration_tokens")),
        config={k: last.config[k] for k in ("block_size", "enable_prefix_caching", "num_gpu_blocks") if k in last.config},
        **delta)
