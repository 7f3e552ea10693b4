"""Is the engine device-agnostic? A check to run on a machine with a CUDA GPU (CI has none).

    python -m deploy.gpu_check [--tokenizer DIR] [--json OUT.json]

A small random Llama over the embedded tokenizer (the tests' tiny model, 4 layers, made on the CPU
and copied to the GPU, so both hold the same weights) runs every strategy the local engine has
that needs no extra weights, through ``engine.runner`` (the app's one entry point):

- float32, CPU vs GPU: the deterministic strategies (greedy, beam, contrastive search,
  contrastive decoding with the model as its own amateur is skipped: it needs bitsandbytes;
  greedy speculative with n-gram drafts, MCTS at temperature 0) give the same tokens on both, and
  each step's raw top-10 probabilities agree to 1e-4;
- sampling: the GPU draws with its own generator (as ``generate()`` does), so its tokens differ
  from the CPU's by design; the same seed gives the same tokens twice on the GPU, and the chain's
  probabilities at each step agree with the CPU's re-processing of the same tokens;
- the batched scheduler on the GPU: four rows (greedy and seeded sampling, two prompt lengths)
  equal four solo runs, token for token;
- the what-if on the GPU: a step re-processed under its own knobs gives its own stages back;
- bfloat16 on the GPU: every strategy runs to its end.

Prints one line per check and exits 1 when any fails. The tokenizer comes from ``--tokenizer`` (a
folder with tokenizer.json), else the embedded model's conversion.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from engine import explore, runner  # noqa: E402
from engine.runner import RunRequest
from engine.config import DecodingConfig  # noqa: E402
from engine.backends.local import LoadedModel  # noqa: E402
from engine.scheduler import Scheduler  # noqa: E402
from engine.trace import Trace  # noqa: E402

PROMPTS = ("The sea is", "Once upon a time, in a small village by the sea, there lived")
DETERMINISTIC = {
    "greedy": {},
    "beam": {"num_beams": 3},
    "contrastive_search": {"penalty_alpha": 0.6, "top_k": 4},
    "speculative": {"drafter": "ngram", "temperature": 0.0},
    "mcts": {"temperature": 0.0},
}


def tiny_llama(vocab_size: int) -> torch.nn.Module:
    """The tests' tiny random Llama (tests/conftest.py's make_tiny_llama), a little deeper."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # spread the logits: random init is near-uniform
    return model


def loaded(model: torch.nn.Module, tokenizer: Any, device: str, dtype: torch.dtype) -> LoadedModel:
    import copy

    moved = copy.deepcopy(model).to(device=device, dtype=dtype)
    return LoadedModel(name=f"tiny-random-llama ({device}, {str(dtype).removeprefix('torch.')})", model=moved,
                       tokenizer=tokenizer, device=torch.device(device), dtype=dtype, quantization="none",
                       source="tiny", eos_token_ids=(2,), memory_bytes=int(moved.get_memory_footprint()))


def raw_tops(trace: Trace) -> list[list[tuple[int, float]]]:
    return [[(t.token_id, t.prob) for t in step.stages[0].top] for step in trace.steps if step.stages]


def close_tops(a: list, b: list, tol: float = 1e-4) -> bool:
    return len(a) == len(b) and all(
        [t for t, _ in x] == [t for t, _ in y] and all(abs(p - q) <= tol for (_, p), (_, q) in zip(x, y))
        for x, y in zip(a, b))


class Checks:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def check(self, name: str, fn: Callable[[], tuple[bool, str]]) -> None:
        start = time.perf_counter()
        try:
            ok, detail = fn()
        except Exception as exc:  # noqa: BLE001 - a check that raises is a failed check, reported
            where = " < ".join(f"{os.path.basename(f.filename)}:{f.lineno}" for f in
                               reversed(traceback.extract_tb(exc.__traceback__)[-4:]))
            ok, detail = False, f"{type(exc).__name__}: {str(exc)[:300]} (at {where})"
        ms = (time.perf_counter() - start) * 1000
        self.rows.append({"check": name, "ok": ok, "detail": detail, "ms": round(ms, 1)})
        print(f"{'PASS' if ok else 'FAIL'}  {name}  ({ms:.0f} ms)  {detail}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", default="", help="a folder with tokenizer.json (default: the embedded model's)")
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--json", default="", help="also write the results here")
    parser.add_argument("--device", default="cuda", help="the device checked against the CPU (cpu: a dry run of "
                                                         "this script itself)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run it on a GPU machine")
        return 2
    from transformers import AutoTokenizer

    if not args.tokenizer:
        from engine.backends.local import embedded_model_dir

        args.tokenizer = str(embedded_model_dir())
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    base = tiny_llama(len(tokenizer))
    cpu = loaded(base, tokenizer, "cpu", torch.float32)
    gpu = loaded(base, tokenizer, args.device, torch.float32)
    half = loaded(base, tokenizer, args.device, torch.bfloat16)
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else args.device
    print(f"gpu_check: {name}, torch {torch.__version__}, "
          f"{sum(p.numel() for p in base.parameters()):,} parameters", flush=True)
    checks = Checks()
    n = args.tokens

    for strategy, knobs in DETERMINISTIC.items():
        for prompt in PROMPTS:
            config = DecodingConfig.from_dict({"strategy": strategy, "max_new_tokens": n, "top_n": 10, **knobs})

            def same(config: DecodingConfig = config, prompt: str = prompt) -> tuple[bool, str]:
                a, b = runner.run(RunRequest(cpu, prompt, config)), runner.run(RunRequest(gpu, prompt, config))
                tops = close_tops(raw_tops(a), raw_tops(b))
                return (a.generated_token_ids == b.generated_token_ids and tops,
                        f"{len(b.generated_token_ids)} tokens, same: {a.generated_token_ids == b.generated_token_ids}, "
                        f"raw top-10 within 1e-4: {tops}")

            checks.check(f"float32 {strategy} cpu == {args.device} ({len(prompt)}-char prompt)", same)

    sample = DecodingConfig.from_dict({"strategy": "sample", "max_new_tokens": n, "temperature": 0.9, "top_p": 0.95,
                                       "min_p": 0.02, "seed": 7, "top_n": 10})

    stateful = DecodingConfig.from_dict({"strategy": "sample", "max_new_tokens": n, "seed": 5, "top_n": 10,
                                         "repetition_penalty": 1.3, "dry_multiplier": 0.8, "xtc_probability": 0.5,
                                         "xtc_threshold": 0.05, "mirostat": 2, "mirostat_tau": 3.0})

    def sampling(sample: DecodingConfig = sample) -> tuple[bool, str]:
        a, b = runner.run(RunRequest(gpu, PROMPTS[1], sample)), runner.run(RunRequest(gpu, PROMPTS[1], sample))
        # the CPU re-processes the GPU's tokens: each step's final distribution must agree
        worst = 0.0
        for i, step in enumerate(a.steps):
            stages = explore.explore_step(cpu, a, i, {})
            final = {t.token_id: t.prob for t in stages[-1].top}
            worst = max([worst, *(abs(final.get(t.token_id, 0.0) - t.prob) for t in step.stages[-1].top)])
        return (a.generated_token_ids == b.generated_token_ids and worst <= 1e-4,
                f"seeded twice equal: {a.generated_token_ids == b.generated_token_ids}; final p vs the CPU's "
                f"re-processing, worst |diff| {worst:.2e}")

    checks.check(f"float32 sampling on {args.device}: seeded, and its chain equals the CPU's", sampling)
    checks.check(f"float32 sampling with penalties, DRY, XTC and mirostat on {args.device}: the same",
                 lambda: sampling(stateful))

    def scheduler() -> tuple[bool, str]:
        runs = [(PROMPTS[0], DecodingConfig(strategy="greedy", max_new_tokens=n)),
                (PROMPTS[1], DecodingConfig(strategy="greedy", max_new_tokens=n)),
                (PROMPTS[0], sample), (PROMPTS[1], sample.replace(seed=8))]
        solo = [runner.run(RunRequest(gpu, p, c)).generated_token_ids for p, c in runs]
        sched = Scheduler(gpu, max_batch=4)
        try:
            import threading

            got: list[Any] = [None] * len(runs)

            def one(i: int) -> None:
                p, c = runs[i]
                got[i] = runner.run(RunRequest(gpu, p, c, scheduler=sched)).generated_token_ids

            threads = [threading.Thread(target=one, args=(i,)) for i in range(len(runs))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            sched.close()
        return got == solo, f"4 rows equal 4 solo runs: {[g == s for g, s in zip(got, solo)]}"

    checks.check(f"float32 batched scheduler on {args.device} == solo runs", scheduler)

    def whatif() -> tuple[bool, str]:
        trace = runner.run(RunRequest(gpu, PROMPTS[1], sample))
        k = len(trace.steps) // 2
        again = explore.explore_step(gpu, trace, k, {})
        a = [[(t.token_id, t.prob) for t in s.top] for s in again]
        b = [[(t.token_id, t.prob) for t in s.top] for s in trace.steps[k].stages]
        return close_tops(a, b, 1e-5), f"step {k} under its own knobs gives its own {len(b)} stages back"

    checks.check(f"what-if on {args.device}", whatif)

    for strategy, knobs in [*DETERMINISTIC.items(), ("sample", {"seed": 3})]:
        config = DecodingConfig.from_dict({"strategy": strategy, "max_new_tokens": n, **knobs})

        def runs(config: DecodingConfig = config) -> tuple[bool, str]:
            trace = runner.run(RunRequest(half, PROMPTS[1], config))
            finite = all(math.isfinite(s.chosen_prob) for s in trace.steps)
            json.loads(trace.to_json())  # strict JSON
            return bool(trace.steps) and finite, f"{len(trace.steps)} tokens, stop {trace.stop_reason}"

        checks.check(f"bfloat16 {strategy} on {args.device} runs to its end", runs)

    failed = [r for r in checks.rows if not r["ok"]]
    print(f"gpu_check: {len(checks.rows) - len(failed)} of {len(checks.rows)} checks passed")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "checks": checks.rows}, f,
                      indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
