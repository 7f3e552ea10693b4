"""Step mode verifying the server's continuation (issue #38) vs one request per token vs fast mode,
against a real llama-server (and vLLM with --vllm-url), in one process: 1 user (interleaved
repeats, bench.common) and N users at once (aggregate tokens/s), greedy and sampling (T 0.8,
top-k 50, top-p 0.9, seeded). Every verified run's tokens are checked equal to the
one-request-per-token run's (the bench stops saying which differ); its acceptance is printed.

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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import interleaved  # noqa: E402
from bench.concurrency import prompt_for  # noqa: E402
from bench.remote import started_server  # noqa: E402
from deploy import vllm_serve  # noqa: E402
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


def aggregate(model, config: DecodingConfig, users: int) -> float:
    """``users`` threads at once, each its own prompt: aggregate tokens/s."""
    tokens = [0] * users
    line = threading.Barrier(users + 1)

    def user(u: int) -> None:
        line.wait()
        tokens[u] = one_run(model, config, prompt_for(u))[0]

    threads = [threading.Thread(target=user, args=(u,)) for u in range(users)]
    for t in threads:
        t.start()
    line.wait()
    began = time.perf_counter()
    for t in threads:
        t.join()
    return sum(tokens) / (time.perf_counter() - began)


def bench_server(label: str, model: served.RemoteModel, args) -> None:
    models = variants(model, args.verify)
    for cname, config in configs(args.tokens).items():
        acceptance = check_equal(models, config, min(args.users, 4))
        rates = interleaved({n: (lambda m=m: one_run(m, config, prompt_for(0))[0]) for n, m in models.items()},
                            repeats=args.repeats)
        together = {n: aggregate(m, config, args.users) for n, m in models.items()}
        fast = "fast (server samples)"
        print(f"\n{label}, {cname}, {args.tokens} tokens; verified tokens equal 1-request/token on "
              f"{min(args.users, 4)} prompts; acceptance {acceptance:.2f}")
        print(f"{'run':<32} {'1 user tok/s':>13} {'x fast':>7} {f'{args.users} users tok/s':>16} {'x fast':>7}")
        one_fast, many_fast = statistics.median(rates[fast]), together[fast]
        for name in models:
            one = statistics.median(rates[name])
            print(f"{name:<32} {one:>13.2f} {one / one_fast:>7.2f} {together[name]:>16.2f} "
                  f"{together[name] / many_fast:>7.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--verify", type=int, default=remote.VERIFY_TOKENS)
    parser.add_argument("--threads", type=int, default=2, help="llama-server threads (-t)")
    parser.add_argument("--url", default="", help="an already running llama-server")
    parser.add_argument("--vllm-url", default="", help="an already running vLLM (make vllm)")
    args = parser.parse_args()
    with nullcontext(args.url) if args.url else started_server(args.threads, slots=16) as url:
        bench_server("llama-server", llamacpp.connect(url, timeout_s=300), args)
    if args.vllm_url:
        spec = served.RemoteSpec.parse(vllm_serve.remote_spec(args.vllm_url))
        bench_server("vLLM", remote.connect_spec(spec, timeout_s=300), args)


if __name__ == "__main__":
    main()
