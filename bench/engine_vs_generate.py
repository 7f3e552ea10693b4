"""Engine greedy with full per-stage trace capture vs transformers' model.generate greedy: same
model, prompt and token count, interleaved in one process. Prints tokens/s and the ratio.

    python -m bench.engine_vs_generate [--tokens 64] [--repeats 3] [--model embedded] [--stages]

``--stages`` adds a sampling run (T 0.8, top-k 50, top-p 0.9, seeded) against generate(do_sample=True)
with the same knobs and seed (same tokens, by the sampler's construction).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import interleaved, report  # noqa: E402
from engine.strategies import decode  # noqa: E402
from engine.config import DecodingConfig  # noqa: E402
from engine.backends.local import ModelSpec, load_model  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", default="embedded")
    p.add_argument("--stages", action="store_true")
    args = p.parse_args()
    lm = load_model(ModelSpec(args.model))
    ids = lm.encode(PROMPT, chat=True)
    print(f"model {lm.name} on {lm.device} ({lm.dtype}), torch threads {torch.get_num_threads()}, prompt {len(ids)} tokens")
    cases = [("greedy", DecodingConfig(strategy="greedy", max_new_tokens=args.tokens), {"do_sample": False})]
    if args.stages:
        knobs = {"temperature": 0.8, "top_k": 50, "top_p": 0.9}
        cases.append(("sample T0.8 k50 p0.9", DecodingConfig(strategy="sample", seed=0, max_new_tokens=args.tokens, **knobs),
                      {"do_sample": True, **knobs}))
    for name, cfg, gen_kwargs in cases:
        n = len(list(decode.stream(lm, ids, cfg)))
        tensor = torch.tensor([ids], device=lm.device)

        def ours() -> int:
            return len(list(decode.stream(lm, ids, cfg)))

        def generate() -> int:
            torch.manual_seed(cfg.seed)
            out = lm.model.generate(tensor, attention_mask=torch.ones_like(tensor), max_new_tokens=args.tokens,
                                    min_new_tokens=n, **gen_kwargs)
            return out.shape[1] - tensor.shape[1]

        rates = interleaved({f"engine {name} (full trace)": ours, f"model.generate {name}": generate}, args.repeats)
        report(f"{name}: {n} tokens", rates, baseline=f"model.generate {name}")


if __name__ == "__main__":
    main()
