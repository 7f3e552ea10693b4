"""The memory side of decoding, measured on one model in one process:

1. cached vs uncached generation at 128 / 512 / 1024 tokens (greedy, the raw model loop; EOS does
   not stop it, so every count is reached). One cached run of 1024 tokens is timed at every step
   (the 128- and 512-token figures sum its first steps). The uncached loop (the whole sequence fed
   again at every step) is quadratic, so it is NOT run to the end: its ms/token is MEASURED at the
   last length of each count and a few lengths between (each right after the cached step at the
   same length, so both see the same load on a shared machine), and a run's total is the sum over
   every step of the linear interpolation between those measurements. Up to --full-uncached tokens it is
   also run end to end, which checks the interpolation. The output labels every row.
2. prefill time vs prompt length (up to a 2,048-token prompt) next to the per-token decode time
   after that prompt: the prefill processes its tokens in parallel (compute-bound), decoding
   reads the whole cache and the weights for every single token (memory-bound).
3. the quantized KV cache: bytes per token measured from the cache tensors vs the formula, and
   its drift against the full-precision cache (engine.reports.drift.kv_drift_report).
4. the self-kv drafters (QuantSpec-style): acceptance rate and speed-up against target-only greedy.

    python -m bench.kv_cache [--tokens 128 512 1024] [--prompt-lengths 128 512 1024 2048]
                             [--drift-tokens 32] [--spec-tokens 64] [--skip speed prefill drift spec]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.reports import drift  # noqa: E402
from engine import runner
from engine.runner import RunRequest
from engine.cache import KVCache  # noqa: E402
from engine.config import DecodingConfig  # noqa: E402
from engine.backends.local import ModelSpec, load_model  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
FILLER = ("The lighthouse stood on a rock at the edge of the bay, and every night its keeper climbed the stairs "
          "to light the lamp, wind the clockwork and write the weather in a book that nobody read. ")


def ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


@torch.inference_mode()
def uncached_ms(lm, ids: list[int]) -> float:
    """One uncached forward over the whole sequence (what every uncached step costs)."""
    return ms(lambda: lm.model(input_ids=torch.tensor([ids], device=lm.device), use_cache=False, logits_to_keep=1))


def interpolated_total(points: list[tuple[int, float]], lengths: range) -> float:
    """Sum over ``lengths`` of the piecewise-linear interpolation of (length, ms) points."""
    total = 0.0
    for length in lengths:
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            if x0 <= length <= x1:
                total += y0 + (y1 - y0) * (length - x0) / max(1, x1 - x0)
                break
    return total


@torch.inference_mode()
def speed(lm, prompt_ids: list[int], counts: list[int], full_uncached: int) -> None:
    """One cached run of max(counts) tokens, timed per step (the n-token figure sums its first n
    steps). At the last step of every count and a few steps between, one uncached forward over the
    same sequence is timed right after the cached step, so both sides see the same machine load."""
    print("\n## cached vs uncached greedy (raw model loop, EOS ignored)")
    longest, p = max(counts), len(prompt_ids)
    marks = {0, *(n - 1 for n in counts), *(round(longest * f) for f in (0.25, 0.5, 0.75))}
    cache, tokens, cached, points = KVCache(lm.model), [], [], []
    for i in range(longest):  # step i reads the prompt and i tokens
        start = time.perf_counter()
        logits = cache.sync(prompt_ids) if i == 0 else cache.step([tokens[-1]])  # [1, V]
        tokens.append(int(logits.argmax()))
        cached.append((time.perf_counter() - start) * 1000)
        if i in marks:
            points.append((p + i, uncached_ms(lm, prompt_ids + tokens[:i])))
    print("paired ms per token at sequence length: " + ", ".join(
        f"{x}: cached {cached[x - p]:.0f} / uncached {y:.0f}" for x, y in points))
    print(f"{'tokens':>7} {'cached tok/s':>13} {'uncached tok/s':>15} {'ratio':>7}  uncached total")
    for n in sorted(counts):
        cached_s = sum(cached[:n]) / 1000
        rows = [("interpolated between the measured lengths", interpolated_total(points, range(p, p + n)) / 1000)]
        if n <= full_uncached:  # also end to end (not paired with the cached steps): checks the interpolation
            sequence = prompt_ids + tokens
            rows.insert(0, (f"end to end ({n} forwards)", sum(uncached_ms(lm, sequence[: p + i]) for i in range(n)) / 1000))
        for how, uncached_s in rows:
            print(f"{n:>7} {n / cached_s:>13.2f} {n / uncached_s:>15.2f} {uncached_s / cached_s:>6.2f}×  {how}")
        first, last = cached[1:min(n, 17)], cached[max(1, n - 16):n]  # step 0 is the prefill
        print(f"{'':>7} cached ms/token over the first {len(first)} steps after the prefill: "
              f"{sum(first) / max(1, len(first)):.1f}, over the last {len(last)}: {sum(last) / max(1, len(last)):.1f}",
              flush=True)


@torch.inference_mode()
def prefill(lm, lengths: list[int]) -> None:
    print("\n## prefill vs decode (fresh cache per prompt length)")
    print(f"{'prompt':>7} {'prefill ms':>11} {'ms / prompt token':>18} {'decode ms / token':>18} {'ratio':>7}")
    filler = lm.encode(FILLER * 64, False)
    for length in lengths:
        ids = (filler * (length // len(filler) + 1))[:length]
        cache = KVCache(lm.model)
        total = ms(lambda: cache.sync(ids))
        decode = sorted(ms(lambda: cache.step([ids[-1]])) for _ in range(5))[2]  # median of 5 steps
        print(f"{length:>7} {total:>11.0f} {total / length:>18.2f} {decode:>18.1f} {decode / (total / length):>6.1f}×",
              flush=True)


def kv_drift(lm, tokens: int, residual: int) -> None:
    print(f"\n## quantized KV cache: {tokens} greedy tokens, residual {residual} (engine.reports.drift.kv_drift_report)")
    report = drift.kv_drift_report(lm, PROMPT, True, tokens, ["dynamic", "quantized-int8", "quantized-int4"],
                                   residual_length=residual)
    print(f"{'kind':>15} {'bytes/token':>12} {'formula':>9} {'cache bytes':>12} {'= formula':>9} {'tok/s':>6} "
          f"{'mean KL':>9} {'top-1':>6} first divergence")
    for k in report.kinds:
        div = "never" if k.first_divergence is None else f"step {k.first_divergence}"
        print(f"{k.kind:>15} {k.bytes_per_token:>12,.0f} {k.formula_bytes_per_token:>9,.0f} {k.cache_bytes:>12,} "
              f"{str(k.cache_bytes == k.formula_bytes):>9} {k.tokens_per_s:>6.2f} {k.mean_kl:>9.2e} "
              f"{k.top1_agreement:>6.0%} {div}", flush=True)
    for kind, message in report.errors.items():
        print(f"{kind:>15} failed: {message}")


def self_kv(lm, tokens: int) -> None:
    print(f"\n## self-kv drafters (QuantSpec-style), greedy, K 4, {tokens} tokens, vs target-only greedy")
    for drafter in ("self-kv8", "self-kv4"):
        config = DecodingConfig(strategy="speculative", temperature=0.0, max_new_tokens=tokens, drafter=drafter,
                                num_draft_tokens=4, kv_residual_length=16, top_n=1)
        trace = runner.run(RunRequest(lm, PROMPT, config, chat=True, compare_baseline=True))
        s = trace.summary
        print(f"{drafter:>9}: accept {s['acceptance_rate']:.1%}, {s['tokens_per_target_forward']:.2f} tokens per "
              f"target forward, speed-up {s['speedup']:.2f}× (same tokens as target-only: {s['baseline_same_tokens']})",
              flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 1024])
    p.add_argument("--full-uncached", type=int, default=128, help="run the uncached loop end to end up to this many tokens")
    p.add_argument("--prompt-lengths", type=int, nargs="+", default=[128, 512, 1024, 2048])
    p.add_argument("--drift-tokens", type=int, default=32)
    p.add_argument("--residual", type=int, default=8)
    p.add_argument("--spec-tokens", type=int, default=64)
    p.add_argument("--skip", nargs="*", default=[], choices=["speed", "prefill", "drift", "spec"])
    p.add_argument("--model", default="embedded")
    args = p.parse_args()
    lm = load_model(ModelSpec(args.model))
    prompt_ids = lm.encode(PROMPT, chat=True)
    print(f"model {lm.name} on {lm.device} ({lm.dtype}), torch threads {torch.get_num_threads()}, "
          f"prompt {len(prompt_ids)} tokens, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    uncached_ms(lm, prompt_ids)  # first-call costs out of the way
    if "speed" not in args.skip:
        speed(lm, prompt_ids, args.tokens, args.full_uncached)
    if "prefill" not in args.skip:
        prefill(lm, args.prompt_lengths)
    if "drift" not in args.skip:
        kv_drift(lm, args.drift_tokens, args.residual)
    if "spec" not in args.skip:
        self_kv(lm, args.spec_tokens)
    print(f"\nload average at the end {os.getloadavg()[0]:.1f} (the machine may be shared: compare ratios, not tok/s)")


if __name__ == "__main__":
    main()
