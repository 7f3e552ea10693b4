"""Speculative decoding vs target-only decoding: same model, prompt, config and token count,
interleaved in one process (a short warm-up of each first). Greedy, so both must produce the same tokens.

CPU, embedded model (default): an input-grounded prompt (fix the spelling of a paragraph that is
in the prompt, chat template on), 128 tokens, drafters ngram, self-int8 and self-nf4.

    .venv/bin/python -m bench.speculative [--tokens 128] [--repeats 3] [--drafters ngram,self-int8,self-nf4]

Target: ngram >= 1.3x on CPU. The bitsandbytes self-drafts may be < 1x on CPU: their CPU kernels
are slower than the fp32 target they draft for, so drafting K tokens costs more than it saves.

GPU pair (a 1.7B target, the embedded 135M model as its drafter; same tokenizer):

    .venv/bin/python -m bench.speculative --target HuggingFaceTB/SmolLM2-1.7B-Instruct \
        --drafters model:embedded,ngram,self-int8 --tokens 128

(``--target`` takes a Hub id or a local directory; the drafter ``model:embedded`` is the embedded
SmolLM2-135M-Instruct.)
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.strategies import decode, speculative  # noqa: E402
from engine import runner
from engine.runner import RunRequest
from engine.config import DecodingConfig  # noqa: E402
from engine.backends.local import LoadedModel, ModelSpec  # noqa: E402
from engine.backends.registry import ModelRegistry

TARGET_SPEEDUP = 1.3
PARAGRAPH = (
    "The old lighthouse stood at the edge of the cliff for more than a hundred years. Every night its keeper climbed "
    "the narow stairs, lit the great lamp and watched the ships pass safely through the dark water. In the winter the "
    "storms were so strong that the windows shook and the sea covered the rocks below with white foam. The keeper "
    "wrote everything in a small book: the weather, the ships he saw, and the birds that rested on the railing. When "
    "he finaly retired, the town kept his book in the library, where children still read it on rainy afternoons."
)
PROMPT = f"Rewrite the following text with the spelling mistakes corrected. Change nothing else.\n\n{PARAGRAPH}"


@dataclass
class Row:
    drafter: str
    k: int
    acceptance: float
    per_forward: float
    spec_ms: list[float]
    base_ms: list[float]
    same_tokens: bool
    tokens: int

    @property
    def speedup(self) -> float:
        """Median over repeats of target-only / speculative time, each pair run back to back (so a
        change in machine load between repeats cancels out)."""
        return statistics.median(b / s for s, b in zip(self.spec_ms, self.base_ms))


def bench_drafter(lm: LoadedModel, registry: ModelRegistry, drafter: str, k: int, tokens: int, repeats: int) -> Row:
    """Interleaved speculative and target-only runs (a short warm-up first), wall-clock per run."""
    config = DecodingConfig(strategy="speculative", temperature=0.0, max_new_tokens=tokens, drafter=drafter,
                            num_draft_tokens=k)
    base_config = speculative.baseline_config(config)
    warm = {"max_new_tokens": 8}  # warm-up: loads the drafter, first-call kernel setup
    runner.run(RunRequest(lm, PROMPT, config.replace(**warm), chat=True, registry=registry))
    decode.run(lm, PROMPT, base_config.replace(**warm), chat=True)
    spec_ms, base_ms, trace, base = [], [], None, None
    for i in range(repeats):
        order = ("spec", "base") if i % 2 == 0 else ("base", "spec")
        for which in order:
            start = time.perf_counter()
            if which == "spec":
                trace = runner.run(RunRequest(lm, PROMPT, config, chat=True, registry=registry))
                spec_ms.append((time.perf_counter() - start) * 1000)
            else:
                base = decode.run(lm, PROMPT, base_config, chat=True)
                base_ms.append((time.perf_counter() - start) * 1000)
    return Row(drafter, k, trace.summary["acceptance_rate"], trace.summary["tokens_per_target_forward"], spec_ms, base_ms,
               trace.generated_token_ids == base.generated_token_ids, len(trace.generated_token_ids))


def print_table(rows: list[Row], title: str) -> None:
    print(f"\n{title}")
    print(f"{'drafter':<22} {'K':>3} {'tokens':>6} {'accept':>7} {'tok/fwd':>8} {'spec ms':>9} {'target ms':>10} "
          f"{'speed-up':>9} {'same':>5}  per repeat")
    for r in rows:
        print(f"{r.drafter:<22} {r.k:>3} {r.tokens:>6} {r.acceptance:>7.1%} {r.per_forward:>8.2f} "
              f"{statistics.median(r.spec_ms):>9.0f} {statistics.median(r.base_ms):>10.0f} {r.speedup:>8.2f}x "
              f"{'yes' if r.same_tokens else 'NO':>5}  {', '.join(f'{b / s:.2f}' for s, b in zip(r.spec_ms, r.base_ms))}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="embedded", help="'embedded', a model directory or a Hub id")
    p.add_argument("--drafters", default="ngram,self-int8,self-nf4", help="comma-separated drafters")
    p.add_argument("--k", type=int, default=4, help="tokens drafted per round")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # a cast notice on every int8 matmul
    registry = ModelRegistry(capacity=4)
    lm = registry.get(ModelSpec(args.target))
    print(f"target {lm.name} on {lm.device} ({lm.dtype}), torch threads {torch.get_num_threads()}, "
          f"{args.tokens} tokens, greedy, chat template, {args.repeats} interleaved repeats "
          f"(times: medians; speed-up: median of back-to-back pairs)")
    rows = [bench_drafter(lm, registry, d.strip(), args.k, args.tokens, args.repeats) for d in args.drafters.split(",") if d.strip()]
    print_table(rows, "speculative vs target-only (same process, same config)")
    ngram = next((r for r in rows if r.drafter == "ngram"), None)
    if ngram is not None:
        verdict = "PASS" if ngram.speedup >= TARGET_SPEEDUP else "BELOW TARGET"
        print(f"ngram speed-up {ngram.speedup:.2f}x (target >= {TARGET_SPEEDUP}x): {verdict}")
    return 0 if all(r.same_tokens for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
