"""A trace from outside (the /branch and /explore_step arguments, a pasted file) is capped at what a
run can make before anything is built from it: steps and ids (max_new_tokens), stages, top-N,
string lengths, nesting. Each refusal is one line naming the field, and it comes at once."""

import json
import time

import pytest

from engine.config import ConfigError, KNOBS
from engine.trace import MAX_TRACE_STEPS, untrusted_trace


def _trace(**fields):
    base = {"model": "m", "strategy": "sample", "config": {}, "prompt": "p", "prompt_token_ids": [1, 2], "text": "",
            "generated_token_ids": [3], "stop_reason": "eos", "steps": [],
            "timing": {"ttft_ms": 0.0, "tokens_per_s": 0.0, "total_ms": 0.0}}
    return base | fields


def _step(**fields):
    stage = {"name": "raw", "kept": 1, "mass_removed": 0.0, "entropy": 0.0, "tv_distance": 0.0, "top": []}
    return {"index": 0, "chosen_token_id": 3, "chosen_token": "x", "chosen_prob": 1.0, "raw_prob": 1.0, "draw": None,
            "draw_low": None, "draw_high": None, "entropy": 0.0, "raw_entropy": 0.0, "stages": [stage]} | fields


def test_limits_are_the_configs():
    assert MAX_TRACE_STEPS == KNOBS["max_new_tokens"].high == 1024


@pytest.mark.parametrize("value, field", [
    (_trace(generated_token_ids=list(range(8000))), "generated_token_ids"),
    (_trace(steps=[_step()] * 1025), "steps"),
    (_trace(prompt_token_ids=[1] * 10_000), "prompt_token_ids"),
    (_trace(steps=[_step(stages=[{"name": "raw", "top": [{"token": "x"}] * 101}])]), "steps[0].stages[0].top"),
    (_trace(steps=[_step(stages=[{"name": "raw"}] * 200)]), "steps[0].stages"),
    (_trace(steps=[_step(chosen_token="x" * 5000)]), "steps[0].chosen_token"),
    (_trace(prompt="x" * 300_000), "prompt"),
    (_trace(extra={"a": json.loads("[" * 50 + "]" * 50)}), "extra"),
    (_trace(steps=[_step(stages=[{"name": "raw", "params": json.loads("[" * 50 + "]" * 50)}])]),
     "steps[0].stages[0].params"),
    (_trace(steps="x"), "steps"),
])
def test_oversized_traces_name_the_field(value, field):
    for form in (value, json.dumps(value)):
        start = time.perf_counter()
        with pytest.raises(ConfigError) as err:
            untrusted_trace(form, "trace")
        assert time.perf_counter() - start < 1.0
        message = str(err.value)
        assert message.startswith(f"trace: {field}: ") and "\n" not in message and len(message) < 300, message


@pytest.mark.parametrize("text", ["[" * 100_000, '{"a":' * 100_000, "NaN", "[1, 2]", "{", "5"])
def test_hostile_json_text_is_one_line(text):
    with pytest.raises(ConfigError) as err:
        untrusted_trace(text, "parent")
    assert str(err.value).startswith("parent: not a trace") and len(str(err.value)) < 300


def test_a_real_sized_trace_passes():
    trace = untrusted_trace(json.dumps(_trace(steps=[_step()] * 1024, generated_token_ids=[3] * 1024)))
    assert len(trace.steps) == 1024 and trace.steps[0].stages[0].state == {}
