"""Inside the model (issue #54) on the embedded model, one process: each of the five parts for a
64-token run, in seconds (the goal: under 5 s each), each beside the plain work it adds to.

1. the logit lens at the run's middle step, against one plain forward of the same prefix;
2. the watermark: a sampled run with the stage (lefthash, then selfhash) against the same run without
   it, and the detector over the run's tokens;
3. every token's rank (GLTR) over the run, against one plain forward of prompt + run;
4. calibration on the held-out text (one forward, the best temperature, the sweep), against the forward;
5. entropy and varentropy: the capture's statistics on [16, V] rows against entropy alone, and the
   hesitation steps of the run.

    python -m bench.inside [--tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine import runner  # noqa: E402
from engine.backends.local import ModelSpec, load_model  # noqa: E402
from engine.chain import entropy_rows, entropy_varentropy_rows  # noqa: E402
from engine.config import DecodingConfig  # noqa: E402
from engine.reports import calibration, lens, ranks, uncertainty  # noqa: E402
from engine.reports import watermark as wm  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper."
GOAL_S = 5.0


def seconds(fn: Callable[[], object], repeats: int) -> float:
    """The median wall time of ``fn`` over ``repeats`` calls (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.inference_mode()
def plain_forward(lm, ids: list[int]) -> None:
    lm.model(input_ids=torch.tensor([ids]), use_cache=False, logits_to_keep=1)


def run(lm, config: DecodingConfig):
    return runner.run(runner.RunRequest(lm, PROMPT, config, chat=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    lm = load_model(ModelSpec())
    base = DecodingConfig(strategy="sample", seed=1, max_new_tokens=args.tokens)
    marked = base.replace(watermark_delta=3.0)
    trace = run(lm, marked)
    ids, middle = trace.prompt_token_ids + trace.generated_token_ids, len(trace.steps) // 2
    prefix = trace.prompt_token_ids + trace.generated_token_ids[:middle]
    rows = torch.softmax(torch.randn(16, lm.vocab_size, generator=torch.Generator().manual_seed(0)) * 4, dim=-1)
    r = args.repeats
    print(f"\nInside the model, {args.tokens}-token run, {lm.name}, {torch.get_num_threads()} torch threads "
          f"(goal: each under {GOAL_S:g} s)")
    print(f"{'part':<36} {'s':>8} {'against':<28} {'s':>8} {'ratio':>7}", flush=True)
    plain_run = seconds(lambda: run(lm, base), r)
    parts = [
        (f"1 logit lens, step {middle}", lambda: lens.trace_lens(lm, trace, middle),
         "one forward of the prefix", lambda: plain_forward(lm, prefix)),
        ("2 watermarked run (lefthash)", lambda: run(lm, marked), "the same run without it", plain_run),
        ("2 watermarked run (selfhash)", lambda: run(lm, marked.replace(watermark_seeding="selfhash")),
         "the same run without it", plain_run),
        ("2 detector over the run", lambda: wm.detect(trace.generated_token_ids, lm.vocab_size,
                                                      wm.WatermarkKey.of(marked)), "", None),
        ("3 ranks of the run's tokens", lambda: ranks.rank_ids(lm, trace.prompt_token_ids, trace.generated_token_ids),
         "one forward of prompt + run", lambda: plain_forward(lm, ids)),
        ("4 calibration (held-out text)", lambda: calibration.calibration_report(lm), "its forward alone",
         lambda: calibration.teacher_forced(lm, calibration.heldout_ids(lm))),
        ("5 entropy + varentropy, 16 rows", lambda: entropy_varentropy_rows(rows), "entropy alone",
         lambda: entropy_rows(rows)),
        ("5 hesitation steps of the run", lambda: uncertainty.uncertainty_series(trace.steps), "", None),
    ]
    for name, fn, against, baseline in parts:
        took = seconds(fn, r)
        base_s = baseline if isinstance(baseline, float) or baseline is None else seconds(baseline, r)
        ratio = f"{took / base_s:7.2f}" if base_s else ""
        shown = f"{base_s:8.3f}" if base_s else ""
        print(f"{name:<36} {took:8.3f} {against:<28} {shown:>8} {ratio}{'' if took < GOAL_S else '  over the goal'}",
              flush=True)

if __name__ == "__main__":
    main()
