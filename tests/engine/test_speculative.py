"""Speculative decoding: greedy output equals target-only greedy (every drafter), sampling is exact
(chi-square against the target's own distribution, with a broken rule shown to fail), seeded runs
repeat, and rewound caches equal a fresh prefill."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from tests.helpers.common import make_tiny_llama
from engine.strategies import decode
from engine import runner
from engine.runner import RunRequest
from engine.cache import KVCache
from engine.config import DecodingConfig
from engine.backends.local import LoadedModel
from engine.backends.registry import ModelRegistry
from engine.strategies.speculative import (DrafterError, ModelDrafter, NgramDrafter, acceptance_probability, assemble, next_k, prompt_lookup, residual_distribution, rounds, rounds_of)
from engine.trace import Trace
from tests.helpers.speculative import chi_square_p, exact_two_token_joint, wrap  # noqa: F401

PROMPT = "The cat sat on the mat. The cat sat on the"
GREEDY = DecodingConfig(strategy="speculative", temperature=0.0, max_new_tokens=24, num_draft_tokens=4)


def perturbed(model, scale: float, seed: int = 7):
    """A copy of ``model`` with noise on its output layer: a draft that agrees often, not always."""
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w = other.lm_head.weight
        w.add_(scale * w.std() * torch.randn(w.shape, generator=gen))
    return other


def save_model(model, tokenizer, folder) -> str:
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def target_only(lm: LoadedModel, prompt: str, config: DecodingConfig, chat: bool = False) -> list[int]:
    base = config.replace(strategy="greedy" if config.is_greedy else "sample")
    return decode.run(lm, prompt, base, chat=chat).generated_token_ids


def run_with(lm: LoadedModel, draft: LoadedModel | None, config: DecodingConfig, prompt: str = PROMPT) -> Trace:
    drafter = ModelDrafter(draft) if draft is not None else NgramDrafter(config.ngram_size)
    ids = lm.encode(prompt)
    return assemble(lm, prompt, ids, config, list(rounds(lm, ids, config, drafter)), drafter, False)


# --- the rules by hand ------------------------------------------------------------------------
def test_acceptance_and_residual_on_a_4_token_pair():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.25, 0.5, 0.125, 0.125])
    p_before, q_before = p.clone(), q.clone()
    assert acceptance_probability(p, q).tolist() == pytest.approx([1.0, 0.6, 1.0, 0.0])
    # max(0, p - q) = [0.25, 0, 0.075, 0] -> normalised by 0.325
    assert residual_distribution(p, q).tolist() == pytest.approx([0.25 / 0.325, 0.0, 0.075 / 0.325, 0.0])
    assert residual_distribution(p, p).tolist() == pytest.approx(p.tolist())  # nothing left: falls back to p
    assert torch.equal(p, p_before) and torch.equal(q, q_before)  # inputs untouched


def test_prompt_lookup_copies_what_followed_the_last_ngram():
    tokens = [5, 6, 7, 8, 9, 1, 5, 6, 7]
    assert prompt_lookup(tokens, 3, 2) == [8, 9]
    assert prompt_lookup(tokens, 3, 10) == [8, 9, 1, 5, 6, 7]  # stops at the end of the text
    assert prompt_lookup([1, 2, 3, 4, 3], 2, 2) == [4, 3]  # no 2-gram match: falls back to n = 1
    assert prompt_lookup([1, 2, 3], 3, 4) == []
    assert prompt_lookup(tokens, 3, 0) == []
    # latest occurrence with a full continuation wins over an earlier one
    assert prompt_lookup([1, 2, 3, 1, 2, 4, 9, 1, 2], 2, 2) == [4, 9]


def test_next_k_grows_after_full_acceptance_and_shrinks_otherwise():
    assert next_k(4, 4, 4) == 6 and next_k(16, 16, 16) == 16
    assert next_k(4, 4, 2) == 3 and next_k(1, 1, 0) == 1
    assert next_k(4, 2, 2) == 4  # fewer drafts than K (n-gram miss, budget): no evidence either way


# --- exactness: vectorised harness over a hand-built pair -------------------------------------
def spec_position(p, q, gen, accept, residual):
    """One speculative position for n rows at once (p, q: [n, V]) -> (token [n], accepted [n])."""
    x = torch.multinomial(q, 1, generator=gen)  # [n, 1] draft
    u = torch.rand(x.shape[0], generator=gen)
    accepted = u < accept(p.gather(1, x), q.gather(1, x))[:, 0]
    y = torch.multinomial(residual(p, q), 1, generator=gen)
    return torch.where(accepted, x[:, 0], y[:, 0]), accepted


def spec_two_tokens(p1, p2, q1, q2, k, n, seed, accept=acceptance_probability, residual=residual_distribution):
    """First two tokens of speculative sampling with K = k, n samples. p1, q1: [V]; p2, q2: [V, V]
    (row = the first token). With K >= 2 token 2 is always one more speculative position (same
    round, or the next round after a rejection); with K = 1 an accepted draft earns a bonus ~ p."""
    gen = torch.Generator().manual_seed(seed)
    t1, acc1 = spec_position(p1.expand(n, -1), q1.expand(n, -1), gen, accept, residual)
    t2, _ = spec_position(p2[t1], q2[t1], gen, accept, residual)
    if k == 1:
        bonus = torch.multinomial(p2[t1], 1, generator=gen)[:, 0]
        t2 = torch.where(acc1, bonus, t2)
    return t1, t2


def hand_pair():
    """A 6-token target/draft pair that disagree a lot; the target rules out token 5 (p = 0)."""
    gen = torch.Generator().manual_seed(2024)
    p1 = torch.tensor([0.40, 0.25, 0.15, 0.12, 0.08, 0.0])
    q1 = torch.tensor([0.10, 0.15, 0.30, 0.20, 0.15, 0.10])
    p2 = torch.softmax(1.5 * torch.randn(6, 6, generator=gen), dim=1)
    p2[:, 5] = 0
    p2 = p2 / p2.sum(1, keepdim=True)
    q2 = torch.softmax(1.5 * torch.randn(6, 6, generator=gen), dim=1)
    return p1, p2, q1, q2


N_SAMPLES = 40_000


@pytest.mark.parametrize("k", [1, 2])
def test_speculative_sampling_matches_target_distribution(k):
    p1, p2, q1, q2 = hand_pair()
    t1, t2 = spec_two_tokens(p1, p2, q1, q2, k, N_SAMPLES, seed=11)
    assert chi_square_p(t1, t2, p1[:, None] * p2) > 1e-3
    assert int((t1 == 5).sum()) == 0 and int((t2 == 5).sum()) == 0  # p = 0 is never emitted


@pytest.mark.parametrize("broken", ["accept_q_over_p", "resample_from_p", "reversed_residual"])
def test_broken_rules_fail_the_same_test(broken):
    p1, p2, q1, q2 = hand_pair()
    rules = {
        "accept_q_over_p": dict(accept=lambda p, q: torch.clamp(q / p, max=1.0)),
        "resample_from_p": dict(residual=lambda p, q: p),
        "reversed_residual": dict(residual=lambda p, q: residual_distribution(q, p)),
    }
    t1, t2 = spec_two_tokens(p1, p2, q1, q2, 2, N_SAMPLES, seed=11, **rules[broken])
    assert chi_square_p(t1, t2, p1[:, None] * p2) < 1e-6


# --- exactness through the real engine loop ---------------------------------------------------
@pytest.fixture(scope="module")
def tiny8(tiny_lm):
    """Target and draft: two different 1-layer random Llamas over an 8-token vocabulary."""
    target = wrap(make_tiny_llama(vocab_size=8, seed=0, layers=1, hidden=32), tiny_lm, "tiny8-target", eos=())
    draft = wrap(make_tiny_llama(vocab_size=8, seed=1, layers=1, hidden=32), tiny_lm, "tiny8-draft", eos=())
    return target, draft


E2E_RUNS = 1500  # seeds 0..1499; each is a whole engine run (draft model, verify, rewind), so fewer than above


def test_engine_loop_samples_the_target_distribution(tiny8):
    target, draft = tiny8
    prompt_ids = [3]  # one token: no target prefill, the first verify pass feeds it
    config = DecodingConfig(strategy="speculative", temperature=2.0, top_k=6, frequency_penalty=1.0,
                            max_new_tokens=3, num_draft_tokens=2, top_n=3)
    joint = exact_two_token_joint(target, prompt_ids, config)
    firsts, seconds, rejected = [], [], 0
    for seed in range(E2E_RUNS):
        cfg = dataclasses.replace(config, seed=seed)
        collected = list(rounds(target, prompt_ids, cfg, ModelDrafter(draft)))
        tokens = [t for r in collected for t in r.emitted_token_ids]
        firsts.append(tokens[0])
        seconds.append(tokens[1])
        rejected += any(d.resampled is not None for r in collected for d in r.drafted)
    assert 0.1 * E2E_RUNS < rejected < 0.9 * E2E_RUNS  # both the accept and the residual paths were taken often
    assert chi_square_p(torch.tensor(firsts), torch.tensor(seconds), joint) > 1e-3


# --- greedy oracles on tiny models ------------------------------------------------------------
@pytest.mark.parametrize("knobs", [{}, {"repetition_penalty": 1.5, "no_repeat_ngram_size": 2}])
def test_greedy_model_drafter_from_a_directory_equals_target_only(tiny_lm, tmp_path, knobs):
    draft_dir = save_model(perturbed(tiny_lm.model, 0.5), tiny_lm.tokenizer, tmp_path / "draft")
    config = GREEDY.replace(drafter=f"model:{draft_dir}", **knobs)
    trace = runner.run(RunRequest(tiny_lm, PROMPT, config, registry=ModelRegistry(capacity=1)))
    assert trace.generated_token_ids == target_only(tiny_lm, PROMPT, config)
    recorded = rounds_of(trace)
    drafted = [d for r in recorded for d in r.drafted]
    assert any(d.accepted for d in drafted) and any(not d.accepted for d in drafted)
    assert [t for r in recorded for t in r.emitted_token_ids] == trace.generated_token_ids
    assert trace.summary["accepted"] == sum(d.accepted for d in drafted)


def test_a_draft_model_with_another_vocabulary_is_refused(tiny_lm, tmp_path):
    small = save_model(make_tiny_llama(vocab_size=1000, seed=3, layers=1, hidden=32), tiny_lm.tokenizer, tmp_path / "small")
    with pytest.raises(DrafterError, match="scores 1000 tokens"):
        runner.run(RunRequest(tiny_lm, PROMPT, GREEDY.replace(drafter=f"model:{small}"), registry=ModelRegistry(capacity=1)))
    tokenizer = copy.deepcopy(tiny_lm.tokenizer)
    tokenizer.add_tokens(["<zebra-token>"])
    other = save_model(make_tiny_llama(vocab_size=49153, seed=3, layers=1, hidden=32), tokenizer, tmp_path / "other")
    with pytest.raises(DrafterError, match="different vocabulary"):
        runner.run(RunRequest(tiny_lm, PROMPT, GREEDY.replace(drafter=f"model:{other}"), registry=ModelRegistry(capacity=1)))


def test_stops_at_eos_inside_a_round_like_target_only(tiny_lm):
    reference = target_only(tiny_lm, PROMPT, GREEDY)
    eos = next(t for i, t in enumerate(reference) if i >= 5 and t not in reference[:i])
    lm = wrap(tiny_lm.model, tiny_lm, "tiny-eos", eos=(eos,))
    trace = run_with(lm, wrap(tiny_lm.model, tiny_lm, "same-weights"), GREEDY)
    assert trace.generated_token_ids == target_only(lm, PROMPT, GREEDY) == reference[: reference.index(eos) + 1]
    assert trace.stop_reason == "eos" and trace.steps[-1].finish_reason == "eos"


@pytest.mark.parametrize("max_new_tokens", [1, 7])
def test_budget_is_exact_with_a_perfect_drafter(tiny_lm, max_new_tokens):
    config = GREEDY.replace(max_new_tokens=max_new_tokens, adaptive_k=True, num_draft_tokens=2)
    trace = run_with(tiny_lm, wrap(tiny_lm.model, tiny_lm, "same-weights"), config)
    assert trace.generated_token_ids == target_only(tiny_lm, PROMPT, config)
    assert len(trace.generated_token_ids) == max_new_tokens and trace.stop_reason == "max_new_tokens"
    if max_new_tokens == 7:
        assert trace.summary["acceptance_rate"] == 1.0  # same weights: every draft passes, so K grows 2 -> 4 (budget caps the drafts)
        assert [r.k for r in trace.rounds] == [2, 4]
        assert trace.summary["target_forwards"] == 1 + 2  # prefill + two verify passes for 7 tokens


# --- sampling: reproducible, caches rewound ---------------------------------------------------
SAMPLING = DecodingConfig(strategy="speculative", temperature=0.8, top_k=40, seed=5, max_new_tokens=20,
                          num_draft_tokens=3)


def test_seeded_speculative_sampling_repeats(tiny_lm):
    draft = wrap(perturbed(tiny_lm.model, 0.3), tiny_lm, "draft")
    first, again = run_with(tiny_lm, draft, SAMPLING), run_with(tiny_lm, draft, SAMPLING)
    other = run_with(tiny_lm, draft, SAMPLING.replace(seed=6))
    assert first.generated_token_ids == again.generated_token_ids
    assert [d.u for r in first.rounds for d in r.drafted] == [d.u for r in again.rounds for d in r.drafted]
    assert first.generated_token_ids != other.generated_token_ids


def assert_cache_equals_prefill(cache: KVCache, model) -> None:
    fresh = KVCache(model)
    fresh.forward(torch.tensor([cache.tokens]))
    assert cache.length == fresh.length == len(cache.tokens)
    for mine, ref in zip(cache.cache.layers, fresh.cache.layers):
        assert torch.allclose(mine.keys, ref.keys, atol=1e-5, rtol=1e-4)
        assert torch.allclose(mine.values, ref.values, atol=1e-5, rtol=1e-4)


def test_rewound_caches_equal_a_fresh_prefill(tiny_lm):
    draft_lm = wrap(perturbed(tiny_lm.model, 0.3), tiny_lm, "draft")
    drafter, cache = ModelDrafter(draft_lm), KVCache(tiny_lm.model)
    prompt_ids = tiny_lm.encode(PROMPT)
    sequence, checked = list(prompt_ids), 0
    for spec_round in rounds(tiny_lm, prompt_ids, SAMPLING, drafter, cache=cache):
        sequence += spec_round.emitted_token_ids
        assert cache.tokens == sequence[:-1]  # target: everything but the newest token
        assert sequence[: len(drafter.cache.tokens)] == drafter.cache.tokens  # draft: no rejected token left
        if any(not d.accepted for d in spec_round.drafted) and checked < 2:
            assert_cache_equals_prefill(cache, tiny_lm.model)
            assert_cache_equals_prefill(drafter.cache, draft_lm.model)
            checked += 1
    assert checked == 2


def test_trace_json_has_rounds_and_per_token_steps(tiny_lm):
    trace = run_with(tiny_lm, wrap(perturbed(tiny_lm.model, 0.3), tiny_lm, "draft"), SAMPLING)
    data = json.loads(trace.to_json())
    drafted = [d for r in data["rounds"] for d in r["drafted"]]
    assert drafted and set(drafted[0]) >= {"token_id", "token", "q", "p", "accept_prob", "u", "accepted", "resampled"}
    for d in drafted:
        assert d["accept_prob"] == pytest.approx(min(1.0, d["p"] / d["q"]))
        assert d["accepted"] == (d["u"] < d["accept_prob"])
        assert (d["resampled"] is None) == d["accepted"]
    assert all(r["steps"] == [] for r in data["rounds"])  # steps live in trace.steps only
    assert [s["chosen_token_id"] for s in data["steps"]] == data["generated_token_ids"]
    assert len(data["generated_token_ids"]) == 20 and data["stop_reason"] == "max_new_tokens"
    summary = data["summary"]
    assert summary["acceptance_rate"] == pytest.approx(summary["accepted"] / summary["drafted"])
    assert summary["tokens_per_target_forward"] == pytest.approx(20 / len(data["rounds"]))
    assert rounds_of(Trace.from_json(trace.to_json())) == trace.rounds


def test_ngram_drafter_is_a_point_mass(tiny_lm):
    config = SAMPLING.replace(drafter="ngram", max_new_tokens=16)
    prompt = "a b c d e f g a b c d e f g a b c"
    trace = runner.run(RunRequest(tiny_lm, prompt, config, registry=ModelRegistry(capacity=1)))
    drafted = [d for r in trace.rounds for d in r.drafted]
    assert drafted
    for d in drafted:
        assert d.q == 1.0 and d.q_top[0].token_id == d.token_id
        assert d.accept_prob == pytest.approx(d.p)
        if d.resampled is not None:  # the residual of a point mass is p without the draft
            assert d.resampled.token_id != d.token_id
            assert d.resampled.prob == pytest.approx(d.resampled.p / (1 - d.p), rel=1e-3)


# --- greedy oracles on the embedded model -----------------------------------------------------
GROUNDED = ("Repeat this sentence exactly, then stop: The quick brown fox jumps over the lazy dog "
            "near the river bank.")


@pytest.fixture(scope="module")
def embedded_reference(embedded):
    config = GREEDY.replace(max_new_tokens=28)
    return config, target_only(embedded, GROUNDED, config, chat=True)


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["ngram", "self-int8", "self-nf4"])
def test_greedy_speculative_equals_target_only_on_the_embedded_model(embedded, registry, embedded_reference, drafter):
    config, reference = embedded_reference
    trace = runner.run(RunRequest(embedded, GROUNDED, config.replace(drafter=drafter), chat=True, registry=registry))
    assert trace.generated_token_ids == reference
    assert trace.summary["accepted"] > 0
    assert trace.summary["target_forwards"] < len(reference)
