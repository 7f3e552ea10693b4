"""What-if on a step: re-processing a step's raw logits under new knobs, checked against the run's
own records (same knobs -> same stages) and against a fresh run with the new knobs (the stages of
step k depend only on the tokens before k, so a run that made the same first k picks must agree)."""

import math

import pytest
import torch

from engine import explore, runner
from engine.runner import RunRequest
from engine.cache import KVCache
from engine.config import ConfigError, DecodingConfig

CFG = DecodingConfig(strategy="sample", seed=3, max_new_tokens=12, temperature=0.8, top_k=20, top_p=0.9)


@pytest.fixture(scope="module")
def trace(tiny_lm):
    return runner.run(RunRequest(tiny_lm, "What if the knobs moved", CFG))


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_own_knobs_reproduce_the_traces_stages(tiny_lm, trace, where):
    step = {"first": 0, "middle": len(trace.steps) // 2, "last": len(trace.steps) - 1}[where]
    stages = explore.explore_step(tiny_lm, trace, step)
    assert explore.stages_match(stages, trace.steps[step].stages)


def test_new_knobs_equal_a_forced_run_with_those_knobs(tiny_lm, trace):
    """Temperature 1.7 at step 5 must equal step 5 of a run with T 1.7 that took the same first 5 tokens."""
    step = 5
    knobs = {"temperature": 1.7, "top_k": 0}
    stages = explore.explore_step(tiny_lm, trace, step, knobs)
    new_cfg = CFG.replace(**knobs)
    prefix = trace.generated_token_ids[:step]
    from engine.strategies import decode

    forced = next(decode.stream(tiny_lm, trace.prompt_token_ids, new_cfg, prefix=prefix[:-1], force=prefix[-1]))
    reference = next(decode.stream(tiny_lm, trace.prompt_token_ids, new_cfg, prefix=prefix))
    assert forced.chosen_token_id == prefix[-1]
    assert explore.stages_match(stages, reference.stages)
    assert [s.name for s in stages] == ["raw", "temperature", "top_p", "final"]
    # flatter: the final entropy grows with temperature
    assert stages[-1].entropy > trace.steps[step].stages[-1].entropy


def test_stage_order_is_data(tiny_lm, trace):
    stages = explore.explore_step(tiny_lm, trace, 2, {"stage_order": ["top_p", "temperature"]})
    assert [s.name for s in stages][:4] == ["raw", "top_p", "temperature", "top_k"]


def test_kept_logits_skip_the_forward(tiny_lm, trace):
    cache = KVCache(tiny_lm.model)
    logits = explore.raw_logits(tiny_lm, trace, 4, cache)
    forwards = cache.forwards
    a = explore.explore_step(tiny_lm, trace, 4, {"temperature": 0.5}, logits=logits)
    b = explore.explore_step(tiny_lm, trace, 4, {"temperature": 0.5}, cache=cache)
    assert explore.stages_match(a, b)
    assert cache.forwards == forwards + 1  # sync to the same context feeds one token to get logits
    assert torch.allclose(logits, explore.raw_logits(tiny_lm, trace, 4, cache), atol=1e-5)


@pytest.mark.parametrize("step, knobs, key", [
    (-1, {}, "step"), (99, {}, "step"), (True, {}, "step"), ("2", {}, "step"),
    (0, {"temperature": -1}, "temperature"), (0, {"no_such_knob": 1}, "no_such_knob"), (0, [1], "knobs"),
    (0, {"top_p": math.nan}, "top_p"),
])
def test_bad_input_names_the_argument(tiny_lm, trace, step, knobs, key):
    with pytest.raises(ConfigError) as err:
        explore.explore_step(tiny_lm, trace, step, knobs)
    assert str(err.value).startswith(f"{key}:")
