"""Memory side of the Quantization & KV cache view: the calculator against hand-computed numbers,
the KV-kinds handler on the tiny model (the embedded model in one slow test), input validation."""

from __future__ import annotations

import json

import pytest

from engine.control import RunControl
from engine.backends.registry import ModelRegistry
from playground.charts import memory as memory_charts
from playground.shared import Shared, UserError
from playground.views import quantization as view

PROMPT = "The capital of France is"


def test_llama2_7b_fp16_is_half_a_megabyte_per_token_not_one():
    data = view.kv_calculator("Llama-2-7B", context=4096, batch=1)
    assert data["estimate"]["kv_bytes_per_token"] == 2 * 32 * 32 * 128 * 2 == 524_288
    assert data["kv_mb_per_token"] == 0.5
    assert data["estimate"]["kv_cache_gb"] == pytest.approx(524_288 * 4096 / 1e9)  # 2.147 GB
    assert "1 MB" in data["note"]
    json.dumps(data, allow_nan=False)


def test_70b_weights_and_gqa_vs_mha_vs_mqa():
    data = view.kv_calculator("Llama-3-70B", context=1, weights_dtype="int4")
    assert data["estimate"]["weights_gb"] == pytest.approx(70_553_706_496 * 0.5 / 1e9)  # ≈ 35 GB
    assert view.kv_calculator("Llama-3-70B")["estimate"]["weights_gb"] == pytest.approx(141.1, abs=0.1)  # ≈ 140 GB
    per_token = [a["kv_bytes_per_token"] for a in data["attention"]]
    assert per_token == [2 * 80 * 64 * 128 * 2, 2 * 80 * 8 * 128 * 2, 2 * 80 * 1 * 128 * 2]
    assert [a["attention"] for a in data["attention"]] == ["mha", "gqa", "mqa"]


def test_custom_architecture_and_its_errors():
    data = view.kv_calculator("custom", 1000, 2, "int8", "fp16", 4, 8, 2, 64, 0.5)
    assert data["estimate"]["kv_bytes_per_token"] == 2 * 4 * 2 * 64 * 1
    assert data["estimate"]["kv_cache_gb"] == pytest.approx(1024 * 1000 * 2 / 1e9)
    assert data["estimate"]["weights_gb"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="kv_heads: 3 must divide heads=8"):
        view.kv_calculator("custom", 10, 1, "fp16", "fp16", 4, 8, 3, 64, 1.0)
    with pytest.raises(ValueError, match="architecture_name: .*'GPT-9'"):
        view.kv_calculator("GPT-9")
    with pytest.raises(ValueError, match="kv_dtype: .*'fp12'"):
        view.kv_calculator("Llama-2-7B", kv_dtype="fp12")
    with pytest.raises(ValueError, match=r"context: expected a whole number in \[1, 10,000,000\], got 1.5"):
        view.kv_calculator("Llama-2-7B", context=1.5)


def test_calculator_updates_show_the_error_in_place_of_the_formula():
    out = view.CalcOutputs("formula", "table", "chart")
    good = view.calculator_updates(out, "Mistral-7B", 32768, 1, "fp16", "fp16")
    assert "131,072 bytes per token" in good["formula"] and len(good["table"]["value"]) == 3
    assert len(good["table"]["column_widths"]) == len(memory_charts.CALCULATOR_HEADERS)  # sized to its words
    bad = view.calculator_updates(out, "Mistral-7B", -1, 1, "fp16", "fp16")
    assert set(bad) == {"formula"} and "context: " in bad["formula"]  # the argument by its API name


def test_kind_inputs_are_validated_with_the_value_named():
    assert view.kind_names(["dynamic", view.SLIDING], 16.0) == ["dynamic", "sliding-16"]
    with pytest.raises(UserError, match="sliding window: .*0"):
        view.kind_names([view.SLIDING], 0)
    with pytest.raises(UserError, match="kinds: tick"):
        view.kind_names([], 16)
    with pytest.raises(UserError, match="kv_residual_length: 0 "):
        view.residual(0)
    with pytest.raises(UserError, match="max_new_tokens: 9999"):
        view.kind_tokens(9999)


@pytest.fixture
def shared(tiny_lm, monkeypatch) -> Shared:
    s = Shared(registry=ModelRegistry(), model=None, quantization=None, user_presets=None)
    monkeypatch.setattr(s, "lm", lambda model, quantization: tiny_lm)
    return s


def kind_out() -> view.KindOutputs:
    return view.KindOutputs("status", "table", "memory", "per_token", "drift", "download")


def test_kinds_handler_streams_rows_and_the_dynamic_cache_matches_its_formula(shared):
    out = kind_out()
    updates = list(view.kinds_updates(out, shared, view.Measure(PROMPT, False, 6, "embedded", "none"),
                                      ["dynamic", "quantized-int8", view.SLIDING], 4, 2, RunControl()))
    last = updates[-1]
    rows = last["table"]["value"]
    assert [r[0] for r in rows] == ["dynamic", "quantized-int8", "sliding-4"]
    assert "bytes = formula for the positions held" in rows[0][3]  # measured cache bytes equal the formula's
    assert rows[0][8] == "reference" and "done: 3 kinds" in last["status"]
    assert last["memory"].data and last["per_token"].data and last["drift"].data
    assert last["download"].endswith(".json")


def test_kinds_api_returns_strict_json(shared):
    data = view.kv_cache_kinds_report(shared, PROMPT, max_new_tokens=4, kinds=["dynamic", "sliding-3"],
                                      residual_length=2, control=RunControl())
    json.dumps(data, allow_nan=False)
    assert [k["kind"] for k in data["kinds"]] == ["dynamic", "sliding-3"]
    assert data["kinds"][0]["mean_kl"] == pytest.approx(0.0, abs=1e-6)  # dynamic against itself


@pytest.mark.slow
def test_int8_kv_cache_drift_is_small_on_the_embedded_model(embedded, monkeypatch):
    s = Shared(registry=ModelRegistry(), model=None, quantization=None, user_presets=None)
    monkeypatch.setattr(s, "lm", lambda model, quantization: embedded)
    data = view.kv_cache_kinds_report(s, "Explain why the sky is blue.", True, 24, ["dynamic", "quantized-int8"], 8,
                                      control=RunControl())
    int8 = data["kinds"][1]
    assert int8["quantized_positions"] > 0 and int8["cache_bytes"] == int8["formula_bytes"]
    assert int8["bytes_per_token"] < data["kinds"][0]["bytes_per_token"]
    assert int8["mean_kl"] < 0.05
