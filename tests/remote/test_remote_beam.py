"""Issue #29: beam search over one-token requests to a remote model (engine.strategies.remote_beam, vLLM's
method), recorded as the local beam search's records; against the real llama-server (marker
`remote`), except the refusal."""

from __future__ import annotations

import pytest

from engine.strategies import beam, remote_beam


from engine import runner
from engine.runner import RunRequest
from engine.strategies.beam import BeamStep, BeamTrace
from engine.config import DecodingConfig
from engine.trace import Trace
from tests.helpers.remote_llamacpp import PROMPT, server_test
from tests.helpers.remote_runner import offline_model


def test_score_is_vllm_s_length_normalised_sum():
    # 3 prompt tokens + 2 generated, the EOS (9) not counted: -2.0 / 4 ** 1.0
    assert remote_beam.score(-2.0, 3, [5, 9], (9,), 1.0) == -0.5
    assert remote_beam.score(-2.0, 3, [5, 6], (9,), 2.0) == -2.0 / 25


def test_diverse_beam_search_is_refused_in_one_line():
    config = DecodingConfig(strategy="beam", num_beams=2, num_beam_groups=2, diversity_penalty=0.5)
    with pytest.raises(ValueError, match="^num_beam_groups: 2 groups .* do not run on a remote model; use 1$"):
        next(runner.stream(RunRequest(offline_model(), "hi", config, prompt_ids=[1, 2])))


@server_test
def test_one_beam_is_greedy(server_model):
    greedy = runner.run(RunRequest(server_model, PROMPT, DecodingConfig(strategy="greedy", max_new_tokens=10)))
    events = list(runner.stream(RunRequest(server_model, PROMPT, DecodingConfig(strategy="beam", num_beams=1, max_new_tokens=10))))
    trace = events[-1].trace
    assert all(isinstance(e.record, BeamStep) for e in events[:-1]) and len(events) == 11
    assert trace.generated_token_ids == greedy.generated_token_ids  # no EOS within the budget here
    tree = trace.beam
    assert isinstance(tree, BeamTrace) and tree.candidates_per_step == 2
    assert all(len(s.candidates) == 2 for s in tree.steps)
    assert [sum(c.status == "kept" for c in s.candidates) for s in tree.steps] == [1] * 9 + [0]
    assert trace.extra["remote"]["requests"] == 10


@server_test
def test_two_beams_find_a_score_at_least_greedy_s(server_model):
    config = DecodingConfig(strategy="beam", max_new_tokens=10, length_penalty=1.0)
    one = runner.run(RunRequest(server_model, PROMPT, config.replace(num_beams=1)))
    two = runner.run(RunRequest(server_model, PROMPT, config.replace(num_beams=2)))
    best, greedy = two.beam.hypotheses[two.beam.winner], one.beam.hypotheses[one.beam.winner]
    print(f"greedy score {greedy.score:.4f} ({greedy.text!r}); 2 beams {best.score:.4f} ({best.text!r})")
    assert best.score >= greedy.score
    assert two.generated_token_ids == best.token_ids
    path = beam.lineage(two.beam, len(best.path) - 1, best.path[-1])
    assert path == best.path  # the Beam view's walk up the tree finds the winner's candidates
    assert beam.lineage_tokens(two.beam, len(best.path) - 1, best.path[-1]) == best.token_ids
    again = Trace.from_json(two.to_json())
    assert again.beam.hypotheses[0].token_ids == best.token_ids  # read back typed
