"""A thin wrapper over transformers' caches: prefill, step, rewind(n), sync, bytes used.

The wrapper remembers which token ids (batch of one) the cache holds, so ``sync`` can move the
cache to any sequence by rewinding to the common prefix and feeding only the missing tokens, in
one forward. Nothing is ever recomputed from scratch unless nothing is shared.

``kind`` picks the cache (engine/kv_quant.py): ``dynamic`` (default), ``quantized-int8`` /
``quantized-int4`` or ``sliding-<N>``. Those crop exactly only while the positions to drop are
unquantized / not yet evicted; otherwise ``rewind`` restores the state saved at the last ``sync``
and feeds what follows it, or, failing that, rebuilds the cache with one prefill forward.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from . import kv_quant
from .metrics import common_prefix


class KVCache:
    def __init__(self, model: Any, kind: str = "dynamic", residual_length: int = 32):
        self.model = model
        self.device = next(model.parameters()).device
        self.kind, self.residual_length = kind, residual_length
        self.cache = kv_quant.make_cache(model.config, kind, residual_length)
        self.tokens: list[int] = []  # ids held, for batch size 1
        self.forwards = 0  # model calls made through this cache
        self._saved: tuple[list[int], list] | None = None  # (tokens, state) at the last sync

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    @torch.inference_mode()
    def forward(self, input_ids: torch.LongTensor, *, all_logits: bool = False,
                output_hidden_states: bool = False) -> Any:
        """Feed input_ids [B, T] after what the cache holds. Returns the model output; its logits
        are [B, T, V] with ``all_logits`` else [B, 1, V] (the last position only)."""
        out = self.model(
            input_ids=input_ids.to(self.device),
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=0 if all_logits else 1,
            output_hidden_states=output_hidden_states,
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

    def reorder(self, index: torch.LongTensor) -> None:
        """Beam search: select / reorder batch rows."""
        self.cache.reorder_cache(index.to(self.device))
        self.tokens, self._saved = [], None

    def nbytes(self) -> int:
        """Bytes the cache's tensors hold (packed integers, scales and zeros included)."""
        return kv_quant.cache_bytes(self.cache).total
