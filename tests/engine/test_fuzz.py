"""A bounded, seeded fuzz suite over the engine's entry points that take untrusted input: presets,
configs (from_dict and direct construction), ``--set`` values, share links. Every case must end in a
clean error naming its argument, or a valid result whose JSON is strict. A crash (any other
exception), a generic message or a NaN fails. A few hundred cases per entry point, seeded, so a
failure reproduces; the whole file runs in a few seconds.
"""

from __future__ import annotations

import json
import random
import re

import pytest

from engine.__main__ import build_parser, config_from_args
from engine.config import CONFIG_KEYS, KNOBS, STAGE_NAMES, STRATEGIES, ConfigError, DecodingConfig, parse_set_value
from engine.presets import PresetError, builtin_presets, load_preset, parse_preset, parse_preset_json
from engine.sharelink import ShareLinkError, ShareState, decode, encode

CASES = 300
HOSTILE_STRINGS = [
    "", " ", "\ud800", "a\udfffb", "<script>alert(1)</script>", "<a href=//evil.example>x</a>",
    "<img src=x onerror=alert(1)>", "/etc/passwd", "~/.ssh", "../../x.json", "x" * 100_000, "NaN", "Infinity",
    "9" * 5000, "model:/etc", "model:", "self-int8", "greedy", "\x00", "🙂" * 50, "None", "[1]", "{}",
]
HOSTILE_VALUES = [
    None, True, False, 0, -1, 1, 2, 5, 0.5, 1e-38, -1e-38, 5e-324, 1e308, float("nan"), float("inf"), float("-inf"),
    2**63, 2**64, -(2**80), 10**400, [], ["x"], ["\ud800"], [1], [[["deep"]]], {}, {"a": 1}, {"1": 2.0}, ("t",),
    *HOSTILE_STRINGS,
]
# A message names its argument: "key: ...", the key being a short identifier (or a quoted unknown key).
NAMED = re.compile(r"^(?:preset \d+(?: \([^)]*\))?: )?(?:[\w\-\[\]., ]{1,60}|'[^\n]{0,80}?(?:'|\.\.\.)|\"[^\n]{0,80}?\"): \S")


def strict_dumps(data) -> str:
    return json.dumps(data, allow_nan=False, ensure_ascii=False)


def assert_clean(exc: BaseException) -> None:
    message = str(exc)
    assert NAMED.match(message), f"message does not name its argument: {message[:200]!r}"
    assert "\n" not in message and len(message) < 1500, message[:200]
    message.encode("utf-8")  # no lone surrogate echoed back
    assert "Traceback" not in message and "None" != message


def random_value(rng: random.Random, key: str):
    """Mostly plausible values for ``key`` (so valid configs are reached too), some hostile."""
    knob = KNOBS.get(key)
    roll = rng.random()
    if roll < 0.4 or knob is None:
        return rng.choice(HOSTILE_VALUES)
    if knob.kind in ("float", "int"):
        low, high = knob.low, knob.high
        value = rng.uniform(low - 1, high + 1) if roll < 0.7 else rng.choice([low, high, knob.neutral])
        return int(value) if knob.kind == "int" else value
    if knob.kind == "str_list":
        return [rng.choice(HOSTILE_STRINGS[:12] + ["cat", "\n", "end"]) for _ in range(rng.randrange(4))]
    if knob.kind == "choice":
        return rng.choice([*knob.choices, "maybe"])
    if knob.kind == "bool":
        return rng.choice([True, False, "true"])
    return knob.neutral


def random_config(rng: random.Random) -> dict:
    keys = rng.sample(CONFIG_KEYS, rng.randrange(1, 5))
    if rng.random() < 0.1:
        keys.append(rng.choice(["temprature", "<b>x</b>", "\ud800", "x" * 500]))
    data = {k: random_value(rng, k) for k in keys}
    if "strategy" in data and rng.random() < 0.7:
        data["strategy"] = rng.choice(list(STRATEGIES))
    if "stage_order" in data and rng.random() < 0.5:
        data["stage_order"] = rng.sample(STAGE_NAMES, rng.randrange(len(STAGE_NAMES)))
    return data


def check_config_result(config: DecodingConfig) -> None:
    text = strict_dumps(config.to_dict())
    assert DecodingConfig.from_dict(json.loads(text)) == config


@pytest.mark.parametrize("seed", range(3))
def test_config_from_dict(seed):
    rng = random.Random(seed)
    valid = 0
    for _ in range(CASES):
        data = random_config(rng)
        try:
            config = DecodingConfig.from_dict(data)
        except ConfigError as exc:
            assert_clean(exc)
            continue
        check_config_result(config)
        valid += 1
    assert valid > 0.03 * CASES  # the generator reaches valid configs too


@pytest.mark.parametrize("seed", range(2))
def test_config_direct_construction(seed):
    rng = random.Random(100 + seed)
    for _ in range(CASES):
        data = {k: v for k, v in random_config(rng).items() if k in CONFIG_KEYS}
        try:
            config = DecodingConfig(**data)
        except ConfigError as exc:
            assert_clean(exc)
            continue
        check_config_result(config)


@pytest.mark.parametrize("seed", range(2))
def test_presets(seed):
    rng = random.Random(200 + seed)
    meta = {"name": ["Mine", "", "\ud800", "<b>x</b>", 5, None, "x" * 100], "description": ["ok.", 5, "\udc80"],
            "version": [1, 2, "1", True]}
    for _ in range(CASES):
        data = random_config(rng)
        for key, options in meta.items():
            if rng.random() < 0.5:
                data[key] = rng.choice(options)
        data.setdefault("name", "Fuzzed")
        as_text = rng.random() < 0.5
        try:
            preset = parse_preset_json(json.dumps(data, ensure_ascii=rng.random() < 0.5)) if as_text \
                else parse_preset(data)
        except (PresetError, ValueError) as exc:  # json.dumps refuses nothing here: only PresetError expected
            assert isinstance(exc, PresetError), repr(exc)
            assert_clean(exc)
            continue
        assert parse_preset_json(preset.to_json()) == preset
        strict_dumps(preset.to_dict())


def test_load_preset_from_the_page():
    rng = random.Random(300)
    names = list(builtin_presets())
    for _ in range(CASES):
        source = rng.choice(HOSTILE_VALUES + names + ['{"name": "x", "top_k": 3}', '{"name": 1}', "{", "{}"])
        try:
            preset = load_preset(source)
        except PresetError as exc:
            assert_clean(exc)
            assert "root:" not in str(exc)  # never a file's content
            continue
        strict_dumps(preset.to_dict())


def test_set_values_through_the_cli_parser():
    rng = random.Random(400)
    for _ in range(CASES):
        items = []
        for _ in range(rng.randrange(1, 4)):
            key = rng.choice([*CONFIG_KEYS, "nope", "", "\ud800"])
            text = rng.choice([*[s for s in HOSTILE_STRINGS if len(s) < 10_000], "0.5", "3", "true", "a,b", "[\"x\"]",
                               "-1", "1e-38", "1e999", "[1, 2]", "top_p,temperature"])
            items += ["--set", f"{key}={text}" if rng.random() < 0.95 else key]
        preset = rng.choice(["greedy", "balanced", "/etc/passwd", "\ud800"])
        try:
            args = build_parser().parse_args(["--prompt", "x", "--preset", preset, *items])
            config = config_from_args(args)
        except (ConfigError, PresetError) as exc:
            assert_clean(exc)
            continue
        check_config_result(config)


def test_parse_set_value_never_crashes():
    rng = random.Random(500)
    for _ in range(CASES):
        key = rng.choice(CONFIG_KEYS)
        text = "".join(rng.choice("0123456789.-e[]\",{}truefalsNIiny \ud800") for _ in range(rng.randrange(30)))
        try:
            parse_set_value(key, text)
        except ConfigError as exc:
            assert_clean(exc)


def _mutate(rng: random.Random, token: str) -> str:
    chars = list(token)
    for _ in range(rng.randrange(1, 4)):
        op, i = rng.random(), rng.randrange(len(chars))
        if op < 0.5:
            chars[i] = rng.choice("AZaz09-_.$%\ud800")
        elif op < 0.75:
            del chars[i]
        else:
            chars.insert(i, rng.choice("Aa0-_."))
    return "".join(chars)


def test_share_links():
    rng = random.Random(600)
    presets = list(builtin_presets().values())
    tokens = [encode(ShareState(rng.choice(["step", "compare", "beam"]), rng.choice(["Hi", "Ünï ✓", "<b>x</b>"]),
                                rng.choice(presets), seed=rng.randrange(1000))) for _ in range(20)]
    accepted = 0
    for _ in range(CASES):
        token = _mutate(rng, rng.choice(tokens)) if rng.random() < 0.8 else rng.choice(HOSTILE_VALUES)
        try:
            state = decode(token)
        except ShareLinkError as exc:
            assert_clean(exc)
            continue
        accepted += 1
        assert decode(encode(state)) == state
        strict_dumps(state.preset.to_dict())
    assert accepted < 0.01 * CASES  # the checksum refuses corrupted links


def test_share_state_fields():
    rng = random.Random(700)
    preset = builtin_presets()["greedy"]
    for _ in range(CASES):
        kwargs = {"view": rng.choice(["step", "BAD", 5, "\ud800", "x" * 40]), "prompt": rng.choice(HOSTILE_VALUES),
                  "preset": preset if rng.random() < 0.9 else {"name": "x"},
                  "seed": rng.choice([None, 0, -1, 2**40, "1", 1.5, 3]), "chat": rng.choice([None, True, "yes"])}
        try:
            state = ShareState(**kwargs)
            token = encode(state)
        except ShareLinkError as exc:
            assert_clean(exc)
            continue
        assert decode(token) == state
