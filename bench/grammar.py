"""The grammar stage's costs, measured on the embedded model in one process (issue #39):

1. LLGuidance's table of the tokenizer (built once per tokenizer) and each grammar preset's compile
   (cold, then from the cache);
2. per generated token, the grammar's mask (sync + mask + records) against one forward of the model
   at the same step (the ratio is what the grammar adds to a step), over the JSON preset's greedy run;
3. the distortion lesson (its run, a sweep of seeds and the exact walk) against one greedy run of the
   same prompt.

    python -m bench.grammar [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine import runner  # noqa: E402
from engine.runner import RUNS  # noqa: E402
from engine.backends.local import ModelSpec, load_model  # noqa: E402
from engine.cache import KVCache  # noqa: E402
from engine.config import DecodingConfig  # noqa: E402
from engine.presets import builtin_presets  # noqa: E402
from engine.reports.lessons import builtin_lessons, evaluate, run_lesson  # noqa: E402
from engine.runner import RunRequest  # noqa: E402
from engine.stages import build_stage  # noqa: E402
from engine.stages import grammar as grammar_stage  # noqa: E402

PRESETS = ("json-object", "yes-no-maybe", "iso-date", "arithmetic")


def ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def compile_times(lm) -> None:
    print(f"tokenizer table: {ms(lambda: grammar_stage.llg_tokenizer(lm.tokenizer)):.0f} ms (once per tokenizer)")
    for stem in PRESETS:
        config = builtin_presets()[stem].config
        cold = ms(lambda: grammar_stage.compile_grammar(config.grammar_kind, config.grammar, lm.tokenizer))
        warm = ms(lambda: grammar_stage.compile_grammar(config.grammar_kind, config.grammar, lm.tokenizer))
        print(f"compile {stem:13s} cold {cold:7.2f} ms   cached {warm:6.3f} ms")


@torch.inference_mode()
def mask_vs_forward(lm, repeat: int) -> None:
    config = builtin_presets()["json-object"].config
    trace = runner.run(RunRequest(lm, "Describe a fictional person.", config, chat=True))
    ids = trace.prompt_token_ids + trace.generated_token_ids
    cache = KVCache(lm.model)
    cache.sync(trace.prompt_token_ids)
    masks, forwards = [], []
    stage = build_stage("grammar", config, len(trace.prompt_token_ids), lm.tokenizer, lm.eos_token_ids)
    for at in range(len(trace.steps)):
        context = ids[:len(trace.prompt_token_ids) + at]
        cache.sync(context[:-1])
        forwards.append(min(ms(lambda: cache.sync(context)) for _ in range(1)))
        logits = cache.sync(context)
        row = torch.tensor([context])
        masks.append(min(ms(lambda: stage.apply(row, logits)) for _ in range(repeat)))
    mask, forward = sum(masks) / len(masks), sum(forwards) / len(forwards)
    print(f"per token over {len(masks)} steps: grammar mask {mask:.2f} ms, forward {forward:.1f} ms "
          f"-> the grammar adds {mask / forward:.1%} to a step")


def lesson_time(lm) -> None:
    lesson = builtin_lessons()["grammar"]
    baseline = ms(lambda: runner.run(RunRequest(lm, lesson.prompt, DecodingConfig(strategy="greedy", max_new_tokens=8),
                                                chat=True)))
    total = ms(lambda: evaluate(lm, lesson, run_lesson(lm, lesson, runs=RUNS), runs=RUNS))
    print(f"distortion lesson: {total / 1000:.1f} s (one 8-token greedy run of its prompt: {baseline / 1000:.2f} s, "
          f"ratio {total / baseline:.1f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="mask timings per step (the fastest is kept)")
    args = parser.parse_args()
    lm = load_model(ModelSpec())
    compile_times(lm)
    mask_vs_forward(lm, args.repeat)
    lesson_time(lm)


if __name__ == "__main__":
    main()
