"""/explore_step (what-if at a step) through gradio_client against the real server reproduces the
run's own stateful stages at the first, a middle and the last step (mirostat v1/v2's μ, XTC's draw,
DRY), and XTC with threshold 0 / probability 1 leaves a valid distribution (one token, finite
entropy), never an empty one."""

from __future__ import annotations

import json
import math

import pytest
from tests.helpers.api import api_client

pytestmark = pytest.mark.slow

RUNS = {
    "mirostat-v1": {"mirostat": 1, "mirostat_tau": 3.0, "mirostat_eta": 0.5},
    "mirostat-v2": {"mirostat": 2, "mirostat_tau": 3.0, "mirostat_eta": 0.5},
    "xtc": {"xtc_threshold": 0.05, "xtc_probability": 0.5, "top_k": 40},
    "dry": {"dry_multiplier": 2.0, "dry_allowed_length": 1},
}
PROMPT = "one two three one two three one two three one two"


def strict(value):
    def refuse(name):
        raise ValueError(name)

    return json.loads(json.dumps(value), parse_constant=refuse)


@pytest.fixture(scope="module")
def client(live_app):

    return api_client(live_app)


@pytest.fixture(scope="module")
def traces(client):
    return {name: client.predict(PROMPT, {"strategy": "sample", "seed": 4, "max_new_tokens": 7, **knobs}, "", False,
                                 api_name="/step_trace") for name, knobs in RUNS.items()}


@pytest.mark.parametrize("name", list(RUNS))
def test_explore_step_reproduces_the_run_at_first_middle_last(client, traces, name):
    trace = traces[name]
    for step in (0, len(trace["steps"]) // 2, len(trace["steps"]) - 1):
        stages = client.predict(trace, step, api_name="/explore_step")
        own = trace["steps"][step]["stages"]
        assert [s["name"] for s in stages] == [s["name"] for s in own]
        for got, want in zip(stages, own):
            assert got["kept"] == want["kept"], (name, step, got["name"])
            assert [t["token_id"] for t in got["top"]] == [t["token_id"] for t in want["top"]], (name, step, got["name"])
            assert got["state"] == want["state"]
        if name.startswith("mirostat") and step:
            assert own[-2]["state"]["mu"] != 6.0  # μ moved: a fresh stage (μ = 2τ) would not reproduce it


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_xtc_threshold_zero_probability_one_keeps_a_token(client, traces, where):
    trace = traces["dry"]
    step = {"first": 0, "middle": len(trace["steps"]) // 2, "last": len(trace["steps"]) - 1}[where]
    stages = strict(client.predict(trace, step, {"xtc_threshold": 0.0, "xtc_probability": 1.0, "top_k": 5,
                                                 "stage_order": ["top_k", "xtc"]}, api_name="/explore_step"))
    xtc = next(s for s in stages if s["name"] == "xtc")
    assert xtc["kept"] == 1 and math.isfinite(xtc["entropy"]) and stages[-1]["kept"] == 1
