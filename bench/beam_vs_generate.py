"""Benchmark: our beam search with full tree capture vs transformers' generate(num_beams=4), same
process, same model, interleaved runs (a warm-up of each first).

    .venv/bin/python -m bench.beam_vs_generate [--runs 3] [--tokens 64] [--beams 4]

Both searches are the same algorithm and return the same sequences (tests/test_beam.py checks
that), so tokens/s compares the cost of our loop and trace capture against generate()'s loop.
Target: ours / generate >= 0.8.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine import beam
from engine.config import DecodingConfig
from engine.models import LoadedModel, ModelRegistry, ModelSpec

PROMPT = "The history of the Roman Empire begins with"
TARGET = 0.8


def run_ours(lm: LoadedModel, prompt_ids: list[int], config: DecodingConfig) -> tuple[float, int]:
    """(seconds, generated tokens of the best hypothesis) for one traced search."""
    start = time.perf_counter()
    trace = list(beam.stream(lm, prompt_ids, config))[-1]
    seconds = time.perf_counter() - start
    assert isinstance(trace, beam.BeamTrace)
    return seconds, trace.hypotheses[0].length


def run_generate(lm: LoadedModel, prompt_ids: list[int], config: DecodingConfig) -> tuple[float, int]:
    ids = torch.tensor([prompt_ids], device=lm.device)
    eos = lm.eos_token_ids[0]
    start = time.perf_counter()
    with torch.inference_mode():
        out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=config.num_beams,
                                max_new_tokens=config.max_new_tokens, length_penalty=config.length_penalty,
                                early_stopping=config.early_stopping, eos_token_id=eos, pad_token_id=eos)
    seconds = time.perf_counter() - start
    generated = out[0, len(prompt_ids):].tolist()
    length = next((i + 1 for i, t in enumerate(generated) if t == eos), len(generated))
    return seconds, length


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
    rows = []
    for i in range(args.runs):
        ours_s, ours_n = run_ours(lm, prompt_ids, config)
        gen_s, gen_n = run_generate(lm, prompt_ids, config)
        rows.append((i + 1, ours_s, ours_n, gen_s, gen_n))
    print(f"{lm.name} on {lm.device} · {args.beams} beams · max_new_tokens {args.tokens} · "
          f"{torch.get_num_threads()} threads · prompt {PROMPT!r}")
    print(f"{'run':>3}  {'ours s':>8} {'tokens':>6} {'tok/s':>7}   {'generate s':>10} {'tokens':>6} {'tok/s':>7}")
    for i, ours_s, ours_n, gen_s, gen_n in rows:
        print(f"{i:>3}  {ours_s:8.2f} {ours_n:6d} {ours_n / ours_s:7.2f}   {gen_s:10.2f} {gen_n:6d} {gen_n / gen_s:7.2f}")
    ours_rate = statistics.median(r[2] / r[1] for r in rows)
    gen_rate = statistics.median(r[4] / r[3] for r in rows)
    ratio = ours_rate / gen_rate
    print(f"median tok/s: ours {ours_rate:.2f} · generate {gen_rate:.2f} · ratio {ratio:.2f} "
          f"(target >= {TARGET}: {'met' if ratio >= TARGET else 'NOT met'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
