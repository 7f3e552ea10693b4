"""What one step-mode request costs a vLLM server (issue #38), by block size: N users at once, each
growing its own sequence through /v1/completions with ``tokens`` per request (1: step mode's one
request per token; 8: a verified continuation's; a whole run in one request: fast mode), greedy,
top-100 log-probabilities as step mode asks. Printed per row: aggregate tokens/s, the server's CPU
milliseconds per token (the API server, engine and worker processes) and vLLM's prefix-cache hit rate
over the row (its /metrics); then the ratio of the CPU cost at ``--block-size 32`` (what `make vllm`
serves on a CPU) to vLLM's CPU default (128), per row.

    python -m bench.vllm_requests [--users 16] [--tokens 32] [--block-sizes 128,32]

Each block size is its own vLLM server (started with deploy/vllm_serve.py's flags, about a minute),
one after the other, on free loopback ports; the numbers of one run come from one process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import urllib.request

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.concurrency import prompt_for  # noqa: E402
from bench.step_verify import cpu_s  # noqa: E402
from deploy import vllm_serve  # noqa: E402
from engine.reports.vllm_metrics import VllmSample, read_sample  # noqa: E402

TOP_N = 100  # engine.backends.served.STEP_TOP_N


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as answer:
        return json.loads(answer.read())


def metrics(url: str) -> VllmSample:
    """vLLM's /metrics, read and checked as the Serving view reads them."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=60) as answer:
        return read_sample(url, answer.read().decode())


def tokenize(url: str, text: str) -> list[int]:
    request = urllib.request.Request(f"{url}/tokenize", data=json.dumps({"model": vllm_serve.SERVED_NAME,
                                                                        "prompt": text}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.loads(answer.read())["tokens"]


def row(url: str, prompts: list[list[int]], tokens: int, per_request: int) -> dict:
    """One thread per prompt, each growing it by ``tokens`` new tokens, ``per_request`` at a time."""
    users = len(prompts)
    processes = psutil.Process().children(recursive=True)
    made = [0] * users

    def user(index: int) -> None:
        ids = list(prompts[index])
        while made[index] < tokens:
            answer = post(url, {"model": vllm_serve.SERVED_NAME, "prompt": ids, "temperature": 0,
                                "max_tokens": min(per_request, tokens - made[index]), "logprobs": TOP_N,
                                "return_tokens_as_token_ids": True, "return_token_ids": True, "ignore_eos": True})
            got = answer["choices"][0].get("token_ids") or []
            if not got:
                return
            ids += got
            made[index] += len(got)

    before = metrics(url)
    cpu0, start = cpu_s(processes), time.perf_counter()
    threads = [threading.Thread(target=user, args=(i,)) for i in range(users)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall, cpu = time.perf_counter() - start, cpu_s(processes) - cpu0
    after = metrics(url)
    hits, queries = after.prefix_hits - before.prefix_hits, after.prefix_queries - before.prefix_queries
    total = sum(made)
    return {"per_request": per_request, "tokens": total, "tok_s": total / wall, "cpu_ms": 1000 * cpu / total,
            "hit_rate": hits / queries if queries > 0 else None}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--block-sizes", default="128,32", help="comma-separated; the first is the baseline")
    args = parser.parse_args(argv)
    sizes = [int(size) for size in args.block_sizes.split(",")]
    python = vllm_serve.install()
    shapes = [(1, "step mode: one request per token"), (8, "verified: 8 tokens per request"),
              (args.tokens, "fast mode: the whole run in one request")]
    results: dict[int, list[dict]] = {}
    for size in sizes:
        with vllm_serve.serving(python, ("--block-size", str(size))) as url:
            post(url, {"model": vllm_serve.SERVED_NAME, "prompt": "Hello", "max_tokens": 2})  # warm up
            served = metrics(url).config.get("block_size")
            if served != str(size):  # the server's own word for the block size it runs
                raise SystemExit(f"bench.vllm_requests: asked --block-size {size}, vLLM reports {served!r}")
            prompts = [tokenize(url, prompt_for(user)) for user in range(args.users)]  # once per server
            results[size] = [row(url, prompts, args.tokens, per) for per, _ in shapes]
    print(f"\nvLLM {vllm_serve.SERVED_NAME}, {args.users} users at once, {args.tokens} tokens each, greedy, "
          f"top-{TOP_N} logprobs")
    print(f"{'block':>5}  {'requests':<42} {'tok/s':>7} {'server CPU ms/token':>20} {'prefix hits':>12}")
    for size in sizes:
        for (per, label), r in zip(shapes, results[size]):
            rate = "–" if r["hit_rate"] is None else f"{100 * r['hit_rate']:.1f}%"
            print(f"{size:>5}  {label:<42} {r['tok_s']:>7.1f} {r['cpu_ms']:>20.1f} {rate:>12}")
    base = sizes[0]
    for size in sizes[1:]:
        for (per, label), ours, theirs in zip(shapes, results[size], results[base]):
            print(f"ratio server CPU per token, block {size} / block {base}, {label}: "
                  f"{ours['cpu_ms'] / theirs['cpu_ms']:.3f}")


if __name__ == "__main__":
    main()
