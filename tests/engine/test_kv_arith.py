"""engine.reports.kv_arith: KV cache and weight memory of real architectures, checked by hand."""

import json

import pytest

from engine.reports import kv_arith
from engine.reports.kv_arith import Architecture

ARCH = kv_arith.load_architectures()


def test_the_five_architectures_are_there_with_their_source():
    assert list(ARCH) == ["Llama-2-7B", "Llama-3-8B", "Llama-3-70B", "Mistral-7B", "Qwen2.5-7B"]
    for arch in ARCH.values():
        assert arch.source.startswith("https://huggingface.co/") and arch.source.endswith("/config.json")
        assert arch.hidden_size == arch.heads * arch.head_dim  # the config values agree with each other


def test_llama2_7b_fp16_is_524288_bytes_per_token():
    # 2 × 32 layers × 32 KV heads × 128 head dim × 2 bytes
    assert kv_arith.kv_bytes_per_token(ARCH["Llama-2-7B"], "fp16") == 2 * 32 * 32 * 128 * 2 == 524_288
    assert "524,288" in kv_arith.LECTURE_SLIP and "1 MB" in kv_arith.LECTURE_SLIP


def test_llama2_7b_4096_tokens_is_2_gib_of_cache():
    # 524,288 bytes × 4,096 tokens = 2^19 × 2^12 = 2^31 bytes = 2 GiB ≈ 2.147 GB
    assert kv_arith.kv_cache_bytes(ARCH["Llama-2-7B"], 4096) == 2**31
    assert kv_arith.estimate(ARCH["Llama-2-7B"], 4096).kv_cache_gb == pytest.approx(2.147483648)


def test_70b_weights_are_140_gb_in_fp16_and_35_gb_in_4_bit():
    assert kv_arith.weight_bytes(70 * 10**9, "fp16") / kv_arith.GB == 140
    assert kv_arith.weight_bytes(70 * 10**9, "int4") / kv_arith.GB == 35


def test_gqa_divides_the_cache_by_heads_over_kv_heads():
    llama3 = ARCH["Llama-3-8B"]  # 32 query heads, 8 KV heads
    rows = kv_arith.compare_attention(llama3, tokens=8192, batch=4)
    assert [r.attention for r in rows] == ["mha", "gqa", "mqa"]
    mha, gqa, mqa = rows
    assert gqa.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131_072
    assert mha.kv_bytes_per_token == 4 * gqa.kv_bytes_per_token and gqa.kv_bytes_per_token == 8 * mqa.kv_bytes_per_token
    # 131,072 × 8,192 × 4 = 2^17 × 2^13 × 2^2 = 2^32 bytes
    assert gqa.kv_cache_gb == pytest.approx(2**32 / 1e9)
    assert mha.weights_gb == gqa.weights_gb == mqa.weights_gb  # only the cache changes


def test_an_mha_model_compares_with_mqa_only():
    rows = kv_arith.compare_attention(ARCH["Llama-2-7B"], tokens=1)
    assert [r.attention for r in rows] == ["mha", "mqa"] and rows[0].kv_bytes_per_token == 32 * rows[1].kv_bytes_per_token


def test_llama3_70b_cache_by_hand():
    # 2 × 80 × 8 × 128 × 2 = 327,680 bytes per token; at 8,192 tokens: 2,684,354,560 bytes
    arch = ARCH["Llama-3-70B"]
    assert kv_arith.kv_bytes_per_token(arch) == 327_680
    assert kv_arith.kv_cache_bytes(arch, 8192) == 2_684_354_560


def test_typed_in_values_are_validated_with_the_key():
    with pytest.raises(ValueError, match=r"^kv_heads: 3 must divide heads=32"):
        Architecture("custom", 32, 32, 3, 128, 7 * 10**9)
    with pytest.raises(ValueError, match=r"^layers: expected an integer in \[1, 1,000\], got 0"):
        Architecture("custom", 0, 32, 8, 128, 7 * 10**9)
    with pytest.raises(ValueError, match=r"^dtype: expected one of fp32 \| fp16"):
        kv_arith.kv_bytes_per_token(ARCH["Mistral-7B"], "fp12")
    with pytest.raises(ValueError, match=r"^tokens: expected an integer"):
        kv_arith.kv_cache_bytes(ARCH["Mistral-7B"], -5)


def test_estimates_are_strict_json():
    rows = kv_arith.compare_attention(ARCH["Qwen2.5-7B"], tokens=32_768, batch=8, kv_dtype="int8", weights_dtype="int4")
    json.dumps([r.__dict__ for r in rows], allow_nan=False)
    assert rows[1].kv_bytes_per_token == 2 * 28 * 4 * 128 * 1 == 28_672
