"""engine.reports.drift: distribution drift between model variants, and the KV cache against the uncached loop."""

import math

import pytest
import torch

from engine.strategies import decode
from engine.reports import drift
from engine.trace import from_dict, to_dict
from tests.helpers.drift import OneModelRegistry  # noqa: F401


def test_compare_logits_on_a_three_token_distribution_checkable_by_hand():
    # p = [0.5, 0.25, 0.25], q = [0.25, 0.5, 0.25]; the reference token is 0.
    p = torch.tensor([[0.5, 0.25, 0.25]]).log()
    q = torch.tensor([[0.25, 0.5, 0.25]]).log()
    (pos,) = drift.compare_logits(p, q, [0], lambda i: f"t{i}")
    # KL = 0.5 ln(0.5/0.25) + 0.25 ln(0.25/0.5) + 0.25 ln 1 = 0.25 ln 2
    assert pos.kl == pytest.approx(0.25 * math.log(2), abs=1e-6)
    assert pos.tv == pytest.approx(0.25, abs=1e-6)  # (|0.5-0.25| + |0.25-0.5| + 0) / 2
    assert pos.top1_token_id == 1 and pos.top1_token == "t1" and not pos.top1_agrees
    assert pos.ref_prob == pytest.approx(0.5) and pos.variant_prob == pytest.approx(0.25)


def test_kl_of_a_model_against_itself_is_zero_and_top1_agrees(tiny_lm):
    prompt_ids = tiny_lm.encode("The cat sat on", False)
    reference = list(decode.stream(tiny_lm, prompt_ids, drift.greedy_config(10)))
    ref_ids = [s.chosen_token_id for s in reference]
    ref_logits = drift.teacher_forced_logits(tiny_lm, prompt_ids, ref_ids)
    assert ref_logits.shape == (len(ref_ids), tiny_lm.vocab_size)
    v = drift.measure_variant(tiny_lm, tiny_lm, prompt_ids, reference, ref_logits, reference)
    assert len(v.positions) == len(ref_ids)
    assert all(p.kl < 1e-6 and p.tv < 1e-6 for p in v.positions)
    assert v.mean_kl < 1e-6 and v.top1_agreement == 1.0  # teacher forcing picks what the cached greedy run picked
    assert v.first_divergence is None and v.generated_token_ids == ref_ids


def test_stream_drift_yields_reference_first_then_each_variant_and_records_failures(tiny_lm):
    reports = [
        (len(r.variants), dict(r.errors), r.pending())
        for r in drift.stream_drift(OneModelRegistry(tiny_lm), "tiny", "Hello there", False, 6, ["nf4", "none"])
    ]
    assert reports == [(0, {}, ["none", "nf4"]), (1, {}, ["nf4"]),
                       (1, {"nf4": "Could not nf4-quantize 'tiny': not in this registry"}, [])]
    report = drift.quantization_report(OneModelRegistry(tiny_lm), "tiny", "Hello there", False, 6, ["none"])
    assert report.requested == ["none"] and report.variants[0].was_loaded
    assert report.variants[0].mean_kl < 1e-6 and len(report.reference_token_ids) <= 6
    assert from_dict(drift.DriftReport, to_dict(report)) == report  # the JSON round-trips to the same record


def test_variants_are_validated_and_ordered():
    assert drift.normalise_variants(["nf4", "none", "nf4"]) == ["none", "nf4"]
    with pytest.raises(ValueError, match="variants: .*'int4'"):
        drift.normalise_variants(["int4"])
    with pytest.raises(ValueError, match="variants: pick at least one"):
        drift.normalise_variants([])


def test_kv_cache_report_tokens_match_and_bytes_per_token_equal_the_formula(tiny_lm):
    report = drift.kv_cache_report(tiny_lm, "Once upon a time", False, 12)
    assert report.tokens_equal and report.generated_token_ids == report.uncached_token_ids
    assert 1 <= len(report.generated_token_ids) <= 12 and len(report.steps) == len(report.generated_token_ids)
    # tiny llama: 2 layers, 2 kv heads, head_dim 64 / 4 heads = 16, float32 -> 2 * 2 * 2 * 16 * 4 = 512 bytes
    assert (report.layers, report.kv_heads, report.head_dim, report.bytes_per_element) == (2, 2, 16, 4)
    assert report.formula_bytes_per_token == 512
    assert report.bytes_per_token == 512
    # the cache holds the prompt and every generated token but the last (never fed back)
    assert report.cache_positions == report.prompt_tokens + len(report.generated_token_ids) - 1
    assert report.cache_bytes == 512 * report.cache_positions
    assert [s.position for s in report.steps][:2] == [report.prompt_tokens, report.prompt_tokens + 1]
    assert report.cached_tokens_per_s > 0 and report.uncached_tokens_per_s > 0
    assert from_dict(drift.KVReport, to_dict(report)) == report


@pytest.mark.slow
def test_int8_embedded_halves_memory_and_drifts_a_little(registry):
    report = drift.quantization_report(registry, "embedded", "The capital of France is", False, 12, ["none", "int8"])
    fp32, int8 = report.variants
    assert (fp32.quantization, int8.quantization) == ("none", "int8")
    assert int8.memory_bytes < 0.5 * fp32.memory_bytes
    assert fp32.mean_kl < 1e-6 and fp32.top1_agreement == 1.0
    assert int8.mean_kl > 0
    assert int8.top1_agreement >= 0.5
    assert len(int8.positions) == len(report.reference_token_ids) == 12
