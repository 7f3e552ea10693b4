"""Model loading: the embedded cache, bitsandbytes quantization on CPU, clear errors."""

import pytest
import torch

from engine.backends.local import (ModelLoadError, ModelSpec, PackedLinear, embedded_model_dir, gguf_path, load_model,
                                   pack_linears, plain_products)
from engine.backends.registry import ModelRegistry


def test_embedded_gguf_is_found_and_converted_once():
    assert gguf_path().suffix == ".gguf"
    folder = embedded_model_dir()
    assert (folder / "model.safetensors").exists() and (folder / "config.json").exists()
    assert embedded_model_dir() == folder  # keyed by size + hash: no second conversion
    assert folder.name.startswith(f"smollm2-135m-instruct-{gguf_path().stat().st_size}-")
    assert folder.name.endswith("-layout2")  # a new layout is a new folder: an older conversion is never trusted


def test_the_converted_folder_holds_the_tied_embedding_under_both_names():
    """Issue #37: vLLM reads ``model.embed_tokens.weight`` (and skips ``lm_head.weight`` when tied); a
    folder without it served a uniform distribution. Both names are in the file, the same tensor."""
    import json

    from safetensors import safe_open

    folder = embedded_model_dir()
    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        assert {"model.embed_tokens.weight", "lm_head.weight"} <= set(weights.keys())
        embed, head = weights.get_tensor("model.embed_tokens.weight"), weights.get_tensor("lm_head.weight")
    assert embed.shape == (49152, 576) and embed.dtype == torch.float32 and torch.equal(embed, head)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True


@pytest.mark.slow
def test_transformers_reads_the_converted_folder_with_the_logits_of_before(embedded, tmp_path):
    """The folder as the conversion wrote it before (one name, no architectures: tests/data/vllm/record.py's
    tied_only_folder) and the GGUF itself give transformers the very logits the new folder gives."""
    from transformers import AutoModelForCausalLM

    from tests.data.vllm.record import tied_only_folder

    ids = torch.tensor([embedded.encode("The capital of France is")])
    with torch.no_grad(), plain_products(embedded.model):  # F.linear on both sides, so bit for bit
        now = embedded.model(ids).logits
        old = AutoModelForCausalLM.from_pretrained(tied_only_folder(embedded_model_dir(), tmp_path / "old"),
                                                   dtype=torch.float32)
        from_gguf = AutoModelForCausalLM.from_pretrained(gguf_path().parent, gguf_file=gguf_path().name,
                                                         dtype=torch.float32)
        assert torch.equal(old(ids).logits, now) and torch.equal(from_gguf(ids).logits, now)


@pytest.mark.slow
def test_embedded_model_facts(embedded):
    cfg = embedded.model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert embedded.vocab_size == 49152 and embedded.has_chat_template
    assert embedded.dtype == torch.float32 and embedded.device.type == "cpu"


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["int8", "nf4"])
def test_bitsandbytes_quantization_shrinks_memory_and_still_generates(registry, embedded, quantization):
    from engine.strategies import decode
    from engine.config import DecodingConfig

    lm = registry.get(ModelSpec(quantization=quantization))
    assert lm.quantization == quantization
    assert lm.memory_bytes < 0.5 * embedded.memory_bytes
    trace = decode.run(lm, "The capital of France is", DecodingConfig(strategy="greedy", max_new_tokens=4))
    assert "Paris" in trace.text


def test_offline_hub_id_gives_clear_message(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # read at import time, so set the constant
    with pytest.raises(ModelLoadError, match="not a local model directory.*Hub"):
        load_model(ModelSpec(source="someone/definitely-not-cached-model"))


def test_directory_without_config_and_bad_spec(tmp_path):
    with pytest.raises(ModelLoadError, match="not a local model directory"):  # the same answer for every path
        load_model(ModelSpec(source=str(tmp_path)))
    with pytest.raises(ModelLoadError, match="quantization"):
        ModelSpec(quantization="int4")


def test_quantized_layer_detector_on_real_models(tiny_lm):
    from engine.backends.local import _has_quantized_layers

    assert not _has_quantized_layers(tiny_lm.model)  # plain float Llama: nothing bitsandbytes replaced


@pytest.mark.slow
def test_quantized_layer_detector_sees_bitsandbytes_layers(registry):
    from engine.backends.local import _has_quantized_layers

    assert _has_quantized_layers(registry.get(ModelSpec(quantization="nf4")).model)


def test_unloadable_checkpoint_gives_one_clear_error(tmp_path):
    import shutil

    src = embedded_model_dir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, tmp_path / name)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match="Could not int8-quantize"):
        load_model(ModelSpec(source=str(tmp_path), quantization="int8"))


def test_a_forked_child_gets_a_free_registry_lock():
    """ZeroGPU forks a worker per request: a registry lock held by another thread at the fork (a
    model loading) must not stay held in the child."""
    import os

    registry = ModelRegistry()
    registry._lock.acquire()  # another thread is loading a model right now
    try:
        pid = os.fork()
        if pid == 0:  # the child: the lock must be free
            os._exit(0 if registry._lock.acquire(timeout=5) else 1)
        _, status = os.waitpid(pid, 0)
    finally:
        registry._lock.release()
    assert os.WEXITSTATUS(status) == 0


def test_startup_examples_are_off_on_zerogpu(monkeypatch):
    from playground import examples

    monkeypatch.delenv("DP_EXAMPLES", raising=False)
    monkeypatch.delenv("SPACES_ZERO_GPU", raising=False)
    assert examples.enabled()
    monkeypatch.setenv("SPACES_ZERO_GPU", "true")
    assert not examples.enabled()


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal within float32 rounding of another summation order: every entry within 1e-5 of the largest."""
    if a.shape != b.shape or not b.numel():
        return a.shape == b.shape
    return bool((a - b).abs().max() <= 1e-5 * b.abs().max().clamp(min=1.0))


def test_packed_linears_give_the_plain_product_within_rounding(embedded):
    """engine.backends.local.pack_linears: every Linear of the embedded model (the head too) reads a oneDNN-packed
    copy; on real hidden states, 1 to 33 rows and a row's last positions, its product is F.linear's within
    float rounding, and F.linear's bit for bit under plain_products(model); the head still shares the embedding's
    weight."""
    model = embedded.model
    head = model.get_output_embeddings()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 30 * 7 + 1 and all(type(m) is PackedLinear for m in linears)  # packed at load
    assert embedded.kernel_bytes == sum(m.weight.numel() * 4 for m in linears)
    assert head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()  # still tied
    ids = torch.tensor([embedded.encode("The history of the printing press begins with woodblocks, movable type "
                                        "in China and Korea, and then Gutenberg's press in Mainz, whose books "
                                        "spread across Europe within fifty years and changed how people read.")])
    with torch.inference_mode():
        hidden = model.model(input_ids=ids).last_hidden_state[0]  # [L, 576]
        assert hidden.shape[0] >= 33
        for rows in (1, 2, 3, 4, 8, 16, 32, 33):
            x = hidden[:rows].unsqueeze(1)  # [rows, 1, 576], as a batched decode step feeds it
            plain = torch.nn.functional.linear(x, head.weight)
            assert _close(head(x), plain), rows
            with plain_products(model):
                assert type(head) is torch.nn.Linear and torch.equal(head(x), plain), rows
            assert type(head) is PackedLinear
        x = hidden[:5].unsqueeze(0)  # [1, 5, 576]: one row's last positions (speculative verification)
        assert _close(head(x), torch.nn.functional.linear(x, head.weight))
        packed = model(ids).logits[0]
        with plain_products(model):
            plain = model(ids).logits[0]
    assert (packed - plain).abs().max() < 1e-3 and torch.equal(packed.argmax(-1), plain.argmax(-1))


def test_linears_left_alone_where_packing_does_not_apply():
    half = torch.nn.Sequential(torch.nn.Linear(8, 4096, bias=False).to(torch.bfloat16))
    assert pack_linears(half) == 0 and type(half[0]) is torch.nn.Linear
    subclass = type("Other", (torch.nn.Linear,), {})(8, 16)  # a quantized or custom layer: not a plain Linear
    assert pack_linears(torch.nn.Sequential(subclass)) == 0 and type(subclass).__name__ == "Other"


def test_a_packed_linear_with_a_bias_any_shape_a_changed_weight_and_autograd():
    torch.manual_seed(0)
    head = torch.nn.Linear(64, 5000)
    holder = torch.nn.Sequential(head)
    assert pack_linears(holder) == 5000 * 64 * 4 and type(head) is PackedLinear
    with torch.inference_mode():
        for shape in ((1, 64), (4, 1, 64), (2, 3, 64), (40, 64), (0, 64)):
            x = torch.randn(*shape)
            assert _close(head(x), torch.nn.functional.linear(x, head.weight, head.bias)), shape
        x = torch.randn(3, 64, dtype=torch.float64)  # another dtype: the plain product
        assert torch.equal(head.double()(x), torch.nn.functional.linear(x, head.weight, head.bias))
    head.float()  # replaced weights: packed again before the next product
    x = torch.randn(4, 64)
    with torch.no_grad():
        head.weight.mul_(2.0)  # changed in place: packed again
        assert _close(head(x), torch.nn.functional.linear(x, head.weight, head.bias))
        head.weight = torch.nn.Parameter(torch.randn(5000, 64))
        assert _close(head(x), torch.nn.functional.linear(x, head.weight, head.bias))
        for _ in range(3):  # new storage under the same Parameter, twice before a product: never a stale copy
            head.weight.data = torch.randn(5000, 64)
            head.weight.data = torch.randn(5000, 64)
            assert _close(head(x), torch.nn.functional.linear(x, head.weight, head.bias))
    x.requires_grad_(True)  # a gradient wanted (Medusa training through the head): F.linear, bit for bit
    out = head(x)
    assert out.grad_fn is not None and torch.equal(out, torch.nn.functional.linear(x, head.weight, head.bias))


def test_a_packed_model_copies_and_packs_weights_made_in_inference_mode():
    """copy.deepcopy of a packed model (tests/remote/test_vllm_quantized.py rounds its own copy to bfloat16) leaves
    the packed copies behind and packs its own; weights made in inference mode (a 4-bit checkpoint's
    dequantized tensors) are packed too."""
    import copy

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Linear(48, 16))
    assert pack_linears(model) == (32 * 48 + 48 * 16) * 4
    x = torch.randn(5, 32)
    with torch.inference_mode():
        before = model(x)
    twin = copy.deepcopy(model)
    assert type(twin[0]) is PackedLinear and "_dp_packed" not in twin[0].__dict__
    with torch.inference_mode():
        assert torch.equal(twin(x), before)
        half = twin.to(torch.bfloat16)  # another dtype: F.linear
        y = x.bfloat16()
        assert torch.equal(half(y), torch.nn.functional.linear(
            torch.nn.functional.linear(y, half[0].weight, half[0].bias), half[1].weight, half[1].bias))
    with torch.inference_mode():
        made = torch.nn.Linear(32, 48)
        made.weight = torch.nn.Parameter(torch.randn(48, 32))  # an inference tensor
    assert made.weight.is_inference()
    holder = torch.nn.Sequential(made)
    assert pack_linears(holder) == 48 * 32 * 4
    with torch.inference_mode():
        assert _close(made(x), torch.nn.functional.linear(x, made.weight, made.bias))
