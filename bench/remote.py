"""Tokens/s of a llama.cpp server through engine.backends vs the local engine, in one process,
interleaved (bench.common), greedy, on the embedded model: the server serves the Q4_1 GGUF, the
local engine its float32 conversion. Every run goes through engine.runner (one entry point).

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

Without --url it starts the cached llama-server (deploy/llama_server.sh builds it the first time,
about 15 min on 2 cores) on a free 127.0.0.1 port and stops it at the end.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager, nullcontext
from typing import Callable, Iterator

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import interleaved, report  # noqa: E402
from engine.backends import llamacpp, openai  # noqa: E402
from engine import runner
from engine.runner import RunRequest
from engine.config import DecodingConfig  # noqa: E402
from engine.backends.local import ModelSpec, gguf_path, load_model  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


@contextmanager
def started_server(threads: int) -> Iterator[str]:
    """The cached llama-server over the embedded GGUF on a free loopback port; yields its URL."""
    binary = subprocess.run(["sh", os.path.join(ROOT, "deploy", "llama_server.sh"), sys.executable],
                            check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([binary, "-m", str(gguf_path()), "--host", "127.0.0.1", "--port", str(port),
                               "-c", "2048", "-t", str(threads), "-np", "1"],
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="llama-server threads (-t)")
    parser.add_argument("--url", default="", help="an already running llama-server")
    args = parser.parse_args()
    config = DecodingConfig(strategy="greedy", max_new_tokens=args.tokens)
    lm = load_model(ModelSpec())
    with (nullcontext(args.url) if args.url else started_server(args.threads)) as url:
        native = llamacpp.connect(url, timeout_s=120)
        through_v1 = openai.connect_openai(url + "/v1", timeout_s=120)
        fast, beams = native.with_mode("fast"), config.replace(strategy="beam", num_beams=2)
        spec = config.replace(strategy="speculative", drafter="ngram", temperature=0.0)
        def tokens(model, config: DecodingConfig, name: str) -> Callable[[], int]:
            """A run's token count (a beam search's steps), refused when it stopped early: a rate over
            a token or two would time the requests' overhead, not decoding."""
            def run() -> int:
                trace = runner.run(RunRequest(model, PROMPT, config, chat=True))  # an instruction to an instruct model
                n = len(trace.beam.steps) if trace.beam is not None else len(trace.steps)
                if n < args.tokens // 2:
                    raise SystemExit(f"bench.remote: {name} made {n} of {args.tokens} tokens ({trace.stop_reason})")
                return n
            return run

        runs = {name: tokens(model, cfg, name) for name, model, cfg in (
            ("llama.cpp step mode (1 request/token)", native, config),
            ("OpenAI /v1 step mode (1 request/token)", through_v1, config),
            ("llama.cpp fast mode (streamed; final + raw: 2 requests)", fast, config),
            ("llama.cpp speculative, n-gram drafts (our rounds)", native, spec),
            ("llama.cpp beam search, 2 beams (steps/s)", native, beams),
            ("local engine (float32, transformers)", lm, config),
        )}
        rates = interleaved(runs, repeats=args.repeats)
    local = "local engine (float32, transformers)"
    for name in (n for n in rates if n != local):
        report(f"greedy, {args.tokens} tokens: {name} vs the local engine", {name: rates[name], local: rates[local]},
               baseline=local)


if __name__ == "__main__":
    main()
