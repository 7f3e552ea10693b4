"""Issue #29: speculative decoding on a remote target (engine.strategies.remote_speculative): engine.strategies.speculative's
rounds with the target scored by the server (vLLM: prompt_logprobs, one request per round; llama-server:
one request per position). Against the real llama-server (marker `remote`), a real vLLM's answers
replayed from tests/data/vllm/, and without a server for the refusals. Live vLLM: tests/remote/test_vllm_live.py."""

from __future__ import annotations

import math

import pytest
import torch

from engine.backends import openai
from engine.strategies import remote_speculative
from engine import runner
from engine.runner import RunRequest
from engine.config import DecodingConfig
from engine.backends.registry import ModelRegistry
from engine.strategies.speculative import SpecRound
from engine.trace import Trace
from tests.helpers.remote_llamacpp import server_test
from tests.data.vllm.record import SCORED_LENGTH
from tests.helpers.remote_openai import VOCAB, recorded, vllm  # noqa: F401 (the fixture)
from tests.helpers.remote_runner import offline_model

PROMPT = "The capital of France is Paris. The capital of Italy is Rome. The capital of France is"


@pytest.mark.parametrize("drafter", ["self-int8", "model:llamacpp:http://127.0.0.1:9", "model:HuggingFaceTB/x"])
def test_a_drafter_a_remote_target_cannot_use_is_one_line(drafter):
    config = DecodingConfig(strategy="speculative", drafter=drafter)
    with pytest.raises(ValueError, match=rf"^drafter: '{drafter}' does not run with a remote target; use ngram or "
                                         r"model:<a remote model the operator lists in DP_REMOTE_MODELS>$"):
        remote_speculative.drafter(offline_model(), config, ModelRegistry(), {})


def test_vllm_scores_every_drafted_position_in_one_request_exactly(vllm):  # noqa: F811
    url, state = vllm
    model = openai.connect_openai(url, timeout_s=5, vocab_size=VOCAB)
    [exchange] = recorded("prompt_logprobs")
    ids, choice = exchange["body"]["prompt"], exchange["answer"]["choices"][0]
    before = len(state["requests"])
    rows = model.api.positions(ids, 1, SCORED_LENGTH)
    assert len(rows) == len(ids) and len(state["requests"]) == before + 1  # one request for every position
    recorded_rows = choice["prompt_logprobs"]
    assert dict((t, lp) for t, lp, _ in rows[0]) == {int(k): v["logprob"] for k, v in recorded_rows[1].items()}
    assert dict((t, lp) for t, lp, _ in rows[0])[ids[1]] == recorded_rows[1][str(ids[1])]["logprob"]  # rank 133 kept
    last = {int(k.split(":")[1]): v for k, v in choice["logprobs"]["top_logprobs"][0].items()}
    assert [t for t, _, _ in rows[-1]] == sorted(last, key=last.get, reverse=True)  # after the last token
    cache = model.with_mode("step", SCORED_LENGTH).cache()  # as speculative feeds it (a RemoteCache)
    logits = cache.forward(torch.tensor([ids]), all_logits=True).logits
    assert logits.shape == (1, len(ids), VOCAB) and cache.tokens == ids
    assert math.isclose(float(logits[0, 0, ids[1]]), recorded_rows[1][str(ids[1])]["logprob"], rel_tol=1e-6)


@server_test
def test_greedy_speculative_with_ngram_drafts_is_remote_greedy(server_model):
    greedy = runner.run(RunRequest(server_model, PROMPT, DecodingConfig(strategy="greedy", max_new_tokens=16)))
    events = list(runner.stream(RunRequest(server_model, PROMPT, DecodingConfig(strategy="speculative", drafter="ngram",
                                                                     temperature=0.0, max_new_tokens=16))))
    trace = events[-1].trace
    assert all(isinstance(e.record, SpecRound) for e in events[:-1])
    assert trace.generated_token_ids == greedy.generated_token_ids
    assert trace.summary["accepted"] > 0  # the prompt repeats itself: n-gram drafts pass
    assert trace.extra["remote"]["scoring_calls"] == trace.summary["rounds"] + 1  # + the prompt's "prefill"
    assert Trace.from_json(trace.to_json()).generated_token_ids == trace.generated_token_ids


@server_test
def test_a_listed_remote_drafter_equal_to_the_target_is_always_accepted(server_model, monkeypatch):
    monkeypatch.setenv("DP_REMOTE_MODELS", f"llamacpp:{server_model.url}")
    config = DecodingConfig(strategy="speculative", drafter=f"model:llamacpp:{server_model.url}", temperature=0.8,
                            max_new_tokens=12, seed=3)
    trace = runner.run(RunRequest(server_model, PROMPT, config))
    again = runner.run(RunRequest(server_model, PROMPT, config))
    assert trace.generated_token_ids == again.generated_token_ids  # seeded: reproducible
    drafted = [d for r in trace.rounds for d in r.drafted]
    assert drafted and all(d.accepted and d.accept_prob == pytest.approx(1.0) for d in drafted)  # p = q
    print(f"rounds {trace.summary['rounds']}, drafted {trace.summary['drafted']}, "
          f"accepted {trace.summary['accepted']}: {trace.text!r}")


@server_test
def test_the_target_only_baseline_runs_on_the_server_and_stops_with_the_run(server_model):
    from engine.control import RunControl, RunStopped

    config = DecodingConfig(strategy="speculative", drafter="ngram", temperature=0.0, max_new_tokens=12)
    trace = runner.run(RunRequest(server_model, PROMPT, config, compare_baseline=True))
    summary = trace.summary
    greedy = runner.run(RunRequest(server_model, PROMPT, DecodingConfig(strategy="greedy", max_new_tokens=12)))
    assert summary["baseline_same_tokens"] and summary["baseline_first_difference"] is None
    assert summary["baseline_tokens"] == len(greedy.generated_token_ids) == len(trace.generated_token_ids)
    assert summary["baseline_ms"] > 0 and math.isfinite(summary["speedup"]) and summary["speedup"] > 0
    assert "baseline_rounding_tie" not in summary  # that check needs the model's logits
    control = RunControl()  # the rounds do not check it (runner.stream does, per event); the baseline must
    events = remote_speculative.stream(server_model, PROMPT, server_model.encode(PROMPT), config, control=control,
                                       compare_baseline=True)
    for event in events:
        if event.record is not None and event.record.finish_reason is not None:
            control.cancel()  # the last round is out: what runs now is the target-only baseline
            break
    with pytest.raises(RunStopped):
        next(events)
