"""Benchmark: our beam search with full tree capture vs transformers' generate(num_beams=4), same
process, same model, interleaved runs (a warm-up of each first).

    .venv/bin/python -m bench.beam_vs_generate [--runs 3] [--tokens 64] [--beams 4]

Both searches are the same algorithm and return the same sequences (tests/engine/test_beam.py checks
that), so tokens/s compares the cost of our loop and trace capture against generate()'s loop.
Target: ours / generate >= 0.8. On a shared machine wall-clock times swing with other load, so the
table also shows process CPU seconds, and the ratio is reported per interleaved pair.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch

from engine.strategies import beam
from engine import runner
from engine.config import DecodingConfig
from engine.backends.local import LoadedModel, ModelSpec
from engine.backends.registry import ModelRegistry

PROMPT = "The history of the Roman Empire begins with"
TARGET = 0.8


@dataclass
class Timed:
    wall_s: float
    cpu_s: float
    tokens: int

    @property
    def rate(self) -> float:
        return self.tokens / self.wall_s


def timed(fn, *args) -> Timed:
    wall, cpu = time.perf_counter(), time.process_time()
    tokens = fn(*args)
    return Timed(time.perf_counter() - wall, time.process_time() - cpu, tokens)


def run_ours(lm: LoadedModel, prompt_ids: list[int], config: DecodingConfig) -> int:
    """One traced search (every candidate recorded); returns the best hypothesis' length."""
    return runner.collect(beam.stream(lm, "", prompt_ids, config)).beam.hypotheses[0].length


def run_generate(lm: LoadedModel, prompt_ids: list[int], config: DecodingConfig) -> int:
    ids = torch.tensor([prompt_ids], device=lm.device)
    eos = lm.eos_token_ids[0]
    with torch.inference_mode():
        out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=config.num_beams,
                                max_new_tokens=config.max_new_tokens, length_penalty=config.length_penalty,
                                early_stopping=config.early_stopping, eos_token_id=eos, pad_token_id=eos)
    generated = out[0, len(prompt_ids):].tolist()
    return next((i + 1 for i, t in enumerate(generated) if t == eos), len(generated))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--beams", type=int, default=4)
    args = p.parse_args(argv)
    lm = ModelRegistry().get(ModelSpec())
    config = DecodingConfig(strategy="beam", num_beams=args.beams, max_new_tokens=args.tokens)
    prompt_ids = lm.encode(PROMPT)
    run_ours(lm, prompt_ids, config)  # warm-up
    run_generate(lm, prompt_ids, config)
    pairs = [(timed(run_ours, lm, prompt_ids, config), timed(run_generate, lm, prompt_ids, config))
             for _ in range(args.runs)]
    print(f"{lm.name} on {lm.device} · {args.beams} beams · max_new_tokens {args.tokens} · "
          f"{torch.get_num_threads()} threads · prompt {PROMPT!r}")
    print(f"{'run':>3} | {'ours wall s':>11} {'cpu s':>7} {'tokens':>6} {'tok/s':>6} | "
          f"{'generate wall s':>15} {'cpu s':>7} {'tokens':>6} {'tok/s':>6} | {'ratio':>5}")
    for i, (ours, gen) in enumerate(pairs, start=1):
        print(f"{i:>3} | {ours.wall_s:11.2f} {ours.cpu_s:7.2f} {ours.tokens:6d} {ours.rate:6.2f} | "
              f"{gen.wall_s:15.2f} {gen.cpu_s:7.2f} {gen.tokens:6d} {gen.rate:6.2f} | {ours.rate / gen.rate:5.2f}")
    ratio = statistics.median(o.rate / g.rate for o, g in pairs)
    total = sum(o.tokens for o, _ in pairs) / sum(o.wall_s for o, _ in pairs) / (
        sum(g.tokens for _, g in pairs) / sum(g.wall_s for _, g in pairs))
    cpu = sum(g.cpu_s for _, g in pairs) / sum(o.cpu_s for o, _ in pairs)
    print(f"ratio ours/generate tok/s: median of pairs {ratio:.2f} · over all runs {total:.2f} · "
          f"by CPU time {cpu:.2f} "
          f"(target >= {TARGET}: {'met' if ratio >= TARGET else 'NOT met'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
