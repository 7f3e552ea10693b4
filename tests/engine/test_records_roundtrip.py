"""#28, typed records: every strategy's stream yields ``Event``s whose record is its own typed
dataclass (beam step, speculative round, contrastive candidates, MCTS position, Medusa round), and
every record, and the whole Trace, survives strict JSON: written with ``dumps_strict`` (no NaN),
read back as equal records, typed again where a view reads them (``Trace.from_json``,
``untrusted_trace``)."""

from __future__ import annotations

import json

import pytest

from engine.strategies import beam, contrastive, mcts, medusa, speculative
from engine import runner
from engine.runner import RunRequest
from engine.config import DecodingConfig
from engine.control import RunControl
from engine.strategies.medusa import MedusaHeads
from engine.trace import Event, StepTrace, Trace, dumps_strict, from_dict, to_dict, untrusted_trace
from tests.helpers.hardening import AmateurRegistry, tiny_amateur  # noqa: F401 (a fixture)

PROMPT = "The quick brown fox"
SMALL = {"max_new_tokens": 4}
# strategy knobs -> the record type its events carry (None: greedy and sampling have no record)
CASES = {
    "greedy": ({}, type(None)),
    "sample": ({"temperature": 0.8, "seed": 2}, type(None)),
    "beam": ({"num_beams": 2}, beam.BeamStep),
    "speculative": ({"drafter": "ngram", "temperature": 0.7, "seed": 1}, speculative.SpecRound),
    "contrastive_search": ({"top_k": 4, "penalty_alpha": 0.6}, contrastive.SearchStep),
    "contrastive_decoding": ({"amateur": "self-int8", "temperature": 0.0}, contrastive.ContrastStep),
    "mcts": ({"mcts_simulations": 4}, mcts.MctsPosition),
    "medusa": ({"temperature": 0.9, "seed": 3}, medusa.MedusaRound),
}


def events_of(lm, amateur, strategy: str, control: RunControl | None = None) -> list[Event]:
    """One run of ``strategy`` on the tiny model. Medusa gets untrained heads (the tiny model has
    none shipped): its registered stream is ``medusa.stream``, called with them."""
    knobs, _ = CASES[strategy]
    config = DecodingConfig.from_dict({"strategy": strategy, **SMALL, **knobs})
    if strategy == "medusa":
        return list(medusa.stream(lm, PROMPT, lm.encode(PROMPT, False), config, heads=MedusaHeads(64, 3)))
    return list(runner.stream(RunRequest(lm, PROMPT, config, registry=AmateurRegistry(amateur), control=control)))


def strict_round_trip(record):
    """``record`` through strict JSON and back as its own type."""
    return from_dict(type(record), json.loads(dumps_strict(to_dict(record))))


@pytest.mark.parametrize("strategy", list(CASES))
def test_each_strategy_streams_events_with_its_record_type(tiny_lm, tiny_amateur, strategy):
    events = events_of(tiny_lm, tiny_amateur, strategy)
    assert all(type(e) is Event for e in events)
    *body, last = events
    assert last.trace is not None and last.record is None and not last.steps
    assert body and all(e.trace is None and type(e.record) is CASES[strategy][1] for e in body)
    assert all(isinstance(s, StepTrace) for e in body for s in e.steps)
    assert [s.chosen_token_id for e in body for s in e.steps] == (last.trace.generated_token_ids
                                                                  if strategy != "beam" else [])


@pytest.mark.parametrize("strategy", [s for s, (_, record) in CASES.items() if record is not type(None)])
def test_every_record_survives_strict_json(tiny_lm, tiny_amateur, strategy):
    records = [e.record for e in events_of(tiny_lm, tiny_amateur, strategy)[:-1]]
    for record in records:
        assert strict_round_trip(record) == record
    if strategy == "beam":  # the whole search tree, as the trace holds it
        tree = events_of(tiny_lm, tiny_amateur, strategy)[-1].trace.beam
        assert type(tree) is beam.BeamTrace and strict_round_trip(tree) == tree


@pytest.mark.parametrize("strategy", list(CASES))
def test_the_whole_trace_survives_strict_json_with_its_records_typed(tiny_lm, tiny_amateur, strategy):
    trace = events_of(tiny_lm, tiny_amateur, strategy)[-1].trace
    text = trace.to_json()
    json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in strict JSON"))
    for back in (Trace.from_json(text), untrusted_trace(text)):
        assert back == trace
        assert type(back.beam) is type(trace.beam) and type(back.rounds) is type(trace.rounds)
        assert {k: [type(r) for r in v] if isinstance(v, list) else type(v) for k, v in back.extra.items()} == \
               {k: [type(r) for r in v] if isinstance(v, list) else type(v) for k, v in trace.extra.items()}


def test_a_stopped_mcts_search_survives_strict_json_typed(tiny_lm, tiny_amateur):
    control = RunControl()
    control.cancel()
    trace = events_of(tiny_lm, tiny_amateur, "mcts", control)[-1].trace
    assert type(trace.extra["mcts_interrupted"]) is mcts.MctsPosition
    back = untrusted_trace(trace.to_json())
    assert back == trace and type(back.extra["mcts_interrupted"]) is mcts.MctsPosition


def test_typed_loading_leaves_records_of_other_strategies_alone(tiny_lm, tiny_amateur):
    """A greedy trace's free-form ``extra`` stays plain data (only a strategy's own records are typed)."""
    trace = events_of(tiny_lm, tiny_amateur, "greedy")[-1].trace
    trace.extra["note"] = {"rounds": [1, 2]}
    assert Trace.from_json(trace.to_json()).extra == {"note": {"rounds": [1, 2]}}
