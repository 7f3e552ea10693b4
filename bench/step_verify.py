"""Step mode verifying the server's continuation (issue #38) vs one request per token vs fast mode,
against a real llama-server (and vLLM with --vllm-url), in one process: 1 user (interleaved
repeats, bench.common) and N users at once (aggregate tokens/s), greedy and sampling (T 0.8,
top-k 50, top-p 0.9, seeded). Every verified run's tokens are checked equal to the
one-request-per-token run's (the bench stops saying which differ); its acceptance is printed.
Beside tokens/s, the CPU milliseconds per token of this process (the app's side: requests, our
chain, traces) and of the server's processes (the one listening on its port and its children):
on a shared, loaded machine CPU time per token is the steadier measure of what each mode costs.

    python -m bench.step_verify [--tokens 32] [--repeats 3] [--users 16] [--verify 8]
                                [--url http://127.0.0.1:8080] [--vllm-url http://127.0.0.1:8000]

Without --url it starts the cached llama-server with 16 slots (-np 16: the N users' requests are
batched, as vLLM batches them) on a free loopback port and stops it at the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from contextlib import nullcontext
from dataclasses import replace

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.concurrency import prompt_for  # noqa: E402
from bench.remote import started_server  # noqa: E402
from deploy import vllm_serve  # noqa: E402
from engine.strategies import served_decode
from engine import runner  # noqa: E402
from engine.backends import llamacpp, remote, served  # noqa: E402
from engine.config import DecodingConfig  # noqa: E402
from engine.runner import RunRequest  # noqa: E402


def configs(tokens: int) -> dict[str, DecodingConfig]:
    return {"greedy": DecodingConfig(strategy="greedy", max_new_tokens=tokens),
            "sampling T0.8 k50 p0.9": DecodingConfig(strategy="sample", temperature=0.8, top_k=50, top_p=0.9, seed=7,
                                                     max_new_tokens=tokens)}


def variants(model: served.RemoteModel, verify: int) -> dict[str, served.RemoteModel]:
    return {"step, 1 request/token": replace(model.with_mode("step"), verify=0),
            f"step, verified (k <= {verify})": replace(model.with_mode("step"), verify=verify),
            "fast (server samples)": model.with_mode("fast")}


def one_run(model, config: DecodingConfig, prompt: str) -> tuple[int, list[int], dict]:
    trace = runner.run(RunRequest(model, prompt, config))
    return len(trace.steps), trace.generated_token_ids, (trace.extra.get("remote") or {}).get("verified") or {}


def check_equal(models: dict, config: DecodingConfig, users: int) -> float:
    """Verified == one request per token on each user's prompt; the verified runs' acceptance."""
    step, verified = list(models.values())[:2]
    accepted = steps = 0
    for u in range(users):
        _, want, _ = one_run(step, config, prompt_for(u))
        _, got, label = one_run(verified, config, prompt_for(u))
        if got != want:
            raise SystemExit(f"bench.step_verify: user {u}: verified {got} != one request per token {want}")
        accepted, steps = accepted + label["accepted"], steps + label["steps"]
    return accepted / max(1, steps)


def server_processes(url: str) -> list[psutil.Process]:
    """The process listening on ``url``'s port and its children (vLLM: engine core, worker)."""
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    pids = {c.pid for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == port
            and c.status == psutil.CONN_LISTEN and c.pid}
    found = [psutil.Process(pid) for pid in pids]
    return found + [child for p in found for child in p.children(recursive=True)]


def cpu_s(processes: list[psutil.Process]) -> float:
    """User + system CPU seconds of ``processes``, those still alive (a child that ended: its time is
    gone from the sum)."""
    total = 0.0
    for p in processes:
        try:
            times = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


class Costs:
    """Wall time and CPU time (this process; the server's) around a block; ``per_token(n)``."""

    def __init__(self, server: list[psutil.Process]):
        self.server = server

    def __enter__(self):
        self.wall, self.app, self.srv = time.perf_counter(), time.process_time(), cpu_s(self.server)
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.wall
        self.app, self.srv = time.process_time() - self.app, cpu_s(self.server) - self.srv

    def per_token(self, tokens: int) -> tuple[float, float, float]:
        """(tokens/s, app CPU ms/token, server CPU ms/token)."""
        return tokens / self.wall, 1000 * self.app / tokens, 1000 * self.srv / tokens


def aggregate(model, config: DecodingConfig, users: int) -> int:
    """``users`` threads at once, each its own prompt: the tokens they made."""
    tokens = [0] * users
    line = threading.Barrier(users + 1)

    def user(u: int) -> None:
        line.wait()
        tokens[u] = one_run(model, config, prompt_for(u))[0]

    threads = [threading.Thread(target=user, args=(u,)) for u in range(users)]
    for t in threads:
        t.start()
    line.wait()
    for t in threads:
        t.join()
    return sum(tokens)


def measured(models: dict, config: DecodingConfig, users: int, repeats: int, server: list) -> dict[str, list]:
    """Per mode, ``repeats`` rounds interleaved (one round: each mode in turn, ``users`` at once):
    [(tokens/s, app CPU ms/token, server CPU ms/token)] each."""
    out: dict[str, list] = {name: [] for name in models}
    aggregate(next(iter(models.values())), config, 1)  # warm-up
    for _ in range(repeats):
        for name, model in models.items():
            with Costs(server) as costs:
                tokens = aggregate(model, config, users)
            out[name].append(costs.per_token(tokens))
    return out


def bench_server(label: str, model: served.RemoteModel, server: list, args) -> None:
    models = variants(model, args.verify)
    fast = "fast (server samples)"
    for cname, config in configs(args.tokens).items():
        acceptance = check_equal(models, config, min(args.users, 4))
        print(f"\n{label}, {cname}, {args.tokens} tokens; verified tokens equal 1-request/token on "
              f"{min(args.users, 4)} prompts; acceptance {acceptance:.2f}; "
              f"medians of {args.repeats} interleaved rounds",
              flush=True)
        print(f"{'users':>5} {'run':<30} {'tok/s':>7} {'x fast':>7} {'app CPU ms/tok':>15} {'server CPU ms/tok':>18}")
        for users in (1, args.users):
            rows = measured(models, config, users, args.repeats, server)
            med = {n: [statistics.median(v[i] for v in rows[n]) for i in range(3)] for n in rows}
            for name, (rate, app, srv) in med.items():
                print(f"{users:>5} {name:<30} {rate:>7.2f} {rate / med[fast][0]:>7.2f} {app:>15.1f} {srv:>18.1f}",
                      flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--verify", type=int, default=served_decode.VERIFY_TOKENS)
    parser.add_argument("--threads", type=int, default=2, help="llama-server threads (-t)")
    parser.add_argument("--url", default="", help="an already running llama-server")
    parser.add_argument("--vllm-url", default="", help="an already running vLLM (make vllm)")
    parser.add_argument("--no-llama", action="store_true", help="only the vLLM at --vllm-url")
    args = parser.parse_args()
    if not args.no_llama:
        with nullcontext(args.url) if args.url else started_server(args.threads, slots=16) as url:
            bench_server("llama-server", llamacpp.connect(url, timeout_s=300), server_processes(url), args)
    if args.vllm_url:
        spec = served.RemoteSpec.parse(vllm_serve.remote_spec(args.vllm_url))
        bench_server("vLLM", remote.connect_spec(spec, timeout_s=300), server_processes(args.vllm_url), args)


if __name__ == "__main__":
    main()
