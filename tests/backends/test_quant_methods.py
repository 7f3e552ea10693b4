"""The 4-bit checkpoint variants without the checkpoints (issue #40): the compressed-tensors
pack-quantized format read from its definition, the variant names everywhere a variant is
accepted, the cache layout, and the one-line messages (tests/backends/test_quant_checkpoints.py loads the
real checkpoints)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from engine import config, settings

from engine.backends import quant_methods
from engine.backends.local import QUANTIZATIONS, ModelLoadError, ModelSpec, embedded_model_dir, load_model
from engine.backends.registry import SELF_VARIANTS, ModelRegistry
from engine.backends.quant_methods import WEIGHT_METHODS, dequantize, read_layout, unpack_int4
from engine.strategies import speculative
from tests.helpers.quant_methods import _comparison  # noqa: F401


def pack_by_definition(q: list[list[int]]) -> torch.Tensor:
    """Rows of ints in [-8, 7] packed as the format defines it, bit by bit: value k of a row, stored
    as q + 8, in bits 4k..4k+3 of the row's bit stream; 32 bits a word, the first in the lowest bit."""
    words = []
    for row in q:
        bits = []
        for value in row:
            unsigned = value + 8
            bits += [(unsigned >> b) & 1 for b in range(4)]
        bits += [0] * (-len(bits) % 32)
        row_words = []
        for w in range(len(bits) // 32):
            word = sum(bit << i for i, bit in enumerate(bits[32 * w:32 * (w + 1)]))
            row_words.append(word - (1 << 32) if word >= 1 << 31 else word)  # as a signed int32
        words.append(row_words)
    return torch.tensor(words, dtype=torch.int32)


def test_unpack_reads_the_format_definition():
    rng = random.Random(0)
    for columns in (8, 64, 72, 13):  # 13: the last word half used
        q = [[rng.randint(-8, 7) for _ in range(columns)] for _ in range(5)]
        packed = pack_by_definition(q)
        assert packed.shape == (5, -(-columns // 8))
        assert unpack_int4(packed, columns).tolist() == q
    # the extremes, and a word whose top value sets the sign bit (7 + 8 = 15 in bits 28..31)
    assert unpack_int4(pack_by_definition([[-8, 7, 0, -1, 1, -8, 7, 7]]), 8).tolist() == [[-8, 7, 0, -1, 1, -8, 7, 7]]


def test_dequantize_is_q_times_its_groups_scale():
    rng = random.Random(1)
    q = [[rng.randint(-8, 7) for _ in range(6)] for _ in range(2)]
    scale = torch.tensor([[0.5, 2.0, 0.25], [1.0, 3.0, 0.1]])  # 3 groups of 2 columns
    w = dequantize(pack_by_definition(q), scale, (2, 6))
    expected = [[q[r][c] * float(scale[r, c // 2]) for c in range(6)] for r in range(2)]
    assert torch.allclose(w, torch.tensor(expected))
    # activation-ordered groups: column j takes the scale of group g_idx[j]
    g_idx = torch.tensor([2, 0, 1, 0, 2, 1])
    w = dequantize(pack_by_definition(q), scale, (2, 6), g_idx)
    expected = [[q[r][c] * float(scale[r, g_idx[c]]) for c in range(6)] for r in range(2)]
    assert torch.allclose(w, torch.tensor(expected))


def layout(**weights):
    base = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 64, "symmetric": True}
    return {"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                    "config_groups": {"group_0": {"weights": base | weights, "targets": ["Linear"]}},
                                    "ignore": ["lm_head"]}}


def test_layout_is_read_and_what_cannot_be_read_is_refused_in_one_line():
    assert read_layout(layout(), "x").group_size == 64
    bad = [(layout(num_bits=8), "config_groups"), (layout(symmetric=False), "symmetric"),
           ({"quantization_config": {"quant_method": "gptq"}}, "pack-quantized"), ({}, "compressed-tensors")]
    for cfg, word in bad:
        with pytest.raises(ValueError) as err:
            read_layout(cfg, "gptq-g64")
        assert word in str(err.value) and str(err.value).startswith("gptq-g64:") and "\n" not in str(err.value)


def test_group_128_cannot_divide_the_embedded_models_inputs():
    """The papers' group size 128 straddles rows of a 576-wide model; 64 and 32 divide every input."""
    hidden, intermediate = 576, 1536  # SmolLM2-135M: q/k/v/o/gate/up read 576, down_proj reads 1536
    assert hidden % 128 != 0
    assert all(width % g == 0 for width in (hidden, intermediate) for g in (64, 32))
    assert {m.group_size for m in WEIGHT_METHODS.values()} == {64, 32}


def test_every_variant_is_accepted_everywhere_a_variant_is():
    names = list(WEIGHT_METHODS)
    assert set(names) >= {"rtn-g64", "gptq-g64", "awq-g64", "rtn-g32", "gptq-g32", "awq-g32"}
    assert QUANTIZATIONS == ("none", "int8", "nf4", *names) == settings.QUANTIZATION_CHOICES
    for name in names:
        assert ModelSpec(quantization=name).quantization == name
        assert f"self-{name}" in SELF_VARIANTS and f"self-{name}" in speculative.DRAFTER_CHOICES
        assert config.DecodingConfig(strategy="speculative", drafter=f"self-{name}").drafter == f"self-{name}"
        assert config.DecodingConfig(strategy="contrastive_decoding", amateur=f"self-{name}").amateur == f"self-{name}"
    assert settings.env_choice("DP_QUANTIZATION", {"DP_QUANTIZATION": "awq-g32"}) == "awq-g32"
    with pytest.raises(ModelLoadError, match="quantization: expected"):
        ModelSpec(quantization="gptq-g128")
    with pytest.raises(config.ConfigError, match="drafter"):
        config.DecodingConfig(strategy="speculative", drafter="self-gptq-g128")


def test_cli_accepts_the_variants():
    from engine.__main__ import build_parser as parser

    assert parser().parse_args(["--quantization", "gptq-g64", "--prompt", "x"]).quantization == "gptq-g64"


def test_a_missing_checkpoint_says_how_to_make_it(tmp_path, monkeypatch):
    monkeypatch.setattr(quant_methods, "checkpoints_dir", lambda model_dir: tmp_path)
    with pytest.raises(ModelLoadError) as err:
        load_model(ModelSpec(quantization="awq-g64"))
    assert str(err.value) == ("quantization: the awq-g64 checkpoint is not made yet; run `make quantize` "
                              "(deploy/quantize.sh, a few minutes the first time)")
    registry = ModelRegistry(policy=None)
    with pytest.raises(ModelLoadError, match="not made yet"):
        registry.get(ModelSpec(quantization="gptq-g32"))
    assert registry.loaded() == []


def test_only_the_embedded_model_has_checkpoints(tmp_path):
    with pytest.raises(ModelLoadError) as err:
        load_model(ModelSpec(source=str(tmp_path), quantization="gptq-g64"))
    assert "made here from the embedded model" in str(err.value) and "\n" not in str(err.value)


def test_the_cache_folder_names_the_recipe_and_the_calibration_sets(tmp_path):
    key = quant_methods.recipe_key()
    assert len(key) == 12 and quant_methods.checkpoints_dir(tmp_path / "m").name == f"w4-m-{key}"
    plan = quant_methods.plan(embedded_model_dir())
    assert plan["VARIANTS"].split() == list(WEIGHT_METHODS)
    assert plan["OUT"].endswith(key) and plan["MAX_TOKENS"] == str(quant_methods.RECIPE["max_tokens"])
    assert all(path.is_file() for path in quant_methods.CALIBRATION_SETS.values())


def test_calibration_and_heldout_texts_are_separate_and_small():
    from deploy.quantize import read_samples

    prose = read_samples(quant_methods.CALIBRATION_SETS["prose"])
    code = read_samples(quant_methods.CALIBRATION_SETS["code"])
    held = quant_methods.HELDOUT.read_text(encoding="utf-8")
    assert len(prose) >= 32 and len(code) >= 16
    assert not any(sample[:60] in held for sample in prose + code)
    assert sum(p.stat().st_size for p in quant_methods.ASSETS.iterdir()) < 100_000
    meta = json.dumps(quant_methods.RECIPE)
    assert "0.14" in meta


def test_comparison_rows_sentence_and_chart_say_the_same_numbers():
    from playground.charts import quant_methods as charts

    report = _comparison()
    rows = charts.comparison_rows(report)
    assert len(rows) == 6 and all(len(r) == len(charts.COMPARE_HEADERS) for r in rows)
    assert rows[0][:6] == ["fp32 (none)", "about none", "32.00", "99.0", "reference", "reference"]
    assert rows[3][3:9] == ["160.1", "0.520", "70.0%", "80", "540", "60"]
    assert rows[5][0] == "awq-g32" and rows[5][1].startswith("failed: quantization: the awq-g32")
    sentence = charts.comparison_sentence(report)
    assert sentence.startswith("fp32 perplexity 99.0 on 1024 held-out tokens.")
    assert "RTN 148.7 (KL 0.470)" in sentence
    assert "GPTQ 160.1 (KL 0.520, +7.7% perplexity vs RTN: does not beat RTN)" in sentence
    assert "AWQ 116.0 (KL 0.180, -22.0% perplexity vs RTN: beats RTN)" in sentence
    fig = charts.comparison_figure(report)
    # horizontal bars (names level on a phone): the numbers on x, the variants' names on y
    assert [list(t.x) for t in fig.data] == [[r.perplexity for r in report.rows], [r.mean_kl for r in report.rows]]
    assert list(fig.data[0].y) == ["fp32 (none)", "nf4", "rtn-g64", "gptq-g64", "awq-g64"]
    json.dumps(fig.to_plotly_json(), default=str, allow_nan=False)


def test_inside_charts_draw_each_methods_errors_and_the_scales():
    from engine.reports.quant_report import InsideLayer
    from playground.charts import quant_methods as charts

    names = ["rtn-g64", "gptq-g64", "awq-g64"]
    report = InsideLayer(3, "q_proj", 64, names, {n: [0.1, 0.2] for n in names}, {n: [0.05, 0.04] for n in names},
                         {n: 0.15 for n in names}, {n: 0.045 for n in names}, [0.5, 2.0], [0.8, 1.6], 1.0, 1024)
    fig = charts.inside_figure(report)
    assert [t.name for t in fig.data] == names * 2 and list(fig.data[3].y) == [0.05, 0.04]
    scales = charts.scales_figure(report)
    assert list(scales.data[0].x) == [0.5, 2.0] and list(scales.data[0].y) == [0.8, 1.6]
    assert "Spearman +1.00" in scales.layout.title.text
    assert charts.inside_sentence(report).startswith("Layer 3 q_proj, group 64")


def test_the_rank_correlation_is_spearmans():
    from engine.reports.quant_report import rank_correlation

    a = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert rank_correlation(a, a * 10) == pytest.approx(1.0)
    assert rank_correlation(a, -a) == pytest.approx(-1.0)
    assert rank_correlation(a, torch.tensor([1.0, 3.0, 2.0, 4.0])) == pytest.approx(0.8)


def test_channel_errors_are_relative_per_output_channel():
    from engine.reports.quant_report import channel_errors

    w = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    w_hat = torch.tensor([[1.1, 0.0], [0.0, 2.0]])
    x = torch.tensor([[1.0, 1.0], [2.0, 0.0]])  # [T, in]
    weight_error, output_error = channel_errors(w, w_hat, x)
    assert weight_error.tolist() == pytest.approx([0.1, 0.0])
    assert output_error.tolist() == pytest.approx([0.1, 0.0])


@pytest.fixture
def methods_view(tiny_lm):
    import gradio as gr

    from tests.helpers.common import shared_over
    from playground.views import quantization

    with gr.Blocks():
        shared = shared_over(tiny_lm)
    out = quantization.MethodOutputs("status", "sentence", "table", "chart", "download")
    return quantization, shared, out


def test_the_methods_handler_streams_the_comparison_and_refuses_bad_variants(methods_view):
    from engine.control import RunControl

    quantization, shared, out = methods_view
    updates = list(quantization.methods_updates(out, shared, ["rtn-g64", "nf4"], "embedded", RunControl()))
    assert "fp32 reads the held-out text" in updates[0]["status"] and updates[0]["table"] == []
    assert "done" in updates[-1]["status"] and updates[-1]["download"] is not None
    # the table's update carries its column widths (each as wide as its longest word), as the drift table's does
    assert [r[0] for r in updates[-1]["table"]["value"]] == ["fp32 (none)", "nf4", "rtn-g64"]
    for bad in (["<b>gptq</b>"], ["gptq-g128"], ["\ud800"]):
        with pytest.raises(ValueError) as err:
            list(quantization.methods_updates(out, shared, bad, "embedded", RunControl()))
        assert str(err.value).startswith("variants: expected some of none | int8 | nf4 | rtn-g64")
