"""MCTS vs greedy vs beam search: the total log-prob of each output under the raw model, on a
few prompts of the embedded model (the quantity MCTS's rollouts score). Same token budget for
all; the log-prob is recomputed for every output by one uncached forward (engine.mcts.raw_logprob).

    .venv/bin/python -m bench.mcts [--tokens 16] [--simulations 16] [--rollout 3] [--beams 4]

MCTS is slow by design (simulations x rollout forwards per token); the defaults keep a CPU run to
a few minutes. Beam search here stops at the budget like the others (early_stopping=never)."""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine import mcts, runner  # noqa: E402
from engine.config import DecodingConfig  # noqa: E402
from engine.models import ModelRegistry, ModelSpec  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "Write a sentence about the sea.",
    "Three things to pack for a hike:",
]


def run_all(lm, prompt: str, args) -> list[tuple[str, float, int, float]]:
    """(strategy, total raw log-prob, tokens, seconds) for greedy, beam and MCTS on one prompt."""
    ids = lm.encode(prompt, chat=True)
    configs = {
        "greedy": DecodingConfig(strategy="greedy", max_new_tokens=args.tokens),
        f"beam ({args.beams})": DecodingConfig(strategy="beam", num_beams=args.beams, max_new_tokens=args.tokens,
                                              early_stopping="never", length_penalty=0.0),
        f"mcts ({args.simulations} sims)": DecodingConfig(strategy="mcts", temperature=0.0, max_new_tokens=args.tokens,
                                                          mcts_simulations=args.simulations,
                                                          mcts_rollout_tokens=args.rollout, mcts_expand_k=args.expand),
    }
    rows = []
    for name, config in configs.items():
        start = time.perf_counter()
        if config.strategy == "mcts":
            trace = mcts.run(lm, prompt, ids, config, chat=True)
        else:
            trace = runner.run(lm, prompt, config, chat=True, prompt_ids=ids)
        seconds = time.perf_counter() - start
        tokens = trace.generated_token_ids
        rows.append((name, mcts.raw_logprob(lm, ids, tokens), len(tokens), seconds))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--simulations", type=int, default=16)
    p.add_argument("--rollout", type=int, default=3)
    p.add_argument("--expand", type=int, default=4)
    p.add_argument("--beams", type=int, default=4)
    args = p.parse_args(argv)
    lm = ModelRegistry().get(ModelSpec())
    print(f"{lm.name} on {lm.device}, torch threads {torch.get_num_threads()}, {args.tokens} tokens, chat template; "
          f"MCTS: {args.simulations} simulations, expand {args.expand}, rollout {args.rollout}")
    print(f"\n{'prompt':<36} {'strategy':<18} {'tokens':>6} {'total logp':>11} {'mean logp':>10} {'seconds':>8}")
    wins = 0
    for prompt in PROMPTS:
        rows = run_all(lm, prompt, args)
        for name, total, n, seconds in rows:
            print(f"{prompt[:36]:<36} {name:<18} {n:>6} {total:>11.3f} {total / max(n, 1):>10.3f} {seconds:>8.1f}")
        wins += rows[2][1] / max(rows[2][2], 1) >= rows[0][1] / max(rows[0][2], 1)
    print(f"\nMCTS's mean log-prob per token >= greedy's on {wins} of {len(PROMPTS)} prompts")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
