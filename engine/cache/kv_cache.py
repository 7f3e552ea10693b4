"""A thin wrapper over transformers' caches: prefill, step, rewind(n), sync, bytes used, and rows
of different lengths left-padded together (the batched scheduler's rows).

The wrapper remembers which token ids (batch of one) the cache holds, so ``sync`` can move the
cache to any sequence by rewinding to the common prefix and feeding only the missing tokens, in
one forward. Nothing is ever recomputed from scratch unless nothing is shared.

A solo run and the scheduler's batch are the same object and the same forward: rows of different
lengths are left-padded, with a mask [B, L] (1 = real token, 0 = padding) that the cache keeps
while any row is padded and feeds as the attention mask, with per-row positions (each row counts
from 0 at its first real token). ``append_rows`` stacks another cache's rows under these,
``keep_rows`` selects rows and trims the padding they all share.

``kind`` picks the cache (``engine.cache.kv_quant``): ``dynamic`` (default), ``quantized-int8`` /
``quantized-int4`` or ``sliding-<N>``. Those crop exactly only while the positions to drop are
unquantized / not yet evicted; otherwise ``rewind`` restores the state saved at the last ``sync``
and feeds what follows it, or, failing that, rebuilds the cache with one prefill forward.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from engine.cache import kv_quant
from engine.base.measures import common_prefix


class KVCache:
    def __init__(self, model: Any, kind: str = "dynamic", residual_length: int = 32):
        self.model = model
        self.device = next(model.parameters()).device
        self.kind, self.residual_length = kind, residual_length
        # transformers' cache; Any: it types a layer's keys and values as optional
        self.cache: Any = kv_quant.make_cache(model.config, kind, residual_length)
        self.tokens: list[int] = []  # ids held, for batch size 1
        self.forwards = 0  # model calls made through this cache
        self._saved: tuple[list[int], list] | None = None  # (tokens, state) at the last sync
        self.mask: torch.Tensor | None = None  # [B, L] while any row is left-padded (1 = real, 0 = pad)

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    @property
    def rows(self) -> int:
        """Rows (batch size) the cache holds; 0 while empty."""
        keys = getattr(self.cache.layers[0], "keys", None) if self.cache.layers else None
        return keys.shape[0] if keys is not None and keys.numel() else 0

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, *, mask: torch.Tensor | None = None, all_logits: bool = False,
                output_hidden_states: bool = False) -> Any:
        """Feed input_ids [B, T] after what the cache holds. ``mask`` [B, T]: which fed positions are
        real (1) and which left padding (0); None: all real. Returns the model output; its logits
        are [B, T, V] with ``all_logits`` else [B, 1, V] (the last position only)."""
        input_ids = input_ids.to(self.device)
        padding: dict[str, torch.Tensor] = {}
        if self.mask is not None or (mask is not None and not bool(mask.all())):
            held = self.mask if self.mask is not None else input_ids.new_ones(input_ids.shape[0], self.length)
            fed = mask.to(self.device) if mask is not None else torch.ones_like(input_ids)
            self.mask = torch.cat([held, fed], dim=1)  # [B, L + T]
            positions = (self.mask.cumsum(dim=1) - 1).clamp(min=0)[:, -input_ids.shape[1]:]  # [B, T]
            padding = {"attention_mask": self.mask, "position_ids": positions}
        out = self.model(
            input_ids=input_ids,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=0 if all_logits else 1,
            output_hidden_states=output_hidden_states,
            **padding,
        )
        self.forwards += 1
        if input_ids.shape[0] == 1:
            self.tokens.extend(input_ids[0].tolist())
        return out

    def step(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Feed tokens (batch of one); return the last position's logits [1, V] in float32."""
        ids = torch.tensor([list(token_ids)], dtype=torch.long)
        return self.forward(ids).logits[:, -1, :].float()

    def rewind(self, n: int) -> None:
        """Drop the last n positions."""
        if n < 0 or n > self.length:
            raise ValueError(f"rewind: n={n} must be in [0, {self.length}]")
        if not n:
            return
        if kv_quant.crop(self.cache, n):
            del self.tokens[-n:]
            if self.mask is not None:
                self.mask = self.mask[:, :-n]
            return
        keep = self.tokens[:-n]
        saved_tokens, state = self._saved or ([], None)
        if state is not None and keep[:len(saved_tokens)] == saved_tokens:
            kv_quant.restore(self.cache, state)
            self.tokens = list(saved_tokens)
        else:
            self.cache = kv_quant.make_cache(self.model.config, self.kind, self.residual_length)
            self.tokens = []
        if len(keep) > len(self.tokens):
            self.forward(torch.tensor([keep[len(self.tokens):]], dtype=torch.long))

    def sync(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Make the cache hold exactly ``token_ids`` and return the logits after the last one.
        Rewinds to the longest common prefix and feeds the rest in one forward."""
        target = list(token_ids)
        common = min(common_prefix(self.tokens, target), len(target) - 1)  # always feed at least one token to get logits
        self.rewind(self.length - common)
        logits = self.step(target[common:])
        if self.kind != "dynamic":  # a point ``rewind`` can return to when it cannot crop
            self._saved = (list(self.tokens), kv_quant.snapshot(self.cache))
        return logits

    def reorder(self, index: torch.Tensor) -> None:
        """Select / reorder batch rows (beam search; a row may be repeated)."""
        index = index.to(self.device)
        self.cache.reorder_cache(index)
        if self.mask is not None:
            self.mask = self.mask.index_select(0, index)
        self.tokens, self._saved = [], None

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (indices, in order; repeats copy a row) and trim the left padding
        they all share (the cache forgets the mask once no row is padded)."""
        if list(rows) == list(range(self.rows)):
            return
        self.reorder(torch.tensor(list(rows), dtype=torch.long))
        if self.mask is None:
            return
        leading = int((self.mask.cumsum(dim=1) == 0).sum(dim=1).min())  # pad columns every row has
        if leading:
            self.mask = self.mask[:, leading:]
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, leading:], layer.values[:, :, leading:]
        if bool(self.mask.all()):
            self.mask = None

    def _mask_or_ones(self) -> torch.Tensor:
        """The rows' mask [B, L], all ones when no row is padded."""
        if self.mask is not None:
            return self.mask
        return torch.ones(self.rows, self.length, dtype=torch.long, device=self.device)

    def append_rows(self, other: "KVCache") -> None:
        """Stack ``other``'s rows under these (full-attention dynamic caches only), left-padding
        whichever side is shorter; ``other`` is consumed."""
        width, length = self.length, other.length
        mine, theirs = self._mask_or_ones(), other._mask_or_ones().to(self.device)
        _pad_left(self.cache, length - width)
        _pad_left(other.cache, width - length)
        self.mask = torch.cat([_pad_mask(mine, length - width), _pad_mask(theirs, width - length)], dim=0)
        for layer, added in zip(self.cache.layers, other.cache.layers):
            layer.keys = torch.cat([layer.keys, added.keys], dim=0)
            layer.values = torch.cat([layer.values, added.values], dim=0)
        if bool(self.mask.all()):
            self.mask = None
        self.tokens, self._saved = [], None

    def nbytes(self) -> int:
        """Bytes the cache's tensors hold (packed integers, scales and zeros included)."""
        return kv_quant.cache_bytes(self.cache).total


def _pad_left(cache: Any, n: int) -> None:
    """Prepend n zero positions to every layer (masked out, so their values never matter)."""
    if n <= 0:
        return
    for layer in cache.layers:
        layer.keys = torch.cat([layer.keys.new_zeros(*layer.keys.shape[:2], n, layer.keys.shape[3]), layer.keys], dim=2)
        layer.values = torch.cat([layer.values.new_zeros(*layer.values.shape[:2], n, layer.values.shape[3]),
                                  layer.values], dim=2)


def _pad_mask(mask: torch.Tensor, n: int) -> torch.Tensor:
    return torch.cat([mask.new_zeros(mask.shape[0], n), mask], dim=1) if n > 0 else mask


def left_padded(sequences: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``sequences`` left-padded to the longest: ids [U, T] and mask [U, T] (1 = real). Pads repeat
    the row's first token (any real id works: they are masked out)."""
    width = max(len(s) for s in sequences)
    ids = torch.tensor([[s[0]] * (width - len(s)) + list(s) for s in sequences], dtype=torch.long, device=device)
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in sequences], dtype=torch.long, device=device)
    return ids, mask
