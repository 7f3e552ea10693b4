"""Compare with 4 lanes vs 1 lane: the Compare view runs every greedy/sampling lane at once, so the
lanes join the batched scheduler together and share its forwards. Prints the wall time of one lane,
of four lanes (four seeds of the same knobs, as the seed sweep does) and their ratio, interleaved
over rounds in one process. Target on a 2-core CPU with the embedded model: 4 lanes <= 1.5x one.

    python -m bench.compare_lanes [--tokens 32] [--rounds 3] [--lanes 4] [--plain-products]

``--plain-products`` also runs every round with the model's products as F.linear (engine.backends.local.
plain_products: oneDNN's packed weights unused), so their gain is measured in the same process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROMPT = "Write a short story about a lighthouse keeper."


def lanes_seconds(shared, lm, prompt_ids, configs) -> float:
    from engine.control import RunControl
    from playground.views.compare.lanes import CompareSession
    from playground.views.compare.run import LaneModel, run_lanes

    session = CompareSession(traces=[None] * len(configs), errors=[""] * len(configs))
    start = time.perf_counter()
    for _ in run_lanes(shared, [LaneModel(lm, prompt_ids)] * len(configs), PROMPT, configs, True, session, RunControl()):
        pass
    if any(session.errors):
        raise RuntimeError(session.errors)
    return time.perf_counter() - start


def forward_seconds(lm, prompt_ids, rows: int, reps: int = 5) -> float:
    """Median wall time of one decode forward (one token per row over the prompt's KV cache) for
    ``rows`` rows: the part of a tick no capture batching can shrink, so 4 lanes / 1 lane cannot
    go below this ratio on the same machine."""
    import torch
    from transformers import DynamicCache

    from engine.threads import step_threads

    with torch.inference_mode(), step_threads(lm.device, rows):  # the threads the scheduler's step uses
        cache = DynamicCache(config=lm.model.config)
        lm.model(input_ids=torch.tensor([prompt_ids] * rows), past_key_values=cache, use_cache=True, logits_to_keep=1)
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            lm.model(input_ids=torch.tensor([[prompt_ids[-1]]] * rows), past_key_values=cache, use_cache=True,
                     logits_to_keep=1)
            times.append(time.perf_counter() - start)
            cache.crop(-1)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    from engine.threads import default_threads, set_threads

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lanes", type=int, default=4)
    p.add_argument("--threads", type=int, default=default_threads(), help="torch threads")
    p.add_argument("--plain-products", action="store_true",
                   help="also time F.linear products (no packed weights), interleaved")
    args = p.parse_args(argv)

    import torch

    from engine.config import DecodingConfig
    from engine.backends.registry import ModelRegistry
    from engine.backends.local import ModelSpec, PackedLinear, plain_products
    from playground.shared import Shared

    set_threads(args.threads)
    registry = ModelRegistry()
    lm = registry.get(ModelSpec())
    shared = Shared(registry=registry, model=None, quantization=None, user_presets=None)
    prompt_ids = lm.encode(PROMPT, True)
    # min_new_tokens keeps every lane to exactly --tokens tokens, so one and four lanes do the same work each
    base = DecodingConfig(strategy="sample", temperature=0.8, top_p=0.95, max_new_tokens=args.tokens,
                          min_new_tokens=args.tokens)
    configs = [base.replace(seed=s) for s in range(args.lanes)]
    lanes_seconds(shared, lm, prompt_ids, configs[:1])  # warm up
    packed = any(type(m) is PackedLinear for m in lm.model.modules())
    one, many, forward, plain_one, plain_many = [], [], [], [], []
    for _ in range(args.rounds):
        one.append(lanes_seconds(shared, lm, prompt_ids, configs[:1]))
        many.append(lanes_seconds(shared, lm, prompt_ids, configs))
        forward.append(forward_seconds(lm, prompt_ids, args.lanes) / forward_seconds(lm, prompt_ids, 1))
        if args.plain_products and packed:
            with plain_products(lm.model):
                plain_one.append(lanes_seconds(shared, lm, prompt_ids, configs[:1]))
                plain_many.append(lanes_seconds(shared, lm, prompt_ids, configs))
    ratios = [m / o for m, o in zip(many, one)]
    print(f"{args.tokens} tokens per lane, {args.rounds} interleaved rounds, torch threads {torch.get_num_threads()}, "
          f"products {'oneDNN, packed weights' if packed else 'F.linear'}")
    print(f"1 lane : {', '.join(f'{x:.1f}' for x in one)} s (median {statistics.median(one):.1f} s)")
    print(f"{args.lanes} lanes: {', '.join(f'{x:.1f}' for x in many)} s (median {statistics.median(many):.1f} s)")
    print(f"{args.lanes} lanes / 1 lane: {', '.join(f'{r:.2f}x' for r in ratios)} (median {statistics.median(ratios):.2f}x; "
          f"target <= 1.5x)")
    print(f"forward alone, {args.lanes} rows / 1 row: {', '.join(f'{r:.2f}x' for r in forward)} "
          f"(median {statistics.median(forward):.2f}x; the floor of the ratio above on this machine)")
    if plain_one:
        plain = [m / o for m, o in zip(plain_many, plain_one)]
        print(f"F.linear products: 1 lane {statistics.median(plain_one):.1f} s, {args.lanes} lanes "
              f"{statistics.median(plain_many):.1f} s, ratio median {statistics.median(plain):.2f}x "
              f"({', '.join(f'{r:.2f}x' for r in plain)}); packed weights: 1 lane "
              f"{statistics.median(plain_one) / statistics.median(one):.2f}x, {args.lanes} lanes "
              f"{statistics.median(plain_many) / statistics.median(many):.2f}x faster")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
