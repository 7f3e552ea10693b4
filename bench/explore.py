"""What-if cost per knob change on the embedded model: re-processing kept raw logits vs one
recompute forward (the cost when the step's logits were not kept). Prints ms and the ratio.

    .venv/bin/python -m bench.explore [--steps 24] [--repeats 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine import explore, runner
from engine.runner import RunRequest
from engine.config import DecodingConfig
from engine.backends.local import EMBEDDED, ModelSpec
from engine.backends.registry import ModelRegistry

KNOB_MOVES = [{"temperature": t} for t in (0.3, 0.7, 1.0, 1.5, 2.5)] + [{"top_p": 0.5}, {"top_k": 5}, {"min_p": 0.1}]


def timed_ms(fn, repeats: int) -> float:
    """Median wall time of ``fn()`` in ms."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    lm = ModelRegistry().get(ModelSpec(source=EMBEDDED))
    trace = runner.run(RunRequest(lm, "Explain why the sky is blue, briefly.", DecodingConfig(strategy="sample", seed=1,
                       max_new_tokens=args.steps), chat=True))
    step = len(trace.steps) - 1
    logits = explore.raw_logits(lm, trace, step)
    moves = iter(KNOB_MOVES * args.repeats)
    kept = timed_ms(lambda: explore.explore_step(lm, trace, step, next(moves), logits=logits), args.repeats)
    moves = iter(KNOB_MOVES * args.repeats)
    recompute = timed_ms(lambda: explore.explore_step(lm, trace, step, next(moves)), args.repeats)
    context = len(explore.step_context(trace, step))
    print(f"what-if at step {step} ({context} context tokens), median of {args.repeats}:")
    print(f"  kept logits:       {kept:8.1f} ms per knob change (target <= 150 ms on CPU)")
    print(f"  recompute forward: {recompute:8.1f} ms per knob change")
    print(f"  ratio recompute / kept: {recompute / kept:.1f}x")


if __name__ == "__main__":
    main()
