"""Issue #39 through the app's API (gradio_client against the real server on 127.0.0.1): two users
at once, each with their own grammar, get their own constrained traces; hostile grammars (markup, a
lone surrogate, a huge text, the wrong type) are one line naming ``grammar``; the what-if endpoint
re-processes a grammar step exactly."""

from __future__ import annotations

import json
import threading

import jsonschema
import pytest

from engine.config import DecodingConfig
from engine.presets import builtin_presets
from tests.helpers.api import api_client

pytestmark = pytest.mark.slow

SCHEMA = json.loads(builtin_presets()["json-object"].config.grammar)


def step_trace(url: str, prompt: str, knobs: dict, preset: str = "") -> dict:

    return api_client(url).predict(prompt, knobs, preset, True, "embedded", "none", api_name="/step_trace")


def test_two_users_at_once_each_get_their_own_grammar(live_app):
    results: dict[str, dict] = {}

    def run(name: str, prompt: str, knobs: dict, preset: str) -> None:
        results[name] = step_trace(live_app, prompt, knobs, preset)

    users = [threading.Thread(target=run, args=("json", "Describe a fictional person.", {"max_new_tokens": 64},
                                                "json-object")),
             threading.Thread(target=run, args=("answer", "Should I take an umbrella today?",
                                                {"grammar": "(Yes|No)", "grammar_kind": "regex", "max_new_tokens": 6,
                                                 "strategy": "sample", "seed": 3}, ""))]
    for user in users:
        user.start()
    for user in users:
        user.join(600)
    jsonschema.validate(json.loads(results["json"]["text"]), SCHEMA)
    # the trace's config is sparse: grammar_kind's neutral json_schema is left out, and read back as itself
    held = DecodingConfig.from_dict(results["json"]["config"])
    assert (held.grammar_kind, json.loads(held.grammar)) == ("json_schema", SCHEMA) and results["json"]["stop_reason"] == "eos"
    assert results["answer"]["text"] in ("Yes", "No") and results["answer"]["config"]["grammar"] == "(Yes|No)"
    stage = results["answer"]["steps"][0]["stages"][1]
    assert stage["name"] == "grammar" and stage["params"]["allowed"] >= 2 and stage["removed"]


@pytest.mark.parametrize("knobs, words", [
    ({"grammar": "<img src=x onerror=alert(1)>(", "grammar_kind": "regex"}, "grammar: this regular expression does not"),
    ({"grammar": "(yes|\ud800)", "grammar_kind": "regex"}, "grammar: invalid text: a lone surrogate"),
    ({"grammar": "a" * 5000, "grammar_kind": "regex"}, "grammar: 5,000 characters is over the 4,000-character limit"),
    ({"grammar": 5, "grammar_kind": "regex"}, "grammar: expected a text of at most 4,000 characters, got 5"),
    ({"grammar": "{", "grammar_kind": "json_schema"}, "grammar: the JSON schema is not valid JSON"),
])
def test_a_hostile_grammar_is_one_line(live_app, knobs, words):
    """Through gradio_client, as a script sends it; a lone surrogate, which gradio_client's own encoder
    refuses to send, as raw HTTP (its JSON escape, as curl or a browser sends it)."""
    if "\ud800" in str(knobs.get("grammar")):
        from tests.helpers.api_fuzz import _raw

        body = json.dumps({"data": ["Hello", knobs | {"max_new_tokens": 4}, "", True, "embedded", "none"]})
        kind, data = _raw(live_app, "/step_trace", body)
        assert kind == "error", (kind, data)
        message = data["error"]
    else:
        with pytest.raises(Exception) as err:
            step_trace(live_app, "Hello", knobs | {"max_new_tokens": 4})
        message = str(err.value)
    assert words in message and "Traceback" not in message and "\n" not in message, message


def test_the_whatif_endpoint_reprocesses_a_grammar_step_exactly(live_app):

    trace = step_trace(live_app, "Should I take an umbrella today?",
                       {"grammar": "(Yes|No|Maybe)", "grammar_kind": "regex", "max_new_tokens": 6})
    client = api_client(live_app)
    for at in range(len(trace["steps"])):
        stages = client.predict(trace, at, {}, "embedded", "none", api_name="/explore_step")
        assert [s["name"] for s in stages] == [s["name"] for s in trace["steps"][at]["stages"]]
        assert stages[1]["params"]["allowed"] == trace["steps"][at]["stages"][1]["params"]["allowed"]
        assert [t["token_id"] for t in stages[1]["top"]] == [t["token_id"] for t in trace["steps"][at]["stages"][1]["top"]]


def test_compare_puts_a_grammar_lane_beside_an_unconstrained_one(live_app):
    """Compare (the /compare endpoint): a lane under the yes/no/maybe regex beside the same sampling
    without it, one prompt and seed. The grammar lane answers one of the three, its first step records
    the mask; the free lane has no grammar stage; and the grammar lane's tokens equal the same run alone
    through /step_trace (the batched forward changes nothing)."""

    prompt = "Should I take an umbrella today?"
    lanes = [{"preset": "yes-no-maybe"}, {"preset": "yes-no-maybe", "config": {"grammar": ""}}]
    data = api_client(live_app).predict(prompt, lanes, 5, 8, True, "embedded", "none", api_name="/compare")
    held, free = (lane["trace"] for lane in data["lanes"])
    assert held["text"] in ("Yes", "No", "Maybe") and held["stop_reason"] == "eos"
    assert held["steps"][0]["stages"][1]["name"] == "grammar" and held["steps"][0]["stages"][1]["params"]["allowed"] >= 3
    assert "grammar" not in [s["name"] for step in free["steps"] for s in step["stages"]]
    alone = step_trace(live_app, prompt, {"seed": 5, "max_new_tokens": 8}, "yes-no-maybe")
    assert alone["generated_token_ids"] == held["generated_token_ids"]
