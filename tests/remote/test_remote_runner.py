"""Issue #29: a remote model goes through the one strategy protocol (engine.runner.stream looks
its streams up by the model's backend). Against the real llama-server of tests/conftest.py
(marker `remote`), except the refusal, which needs no server."""

from __future__ import annotations

import pytest

from engine.strategies import served_decode
from engine.backends import llamacpp, served
from engine import runner
from engine.runner import RunRequest
from engine.config import DecodingConfig
from tests.helpers.remote_llamacpp import PROMPT, llamacpp_greedy, server_test
from tests.helpers.remote_runner import offline_model  # noqa: F401


@pytest.mark.parametrize("strategy", ["mcts", "medusa", "contrastive_search"])
def test_a_strategy_the_backend_lacks_is_one_value_error_naming_both(strategy):
    with pytest.raises(ValueError, match=rf"^strategy: '{strategy}' does not run on the llamacpp backend; "
                                         r"it runs beam, greedy, sample, speculative$"):
        next(runner.stream(RunRequest(offline_model(), "hi", DecodingConfig(strategy=strategy, top_k=4))))


def test_the_mode_is_checked():
    with pytest.raises(ValueError, match="^mode: expected step or fast, got 'slow'$"):
        offline_model().with_mode("slow")


@pytest.fixture(scope="module")
def server_model(llama_server) -> served.RemoteModel:
    return llamacpp.connect(llama_server, timeout_s=60)


SAMPLE = DecodingConfig(strategy="sample", temperature=1.1, top_k=40, max_new_tokens=10, seed=7)


@server_test
def test_runner_run_on_a_remote_model_is_step_mode(server_model):
    greedy = DecodingConfig(strategy="greedy", max_new_tokens=12)
    events = list(runner.stream(RunRequest(server_model, PROMPT, greedy)))
    trace = events[-1].trace
    assert [e.steps[0] for e in events[:-1]] == trace.steps  # an Event per token, then the Trace
    assert trace.generated_token_ids == served_decode.run_step(server_model, PROMPT, greedy).generated_token_ids
    assert trace.generated_token_ids == llamacpp_greedy(server_model, server_model.encode(PROMPT), 12)
    assert trace.extra["remote"]["mode"] == "step" and len(trace.extra["remote"]["tail_mass"]) == 12
    sampled = runner.run(RunRequest(server_model, PROMPT, SAMPLE))
    assert sampled.generated_token_ids == served_decode.run_step(server_model, PROMPT, SAMPLE).generated_token_ids
    fast = runner.run(RunRequest(server_model.with_mode("fast"), PROMPT, greedy))
    assert fast.generated_token_ids == trace.generated_token_ids and fast.extra["remote"]["mode"] == "fast"


@server_test
def test_branching_a_remote_run_at_a_middle_step(server_model):
    parent = runner.run(RunRequest(server_model, PROMPT, SAMPLE))
    same = runner.collect(runner.branch(server_model, parent, 4, parent.generated_token_ids[4]))
    assert same.generated_token_ids == parent.generated_token_ids  # the draws after a kept step are the run's
    other = next(t.token_id for t in parent.steps[4].stages[0].top if t.token_id != parent.generated_token_ids[4])
    child = runner.collect(runner.branch(server_model, parent, 4, other))
    assert child.generated_token_ids[:5] == parent.generated_token_ids[:4] + [other]
    assert child.branch_of == 4 and child.steps[4].forced
    assert len(child.extra["remote"]["tail_mass"]) == len(child.steps) - 4  # the label covers the new steps
    greedy = runner.collect(runner.branch(server_model, parent, 4, None,
                                          config=DecodingConfig(strategy="greedy", max_new_tokens=10)))
    ids = server_model.encode(PROMPT) + parent.generated_token_ids[:4]
    assert greedy.generated_token_ids[4:] == llamacpp_greedy(server_model, ids, 6)  # a longer prompt to the server
    with pytest.raises(ValueError, match="^prefix: a fast-mode run of .* cannot continue from a step"):
        runner.collect(runner.branch(server_model.with_mode("fast"), parent, 4, other))
