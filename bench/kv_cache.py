"""Greedy with the KV cache (engine.decode.stream, full trace capture) vs the nanoGPT loop that feeds
the whole sequence again at every step (engine.drift.uncached_greedy): same model and prompt,
interleaved in one process, at several token counts. Prints tokens/s and the speed-up per count.

    python -m bench.kv_cache [--tokens 32 64 128] [--repeats 3] [--warmup 0] [--model embedded]

The uncached loop's cost per token grows with the sequence, so the speed-up grows with the count.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import interleaved, report  # noqa: E402
from engine import decode, drift  # noqa: E402
from engine.models import ModelSpec, load_model  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
CACHED = "KV cache (decode.stream, full trace)"
UNCACHED = "no cache (recompute every step)"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=0, help="extra rounds; the token check already runs each loop once")
    p.add_argument("--model", default="embedded")
    args = p.parse_args()
    lm = load_model(ModelSpec(args.model))
    ids = lm.encode(PROMPT, chat=True)
    print(f"model {lm.name} on {lm.device} ({lm.dtype}), torch threads {torch.get_num_threads()}, "
          f"prompt {len(ids)} tokens")
    rows = []
    for tokens in args.tokens:
        cfg = drift.greedy_config(tokens)
        cached_ids = [s.chosen_token_id for s in decode.stream(lm, ids, cfg)]
        uncached_ids, _ = drift.uncached_greedy(lm, ids, cfg)
        assert cached_ids == uncached_ids, f"{tokens} tokens: the cached and uncached loops picked different tokens"
        runs = {CACHED: lambda: len(list(decode.stream(lm, ids, cfg))),
                UNCACHED: lambda: len(drift.uncached_greedy(lm, ids, cfg)[0])}
        rates = interleaved(runs, args.repeats, args.warmup)
        ratio = report(f"greedy, {len(cached_ids)} new tokens (asked {tokens}), same tokens", rates, baseline=UNCACHED)
        rows.append((len(cached_ids), statistics.median(rates[CACHED]), statistics.median(rates[UNCACHED]), ratio))
    print(f"\n{'new tokens':>10} {'cached tok/s':>13} {'uncached tok/s':>15} {'speed-up':>9}")
    for n, cached, uncached, ratio in rows:
        print(f"{n:>10} {cached:>13.2f} {uncached:>15.2f} {ratio:>8.2f}×")


if __name__ == "__main__":
    main()
