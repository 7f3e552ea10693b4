"""MCTS's default preset against the request time limit: wall time, tokens/s and forwards of the
view's default run (presets/mcts.json, the view's prompt) next to greedy decoding of the same number
of tokens, interleaved in one process. Prints the ratio and the share of the 120 s limit used.

    .venv/bin/python -m bench.mcts [--repeats 2] [--threads 1] [--tokens N] [--simulations N] [--expand N] [--rollout N]
    .venv/bin/python -m bench.mcts --quality [--tokens 16] [--simulations 16] [--rollout 3] [--beams 4]

MCTS is slow by design: each token costs its simulations x max(1, rollout) forwards (one for the
path, one per rollout token after the first). ``--quality`` instead sets MCTS against greedy and
beam search by the total log-prob of each output under the raw model on a few chat prompts (the
quantity MCTS's rollouts score; engine.strategies.mcts.raw_logprob, one uncached forward per output; beam
stops at the budget like the others, early_stopping=never).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.strategies import decode, mcts  # noqa: E402
from engine import runner
from engine.runner import RunRequest
from engine.config import DecodingConfig  # noqa: E402
from engine.control import DEFAULT_REQUEST_SECONDS  # noqa: E402
from engine.backends.registry import ModelRegistry  # noqa: E402
from engine.backends.local import ModelSpec
from engine.threads import set_threads  # noqa: E402
from engine.presets import builtin_presets  # noqa: E402

MCTS_PRESET = "mcts"
MCTS_PROMPT = "The capital of France is"  # the view's prompt (playground.views.search.MCTS_PROMPT)
PROMPTS = [
    "The capital of France is",
    "Write a sentence about the sea.",
    "Three things to pack for a hike:",
]


# --- the default preset's time ---------------------------------------------------------------
def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def default_preset(lm, args) -> None:
    """The default preset (knobs overridden by the flags) vs greedy of as many tokens, interleaved."""
    config = builtin_presets()[MCTS_PRESET].config
    overrides = {"max_new_tokens": args.tokens, "mcts_simulations": args.simulations, "mcts_rollout_tokens": args.rollout,
                 "mcts_expand_k": args.expand}
    config = config.replace(**{k: v for k, v in overrides.items() if v is not None})
    ids = lm.encode(MCTS_PROMPT, chat=False)
    print(f"MCTS preset {MCTS_PRESET!r}: {config.max_new_tokens} tokens, {config.mcts_simulations} simulations, "
          f"expand {config.mcts_expand_k}, rollout {config.mcts_rollout_tokens}; prompt {MCTS_PROMPT!r} (no chat "
          f"template, as the view opens), {args.repeats} interleaved repeats\n")
    mcts_s, greedy_s, tokens, forwards = [], [], 0, 0
    for _ in range(args.repeats):
        seconds, trace = timed(lambda: runner.run(RunRequest(lm, MCTS_PROMPT, config, prompt_ids=ids)))
        tokens, forwards = len(trace.generated_token_ids), 1 + trace.summary["search_forwards"] + len(trace.steps) - 1
        mcts_s.append(seconds)
        # greedy of exactly as many tokens (min_new_tokens keeps it from stopping earlier)
        greedy = config.replace(strategy="greedy", max_new_tokens=tokens, min_new_tokens=tokens)
        seconds, steps = timed(lambda: list(decode.stream(lm, ids, greedy)))
        greedy_s.append(seconds)
    m, g = statistics.median(mcts_s), statistics.median(greedy_s)
    print(f"{'run':<34} {'median s':>9} {'tok/s':>7} {'runs (s)':>20}")
    print(f"{'mcts (default preset)':<34} {m:>9.2f} {tokens / m:>7.2f} {', '.join(f'{s:.1f}' for s in mcts_s):>20}")
    print(f"{'greedy, same tokens':<34} {g:>9.2f} {tokens / g:>7.2f} {', '.join(f'{s:.1f}' for s in greedy_s):>20}")
    ours, theirs = (mcts.raw_logprob(lm, ids, t) for t in (trace.generated_token_ids, [s.chosen_token_id for s in steps]))
    print(f"\ntotal raw log-prob of the output: mcts {ours:.2f} {trace.text!r}; greedy {theirs:.2f}")
    print(f"{tokens} tokens, {forwards} forwards ({forwards / tokens:.1f} per token, {m / forwards * 1000:.0f} ms each); "
          f"ratio mcts / greedy time = {m / g:.1f}x; {m / DEFAULT_REQUEST_SECONDS:.0%} of the "
          f"{DEFAULT_REQUEST_SECONDS:g} s request limit")


# --- quality: MCTS vs greedy vs beam -----------------------------------------------------------
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
        seconds, trace = timed(lambda: runner.run(RunRequest(lm, prompt, config, chat=True, prompt_ids=ids)))
        tokens = trace.generated_token_ids
        rows.append((name, mcts.raw_logprob(lm, ids, tokens), len(tokens), seconds))
    return rows


def quality(lm, args) -> None:
    for name, default in (("tokens", 16), ("simulations", 16), ("rollout", 3), ("expand", 4)):
        if getattr(args, name) is None:
            setattr(args, name, default)
    print(f"{args.tokens} tokens, chat template; MCTS: {args.simulations} simulations, expand {args.expand}, "
          f"rollout {args.rollout}")
    print(f"\n{'prompt':<36} {'strategy':<18} {'tokens':>6} {'total logp':>11} {'mean logp':>10} {'seconds':>8}")
    wins = 0
    for prompt in PROMPTS:
        rows = run_all(lm, prompt, args)
        for name, total, n, seconds in rows:
            print(f"{prompt[:36]:<36} {name:<18} {n:>6} {total:>11.3f} {total / max(n, 1):>10.3f} {seconds:>8.1f}")
        wins += rows[2][1] / max(rows[2][2], 1) >= rows[0][1] / max(rows[0][2], 1)
    print(f"\nMCTS's mean log-prob per token >= greedy's on {wins} of {len(PROMPTS)} prompts")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quality", action="store_true", help="MCTS vs greedy vs beam by total raw log-prob instead")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the issue's setting; 0: torch's default)")
    p.add_argument("--tokens", type=int, default=None, help="default: the preset's (--quality: 16)")
    p.add_argument("--simulations", type=int, default=None, help="default: the preset's (--quality: 16)")
    p.add_argument("--rollout", type=int, default=None, help="default: the preset's (--quality: 3)")
    p.add_argument("--expand", type=int, default=None, help="default: the preset's (--quality: 4)")
    p.add_argument("--beams", type=int, default=4, help="--quality only")
    args = p.parse_args(argv)
    set_threads(args.threads)
    lm = ModelRegistry().get(ModelSpec())
    print(f"{lm.name} on {lm.device} ({lm.dtype}), torch threads {torch.get_num_threads()}")
    (quality if args.quality else default_preset)(lm, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
