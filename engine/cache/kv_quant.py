"""KV cache kinds: what the cache keeps, how it is built, and how many bytes it really holds.

``kv_cache`` (a DecodingConfig knob) names the kind:

- ``dynamic``: transformers' ``DynamicCache``, every position in the model's dtype.
- ``quantized-int8`` / ``quantized-int4``: transformers' ``QuantizedCache`` with the HQQ backend
  (KIVI's layout): the most recent ``residual_length`` positions stay in the model's dtype; when that
  residual fills up, the whole cache is re-quantized into packed integers plus, per group of
  ``group_size`` values, a scale and a zero point in the model's dtype. HQQ is the backend because it
  runs on CPU and offers 8 bits (optimum-quanto's KV layer takes only 2 or 4).
- ``sliding-<N>``: a window of the last N positions (transformers keeps N - 1 and the new one), as
  sliding-window attention models do. The prompt is read in one prefill forward with full attention;
  every later token sees only the window.

The self-speculative drafters ``self-kv8`` / ``self-kv4`` (QuantSpec) are the target model itself
reading a quantized KV cache: ``speculative.make_drafter`` builds a ``ModelDrafter`` over the target
with ``KVCache(kind=SELF_KV_DRAFTERS[name])``; the target verifies with its full-precision cache.

Byte accounting reads the tensors the cache holds (packed integers, scales and zeros included) and
sets them against the formula for the layout, so a test can check one against the other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, QuantizedCache
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer, QuantizedLayer

from engine.config import check_kv_cache

BACKEND = "hqq"
# HQQ's axis 1 groups contiguous values: with a group dividing head_dim, each group is a slice of
# one head's key or value vector at one position (per-token quantization), so a position's
# quantized values do not depend on how long the cache is. (Axis 0 would stride each group across
# positions and heads.) HQQ packs 4-bit rows in pairs, so there must be an even number of groups:
# groups of half a head vector guarantee it for any number of positions.
AXIS = 1
MAX_GROUP_SIZE = 64
SELF_KV_DRAFTERS = {"self-kv8": "quantized-int8", "self-kv4": "quantized-int4"}


@dataclass(frozen=True)
class CacheKind:
    """A parsed ``kv_cache`` value: ``bits`` for the quantized kinds, ``window`` for sliding."""

    name: str
    bits: int | None = None
    window: int | None = None


def parse_kind(kind: str) -> CacheKind:
    """``dynamic`` | ``quantized-int8`` | ``quantized-int4`` | ``sliding-<N>`` (ConfigError otherwise)."""
    check_kv_cache("kv_cache", kind)
    if kind.startswith("quantized-int"):
        return CacheKind(kind, bits=int(kind.removeprefix("quantized-int")))
    if kind.startswith("sliding-"):
        return CacheKind(kind, window=int(kind.removeprefix("sliding-")))
    return CacheKind(kind)


@dataclass(frozen=True)
class KVGeometry:
    """What one cached position costs: 2 (K and V) × layers × kv_heads × head_dim values."""

    layers: int
    kv_heads: int
    head_dim: int
    bytes_per_element: int  # of the model's compute dtype

    @property
    def values_per_position(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim

    @property
    def group_size(self) -> int:
        """Quantization group: the largest power-of-two divisor of head_dim / 2, at most MAX_GROUP_SIZE
        (32 for head_dim 64, 64 for head_dim 128)."""
        return math.gcd(MAX_GROUP_SIZE, max(1, self.head_dim // 2))


def geometry(model_config: Any, dtype: torch.dtype) -> KVGeometry:
    """The KV geometry of a transformers config (its text config for multimodal ones)."""
    cfg = model_config.get_text_config(decoder=True) if hasattr(model_config, "get_text_config") else model_config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return KVGeometry(cfg.num_hidden_layers, kv_heads, head_dim, torch.empty((), dtype=dtype).element_size())


def make_cache(model_config: Any, kind: str = "dynamic", residual_length: int = 32) -> Cache:
    """A fresh transformers cache of the given kind for a model with this config."""
    parsed = parse_kind(kind)
    if parsed.bits is not None:
        geo = geometry(model_config, torch.float32)
        try:
            return QuantizedCache(BACKEND, model_config, nbits=parsed.bits, residual_length=residual_length,
                                  q_group_size=geo.group_size, axis_key=AXIS, axis_value=AXIS)
        except ValueError as exc:  # e.g. a model with sliding-window layers
            raise ValueError(f"kv_cache: {kind} is not available for this model ({exc})") from None
    if parsed.window is not None:
        layers = geometry(model_config, torch.float32).layers
        return Cache(layers=[DynamicSlidingWindowLayer(sliding_window=parsed.window) for _ in range(layers)])
    return DynamicCache(config=model_config)


# --- rewinding --------------------------------------------------------------------------------
def crop(cache: Cache, n: int) -> bool:
    """Drop the last n positions in place when the cache can do it exactly; False when it cannot
    (a quantized cache whose last n positions were already quantized, a sliding window that has
    already evicted), and then the cache is unchanged."""
    layers: list[Any] = list(cache.layers)  # transformers types a layer's tensors as optional
    if all(type(layer) is DynamicLayer for layer in layers):
        cache.crop(-n)
        return True
    if all(isinstance(layer, QuantizedLayer) for layer in layers):
        if any(_residual_positions(layer) < n for layer in layers):
            return False
        for layer in layers:  # the last n positions are all in the unquantized residual
            layer.keys, layer.values = layer.keys[..., :-n, :], layer.values[..., :-n, :]
            layer.cumulative_length -= n
        return True
    if all(isinstance(layer, DynamicSlidingWindowLayer) for layer in layers):
        if any(layer.cumulative_length >= layer.sliding_window for layer in layers):
            return False
        cache.crop(-n)
        return True
    return False


def snapshot(cache: Cache) -> list[dict[str, Any]]:
    """The per-layer state, by reference: layers replace their tensors on update (never write into
    them), so restoring these references brings the cache back exactly."""
    return [dict(vars(layer)) for layer in cache.layers]


def restore(cache: Cache, state: list[dict[str, Any]]) -> None:
    for layer, saved in zip(cache.layers, state):
        vars(layer).clear()
        vars(layer).update(saved)


# --- bytes ------------------------------------------------------------------------------------
@dataclass
class CacheBytes:
    """Bytes a cache holds, measured from its tensors, and the positions behind them."""

    full_precision: int  # keys/values in the model's dtype (a quantized cache's residual too)
    quantized: int  # packed integer storage
    scales: int  # per-group scales and zero points
    positions: int  # positions the cache stands for (its sequence length)
    quantized_positions: int  # of those, held in the quantized storage
    stored_positions: int  # held at all (a sliding window drops the oldest)

    @property
    def total(self) -> int:
        return self.full_precision + self.quantized + self.scales

    @property
    def per_position(self) -> float:
        return self.total / self.positions if self.positions else 0.0


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) and t.dim() > 0 else 0


def _residual_positions(layer: Any) -> int:
    keys = getattr(layer, "keys", None)
    return keys.shape[-2] if isinstance(keys, torch.Tensor) and keys.dim() == 4 else 0


def _quantized_bytes(stored: Any) -> tuple[int, int]:
    """(packed bytes, scale + zero bytes) of one HQQ-quantized tensor: (packed tensor, meta dict)."""
    if stored is None:
        return 0, 0
    packed, meta = stored
    return _nbytes(packed), sum(_nbytes(v) for k, v in meta.items() if k in ("scale", "zero"))


def cache_bytes(cache: Cache) -> CacheBytes:
    """Measure a cache built by ``make_cache`` (layer 0 gives the position counts)."""
    full = packed = scales = 0
    for layer in cache.layers:
        full += _nbytes(getattr(layer, "keys", None)) + _nbytes(getattr(layer, "values", None))
        if isinstance(layer, QuantizedLayer):
            for stored in (layer._quantized_keys, layer._quantized_values):
                p, s = _quantized_bytes(stored)
                packed, scales = packed + p, scales + s
    first = cache.layers[0] if cache.layers else None
    positions = cache.get_seq_length() if first is not None else 0
    residual = _residual_positions(first) if first is not None else 0
    quantized = positions - residual if isinstance(first, QuantizedLayer) else 0
    stored = residual + quantized if isinstance(first, QuantizedLayer) else residual
    return CacheBytes(full, packed, scales, positions, quantized, stored)


def formula_bytes(geo: KVGeometry, kind: str, full_positions: int, quantized_positions: int = 0) -> int:
    """The layout's bytes: full-precision positions × 2·L·H_kv·D × bytes per element, plus, for a
    quantized kind, quantized positions × 2·L·H_kv·D × (bits / 8 + 2 × bytes per element / group)
    (packed values, then a scale and a zero per group)."""
    values = geo.values_per_position
    total = full_positions * values * geo.bytes_per_element
    bits = parse_kind(kind).bits
    if bits is not None and quantized_positions:
        groups = quantized_positions * values // geo.group_size
        total += quantized_positions * values * bits // 8 + groups * 2 * geo.bytes_per_element
    return total


def formula_bytes_per_token(geo: KVGeometry, kind: str) -> float:
    """Bytes per position once stored in the kind's long-term layout (quantized for the quantized
    kinds; a sliding window costs what dynamic does per position it keeps)."""
    return formula_bytes(geo, kind, 0, 1) if parse_kind(kind).bits else float(formula_bytes(geo, kind, 1))


def formula_text(geo: KVGeometry, kind: str) -> str:
    """The per-position formula with its numbers, for display."""
    base = (f"2 × {geo.layers} layers × {geo.kv_heads} kv heads × {geo.head_dim} head dim")
    bits = parse_kind(kind).bits
    if bits is None:
        return f"{base} × {geo.bytes_per_element} bytes = {formula_bytes_per_token(geo, kind):,.0f} bytes"
    return (f"{base} × ({bits}/8 + 2 × {geo.bytes_per_element} / {geo.group_size}) bytes "
            f"= {formula_bytes_per_token(geo, kind):,.0f} bytes")


def expected_bytes(geo: KVGeometry, kind: str, counts: CacheBytes) -> int:
    """The formula applied to the positions a measured cache holds (quantized and not)."""
    full = counts.stored_positions - counts.quantized_positions
    return formula_bytes(geo, kind, full, counts.quantized_positions)
