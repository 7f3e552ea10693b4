"""Where a local token's CPU goes: the model forward against the capture and pick (the stage
chain's records, the pick, the StepTrace: ``core.advance_rows``), at 1 and at 16 rows, greedy and
sampling with three stages, full traces, one torch thread. The scheduler's loop body is driven
directly (one ``KVCache.forward`` of every row, then ``advance_rows``), timed by the process's CPU
time (on a loaded machine wall time mostly measures the other processes); median of ``--repeats``.

    python -m bench.token_split [--tokens 32] [--repeats 5] [--plain]

``--plain`` also times every row with the model's products as F.linear (engine.backends.local.
plain_products: oneDNN's packed weights unused), interleaved in the same process, and prints the
forward's ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.chain_capture import CONFIGS  # noqa: E402
from engine.backends.local import ModelSpec, load_model, plain_products  # noqa: E402
from engine.cache import KVCache  # noqa: E402
from engine.core import RunState, advance_rows  # noqa: E402


def split(lm, config, rows: int, tokens: int) -> tuple[float, float]:
    """CPU seconds in the forwards and in the captures of ``tokens`` steps of ``rows`` runs."""
    prompts = [lm.encode(p, chat=False) for p in _prompts(rows)]
    states = [RunState(lm, ids, config) for ids in prompts]
    width = max(map(len, prompts))
    kv = KVCache(lm.model)
    ids = torch.tensor([[p[0]] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    logits = kv.forward(ids, mask=mask).logits[:, -1, :].float()
    forward = capture = 0.0
    for _ in range(tokens):
        start = time.process_time()
        advance_rows(states, logits)
        mid = time.process_time()
        logits = kv.forward(torch.tensor([[s.last_token] for s in states])).logits[:, -1, :].float()
        capture, forward = capture + mid - start, forward + time.process_time() - mid
    return forward, capture


def _prompts(rows: int) -> list[str]:
    from bench.concurrency import prompt_for
    return [prompt_for(u) for u in range(rows)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--plain", action="store_true", help="also time F.linear products, interleaved")
    args = p.parse_args()
    torch.set_num_threads(1)
    lm = load_model(ModelSpec("embedded"))
    print(f"model {lm.name} ({lm.dtype}, attention {lm.model.config._attn_implementation}), torch threads 1, "
          f"{args.tokens} tokens, load average {os.getloadavg()[0]:.1f}")
    plain = f" {'F.linear forward':>17} {'packed / F.linear':>18}" if args.plain else ""
    print(f"{'config':<24} {'rows':>4} {'forward ms/token':>17} {'capture ms/token':>17} {'capture share':>14}{plain}")
    with torch.inference_mode():
        for name, config in CONFIGS.items():
            for rows in (1, 16):
                split(lm, config, rows, 2)  # warm-up
                runs, plains = [], []
                for _ in range(args.repeats):
                    runs.append(split(lm, config, rows, args.tokens))
                    if args.plain:
                        with plain_products(lm.model):
                            plains.append(split(lm, config, rows, args.tokens)[0])
                fwd, cap = (statistics.median(r[i] for r in runs) for i in (0, 1))
                per = 1000 / (args.tokens * rows)
                line = f"{name:<24} {rows:>4} {fwd * per:>17.2f} {cap * per:>17.2f} {cap / (fwd + cap):>14.1%}"
                if plains:
                    base = statistics.median(plains)
                    line += f" {base * per:>17.2f} {base / fwd:>17.2f}x"
                print(line)
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
