"""4-bit weight-only checkpoints made here the way the field makes them (issue #40): round to nearest
(RTN), GPTQ and AWQ, W4A16 at two group sizes, written by llm-compressor in the compressed-tensors
format (deploy/quantize.sh makes them once, in its own cached environment) and loaded here.

The checkpoints store each Linear weight as packed 4-bit integers (``weight_packed``: int32, eight
values per word, the first in the lowest bits, each stored as q + 8), one float scale per group of
``group_size`` input channels (``weight_scale`` [out, in / group]) and the shape
(``weight_shape``); symmetric, so w = q × scale with q in [-8, 7]. There is no 4-bit matrix kernel
for the CPU here, so ``load_checkpoint`` dequantizes every weight once, at load, to the model's
float dtype: the numbers the model computes with are exactly the 4-bit values, but the memory in
use is the float model's (``packed_bytes`` says what a 4-bit kernel would keep).

Group size 128, the papers' setting, cannot be used on the embedded model: its hidden size is 576
= 4.5 × 128, so 128 does not divide the input dimension of q/k/v/o/gate/up (576) and the groups
would straddle rows; 64 (9 groups) and 32 (18 groups) divide 576 and 1536 (down_proj) exactly.

``python -m deploy.quantize_plan`` prints what deploy/quantize.sh needs (``plan``: one ``KEY=value``
a line): the model directory, the cache folder, the calibration sets and the variants to make.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from engine.settings import cache_root

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "quant"  # engine/assets/quant
CALIBRATION_SETS = {"prose": ASSETS / "calibration-prose.txt", "code": ASSETS / "calibration-code.txt"}
HELDOUT = ASSETS / "heldout.txt"
# What deploy/quantize.py is asked to do; any change here (or in a calibration file) names a new cache folder.
RECIPE: dict[str, Any] = {"format": "pack-quantized", "bits": 4, "symmetric": True, "max_tokens": 64, "gptq_dampening": 0.1,
          "gptq_actorder": "static", "awq_n_grid": 10, "llmcompressor": "0.14.0.1", "version": 1}
QUANTIZE_HINT = "run `make quantize` (deploy/quantize.sh, a few minutes the first time)"


@dataclass(frozen=True)
class WeightMethod:
    """One checkpoint variant: its method, group size and calibration set."""

    name: str  # e.g. gptq-g64, awq-g64-code
    method: str  # rtn | gptq | awq
    group_size: int
    calibration: str  # a CALIBRATION_SETS key ("" for rtn: it reads no data)
    about: str


def _variant(method: str, group: int, calibration: str = "prose") -> WeightMethod:
    about = {"rtn": "round to nearest, no calibration data",
             "gptq": "GPTQ: column-by-column rounding that corrects the next columns with the Hessian of the inputs",
             "awq": "AWQ: scales the input channels with large activations up before rounding, folds the scale back"}
    suffix = "" if calibration == "prose" else f"-{calibration}"
    data = "" if method == "rtn" else f"; calibrated on {calibration}"
    return WeightMethod(f"{method}-g{group}{suffix}", method, group, "" if method == "rtn" else calibration,
                        f"{about[method]} (4-bit, group {group}{data})")


WEIGHT_METHODS = {m.name: m for m in (
    _variant("rtn", 64), _variant("gptq", 64), _variant("awq", 64),
    _variant("rtn", 32), _variant("gptq", 32), _variant("awq", 32),
    _variant("gptq", 64, "code"), _variant("awq", 64, "code"),
)}


def is_checkpoint_variant(quantization: str) -> bool:
    return quantization in WEIGHT_METHODS


@lru_cache(maxsize=1)
def recipe_key() -> str:
    """A short hash of the recipe and the calibration files: the cache folder's name."""
    digest = hashlib.sha256(json.dumps(RECIPE, sort_keys=True).encode())
    for name in sorted(CALIBRATION_SETS):
        digest.update(name.encode() + CALIBRATION_SETS[name].read_bytes())
    return digest.hexdigest()[:12]


def checkpoints_dir(model_dir: Path) -> Path:
    """The cache folder holding one folder per variant of the model in ``model_dir``."""
    return cache_root() / f"w4-{model_dir.name}-{recipe_key()}"


def checkpoint_path(model_dir: Path, name: str) -> Path:
    return checkpoints_dir(model_dir) / name


def missing_message(name: str) -> str:
    return f"quantization: the {name} checkpoint is not made yet; {QUANTIZE_HINT}"


# --- the format: unpack and dequantize ------------------------------------------------------------
def unpack_int4(packed: torch.Tensor, columns: int) -> torch.Tensor:
    """int32 [rows, ceil(columns / 8)] -> int8 [rows, columns] in [-8, 7]: value k of a row sits in
    bits 4k..4k+3 of the stream (word k // 8, bits 4 (k % 8)), stored as q + 8. Read as
    little-endian bytes, byte b holds value 2b in its low nibble and value 2b + 1 in its high one."""
    if sys.byteorder != "little":
        raise RuntimeError("unpack_int4 reads the int32 words as little-endian bytes")
    data = packed.contiguous().view(torch.uint8)  # [rows, 4 × words]
    nibbles = torch.stack((data & 0xF, data >> 4), dim=-1).reshape(packed.shape[0], -1)  # [rows, 8 × words]
    return nibbles[:, :columns].to(torch.int8) - 8


def dequantize(packed: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int],
               g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 weight [out, in] = q × the scale of each input channel's group (``g_idx[j]``:
    column j's group when GPTQ's activation order reordered the groups, else j // group size)."""
    rows, columns = shape
    q = unpack_int4(packed, columns)  # [out, in]
    groups = scale.shape[1]
    if g_idx is None and columns % groups == 0:  # contiguous groups: no gather
        grouped = q.view(rows, groups, columns // groups).float() * scale.float()[:, :, None]
        return grouped.view(rows, columns)
    index = g_idx.long() if g_idx is not None else torch.arange(columns, device=q.device) // -(-columns // groups)
    return q.float() * scale.float()[:, index]


@dataclass(frozen=True)
class QuantizedLayout:
    """What a checkpoint's quantization_config says, checked: only what ``dequantize`` reads."""

    group_size: int
    symmetric: bool
    ignore: tuple[str, ...]


def read_layout(config: dict, where: str) -> QuantizedLayout:
    """The checkpoint's scheme, or ValueError naming the field that this loader cannot read."""
    qc = config.get("quantization_config") or {}
    if qc.get("quant_method") != "compressed-tensors" or qc.get("format") != "pack-quantized":
        raise ValueError(f"{where}: expected a compressed-tensors pack-quantized checkpoint, got "
                         f"{qc.get('quant_method')!r} / {qc.get('format')!r}")
    groups = list((qc.get("config_groups") or {}).values())
    weights = groups[0].get("weights") if len(groups) == 1 else None
    if not weights or weights.get("num_bits") != 4 or weights.get("type") != "int" or weights.get("strategy") != "group":
        raise ValueError(f"{where}: config_groups: expected one 4-bit integer group-wise weight scheme, got {groups!r:.200}")
    if not weights.get("symmetric") or groups[0].get("input_activations"):
        raise ValueError(f"{where}: expected symmetric 4-bit weights and float activations (W4A16), got "
                         f"symmetric={weights.get('symmetric')!r}, input_activations={groups[0].get('input_activations')!r:.80}")
    return QuantizedLayout(int(weights["group_size"]), bool(weights.get("symmetric")), tuple(qc.get("ignore") or ()))


def dense_state_dict(path: Path) -> tuple[dict[str, torch.Tensor], int]:
    """The checkpoint's tensors with every packed weight dequantized to float32, and how many bytes
    the packed weights and their scales take (what a 4-bit kernel would keep in memory)."""
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as fh:
            tensors.update({k: fh.get_tensor(k) for k in fh.keys()})
    packed_bytes = 0
    for prefix in [k.removesuffix(".weight_packed") for k in tensors if k.endswith(".weight_packed")]:
        parts = {s: tensors.pop(f"{prefix}.{s}", None) for s in ("weight_packed", "weight_scale", "weight_shape",
                                                                  "weight_g_idx")}
        packed_bytes += sum(t.numel() * t.element_size() for t in parts.values() if t is not None)
        packed, scale, shape = parts["weight_packed"], parts["weight_scale"], parts["weight_shape"]
        if packed is None or scale is None or shape is None:  # a TypeError would escape the loader's one line
            raise ValueError(f"{prefix}: a packed weight without its weight_scale or weight_shape")
        rows, cols = (int(v) for v in shape)  # a shape of another length: ValueError, one line
        tensors[f"{prefix}.weight"] = dequantize(packed, scale, (rows, cols), parts["weight_g_idx"])
    return tensors, packed_bytes


def load_checkpoint(path: Path, dtype: torch.dtype) -> tuple[Any, Any, int]:
    """(tokenizer, model, packed bytes) of a checkpoint folder: the model built from its config and
    its tensors, every 4-bit weight dequantized (``dense_state_dict``), in ``dtype``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.initialization import no_init_weights

    raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    read_layout(raw, path.name)
    config = AutoConfig.from_pretrained(path, trust_remote_code=False, local_files_only=True)
    del config.quantization_config  # the model is built as the float model it computes as
    tensors, packed_bytes = dense_state_dict(path)
    with no_init_weights():  # every tensor is overwritten below: random initialisation would be wasted time
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    expected = set(model.state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or extra:
        raise ValueError(f"{path.name}: tensors do not match the config: missing {missing[:3]}, unexpected {extra[:3]}")
    model.load_state_dict(tensors, strict=False, assign=True)
    model.tie_weights()
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False, local_files_only=True)
    return tokenizer, model.to(dtype), packed_bytes


def folder_bytes(path: Path) -> int:
    """Bytes of the checkpoint's weight files on disk."""
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def made_variants(model_dir: Path) -> list[str]:
    """The variants whose checkpoints are in the cache (complete: each is renamed into place whole)."""
    return [n for n in WEIGHT_METHODS if (checkpoint_path(model_dir, n) / "config.json").is_file()]


def checkpoint_meta(model_dir: Path, name: str) -> dict:
    """What deploy/quantize.py recorded about a checkpoint (recipe, calibration, seconds)."""
    path = checkpoint_path(model_dir, name) / "quantize.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def plan(model_dir: Path) -> dict[str, str]:
    """What deploy/quantize.sh runs for the model in ``model_dir`` (the embedded model's converted
    directory): the cache folder, the calibration sets and the variants, with the recipe's settings."""
    return {"MODEL": str(model_dir), "OUT": str(checkpoints_dir(model_dir)),
            "CALIBRATION": " ".join(f"{k}={v}" for k, v in CALIBRATION_SETS.items()),
            "VARIANTS": " ".join(WEIGHT_METHODS), "MAX_TOKENS": str(RECIPE["max_tokens"]),
            "DAMPENING": str(RECIPE["gptq_dampening"]), "ACTORDER": str(RECIPE["gptq_actorder"]),
            "N_GRID": str(RECIPE["awq_n_grid"])}

