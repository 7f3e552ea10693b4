"""engine.core (the pieces every strategy shares) and engine.backends.registry's variant helper.

Oracles: a 4-token distribution checked by hand, ``sampling.sample_probs`` with the same seed,
an uncached loop (the whole sequence fed at every step) driving ``RunState``, and ``decode.stream``
alone for the scheduler's stateful (mirostat + XTC) runs."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

from engine import core, sampling
from engine.strategies import decode
from engine.config import ConfigError, DecodingConfig
from engine.backends.local import EMBEDDED, ModelLoadError, ModelSpec
from engine.backends.registry import SELF_VARIANTS, ModelPolicy, ModelRegistry, resolve_variant, variant_spec
from engine.chain import Chain
from engine.scheduler import Scheduler
from engine.trace import StepTrace

from tests.helpers.common import make_tiny_llama

PROBS = torch.tensor([0.1, 0.4, 0.4, 0.1])  # tokens 1 and 2 tie for the top
STATEFUL = DecodingConfig(strategy="sample", seed=3, xtc_threshold=0.01, xtc_probability=0.5, mirostat=2,
                          mirostat_tau=3.0, max_new_tokens=16)


def four_token_traced(logits: torch.Tensor):
    ids = torch.tensor([[0]])
    return Chain([]).traced(ids, logits, 4, str)


# --- the pick policy -------------------------------------------------------------------------------
def test_greedy_takes_the_lowest_id_of_a_tie():
    chosen = core.pick(four_token_traced(PROBS.log()[None]), None)
    assert chosen.token_id == 1 and chosen.prob == pytest.approx(0.4) and chosen.draw is None


def test_forced_token_keeps_its_probability_and_the_generator_aligned():
    traced = four_token_traced(PROBS.log()[None])
    forced_gen, plain_gen = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    assert core.pick(traced, forced_gen, force=3) == sampling.Pick(3, pytest.approx(0.1))
    sampling.sample_probs(PROBS, plain_gen)  # what an unforced step draws
    assert core.pick(traced, forced_gen) == core.pick(traced, plain_gen)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_seeded_draw_equals_sample_probs(seed):
    traced = four_token_traced(PROBS.log()[None])
    expected = sampling.sample_probs(traced.final_probs, torch.Generator().manual_seed(seed))
    assert core.pick(traced, torch.Generator().manual_seed(seed)) == expected
    assert core.pick(PROBS.log()[None], torch.Generator().manual_seed(seed)) == expected  # final logits alone
    assert expected.low <= expected.draw < expected.high


@pytest.mark.parametrize("logits", [torch.full((1, 4), float("-inf")), torch.tensor([[0.0, float("nan"), 0.0, 0.0]])])
def test_nothing_to_pick_raises_no_tokens_left(logits):
    for generator in (None, torch.Generator().manual_seed(0)):
        with pytest.raises(sampling.NoTokensLeft, match="no_tokens_left at step 5"):
            core.pick(four_token_traced(logits), generator, step=5)


def test_pick_rows_equals_pick_row_by_row():
    """Greedy, seeded, forced and NaN rows in one call: each row's result is the one-row ``pick``'s,
    float for float, and every generator ends where its one-row twin does."""
    finals = [four_token_traced(PROBS.log()[None]), PROBS.log()[None], four_token_traced(PROBS.flip(0).log()[None]),
              torch.tensor([[0.0, float("nan"), 0.0, 0.0]])]
    forces, steps = [None, None, 2, None], [0, 1, 2, 3]
    gens = lambda: [None, torch.Generator().manual_seed(5), torch.Generator().manual_seed(6), None]  # noqa: E731
    rows, alone = gens(), gens()
    got = core.pick_rows(finals, rows, forces, steps)
    for i in range(3):
        assert got[i] == core.pick(finals[i], alone[i], forces[i], step=steps[i]), i
    assert isinstance(got[3], sampling.NoTokensLeft) and got[3].step == 3
    assert got[1].draw is not None and got[2] == sampling.Pick(2, pytest.approx(0.4))
    for a, b in zip(rows[1:3], alone[1:3]):
        assert torch.equal(a.get_state(), b.get_state())


def test_one_implementation_of_the_pick_and_the_step(tiny_lm, monkeypatch):
    """``pick`` and ``RunState.advance`` are the one-row cases of ``pick_rows`` and ``advance_rows``
    (no second copy of the policy or the loop body to drift apart)."""
    calls = []
    for name in ("pick_rows", "advance_rows"):
        real = getattr(core, name)
        monkeypatch.setattr(core, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    core.pick(PROBS.log()[None], None)
    state = core.RunState(tiny_lm, [1, 2, 3], DecodingConfig(strategy="sample", seed=0, max_new_tokens=2))
    state.advance(torch.zeros(1, tiny_lm.vocab_size))
    assert calls == ["pick_rows", "advance_rows", "pick_rows"]


def test_empty_prompt_is_refused():
    with pytest.raises(ValueError, match="^prompt: empty after tokenisation"):
        core.check_prompt([])
    core.check_prompt([0])


def test_run_summary_by_hand():
    steps = [StepTrace(i, 0, "", p, r, None, None, None, h, h, []) for i, (p, r, h) in
             enumerate([(0.5, 0.25, 1.0), (0.25, 0.5, 2.0)])]
    summary = core.run_summary(steps)
    assert summary["mean_logprob"] == pytest.approx((math.log(0.5) + math.log(0.25)) / 2)
    assert summary["perplexity"] == pytest.approx(math.exp(-(math.log(0.25) + math.log(0.5)) / 2))  # 2√2
    assert summary["perplexity"] == pytest.approx(2 * math.sqrt(2))
    assert summary["mean_entropy"] == 1.5 and core.run_summary([]) == {"tokens": 0}


# --- RunState: the loop body of decode and the scheduler ---------------------------------------------
@torch.inference_mode()
def uncached_steps(lm, prompt_ids, config, prefix=(), force=None):
    """RunState driven by full-sequence forwards (no KV cache; a stateful prefix replayed from one
    forward's logits)."""
    state = core.RunState(lm, prompt_ids, config, prefix=prefix, force=force)
    if state.needs_replay:
        rows = lm.model(input_ids=state.ids).logits[0, len(prompt_ids) - 1:-1].float()
        state.replay(rows)
    steps = []
    while True:
        step = state.advance(lm.model(input_ids=state.ids).logits[:, -1, :].float())
        steps.append(step)
        if step.finish_reason is not None:
            return steps


def assert_same(steps, reference):
    assert [s.chosen_token_id for s in steps] == [s.chosen_token_id for s in reference]
    assert [s.finish_reason for s in steps] == [s.finish_reason for s in reference]
    for a, b in zip(steps, reference):
        assert (a.index, a.forced) == (b.index, b.forced)
        assert a.chosen_prob == pytest.approx(b.chosen_prob, abs=1e-4)
        assert (a.draw is None) == (b.draw is None) and (a.draw is None or a.draw == pytest.approx(b.draw, abs=1e-4))
        assert [s.params.get("fired") for s in a.stages] == [s.params.get("fired") for s in b.stages]
        mu = [s.params.get("mu") for s in a.stages if s.name == "mirostat"]
        assert mu == pytest.approx([s.params.get("mu") for s in b.stages if s.name == "mirostat"], abs=1e-4)


@pytest.mark.parametrize("config", [DecodingConfig(strategy="greedy", repetition_penalty=1.3, max_new_tokens=12),
                                    STATEFUL])
def test_run_state_equals_decode_stream(tiny_lm, config):
    ids = tiny_lm.encode("The shared core")
    reference = list(decode.stream(tiny_lm, ids, config))
    assert_same(uncached_steps(tiny_lm, ids, config), reference)
    if config.mirostat:  # the stateful stages did something: μ moved and XTC both fired and held back
        mus = [s.params["mu"] for step in reference for s in step.stages if s.name == "mirostat"]
        fired = {s.params["fired"] for step in reference for s in step.stages if s.name == "xtc"}
        assert len(set(mus)) > 1 and fired == {True, False}


def test_run_state_branch_replays_a_stateful_prefix(tiny_lm):
    ids = tiny_lm.encode("The shared core")
    parent = list(decode.stream(tiny_lm, ids, STATEFUL))
    prefix = [s.chosen_token_id for s in parent[:6]]
    # continuing with the token the parent chose reproduces the parent (μ and the draws replayed)
    again = list(decode.stream(tiny_lm, ids, STATEFUL, prefix=prefix, force=parent[6].chosen_token_id))
    assert [s.chosen_token_id for s in again] == [s.chosen_token_id for s in parent[6:]]
    branched = uncached_steps(tiny_lm, ids, STATEFUL, prefix=prefix, force=42)
    assert_same(branched, list(decode.stream(tiny_lm, ids, STATEFUL, prefix=prefix, force=42)))
    with pytest.raises(RuntimeError, match="replay"):
        core.RunState(tiny_lm, ids, STATEFUL, prefix=prefix).advance(torch.zeros(1, tiny_lm.vocab_size))


@pytest.mark.parametrize("branch", [False, True])
def test_scheduler_with_stateful_stages_equals_decode(tiny_lm, branch):
    """Mirostat's μ and XTC's coin per row, batched with a plain neighbour; a branch of such a run
    is prefilled alone with its prefix's logits and replayed."""
    ids, other = tiny_lm.encode("The shared core"), tiny_lm.encode("A neighbour, longer than the other prompt")
    parent = list(decode.stream(tiny_lm, ids, STATEFUL))
    kwargs = {"prefix": [s.chosen_token_id for s in parent[:5]], "force": 42} if branch else {}
    neighbour = DecodingConfig(strategy="sample", seed=9, max_new_tokens=16)
    scheduler = Scheduler(tiny_lm, max_batch=4)
    plain = scheduler.stream(other, neighbour)
    first = next(plain)  # the neighbour holds a row, so the stateful run joins a running batch
    batched = list(scheduler.stream(ids, STATEFUL, **kwargs))
    assert_same(batched, list(decode.stream(tiny_lm, ids, STATEFUL, **kwargs)))
    assert_same([first, *plain], list(decode.stream(tiny_lm, other, neighbour)))


# --- the variant helper --------------------------------------------------------------------------------
class OneModel:
    """A registry stand-in that hands out one model and records what was asked."""

    def __init__(self, lm):
        self.lm, self.asked = lm, []

    def get(self, spec, progress=None, *, key="model"):
        self.asked.append((spec, key))
        return self.lm


def test_variant_spec_on_the_target_device_and_dtype(tiny_lm):
    assert variant_spec(tiny_lm, "self-nf4", "drafter") == ModelSpec(tiny_lm.source, "nf4", "cpu", "float32")
    assert variant_spec(tiny_lm, "model:org/x", "amateur") == ModelSpec("org/x", "none", "cpu", "float32")
    for bad in ("self-int4", "org/x", "model:", ""):
        expected = " | ".join(SELF_VARIANTS + ("model:<id or dir>",))  # self-int8 | self-nf4 | self-<4-bit> ...
        with pytest.raises(ConfigError, match=f"^amateur: expected {re.escape(expected)}, got {bad!r}"):
            variant_spec(tiny_lm, bad, "amateur")


def test_resolve_variant_loads_through_the_registry_and_checks_the_tokenizer(tiny_lm):
    registry = OneModel(tiny_lm)
    assert resolve_variant(tiny_lm, "self-int8", registry, "drafter") is tiny_lm
    assert registry.asked == [(ModelSpec(tiny_lm.source, "int8", "cpu", "float32"), "drafter")]
    small = dataclasses.replace(tiny_lm, name="small", model=make_tiny_llama(vocab_size=1000, layers=1, hidden=32))
    with pytest.raises(ConfigError, match="^drafter: 'model:small' \\(small\\) scores 1000 tokens but the tokenizer has 49152"):
        resolve_variant(tiny_lm, "model:small", OneModel(small), "drafter")
    other_tokenizer = type("Tok", (), {"get_vocab": lambda self: {"a": 0}, "__len__": lambda self: 1})()
    other = dataclasses.replace(tiny_lm, name="other", tokenizer=other_tokenizer)
    with pytest.raises(ConfigError, match="^amateur: 'model:o' \\(other\\) uses a different tokenizer .*1 vs 49152 tokens"):
        resolve_variant(tiny_lm, "model:o", OneModel(other), "amateur")


def test_resolve_variant_applies_the_registry_policy(tiny_lm, monkeypatch):
    monkeypatch.setattr("engine.backends.registry.load_model", lambda spec, progress=None: pytest.fail("loaded"))
    registry = ModelRegistry(policy=ModelPolicy((EMBEDDED,)))
    with pytest.raises(ModelLoadError, match="^amateur: '/etc' is not offered here"):
        resolve_variant(tiny_lm, "model:/etc", registry, "amateur")


@pytest.mark.parametrize("batched", [False, True])
def test_a_middle_stage_records_the_picked_token_s_p_where_its_top_n_misses_it(tiny_lm, batched):
    """top_n = 1 keeps one token per stage: at T = 4 the pick is rarely the top one, so a stage
    between raw and final records the picked token's p (``StageTrace.chosen_prob``). Oracle: the
    step's raw logits recomputed without a cache (explore.raw_logits), divided by T (after the
    temperature stage), then cut to the top 40 and renormalised (after top-k)."""
    from engine import explore, runner
    from engine.runner import RunRequest
    from playground.charts.step import stage_chart

    config = DecodingConfig(strategy="sample", temperature=4.0, top_k=40, top_n=1, max_new_tokens=12, seed=2,
                            stage_order=("temperature", "top_k"))
    scheduler = Scheduler(tiny_lm, max_batch=4) if batched else None
    try:
        trace = runner.run(RunRequest(tiny_lm, "The sea is", config, scheduler=scheduler))
    finally:
        if scheduler is not None:
            scheduler.close()
    checked = 0
    for i, step in enumerate(trace.steps):
        assert [s.name for s in step.stages] == ["raw", "temperature", "top_k", "final"]
        scaled = explore.raw_logits(tiny_lm, trace, i)[0].float() / 4.0
        cut = scaled.masked_fill(scaled < torch.topk(scaled, 40).values[-1], float("-inf"))
        oracle = {"temperature": torch.softmax(scaled, -1), "top_k": torch.softmax(cut, -1)}
        for stage in step.stages[1:-1]:
            if stage.top[0].token_id == step.chosen_token_id:
                assert stage.chosen_prob is None  # its top-N says it
                continue
            checked += 1
            assert stage.chosen_prob == pytest.approx(float(oracle[stage.name][step.chosen_token_id]), rel=1e-4)
        assert step.stages[0].chosen_prob is None and step.stages[-1].chosen_prob is None  # raw_prob, chosen_prob
        texts = [t for bar in stage_chart(step).data if bar.type == "bar" for t in (bar.text or ())]
        assert "p not recorded" not in texts
    assert checked >= 6, checked  # most picks at T = 4 are not a stage's top token
