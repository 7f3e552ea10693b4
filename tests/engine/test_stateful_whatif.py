"""What-if reproduces stateful stages exactly: each step's stage records carry the state the stage
used (mirostat's μ before the step, XTC's draw u), so re-processing step k with the run's own knobs
gives the run's own stage outputs at step k, at the first, a middle and the last step, also after
the trace went through its JSON. XTC with threshold 0 and probability 1 keeps one token (the least
likely one alive, as llama.cpp keeps the last candidate above the threshold), never none."""

import json
import math

import pytest
import torch

from engine import explore, runner
from engine.runner import RunRequest
from engine.config import DecodingConfig
from engine.chain import Chain
from engine.stages import Xtc
from engine.trace import Trace

PROMPT = "one two three one two three one two three one two"
CONFIGS = {
    "mirostat-v1": DecodingConfig(strategy="sample", seed=5, max_new_tokens=10, temperature=0.05, mirostat=1,
                                  mirostat_tau=3.0, mirostat_eta=0.5),
    "mirostat-v2": DecodingConfig(strategy="sample", seed=5, max_new_tokens=10, temperature=0.05, mirostat=2,
                                  mirostat_tau=3.0, mirostat_eta=0.5),
    "xtc": DecodingConfig(strategy="sample", seed=7, max_new_tokens=10, temperature=0.05, top_k=40,
                          xtc_threshold=0.01, xtc_probability=0.5),
    "dry": DecodingConfig(strategy="sample", seed=9, max_new_tokens=10, temperature=0.05, dry_multiplier=2.0,
                          dry_allowed_length=1),
}


def _strict(text: str):
    return json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))


@pytest.fixture(scope="module")
def traces(tiny_lm):
    return {name: runner.run(RunRequest(tiny_lm, PROMPT, cfg)) for name, cfg in CONFIGS.items()}


def _same(a, b):
    assert [s.name for s in a] == [s.name for s in b]
    for x, y in zip(a, b):
        assert x.kept == y.kept, (x.name, x.kept, y.kept)
        assert [t.token_id for t in x.top] == [t.token_id for t in y.top], x.name
        assert all(abs(p.prob - q.prob) < 1e-5 for p, q in zip(x.top, y.top)), x.name
        assert math.isclose(x.entropy, y.entropy, abs_tol=1e-4), x.name
        assert x.state == y.state, x.name


@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_whatif_with_own_knobs_reproduces_the_step(tiny_lm, traces, name, where):
    trace = Trace.from_json(traces[name].to_json())  # the state survives the JSON round trip
    step = {"first": 0, "middle": len(trace.steps) // 2, "last": len(trace.steps) - 1}[where]
    _same(explore.explore_step(tiny_lm, trace, step), trace.steps[step].stages)


def test_the_trace_carries_each_steps_state(traces):
    mu = [s.stages[-2].state["mu"] for s in traces["mirostat-v2"].steps]
    assert mu[0] == 6.0 and len(set(mu)) > 1  # μ starts at 2τ and moves: a fresh stage would not match
    assert [s.stages[-2].params["mu"] for s in traces["mirostat-v2"].steps] == mu
    draws = [next(st for st in s.stages if st.name == "xtc").state["u"] for s in traces["xtc"].steps]
    assert all(0 <= u < 1 for u in draws) and len(set(draws)) == len(draws)
    _strict(traces["xtc"].to_json())


def test_mirostat_kept_count_follows_the_runs_mu(tiny_lm, traces):
    """The run's own μ at the last step, not 2τ: its kept count is the run's."""
    trace = traces["mirostat-v1"]
    last = len(trace.steps) - 1
    stages = explore.explore_step(tiny_lm, trace, last)
    assert stages[-2].kept == trace.steps[last].stages[-2].kept == trace.steps[last].stages[-2].params["kept"]


def test_xtc_whatif_needs_no_generator_and_moves_the_probability(tiny_lm, traces):
    trace = traces["xtc"]
    step = len(trace.steps) // 2
    u = next(s for s in trace.steps[step].stages if s.name == "xtc").state["u"]
    for p in (0.01, 0.99, 1.0):
        stages = explore.explore_step(tiny_lm, trace, step, {"xtc_probability": p})
        xtc = next(s for s in stages if s.name == "xtc")
        assert xtc.params["fired"] == (p >= 1 or u < p)  # the run's own draw against the new probability


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_xtc_threshold_zero_probability_one_keeps_a_token(tiny_lm, traces, where):
    trace = traces["dry"]
    step = {"first": 0, "middle": len(trace.steps) // 2, "last": len(trace.steps) - 1}[where]
    stages = explore.explore_step(tiny_lm, trace, step, {"xtc_threshold": 0.0, "xtc_probability": 1.0, "top_k": 5,
                                                          "stage_order": ["top_k", "xtc"]})
    xtc = next(s for s in stages if s.name == "xtc")
    assert xtc.kept == 1 and math.isfinite(xtc.entropy) and stages[-1].kept == 1
    top_k = next(s for s in stages if s.name == "top_k")
    assert xtc.top[0].token_id == top_k.top[-1].token_id  # the least likely of the five survives
    _strict(json.dumps([s.__dict__ for s in stages], default=lambda o: o.__dict__))


def test_xtc_never_keeps_a_masked_token():
    logits = torch.tensor([[3.0, 2.0, 1.0, -float("inf"), -float("inf")]])
    out = Xtc(0.0, 1.0)(torch.zeros(1, 1, dtype=torch.long), logits)
    assert out[0].tolist() == [-float("inf"), -float("inf"), 1.0, -float("inf"), -float("inf")]


def test_loaded_state_replaces_the_draw():
    stage = Chain.from_config(DecodingConfig(strategy="sample", xtc_threshold=0.1, xtc_probability=0.5)).stages[-1]
    stage.load_state({"u": 0.25})
    stage(torch.zeros(1, 1, dtype=torch.long), torch.tensor([[3.0, 2.9, 0.0]]))
    assert stage.params["u"] == 0.25 and stage.params["fired"] and stage.state() == {"u": 0.25}


@pytest.mark.parametrize("name", ["mirostat-v1", "mirostat-v2", "xtc"])
def test_step_through_whatif_reproduces_the_step_and_its_pick(tiny_lm, traces, name):
    """The page's what-if (engine.strategies.decode.whatif_step, from kept raw logits) with the run's own
    knobs: the run's stages and the run's token at the first, a middle and the last step."""
    from engine.strategies import decode

    trace = traces[name]
    for step in (0, len(trace.steps) // 2, len(trace.steps) - 1):
        changed = decode.whatif_step(tiny_lm, trace, step, {}, explore.raw_logits(tiny_lm, trace, step))
        _same(changed.stages, trace.steps[step].stages)
        assert changed.chosen_token_id == trace.steps[step].chosen_token_id
