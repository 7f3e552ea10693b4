"""Beam search: oracle against transformers' generate(num_beams=...), cache reordering against an
uncached recompute, trace invariants, diverse groups, the runner and the JSON round trip."""

from __future__ import annotations

import json
import math

import pytest
import torch

from engine.strategies import beam
from engine import runner
from engine.runner import RunRequest
from engine.config import DecodingConfig
from engine.backends.local import LoadedModel
from engine.trace import Trace

from tests.helpers.common import make_tiny_llama


def beam_config(**knobs) -> DecodingConfig:
    return DecodingConfig(strategy="beam", **knobs)


def search(lm: LoadedModel, prompt_ids: list[int], config: DecodingConfig) -> beam.BeamTrace:
    events = list(beam.stream(lm, "", prompt_ids, config))
    assert all(isinstance(e.record, beam.BeamStep) and not e.steps for e in events[:-1])
    assert isinstance(events[-1].trace.beam, beam.BeamTrace)
    return events[-1].trace.beam


def generate_beams(lm: LoadedModel, prompt_ids: list[int], config: DecodingConfig):
    ids = torch.tensor([prompt_ids])
    eos = lm.eos_token_ids[0]
    return lm.model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=config.num_beams,
        num_return_sequences=config.num_return_sequences, max_new_tokens=config.max_new_tokens,
        length_penalty=config.length_penalty, early_stopping=config.early_stopping,
        no_repeat_ngram_size=config.no_repeat_ngram_size or None, eos_token_id=eos, pad_token_id=eos,
        output_scores=True, return_dict_in_generate=True,
    )


def assert_matches_generate(lm: LoadedModel, prompt_ids: list[int], config: DecodingConfig) -> beam.BeamTrace:
    """Our returned hypotheses == generate()'s sequences (up to its padding) and sequences_scores."""
    ours = search(lm, prompt_ids, config)
    out = generate_beams(lm, prompt_ids, config)
    returned = [h for h in ours.hypotheses if h.returned]
    assert len(returned) == config.num_return_sequences == out.sequences.shape[0]
    for h, sequence, score in zip(returned, out.sequences, out.sequences_scores):
        theirs = sequence[len(prompt_ids):].tolist()
        assert theirs[:h.length] == h.token_ids
        assert set(theirs[h.length:]) <= {lm.eos_token_ids[0]}  # generate pads finished rows
        assert h.score == pytest.approx(float(score), abs=2e-4)
        assert h.score == pytest.approx(h.sum_logprobs / h.length ** config.length_penalty, rel=1e-5)
    return ours


# --- a tiny model whose "EOS" is a token it often proposes, so beams finish early ---------------
TINY_VOCAB = 64
TINY_EOS = 38  # among the tokens this seed's tiny model proposes most; makes early stopping happen


@pytest.fixture(scope="module")
def tiny64(tiny_lm) -> LoadedModel:
    model = make_tiny_llama(vocab_size=TINY_VOCAB)
    return LoadedModel(name="tiny-64", model=model, tokenizer=tiny_lm.tokenizer, device=torch.device("cpu"),
                       dtype=torch.float32, quantization="none", source="tiny", eos_token_ids=(TINY_EOS,),
                       memory_bytes=0)


# (prompt, num_beams): with these, hypotheses end by EOS at different steps and, depending on the
# mode, the search ends by early stopping or runs to max_new_tokens.
TINY_CASES = (([30, 31], 2), ([50, 8, 8], 3), ([50, 8, 8], 4))


@pytest.mark.parametrize("early_stopping", [True, False, "never"])
@pytest.mark.parametrize("length_penalty", [0.5, 1.0, 2.0])
def test_tiny_model_matches_generate_in_every_early_stopping_mode(tiny64, early_stopping, length_penalty):
    for prompt, num_beams in TINY_CASES:
        config = beam_config(num_beams=num_beams, num_return_sequences=num_beams, max_new_tokens=20,
                             length_penalty=length_penalty, early_stopping=early_stopping)
        assert_matches_generate(tiny64, prompt, config)


# --- the embedded model: sense, and the oracle on real text -------------------------------------
EMBEDDED_CASES = [  # (prompt, chat, knobs)
    ("The capital of France is", False,
     dict(num_beams=4, length_penalty=1.0, early_stopping=False, num_return_sequences=4, max_new_tokens=12)),
    ("Once upon a time", False,
     dict(num_beams=2, length_penalty=0.5, early_stopping=True, num_return_sequences=2, max_new_tokens=12)),
    ("def fibonacci(n):", False,
     dict(num_beams=6, length_penalty=2.0, early_stopping=False, num_return_sequences=3, max_new_tokens=10)),
    ("What is 2+2? Reply with just the number.", True,
     dict(num_beams=4, length_penalty=1.0, early_stopping=False, num_return_sequences=4, max_new_tokens=12)),
    ("The cat sat on the mat. The cat sat on the", False,
     dict(num_beams=3, no_repeat_ngram_size=2, num_return_sequences=2, max_new_tokens=10)),
]


@pytest.mark.slow
@pytest.mark.parametrize("prompt,chat,knobs", EMBEDDED_CASES, ids=[c[0][:16] for c in EMBEDDED_CASES])
def test_embedded_matches_generate(embedded, prompt, chat, knobs):
    ours = assert_matches_generate(embedded, embedded.encode(prompt, chat), beam_config(**knobs))
    if chat:  # the instruct model answers and stops: EOS-finished hypotheses are compared too
        assert any(h.finish_reason == "eos" for h in ours.hypotheses)


# --- cache reordering vs an uncached recompute ------------------------------------------------
def test_reordered_cache_gives_the_logprobs_of_an_uncached_recompute(tiny_lm):
    prompt = tiny_lm.encode("Beam search keeps several")
    config = beam_config(num_beams=4, max_new_tokens=10)
    trace = search(tiny_lm, prompt, config)
    checked = 0
    for t, step in enumerate(trace.steps):
        for parent in sorted({c.parent for c in step.candidates}):
            prefix = [] if t == 0 else beam.lineage_tokens(trace, t - 1, _slot_owner(trace, t - 1, parent))
            with torch.no_grad():
                logits = tiny_lm.model(torch.tensor([prompt + prefix])).logits[0, -1].float()
            expected = torch.log_softmax(logits, dim=-1)
            for c in step.candidates:
                if c.parent == parent:
                    assert c.raw_logprob == pytest.approx(float(expected[c.token_id]), abs=1e-4)
                    checked += 1
    assert checked == 10 * 2 * 4  # 10 steps x K = 2 x 4 candidates, none skipped


def _slot_owner(trace: beam.BeamTrace, step: int, slot: int) -> int:
    return next(i for i, c in enumerate(trace.steps[step].candidates) if c.beam == slot)


# --- trace invariants ----------------------------------------------------------------------------
def test_trace_records_every_candidate_with_consistent_scores(tiny64):
    config = beam_config(num_beams=3, num_return_sequences=2, max_new_tokens=15, length_penalty=0.5)
    trace = search(tiny64, [50, 8, 8], config)
    assert trace.candidates_per_step == 6  # max(2, 1 + one EOS id) * 3 beams
    for t, step in enumerate(trace.steps):
        assert len(step.candidates) == 6
        assert sum(c.status == "kept" for c in step.candidates) <= 3
        assert all(c.status in beam.STATUSES for c in step.candidates)
        for c in step.candidates:
            assert c.normalized_score == pytest.approx(c.score / (t + 1) ** 0.5, rel=1e-5)
            parent_score = 0.0 if t == 0 else trace.steps[t - 1].candidates[_slot_owner(trace, t - 1, c.parent)].score
            assert c.score == pytest.approx(parent_score + c.logprob, abs=1e-4)
            expected = "eos" if c.token_id == TINY_EOS else "max_new_tokens" if t == 14 else None
            assert c.finish_reason == expected
    scores = [h.score for h in trace.hypotheses]
    assert scores == sorted(scores, reverse=True) and trace.winner == 0
    assert [h.returned for h in trace.hypotheses] == [True, True] + [False] * (len(scores) - 2)
    for h in trace.hypotheses:
        last = trace.steps[h.length - 1].candidates[h.path[-1]]
        assert last.status == "finished" and beam.lineage_tokens(trace, h.length - 1, h.path[-1]) == h.token_ids
        assert all(trace.steps[t].candidates[i].status in ("kept", "dropped") for t, i in enumerate(h.path[:-1]))


def test_early_stopping_true_ends_once_num_beams_hypotheses_finished(tiny64):
    eager = search(tiny64, [50, 8, 8], beam_config(num_beams=3, num_return_sequences=3, max_new_tokens=15,
                                                   early_stopping=True, length_penalty=0.5))
    lengths = sorted(h.length for h in eager.hypotheses)
    assert lengths == [3, 8, 10] and all(h.finish_reason == "eos" for h in eager.hypotheses)
    assert eager.ended_by == "early_stopping" and len(eager.steps) == 10  # the third finished at step 10
    last = eager.steps[-1].candidates
    assert any(c.status == "dropped" for c in last) and not any(c.status == "kept" for c in last)
    # False: the search goes on while the best running beam could still beat the worst finished one
    patient = search(tiny64, [50, 8, 8], beam_config(num_beams=3, num_return_sequences=3, max_new_tokens=15,
                                                     early_stopping=False, length_penalty=0.5))
    assert len(patient.steps) == 12 and patient.ended_by == "early_stopping"
    assert [h.token_ids for h in patient.hypotheses] == [h.token_ids for h in eager.hypotheses]


def test_stop_strings_finish_beams(tiny_lm):
    prompt = tiny_lm.encode("Stop strings")
    free = search(tiny_lm, prompt, beam_config(num_beams=2, max_new_tokens=6))
    third = tiny_lm.decode(free.hypotheses[0].token_ids[2:3])
    word = third.strip() or third
    config = beam_config(num_beams=2, max_new_tokens=6, stop=[word])
    trace = runner.run(RunRequest(tiny_lm, "Stop strings", config))
    stopped = [c for s in trace.beam.steps for c in s.candidates if c.finish_reason == "stop_string"]
    assert stopped
    for c in stopped:
        assert word in tiny_lm.decode(beam.lineage_tokens(trace.beam, *_locate(trace.beam, c)))
    if trace.stop_reason == "stop_string":
        assert word not in trace.text


def _locate(trace: beam.BeamTrace, candidate) -> tuple[int, int]:
    for t, s in enumerate(trace.steps):
        for i, c in enumerate(s.candidates):
            if c is candidate:
                return t, i
    raise AssertionError("candidate not in trace")


# --- diverse (group) beam search -----------------------------------------------------------------
def test_group_zero_of_diverse_search_is_a_plain_beam_search(tiny64):
    """Group 0 sees no diversity penalty (only later groups do), so it is a plain search of its size."""
    diverse = search(tiny64, [7, 21, 40, 3, 11], beam_config(num_beams=4, num_beam_groups=2, diversity_penalty=5.0,
                                                         num_return_sequences=4, max_new_tokens=12))
    plain = search(tiny64, [7, 21, 40, 3, 11], beam_config(num_beams=2, num_return_sequences=2, max_new_tokens=12))
    group0 = [(h.token_ids, h.score) for h in diverse.hypotheses if h.group == 0]
    assert [t for t, _ in group0] == [h.token_ids for h in plain.hypotheses]
    assert [s for _, s in group0] == pytest.approx([h.score for h in plain.hypotheses], abs=1e-5)


def test_diversity_penalty_pushes_group_one_off_group_zeros_tokens(tiny64):
    config = beam_config(num_beams=4, num_beam_groups=2, diversity_penalty=10.0, max_new_tokens=3)
    first = search(tiny64, [5, 9, 13], config).steps[0]
    kept = {g: {c.token_id for c in first.candidates if c.group == g and c.status == "kept"} for g in (0, 1)}
    assert len(kept[0]) == 2 and len(kept[1]) == 2 and not kept[0] & kept[1]
    penalised = [c for c in first.candidates if c.group == 1 and c.token_id in kept[0]]
    assert all(c.logprob == pytest.approx(c.raw_logprob - 10.0, abs=1e-4) for c in penalised)


# --- runner, trace JSON, CLI shape ---------------------------------------------------------------
def test_runner_returns_the_winner_as_the_trace_text(tiny_lm):
    config = beam_config(num_beams=3, num_return_sequences=2, max_new_tokens=8)
    trace = runner.run(RunRequest(tiny_lm, "Hello", config))
    winner = trace.beam.hypotheses[trace.beam.winner]
    assert trace.strategy == "beam" and trace.generated_token_ids == winner.token_ids
    assert trace.text == tiny_lm.decode(winner.token_ids)
    assert [s.chosen_token_id for s in trace.steps] == winner.token_ids
    assert trace.steps[0].chosen_prob == pytest.approx(math.exp(trace.beam.steps[0].candidates[winner.path[0]].logprob))
    assert trace.stop_reason == winner.finish_reason == "max_new_tokens"


def test_trace_json_round_trip(tiny_lm):
    trace = runner.run(RunRequest(tiny_lm, "Hello", beam_config(num_beams=2, max_new_tokens=4)))
    data = json.loads(trace.to_json())
    cand = data["beam"]["steps"][0]["candidates"][0]
    assert set(cand) >= {"parent", "token", "token_id", "logprob", "score", "normalized_score", "status"}
    assert data["beam"]["winner"] == 0 and data["beam"]["hypotheses"][0]["token_ids"] == data["generated_token_ids"]
    again = Trace.from_json(trace.to_json())
    assert beam.BeamTrace.from_dict(again.beam) == trace.beam


def test_bad_requests_name_the_problem(tiny_lm):
    with pytest.raises(ValueError, match="prompt"):
        list(beam.stream(tiny_lm, "", [], beam_config(num_beams=2)))
    with pytest.raises(ValueError, match="num_return_sequences"):
        beam_config(num_beams=2, num_return_sequences=3)
