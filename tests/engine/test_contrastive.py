"""Contrastive search and contrastive decoding against straightforward uncached references (full
recompute every step, as simple as nanoGPT), plus the word-constraints stage."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers.generation import logits_process as tlp

from engine.strategies import contrastive, decode
from engine import runner
from engine.runner import RunRequest
from engine.config import ConfigError, DecodingConfig
from engine.backends.local import LoadedModel
from engine.backends.registry import ModelRegistry
from engine.chain import Chain
from engine.stages import word_token_variants
from engine.trace import Trace
from tests.helpers.common import make_tiny_llama

PROMPT = "The best way to learn a new language is"


def token_events(events) -> list:
    """(StepTrace, record) of each token's Event of a contrastive stream (the last, the Trace, left out)."""
    events = list(events)
    assert events[-1].trace is not None and all(len(e.steps) == 1 for e in events[:-1])
    return [(e.steps[0], e.record) for e in events[:-1]]


# --- references ----------------------------------------------------------------------------------


@torch.no_grad()
def reference_contrastive_search(model, prompt_ids, k, alpha, steps, eos_ids, penalty=1.0):
    """Su et al. 2022 with no cache: each step feeds the k whole candidate sequences from scratch.
    Returns the generated ids and, per step, the chosen candidate's score."""
    ids, scores = list(prompt_ids), []
    logits = model(torch.tensor([ids])).logits[:, -1, :]  # [1, V]
    for _ in range(steps):
        if penalty != 1.0:
            logits = tlp.RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([ids]), logits)
        top_p, top_i = torch.softmax(logits[0], dim=-1).topk(k)
        out = model(torch.tensor([ids + [c] for c in top_i.tolist()]), output_hidden_states=True)  # [k, S + 1]
        hidden = out.hidden_states[-1]  # [k, S + 1, H]: context (prompt included) then the candidate
        similarity = F.cosine_similarity(hidden[:, -1:, :], hidden[:, :-1, :], dim=-1).max(dim=-1).values  # [k]
        score = (1 - alpha) * top_p - alpha * similarity
        best = int(score.argmax())
        ids.append(int(top_i[best]))
        scores.append(float(score[best]))
        logits = out.logits[best:best + 1, -1, :]  # the chosen sequence's next-token logits
        if ids[-1] in eos_ids:
            break
    return ids[len(prompt_ids):], scores


@torch.no_grad()
def reference_contrastive_decoding(expert, amateur, prompt_ids, alpha, steps):
    """Li et al. 2023, greedy, recomputing both models from scratch each step."""
    ids, scores = list(prompt_ids), []
    for _ in range(steps):
        x = torch.tensor([ids])
        e = torch.log_softmax(expert(x).logits[0, -1].float(), dim=-1)
        a = torch.log_softmax(amateur(x).logits[0, -1].float(), dim=-1)
        plausible = e >= e.max() + math.log(alpha)  # p_e >= alpha * max p_e
        score = torch.where(plausible, e - a, torch.tensor(float("-inf")))
        ids.append(int(score.argmax()))
        scores.append(float(score.max()))
    return ids[len(prompt_ids):], scores


@pytest.fixture(scope="module")
def tiny_amateur(tiny_lm) -> LoadedModel:
    """A second random tiny Llama (another seed) over the same tokenizer."""
    model = make_tiny_llama(seed=1)
    return LoadedModel(name="tiny-amateur", model=model, tokenizer=tiny_lm.tokenizer, device=torch.device("cpu"),
                       dtype=torch.float32, quantization="none", source="tiny", eos_token_ids=(2,), memory_bytes=0)


class FeedLog:
    """Records the input_ids shape of every forward of a model (to check what the cache saves)."""

    def __init__(self, model):
        self.shapes: list[tuple[int, int]] = []
        self.handle = model.register_forward_pre_hook(self.record, with_kwargs=True)

    def record(self, module, args, kwargs):
        self.shapes.append(tuple(kwargs["input_ids"].shape))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def chosen_score(record) -> float:
    return next(c.score for c in record.candidates if c.token_id == record.chosen_token_id)


# --- contrastive search --------------------------------------------------------------------------


def test_degeneration_penalty_and_scores_by_hand():
    context = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    candidates = torch.tensor([[1.0, 1.0], [-1.0, 0.0]])
    penalty = contrastive.degeneration_penalty(context, candidates)
    assert penalty.tolist() == pytest.approx([1 / math.sqrt(2), 0.0])  # cos 45° with either; cos 90°/180°
    score = contrastive.search_scores(torch.tensor([0.5, 0.3, 0.0]), torch.tensor([0.7071, 0.0, -1.0]), alpha=0.5)
    assert score[:2].tolist() == pytest.approx([0.5 * 0.5 - 0.5 * 0.7071, 0.5 * 0.3])
    assert score[2] == float("-inf")  # a masked candidate (p = 0) never wins, however dissimilar


def test_search_matches_uncached_reference_on_tiny_model_with_penalty(tiny_lm):
    cfg = DecodingConfig(strategy="contrastive_search", top_k=5, penalty_alpha=0.4, repetition_penalty=1.3,
                         temperature=0.7, max_new_tokens=12)  # temperature: a sampling stage, ignored here
    prompt_ids = tiny_lm.encode(PROMPT)
    with FeedLog(tiny_lm.model) as feeds:
        pairs = token_events(contrastive.stream(tiny_lm, PROMPT, prompt_ids, cfg))
    # prefill once, then one forward per token: the 5 candidates as a batch of one-token continuations
    assert feeds.shapes == [(1, len(prompt_ids))] + [(5, 1)] * len(pairs)
    ref_ids, ref_scores = reference_contrastive_search(tiny_lm.model, prompt_ids, 5, 0.4, 12, (2,), penalty=1.3)
    assert [s.chosen_token_id for s, _ in pairs] == ref_ids
    assert [chosen_score(r) for _, r in pairs] == pytest.approx(ref_scores, abs=1e-4)
    step, record = pairs[0]
    assert [st.name for st in step.stages] == ["raw", "repetition_penalty", "final"]
    assert len(record.candidates) == 5 and record.chosen_token_id == step.chosen_token_id
    assert [c.prob for c in record.candidates] == sorted((c.prob for c in record.candidates), reverse=True)
    best = max(record.candidates, key=lambda c: c.score)
    assert best.token_id == step.chosen_token_id and step.chosen_prob == pytest.approx(best.prob)


def test_search_with_alpha_zero_is_greedy(tiny_lm):
    cfg = DecodingConfig(strategy="contrastive_search", top_k=4, penalty_alpha=0.0, max_new_tokens=10)
    greedy = decode.run(tiny_lm, PROMPT, DecodingConfig(strategy="greedy", max_new_tokens=10))
    assert runner.run(RunRequest(tiny_lm, PROMPT, cfg)).generated_token_ids == greedy.generated_token_ids


def test_search_refuses_too_many_candidates(tiny_lm):
    cfg = DecodingConfig(strategy="contrastive_search", top_k=contrastive.MAX_SEARCH_CANDIDATES + 1)
    with pytest.raises(ConfigError, match=r"top_k: .*allowed \[2, 64\], got 65"):
        runner.run(RunRequest(tiny_lm, PROMPT, cfg))


@pytest.mark.slow
def test_search_matches_uncached_reference_on_embedded_model(embedded):
    cfg = DecodingConfig(strategy="contrastive_search", top_k=4, penalty_alpha=0.6, max_new_tokens=16)
    trace = runner.run(RunRequest(embedded, PROMPT, cfg))
    ref_ids, ref_scores = reference_contrastive_search(embedded.model, trace.prompt_token_ids, 4, 0.6, 16,
                                                       embedded.eos_token_ids)
    assert trace.generated_token_ids == ref_ids
    assert [chosen_score(r) for r in trace.extra["contrastive_search"]] == pytest.approx(ref_scores, abs=1e-4)
    assert len(trace.steps) == len(ref_ids) and trace.stop_reason in ("eos", "max_new_tokens")
    again = Trace.from_json(trace.to_json())  # records survive a JSON round trip, typed
    assert contrastive.records(again) == trace.extra["contrastive_search"]


# --- contrastive decoding ------------------------------------------------------------------------


def test_contrast_scores_by_hand():
    expert = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    amateur = torch.log(torch.tensor([[0.7, 0.1, 0.1, 0.1]]))
    scores, plausible, _, _ = contrastive.contrast_scores(expert, amateur, alpha=0.2)  # cutoff 0.2 * 0.5 = 0.1
    assert plausible[0].tolist() == [True, True, True, False]
    assert scores[0, :3].tolist() == pytest.approx([math.log(0.5 / 0.7), math.log(3.0), math.log(1.5)], abs=1e-6)
    assert scores[0, 3] == float("-inf") and int(scores.argmax()) == 1  # not the expert's favourite


def test_decoding_matches_reference_on_two_tiny_models(tiny_lm, tiny_amateur):
    cfg = DecodingConfig(strategy="contrastive_decoding", temperature=0.0, cd_alpha=0.1, max_new_tokens=12)
    prompt_ids = tiny_lm.encode(PROMPT)
    with FeedLog(tiny_lm.model) as expert_feeds, FeedLog(tiny_amateur.model) as amateur_feeds:
        pairs = token_events(contrastive.stream(tiny_lm, PROMPT, prompt_ids, cfg, amateur=tiny_amateur))
    feeds = [(1, len(prompt_ids))] + [(1, 1)] * (len(pairs) - 1)  # each model: prefill, then one token per step
    assert expert_feeds.shapes == feeds and amateur_feeds.shapes == feeds
    ref_ids, ref_scores = reference_contrastive_decoding(tiny_lm.model, tiny_amateur.model, prompt_ids, 0.1, 12)
    assert [s.chosen_token_id for s, _ in pairs] == ref_ids
    assert [chosen_score(r) for _, r in pairs] == pytest.approx(ref_scores, abs=1e-4)
    step, record = pairs[0]
    assert [st.name for st in step.stages] == ["raw", "contrast", "final"]
    assert step.stages[1].kept == record.plausible
    for c in record.candidates:
        assert c.plausible == (math.exp(c.expert_logprob) >= record.threshold_prob - 1e-9)
        if c.plausible:
            assert c.score == pytest.approx(c.expert_logprob - c.amateur_logprob, abs=1e-5)


def test_decoding_samples_from_softmax_of_scores(tiny_lm, tiny_amateur):
    cfg = DecodingConfig(strategy="contrastive_decoding", temperature=1.0, top_p=0.95, cd_alpha=0.1,
                         max_new_tokens=10, seed=3)
    prompt_ids = tiny_lm.encode(PROMPT)
    first = runner.collect(contrastive.stream(tiny_lm, PROMPT, prompt_ids, cfg, amateur=tiny_amateur))
    again = runner.collect(contrastive.stream(tiny_lm, PROMPT, prompt_ids, cfg, amateur=tiny_amateur))
    assert again.generated_token_ids == first.generated_token_ids and first.extra["amateur"] == tiny_amateur.name
    assert [st.name for st in first.steps[0].stages] == ["raw", "contrast", "top_p", "final"]
    for step, record in zip(first.steps, contrastive.records(first)):
        assert step.draw is not None
        chosen = next(c for c in record.candidates if c.token_id == step.chosen_token_id)
        assert chosen.plausible
        shown = [c.score for c in record.candidates if c.plausible]
        if len(shown) == record.plausible and step.stages[2].mass_removed == 0:  # the record lists the whole set
            expected = math.exp(chosen.score) / sum(math.exp(s) for s in shown)
            assert step.chosen_prob == pytest.approx(expected, rel=1e-4)


def test_decoding_refuses_an_amateur_with_another_tokenizer(tiny_lm, tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]")
    other = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(vocab))
    amateur = LoadedModel(name="other-vocab", model=tiny_lm.model, tokenizer=other, device=torch.device("cpu"),
                          dtype=torch.float32, quantization="none", source="x", eos_token_ids=(2,), memory_bytes=0)
    cfg = DecodingConfig(strategy="contrastive_decoding", temperature=0.0)
    with pytest.raises(ConfigError, match="amateur: .*other-vocab.* different tokenizer"):
        list(contrastive.stream(tiny_lm, "", [1, 2, 3], cfg, amateur=amateur))
    with pytest.raises(ConfigError, match="amateur: could not load"):
        contrastive.resolve_amateur(tiny_lm, cfg.replace(amateur=f"model:{tmp_path}"), ModelRegistry())


@pytest.mark.slow
def test_decoding_with_self_nf4_amateur_on_embedded_model(embedded, registry):
    cfg = DecodingConfig(strategy="contrastive_decoding", amateur="self-nf4", temperature=0.0, max_new_tokens=8)
    trace = runner.run(RunRequest(embedded, PROMPT, cfg, registry=registry))
    assert 1 <= len(trace.steps) <= 8 and trace.stop_reason in ("eos", "max_new_tokens")
    assert trace.extra["amateur"] == "self-nf4" and trace.text.strip()
    for step, record in zip(trace.steps, contrastive.records(trace)):
        scored = [c.score for c in record.candidates if c.plausible]
        assert chosen_score(record) == max(scored)  # greedy: the best contrast score wins
        assert step.stages[-2].name == "contrast" and step.stages[-2].params["amateur"] == "self-nf4"


def test_run_rejects_other_strategies(tiny_lm):
    with pytest.raises(ConfigError, match="strategy: engine.strategies.contrastive runs"):
        list(contrastive.stream(tiny_lm, PROMPT, [1, 2, 3], DecodingConfig(strategy="greedy")))


# --- the constraints stage -----------------------------------------------------------------------


def test_allowed_words_mask_everything_else_but_eos_and_renormalise(tiny_lm):
    cfg = DecodingConfig(strategy="greedy", allowed_words=("cat", "dog"))
    allowed = {i for w in ("cat", "dog") for ids in word_token_variants(tiny_lm.tokenizer, w) for i in ids} | {2}
    chain = Chain.from_config(cfg, 1, tiny_lm.tokenizer, tiny_lm.eos_token_ids)
    logits = torch.randn(1, tiny_lm.vocab_size, generator=torch.Generator().manual_seed(0))
    final, stages = chain.traced(torch.tensor([[1]]), logits, 5, tiny_lm.token_text)
    probs, raw = torch.softmax(final[0], dim=-1), torch.softmax(logits[0], dim=-1)
    assert set(torch.nonzero(probs).flatten().tolist()) == allowed
    kept_mass = float(raw[sorted(allowed)].sum())
    for i in allowed:  # each survivor's probability is its raw probability over the kept mass
        assert float(probs[i]) == pytest.approx(float(raw[i]) / kept_mass, rel=1e-5)
    constraints = stages[1]
    assert constraints.name == "constraints" and constraints.kept == len(allowed)
    assert constraints.mass_removed == pytest.approx(1 - kept_mass, abs=1e-5)


def test_constraints_stage_shows_in_step_traces(tiny_lm):
    cfg = DecodingConfig(strategy="sample", banned_words=("the",), temperature=0.8, top_k=20, max_new_tokens=3)
    trace = decode.run(tiny_lm, PROMPT, cfg)
    assert [st.name for st in trace.steps[0].stages] == ["raw", "constraints", "temperature", "top_k", "final"]
    assert trace.steps[0].stages[1].params == {"allowed_words": [], "banned_words": ["the"]}


@pytest.mark.slow
def test_banned_word_never_appears_on_embedded_model(embedded):
    prompt = "The capital of France is"
    free = decode.run(embedded, prompt, DecodingConfig(strategy="greedy", max_new_tokens=6))
    assert "Paris" in free.text  # so the ban below has something to prevent
    banned_ids = {ids[-1] for ids in word_token_variants(embedded.tokenizer, "Paris") if len(ids) == 1}
    for cfg in (DecodingConfig(strategy="greedy", banned_words=("Paris",), max_new_tokens=12),
                DecodingConfig(strategy="sample", banned_words=("Paris",), max_new_tokens=12, seed=1)):
        trace = decode.run(embedded, prompt, cfg)
        assert "Paris" not in trace.text
        assert not banned_ids & set(trace.generated_token_ids)
        assert all(st.name == "constraints" for st in [s.stages[1] for s in trace.steps])
