"""The step loop against its oracles: an uncached recompute, transformers' generate() (greedy and
seeded sampling), reproducibility, stopping, branching, and the trace JSON schema."""

import json

import pytest
import torch

from engine.strategies import decode
from engine.cache import KVCache
from engine.config import DecodingConfig
from engine.trace import Trace


def uncached_greedy(model, prompt_ids, n):
    """The nanoGPT reference: feed the whole sequence every step."""
    ids = list(prompt_ids)
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        ids.append(int(torch.argmax(logits)))
    return ids[len(prompt_ids):]


def test_cached_decoding_equals_uncached_recompute(tiny_lm):
    prompt_ids = tiny_lm.encode("Once upon a time")
    cfg = DecodingConfig(strategy="greedy", max_new_tokens=24)
    steps = list(decode.stream(tiny_lm, prompt_ids, cfg))
    ours = [s.chosen_token_id for s in steps]
    assert ours == uncached_greedy(tiny_lm.model, prompt_ids, len(ours))


def test_cache_holds_one_position_per_token_and_prefill_is_one_forward(tiny_lm):
    prompt_ids = tiny_lm.encode("Hello there, general")
    cache = KVCache(tiny_lm.model)
    steps = list(decode.stream(tiny_lm, prompt_ids, DecodingConfig(strategy="greedy", max_new_tokens=10), cache=cache))
    assert cache.forwards == len(steps)  # prefill + one forward per token after the first
    assert cache.length == len(prompt_ids) + len(steps) - 1


def test_cache_rewind_equals_fresh_prefill(tiny_lm):
    ids = tiny_lm.encode("The quick brown fox jumps over the lazy dog")
    cache = KVCache(tiny_lm.model)
    cache.step(ids)
    cache.rewind(3)
    fresh = KVCache(tiny_lm.model)
    fresh.step(ids[:-3])
    for a, b in zip(cache.cache.layers, fresh.cache.layers):
        assert torch.allclose(a.keys, b.keys, atol=1e-6) and torch.allclose(a.values, b.values, atol=1e-6)
    assert torch.allclose(cache.sync(ids), fresh.sync(ids), atol=1e-5)


def test_seeded_sampling_reproducible_and_seed_sensitive(tiny_lm):
    cfg = DecodingConfig(strategy="sample", seed=11, max_new_tokens=16, temperature=1.3)
    ids = tiny_lm.encode("Seeds")
    a = [s.chosen_token_id for s in decode.stream(tiny_lm, ids, cfg)]
    b = [s.chosen_token_id for s in decode.stream(tiny_lm, ids, cfg)]
    c = [s.chosen_token_id for s in decode.stream(tiny_lm, ids, cfg.replace(seed=12))]
    assert a == b
    assert a != c


def test_stop_reasons(tiny_lm):
    ids = tiny_lm.encode("Stop")
    steps = list(decode.stream(tiny_lm, ids, DecodingConfig(strategy="greedy", max_new_tokens=5)))
    assert len(steps) == 5 and steps[-1].finish_reason == "max_new_tokens"
    assert all(s.finish_reason is None for s in steps[:-1])
    text = tiny_lm.decode([s.chosen_token_id for s in steps])
    stop = text[len(text) // 2:][:2] or text[-1:]
    cfg = DecodingConfig(strategy="greedy", max_new_tokens=5, stop=(stop,))
    trace = decode.run(tiny_lm, "Stop", cfg)
    assert trace.stop_reason == "stop_string" and stop not in trace.text


def test_branch_with_same_token_reproduces_and_other_token_diverges(tiny_lm):
    cfg = DecodingConfig(strategy="sample", seed=3, max_new_tokens=12, temperature=1.5)
    cache = KVCache(tiny_lm.model)
    parent = decode.run(tiny_lm, "Branching", cfg, cache=cache)
    k = 4
    same = list(decode.branch(tiny_lm, parent, k, parent.generated_token_ids[k], cache=cache))
    assert [s.chosen_token_id for s in same] == parent.generated_token_ids
    assert same[k].forced and same[k].draw is None
    other_token = next(t.token_id for t in parent.steps[k].stages[0].top if t.token_id != parent.generated_token_ids[k])
    forwards_before = cache.forwards
    other = list(decode.branch(tiny_lm, parent, k, other_token, cache=cache))
    assert [s.chosen_token_id for s in other[:k]] == parent.generated_token_ids[:k]
    assert other[k].chosen_token_id == other_token
    # the cache was rewound to the shared prefix, not rebuilt: one sync forward, then one per token
    assert cache.forwards - forwards_before == len(other) - k


def test_trace_json_schema_and_round_trip(tiny_lm):
    cfg = DecodingConfig(strategy="sample", seed=1, max_new_tokens=6, temperature=0.9, top_k=20, top_p=0.95, top_n=5)
    trace = decode.run(tiny_lm, "Schema", cfg)
    data = json.loads(trace.to_json())
    for key in ("model", "strategy", "config", "prompt", "prompt_token_ids", "text", "generated_token_ids",
                "stop_reason", "steps", "timing"):
        assert key in data
    step = data["steps"][0]
    for key in ("index", "chosen_token_id", "chosen_token", "chosen_prob", "draw", "entropy", "stages"):
        assert key in step
    assert [s["name"] for s in step["stages"]] == ["raw", "temperature", "top_k", "top_p", "final"]
    assert all(len(s["top"]) <= 5 and {"token_id", "token", "prob"} <= set(s["top"][0]) for s in step["stages"])
    assert step["stages"][2]["kept"] == 20 and step["stages"][2]["mass_removed"] > 0
    assert set(data["timing"]) >= {"ttft_ms", "tokens_per_s"}
    assert Trace.from_json(trace.to_json()) == trace


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_equals_generate_on_embedded_model(embedded, prompt):
    cfg = DecodingConfig(strategy="greedy", max_new_tokens=40)
    trace = decode.run(embedded, prompt, cfg)
    ids = torch.tensor([trace.prompt_token_ids])
    out = embedded.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=40)
    assert trace.generated_token_ids == out[0, ids.shape[1]:].tolist()
    assert len(trace.generated_token_ids) >= 32 or trace.stop_reason == "eos"


@pytest.mark.slow
def test_greedy_with_chat_template_equals_generate(embedded):
    trace = decode.run(embedded, "Name three colours.", DecodingConfig(strategy="greedy", max_new_tokens=32), chat=True)
    ids = torch.tensor([trace.prompt_token_ids])
    out = embedded.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=32)
    assert trace.generated_token_ids == out[0, ids.shape[1]:].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("knobs", [
    {"temperature": 0.8, "top_k": 40, "top_p": 0.9},
    {"temperature": 1.2, "min_p": 0.05, "repetition_penalty": 1.3},
    {"temperature": 1.0, "typical_p": 0.8, "epsilon_cutoff": 0.001, "no_repeat_ngram_size": 2},
])
def test_seeded_sampling_equals_generate_with_same_seed(embedded, knobs):
    cfg = DecodingConfig(strategy="sample", seed=42, max_new_tokens=32, **knobs)
    trace = decode.run(embedded, "The weather today", cfg)
    ids = torch.tensor([trace.prompt_token_ids])
    torch.manual_seed(42)
    out = embedded.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=32,
                                  top_k=knobs.get("top_k", 0), **{k: v for k, v in knobs.items() if k != "top_k"})
    assert trace.generated_token_ids == out[0, ids.shape[1]:].tolist()
