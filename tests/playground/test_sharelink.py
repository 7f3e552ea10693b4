"""Share links: round trips, size caps, and junk that must come back as a ShareLinkError only."""

from __future__ import annotations

import base64
import json
import re
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import DecodingConfig
from engine.presets import Preset, builtin_presets
from engine.sharelink import (
    MAX_JSON_BYTES, MAX_PROMPT_CHARS, MAX_TOKEN_CHARS, SHARE_PARAM, TOKEN_PREFIX, ShareLinkError, ShareState, checksum,
    decode, encode, share_query,
)


def pack(payload: bytes | str) -> str:
    """A token around arbitrary content (to reach the checks after decompression)."""
    raw = payload.encode() if isinstance(payload, str) else payload
    packer = zlib.compressobj(9, zlib.DEFLATED, -15)
    body = base64.urlsafe_b64encode(packer.compress(raw) + packer.flush()).rstrip(b"=").decode()
    return f"{TOKEN_PREFIX}{body}.{checksum(body)}"


def good_payload(**changes) -> dict:
    preset = builtin_presets()["balanced"].to_dict()
    return {"view": "step", "prompt": "Hello", "seed": 7, "preset": preset} | changes


@pytest.mark.parametrize("stem", list(builtin_presets()))
def test_round_trip_every_builtin(stem):
    prompt = "Ünïcode ✓ & ?share=x#frag\nnew line"
    state = ShareState(view="compare", prompt=prompt, preset=builtin_presets()[stem], seed=1234)
    token = encode(state)
    assert re.fullmatch(r"s2\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]{6}", token)  # URL-safe as is: no escaping needed
    assert decode(token) == state
    assert decode(token).preset.config.seed == 1234


def test_seed_is_one_source_of_truth():
    preset = Preset.create("Seeded", "x", DecodingConfig(seed=99, temperature=0.7))
    assert ShareState("step", "p", preset).seed == 99  # no seed given: the preset's
    state = ShareState("step", "p", preset, seed=5)
    assert state.preset.config.seed == 5 and state.preset.config.temperature == 0.7
    assert json.loads(zlib.decompress(base64.urlsafe_b64decode(encode(state)[3:] + "=="), -15))["seed"] == 5


def test_share_query_and_size():
    state = ShareState("step", "The cat sat on the mat.", builtin_presets()["creative"], seed=42)
    query = share_query(state)
    assert query.startswith(f"?{SHARE_PARAM}={TOKEN_PREFIX}")
    assert len(query) < 400  # a typical link stays short


def test_long_prompt_is_refused_when_encoding():
    noisy = "".join(chr(0x4E00 + (i * 7919) % 20000) for i in range(MAX_PROMPT_CHARS))  # incompressible-ish
    with pytest.raises(ShareLinkError, match="over the 6,000-character limit; shorten the prompt"):
        encode(ShareState("step", noisy, builtin_presets()["greedy"]))
    with pytest.raises(ShareLinkError, match="prompt: 8,001 characters is over the 8,000-character limit"):
        ShareState("step", "x" * (MAX_PROMPT_CHARS + 1), builtin_presets()["greedy"])


@pytest.mark.parametrize("kwargs, fragment", [
    ({"view": "Step/../x"}, "view: expected a short lower-case name"),
    ({"view": ""}, "view:"),
    ({"prompt": None}, "prompt:"),
    ({"seed": -1}, "seed: -1 is out of range"),
    ({"seed": "7"}, "seed: expected a number"),
    ({"preset": {"name": "x"}}, "preset: expected a Preset"),
])
def test_invalid_state(kwargs, fragment):
    args = {"view": "step", "prompt": "p", "preset": builtin_presets()["greedy"], "seed": 0} | kwargs
    with pytest.raises(ShareLinkError, match=re.escape(fragment)):
        ShareState(**args)


@pytest.mark.parametrize("token, fragment", [
    (None, "link: expected text, got NoneType"),
    ("", "unknown format"),
    ("v9.abc", "unknown format"),
    ("s1.", "contains characters a share link never has"),
    ("s1.abc$def", "contains characters"),
    ("s1.a", "damaged"),
    ("s1." + "A" * (MAX_TOKEN_CHARS + 1), "over the 6,000-character limit"),
    (pack(json.dumps(good_payload()))[:-6], "damaged"),  # cut short when copied
    (pack(json.dumps(good_payload())) + "AAAA", "damaged"),  # trailing bytes after the stream
    (pack(" " * (MAX_JSON_BYTES * 30)), "over the 32,768-byte limit"),  # a zip bomb
    (pack("[1, 2]"), "link: expected an object, got list"),
    (pack('{"view": "step", "prompt": NaN}'), "NaN is not allowed"),
    (pack("\xff not json"), "not valid JSON"),
    (pack(b"\xff\xfe binary"), "not valid JSON"),
    (pack(json.dumps(good_payload(extra=1))), "unknown ['extra']"),
    (pack(json.dumps({"view": "step"})), "missing ['prompt', 'seed', 'preset']"),
    (pack(json.dumps(good_payload(preset={**good_payload()["preset"], "temperature": 99}))),
     "preset: temperature: 99.0 is out of range; allowed 0 or [0.01, 5]"),
    (pack(json.dumps(good_payload(preset={**good_payload()["preset"], "seed": 3}))), "seed belongs at the top level"),
    (pack(json.dumps(good_payload(preset="greedy"))), "preset: preset: expected a JSON object"),
    (pack(json.dumps(good_payload(seed=2**40))), "seed: 1099511627776 is out of range"),
    (pack(json.dumps(good_payload(view="<script>"))), "view: expected a short lower-case name"),
    (pack(json.dumps(good_payload(prompt=["x"]))), "prompt: expected text"),
])
def test_malformed_links_give_a_clear_message(token, fragment):
    with pytest.raises(ShareLinkError) as info:
        decode(token)
    assert fragment in str(info.value)


def test_decoded_token_pack_helper_agrees_with_encode():
    state = decode(pack(json.dumps(good_payload())))
    assert (state.view, state.prompt, state.seed, state.preset.name) == ("step", "Hello", 7, "Balanced")


# --- property tests -------------------------------------------------------------------------------
json_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=200)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=25)


def _decodes_or_fails_cleanly(token) -> None:
    try:
        state = decode(token)
    except ShareLinkError as exc:
        assert str(exc)
        return
    assert decode(encode(state)) == state  # never a partial state


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300) | st.text(alphabet="ABCDEFabcdef0123456789-_.s", max_size=300).map(lambda t: "s1." + t))
def test_random_tokens(token):
    _decodes_or_fails_cleanly(token)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=500))
def test_random_compressed_bytes(raw):
    _decodes_or_fails_cleanly(pack(raw))
    body = base64.urlsafe_b64encode(raw).decode().rstrip("=")
    _decodes_or_fails_cleanly(f"{TOKEN_PREFIX}{body}.{checksum(body)}" if body else TOKEN_PREFIX)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["view", "prompt", "seed", "preset", "x"]), json_values, max_size=5))
def test_random_payloads(changes):
    try:
        text = json.dumps(good_payload() | changes, allow_nan=True)
    except (ValueError, RecursionError):
        return
    _decodes_or_fails_cleanly(pack(text))


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(max_size=20), json_values, max_size=6))
def test_random_presets_inside_a_link(preset):
    _decodes_or_fails_cleanly(pack(json.dumps(good_payload(preset=good_payload()["preset"] | preset))))


def test_chat_switch_round_trips():
    state = ShareState("step", "p", builtin_presets()["greedy"], chat=True)
    assert decode(encode(state)).chat is True
    assert decode(encode(ShareState("step", "p", builtin_presets()["greedy"]))).chat is None
    with pytest.raises(ShareLinkError, match="chat: expected true or false"):
        ShareState("step", "p", builtin_presets()["greedy"], chat="yes")
    with pytest.raises(ShareLinkError, match="chat: expected true or false"):
        decode(pack(json.dumps(good_payload(chat=1))))


# --- the app side (playground.share_links) -----------------------------------------------------------
def test_restore_from_query():
    from playground.share_links import restore_from_query

    state = ShareState("compare", "hi", builtin_presets()["wild"], seed=3)
    assert restore_from_query({"share": encode(state)}) == state
    assert restore_from_query({}) is None and restore_from_query(None) is None
    message = restore_from_query({"share": "s1.$$$"})
    assert isinstance(message, str) and message.startswith("This share link could not be opened (link: contains")
    assert message.endswith("the defaults are shown instead.")


def test_share_token_names_the_preset_and_marks_edits():
    from playground.share_links import share_token

    balanced = builtin_presets()["balanced"]
    same = decode(share_token("step", "p", balanced.config.replace(seed=4), "balanced", [], chat=True))
    assert (same.preset.name, same.preset.description) == ("Balanced", balanced.description)
    assert (same.seed, same.chat) == (4, True)
    edited = decode(share_token("step", "p", balanced.config.replace(top_p=0.5), "balanced", []))
    assert edited.preset.name == "Balanced" and edited.preset.description == "Settings shared by link."
    assert edited.preset.config.top_p == 0.5
    custom = decode(share_token("step", "", DecodingConfig(top_k=7), "(custom)", []))
    assert custom.preset.name == "Shared settings" and custom.prompt == ""
