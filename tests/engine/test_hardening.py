"""Engine hardening (issue 10): contracts at the boundary (check_text, model_policy, load_preset),
no_tokens_left instead of a NaN pick, strict trace JSON for every strategy, direct-construction type
checks, the CLI's one-line exit 2, checksummed share links, evicted models freed."""

from __future__ import annotations

import gc
import json
import math
import weakref

import pytest
import torch

from tests.helpers.common import make_tiny_llama
from engine import runner, sampling
from engine.runner import RunRequest
from engine.__main__ import main as cli_main
from engine.config import ConfigError, DecodingConfig, check_text
from engine.backends.local import EMBEDDED, LoadedModel, ModelLoadError, ModelSpec
from engine.backends.registry import ModelPolicy, ModelRegistry, model_policy
from engine.presets import PresetError, load_preset
from engine.sharelink import ShareLinkError, ShareState, decode, encode
from engine.presets import builtin_presets
from engine.trace import STOP_REASONS, Trace
from tests.helpers.hardening import AmateurRegistry, tiny_amateur  # noqa: F401

PROMPT = "The cat sat on the"
# Every token masked from the first step: the only allowed word is also banned, and EOS (which the
# constraint always allows) is masked by min_new_tokens.
ALL_MASKED = {"allowed_words": ["cat"], "banned_words": ["cat"], "min_new_tokens": 5}


def strict_loads(text: str):
    def refuse(name):
        raise ValueError(f"non-strict JSON constant {name}")
    return json.loads(text, parse_constant=refuse)


# --- check_text ------------------------------------------------------------------------------------
@pytest.mark.parametrize("value,fragment", [
    ("\ud800", "lone surrogate (U+D800) at character 0"), ("ok\udfff", "U+DFFF) at character 2"),
    (5, "expected text, got int"), (None, "expected text, got NoneType"), (["x"], "got list"),
    ("", "empty"), ("x" * 201, "201 characters is over the 200-character limit"),
])
def test_check_text_refuses_with_the_key(value, fragment):
    with pytest.raises(ConfigError) as info:
        check_text("stop", value)
    assert info.value.key == "stop" and str(info.value).startswith("stop: ") and fragment in str(info.value)


def test_check_text_accepts_valid_unicode():
    assert check_text("prompt", "Ünïcode ✓ 😀", max_len=20) == "Ünïcode ✓ 😀"
    assert check_text("prompt", "", allow_empty=True) == ""


# --- config: types by direct construction, bounds against underflow -----------------------------------
@pytest.mark.parametrize("kwargs,key,fragment", [
    ({"stop": "abc"}, "stop", "a single string 'abc'"), ({"stop": 5}, "stop", "got 5"),
    ({"stop": {"a": 1}}, "stop", "got {'a': 1}"), ({"allowed_words": "cat"}, "allowed_words", "single string"),
    ({"banned_words": ("ok", 3)}, "banned_words", "got item 3"), ({"stop": ["\ud800"]}, "stop", "lone surrogate"),
    ({"drafter": "model:\ud800"}, "drafter", "lone surrogate"), ({"strategy": ["greedy"]}, "strategy", "got ['greedy']"),
    ({"temperature": 1e-38}, "temperature", "0 or [0.01, 5]"), ({"temperature": 0.009}, "temperature", "out of range"),
    ({"repetition_penalty": 1e-38}, "repetition_penalty", "[0.01, 10]"),
    ({"strategy": "contrastive_search", "top_k": 1}, "top_k", "needs top_k >= 2"),
])
def test_direct_construction_validates_types(kwargs, key, fragment):
    with pytest.raises(ConfigError) as info:
        DecodingConfig(**kwargs)
    assert info.value.key == key and fragment in str(info.value)


def test_valid_lists_and_bounds_are_kept():
    cfg = DecodingConfig(stop=("a", "b"), temperature=0.01, repetition_penalty=0.01)
    assert cfg.stop == ("a", "b") and cfg.temperature == 0.01 and DecodingConfig(temperature=0.0).is_greedy


# --- CLI: one line, exit 2 ---------------------------------------------------------------------------
@pytest.mark.parametrize("argv,fragment", [
    (["--prompt", "hi", "--set", "top_k=" + "9" * 5000], "top_k: value of 5,000 characters is too long"),
    (["--prompt", "hi", "--set", "stop=[" + "1" * 5000 + "]"], "stop: "),
    (["--prompt", "hi", "--set", "temperature=1e-38"], "temperature: 1e-38 is out of range"),
    (["--prompt", "\ud800"], "--prompt: invalid text: a lone surrogate"),
    (["--prompt", "hi", "--preset", "\udcff.json"], "--preset: invalid text"),
    (["--prompt", "hi", "--set", "stop=\udc80"], "stop: invalid text"),
])
def test_cli_bad_input_is_one_line_exit_2(argv, fragment, capsys):
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and fragment in err and "Traceback" not in err


# --- model policy ------------------------------------------------------------------------------------
@pytest.mark.parametrize("source", ["/etc/passwd", "~/.ssh", "../../x.json", "/tmp", "someone/model", "model:/etc"])
def test_default_policy_refuses_paths_and_hub_ids_alike(source, monkeypatch):
    for name in ("DP_PUBLIC", "SPACE_ID", "DP_MODELS", "DP_ALLOW_LOCAL_MODELS", "DP_MODEL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ModelLoadError) as info:
        model_policy().check(source, "drafter")
    message = str(info.value)
    shown = source.removeprefix("model:")
    # the same sentence whatever the path names: nothing about files, directories or existence
    assert message == f"drafter: {shown!r} is not offered here; allowed: embedded " \
                      "(the operator can allow more with DP_MODELS or DP_ALLOW_LOCAL_MODELS=1)"


def test_policy_from_environment(monkeypatch):
    for name in ("DP_PUBLIC", "SPACE_ID", "DP_MODEL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DP_MODELS", "embedded, org/a ,org/a")
    monkeypatch.setenv("DP_ALLOW_LOCAL_MODELS", "1")
    policy = model_policy()
    assert policy == ModelPolicy(("embedded", "org/a"), public=False, allow_local=True)
    assert policy.check("/some/dir") == "/some/dir" and policy.check("model:org/b", "amateur") == "model:org/b"
    monkeypatch.setenv("SPACE_ID", "user/space")  # public: the operator flag no longer applies
    public = model_policy()
    assert public.public and not public.allow_local and public.check("org/a") == "org/a"
    with pytest.raises(ModelLoadError, match=r"^model: '/some/dir' is not offered here; allowed: embedded, org/a$"):
        public.check("/some/dir")
    with pytest.raises(ModelLoadError, match="model: expected text, got int"):
        public.check(5)


def test_registry_with_a_policy_refuses_before_loading(monkeypatch):
    loads = []
    monkeypatch.setattr("engine.backends.registry.load_model", lambda spec, progress=None: loads.append(spec))
    registry = ModelRegistry(policy=ModelPolicy((EMBEDDED,)))
    with pytest.raises(ModelLoadError, match="^amateur: '/etc' is not offered here"):
        registry.get(ModelSpec("/etc"), key="amateur")
    assert loads == []


# --- presets from the page: names or JSON objects only ---------------------------------------------------
def test_load_preset_refuses_paths_unless_allowed(tmp_path):
    path = tmp_path / "secret.json"
    path.write_text('{"name": "Secret", "temperature": 98765.4321}')  # (the file's numbers: not in any path)
    for source in (str(path), "/etc/passwd", "~/.ssh", "../../x.json"):
        with pytest.raises(PresetError) as info:
            load_preset(source)
        assert "is not a built-in preset" in str(info.value) and "98765" not in str(info.value)
    assert load_preset({"name": "Mine", "temperature": 0.5}).config.temperature == 0.5
    assert load_preset('{"name": "Mine", "top_k": 5}').config.top_k == 5
    with pytest.raises(PresetError, match="temperature: 98765.4321 is out of range"):  # the CLI reads files
        load_preset(str(path), allow_paths=True)
    with pytest.raises(PresetError, match="preset: expected text, got int"):
        load_preset(5)


# --- share links -------------------------------------------------------------------------------------
def test_every_single_character_corruption_is_refused():
    token = encode(ShareState("step", "Hello there", builtin_presets()["balanced"], seed=7))
    alphabet = "AQgw_-09z."
    changed = 0
    for i in range(3, len(token)):
        for c in alphabet:
            if c == token[i]:
                continue
            changed += 1
            with pytest.raises(ShareLinkError):
                decode(token[:i] + c + token[i + 1:])
    assert changed > 1000 and decode(token).seed == 7


def test_legacy_links_without_checksum_still_decode():
    token = encode(ShareState("step", "Hi", builtin_presets()["greedy"], seed=3))
    body = token[len("s2."):].rpartition(".")[0]
    assert decode("s1." + body) == decode(token)


# --- no_tokens_left and strict JSON over every strategy ----------------------------------------------
def test_has_tokens_on_hand_made_rows():
    inf, nan = float("inf"), float("nan")
    assert sampling.has_tokens(torch.tensor([[0.0, -inf]]))
    assert not sampling.has_tokens(torch.tensor([[-inf, -inf]]))
    assert not sampling.has_tokens(torch.tensor([[nan, 0.0]]))
    assert not sampling.has_tokens(torch.tensor([[inf, 0.0]]))
    assert not sampling.has_tokens(torch.tensor([[0.0, 1.0], [-inf, -inf]]))  # every row must have one
    with pytest.raises(sampling.NoTokensLeft, match="no_tokens_left at step 3"):
        sampling.ensure_tokens(torch.tensor([[-inf]]), 3)
    assert "no_tokens_left" in STOP_REASONS


STRATEGIES = [
    {"strategy": "greedy"}, {"strategy": "sample", "temperature": 0.8, "top_p": 0.9},
    {"strategy": "beam", "num_beams": 2}, {"strategy": "speculative", "drafter": "ngram"},
    {"strategy": "contrastive_search", "top_k": 4}, {"strategy": "contrastive_decoding", "amateur": "self-int8"},
]


@pytest.mark.parametrize("masked", [False, True], ids=["normal", "all-masked"])
@pytest.mark.parametrize("base", STRATEGIES, ids=[s["strategy"] for s in STRATEGIES])
def test_every_strategy_emits_strict_json(tiny_lm, tiny_amateur, base, masked):
    config = DecodingConfig.from_dict({**base, "max_new_tokens": 5, **(ALL_MASKED if masked else {})})
    trace = runner.run(RunRequest(tiny_lm, PROMPT, config, registry=AmateurRegistry(tiny_amateur)))
    data = strict_loads(trace.to_json())
    assert data["stop_reason"] in STOP_REASONS
    if masked:  # token 0 is never picked from a NaN distribution: the run ends, saying why
        assert data["stop_reason"] == "no_tokens_left" and data["generated_token_ids"] == [] and data["text"] == ""
    else:
        assert data["stop_reason"] == "max_new_tokens" and len(data["generated_token_ids"]) == 5
    assert Trace.from_json(trace.to_json()).generated_token_ids == trace.generated_token_ids


@pytest.mark.parametrize("strategy", ["greedy", "sample"])
def test_tokens_run_out_mid_run(tiny_lm, strategy):
    # Only the tokens of "cat" are allowed, none may repeat, EOS is masked: a few steps, then nothing.
    config = DecodingConfig(strategy=strategy, allowed_words=("cat",), no_repeat_ngram_size=1, min_new_tokens=50,
                            max_new_tokens=50)
    trace = runner.run(RunRequest(tiny_lm, PROMPT, config))
    ids = trace.generated_token_ids
    assert trace.stop_reason == "no_tokens_left" and 1 <= len(ids) < 10 and len(set(ids)) == len(ids)
    assert trace.steps[-1].finish_reason == "no_tokens_left"
    assert all(math.isfinite(s.chosen_prob) and s.chosen_prob > 0 for s in trace.steps)
    strict_loads(trace.to_json())


def test_to_json_writes_non_finite_as_null(tiny_lm):
    trace = runner.run(RunRequest(tiny_lm, PROMPT, DecodingConfig(strategy="greedy", max_new_tokens=2)))
    trace.summary["odd"] = [float("nan"), float("-inf"), 1.5]
    assert strict_loads(trace.to_json())["summary"]["odd"] == [None, None, 1.5]


# --- evicted models are freed ------------------------------------------------------------------------
def test_evicted_model_is_garbage_collected(tiny_lm, monkeypatch):
    def fake_load(spec, progress=None):
        return LoadedModel(name=spec.source, model=make_tiny_llama(layers=1, hidden=32), tokenizer=tiny_lm.tokenizer,
                           device=torch.device("cpu"), dtype=torch.float32, quantization="none",
                           source=spec.source, eos_token_ids=(2,), memory_bytes=0)

    monkeypatch.setattr("engine.backends.registry.load_model", fake_load)
    registry = ModelRegistry(capacity=1)
    handle = registry.handle(ModelSpec("first"))  # what a session keeps
    lm = handle.get()
    runner.run(RunRequest(lm, PROMPT, DecodingConfig(strategy="sample", max_new_tokens=3)))  # leaves no cache behind
    ref, model_ref = weakref.ref(lm), weakref.ref(lm.model)
    del lm
    gc.collect()
    assert ref() is not None  # still in the registry
    registry.get(ModelSpec("second"))  # evicts "first"
    gc.collect()
    assert ref() is None and model_ref() is None
    assert handle.get().source == "first"  # the handle re-resolves (reloads) through the registry


def test_dtype_is_validated_on_the_cli_and_in_the_environment(monkeypatch, capsys):
    """``--dtype`` takes only the listed dtypes (argparse: exit 2, one line naming it); a bad
    DP_DTYPE is refused by name when a model loads, never silently replaced."""
    with pytest.raises(SystemExit) as exc:
        cli_main(["--prompt", "hi", "--dtype", "float64"])
    assert exc.value.code == 2
    assert "--dtype" in capsys.readouterr().err
    from engine.backends.local import ModelLoadError, resolve_dtype

    monkeypatch.setenv("DP_DTYPE", "float64")
    with pytest.raises(ModelLoadError, match="DP_DTYPE: expected auto .* got 'float64'"):
        resolve_dtype("auto", torch.device("cpu"))
    monkeypatch.setenv("DP_DTYPE", "bfloat16")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32  # an explicit dtype wins
    monkeypatch.delenv("DP_DTYPE")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
