"""The batched scheduler against its oracle, ``decode.stream`` run alone: same tokens, same stage top
lists, probabilities within 1e-4, for runs stepped together in one forward (different prompt
lengths, knobs, seeds, stop rules, and a run joining mid-flight). Plus isolation, branching,
cancellation, limits and the per-model registry."""

from __future__ import annotations

import dataclasses
import gc
import threading
import time
import weakref

import pytest

from engine.strategies import decode
from engine import runner
from engine.runner import RunRequest
from engine.config import DecodingConfig
from engine.control import RunControl, RunStopped
from engine.scheduler import Scheduler, SchedulerFull, scheduler_for
from tests.helpers.scheduler import assert_same_steps, run_concurrently  # noqa: F401


def mixed_jobs(lm, prompts, stop_string):
    """8 runs with different lengths and knobs; the last one is the late joiner."""
    ids = [lm.encode(p) for p in prompts]
    configs = [
        DecodingConfig(strategy="greedy", max_new_tokens=24),
        DecodingConfig(strategy="sample", seed=1, max_new_tokens=20),
        DecodingConfig(strategy="sample", seed=2, temperature=0.7, top_k=40, max_new_tokens=18),
        DecodingConfig(strategy="sample", seed=3, top_p=0.8, repetition_penalty=1.3, max_new_tokens=22),
        DecodingConfig(strategy="sample", seed=4, min_p=0.05, frequency_penalty=0.5, presence_penalty=0.3,
                       max_new_tokens=16),
        DecodingConfig(strategy="greedy", no_repeat_ngram_size=2, repetition_penalty=1.2, max_new_tokens=12),
        DecodingConfig(strategy="greedy", stop=(stop_string,), max_new_tokens=24),
        DecodingConfig(strategy="sample", seed=7, temperature=1.3, top_k=100, max_new_tokens=20),
    ]
    return list(zip(ids, configs))


TINY_PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog, then sleeps in the sun all afternoon long.",
                "Once upon a time", "1 2 3 4 5 6 7 8 9 10 11 12", "Q: why is the sky blue?\nA:",
                "zebra", "Marker-alpha: the lighthouse", "Late joiner prompt with a medium number of tokens"]


def stop_from_solo(lm, ids, config):
    """A stop string the greedy run will meet at its 5th step: the text of that step's token."""
    steps = list(decode.stream(lm, ids, config))
    text = lm.decode([s.chosen_token_id for s in steps[:5]])
    return text[-2:] if text.strip() else "e"


def test_batched_runs_equal_solo_runs_tiny(tiny_lm):
    ids6 = tiny_lm.encode(TINY_PROMPTS[6])
    stop = stop_from_solo(tiny_lm, ids6, DecodingConfig(strategy="greedy", max_new_tokens=24))
    jobs = mixed_jobs(tiny_lm, TINY_PROMPTS, stop)
    batched, seen_active = run_concurrently(Scheduler(tiny_lm, max_batch=8), jobs[:7], late=jobs[7])
    assert seen_active[0] >= 1  # the late run joined while others were running
    reasons = set()
    for i, ((ids, config), steps) in enumerate(zip(jobs, batched)):
        solo = list(decode.stream(tiny_lm, ids, config))
        assert_same_steps(steps, solo, f"run {i}")
        reasons.add(solo[-1].finish_reason)
    assert reasons == {"max_new_tokens", "stop_string"}


def test_more_runs_than_rows_wait_and_still_match(tiny_lm):
    """max_batch 2 with 5 runs: the rest queue and join as rows free up."""
    jobs = mixed_jobs(tiny_lm, TINY_PROMPTS, "zzz")[:5]
    scheduler = Scheduler(tiny_lm, max_batch=2)
    batched, _ = run_concurrently(scheduler, jobs)
    for (ids, config), steps in zip(jobs, batched):
        assert_same_steps(steps, list(decode.stream(tiny_lm, ids, config)))
    stats = scheduler.stats()
    assert 1.0 < stats["mean_batch"] <= 2.0 and stats["active"] == 0 and stats["queued"] == 0


def test_isolation_marker_prompts(tiny_lm):
    """Each run's Trace holds only its own prompt and the tokens its solo run gives; the solo runs
    differ, so any swap or mix between rows would show."""
    markers = [f"MARKER-{name} says:" for name in ("RED", "GREEN", "BLUE", "AMBER", "VIOLET", "ONYX")]
    config = DecodingConfig(strategy="sample", seed=11, repetition_penalty=1.5, max_new_tokens=16)
    scheduler = Scheduler(tiny_lm)
    traces: dict[str, object] = {}

    def go(marker):
        traces[marker] = runner.run(RunRequest(tiny_lm, marker, config, scheduler=scheduler))

    threads = [threading.Thread(target=go, args=(m,)) for m in markers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    solos = {m: decode.run(tiny_lm, m, config) for m in markers}
    assert len({tuple(s.generated_token_ids) for s in solos.values()}) == len(markers)
    for marker in markers:
        trace = traces[marker]
        assert trace.prompt == marker and trace.prompt_token_ids == tiny_lm.encode(marker)
        assert trace.generated_token_ids == solos[marker].generated_token_ids
        assert not any(other in trace.text for other in markers if other != marker)


@pytest.mark.parametrize("config", [DecodingConfig(strategy="greedy", max_new_tokens=14),
                                    DecodingConfig(strategy="sample", seed=5, top_k=30, max_new_tokens=14)])
def test_branch_prefix_and_force_equal_decode(tiny_lm, config):
    ids = tiny_lm.encode("Branch from here")
    parent = list(decode.stream(tiny_lm, ids, config))
    prefix, force = [s.chosen_token_id for s in parent[:5]], 1234
    solo = list(decode.stream(tiny_lm, ids, config, prefix=prefix, force=force))
    other = (tiny_lm.encode("a neighbour run"), DecodingConfig(strategy="sample", seed=9, max_new_tokens=14))
    scheduler = Scheduler(tiny_lm)
    results = {}

    def neighbour():
        results["neighbour"] = list(scheduler.stream(*other))

    t = threading.Thread(target=neighbour)
    t.start()
    batched = list(scheduler.stream(ids, config, prefix=prefix, force=force))
    t.join(60)
    assert batched[0].forced and batched[0].chosen_token_id == force and batched[0].index == 5
    assert_same_steps(batched, solo)
    assert_same_steps(results["neighbour"], list(decode.stream(tiny_lm, *other)))


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


LONG = DecodingConfig(strategy="greedy", max_new_tokens=1024)


def test_cancel_frees_the_row(tiny_lm):
    scheduler = Scheduler(tiny_lm)
    control = RunControl()
    stream = scheduler.stream(tiny_lm.encode("cancel me"), LONG, control=control)
    next(stream), next(stream)
    control.cancel()
    with pytest.raises(RunStopped) as stopped:
        for _ in stream:
            pass
    assert stopped.value.reason == "cancelled"
    assert wait_for(lambda: scheduler.stats()["active"] == 0)


@pytest.mark.parametrize("how", ["close", "garbage"])
def test_consumer_leaving_frees_the_row(tiny_lm, how):
    scheduler = Scheduler(tiny_lm)
    stream = scheduler.stream(tiny_lm.encode("walk away"), LONG)
    next(stream)
    assert scheduler.stats()["active"] == 1
    if how == "close":
        stream.close()
    else:
        del stream
        gc.collect()
    assert wait_for(lambda: scheduler.stats()["active"] == 0)
    ticks = scheduler.stats()["ticks"]
    time.sleep(0.2)
    assert scheduler.stats()["ticks"] == ticks  # nothing left running


def test_time_limit_stops_the_run(tiny_lm):
    scheduler = Scheduler(tiny_lm)
    control = RunControl(deadline_s=0.05)
    with pytest.raises(RunStopped) as stopped:
        steps = list(scheduler.stream(tiny_lm.encode("slow"), LONG, control=control))
        assert len(steps) < LONG.max_new_tokens
    assert stopped.value.reason == "time_limit" and "DP_REQUEST_SECONDS" in str(stopped.value)
    assert wait_for(lambda: scheduler.stats()["active"] == 0)


def test_queue_full_raises(tiny_lm):
    scheduler = Scheduler(tiny_lm, max_batch=1, max_queue=1)
    second_control = RunControl()
    first = scheduler.stream(tiny_lm.encode("first"), LONG)
    next(first)
    outcome = []

    def second():
        try:
            list(scheduler.stream(tiny_lm.encode("second"), LONG, control=second_control))
        except RunStopped as stop:
            outcome.append(stop.reason)

    waiting = threading.Thread(target=second)
    waiting.start()
    assert wait_for(lambda: scheduler.stats()["queued"] == 1)
    with pytest.raises(SchedulerFull, match="queue is full.*DP_MAX_QUEUE=1"):
        next(scheduler.stream(tiny_lm.encode("third"), LONG))
    second_control.cancel()  # leaves the line while still waiting for the row
    waiting.join(30)
    assert not waiting.is_alive() and outcome == ["cancelled"] and scheduler.stats()["queued"] == 0
    first.close()
    assert wait_for(lambda: scheduler.stats()["active"] == 0)


def test_close_fails_running_runs_and_ends_the_worker(tiny_lm):
    scheduler = Scheduler(tiny_lm)
    stream = scheduler.stream(tiny_lm.encode("still going"), LONG)
    next(stream)
    scheduler.close()
    assert scheduler._worker is None and scheduler.stats()["active"] == 0
    with pytest.raises(RuntimeError, match="shutting down"):
        for _ in stream:
            pass
    with pytest.raises(RuntimeError, match="shutting down"):
        next(scheduler.stream(tiny_lm.encode("too late"), LONG))


def test_limits_from_environment(tiny_lm, monkeypatch):
    monkeypatch.setenv("DP_MAX_BATCH", "4")
    monkeypatch.setenv("DP_MAX_QUEUE", "9")
    scheduler = Scheduler(tiny_lm)
    assert (scheduler.max_batch, scheduler.max_queue) == (4, 9)
    monkeypatch.setenv("DP_MAX_BATCH", "lots")
    with pytest.raises(ValueError, match="DP_MAX_BATCH: expected an integer >= 1, got 'lots'"):
        Scheduler(tiny_lm)
    monkeypatch.setenv("DP_MAX_BATCH", "0")
    with pytest.raises(ValueError, match="DP_MAX_BATCH"):
        Scheduler(tiny_lm)


def test_rejects_search_strategies_and_empty_prompts(tiny_lm):
    scheduler = Scheduler(tiny_lm)
    with pytest.raises(ValueError, match="strategy: .*'beam'"):
        next(scheduler.stream([1, 2], DecodingConfig(strategy="beam", num_beams=2)))
    with pytest.raises(ValueError, match="prompt: empty"):
        next(scheduler.stream([], DecodingConfig()))


def test_scheduler_for_is_one_per_model_and_does_not_keep_it_alive(tiny_lm):
    lm = dataclasses.replace(tiny_lm)
    found = []
    threads = [threading.Thread(target=lambda: found.append(scheduler_for(lm))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(s) for s in found}) == 1 and scheduler_for(lm) is found[0]
    assert scheduler_for(tiny_lm) is not found[0]
    assert len(list(found[0].stream(lm.encode("hi"), DecodingConfig(strategy="greedy", max_new_tokens=3)))) == 3
    assert wait_for(lambda: found[0]._worker is None)  # idle: no thread holds anything
    ref = weakref.ref(lm)
    del lm
    gc.collect()
    assert ref() is None


EMBEDDED_PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):",
                    "In 1969, the first humans", "List three colours:\n1.", "Why do cats purr? Answer briefly.",
                    "Once upon a time, in a small village at the edge of a dark forest, there lived an old clockmaker "
                    "who", "My favourite recipe for pancakes starts with"]


@pytest.mark.slow
def test_batched_runs_equal_solo_runs_embedded(embedded):
    """The headline: 8 runs on SmolLM2 (greedy, seeded sampling with different knobs, lengths, a stop
    string, EOS from the chat template, and a run joining mid-flight) equal their solo runs."""
    jobs = mixed_jobs(embedded, EMBEDDED_PROMPTS, "\n")
    chat_ids = embedded.encode("What is 2+2? Answer with one number.", chat=True)
    jobs[5] = (chat_ids, DecodingConfig(strategy="greedy", max_new_tokens=24))
    batched, seen_active = run_concurrently(Scheduler(embedded, max_batch=8), jobs[:7], late=jobs[7])
    assert seen_active[0] >= 1
    reasons = []
    for i, ((ids, config), steps) in enumerate(zip(jobs, batched)):
        solo = list(decode.stream(embedded, ids, config))
        assert_same_steps(steps, solo, f"run {i}")
        reasons.append(solo[-1].finish_reason)
    assert reasons[5] == "eos" and reasons[6] == "stop_string" and "max_new_tokens" in reasons


def test_length_groups_sort_and_bound_the_padding():
    """Prompts of 3, 40, 3, 4 and 30 tokens: shortest first; a group holds at most 2x its real tokens
    once padded (3+3+4 padded to 4 is 12 <= 20; adding 30 would be 120 > 2 x 40), so the long
    prompts neither pad the short ones nor delay their first token."""
    from types import SimpleNamespace

    from engine.scheduler import length_groups

    runs = [SimpleNamespace(sequence=[0] * n) for n in (3, 40, 3, 4, 30)]
    groups = length_groups(runs)
    assert [[len(r.sequence) for r in g] for g in groups] == [[3, 3, 4], [30, 40]]
    assert length_groups([]) == []


def test_run_arriving_during_a_forward_gets_its_first_token_before_the_rows_step(tiny_lm):
    """Ticks driven by hand (no worker): run b arrives while a is running; the next tick's forward
    steps a, then b is prefilled and gets its first token before a's step goes out. Both still
    equal their solo runs."""
    import torch

    from engine.scheduler import _Run

    order = []

    class Out(list):
        """A run's stream that records, across runs, the order in which steps went out."""

        def __init__(self, name):
            super().__init__()
            self.name = name

        def put(self, item):
            order.append((self.name, item.index))
            self.append(item)

    jobs = {"a": (tiny_lm.encode("Once upon a time"), DecodingConfig(strategy="sample", seed=3, max_new_tokens=6)),
            "b": (tiny_lm.encode("The quick brown fox jumps"), DecodingConfig(strategy="greedy", max_new_tokens=5))}
    runs = {}
    for name, (ids, config) in jobs.items():
        runs[name] = _Run(tiny_lm, ids, config, (), None, None)
        runs[name].out = Out(name)
    scheduler = Scheduler(tiny_lm, max_batch=4)
    with torch.inference_mode():
        scheduler._tick([runs["a"]])  # a: prefill -> step 0; forward -> step 1
        scheduler._waiting.append(runs["b"])
        scheduler._tick([])
        assert order == [("a", 0), ("a", 1), ("b", 0), ("a", 2)]
        while scheduler._batch.runs:
            scheduler._tick([])
    for name, (ids, config) in jobs.items():
        assert_same_steps(list(runs[name].out), list(decode.stream(tiny_lm, ids, config)), name)


def prefill_same_prompt_once(lm, other: str, monkeypatch):
    """Three lanes of one prompt (seeds 1, 2, 3) and a greedy run of ``other`` join in one tick:
    the prefill forward feeds 2 rows, not 4, the decode forwards 4 rows, and every run still
    equals its solo run (each got its own copy of the shared KV rows)."""
    import torch

    from engine.scheduler import _Run, distinct_sequences

    same = lm.encode("Once upon a time")
    jobs = [(same, DecodingConfig(strategy="sample", seed=seed, max_new_tokens=6)) for seed in (1, 2, 3)]
    jobs.append((lm.encode(other), DecodingConfig(strategy="greedy", max_new_tokens=6)))
    runs = [_Run(lm, ids, config, (), None, None) for ids, config in jobs]
    assert distinct_sequences(runs)[1] == [0, 0, 0, 1]
    shapes = []
    forward = lm.model.forward

    def counting_forward(*args, **kwargs):
        shapes.append(tuple(kwargs["input_ids"].shape))
        return forward(*args, **kwargs)

    monkeypatch.setattr(lm.model, "forward", counting_forward)
    scheduler = Scheduler(lm, max_batch=4)
    with torch.inference_mode():
        scheduler._tick(runs)
        while scheduler._batch.runs:
            scheduler._tick([])
    monkeypatch.undo()
    assert shapes[0] == (2, max(len(same), len(jobs[3][0])))
    assert set(shapes[1:]) == {(4, 1)}
    for i, (run, (ids, config)) in enumerate(zip(runs, jobs)):
        steps = [run.out.get_nowait() for _ in range(run.out.qsize())]
        assert_same_steps(steps, list(decode.stream(lm, ids, config)), f"run {i}")


def test_runs_with_the_same_prompt_are_prefilled_once(tiny_lm, monkeypatch):
    # The random model's distributions are near-flat: "The quick brown fox jumps" has two top-list
    # entries 3e-8 apart, whose order any change of batch shape may flip; this prompt has none.
    prefill_same_prompt_once(tiny_lm, "Q: why is the sky blue?", monkeypatch)


@pytest.mark.slow
def test_runs_with_the_same_prompt_are_prefilled_once_embedded(embedded, monkeypatch):
    prefill_same_prompt_once(embedded, "The quick brown fox jumps", monkeypatch)


def test_runs_sent_together_to_an_idle_scheduler_share_the_first_prefill(tiny_lm, monkeypatch):
    """Four runs (three of one prompt) started in threads at once: the idle scheduler's worker waits
    GATHER_S (0.5 s here, so a loaded machine's thread starts fit in it) and prefills them in one
    forward of 2 rows; every run equals its solo run."""
    import engine.scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "GATHER_S", 0.5)
    same, other = tiny_lm.encode("Once upon a time"), tiny_lm.encode("Q: why is the sky blue?")
    jobs = [(same, DecodingConfig(strategy="sample", seed=seed, max_new_tokens=5)) for seed in (1, 2, 3)]
    jobs.append((other, DecodingConfig(strategy="greedy", max_new_tokens=5)))
    shapes = []
    forward = tiny_lm.model.forward

    def counting_forward(*args, **kwargs):
        shapes.append(tuple(kwargs["input_ids"].shape))
        return forward(*args, **kwargs)

    monkeypatch.setattr(tiny_lm.model, "forward", counting_forward)
    batched, _ = run_concurrently(Scheduler(tiny_lm, max_batch=4), jobs)
    monkeypatch.undo()
    assert shapes[0] == (2, max(len(same), len(other)))
    assert set(shapes[1:]) == {(4, 1)}
    for i, ((ids, config), steps) in enumerate(zip(jobs, batched)):
        assert_same_steps(steps, list(decode.stream(tiny_lm, ids, config)), f"run {i}")


def test_the_app_owns_its_schedulers_and_nothing_is_written_onto_the_model(tiny_lm):
    """#28: schedulers live in a Schedulers the app's Shared owns (no ``lm._scheduler``): two apps
    in one process get their own, a collected model is forgotten."""
    from engine.scheduler import Schedulers
    from playground.shared import Shared

    lm = dataclasses.replace(tiny_lm)
    one, two = (Shared(registry=None, model=None, quantization=None, user_presets=None) for _ in range(2))
    assert one.scheduler_for(lm) is one.scheduler_for(lm) is not two.scheduler_for(lm)
    assert one.scheduler_for(lm) is not scheduler_for(lm)  # nor the process-wide one of the CLI and benchmarks
    assert not hasattr(lm, "_scheduler") and "_scheduler" not in vars(lm)
    own = Schedulers()
    own.get(lm)
    assert len(own) == 1
    del lm
    gc.collect()
    assert len(own) == 0
