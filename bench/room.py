"""The room as the load: N simulated browsers through the real app, and what the Serving view says
about the same run (issues #41 and #38).

    python -m bench.room [--users 16] [--tokens 32] [--app http://127.0.0.1:7860]

Each user is a gradio_client session of the app (``--app``, loopback only; without it the app is
started in this process on a free 127.0.0.1 port, startup examples off), opened before the clock
(``bench.concurrency.app_clients``: opening the page is not pressing Generate). All press Generate
at once: ``/step_trace``, sampling, their own seed and prompt, ``--tokens`` tokens. Bounded: at most
MAX_USERS users and MAX_TOKENS tokens each, and the whole run within ``--deadline`` seconds.

Printed: the load average, the run's UTC window, aggregate tokens/s (client wall clock), and from the
traces the users received the time to first token and per output token (p50 / p95, nearest rank, the
definitions the scheduler's records use: the first step's ``elapsed_ms``; (last - first) / (steps - 1)),
then what ``/serving_stats`` says over the same window: the Serving view's numbers, which it shows in
the same words (tests/test_serving_browser.py compares the page with this printout). The two TTFT/TPOT
lines agree when nothing else ran in the window.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.concurrency import app_clients, prompt_for  # noqa: E402
from engine.reports.serving import BLOCK_SIZE, percentile, utc  # noqa: E402

MAX_USERS = 64
MAX_TOKENS = 256
DEADLINE_S = 600.0


@dataclass
class RoomRun:
    """One load run: its window (``time.time()``), the client's wall clock and every user's trace."""

    url: str
    users: int
    tokens: int
    started: float
    ended: float
    wall_s: float
    traces: list[dict]
    load: float | None

    def ttft_ms(self) -> list[float]:
        """Each user's time to first token: its first step's elapsed_ms (the trace's timing.ttft_ms)."""
        return [t["steps"][0]["elapsed_ms"] for t in self.traces if t["steps"]]

    def tpot_ms(self) -> list[float]:
        """Each user's time per output token after the first, from its steps' elapsed_ms."""
        return [(t["steps"][-1]["elapsed_ms"] - t["steps"][0]["elapsed_ms"]) / (len(t["steps"]) - 1)
                for t in self.traces if len(t["steps"]) > 1]


def check_args(url: str, users: int, tokens: int) -> None:
    """One line naming the argument when the run would leave its bounds."""
    host = urllib.parse.urlsplit(url).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise SystemExit(f"--app: expected an app on this machine (127.0.0.1, ::1 or localhost), got {url[:200]!r}")
    if not 1 <= users <= MAX_USERS:
        raise SystemExit(f"--users: expected 1 to {MAX_USERS}, got {users}")
    if not 1 <= tokens <= MAX_TOKENS:
        raise SystemExit(f"--tokens: expected 1 to {MAX_TOKENS}, got {tokens}")


def room_run(url: str, users: int, tokens: int, clients: list | None = None, deadline_s: float = DEADLINE_S) -> RoomRun:
    """``users`` sessions of the app at ``url`` send /step_trace at once; their traces (a user
    still waiting after ``deadline_s`` fails the run)."""
    check_args(url, users, tokens)
    clients = clients or app_clients(url, users)
    traces: list = [None] * users
    barrier = threading.Barrier(users + 1)
    deadline = time.monotonic() + deadline_s

    def user(i: int) -> None:
        barrier.wait()
        try:
            config = {"strategy": "sample", "seed": 1000 + i, "max_new_tokens": tokens}
            job = clients[i].submit(prompt_for(i), config, "", False, "embedded", "none", api_name="/step_trace")
            traces[i] = job.result(timeout=max(1.0, deadline - time.monotonic()))
        except BaseException as exc:  # noqa: BLE001 (reported below)
            traces[i] = exc

    threads = [threading.Thread(target=user, args=(i,), daemon=True) for i in range(users)]
    for t in threads:
        t.start()
    started, clock = time.time(), time.perf_counter()
    barrier.wait()
    for t in threads:
        t.join()
    wall, ended = time.perf_counter() - clock, time.time()
    errors = [t for t in traces if isinstance(t, BaseException)]
    if errors:
        raise RuntimeError(f"{len(errors)} of {users} users failed; first: {errors[0]!r}")
    return RoomRun(url, users, tokens, started, ended, wall, traces, os.getloadavg()[0])


def spread_text(values: list[float]) -> str:
    """``X ms / Y ms`` (p50 / p95), as the Serving view's cards show them."""
    return f"{percentile(values, 50):,.0f} ms / {percentile(values, 95):,.0f} ms"


def printout(run: RoomRun, stats: dict | None) -> str:
    """The run's lines, then the scheduler's over the same window (``/serving_stats``)."""
    tokens = sum(len(t["generated_token_ids"]) for t in run.traces)
    lines = [f"room load: {run.users} users x {run.tokens} tokens (/step_trace, sampling) on {run.url}",
             f"window {utc(run.started).removesuffix(' UTC')}–{utc(run.ended)}, load average {run.load:.1f} on {os.cpu_count()} cores",
             f"aggregate: {tokens} tokens in {run.wall_s:.1f} s = {tokens / run.wall_s:.1f} tokens/s (client wall clock)",
             f"traces:    time to first token p50 / p95 {spread_text(run.ttft_ms())}; "
             f"time per output token p50 / p95 {spread_text(run.tpot_ms())} ({len(run.traces)} runs)"]
    if stats and stats.get("available"):
        lines += scheduler_lines(stats)
    return "\n".join(lines)


def scheduler_lines(stats: dict) -> list[str]:
    """/serving_stats in the Serving view's words."""
    peak = stats["peak"] or {}
    ttft, tpot = stats["ttft_ms"], stats["tpot_ms"]
    return [f"scheduler: {stats['ticks']} ticks, {stats['runs']} runs ended, rows per tick mean {stats['mean_rows']:.1f} "
            f"/ max {stats['max_rows']}, most waiting {stats['max_queued']}, decode {stats['tokens_per_s']:.1f} "
            "tokens/s while busy",
            f"scheduler: time to first token p50 / p95 {ttft['p50']:,.0f} ms / {ttft['p95']:,.0f} ms; "
            f"time per output token p50 / p95 {tpot['p50']:,.0f} ms / {tpot['p95']:,.0f} ms",
            f"KV positions at the fullest tick: {peak.get('rows')} rows holding {peak.get('used'):,} tokens; left-padded "
            f"batch {peak.get('padded'):,}, paged (block {BLOCK_SIZE}) {peak.get('paged'):,}, contiguous reservation "
            f"{peak.get('reserved'):,}"]


def serving_stats(url: str, run: RoomRun) -> dict:
    """/serving_stats over the run's window (from its start to now)."""
    from gradio_client import Client

    window = time.time() - run.started  # every record of the run is at or after its start
    return Client(url, verbose=False, ssl_verify=not url.startswith("http://")).predict(
        "embedded", "none", window, False, api_name="/serving_stats")


def start_app() -> str:
    """The app on a free 127.0.0.1 port in this process (startup examples off); its URL."""
    import socket

    os.environ["DP_EXAMPLES"] = "0"
    from engine.backends.registry import ModelRegistry
    from playground.app import build_app, launch_kwargs

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    demo = build_app(ModelRegistry())
    demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=port, quiet=True, **launch_kwargs())
    return demo.local_url.rstrip("/")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--users", type=int, default=16)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--app", default="", help="URL of a running app on this machine (default: start one here)")
    p.add_argument("--deadline", type=float, default=DEADLINE_S, help="seconds the whole run may take")
    args = p.parse_args()
    url = args.app.rstrip("/") or start_app()
    check_args(url, args.users, args.tokens)
    clients = app_clients(url, args.users)
    room_run(url, 1, 4, clients[:1], args.deadline)  # warm-up: the app loads its model on first use
    run = room_run(url, args.users, args.tokens, clients, args.deadline)
    print(printout(run, serving_stats(url, run)))


if __name__ == "__main__":
    main()
