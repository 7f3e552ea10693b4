"""DecodingConfig validation: bad values name the key and the allowed range; sparse round trips."""

import pytest

from engine.config import DEFAULT_STAGE_ORDER, KNOBS, ConfigError, DecodingConfig, parse_set_value

BAD = [
    ({"temperature": -0.1}, "temperature", "0 or [0.01, 5]"),
    ({"temperature": 1e-38}, "temperature", "0 or [0.01, 5]"),
    ({"repetition_penalty": 1e-38}, "repetition_penalty", "[0.01, 10]"),
    ({"temperature": "hot"}, "temperature", "got 'hot'"),
    ({"temperature": float("nan")}, "temperature", "finite"),
    ({"top_k": 2.5}, "top_k", "integer"),
    ({"top_k": -1}, "top_k", "[0, 100000]"),
    ({"top_p": 0.0}, "top_p", "(0, 1]"),
    ({"top_p": 1.01}, "top_p", "(0, 1]"),
    ({"min_p": 2}, "min_p", "[0, 1]"),
    ({"typical_p": 0}, "typical_p", "(0, 1]"),
    ({"repetition_penalty": 0}, "repetition_penalty", "[0.01, 10]"),
    ({"frequency_penalty": 2.5}, "frequency_penalty", "[-2, 2]"),
    ({"no_repeat_ngram_size": 11}, "no_repeat_ngram_size", "[0, 10]"),
    ({"max_new_tokens": 0}, "max_new_tokens", "[1, 1024]"),
    ({"seed": -1}, "seed", "[0,"),
    ({"seed": True}, "seed", "number"),
    ({"stop": "x"}, "stop", "list"),
    ({"stop": [""]}, "stop", "item"),
    ({"strategy": "magic"}, "strategy", "greedy | sample"),
    ({"stage_order": ["top_k", "top_k"]}, "stage_order", "twice"),
    ({"stage_order": ["nucleus"]}, "stage_order", "unknown stage"),
    ({"early_stopping": "sometimes"}, "early_stopping", "never"),
    ({"drafter": "gpt"}, "drafter", "model:<id or dir>"),
    ({"wat": 1}, "wat", "unknown key"),
    ({"strategy": "beam", "num_beams": 2, "num_return_sequences": 3}, "num_return_sequences", "exceeds"),
]


@pytest.mark.parametrize("values,key,fragment", BAD, ids=[k for _, k, _ in BAD])
def test_bad_config_names_key_and_range(values, key, fragment):
    with pytest.raises(ConfigError) as info:
        DecodingConfig.from_dict(values)
    assert info.value.key == key
    assert str(info.value).startswith(f"{key}:") and fragment in str(info.value)


def test_sparse_round_trip_and_neutral_values():
    cfg = DecodingConfig.from_dict({"strategy": "sample", "temperature": 0.7, "top_p": 0.9, "stop": ["\n\n"]})
    sparse = cfg.to_dict(sparse=True)
    assert sparse == {"strategy": "sample", "temperature": 0.7, "top_p": 0.9, "stop": ["\n\n"]}
    assert DecodingConfig.from_dict(sparse) == cfg
    assert DecodingConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.active_stages() == ("temperature", "top_p")
    assert DecodingConfig().active_stages() == ()


def test_every_knob_neutral_value_is_valid_and_inactive():
    cfg = DecodingConfig.from_dict({k: knob.neutral for k, knob in KNOBS.items()})
    assert cfg.active_stages() == ()
    assert cfg.stage_order == DEFAULT_STAGE_ORDER


def test_partial_stage_order_appends_the_rest_in_default_order():
    cfg = DecodingConfig(stage_order=("top_p", "temperature"))
    assert cfg.stage_order[:2] == ("top_p", "temperature")
    assert sorted(cfg.stage_order) == sorted(DEFAULT_STAGE_ORDER)


def test_temperature_zero_is_greedy():
    assert DecodingConfig(temperature=0.0).is_greedy
    assert not DecodingConfig(temperature=0.5).is_greedy


def test_parse_set_value_types():
    assert parse_set_value("temperature", "0.7") == 0.7
    assert parse_set_value("top_k", "40") == 40
    assert parse_set_value("stop", "a,b") == ["a", "b"]
    assert parse_set_value("stop", '["\\n"]') == ["\n"]
    assert parse_set_value("adaptive_k", "true") is True
    assert parse_set_value("drafter", "ngram") == "ngram"
    assert parse_set_value("stage_order", "top_p, temperature") == ["top_p", "temperature"]


DEEP = [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]  # 34 deep


def _endpoint(prompt: str, config: dict | None = None, chat: bool = False, seed: int | None = None,
              items: list[str] | None = None, control=None) -> None:
    """A stand-in API function: check_arguments reads its annotations."""


@pytest.mark.parametrize("args, key, fragment", [
    (("Hi", None, float("nan")), "chat", "expected true or false, got nan"),
    (("Hi", None, "no"), "chat", "expected true or false, got 'no'"),
    (("Hi", None, 0), "chat", "expected true or false"),
    ((["Hi"],), "prompt", "expected text"),
    (("Hi", [1]), "config", "expected a JSON object or null"),
    (("Hi", None, False, 1.5), "seed", "expected an integer or null"),
    (("Hi", None, False, None, True), "items", "expected a list or null"),
    (("Hi", {"a": DEEP}), "config", "nested more than 32"),
    (("x" * 10_000, None, "x" * 10_000), "chat", "..."),
])
def test_check_arguments_names_the_argument(args, key, fragment):
    from engine.config import check_arguments

    with pytest.raises(ConfigError) as err:
        check_arguments(_endpoint, args, {})
    message = str(err.value)
    assert message.startswith(f"{key}: ") and fragment in message and len(message) < 200


def test_check_arguments_accepts_what_the_annotations_allow():
    from engine.config import check_arguments

    check_arguments(_endpoint, ("Hi", {"a": 1}, True, 3.0, ["x"]), {})
    check_arguments(_endpoint, ("Hi",), {"chat": False, "seed": None})
