"""The grammar stage's costs, measured on the embedded model in one process (issue #39):

1. LLGuidance's table of the tokenizer (built once per tokenizer) and each grammar preset's compile
   (cold, then from the cache);
2. per generated token, the grammar's mask (sync + mask + records) against one forward of the model
   at the same step (the ratio is what the grammar adds to a step), over the JSON preset's greedy run;
3. the distortion lesson (its run, a sweep of seeds and the exact walk) against one greedy run of the
   same prompt;
4. issue #50: a normal user's 16-token greedy run in the batched scheduler beside 1 and 8 runs of the
   tester's ambiguous grammar, as a ratio against the same run alone (the median of ``--repeat``
   timings each). The grammar is refused at its compile now (the time to refuse is printed); to
   measure what the per-step CPU budget alone bounds, the neighbours run with that refusal and
   LLGuidance's tightened fuel switched off (``budget_only``), and how each of them stopped is printed.

    python -m bench.grammar [--repeat 5] [--only neighbours]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import threading
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
from engine.scheduler import Scheduler  # noqa: E402
from engine.stages import build_stage  # noqa: E402
from engine.stages import grammar as grammar_stage  # noqa: E402

PRESETS = ("json-object", "yes-no-maybe", "iso-date", "arithmetic")
HOSTILE = 'root ::= x\nx ::= x x x x | x x x | x x | [a-z] | [a-z][a-z] | ""\n'  # issue #50's 52 characters
WORDS = "thequickbrownfoxjumpsoverthelazydog"
LLGUIDANCE_DEFAULT_LIMITS = dict(max_items_in_row=2_000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
                                 step_max_items=50_000, max_lexer_states=250_000, max_grammar_size=500_000)


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


@contextlib.contextmanager
def budget_only():
    """The grammar stage as it was before issue #50 but for its CPU budget: no refusal at its compile,
    LLGuidance's default fuel (which lets the tester's grammar take seconds per mask)."""
    saved = grammar_stage.check_syntax, grammar_stage.LIMITS
    grammar_stage.check_syntax, grammar_stage.LIMITS = (lambda kind, text: None), LLGUIDANCE_DEFAULT_LIMITS
    grammar_stage._compiled.clear()
    try:
        yield
    finally:
        grammar_stage.check_syntax, grammar_stage.LIMITS = saved
        grammar_stage._compiled.clear()


def together(lm, scheduler: Scheduler, requests: list[tuple[str, DecodingConfig, bool]]) -> tuple[float, list[str]]:
    """Run every (prompt, config, chat) on ``lm`` at once through ``scheduler``: the seconds until
    the first one (the normal user's) ended, and how each ended."""
    ends: list[str] = [""] * len(requests)
    done = threading.Event()
    start = time.perf_counter()
    elapsed = [0.0]

    def one(i: int, prompt: str, config: DecodingConfig, chat: bool) -> None:
        try:
            trace = runner.run(RunRequest(lm, prompt, config, chat=chat, scheduler=scheduler))
            ends[i] = f"{trace.stop_reason} after {len(trace.steps)} tokens"
        except Exception as exc:  # noqa: BLE001 (printed: the budget's one line)
            ends[i] = str(exc)
        if i == 0:
            elapsed[0] = time.perf_counter() - start
            done.set()

    threads = [threading.Thread(target=one, args=(i, *request)) for i, request in enumerate(requests)]
    with scheduler.gathered(len(requests)):
        for thread in threads:
            thread.start()
    for thread in threads:
        thread.join()
    return elapsed[0], ends


def hostile_neighbours(lm, repeat: int) -> None:
    normal = ("Name three colours.", DecodingConfig(strategy="greedy", max_new_tokens=16), True)
    hostile = DecodingConfig(strategy="greedy", grammar=HOSTILE, grammar_kind="gbnf", max_new_tokens=64)
    start = time.perf_counter()
    try:
        grammar_stage.compile_grammar("gbnf", HOSTILE, lm.tokenizer)
    except Exception as exc:  # noqa: BLE001 (the refusal is what is measured)
        print(f"the tester's grammar: refused at its compile in {(time.perf_counter() - start) * 1000:.1f} ms: {exc}")
    scheduler = Scheduler(lm)
    alone = statistics.median(together(lm, scheduler, [normal])[0] for _ in range(repeat))
    print(f"a normal 16-token greedy run alone in the scheduler: {alone:.2f} s (median of {repeat})")
    with budget_only():
        grammar_stage.compile_grammar("gbnf", HOSTILE, lm.tokenizer)  # compiled once, as the app's cache does
        for count in (1, 8):
            # raw text that lowercase letters continue (a chat prompt's reply would end at once: the grammar allows it)
            runs = [together(lm, scheduler, [normal] + [(f"{WORDS[i:]} {WORDS[:i]}", hostile, False)
                                                        for i in range(count)])
                    for _ in range(repeat)]
            beside = statistics.median(seconds for seconds, _ in runs)
            print(f"beside {count} run(s) of the tester's grammar (budget only): {beside:.2f} s, "
                  f"ratio {beside / alone:.2f}x; the normal run: {runs[-1][1][0]}")
            for end in sorted(set(runs[-1][1][1:])):
                print(f"    a hostile run: {end}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="timings per measure (the fastest or the median)")
    parser.add_argument("--only", choices=("neighbours",), help="only the hostile neighbours' measure (issue #50)")
    args = parser.parse_args()
    lm = load_model(ModelSpec())
    if args.only != "neighbours":
        compile_times(lm)
        mask_vs_forward(lm, args.repeat)
        lesson_time(lm)
    hostile_neighbours(lm, args.repeat)


if __name__ == "__main__":
    main()
