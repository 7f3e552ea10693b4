"""What serving costs and shows, on the embedded model (issue #41); the room's load itself is
``bench.room``.

    python -m bench.serving --overhead [--users 16]
    python -m bench.serving --demos [--vllm http://127.0.0.1:8000] [--vllm-chunked http://127.0.0.1:8001]

``--overhead``: what the flight recorder costs a tick (building and appending one ``Tick`` of 16
rows, µs) against the median tick of a 16-user run in the same process, as a ratio; and the same
16-user run's tokens/s with the recorder on and off (interleaved, three rounds each).

``--demos``: the four demonstrations on the embedded model, printed as the Serving view words them,
and with ``--vllm`` the prefix-sharing and chunked-prefill demonstrations on that vLLM
(``--vllm-chunked``: a second vLLM started with ``--max-num-batched-tokens 128``, so both settings are
measured).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.concurrency import prompt_for  # noqa: E402


# --- the recorder's cost ------------------------------------------------------------------------------
def record_cost_us(rows: int = 16, repeats: int = 20_000) -> float:
    """µs to build one Tick of ``rows`` rows (their lengths read as the scheduler reads them) and append it."""
    import torch

    from engine.reports.serving import ServingStats, Tick

    ids = [torch.zeros(1, 40 + i, dtype=torch.long) for i in range(rows)]
    stats = ServingStats(bytes_per_position=1)
    start = time.perf_counter()
    for _ in range(repeats):
        lengths = tuple(t.shape[1] for t in ids)
        stats.add_tick(Tick(time.time(), rows, 0, 0, 60, lengths, rows * 80, 0, 0, 1.0, 2.0, 3.0))
    return (time.perf_counter() - start) / repeats * 1e6


def overhead(users: int = 16, tokens: int = 24, rounds: int = 3) -> str:
    from engine.backends.local import ModelSpec, load_model
    from engine.config import DecodingConfig
    from engine.reports.serving import ServingStats
    from engine.scheduler import Scheduler

    lm = load_model(ModelSpec())
    jobs = [(lm.encode(prompt_for(i)), DecodingConfig(strategy="sample", seed=i, max_new_tokens=tokens)) for i in range(users)]
    rates: dict[str, list[float]] = {"recorder on": [], "recorder off": []}
    ticks_ms: list[float] = []
    for _ in range(rounds):
        for name in rates:
            scheduler = Scheduler(lm, max_batch=users)
            if name == "recorder off":
                scheduler.serving = _Off()
            start = time.perf_counter()
            done = _consume_all(scheduler, jobs)
            rates[name].append(done / (time.perf_counter() - start))
            if isinstance(scheduler.serving, ServingStats):
                ticks_ms += [t.ms for t in scheduler.serving.snapshot().ticks]
    cost = record_cost_us(users)
    tick = statistics.median(ticks_ms)
    on, off = statistics.median(rates["recorder on"]), statistics.median(rates["recorder off"])
    return (f"recorder: {cost:.1f} µs per tick of {users} rows vs a median tick of {tick:.1f} ms: {cost / 1000 / tick:.5f} of a tick\n"
            f"{users} users x {tokens} tokens: recorder on {on:.1f} tokens/s, off {off:.1f} tokens/s, ratio on/off "
            f"{on / off:.3f} (medians of {rounds} interleaved rounds; load average {os.getloadavg()[0]:.1f})")


class _Off:
    """A recorder that records nothing (the baseline of ``overhead``)."""

    def add_tick(self, tick) -> None:
        pass

    def add_run(self, run) -> None:
        pass


def _consume_all(scheduler, jobs) -> int:
    counts = [0] * len(jobs)

    def go(i: int) -> None:
        for _ in scheduler.stream(*jobs[i]):
            counts[i] += 1

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts)


# --- the demonstrations ---------------------------------------------------------------------------------
def demos(vllm: str, vllm_chunked: str) -> str:
    from engine.backends.local import ModelSpec, load_model
    from engine.control import RunControl
    from engine.reports import serving_demos as d
    from engine.reports.vllm_metrics import MetricsWatch
    from playground.charts import serving as charts

    lm, lines = load_model(ModelSpec()), []
    for name in ("batching", "paged", "prefix", "chunked"):
        result = getattr(d, f"{name}_demo")(lm, RunControl())
        lines.append(_text(getattr(charts, f"{name}_html")(result)))
    for url in filter(None, (vllm, vllm_chunked)):
        watch = MetricsWatch(url)
        lines.append(_text(charts.vllm_prefix_html(d.vllm_prefix_demo(watch, RunControl()))))
        lines.append(_text(charts.vllm_chunked_html(d.vllm_chunked_demo(watch, RunControl()))))
    return "\n".join(lines)


def _text(html_text: str) -> str:
    import html
    import re

    return html.unescape(re.sub(r"<br>", " · ", re.sub(r"<(?!br)[^>]+>", "", html_text)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--users", type=int, default=16)
    p.add_argument("--overhead", action="store_true")
    p.add_argument("--demos", action="store_true")
    p.add_argument("--vllm", default="", help="a vLLM server's root URL (its demonstrations)")
    p.add_argument("--vllm-chunked", default="", help="a second vLLM, started with --max-num-batched-tokens 128")
    args = p.parse_args()
    if args.overhead:
        print(overhead(args.users))
    if args.demos or not args.overhead:
        print(demos(args.vllm, args.vllm_chunked))


if __name__ == "__main__":
    main()
