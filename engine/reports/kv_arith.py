"""The KV-cache arithmetic of real models: how much memory the cache and the weights take.

    KV cache bytes = 2 (K and V) × layers × KV heads × head dim × bytes per element × tokens × batch
    weight bytes   = parameters × bytes per parameter

Grouped-query attention (GQA: fewer KV heads than query heads) and multi-query attention (MQA: one
KV head) shrink the first line by heads / kv_heads; ``compare_attention`` sets the same model with
MHA (kv_heads = heads), its own GQA and MQA side by side.

A worked check (Llama-2-7B, fp16, MHA): 2 × 32 × 32 × 128 × 2 = 524,288 bytes ≈ 0.5 MB per token.
One lecture's worked example states ≈ 1 MB per token for these same numbers; the formula does not
give that (1 MB would need fp32, or counting K and V twice). ``LECTURE_SLIP`` says so for display.

Architectures are read from ``engine/assets/architectures.json``, each with the URL of the config.json it
was copied from.
"""

from __future__ import annotations

import json
import reprlib
from dataclasses import dataclass
from pathlib import Path

ARCHITECTURES_FILE = Path(__file__).resolve().parents[1] / "assets" / "architectures.json"  # engine/assets
# bytes per element / parameter; int4 is half a byte (packed two per byte; scales not counted)
DTYPE_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}
GB = 1e9  # decimal gigabytes, as the lecture's "140 GB" uses
LECTURE_SLIP = (
    "Llama-2-7B in fp16: 2 × 32 layers × 32 KV heads × 128 head dim × 2 bytes = 524,288 bytes ≈ 0.5 MB per token. "
    "One lecture's worked example says ≈ 1 MB per token for the same numbers: that would need 4 bytes per value "
    "(fp32), not fp16's 2."
)
MAX_LAYERS, MAX_HEADS, MAX_HEAD_DIM = 1_000, 1_024, 4_096
MAX_TOKENS, MAX_BATCH, MAX_PARAMETERS = 10_000_000, 100_000, 10**14
ECHO_CHARS = 200  # an error message shows at most this much of the value it refuses
_ECHO = reprlib.Repr()
_ECHO.maxstring = _ECHO.maxother = _ECHO.maxlong = ECHO_CHARS - 40
_ECHO.maxlevel, _ECHO.maxlist, _ECHO.maxtuple, _ECHO.maxdict, _ECHO.maxset = 3, 6, 6, 6, 6


def shown(value: object) -> str:
    """``repr(value)`` for an error message, cut to about ECHO_CHARS characters (a 1 MB string, a
    deeply nested list) with the length it had when that was cut."""
    text = _ECHO.repr(value)
    if isinstance(value, str) and len(value) > ECHO_CHARS - 40:
        text += f" ({len(value):,} characters)"
    return text[:ECHO_CHARS]


@dataclass(frozen=True)
class Architecture:
    """What the calculator needs of a model (see engine/assets/architectures.json)."""

    name: str
    layers: int
    heads: int  # query heads
    kv_heads: int
    head_dim: int
    parameters: int
    source: str = ""  # where the values come from
    hidden_size: int = 0
    max_context: int = 0

    def __post_init__(self) -> None:
        for key, high in (("layers", MAX_LAYERS), ("heads", MAX_HEADS), ("kv_heads", MAX_HEADS),
                          ("head_dim", MAX_HEAD_DIM), ("parameters", MAX_PARAMETERS)):
            _check_count(key, getattr(self, key), high)
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads: {self.kv_heads} must divide heads={self.heads} (each KV head serves a group)")

    @property
    def attention(self) -> str:
        """mha | gqa | mqa."""
        return "mha" if self.kv_heads == self.heads else "mqa" if self.kv_heads == 1 else "gqa"


def _check_count(key: str, value: object, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
        raise ValueError(f"{key}: expected an integer in [1, {high:,}], got {shown(value)}")
    return value


def dtype_bytes(dtype: str, key: str = "dtype") -> float:
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise ValueError(f"{key}: expected one of {' | '.join(DTYPE_BYTES)}, got {shown(dtype)}")
    return DTYPE_BYTES[dtype]


def load_architectures(path: Path = ARCHITECTURES_FILE) -> dict[str, Architecture]:
    """The well-known architectures by name, in file order."""
    data = json.loads(path.read_text(encoding="utf-8"))
    return {a["name"]: Architecture(**a) for a in data["architectures"]}


def kv_bytes_per_token(arch: Architecture, dtype: str = "fp16") -> float:
    """2 × layers × KV heads × head dim × bytes per element."""
    return 2 * arch.layers * arch.kv_heads * arch.head_dim * dtype_bytes(dtype)


def kv_cache_bytes(arch: Architecture, tokens: int, batch: int = 1, dtype: str = "fp16") -> float:
    """The whole cache: bytes per token × tokens × batch."""
    _check_count("tokens", tokens, MAX_TOKENS)
    _check_count("batch", batch, MAX_BATCH)
    return kv_bytes_per_token(arch, dtype) * tokens * batch


def weight_bytes(parameters: int, dtype: str = "fp16") -> float:
    """parameters × bytes per parameter (70e9 in fp16 = 140 GB; in int4 = 35 GB)."""
    _check_count("parameters", parameters, MAX_PARAMETERS)
    return parameters * dtype_bytes(dtype, "weights_dtype")


@dataclass(frozen=True)
class MemoryEstimate:
    """One row of the calculator."""

    name: str
    attention: str  # mha | gqa | mqa
    kv_heads: int
    kv_bytes_per_token: float
    kv_cache_gb: float
    weights_gb: float
    total_gb: float


def estimate(arch: Architecture, tokens: int, batch: int = 1, kv_dtype: str = "fp16",
             weights_dtype: str = "fp16") -> MemoryEstimate:
    kv = kv_cache_bytes(arch, tokens, batch, kv_dtype)
    weights = weight_bytes(arch.parameters, weights_dtype)
    return MemoryEstimate(arch.name, arch.attention, arch.kv_heads, kv_bytes_per_token(arch, kv_dtype), kv / GB,
                          weights / GB, (kv + weights) / GB)


def compare_attention(arch: Architecture, tokens: int, batch: int = 1, kv_dtype: str = "fp16",
                      weights_dtype: str = "fp16") -> list[MemoryEstimate]:
    """The same model as MHA (kv_heads = heads), as it is (when GQA), and as MQA (kv_heads = 1).
    Only the KV cache changes: the weights are kept as the real model's (an approximation for the
    MHA / MQA variants, whose K and V projections would be larger / smaller)."""
    variants = [_with_kv_heads(arch, arch.heads, "MHA")]
    if arch.attention == "gqa":
        variants.append(arch)
    variants.append(_with_kv_heads(arch, 1, "MQA"))
    return [estimate(v, tokens, batch, kv_dtype, weights_dtype) for v in variants]


def _with_kv_heads(arch: Architecture, kv_heads: int, label: str) -> Architecture:
    if arch.kv_heads == kv_heads:
        return arch
    return Architecture(f"{arch.name} as {label}", arch.layers, arch.heads, kv_heads, arch.head_dim, arch.parameters,
                        arch.source, arch.hidden_size, arch.max_context)
