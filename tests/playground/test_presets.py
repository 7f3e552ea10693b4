"""Presets: the built-in library, the strict format, import/export files.

The property tests throw junk at the parser: it must answer with a PresetError or a complete,
valid preset; never another exception, never a preset that silently dropped a key.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import runner
from engine.runner import RunRequest
from engine.__main__ import build_parser, config_from_args
from engine.config import CONFIG_KEYS, KNOBS, DecodingConfig
from engine.presets import (
    BUILTIN_DIR, MAX_FILE_PRESETS, MAX_NAME_LEN, MAX_PRESET_BYTES, Preset, PresetError, builtin_presets, file_stem,
    load_preset, parse_preset, parse_preset_file, parse_preset_json, presets_to_json, sanitize_name, unique_name,
)
from engine.trace import STOP_REASONS

REQUIRED = {  # stem -> the knobs the issue asks for, as they appear in the file
    "greedy": {"strategy": "greedy"},
    "beam-4": {"strategy": "beam", "num_beams": 4},
    "focused": {"strategy": "sample", "temperature": 0.3, "top_p": 0.9},
    "balanced": {"strategy": "sample", "temperature": 0.8, "top_p": 0.9},
    "creative": {"strategy": "sample", "temperature": 1.2, "top_k": 50},
    "wild": {"strategy": "sample", "temperature": 1.5, "top_k": 100},
    "min-p": {"strategy": "sample", "min_p": 0.05},  # temperature 1.0 is neutral, so not written
    "code": {"strategy": "sample", "temperature": 0.2, "top_p": 0.1},
    "chat": {"strategy": "sample", "temperature": 0.5, "top_p": 0.5},
    "anti-repetition": {"frequency_penalty": 0.5, "presence_penalty": 0.5, "no_repeat_ngram_size": 3},
    "contrastive-search": {"strategy": "contrastive_search", "top_k": 4},  # penalty_alpha 0.6 is neutral
    "speculative-self-int8": {"strategy": "speculative"},  # drafter self-int8, K 4: neutral values
    "speculative-ngram": {"strategy": "speculative", "drafter": "ngram"},
}


def valid(**knobs) -> dict:
    return {"version": 1, "name": "Test", "description": "A test preset.", "strategy": "sample", **knobs}


# --- the built-in library -----------------------------------------------------------------------
def test_library_has_the_required_presets_with_their_knobs():
    library = builtin_presets()
    for stem, expected in REQUIRED.items():
        data = library[stem].to_dict()
        assert {k: data.get(k) for k in expected} == expected, stem
    assert library["contrastive-search"].config.penalty_alpha == 0.6
    spec = library["speculative-self-int8"].config
    assert (spec.drafter, spec.num_draft_tokens) == ("self-int8", 4)
    assert library["min-p"].config.temperature == 1.0


@pytest.mark.parametrize("path", sorted(BUILTIN_DIR.glob("*.json")), ids=lambda p: p.stem)
def test_builtin_file_is_canonical_and_round_trips(path: Path):
    """file JSON -> Preset -> config -> JSON: byte-for-byte the file (so files are sparse and canonical)."""
    text = path.read_text(encoding="utf-8")
    preset = parse_preset_json(text)
    assert preset.to_json() == text
    rebuilt = DecodingConfig.from_dict(preset.config.to_dict(sparse=True))
    assert rebuilt == preset.config
    assert Preset(preset.name, preset.description, rebuilt).to_json() == text
    data = json.loads(text)
    for key, value in data.items():  # sparse: nothing written at its neutral value
        if key in KNOBS:
            assert value != KNOBS[key].neutral, (path.stem, key)
    assert file_stem(preset.name) == file_stem(preset.name).lower()


def test_builtin_descriptions_are_one_sentence():
    for stem, preset in builtin_presets().items():
        text = preset.description
        assert 20 <= len(text) <= 160 and text[0].isupper() and text.endswith("."), stem
        assert ". " not in text[:-1], f"{stem}: more than one sentence"


def test_cli_reads_the_same_object(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(Preset.create("Mine", "Mine.", DecodingConfig(temperature=0.7, top_k=20)).to_json())
    args = build_parser().parse_args(["--preset", str(path), "--prompt", "x", "--set", "top_p=0.5"])
    assert config_from_args(args) == DecodingConfig(temperature=0.7, top_k=20, top_p=0.5)
    assert load_preset("greedy") is not None and load_preset("greedy").config.strategy == "greedy"
    with pytest.raises(PresetError, match="not a built-in preset"):
        load_preset("no-such-preset")
    with pytest.raises(PresetError, match="not a built-in preset"):  # paths only from the CLI
        load_preset(str(path))


def _run_preset(lm, stem: str, max_new_tokens: int):
    config = builtin_presets()[stem].config.replace(max_new_tokens=max_new_tokens)
    return config, runner.run(RunRequest(lm, "The cat sat on the", config))


@pytest.mark.parametrize("stem", [s for s in REQUIRED if s != "speculative-self-int8"])
def test_builtin_preset_runs(tiny_lm, stem):
    config, trace = _run_preset(tiny_lm, stem, 3)
    assert trace.strategy == config.strategy
    assert 1 <= len(trace.generated_token_ids) <= 3
    assert trace.stop_reason in STOP_REASONS
    assert all(0 <= t < tiny_lm.vocab_size for t in trace.generated_token_ids)


@pytest.mark.slow
def test_speculative_self_int8_preset_runs(embedded):
    """The int8 self-drafter needs a model the registry can quantize, so this one runs on the embedded model."""
    config, trace = _run_preset(embedded, "speculative-self-int8", 4)
    assert trace.strategy == "speculative"
    assert 1 <= len(trace.generated_token_ids) <= 4 and trace.stop_reason in STOP_REASONS


# --- strict parsing -------------------------------------------------------------------------------
@pytest.mark.parametrize("data, fragment", [
    (valid(temprature=0.5), "temprature: unknown key (did you mean 'temperature'?)"),
    (valid(temperature="hot"), "temperature: expected a number in 0 or [0.01, 5]"),
    (valid(temperature=True), "temperature: expected a number"),
    (valid(temperature=7.0), "temperature: 7.0 is out of range; allowed 0 or [0.01, 5]"),
    (valid(top_p=0.0), "top_p: 0.0 is out of range; allowed (0, 1]"),
    (valid(top_k=2.5), "top_k: expected an integer"),
    (valid(top_k=10**5000), "top_k:"),  # a 5000-digit integer: its repr itself fails in Python
    (valid(temperature=10**400), "temperature:"),  # too big for a float
    (valid(stop="END"), "stop: expected a list of strings, got a single string 'END'; write ['END']"),
    (valid(stop=[[["deep"]]]), "stop:"),
    (valid(stage_order=["top_k", "top_k"]), "stage_order: stage 'top_k' appears twice"),
    (valid(stage_order=["warp"]), "stage_order: unknown stage 'warp'"),
    (valid(strategy="telepathy"), "strategy: expected one of greedy | sample"),
    (valid(strategy=["sample"]), "strategy:"),
    (valid(strategy="beam", num_beams=4, num_beam_groups=3), "num_beam_groups: 3 does not divide num_beams=4"),
    (valid(drafter="pickle:evil"), "drafter: expected one of self-int8"),
    ({**valid(), "version": 2}, "version: expected 1, got 2"),
    ({**valid(), "version": True}, "version: expected 1"),
    ({**valid(), "name": ""}, "name: expected a non-empty string"),
    ({**valid(), "name": "x" * (MAX_NAME_LEN + 1)}, "name: expected a non-empty string of at most 64"),
    ({**valid(), "name": 7}, "name:"),
    ({**valid(), "description": "d" * 501}, "description: expected a string of at most 500"),
    ([valid()], "preset: expected a JSON object, got list"),
    ({1: 2}, "keys must be strings"),
])
def test_invalid_preset_names_the_key(data, fragment):
    with pytest.raises(PresetError) as info:
        parse_preset(data)
    assert fragment in str(info.value)
    assert len(str(info.value)) < 600


@pytest.mark.parametrize("text, fragment", [
    ('{"name": "x", "temperature": NaN}', "NaN is not allowed"),
    ('{"name": "x", "top_p": Infinity}', "Infinity is not allowed"),
    ('{"name": "x", "top_k": 5, "top_k": 6}', "duplicate key 'top_k'"),
    ('{"name": "x", ', "not valid JSON"),
    ("[" * 5000 + "]" * 5000, "preset:"),
    ('{"name": "x", "top_k": ' + "9" * 5000 + "}", "not valid JSON"),
    (b"\xff\xfe\x00garbage", "not valid JSON"),
    ('{"name": "' + "x" * MAX_PRESET_BYTES + '"}', "over the 16,384-byte limit"),
])
def test_invalid_preset_text(text, fragment):
    with pytest.raises(PresetError) as info:
        parse_preset_json(text)
    assert fragment in str(info.value)


def test_names_are_sanitised_for_display_and_files():
    preset = parse_preset({**valid(), "name": "  ../../etc/passwd\x00 \n"})
    assert preset.name == "etc passwd"
    assert "/" not in file_stem("../../etc/passwd") and file_stem("../../etc/passwd") == "etc-passwd"
    assert file_stem("Beam search (4)") == "beam-search-4"
    assert file_stem("///") == "preset" and file_stem("Ours .. x") == "ours-.-x"
    assert sanitize_name('a\\b:c*d?"e<f>g|h') == "a b c d e f g h"
    assert len(sanitize_name("y" * 500)) == MAX_NAME_LEN


def test_unique_name():
    assert unique_name("Mine", []) == "Mine"
    assert unique_name("Mine", ["Mine", "Mine (2)"]) == "Mine (3)"
    long = "z" * MAX_NAME_LEN
    assert unique_name(long, [long]) == "z" * (MAX_NAME_LEN - 4) + " (2)"


def test_create_validates_and_is_sparse():
    preset = Preset.create("  Mine ", "Low temperature.", DecodingConfig(temperature=0.3))
    assert preset.to_dict() == {"version": 1, "name": "Mine", "description": "Low temperature.",
                                "strategy": "sample", "temperature": 0.3}
    with pytest.raises(PresetError, match="name"):
        Preset.create("", "x", DecodingConfig())
    assert preset.renamed("Other").name == "Other" and preset.renamed("Other").config == preset.config


# --- import / export files ------------------------------------------------------------------------
def test_import_keeps_good_presets_and_reports_each_bad_one():
    items = [valid(temperature=0.5), {**valid(temperature=9.0), "name": "Too hot"}, "junk", valid(top_k=3)]
    result = parse_preset_file(json.dumps(items))
    assert [p.config.temperature for p in result.presets] == [0.5, 1.0]
    assert [p.config.top_k for p in result.presets] == [0, 3]
    assert result.errors == (
        "preset 2 ('Too hot'): temperature: 9.0 is out of range; allowed 0 or [0.01, 5]",
        "preset 3: preset: expected a JSON object, got str",
    )


def test_import_single_object_and_junk_files():
    assert [p.name for p in parse_preset_file(json.dumps(valid())).presets] == ["Test"]
    assert parse_preset_file("not json").errors[0].startswith("file: not valid JSON")
    assert parse_preset_file("42").errors == ("file: expected a preset object or a list of them, got int",)
    many = parse_preset_file(json.dumps([valid()] * (MAX_FILE_PRESETS + 5)))
    assert len(many.presets) == MAX_FILE_PRESETS and "over the 200-preset limit" in many.errors[0]


def test_export_round_trips_one_and_many():
    library = list(builtin_presets().values())
    assert parse_preset_file(presets_to_json(library)).presets == tuple(library)
    one = presets_to_json(library[:1])
    assert json.loads(one)["name"] == library[0].name  # a single preset is a plain object
    assert parse_preset_file(one).presets == (library[0],)


# --- property tests -------------------------------------------------------------------------------
json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=300)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=5)
                           | st.dictionaries(st.text(max_size=20), inner, max_size=5), max_leaves=30)
config_keys = st.sampled_from([*CONFIG_KEYS, "version", "name", "description", "seeds", "__class__", ""])


def _check_complete(data: dict, preset: Preset) -> None:
    """A parsed preset carries every key it was given (no silent drops), and re-parses to itself."""
    for key, value in data.items():
        if key in KNOBS:
            got = getattr(preset.config, key)
            got = list(got) if isinstance(got, tuple) else got
            assert got == value or (isinstance(value, float) and math.isclose(got, value)), key
    assert parse_preset(preset.to_dict()) == preset


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(config_keys, json_values, max_size=6), st.sampled_from(list(REQUIRED)))
def test_mutated_presets_parse_or_fail_cleanly(changes, stem):
    data = builtin_presets()[stem].to_dict() | changes
    try:
        preset = parse_preset(data)
    except PresetError as exc:
        assert str(exc)
        return
    _check_complete(data, preset)


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_random_json_values_parse_or_fail_cleanly(value):
    try:
        preset = parse_preset(value)
    except PresetError:
        return
    assert isinstance(value, dict)
    _check_complete(value, preset)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=400) | st.binary(max_size=400))
def test_random_text_parses_or_fails_cleanly(text):
    try:
        parse_preset_json(text)
    except PresetError:
        pass
    result = parse_preset_file(text)
    assert result.presets or result.errors


@settings(max_examples=50, deadline=None)
@given(st.integers(min_value=1, max_value=3000), st.sampled_from(["[", "{\"a\":"]))
def test_deep_nesting_fails_cleanly(depth, opener):
    with pytest.raises(PresetError):
        parse_preset_json(opener * depth)
    with pytest.raises(PresetError):
        parse_preset(valid(stop=json.loads("[" * min(depth + 1, 500) + "]" * min(depth + 1, 500))))


# --- user presets in the browser (playground.user_presets: pure list operations) ---------------------
def test_user_preset_list_operations():
    from playground import user_presets as ui

    mine = Preset.create("Mine", "Mine.", DecodingConfig(temperature=0.4))
    stored = ui.save_user_preset([], mine)
    assert stored == [mine.to_dict()]
    with pytest.raises(PresetError, match="already have a preset called 'Mine'"):
        ui.save_user_preset(stored, mine)
    stored = ui.save_user_preset(stored, Preset.create("Mine", "v2", DecodingConfig(temperature=0.5)), overwrite=True)
    assert [p["temperature"] for p in stored] == [0.5]
    stored = ui.rename_user_preset(stored, "Mine", "  Ours/../x ")
    assert [p["name"] for p in stored] == ["Ours .. x"]  # no separators left; dots alone are harmless
    with pytest.raises(PresetError, match="no saved preset called 'Mine'"):
        ui.delete_user_preset(stored, "Mine")
    assert ui.delete_user_preset(stored, "Ours .. x") == []


def test_stored_list_is_untrusted():
    from playground import user_presets as ui

    good = Preset.create("Good", "", DecodingConfig(top_k=5)).to_dict()
    presets, errors = ui.read_user_presets([good, {"name": "Bad", "top_k": -1}, "junk", dict(good)])
    assert [p.name for p in presets] == ["Good"]
    assert errors == ["stored preset 2: top_k: -1 is out of range; allowed [0, 100000]",
                      "stored preset 3: preset: expected a JSON object, got str",
                      "stored preset 4: a second 'Good'; dropped"]
    assert ui.read_user_presets({"not": "a list"}) == ([], ["stored presets: not a list; ignored"])
    assert ui.read_user_presets(None) == ([], [])


def test_picker_merges_builtins_and_user_presets():
    from playground import user_presets as ui

    stored = [Preset.create("Cold", "", DecodingConfig(temperature=0.1)).to_dict()]
    choices = ui.preset_choices(stored)
    assert choices[0] == ui.CUSTOM and choices[-1] == "★ Cold" and "balanced" in choices
    assert ui.find_preset("★ Cold", stored).config.temperature == 0.1
    assert ui.find_preset("★ Nope", stored) is None
    balanced = builtin_presets()["balanced"].config
    assert ui.matching_choice(balanced.replace(seed=9), stored) == ("balanced", False)
    assert ui.matching_choice(balanced.replace(top_p=0.5), stored, "Balanced") == ("balanced", True)
    assert ui.matching_choice(DecodingConfig(temperature=0.1), stored) == ("★ Cold", False)
    assert ui.matching_choice(DecodingConfig(temperature=0.11), stored, "Who") == (ui.CUSTOM, False)


def test_import_into_user_presets_renames_clashes():
    from playground import user_presets as ui

    stored = [Preset.create("Test", "", DecodingConfig()).to_dict()]
    new, imported, errors = ui.import_user_presets(stored, json.dumps([valid(), valid(top_k=0.5)]))
    assert imported == ["Test (2)"] and [p["name"] for p in new] == ["Test", "Test (2)"]
    assert errors == ["preset 2 ('Test'): top_k: expected an integer in [0, 100000], got 0.5"]


def test_export_file_and_upload_limits(tmp_path):
    from playground import user_presets as ui

    path = Path(ui.export_file([builtin_presets()["beam-4"]]))
    assert path.name == "beam-search-4.json"
    assert parse_preset_file(path.read_bytes()).presets == (builtin_presets()["beam-4"],)
    library = Path(ui.export_file(list(builtin_presets().values()), "all"))
    assert library.name == "all.json" and len(parse_preset_file(library.read_bytes()).presets) == len(builtin_presets())
    with pytest.raises(PresetError, match="nothing to export"):
        ui.export_file([])
    big = tmp_path / "big.json"
    big.write_bytes(b" " * 1_048_577)
    with pytest.raises(PresetError, match="over the 1,048,576-byte limit"):
        ui.read_upload(str(big))
    with pytest.raises(PresetError, match="choose a .json file"):
        ui.read_upload(None)


def test_presets_view_helpers():
    from playground.views import presets as view

    assert view.settings_text(builtin_presets()["balanced"]) == "temperature 0.8 · top_p 0.9"
    assert view.settings_text(builtin_presets()["greedy"]) == "—"
    llama, webui = "llama.cpp (command-line flags)", "text-generation-webui (YAML preset)"
    text, notes, path = view.interop_view(builtin_presets()["anti-repetition"].to_json(), llama)
    assert text.startswith('--samplers "penalties;temperature;top_p"') and path is None
    assert "**no_repeat_ngram_size** does not map" in notes
    text, notes, path = view.interop_view(builtin_presets()["balanced"].to_json(), webui)
    assert Path(path).name == "balanced.yaml" and Path(path).read_text() == text
    assert notes == "Every setting maps exactly."
    assert view.interop_view('{"name": "x", "top_k": -3}', "llama.cpp (command-line flags)")[1].startswith(
        "Fix the preset JSON first: top_k: -3 is out of range")
    assert view.validate_api('{"name": " x ", "temperature": 1.0, "top_k": 3}') == {
        "version": 1, "name": "x", "description": "", "strategy": "sample", "top_k": 3}
    assert view.interop_api(builtin_presets()["greedy"].to_json(), "llama.cpp")["text"].startswith('--samplers "top_k"')
