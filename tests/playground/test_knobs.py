"""KnobPanel's pure parts: sampler groups cover every stage knob once, JSON boxes parse strictly,
every invalid knob of a click is reported at once, greedy greys exactly the sampling-only knobs."""

import pytest

from engine.config import KNOBS, SAMPLING_ONLY_STAGES, STAGE_NAMES
from playground.knobs import (KNOB_GROUPS, SAMPLING_KNOBS, STAGE_KNOBS, checked_values, component_value, display_value,
                              parse_stage_order, stage_list_html)
from playground.shared import UserError


def test_every_stage_knob_is_in_exactly_one_group():
    staged = {name for name, knob in KNOBS.items() if knob.stage is not None and knob.stage != "constraints"}
    assert sorted(STAGE_KNOBS) == sorted(staged)
    assert len(STAGE_KNOBS) == len(set(STAGE_KNOBS))
    assert [title for title, _, _ in KNOB_GROUPS] == ["Temperature shaping", "Truncation", "Penalties",
                                                      "Repetition (DRY, no-repeat n-gram)", "Adaptive (mirostat, XTC)",
                                                      "Structured output (grammar)", "Watermark"]


def test_greedy_greys_exactly_the_sampling_only_knobs():
    assert {KNOBS[n].stage for n in SAMPLING_KNOBS} == set(SAMPLING_ONLY_STAGES)
    assert "repetition_penalty" not in SAMPLING_KNOBS and "dry_multiplier" not in SAMPLING_KNOBS
    assert "temperature" in SAMPLING_KNOBS and "mirostat_tau" in SAMPLING_KNOBS


def test_logit_bias_and_dry_breakers_are_json_boxes():
    assert component_value(KNOBS["logit_bias"], '{"sea": -5, "13": 2}') == {"sea": -5, "13": 2}
    assert component_value(KNOBS["logit_bias"], "") == {}
    breakers = component_value(KNOBS["dry_sequence_breakers"], '["\\n", ":", ","]')
    assert breakers == ["\n", ":", ","]  # a comma is a breaker, not a separator
    assert display_value(KNOBS["dry_sequence_breakers"], ("\n", ":")) == '["\\n", ":"]'
    assert display_value(KNOBS["logit_bias"], {}) == "{}"


@pytest.mark.parametrize("knob, text, words", [
    ("logit_bias", "{sea: 1}", ["logit_bias: not valid JSON"]),
    ("logit_bias", "[1, 2]", ["logit_bias: expected an object", "got a JSON list"]),
    ("logit_bias", '{"a": NaN}', ["logit_bias: not valid JSON", "NaN is not allowed"]),
    ("dry_sequence_breakers", '"\\n"', ["dry_sequence_breakers: expected a list", "got a JSON str"]),
])
def test_bad_json_names_the_knob(knob, text, words):
    with pytest.raises(UserError) as err:
        component_value(KNOBS[knob], text)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_every_invalid_knob_is_reported_at_once():
    names = ["temperature", "top_p", "top_k", "logit_bias"]
    values, errors = checked_values(names, [999.0, -1.0, 5.0, "{"])
    assert values == {"top_k": 5}
    assert [e.split(":")[0] for e in errors] == ["temperature", "top_p", "logit_bias"]
    assert "999" in errors[0] and "-1" in errors[1]  # the typed values, not clamped ones


def test_stage_list_holds_every_stage_and_round_trips():
    html = stage_list_html(STAGE_NAMES, "step-stage-order")
    assert html.count("<li ") == len(STAGE_NAMES) and 'data-target="step-stage-order"' in html
    assert parse_stage_order("top_p, temperature") == ["top_p", "temperature"]
    assert parse_stage_order("") == list(STAGE_NAMES)
