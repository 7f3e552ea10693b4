"""Medusa (trained heads, one-forward verification of a chain or a tree of candidates) vs
target-only greedy: same model, prompt, token count, interleaved in one process after a short
warm-up of each. Greedy, so both must produce the same tokens. Optionally the n-gram speculative
drafter on the same prompts.

CPU, embedded model, chat template; prompts: two held out from the heads' training prompts
(never trained on) and the spelling-correction prompt of bench/speculative.py.

    .venv/bin/python -m bench.medusa [--tokens 128] [--repeats 3] [--heads 3] [--shapes chain,4x10] [--ngram]
                                     [--dtype float32|bfloat16]

``--shapes``: ``chain`` (each head's top-1) and/or WIDTHxNODES trees (the best NODES paths over each
head's top WIDTH; engine.strategies.medusa.TREE is the default the app runs), with @MIN_SCORE for the dynamic
tree (only paths whose product of head probabilities reaches it).

``--dtype bfloat16`` runs both Medusa and target-only in bfloat16 (on a CPU with AMX, a forward of
dozens of positions then costs little more than one: the GPU's situation). Greedy equality then
holds up to rounding: a forward of 11 positions rounds differently from one of 1, so where the
target's two best logits are a bfloat16 step apart the two runs may pick different ones.
``same`` says ``tie@N`` when the first different token N is such a tie (the logits of both tokens
within two rounding steps in an uncached recompute), ``NO@N`` otherwise (a failure: exit 1).

Targets (issue 16): >= 1.8 tokens per target forward and a wall-clock speed-up > 1.2x on CPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.speculative import PROMPT as SPELLING  # noqa: E402
from engine.strategies import decode, medusa, speculative  # noqa: E402
from engine import runner
from engine.runner import RunRequest
from engine.config import ConfigError, DecodingConfig  # noqa: E402
from engine.backends.registry import ModelRegistry  # noqa: E402
from engine.backends.local import ModelSpec
from engine.threads import set_threads  # noqa: E402

TARGET_PER_FORWARD = 1.8
TARGET_SPEEDUP = 1.2
PROMPTS = {
    "volcanoes (held out)": "What are the most important things to know about volcanoes?",
    "story (held out)": "Continue the story: Once upon a time, in a small village by the sea,",
    "spelling fix": SPELLING,
}


@dataclass
class Row:
    prompt: str
    method: str
    per_forward: float
    fast_ms: list[float]
    base_ms: list[float]
    same: str  # yes | tie@N | NO@N
    tokens: int
    head_acceptance: list[float]

    @property
    def speedup(self) -> float:
        """Median over back-to-back pairs of target-only / method time (per generated token)."""
        return statistics.median(b / f for f, b in zip(self.fast_ms, self.base_ms))


def parse_shape(text: str) -> medusa.TreeShape:
    """``chain`` or WIDTHxNODES (``4x10``), optionally @MIN_SCORE (``8x48@0.02``: the dynamic tree)."""
    if text == "chain":
        return medusa.CHAIN
    size, _, min_score = text.partition("@")
    width, _, nodes = size.partition("x")
    try:
        return medusa.TreeShape(int(width), int(nodes), float(min_score) if min_score else 0.0)
    except (ValueError, ConfigError) as exc:
        raise SystemExit(f"--shapes: {text!r} is neither 'chain' nor WIDTHxNODES[@MIN_SCORE] (e.g. 4x10, 8x48@0.02): "
                         f"{exc}") from None


def shape_name(shape: medusa.TreeShape) -> str:
    if shape == medusa.CHAIN:
        return "medusa chain"
    return f"medusa {shape.width}x{shape.nodes}" + (f"@{shape.min_score:g}" if shape.min_score else "")


def bench_prompt(lm, registry, name: str, prompt: str, method: str, config: DecodingConfig, repeats: int,
                 shape: medusa.TreeShape | None = None) -> Row:
    ids = lm.encode(prompt, chat=True)
    heads = medusa.load_heads(lm) if shape is not None else None
    base_config = config.replace(strategy="greedy")

    def fast(cfg):
        if shape is not None:
            return runner.collect(medusa.stream(lm, prompt, ids, cfg, chat=True, heads=heads, shape=shape))
        return runner.run(RunRequest(lm, prompt, cfg, chat=True, prompt_ids=ids, registry=registry))

    def base(cfg):
        return decode.assemble(lm, prompt, ids, cfg, list(decode.stream(lm, ids, cfg)), True)

    fast(config.replace(max_new_tokens=8))  # warm-up
    base(base_config.replace(max_new_tokens=8))
    fast_ms, base_ms, trace, reference = [], [], None, None
    for i in range(repeats):
        for which in (("fast", "base") if i % 2 == 0 else ("base", "fast")):
            start = time.perf_counter()
            if which == "fast":
                trace = fast(config)
                fast_ms.append((time.perf_counter() - start) * 1000 / max(1, len(trace.generated_token_ids)))
            else:
                reference = base(base_config)
                base_ms.append((time.perf_counter() - start) * 1000 / max(1, len(reference.generated_token_ids)))
    return Row(name, method, trace.summary["tokens_per_target_forward"], fast_ms, base_ms,
               compare_tokens(lm, ids, trace.generated_token_ids, reference.generated_token_ids),
               len(trace.generated_token_ids), trace.summary.get("head_acceptance", []))


def compare_tokens(lm, prompt_ids: list[int], got: list[int], expected: list[int]) -> str:
    """``yes`` if equal; ``tie@N`` if the first difference N is a rounding tie of the target
    (engine.strategies.speculative.first_difference); else ``NO@N``."""
    diff = speculative.first_difference(lm, prompt_ids, got, expected)
    n = diff["baseline_first_difference"]
    return "yes" if n is None else f"tie@{n}" if diff["baseline_rounding_tie"] else f"NO@{n}"


def print_table(rows: list[Row]) -> None:
    print(f"\n{'prompt':<22} {'method':<20} {'tokens':>6} {'tok/fwd':>8} {'ms/token':>9} {'target ms/tok':>14} "
          f"{'speed-up':>9} {'same':>7}  per-head acceptance")
    for r in rows:
        heads = ", ".join(f"{a:.0%}" for a in r.head_acceptance) or "-"
        print(f"{r.prompt:<22} {r.method:<20} {r.tokens:>6} {r.per_forward:>8.2f} "
              f"{statistics.median(r.fast_ms):>9.1f} {statistics.median(r.base_ms):>14.1f} {r.speedup:>8.2f}x "
              f"{r.same:>7}  {heads}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--shapes", default="chain,4x10", help="comma-separated: chain and/or WIDTHxNODES trees")
    p.add_argument("--ngram", action="store_true", help="also the n-gram speculative drafter (K=4) on the same prompts")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default, the app's)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="the model's dtype for both Medusa and target-only (bfloat16: see the module doc)")
    args = p.parse_args(argv)
    set_threads(args.threads)
    registry = ModelRegistry(capacity=2)
    lm = registry.get(ModelSpec(dtype=args.dtype))
    print(f"{lm.name} on {lm.device} ({lm.dtype}), torch threads {torch.get_num_threads()}, {args.tokens} tokens, "
          f"greedy, chat template, {args.repeats} interleaved repeats (ms per token: medians)")
    config = DecodingConfig(strategy="medusa", temperature=0.0, max_new_tokens=args.tokens, medusa_heads=args.heads)
    shapes = [parse_shape(s) for s in args.shapes.split(",")]
    rows = []
    for name, prompt in PROMPTS.items():
        for shape in shapes:
            rows.append(bench_prompt(lm, registry, name, prompt, shape_name(shape), config, args.repeats, shape))
        if args.ngram:
            ngram = config.replace(strategy="speculative", drafter="ngram", num_draft_tokens=4)
            rows.append(bench_prompt(lm, registry, name, prompt, "ngram (K=4)", ngram, args.repeats))
    print_table(rows)
    for shape in shapes:
        med = [r for r in rows if r.method == shape_name(shape)]
        per_forward = statistics.mean(r.per_forward for r in med)
        speedup = statistics.mean(r.speedup for r in med)
        ok = per_forward >= TARGET_PER_FORWARD and speedup > TARGET_SPEEDUP
        print(f"{shape_name(shape)} mean: {per_forward:.2f} tokens per target forward "
              f"(target >= {TARGET_PER_FORWARD}), "
              f"speed-up {speedup:.2f}x (target > {TARGET_SPEEDUP}x): {'PASS' if ok else 'BELOW TARGET'}")
    return 0 if all(r.same == "yes" or r.same.startswith("tie@") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
