"""Search & heads view: the MCTS and Medusa handlers driven directly (tiny random Llama; the
embedded model for one slow test each), outputs keyed by component."""

from __future__ import annotations

import json
import math

import pytest

from engine.strategies import medusa
from engine.config import ConfigError, DecodingConfig
from engine.control import RunControl
from engine.strategies.medusa import MedusaHeads
from playground.events import error_message
from playground.views import search
from tests.helpers.search_view import mcts_out, shared  # noqa: F401

PROMPT = "The capital of France is"


def medusa_out() -> search.MedusaOutputs:
    return search.MedusaOutputs(*[f"medusa.{n}" for n in ("status", "text", "summary", "round_picker", "round_tree",
                                                          "accept", "download", "session")])


def request(lm, config: DecodingConfig, prompt: str = PROMPT) -> search.RunRequest:
    return search.RunRequest(lm, prompt, lm.encode(prompt, False), config, False)


def test_mcts_handler_draws_a_tree_per_position_and_compares_three_strategies(tiny_lm, shared):
    out = mcts_out()
    config = DecodingConfig(strategy="mcts", max_new_tokens=3, mcts_simulations=6, mcts_expand_k=3,
                            mcts_rollout_tokens=1)
    updates = list(search.stream_mcts(out, shared, request(tiny_lm, config), RunControl()))
    last = updates[-1]
    session: search.MctsSession = last[out.session]
    assert len(session.positions) == 3
    for p in session.positions:  # every simulation passes through exactly one child of the root
        assert sum(p.nodes[c].visits for c in p.nodes[0].children) == 6
    assert [r[0] for r in session.quality] == ["mcts", "greedy", f"beam ({search.COMPARE_BEAMS})"]
    assert last[out.tree].data and len(last[out.visits]) == 3  # expand_k children of the root
    assert last[out.text] == session.trace.text
    # the MCTS row's total equals the engine's own sum of raw log-probs of the committed tokens
    assert session.quality[0][1] == pytest.approx(session.trace.summary["total_raw_logprob"], abs=1e-3)
    assert [row[0] for row in last[out.quality_table]] == ["mcts", "greedy", "beam (4)"]


def test_mcts_position_picker_redraws_that_position_without_the_model(tiny_lm, shared):
    out = mcts_out()
    config = DecodingConfig(strategy="mcts", max_new_tokens=2, mcts_simulations=4, mcts_rollout_tokens=0)
    session = list(search.stream_mcts(out, shared, request(tiny_lm, config), RunControl()))[-1][out.session]
    first = search.tree_updates(out, session, 0)
    assert first[out.tree].layout.title.text.startswith("Token 0:")
    assert search.tree_updates(out, None, 0) == {}
    assert [c[1] for c in search.position_choices(session.positions)] == [0, 1]


def test_mcts_trace_api_returns_strict_json_with_the_trees(tiny_lm, shared, monkeypatch):
    monkeypatch.setattr(shared, "lm", lambda model, quantization: tiny_lm)
    data = search.mcts_trace(shared, PROMPT, {"max_new_tokens": 2, "mcts_simulations": 3}, control=RunControl())
    json.dumps(data, allow_nan=False)
    assert data["strategy"] == "mcts" and len(data["extra"]["mcts"]) == 2
    assert data["summary"]["simulations"] == 6
    with pytest.raises(ConfigError, match="mcts_simulations"):
        search.mcts_trace(shared, PROMPT, {"mcts_simulations": 0}, control=RunControl())


def test_medusa_handler_shows_rounds_tokens_per_forward_and_speedup(tiny_lm, shared, monkeypatch):
    # Untrained heads (W = 0) read the base LM head: valid proposals, so the whole path runs.
    monkeypatch.setattr(medusa, "load_heads", lambda lm, path=None: MedusaHeads(64, 3))
    out = medusa_out()
    config = DecodingConfig(strategy="medusa", max_new_tokens=6, medusa_heads=3)
    last = list(search.stream_medusa(out, shared, request(tiny_lm, config), RunControl()))[-1]
    session: search.MedusaSession = last[out.session]
    trace = session.trace
    assert sum(len(r.emitted_token_ids) for r in session.rounds) == len(trace.generated_token_ids) == 6
    assert trace.summary["tokens_per_target_forward"] == pytest.approx(6 / len(session.rounds))
    assert "tokens per target forward" in last[out.summary] and "Speed-up vs target-only" in last[out.summary]
    assert isinstance(trace.summary["baseline_same_tokens"], bool)  # random weights: near-ties may flip
    assert last[out.round_tree].data and last[out.accept].data
    assert len(session.first_tokens) == len(session.rounds)


def test_medusa_without_heads_is_a_one_line_user_message(tiny_lm, shared):
    out = medusa_out()
    config = DecodingConfig(strategy="medusa", max_new_tokens=4)
    with pytest.raises(ConfigError) as caught:
        list(search.stream_medusa(out, shared, request(tiny_lm, config), RunControl()))
    message = error_message(caught.value, "generation")
    assert "no trained heads" in message and "\n" not in message


def test_medusa_summary_says_na_for_a_missing_speedup():
    class T:  # the summary only reads these fields
        summary = {"tokens_per_target_forward": 2.0, "speedup": math.nan, "head_acceptance": [0.5]}
        rounds = [1, 2]
        generated_token_ids = [1, 2, 3, 4]
        timing = type("Timing", (), {"tokens_per_s": 10.0})()

    text = search.medusa_summary(T())
    assert "**2.00 tokens per target forward**" in text and "n/a×" in text and "head 1: 50.0%" in text


@pytest.mark.slow
def test_mcts_and_medusa_on_the_embedded_model(embedded, shared):
    config = DecodingConfig(strategy="mcts", max_new_tokens=3, mcts_simulations=8)
    session = list(search.stream_mcts(mcts_out(), shared, request(embedded, config), RunControl()))[-1]["mcts.session"]
    assert len(session.quality) == 3 and all(math.isfinite(r[1]) for r in session.quality)
    config = DecodingConfig(strategy="medusa", max_new_tokens=12, medusa_heads=3, temperature=0.0)  # greedy: same tokens
    last = list(search.stream_medusa(medusa_out(), shared, request(embedded, config, "Say hello."),
                                     RunControl()))[-1]
    trace = last["medusa.session"].trace
    assert trace.summary["baseline_same_tokens"] is True
    assert trace.summary["tokens_per_target_forward"] >= 1.0


def test_medusa_handler_runs_the_dynamic_tree_for_two_users_at_once(tiny_lm, shared, monkeypatch):
    """Two people run Medusa at once with different ``medusa_tree_min_score``: each summary and
    trace names its own threshold, every verified node reaches it, and greedy stays exact."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.helpers.medusa import random_heads, target_only

    heads = random_heads(64, 3, 3.0)
    monkeypatch.setattr(medusa, "load_heads", lambda lm, path=None: heads)

    def run(min_score: float) -> dict:
        config = DecodingConfig(strategy="medusa", temperature=0.0, max_new_tokens=8, medusa_heads=3,
                                medusa_tree_width=4, medusa_tree_nodes=24, medusa_tree_min_score=min_score)
        out = medusa_out()
        last = list(search.stream_medusa(out, shared, request(tiny_lm, config), RunControl()))[-1]
        return {"summary": last[out.summary], "trace": last[out.session].trace, "config": config}

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(run, (0.05, 0.3)))
    for min_score, got in zip((0.05, 0.3), results):
        trace = got["trace"]
        assert trace.summary["tree_min_score"] == min_score
        assert f"only paths with probability ≥ {min_score:g}: " in got["summary"]
        assert all(n.score >= min_score for r in medusa.rounds_of(trace) for n in r.tree)
        assert trace.generated_token_ids == target_only(tiny_lm, tiny_lm.encode(PROMPT, False), got["config"])
