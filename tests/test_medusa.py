"""Medusa: greedy equals target-only greedy token for token; sampling keeps the target's
distribution (chi-square, as tests/test_speculative.py); caches cropped, never rebuilt; heads
file I/O with its checksum; trace JSON round trip."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from conftest import make_tiny_llama
from engine import decode, medusa
from engine.config import ConfigError, DecodingConfig
from engine.medusa import MedusaHeads, head_logits, load_heads, save_heads
from engine.trace import Trace
from test_speculative import chi_square_p, exact_two_token_joint, wrap

GREEDY = DecodingConfig(strategy="medusa", temperature=0.0, max_new_tokens=20, medusa_heads=3)


def random_heads(hidden: int, k: int, scale: float, seed: int = 0) -> MedusaHeads:
    heads = MedusaHeads(hidden, k)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        heads.weight.copy_(scale * torch.randn(heads.weight.shape, generator=gen) / hidden ** 0.5)
    return heads.eval().requires_grad_(False)


def target_only(lm, ids, config) -> list[int]:
    base = config.replace(strategy="greedy" if config.is_greedy else "sample")
    return [s.chosen_token_id for s in decode.stream(lm, ids, base)]


def test_untrained_heads_read_out_exactly_the_base_head(tiny_lm):
    """W = 0, b = 0: h + SiLU(0) = h, so every head's logits are the LM head's."""
    lm_head = tiny_lm.model.get_output_embeddings()
    h = torch.randn(5, 64)
    logits = head_logits(MedusaHeads(64, 3), lm_head, h)  # [5, 3, V]
    assert logits.shape == (5, 3, tiny_lm.vocab_size)
    for k in range(3):
        torch.testing.assert_close(logits[:, k], lm_head(h).float())


@pytest.mark.parametrize("knobs", [{}, {"repetition_penalty": 1.5, "no_repeat_ngram_size": 2}])
@pytest.mark.parametrize("scale", [0.0, 3.0])
def test_greedy_medusa_equals_target_greedy(tiny_lm, knobs, scale):
    config = GREEDY.replace(**knobs)
    ids = tiny_lm.encode("The cat sat on the mat. The cat sat on the")
    trace = medusa.run(tiny_lm, "", ids, config, heads=random_heads(64, 3, scale))
    assert trace.generated_token_ids == target_only(tiny_lm, ids, config)
    assert trace.summary["rounds"] == len(trace.rounds)
    assert trace.summary["tokens_per_target_forward"] == len(trace.steps) / len(trace.rounds)
    assert all(r.k <= 3 and len(r.proposals) == r.k for r in trace.rounds)


def test_a_perfect_proposer_emits_k_plus_one_tokens_per_forward(tiny_lm, monkeypatch):
    """Heads that always propose the target's own greedy continuation: every draft is accepted,
    so each round after the first emits K + 1 tokens, and the budget is still exact."""
    ids = tiny_lm.encode("Once upon a time")
    config = GREEDY.replace(max_new_tokens=13)
    reference = target_only(tiny_lm, ids, config)

    def oracle(self, k):
        if self.hidden is None or k <= 0:
            return []
        done = len(self.generated)
        return [medusa.HeadProposal(i + 1, t, "", []) for i, t in enumerate(reference[done: done + k])]

    monkeypatch.setattr(medusa._MedusaVerifier, "propose", oracle)
    trace = medusa.run(tiny_lm, "", ids, config, heads=MedusaHeads(64, 3))
    assert trace.generated_token_ids == reference
    assert [len(r.emitted_token_ids) for r in trace.rounds] == [1, 4, 4, 4]  # 13 tokens, 4 forwards
    assert trace.summary["tokens_per_target_forward"] == 13 / 4


def test_the_cache_is_cropped_back_to_the_sequence(tiny_lm, monkeypatch):
    """After each round the target cache holds exactly the sequence minus its last token, with
    the keys a fresh prefill would have."""
    seen = []
    original = medusa._MedusaVerifier.medusa_round

    def spy(self, index):
        out = original(self, index)
        seen.append((self.cache.length, len(self.sequence) - 1, list(self.cache.tokens) == self.sequence[:-1]))
        if index == 2:
            fresh = tiny_lm.model(torch.tensor([self.sequence[:-1]]), use_cache=True).past_key_values
            torch.testing.assert_close(self.cache.cache.layers[0].keys, fresh.layers[0].keys, atol=1e-4, rtol=1e-4)
        return out

    monkeypatch.setattr(medusa._MedusaVerifier, "medusa_round", spy)
    medusa.run(tiny_lm, "", tiny_lm.encode("a b a b a b"), GREEDY, heads=random_heads(64, 3, 3.0))
    assert seen and all(length == want and same for length, want, same in seen)


# --- sampling: the target distribution is unchanged ------------------------------------------------
E2E_RUNS = 1500


def test_sampling_medusa_keeps_the_target_distribution(tiny_lm):
    """Two tokens after a one-token prompt on an 8-token model: the first from p, the second
    through a head's draft and the rejection rule. Their joint must be the target's."""
    target = wrap(make_tiny_llama(vocab_size=8, seed=0, layers=1, hidden=32), tiny_lm, "tiny8-target", eos=())
    heads = random_heads(32, 2, 4.0, seed=3)
    config = DecodingConfig(strategy="medusa", temperature=2.0, top_k=6, frequency_penalty=1.0,
                            max_new_tokens=3, medusa_heads=2, top_n=3)
    joint = exact_two_token_joint(target, [3], config)
    firsts, seconds, rejected = [], [], 0
    for seed in range(E2E_RUNS):
        collected = list(medusa.rounds(target, [3], dataclasses.replace(config, seed=seed), heads))
        tokens = [t for r in collected for t in r.emitted_token_ids]
        firsts.append(tokens[0])
        seconds.append(tokens[1])
        rejected += any(d.resampled is not None for r in collected for d in r.drafted)
    assert 0.1 * E2E_RUNS < rejected < 0.9 * E2E_RUNS  # both paths taken often
    assert chi_square_p(torch.tensor(firsts), torch.tensor(seconds), joint) > 1e-3


def test_seeded_sampling_repeats(tiny_lm):
    config = DecodingConfig(strategy="medusa", temperature=0.8, seed=5, max_new_tokens=12)
    ids = tiny_lm.encode("Hello")
    heads = random_heads(64, 3, 3.0)
    runs = [medusa.run(tiny_lm, "", ids, config, heads=heads).generated_token_ids for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 12


# --- trace and heads file ---------------------------------------------------------------------------
def test_trace_json_round_trips_with_proposals(tiny_lm):
    trace = medusa.run(tiny_lm, "hi", None, GREEDY.replace(max_new_tokens=8), heads=random_heads(64, 3, 3.0))
    text = trace.to_json()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    back = medusa.rounds_of(Trace.from_json(text))
    assert [len(r.proposals) for r in back] == [len(r.proposals) for r in trace.rounds]
    assert back[1].proposals[0].candidates[0].token_id == back[1].drafted[0].token_id
    assert sum(len(r.emitted_token_ids) for r in back) == 8
    assert all(r.steps == [] for r in trace.rounds)  # steps live in trace.steps only


def test_heads_file_round_trip_and_checksum(tiny_lm, tmp_path):
    heads = random_heads(64, 2, 1.0)
    path = tmp_path / "heads.safetensors"
    save_heads(heads, path, {"base_model": "tiny"})
    loaded = load_heads(tiny_lm, path)
    torch.testing.assert_close(loaded.weight, heads.weight.half().float())
    path.write_bytes(path.read_bytes()[:-1] + b" ")
    with pytest.raises(ConfigError, match="strategy: medusa: heads.safetensors does not match its checksum"):
        load_heads(tiny_lm, path)
    with pytest.raises(ConfigError, match="strategy: medusa: no trained heads for tiny-random-llama"):
        load_heads(tiny_lm)


def test_medusa_heads_knob_is_validated():
    with pytest.raises(ConfigError, match="medusa_heads: 5 is out of range"):
        DecodingConfig(strategy="medusa", medusa_heads=5)


# --- the shipped heads on the embedded model -----------------------------------------------------------
@pytest.mark.slow
def test_trained_heads_greedy_equals_target_and_accept_drafts(embedded):
    ids = embedded.encode("Explain the water cycle in two sentences.", chat=True)
    config = GREEDY.replace(max_new_tokens=48)
    trace = medusa.run(embedded, "", ids, config)
    assert trace.generated_token_ids == target_only(embedded, ids, config)
    assert trace.summary["accepted"] > 0 and trace.summary["tokens_per_target_forward"] > 1.0  # heads' tokens get accepted
    assert medusa.heads_path(embedded.name).with_suffix(".sha256").is_file()
