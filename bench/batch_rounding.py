"""How far a run's numbers in a batched forward are from the same run alone (issue #50: a tester saw
per-step probabilities differ by up to 7.5e-6 between concurrent and serial runs).

Eight runs of the embedded model (greedy and seeded sampling with different knobs and lengths) stepped
together by one Scheduler, then each alone through engine.strategies.decode.stream: the tokens must be
equal; the largest |Δ| of every probability the trace records (chosen, raw, each stage's top list) and of
the entropies is printed, with where it was. The batched forward multiplies a [rows, hidden] matrix where
the solo one multiplies [1, hidden]: oneDNN blocks the sums by row count, so they add in another order
(float32 rounding), and a softmax over 49,152 logits carries that to the probabilities.

    python -m bench.batch_rounding [--rows 8] [--tokens 24]
"""

from __future__ import annotations

import argparse
import threading

from engine.backends.local import ModelSpec, load_model
from engine.config import DecodingConfig
from engine.scheduler import Scheduler
from engine.strategies import decode

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):", "In 1969, the first humans",
           "List three colours:\n1.", "Why do cats purr? Answer briefly.", "Once upon a time, in a small village",
           "My favourite recipe for pancakes starts with"]


def configs(tokens: int) -> list[DecodingConfig]:
    return [DecodingConfig(strategy="greedy", max_new_tokens=tokens),
            DecodingConfig(strategy="sample", seed=1, max_new_tokens=tokens),
            DecodingConfig(strategy="sample", seed=2, temperature=0.7, top_k=40, max_new_tokens=tokens),
            DecodingConfig(strategy="sample", seed=3, top_p=0.8, repetition_penalty=1.3, max_new_tokens=tokens),
            DecodingConfig(strategy="sample", seed=4, min_p=0.05, max_new_tokens=tokens),
            DecodingConfig(strategy="greedy", repetition_penalty=1.2, max_new_tokens=tokens),
            DecodingConfig(strategy="sample", seed=7, temperature=1.3, top_k=100, max_new_tokens=tokens),
            DecodingConfig(strategy="sample", seed=9, temperature=1.0, max_new_tokens=tokens)]


def numbers(step) -> dict[str, float]:
    """Every probability and entropy a StepTrace records, by a name that says where it is."""
    out = {"chosen_prob": step.chosen_prob, "raw_prob": step.raw_prob, "entropy": step.entropy,
           "raw_entropy": step.raw_entropy}
    for stage in step.stages:
        for t in stage.top:
            out[f"{stage.name} p(id {t.token_id})"] = t.prob
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=24)
    args = parser.parse_args()
    lm = load_model(ModelSpec())
    jobs = [(lm.encode(p), c) for p, c in zip(PROMPTS[:args.rows], configs(args.tokens)[:args.rows])]
    scheduler, batched = Scheduler(lm, max_batch=args.rows), {}

    def consume(i, ids, config):
        batched[i] = list(scheduler.stream(ids, config))

    threads = [threading.Thread(target=consume, args=(i, *job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    worst = {"probability": (0.0, ""), "entropy": (0.0, "")}
    compared = 0
    for i, (ids, config) in enumerate(jobs):
        solo = list(decode.stream(lm, ids, config))
        assert [s.chosen_token_id for s in solo] == [s.chosen_token_id for s in batched[i]], f"run {i}: tokens differ"
        for a, b in zip(batched[i], solo):
            mine, theirs = numbers(a), numbers(b)
            for key in mine.keys() & theirs.keys():
                compared += 1
                kind = "entropy" if "entropy" in key else "probability"
                delta = abs(mine[key] - theirs[key])
                if delta > worst[kind][0]:
                    worst[kind] = (delta, f"run {i} step {a.index} {key}: {theirs[key]:.6g} alone")
    print(f"{args.rows} runs x {args.tokens} tokens batched vs alone: tokens equal; {compared} numbers compared")
    for kind, (delta, where) in worst.items():
        print(f"largest |delta| of a {kind}: {delta:.2e} ({where})")


if __name__ == "__main__":
    main()
