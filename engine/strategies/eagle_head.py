"""The EAGLE-3 draft head: it predicts the target's next token from the target's own features.

At sequence position i the head reads the token x_{i+1} (its embedding, the target's own, frozen)
and a feature f of position i: on the target's positions, the target's hidden states after a low, a
middle and a high layer (``layers``: indices into transformers' ``hidden_states``) fused by one
linear layer ``fc`` [3H -> H]; on the head's own draft positions, the head's own output there (EAGLE's
autoregression over features). ONE Llama decoder layer in vLLM's EAGLE-3 wiring
(``Eagle3LlamaForCausalLM``, vllm/model_executor/models/llama_eagle3.py): its attention reads
``[input_norm(embedding), hidden_norm(f)]`` through q/k/v of width 2H, the feature f is the residual,
then the layer's MLP; the output g_i (before the final norm) is the next draft position's feature, and
``norm(g_i)`` read out over a draft vocabulary trimmed by frequency (``d2t``: draft index -> target
token id; ``t2d``: target id -> in the draft vocabulary) with the target's own LM-head rows (frozen,
never stored) predicts x_{i+2}. The same wiring as vLLM's makes its export a renaming
(engine.strategies.eagle_export), so vLLM serves this head exactly.

Saved as safetensors (float16; no pickle) beside a JSON config and a ``.sha256``; ``load_head``
checks the checksum and that the head fits the model.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from engine.base.seam import Model
from engine.config import ConfigError
from engine.strategies.medusa import ASSETS, slug


def feature_layers(num_layers: int) -> tuple[int, int, int]:
    """Low, middle, high: indices into ``hidden_states`` (0 = the embeddings) of an N-layer model
    (EAGLE-3's choice: after layer 2, the middle one and N - 2)."""
    return min(2, num_layers), num_layers // 2, max(num_layers - 2, 0)


LAYOUT = "vllm-eagle3"


@dataclass
class HeadConfig:
    """What a head is for and its shape (the JSON beside the weights)."""

    base_model: str
    hidden: int
    vocab_size: int  # the target's
    draft_vocab: int
    layers: tuple[int, int, int]
    meta: dict = field(default_factory=dict)  # how it was trained (command, settings, accuracy)
    layout: str = LAYOUT  # the layer's wiring; a head of another layout is refused, not misread


class EagleHead(nn.Module):
    """Fusion, one decoder layer (q/k/v over [normed embedding, normed feature]), a norm; the
    read-out rows come from the target (``bind``)."""

    d2t: torch.Tensor  # buffers
    t2d: torch.Tensor

    def __init__(self, target_config, head: HeadConfig, d2t: torch.Tensor):
        super().__init__()
        h = head.hidden
        self.head = head
        self.fc = nn.Linear(3 * h, h, bias=False)
        config = type(target_config).from_dict(target_config.to_dict())
        config._attn_implementation = "sdpa"
        self.layer = LlamaDecoderLayer(config, layer_idx=0)
        attn = self.layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):  # vLLM's first EAGLE-3 layer: q/k/v read 2H
            old = getattr(attn, name)
            setattr(attn, name, nn.Linear(2 * h, old.out_features, bias=old.bias is not None))
        self.hidden_norm = LlamaRMSNorm(h, eps=getattr(config, "rms_norm_eps", 1e-6))
        self.norm = LlamaRMSNorm(h, eps=getattr(config, "rms_norm_eps", 1e-6))
        self.rotary = LlamaRotaryEmbedding(config)
        self.register_buffer("d2t", d2t.long(), persistent=False)
        t2d = torch.zeros(head.vocab_size, dtype=torch.bool)
        t2d[d2t.long()] = True
        self.register_buffer("t2d", t2d, persistent=False)
        self.embed: torch.Tensor | None = None  # [V, H] the target's embeddings (bind)
        self.rows: torch.Tensor | None = None  # [V', H] the target's LM-head rows of d2t (bind)

    def bind(self, target: Any) -> "EagleHead":  # a transformers causal LM
        """Take the target's embeddings and its LM-head rows of the draft vocabulary (frozen)."""
        with torch.inference_mode(False), torch.no_grad():
            self.embed = target.get_input_embeddings().weight.detach()
            self.rows = target.get_output_embeddings().weight.detach()[self.d2t.to(self.embed.device)].contiguous()
        return self

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """[..., 3H] (low, middle, high concatenated) -> [..., H]."""
        return self.fc(features)

    def forward(self, tokens: torch.Tensor, feature: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None, cache=None) -> torch.Tensor:
        """tokens [B, T], fused features [B, T, H], positions [B, T], an additive mask [B, 1, T, K]
        (None: causal over the fed rows alone) -> draft states g [B, T, H] (before the norm)."""
        assert self.embed is not None, "bind the head to its target first"
        layer = self.layer
        embedded = layer.input_layernorm(self.embed[tokens].to(feature.dtype))
        x = torch.cat([embedded, self.hidden_norm(feature)], dim=-1)
        if mask is None:
            mask = causal_mask(tokens.shape[1], x.dtype)
        attended, _ = layer.self_attn(x, position_embeddings=self.rotary(feature, positions), attention_mask=mask,
                                      cache=cache)
        state = feature + attended  # the feature is the residual (vLLM's norm after the residual)
        return state + layer.mlp(layer.post_attention_layernorm(state))

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        """Draft states [..., H] -> logits over the draft vocabulary [..., V'] (float32)."""
        assert self.rows is not None, "bind the head to its target first"
        normed = self.norm(states)
        flat = normed.reshape(-1, normed.shape[-1]).to(self.rows.dtype)
        return (self.rows @ flat.T).T.reshape(*normed.shape[:-1], self.rows.shape[0]).float()


def causal_mask(size: int, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, T, T] additive causal mask."""
    allowed = torch.ones(size, size, dtype=torch.bool).tril()
    return torch.zeros(size, size, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


def head_path(model_name: str) -> Path:
    return ASSETS / f"eagle-{slug(model_name)}.safetensors"


_TRAINED = ("fc.weight", "hidden_norm.weight", "norm.weight")


def save_head(head: EagleHead, path: Path) -> str:
    """Write the head (float16 safetensors), its JSON config and a ``.sha256`` naming the digests of
    both. All three go to temporary names first and are renamed into place, the checksum last: an
    interrupted save leaves the old files (or, between renames, files whose checksum no longer
    matches, which ``load_head`` refuses), never a half-written one. Returns the weights' digest."""
    tensors = {name: t.detach().to(torch.float16).cpu().contiguous() for name, t in head.state_dict().items()
               if name.startswith("layer.") or name in _TRAINED}
    tensors["d2t"] = head.d2t.to(torch.int32).cpu().contiguous()
    config = json.dumps(asdict(head.head), indent=2, allow_nan=False)
    temps: list[str] = []
    try:
        weights = _temp(path, temps, lambda f: save_file(tensors, f))
        meta = _temp(path.with_suffix(".json"), temps, lambda f: Path(f).write_text(config))
        digest, meta_digest = _sha(Path(weights)), _sha(Path(meta))
        sums = _temp(path.with_suffix(".sha256"), temps, lambda f: Path(f).write_text(
            f"{digest}  {path.name}\n{meta_digest}  {path.with_suffix('.json').name}\n"))
        for temp, final in ((weights, path), (meta, path.with_suffix(".json")), (sums, path.with_suffix(".sha256"))):
            os.replace(temp, final)
    finally:
        for temp in temps:
            if os.path.exists(temp):
                os.unlink(temp)
    return digest


def _temp(path: Path, temps: list[str], write) -> str:
    handle, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    os.close(handle)
    temps.append(temp)
    write(temp)
    os.chmod(temp, 0o644)  # mkstemp's 0600 would keep the shipped files from other readers
    return temp


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _checksums_match(path: Path) -> bool:
    """Every file the ``.sha256`` names (the weights first; the JSON too since heads record it)
    exists beside it with that digest."""
    sums = path.with_suffix(".sha256")
    if not sums.is_file():
        return False
    lines = [line.split() for line in sums.read_text().splitlines() if line.strip()]
    if not lines or lines[0][-1] != path.name:
        return False
    return all(len(line) == 2 and (path.parent / line[1]).is_file() and _sha(path.parent / line[1]) == line[0]
               for line in lines)


def load_head(lm: Model, path: Path | None = None) -> EagleHead:
    """The trained head for ``lm`` (checksum verified), bound to it, in its dtype and device."""
    path = path or head_path(lm.name)
    if not path.is_file():
        raise ConfigError("strategy", f"eagle: no trained head for {lm.name} (expected {path.name}); "
                                      f"train one with python -m engine.strategies.eagle_train --model <source>")
    if not _checksums_match(path):
        raise ConfigError("strategy", f"eagle: {path.name} does not match its checksum; retrain or restore it")
    raw = json.loads(path.with_suffix(".json").read_text())
    if raw.get("layout") != LAYOUT:
        layout = raw.get("layout", "in_proj (the first)")
        raise ConfigError("strategy", f"eagle: {path.name} is a head of layout {layout!r}, not {LAYOUT!r}; "
                                      f"retrain it with python -m engine.strategies.eagle_train")
    config = HeadConfig(**{**raw, "layers": tuple(raw["layers"])})
    target = lm.model.config
    if config.hidden != int(target.hidden_size) or config.vocab_size != lm.vocab_size:
        raise ConfigError("strategy", f"eagle: {path.name} is for hidden size {config.hidden} and vocabulary "
                                      f"{config.vocab_size}; {lm.name} has {target.hidden_size} and {lm.vocab_size}")
    tensors = load_file(str(path))
    d2t = tensors.pop("d2t").long()
    head = EagleHead(target, config, d2t)
    head.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=True)
    head = head.to(device=lm.device, dtype=lm.dtype).eval().requires_grad_(False)
    return head.bind(lm.model)
