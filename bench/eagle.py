"""EAGLE (the shipped head, EAGLE-2's dynamic tree) and Medusa (the shipped heads, its default tree)
against target-only greedy: same model, prompt and token count, interleaved in one process after a
warm-up of each. Greedy, so all three must produce the same tokens (``same``; exit 1 if not).

CPU, embedded model, chat template; prompts: bench/medusa.py's (held out from both heads' training).

    .venv/bin/python -m bench.eagle [--tokens 128] [--repeats 2] [--eagle-tokens 12] [--eagle-depth 5]
                                    [--eagle-topk 4] [--dtype float32|bfloat16] [--threads 2] [--no-medusa]

Prints per prompt and method: tokens per target forward (mean acceptance length) and the wall-clock
ratio to target-only (median over back-to-back pairs). Goals (issue 53): >= 2.5 tokens per target
forward and >= 1.5x target-only. With ``--dtype bfloat16`` it also loads the float32 model and prints the
drift bfloat16 costs: per prompt, how many greedy tokens bfloat16 target-only shares with float32's
before they part (``same`` then compares EAGLE with bfloat16's own target-only, and says ``tie@N`` where the
first different token N is a bfloat16 rounding tie of the target, as bench.medusa does: a tree forward
rounds differently from a one-row one). The ratio to vLLM's plain stream is bench.served_speculative's
(it starts vLLM).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.medusa import PROMPTS, compare_tokens  # noqa: E402
from engine import runner  # noqa: E402
from engine.backends.local import ModelSpec, load_model  # noqa: E402
from engine.config import DecodingConfig  # noqa: E402
from engine.strategies import decode, eagle, eagle_head, medusa  # noqa: E402
from engine.threads import set_threads  # noqa: E402

GOAL_PER_FORWARD = 2.5
GOAL_SPEEDUP = 1.5


def timed(run) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = run()
    return (time.perf_counter() - t0) * 1000, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.eagle", description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--eagle-tokens", type=int, default=12)
    parser.add_argument("--eagle-depth", type=int, default=5)
    parser.add_argument("--eagle-topk", type=int, default=4)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-medusa", action="store_true", help="EAGLE against target-only alone (half the time)")
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.repeats < 1:
        parser.error(f"--tokens and --repeats must be at least 1, got {args.tokens} and {args.repeats}")
    set_threads(args.threads)
    lm = load_model(ModelSpec("embedded", device="cpu", dtype=args.dtype))
    config = DecodingConfig(strategy="eagle", temperature=0.0, max_new_tokens=args.tokens,
                            eagle_tokens=args.eagle_tokens, eagle_depth=args.eagle_depth, eagle_topk=args.eagle_topk)
    greedy = config.replace(strategy="greedy")
    head = eagle_head.load_head(lm)  # once: reading and checksumming 10 MB is no part of a round
    exact = None if args.dtype == "float32" else load_model(ModelSpec("embedded", device="cpu", dtype="float32"))
    methods = {
        "eagle": lambda ids: runner.collect(eagle.stream(lm, "", ids, config, head=head)),
        "medusa": lambda ids: runner.collect(medusa.stream(lm, "", ids, config.replace(strategy="medusa"))),
    }
    if args.no_medusa:
        del methods["medusa"]
    print(f"embedded model, {args.dtype}, {args.tokens} greedy tokens, {args.repeats} repeats, eagle tree "
          f"{args.eagle_tokens} nodes / depth {args.eagle_depth} / top-{args.eagle_topk}")
    print(f"{'prompt':24} {'method':7} {'tok/forward':>11} {'x target-only':>13} same")
    failed, summary = False, {name: ([], []) for name in methods}
    for label, prompt in PROMPTS.items():
        ids = lm.encode(prompt, chat=True)
        reference = [s.chosen_token_id for s in decode.stream(lm, ids, greedy)]  # also the warm-up
        if exact is not None:
            float32 = [s.chosen_token_id for s in decode.stream(exact, ids, greedy)]
            shared = next((i for i, (a, b) in enumerate(zip(reference, float32)) if a != b),
                          min(len(reference), len(float32)))
            print(f"{label:24} drift: {args.dtype} greedy equals float32's for {shared} of {len(float32)} tokens",
                  flush=True)
        for name, run in methods.items():
            run(ids)  # warm-up
            ratios, per_forward, same = [], 0.0, "yes"
            for _ in range(args.repeats):
                base_ms, _ = timed(lambda: list(decode.stream(lm, ids, greedy)))
                fast_ms, trace = timed(lambda: run(ids))
                ratios.append(base_ms / fast_ms)
                per_forward = trace.summary["tokens_per_target_forward"]
                if same == "yes":  # a repeat's difference is kept
                    same = compare_tokens(lm, ids, trace.generated_token_ids, reference)
            failed |= not (same == "yes" or same.startswith("tie@"))
            summary[name][0].append(per_forward)
            summary[name][1].append(statistics.median(ratios))
            ratio = statistics.median(ratios)
            print(f"{label:24} {name:7} {per_forward:11.2f} {ratio:12.2f}x {same}", flush=True)
    for name, (per_forward, ratios) in summary.items():
        print(f"mean {name}: {statistics.fmean(per_forward):.2f} tokens per target forward, "
              f"{statistics.fmean(ratios):.2f}x target-only")
    mean_pf, mean_ratio = (statistics.fmean(v) for v in summary["eagle"])
    print(f"goals: >= {GOAL_PER_FORWARD} tokens per forward: {'met' if mean_pf >= GOAL_PER_FORWARD else 'NOT met'}; "
          f">= {GOAL_SPEEDUP}x target-only: {'met' if mean_ratio >= GOAL_SPEEDUP else 'NOT met'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
