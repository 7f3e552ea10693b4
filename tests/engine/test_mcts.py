"""MCTS decoding on a hand-built bigram model whose right answer is known by hand: greedy takes
the locally likelier token into a flat, low-probability continuation; lookahead finds the other
one. Visit counts, cache reuse, reproducibility, stop rules and the trace JSON."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.strategies import decode, mcts
from engine import runner
from engine.runner import RunRequest
from engine.config import ConfigError, DecodingConfig
from engine.control import RunControl, RunStopped
from engine.trace import Trace
from tests.helpers.mcts import StopAfter  # noqa: F401

# P[a] = the next-token distribution after token a (8 tokens). From the prompt token 0, greedy
# takes 1 (0.55), after which every continuation is a 1-in-3 guess among 5, 6, 7; token 2 (0.45)
# leads into 3, 4, 3, 4... with probability 0.97 each.
EPS = 1e-4
TABLE = {
    0: {1: 0.55, 2: 0.45},
    1: {5: 1 / 3, 6: 1 / 3, 7: 1 / 3},
    2: {3: 0.97},
    3: {4: 0.97},
    4: {3: 0.97},
    5: {5: 1 / 3, 6: 1 / 3, 7: 1 / 3},
    6: {5: 1 / 3, 6: 1 / 3, 7: 1 / 3},
    7: {5: 1 / 3, 6: 1 / 3, 7: 1 / 3},
}


def bigram_probs() -> torch.Tensor:
    """[8, 8]: row a is the next-token distribution after a (every cell at least EPS)."""
    p = torch.full((8, 8), EPS)
    for a, row in TABLE.items():
        for b, prob in row.items():
            p[a, b] = prob
    return p / p.sum(dim=1, keepdim=True)


def bigram_llama() -> LlamaForCausalLM:
    """A 1-layer Llama whose logits depend only on the last token: attention and MLP outputs are
    zeroed, the embedding is one-hot, so logits = lm_head(norm(e_a)) = log P[a] (the RMS norm
    maps a one-hot e_a to sqrt(8) e_a)."""
    config = LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=0, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
                         rms_norm_eps=1e-12)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(8))
        model.model.layers[0].self_attn.o_proj.weight.zero_()
        model.model.layers[0].mlp.down_proj.weight.zero_()
        model.lm_head.weight.copy_(bigram_probs().log().T / math.sqrt(8))
    return model


@pytest.fixture(scope="module")
def bigram(tiny_lm):
    return dataclasses.replace(tiny_lm, name="bigram-8", model=bigram_llama(), eos_token_ids=(), _token_text={})


CONFIG = DecodingConfig(strategy="mcts", temperature=0.0, max_new_tokens=4, mcts_simulations=24,
                        mcts_expand_k=2, mcts_rollout_tokens=3)


def total_logprob(tokens: list[int], first: int = 0) -> float:
    p = bigram_probs()
    return sum(math.log(p[a, b]) for a, b in zip([first, *tokens], tokens))


def test_the_bigram_model_has_the_hand_table_as_logits(bigram):
    logits = bigram.model(torch.tensor([[0, 1, 2, 3]])).logits[0]
    torch.testing.assert_close(torch.softmax(logits, -1), bigram_probs()[[0, 1, 2, 3]], atol=1e-5, rtol=1e-4)


def test_lookahead_avoids_the_greedy_trap(bigram):
    greedy = [s.chosen_token_id for s in decode.stream(bigram, [0], DecodingConfig(strategy="greedy", max_new_tokens=4))]
    trace = runner.run(RunRequest(bigram, "", CONFIG, prompt_ids=[0]))
    assert greedy[0] == 1  # greedy walks into the flat branch
    assert trace.generated_token_ids == [2, 3, 4, 3]  # by hand: the 0.45 token then the 0.97 chain
    # log(0.45) + 3 log(0.97) ~ -0.89 vs log(0.55) + 3 log(1/3) ~ -3.89 for greedy
    assert total_logprob(trace.generated_token_ids) > total_logprob(greedy) + 2.5
    assert trace.summary["total_raw_logprob"] == pytest.approx(total_logprob([2, 3, 4, 3]), abs=1e-3)


def test_visit_counts_sum_to_the_simulations(bigram):
    trace = runner.run(RunRequest(bigram, "", CONFIG, prompt_ids=[0]))
    for position in mcts.positions_of(trace):
        nodes = position.nodes
        root = nodes[0]
        assert root.visits == CONFIG.mcts_simulations
        assert sum(nodes[c].visits for c in root.children) == CONFIG.mcts_simulations
        for node in nodes:  # a node's visits = its own rollouts + its children's visits
            assert node.visits == len(node.values) + sum(nodes[c].visits for c in node.children)
        committed = [n for n in nodes if n.committed]
        assert len(committed) == 1 and committed[0].parent == 0
        assert committed[0].token_id == position.chosen_token_id
        assert committed[0].visits == max(nodes[c].visits for c in root.children)


def test_node_values_are_mean_raw_logprobs_of_path_and_rollout(bigram):
    """The first simulation visits the root's most probable child (1) and rolls out greedily
    among 5, 6, 7 (1/3 each); its value is the mean of the four raw log-probs."""
    position = mcts.positions_of(runner.run(RunRequest(bigram, "", CONFIG.replace(max_new_tokens=1 + 3), prompt_ids=[0])))[0]
    first = position.nodes[position.nodes[0].children[0]]
    assert first.token_id == 1 and first.prior == pytest.approx(0.55, abs=1e-3)
    assert len(first.rollout) == 3 and set(first.rollout) <= {5, 6, 7}
    assert first.values[0] == pytest.approx(total_logprob([1, *first.rollout]) / 4, abs=1e-4)
    assert first.values[0] == pytest.approx((math.log(0.55) + 3 * math.log(1 / 3)) / 4, abs=1e-3)


def test_priors_come_from_the_stage_chain(bigram):
    """Banning token 2's text makes it unreachable: MCTS then has to take 1."""
    word = bigram.token_text(2)
    config = CONFIG.replace(temperature=1.0, banned_words=[word]) if word.strip() else None
    if config is None:
        pytest.skip("token 2 has no text to ban")
    trace = runner.run(RunRequest(bigram, "", config, prompt_ids=[0]))
    assert 2 not in trace.generated_token_ids


def test_seeded_runs_repeat_and_json_is_strict(bigram):
    a, b = (runner.run(RunRequest(bigram, "", CONFIG.replace(temperature=1.0, seed=3), prompt_ids=[0])) for _ in range(2))
    assert a.generated_token_ids == b.generated_token_ids
    assert a.extra["mcts"][0].nodes == b.extra["mcts"][0].nodes
    text = a.to_json()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    back = mcts.positions_of(Trace.from_json(text))
    assert back[0].nodes[0].children == a.extra["mcts"][0].nodes[0].children
    assert back[0].chosen_token_id == a.generated_token_ids[0]


def test_the_cache_is_reused_not_rebuilt(bigram, monkeypatch):
    """Each simulation feeds only its path (one forward) and the rollout; the prompt is fed once."""
    fed = []
    original = mcts.KVCache.forward

    def spy(self, input_ids, **kw):
        fed.append(input_ids.shape[1])
        return original(self, input_ids, **kw)

    monkeypatch.setattr(mcts.KVCache, "forward", spy)
    prompt = [0, 3, 4, 3, 4, 3, 4, 0]
    trace = runner.run(RunRequest(bigram, "", CONFIG.replace(max_new_tokens=2), prompt_ids=prompt))
    assert fed[0] == len(prompt) and max(fed[1:]) <= CONFIG.max_new_tokens
    searched = sum(p.forwards for p in mcts.positions_of(trace))
    assert len(fed) == 1 + searched + 1  # prefill, the searches, one step after the first commit


def test_a_stop_before_the_first_simulation_gives_an_empty_partial_trace(bigram):
    control = RunControl()
    control.cancel()
    trace = runner.run(RunRequest(bigram, "", CONFIG, prompt_ids=[0], control=control))
    assert trace.generated_token_ids == [] and trace.summary["stopped"] == "cancelled"
    assert mcts.interrupted_of(trace).simulations == 0 and trace.stop_reason == ""


def test_positions_raises_a_search_stopped_holding_the_tree_so_far(bigram):
    with pytest.raises(RunStopped) as stop:
        list(mcts.positions(bigram, [0], CONFIG, StopAfter(5)))
    assert isinstance(stop.value, mcts.SearchStopped) and stop.value.reason == "cancelled"
    assert stop.value.position.simulations == 5 and stop.value.position.nodes[0].visits == 5


@pytest.mark.parametrize("tokens, sims", [(0, 3), (2, 0), (3, 23)])  # the first, a middle, the last position
@pytest.mark.parametrize("reason", ["cancelled", "time_limit"])
def test_a_stopped_run_returns_the_tokens_and_trees_so_far(bigram, tokens, sims, reason):
    full = runner.run(RunRequest(bigram, "", CONFIG, prompt_ids=[0]))
    control = StopAfter(tokens * CONFIG.mcts_simulations + sims, reason)
    trace = runner.run(RunRequest(bigram, "", CONFIG, prompt_ids=[0], control=control))
    assert trace.summary["stopped"] == reason
    assert ("time limit" in trace.summary["stopped_message"]) == (reason == "time_limit")
    assert trace.generated_token_ids == full.generated_token_ids[:tokens] and len(trace.steps) == tokens
    assert [p.nodes for p in mcts.positions_of(trace)] == [p.nodes for p in mcts.positions_of(full)][:tokens]
    interrupted = mcts.interrupted_of(trace)
    assert interrupted.index == tokens and interrupted.simulations == sims
    assert interrupted.chosen_token_id == mcts.NOT_COMMITTED and not any(n.committed for n in interrupted.nodes)
    assert interrupted.nodes[0].visits == sims
    assert trace.summary["simulations"] == tokens * CONFIG.mcts_simulations + sims
    back = Trace.from_json(trace.to_json())  # the partial trace is strict JSON and reads back
    assert mcts.interrupted_of(back).nodes[0].visits == sims and back.summary["stopped"] == reason


def test_knobs_are_validated():
    with pytest.raises(ConfigError, match="mcts_simulations: 0 is out of range"):
        DecodingConfig(strategy="mcts", mcts_simulations=0)
    with pytest.raises(ConfigError, match="mcts_expand_k"):
        DecodingConfig(strategy="mcts", mcts_expand_k=17)


@pytest.mark.slow
def test_mcts_on_the_embedded_model_is_no_worse_than_greedy(embedded):
    ids = embedded.encode("The capital of France is", chat=False)
    config = DecodingConfig(strategy="mcts", temperature=0.0, max_new_tokens=6, mcts_simulations=12)
    trace = runner.run(RunRequest(embedded, "", config, prompt_ids=ids))
    greedy = decode.assemble(embedded, "", ids, config, list(decode.stream(embedded, ids, config.replace(strategy="greedy"))), False)
    assert len(trace.steps) == 6
    assert trace.summary["total_raw_logprob"] >= sum(math.log(s.raw_prob) for s in greedy.steps) - 1.0


def test_raw_logprob_matches_the_hand_table(bigram):
    assert mcts.raw_logprob(bigram, [0], [2, 3, 4]) == pytest.approx(total_logprob([2, 3, 4]), abs=1e-4)
    assert mcts.raw_logprob(bigram, [0], []) == 0.0
