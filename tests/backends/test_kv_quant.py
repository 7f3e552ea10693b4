"""engine.cache.kv_quant and KVCache(kind=...): the KV cache kinds, their bytes against the formula,
exact rewinds, reproducible decoding, the KV drift report and the self-kv drafters."""

import json

import pytest
import torch

from engine.strategies import decode
from engine.reports import drift
from engine import runner
from engine.cache import kv_quant
from engine.runner import RunRequest
from engine.cache import KVCache
from engine.config import ConfigError, DecodingConfig
from engine.control import RunControl, RunStopped
from engine.backends.registry import ModelRegistry
from engine.trace import to_dict

KINDS = ["dynamic", "quantized-int8", "quantized-int4", "sliding-8"]
PROMPT_IDS = list(range(100, 120))  # 20 tokens
LATER = list(range(300, 311))  # 11 tokens fed one by one after the prompt


def fed(model, kind, residual_length=4, later=LATER):
    """A cache of ``kind`` after the prompt (one prefill) and ``later`` one token per forward."""
    cache = KVCache(model, kind, residual_length)
    cache.sync(PROMPT_IDS)
    for token in later:
        cache.step([token])
    return cache


# --- the knob -----------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["dynamic", "quantized-int8", "quantized-int4", "sliding-2", "sliding-4096"])
def test_kv_cache_accepts_the_kinds(value):
    assert DecodingConfig(kv_cache=value).kv_cache == value
    assert kv_quant.parse_kind(value).name == value


@pytest.mark.parametrize("value", ["static", "sliding-1", "sliding-", "sliding-x", "sliding-99999999", "quantized-int3"])
def test_kv_cache_rejects_other_values_naming_the_key(value):
    with pytest.raises(ConfigError) as info:
        DecodingConfig(kv_cache=value)
    assert str(info.value).startswith("kv_cache:") and repr(value) in str(info.value)


def test_kv_residual_length_has_bounds():
    with pytest.raises(ConfigError, match=r"^kv_residual_length: 0 is out of range; allowed \[1, 1024\]"):
        DecodingConfig(kv_residual_length=0)
    assert DecodingConfig.from_dict({"kv_cache": "quantized-int4", "kv_residual_length": 8}).to_dict(sparse=True) == {
        "strategy": "sample", "kv_cache": "quantized-int4", "kv_residual_length": 8}


# --- bytes: measured from the tensors vs the formula -------------------------------------------------
def test_formula_per_position_by_hand(tiny_lm):
    # tiny Llama: 2 layers, 2 kv heads, head_dim 16, float32 -> 2 * 2 * 2 * 16 = 128 values per position;
    # quantization groups of 8 values (half a head), each with a float32 scale and zero: 2 * 4 / 8 = 1 byte per value
    geo = kv_quant.geometry(tiny_lm.model.config, torch.float32)
    assert (geo.layers, geo.kv_heads, geo.head_dim, geo.bytes_per_element, geo.group_size) == (2, 2, 16, 4, 8)
    assert kv_quant.formula_bytes_per_token(geo, "dynamic") == 128 * 4 == 512
    assert kv_quant.formula_bytes_per_token(geo, "quantized-int8") == 128 * (1 + 1) == 256
    assert kv_quant.formula_bytes_per_token(geo, "quantized-int4") == 128 * (0.5 + 1) == 192


def test_formula_for_the_embedded_model_by_hand(embedded):
    # SmolLM2-135M: 30 layers, 3 kv heads, head_dim 64, float32 -> 2 * 30 * 3 * 64 = 11,520 values per position;
    # groups of 32 values with a float32 scale and zero: 8 / 32 = 0.25 bytes per value
    geo = kv_quant.geometry(embedded.model.config, embedded.dtype)
    assert geo.group_size == 32
    assert kv_quant.formula_bytes_per_token(geo, "dynamic") == 11_520 * 4 == 46_080
    assert kv_quant.formula_bytes_per_token(geo, "quantized-int8") == 11_520 * 1.25 == 14_400
    assert kv_quant.formula_bytes_per_token(geo, "quantized-int4") == 11_520 * 0.75 == 8_640


@pytest.mark.parametrize("kind", KINDS)
def test_measured_bytes_equal_the_formula_for_the_layout(tiny_lm, kind):
    cache = fed(tiny_lm.model, kind)
    counts = kv_quant.cache_bytes(cache.cache)
    geo = kv_quant.geometry(tiny_lm.model.config, torch.float32)
    assert counts.positions == cache.length == 31
    assert counts.total == cache.nbytes() == kv_quant.expected_bytes(geo, kind, counts)
    if kind.startswith("quantized"):
        # the prefill quantizes the prompt; then every 4th token flushes the residual: 11 = 2 * 4 + 3
        assert (counts.quantized_positions, counts.stored_positions) == (28, 31)
        assert counts.total == 3 * 512 + 28 * kv_quant.formula_bytes_per_token(geo, kind)
        assert counts.quantized > 0 and counts.scales > 0
    elif kind == "sliding-8":
        assert counts.stored_positions == 7 and counts.total == 7 * 512  # N - 1 kept; the new one makes N
    else:
        assert counts.total == 31 * 512


def test_a_longer_residual_keeps_more_in_full_precision(tiny_lm):
    short, long = (kv_quant.cache_bytes(fed(tiny_lm.model, "quantized-int8", r).cache) for r in (4, 32))
    assert long.quantized_positions == 20 and long.total == 11 * 512 + 20 * 256  # only the prompt is quantized
    assert short.total < long.total


# --- what each kind computes ------------------------------------------------------------------------
def test_a_window_longer_than_the_run_equals_the_dynamic_cache(tiny_lm):
    dynamic, sliding = KVCache(tiny_lm.model), KVCache(tiny_lm.model, "sliding-64")
    assert torch.equal(dynamic.sync(PROMPT_IDS), sliding.sync(PROMPT_IDS))
    for token in LATER:
        torch.testing.assert_close(sliding.step([token]), dynamic.step([token]), rtol=0, atol=1e-5)


def test_a_short_window_forgets_and_stays_bounded(tiny_lm):
    sizes = []
    cache = KVCache(tiny_lm.model, "sliding-4")
    dynamic = KVCache(tiny_lm.model)
    cache.sync(PROMPT_IDS)
    dynamic.sync(PROMPT_IDS)
    gaps = []
    for token in LATER:
        gaps.append(float((cache.step([token]) - dynamic.step([token])).abs().max()))
        sizes.append(cache.nbytes())
    assert set(sizes) == {3 * 512}  # 3 positions kept, whatever the length
    assert max(gaps) > 1e-3  # it really attends to fewer positions


def test_rewind_inside_the_residual_is_exact(tiny_lm):
    cache = fed(tiny_lm.model, "quantized-int8", residual_length=8, later=[300, 301, 302])
    cache.rewind(2)  # 300 stays; 301 and 302 were still unquantized
    again = cache.step([400])
    fresh = fed(tiny_lm.model, "quantized-int8", residual_length=8, later=[300])
    assert torch.equal(again, fresh.step([400]))
    assert cache.tokens == fresh.tokens


def test_rewind_past_quantized_positions_restores_the_last_sync(tiny_lm):
    cache = fed(tiny_lm.model, "quantized-int4", residual_length=2, later=[300, 301, 302, 303])
    cache.rewind(2)  # 302, 303 were flushed into the quantized storage: back to the prompt, then feed 300, 301
    again = cache.step([400])
    reference = KVCache(tiny_lm.model, "quantized-int4", 2)
    reference.sync(PROMPT_IDS)
    reference.forward(torch.tensor([[300, 301]]))
    assert torch.equal(again, reference.step([400]))
    assert cache.tokens == PROMPT_IDS + [300, 301, 400] and cache.length == 23


# --- decoding with a kind -----------------------------------------------------------------------------
def manual_greedy(lm, prompt_ids, kind, n):
    """The simplest loop over KVCache(kind): argmax of the raw logits."""
    cache = KVCache(lm.model, kind, 4)
    logits, out = cache.sync(prompt_ids), []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = cache.step([out[-1]])
    return out


@pytest.mark.parametrize("kind", ["quantized-int4", "sliding-4"])
def test_decode_uses_the_configured_kind(tiny_lm, kind):
    prompt_ids = tiny_lm.encode("Once upon a time there was", False)
    config = DecodingConfig(strategy="greedy", max_new_tokens=12, top_n=1, kv_cache=kind, kv_residual_length=4)
    ours = [s.chosen_token_id for s in decode.stream(tiny_lm, prompt_ids, config)]
    assert ours == manual_greedy(tiny_lm, prompt_ids, kind, len(ours))


def test_sampling_with_a_quantized_cache_is_reproducible(tiny_lm):
    config = DecodingConfig(strategy="sample", seed=5, max_new_tokens=16, top_n=3, kv_cache="quantized-int4",
                            kv_residual_length=4)
    first, second = (runner.run(RunRequest(tiny_lm, "The cat sat on", config)) for _ in range(2))
    assert first.generated_token_ids == second.generated_token_ids
    assert [s.chosen_prob for s in first.steps] == [s.chosen_prob for s in second.steps]


# --- the drift report ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_report(tiny_lm):
    return drift.kv_drift_report(tiny_lm, "Once upon a time", False, 12, KINDS, residual_length=4)


def test_drift_report_rows(tiny_report):
    rows = {k.kind: k for k in tiny_report.kinds}
    assert list(rows) == KINDS and not tiny_report.errors
    assert rows["dynamic"].mean_kl < 1e-6 and rows["dynamic"].top1_agreement == 1.0  # the yardstick against itself
    assert rows["dynamic"].first_divergence is None
    assert rows["quantized-int4"].mean_kl > rows["quantized-int8"].mean_kl > 0  # fewer bits, more drift
    for row in rows.values():
        assert row.cache_bytes == row.formula_bytes
        assert len(row.positions) == len(tiny_report.reference_token_ids) == 12
        assert len(row.memory_bytes) == len(row.generated_token_ids)
        assert row.memory_positions[0] == len(tiny_report.prompt_token_ids)
    assert rows["quantized-int4"].cache_bytes < rows["quantized-int8"].cache_bytes < rows["dynamic"].cache_bytes
    assert "Teacher-forced" in tiny_report.method and "Free-running" in tiny_report.method


def test_drift_report_json_is_strict(tiny_report):
    json.dumps(to_dict(tiny_report), allow_nan=False)


def test_drift_report_stops_when_cancelled(tiny_lm):
    control = RunControl()
    control.cancel()
    with pytest.raises(RunStopped):
        drift.kv_drift_report(tiny_lm, "Once upon a time", False, 4, ["dynamic"], control=control)


def test_drift_report_caps_its_length(tiny_lm, monkeypatch):
    monkeypatch.setattr(drift, "MAX_KV_DRIFT_TOKENS", 3)
    report = drift.kv_drift_report(tiny_lm, "Once upon a time", False, 10, ["dynamic"])
    assert report.max_new_tokens == 3 and "capped at 3 of the 10" in report.note


@pytest.mark.slow
def test_int8_kv_drift_on_the_embedded_model_is_small(embedded):
    # 32 tokens, residual 8, so nearly every position is quantized. Measured: int8 mean KL 7.5e-5 nats, top-1
    # 100%, never diverges; int4 mean KL 2.6e-2, top-1 91%. The bounds leave room for other CPUs' rounding.
    report = drift.kv_drift_report(embedded, "Write a short story about a lighthouse keeper.", True, 32,
                                   ["quantized-int8", "quantized-int4"], residual_length=8)
    int8, int4 = report.kinds
    assert int8.mean_kl < 1e-3 and int8.top1_agreement >= 0.9
    assert int4.mean_kl > int8.mean_kl
    assert int8.cache_bytes == int8.formula_bytes and int4.cache_bytes == int4.formula_bytes
    assert int8.bytes_per_token < 0.4 * 46_080  # well under the float32 cache's 46,080 bytes per position


def test_an_odd_number_of_positions_and_heads_packs_in_4_bits():
    # HQQ packs 4-bit rows in pairs; half-head groups keep the row count even (3 kv heads x 21 positions)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=500, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=3, num_key_value_heads=3)
    model = LlamaForCausalLM(config).eval()
    cache = KVCache(model, "quantized-int4", 1)
    cache.sync(list(range(21)))
    cache.step([7])
    counts = kv_quant.cache_bytes(cache.cache)
    geo = kv_quant.geometry(config, torch.float32)
    assert (counts.positions, counts.quantized_positions) == (22, 22)
    assert counts.total == kv_quant.expected_bytes(geo, "quantized-int4", counts)


# --- the self-kv drafters -----------------------------------------------------------------------------
@pytest.mark.parametrize("drafter", ["self-kv8", "self-kv4"])
def test_greedy_self_kv_speculative_equals_target_greedy(tiny_lm, drafter):
    config = DecodingConfig(strategy="speculative", temperature=0.0, max_new_tokens=24, top_n=1, drafter=drafter,
                            num_draft_tokens=4, kv_residual_length=2)
    trace = runner.run(RunRequest(tiny_lm, "Once upon a time there was", config, registry=ModelRegistry(capacity=1)))
    greedy = runner.run(RunRequest(tiny_lm, "Once upon a time there was", config.replace(strategy="greedy")))
    assert trace.generated_token_ids == greedy.generated_token_ids
    assert trace.summary["drafter"].endswith(f"({kv_quant.SELF_KV_DRAFTERS[drafter]} KV)")
    assert trace.summary["acceptance_rate"] > 0.5  # the target drafting for itself agrees with itself mostly


@pytest.mark.slow
def test_self_kv4_speculative_sampling_keeps_the_target_distribution(tiny_lm):
    # The exact rule makes the drafter irrelevant to the output distribution: chi-square of the first two
    # tokens over 1,000 seeded runs against the target's exact joint (test_speculative's helpers).
    import dataclasses

    from engine.strategies.speculative import ModelDrafter, rounds
    from tests.helpers.common import make_tiny_llama
    from tests.helpers.speculative import chi_square_p, exact_two_token_joint, wrap

    target = wrap(make_tiny_llama(vocab_size=8, seed=0, layers=1, hidden=32), tiny_lm, "tiny8", eos=())
    config = DecodingConfig(strategy="speculative", temperature=2.0, max_new_tokens=3, num_draft_tokens=2, top_n=3)
    joint = exact_two_token_joint(target, [3], config)
    firsts, seconds = [], []
    for seed in range(1000):
        drafter = ModelDrafter(target, "self-kv4", KVCache(target.model, "quantized-int4", 1))
        tokens = [t for r in rounds(target, [3], dataclasses.replace(config, seed=seed), drafter)
                  for t in r.emitted_token_ids]
        firsts.append(tokens[0])
        seconds.append(tokens[1])
    assert chi_square_p(torch.tensor(firsts), torch.tensor(seconds), joint) > 1e-3
