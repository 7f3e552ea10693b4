"""#28: branching and "continue from here" are ``runner.stream(RunRequest(..., prefix=, force=))``: one path with
the runner's guards. ``runner.branch`` only validates, replays the kept steps and streams the rest."""

from __future__ import annotations

import pytest

from engine.strategies import decode
from engine import runner
from engine.runner import RunRequest
from engine.config import STRATEGIES, DecodingConfig

SAMPLE = DecodingConfig(strategy="sample", temperature=0.9, top_k=20, seed=5, max_new_tokens=8)


@pytest.mark.parametrize("config", [SAMPLE.replace(strategy="greedy"), SAMPLE], ids=["greedy", "sample"])
def test_stream_with_prefix_and_force_equals_decode(tiny_lm, config):
    ids = tiny_lm.encode("Once upon", False)
    parent = runner.run(RunRequest(tiny_lm, "Once upon", config))
    prefix, forced = parent.generated_token_ids[:3], 7
    events = list(runner.stream(RunRequest(tiny_lm, "Once upon", config, prefix=prefix, force=forced)))
    steps = [s for e in events for s in e.steps]
    expected = list(decode.stream(tiny_lm, ids, config, prefix=prefix, force=forced))
    assert [s.chosen_token_id for s in steps] == [s.chosen_token_id for s in expected]
    assert steps[0].index == 3 and steps[0].forced and steps[0].chosen_token_id == forced
    assert events[-1].trace.steps == steps  # the continuation's own trace: only the new tokens


def test_branch_is_the_kept_steps_then_the_stream(tiny_lm):
    parent = runner.run(RunRequest(tiny_lm, "Once upon", SAMPLE))
    events = list(runner.branch(tiny_lm, parent, 3, 7))
    assert events[0].steps == parent.steps[:3]
    new = [s for e in events[1:] for s in e.steps]
    streamed = list(runner.stream(RunRequest(tiny_lm, parent.prompt, SAMPLE, prompt_ids=parent.prompt_token_ids,
                                  prefix=parent.generated_token_ids[:3], force=7)))
    assert [s.chosen_token_id for s in new] == streamed[-1].trace.generated_token_ids
    trace = events[-1].trace
    assert trace.branch_of == 3 and trace.generated_token_ids[:4] == parent.generated_token_ids[:3] + [7]
    assert [s.index for s in trace.steps] == list(range(len(trace.steps)))


def test_branch_with_the_runs_own_token_repeats_the_run(tiny_lm):
    parent = runner.run(RunRequest(tiny_lm, "Once upon", SAMPLE))
    again = runner.collect(runner.branch(tiny_lm, parent, 2, parent.generated_token_ids[2]))
    assert again.generated_token_ids == parent.generated_token_ids and again.stop_reason == parent.stop_reason


@pytest.mark.parametrize("strategy", sorted(set(STRATEGIES) - {n for n, s in STRATEGIES.items() if s.continues}))
@pytest.mark.parametrize("argument", ["prefix", "force"])
def test_strategies_that_cannot_continue_refuse_prefix_and_force(tiny_lm, strategy, argument):
    kwargs = {"prefix": [1, 2]} if argument == "prefix" else {"force": 1}
    with pytest.raises(ValueError, match=rf"^{argument}: only greedy and sample runs continue from a step, "
                                         rf"not '{strategy}'$"):
        next(runner.stream(RunRequest(tiny_lm, "hi", DecodingConfig(strategy=strategy, top_k=4), **kwargs)))


@pytest.mark.parametrize("kwargs, message", [({"force": -1}, "force: token -1"),
                                             ({"prefix": [1, 10**6]}, "prefix: token 1000000"),
                                             ({"force": True}, "force: token True")])
def test_stream_refuses_tokens_outside_the_vocabulary(tiny_lm, kwargs, message):
    with pytest.raises(ValueError, match=f"^{message} is out of range"):
        next(runner.stream(RunRequest(tiny_lm, "hi", SAMPLE, **kwargs)))


def test_a_branch_that_runs_out_of_tokens_says_so(tiny_lm):
    """Only the tokens of "cat", none repeated, EOS masked: the run, and a branch of it, end with
    nothing left to pick ("no_tokens_left" on the trace and its last step)."""
    config = DecodingConfig(strategy="greedy", allowed_words=("cat",), no_repeat_ngram_size=1, min_new_tokens=50,
                            max_new_tokens=50)
    parent = runner.run(RunRequest(tiny_lm, "Once upon", config))
    assert parent.stop_reason == "no_tokens_left" and len(parent.steps) >= 2
    trace = runner.collect(runner.branch(tiny_lm, parent, 1, parent.generated_token_ids[1]))
    assert trace.generated_token_ids == parent.generated_token_ids and trace.branch_of == 1
    assert trace.stop_reason == "no_tokens_left" and trace.steps[-1].finish_reason == "no_tokens_left"


STATEFUL = DecodingConfig(strategy="sample", mirostat=2, mirostat_tau=3.0, xtc_threshold=0.05, xtc_probability=0.5,
                          seed=11, max_new_tokens=12)


@pytest.mark.parametrize("through", ["decode", "scheduler"])
def test_a_branch_under_the_runs_own_knobs_takes_its_recorded_state_without_replay(tiny_lm, monkeypatch, through):
    """Mirostat's μ and XTC's coin (#28): branching a stateful run at the first, a middle and the last
    step with the run's own token repeats the run exactly (tokens, p, draws, every stage's state),
    with RunState.replay never called: mirostat's μ comes from the step's record, the draws before
    it are skipped. "Continue with other knobs" still replays (its μ is the new knobs' over the prefix)."""
    from engine import core
    from engine.scheduler import Scheduler

    parent = runner.run(RunRequest(tiny_lm, "A stateful run", STATEFUL))
    assert len(parent.steps) == 12 and any(s.stages[-2].state for s in parent.steps)
    scheduler = Scheduler(tiny_lm) if through == "scheduler" else None
    replayed = []
    real_replay = core.RunState.replay
    monkeypatch.setattr(core.RunState, "replay", lambda self, rows: replayed.append(1) or real_replay(self, rows))
    for at in (0, 6, 11):
        trace = runner.collect(runner.branch(tiny_lm, parent, at, parent.generated_token_ids[at], scheduler=scheduler))
        assert trace.generated_token_ids == parent.generated_token_ids
        for mine, theirs in zip(trace.steps[at + 1:], parent.steps[at + 1:]):
            assert (mine.chosen_prob, mine.draw) == pytest.approx((theirs.chosen_prob, theirs.draw), rel=1e-5)
            for a, b in zip(mine.stages, theirs.stages):
                assert a.name == b.name and a.state.keys() == b.state.keys()
                assert a.state == pytest.approx(b.state, rel=1e-5), a.name
    assert replayed == []  # no step replayed
    other = STATEFUL.replace(mirostat_tau=4.0)
    runner.collect(runner.branch(tiny_lm, parent, 6, None, config=other, scheduler=scheduler))
    assert replayed == [1]  # other knobs: the prefix is replayed under them


def test_a_branch_whose_records_lack_mirostat_s_state_replays_and_still_repeats_the_run(tiny_lm, monkeypatch):
    """A parent trace from outside (an older or edited trace JSON) may carry no ``state`` in its
    records: under its own knobs the branch must not start mirostat afresh from missing μ, it
    replays the prefix instead, and still repeats the run at the first, a middle and the last step."""
    import dataclasses

    from engine import core

    parent = runner.run(RunRequest(tiny_lm, "A stateful run", STATEFUL))
    stripped = dataclasses.replace(parent, steps=[
        dataclasses.replace(step, stages=[dataclasses.replace(s, state={}) for s in step.stages])
        for step in parent.steps])
    replayed = []
    real_replay = core.RunState.replay
    monkeypatch.setattr(core.RunState, "replay", lambda self, rows: replayed.append(1) or real_replay(self, rows))
    for at in (0, 6, 11):
        trace = runner.collect(runner.branch(tiny_lm, stripped, at, parent.generated_token_ids[at]))
        assert trace.generated_token_ids == parent.generated_token_ids
        for mine, theirs in zip(trace.steps[at + 1:], parent.steps[at + 1:]):
            assert (mine.chosen_prob, mine.draw) == pytest.approx((theirs.chosen_prob, theirs.draw), rel=1e-5)
    assert replayed == [1, 1]  # steps 6 and 11 replayed their prefix (step 0 has none)
