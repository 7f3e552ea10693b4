"""Speculative decoding served (issue #53, "Served"): vLLM's ngram and EAGLE-3 methods (EAGLE-3: our head as
engine.strategies.eagle_export converts it) and llama-server's ngram drafting, each against the same server
without speculation, beside our own EAGLE and ngram drafter on the same prompts.

    .venv/bin/python -m bench.served_speculative [--tokens 128] [--k 4] [--repeats 2] [--only vllm,llama,ours]

Chat prompts: bench/medusa.py's (held out from the heads' training); greedy, ``--tokens`` new tokens (fewer
where the model stops). One server at a time, started here (vLLM: deploy/vllm_serve.py, about a minute each;
llama-server: bench.remote.started_server). Per server and method, summed over the prompts:

- tokens per target forward: n / (n - accepted) (the prefill's token and each verifying forward's bonus
  token count once); vLLM's counters (``/metrics``: ``vllm:spec_decode_num_accepted_tokens_total``...),
  llama-server's ``timings.draft_n_accepted``; ours from the trace (``tokens_per_target_forward``).
- per draft: 1 + accepted / drafts (vLLM's "mean acceptance length"; a step without a draft is not one);
- tok/s: completion tokens over the request's wall time, median of ``--repeats`` after a warm-up, and
  its ratio to the same server without speculation;
- same: the greedy text equals the server's own without speculation (ours: the token ids of target-only).

A method the server refuses prints its one-line error instead. Exit 1 if any greedy output differs. With ours
and vLLM in one run, the last line sets our EAGLE's tok/s against vLLM's plain stream (issue 53's goal: >= 1.2x).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.medusa import PROMPTS  # noqa: E402
from deploy import vllm_serve  # noqa: E402
from engine.backends.client import JsonClient, RemoteError  # noqa: E402

LOGS = Path("/tmp")
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


@dataclass
class Row:
    """One method on one server, summed over the prompts."""

    server: str
    method: str
    tokens: int = 0
    accepted: int = 0
    drafts: int = 0
    rates: list[float] = field(default_factory=list)  # tok/s, one per prompt (median of the repeats)
    texts: list[Any] = field(default_factory=list)  # per prompt: the greedy output
    refused: str = ""

    @property
    def per_forward(self) -> float:
        return self.tokens / max(1, self.tokens - self.accepted)

    @property
    def per_draft(self) -> float:
        return 1 + self.accepted / self.drafts if self.drafts else float("nan")

    @property
    def rate(self) -> float:
        return statistics.fmean(self.rates) if self.rates else float("nan")


def vllm_counters(url: str) -> dict[str, float]:
    """The speculative counters of vLLM's ``/metrics`` (absent, as without speculation: zeros)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as answer:
        text = answer.read().decode()
    found = {}
    for name in COUNTERS:
        match = re.search(rf"^vllm:spec_decode_{name}_total{{[^}}]*}} (\S+)$", text, re.M)
        found[name] = float(match.group(1)) if match else 0.0
    return found


def chat(url: str, prompt: str, tokens: int) -> tuple[dict[str, Any], float]:
    """One greedy chat completion (either server's OpenAI API) and its wall time in seconds."""
    body = {"model": vllm_serve.SERVED_NAME, "messages": [{"role": "user", "content": prompt}],
            "temperature": 0, "max_tokens": tokens}
    t0 = time.perf_counter()
    answer = JsonClient(url, timeout_s=600, server="bench").post("/v1/chat/completions", body)
    return answer, time.perf_counter() - t0


def measure(url: str, row: Row, tokens: int, repeats: int, accepted: Callable[[str, dict], tuple[int, int]]) -> Row:
    """Fill ``row`` from requests to ``url``: ``accepted(url, answer)`` -> (accepted, drafts) of one answer."""
    for prompt in PROMPTS.values():
        chat(url, prompt, tokens)  # warm-up
        rates = []
        for _ in range(repeats):
            before = vllm_counters(url) if row.server == "vllm" else {}
            answer, seconds = chat(url, prompt, tokens)
            got, drafts = accepted(url, {"answer": answer, "before": before})
            n = int(answer["usage"]["completion_tokens"])
            rates.append(n / seconds)
        row.tokens, row.accepted, row.drafts = row.tokens + n, row.accepted + got, row.drafts + drafts
        row.rates.append(statistics.median(rates))
        row.texts.append(answer["choices"][0]["message"]["content"])
    return row


def vllm_accepted(url: str, seen: dict) -> tuple[int, int]:
    after = vllm_counters(url)
    return (int(after["num_accepted_tokens"] - seen["before"].get("num_accepted_tokens", 0)),
            int(after["num_drafts"] - seen["before"].get("num_drafts", 0)))


def llama_accepted(url: str, seen: dict) -> tuple[int, int]:
    timings = seen["answer"].get("timings") or {}
    return int(timings.get("draft_n_accepted", 0)), int(timings.get("draft_n", 0))


def refusal(log: Path, exc: Exception) -> str:
    """The server's own error line from its log (the last ``...Error: ...``), else the exception's."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    lines = [line.split("] ", 1)[-1].strip() for line in text.splitlines()
             if re.search(r"\b\w*(Error|Exception): ", line) and "ulimit" not in line
             and "initialization failed" not in line]
    return (lines[-1] if lines else str(exc))[:300]


def served(server: str, methods: dict[str, Sequence[str]], start: Callable[[Sequence[str], Path], ContextManager[str]],
           accepted, args) -> list[Row]:
    """Each method's server in turn (one at a time: a small machine), measured or its refusal kept."""
    rows = []
    for method, flags in methods.items():
        log = LOGS / f"served-speculative-{server}-{method.split()[0]}.log"
        row = Row(server, method)
        try:
            with start(flags, log) as url:
                measure(url, row, args.tokens, args.repeats, accepted)
        except (vllm_serve.VllmError, RemoteError, OSError, SystemExit) as exc:
            row.refused = refusal(log, exc)
        print(f"  {server} {method}: {'refused' if row.refused else 'measured'}", file=sys.stderr, flush=True)
        rows.append(row)
    return rows


def vllm_rows(args) -> list[Row]:
    python = vllm_serve.install()
    methods: dict[str, Sequence[str]] = {"plain": []}
    for spec in (f"ngram:{args.k}", f"eagle3:{args.k}"):
        try:
            methods[f"{spec.split(':')[0]} (K={args.k})"] = vllm_serve.speculative_flags(spec)
        except (ValueError, OSError) as exc:
            print(f"  vllm {spec}: {exc}", file=sys.stderr)
    return served("vllm", methods, lambda flags, log: vllm_serve.serving(python, flags, log=log), vllm_accepted, args)


def llama_rows(args) -> list[Row]:
    from bench.remote import started_server

    ngram = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m",
             str(args.k), "--spec-draft-n-max", str(args.k)]
    methods = {"plain": [], f"ngram-simple (K={args.k})": ngram}
    return served("llama", methods, lambda flags, log: started_server(args.threads, 1, flags), llama_accepted, args)


def our_rows(args) -> list[Row]:
    """Our EAGLE (the shipped head, bench.eagle's tree: 12 nodes, depth 5, top-4) and ngram drafter (K, n=3)
    in the engine, each beside target-only greedy on the same prompts (one run each, after a warm-up)."""
    from engine import runner
    from engine.backends.local import ModelSpec
    from engine.backends.registry import ModelRegistry
    from engine.config import DecodingConfig
    from engine.strategies import eagle, eagle_head
    from engine.threads import set_threads

    set_threads(args.threads)
    registry = ModelRegistry(capacity=1)
    lm = registry.get(ModelSpec("embedded", device="cpu", dtype="float32"))
    greedy = DecodingConfig(strategy="greedy", temperature=0.0, max_new_tokens=args.tokens)
    ngram = greedy.replace(strategy="speculative", drafter="ngram", num_draft_tokens=args.k, ngram_size=3)
    head = eagle_head.load_head(lm)
    rows = [Row("ours", "target-only"), Row("ours", "eagle (tree 12/5/4)"), Row("ours", f"ngram (K={args.k}, n=3)")]
    for prompt in PROMPTS.values():
        ids = lm.encode(prompt, chat=True)
        runs = [lambda: runner.run(runner.RunRequest(lm, prompt, greedy, chat=True, registry=registry)),
                lambda: runner.collect(eagle.stream(lm, "", ids, greedy.replace(strategy="eagle"), head=head)),
                lambda: runner.run(runner.RunRequest(lm, prompt, ngram, chat=True, registry=registry))]
        for row, run in zip(rows, runs):
            run()  # warm-up
            trace, seconds = timed(run)
            n = len(trace.generated_token_ids)
            per_forward = float(trace.summary.get("tokens_per_target_forward", 1.0))
            row.tokens += n
            row.accepted += round(n - n / per_forward)
            row.rates.append(n / seconds)
            row.texts.append(list(trace.generated_token_ids))
    return rows


def timed(run: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = run()
    return out, time.perf_counter() - t0


def report(rows: list[Row]) -> bool:
    """Print the table; whether every measured greedy output equals its server's own without speculation."""
    print(f"{'server':7} {'method':24} {'tok/forward':>11} {'per draft':>9} {'tok/s':>7} {'x plain':>7} same")
    same_all = True
    for row in rows:
        if row.refused:
            print(f"{row.server:7} {row.method:24} refused: {row.refused}")
            continue
        plain = rows[[r.server for r in rows].index(row.server)]
        same = row.texts == plain.texts
        same_all &= same
        ratio = row.rate / plain.rate if plain.rates and not plain.refused else float("nan")
        per_draft = f"{row.per_draft:9.2f}" if row.drafts else f"{'-':>9}"
        print(f"{row.server:7} {row.method:24} {row.per_forward:11.2f} {per_draft} {row.rate:7.1f} "
              f"{ratio:6.2f}x {'yes' if same else 'NO'}")
    return same_all


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.served_speculative", description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4, help="draft tokens per step (1 to 8)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    parser.add_argument("--only", default="vllm,llama,ours", help="comma-separated: vllm, llama, ours")
    args = parser.parse_args(argv)
    parts = [p for p in args.only.split(",") if p]
    if unknown := [p for p in parts if p not in ("vllm", "llama", "ours")]:
        parser.error(f"--only: {unknown[0]!r} is not one of vllm, llama, ours")
    if args.tokens < 1 or args.repeats < 1 or not 1 <= args.k <= vllm_serve.SPEC_MAX_TOKENS:
        parser.error(f"--tokens and --repeats must be at least 1 and --k 1 to {vllm_serve.SPEC_MAX_TOKENS}, "
                     f"got {args.tokens}, {args.repeats} and {args.k}")
    rows: list[Row] = []
    for part, make in (("ours", our_rows), ("vllm", vllm_rows), ("llama", llama_rows)):
        if part in parts:
            rows += make(args)
    print(f"{len(PROMPTS)} chat prompts, {args.tokens} greedy tokens, K={args.k}, {args.repeats} repeats; "
          f"load average {os.getloadavg()[0]:.2f}")
    same = report(rows)
    eagle = next((r for r in rows if r.server == "ours" and r.method.startswith("eagle")), None)
    plain = next((r for r in rows if r.server == "vllm" and r.method == "plain" and not r.refused), None)
    if eagle is not None and plain is not None:
        ratio = eagle.rate / plain.rate
        print(f"goal: our EAGLE {eagle.rate:.1f} tok/s = {ratio:.2f}x vLLM's plain stream "
              f"({'met' if ratio >= 1.2 else 'NOT met'}: >= 1.2x)")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
