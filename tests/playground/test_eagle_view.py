"""Search & heads view, EAGLE section: the handler driven directly (tiny random Llama with an
untrained head; the embedded model with the shipped head for one slow test), outputs keyed by
component. Oracles: the trace's own rounds and target-only greedy."""

from __future__ import annotations

import json

import pytest

from engine.config import ConfigError, DecodingConfig
from engine.control import RunControl
from engine.strategies import eagle
from playground.events import error_message
from playground.views import search
from tests.helpers.eagle import random_head
from tests.helpers.medusa import target_only
from tests.helpers.search_view import shared  # noqa: F401

PROMPT = "a b a b a b"


def eagle_out() -> search.EagleOutputs:
    return search.EagleOutputs(*[f"eagle.{n}" for n in ("status", "text", "summary", "round_picker", "round_tree",
                                                        "accept", "calibration", "compare", "download", "session")])


def request(lm, config: DecodingConfig, prompt: str = PROMPT, chat: bool = False) -> search.RunRequest:
    return search.RunRequest(lm, prompt, lm.encode(prompt, chat), config, chat)


@pytest.fixture
def tiny_head(tiny_lm, monkeypatch):
    head = random_head(tiny_lm, 512)
    monkeypatch.setattr(eagle, "load_head", lambda lm, path=None: head)
    return head


def run_view(lm, shared, config: DecodingConfig, prompt: str = PROMPT, chat: bool = False) -> dict:
    return list(search.stream_eagle(eagle_out(), shared, request(lm, config, prompt, chat), RunControl()))[-1]


def test_eagle_handler_shows_every_round_the_summary_and_the_side_by_side(tiny_lm, shared, tiny_head):
    out = eagle_out()
    config = DecodingConfig(strategy="eagle", temperature=0.0, max_new_tokens=10, eagle_tokens=6, eagle_depth=3)
    last = run_view(tiny_lm, shared, config)
    session: search.EagleSession = last[out.session]
    trace = session.trace
    assert trace.generated_token_ids == target_only(tiny_lm, tiny_lm.encode(PROMPT, False), config)
    assert sum(len(r.emitted_token_ids) for r in session.rounds) == len(trace.generated_token_ids) == 10
    assert len(session.rounds) >= 3 and len(session.first_tokens) == len(session.rounds)
    summary = last[out.summary]
    assert f"**{trace.summary['tokens_per_target_forward']:.2f} tokens per target forward**" in summary
    assert "Speed-up vs target-only" in summary and "Same tokens as target-only: yes" in summary
    assert last[out.text] == trace.text and last[out.accept].data and last[out.calibration].data
    assert [c[1] for c in last[out.round_picker]["choices"]] == [r.index for r in session.rounds]
    # first, a middle and the last round: each draws its own tree, every node labelled
    for i in (0, len(session.rounds) // 2, len(session.rounds) - 1):
        record = session.rounds[i]
        fig = search.eagle_round_updates(out, session, record.index)[out.round_tree]
        assert fig.layout.title.text.startswith(f"Round {record.index}: {len(record.path)} of {len(record.tree)}")
        labels = [t for trace_ in fig.data if trace_.name in ("accepted", "rejected", "untested") for t in trace_.text]
        assert len(labels) == len(record.tree)
    assert search.eagle_round_updates(out, None, 0) == {}
    rows = {row[0]: row for row in last[out.compare]}
    assert list(rows) == ["EAGLE", "target only", "Medusa", "n-gram (prompt lookup)"]
    assert rows["EAGLE"][1] == f"{trace.summary['tokens_per_target_forward']:.2f}" and rows["EAGLE"][4] == "yes"
    assert rows["Medusa"][1].startswith("n/a: ") and "no trained heads" in rows["Medusa"][1]  # none for tiny_lm
    assert rows["n-gram (prompt lookup)"][4] == "yes"  # greedy n-gram: the same tokens


def test_eagle_trace_api_returns_strict_json_with_the_trees(tiny_lm, shared, tiny_head, monkeypatch):
    monkeypatch.setattr(shared, "lm", lambda model, quantization: tiny_lm)
    data = search.eagle_trace(shared, PROMPT, {"max_new_tokens": 5}, compare_baseline=False, control=RunControl())
    json.dumps(data, allow_nan=False)
    assert data["strategy"] == "eagle" and all("tree" in r and "path" in r for r in data["rounds"])
    assert sum(len(r["emitted_token_ids"]) for r in data["rounds"]) == len(data["generated_token_ids"]) == 5


@pytest.mark.parametrize("knobs, knob", [
    ({"eagle_tokens": 0}, "eagle_tokens"), ({"eagle_depth": 99}, "eagle_depth"), ({"eagle_topk": "wide"}, "eagle_topk"),
    ({"eagle_tokens": 1e308}, "eagle_tokens"), ({"max_new_tokens": -1}, "max_new_tokens"),
])
def test_hostile_knob_values_are_one_line_naming_the_knob(tiny_lm, shared, tiny_head, monkeypatch, knobs, knob):
    monkeypatch.setattr(shared, "lm", lambda model, quantization: tiny_lm)
    with pytest.raises(ConfigError) as caught:
        search.eagle_trace(shared, PROMPT, knobs, control=RunControl())
    message = error_message(caught.value, "generation")
    assert knob in message and "\n" not in message
    with pytest.raises(ConfigError, match=knob):
        DecodingConfig(strategy="eagle", **knobs)


@pytest.mark.slow
def test_eagle_on_the_embedded_model_with_the_shipped_head(embedded, shared):
    """The shipped head on a chat prompt: greedy EAGLE equals target-only; the draft accepts tokens."""
    config = DecodingConfig(strategy="eagle", temperature=0.0, max_new_tokens=16)
    last = run_view(embedded, shared, config, search.EAGLE_PROMPT, chat=True)
    trace = last["eagle.session"].trace
    assert trace.summary["baseline_same_tokens"] is True
    assert trace.summary["tokens_per_target_forward"] > 1.0
    rows = {row[0]: row for row in last["eagle.compare"]}
    assert rows["Medusa"][4] == "yes" and rows["n-gram (prompt lookup)"][4] == "yes"


def test_eagle_summary_names_the_token_that_differs_and_says_na_for_a_missing_speedup():
    class T:  # the summary only reads these fields
        summary = {"tokens_per_target_forward": 2.0, "speedup": float("nan"), "mean_tree_nodes": 8.0,
                   "eagle_tokens": 12, "eagle_depth": 5, "baseline_same_tokens": False, "baseline_first_difference": 7}
        rounds: list = []
        generated_token_ids = [1, 2, 3, 4]
        timing = type("Timing", (), {"tokens_per_s": 10.0})()

    text = search.eagle_summary(T())
    assert "**2.00 tokens per target forward**" in text and "n/a×" in text
    assert "greedy EAGLE should equal target-only greedy, but token 7 differs" in text
