"""A thin wrapper over transformers' DynamicCache: prefill, step, rewind(n), sync, bytes used.

The wrapper remembers which token ids (batch of one) the cache holds, so ``sync`` can move the
cache to any sequence by rewinding to the common prefix and feeding only the missing tokens, in
one forward. Nothing is ever recomputed from scratch unless nothing is shared.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from transformers import DynamicCache


class KVCache:
    def __init__(self, model: Any):
        self.model = model
        self.device = next(model.parameters()).device
        self.cache = DynamicCache(config=model.config)
        self.tokens: list[int] = []  # ids held, for batch size 1
        self.forwards = 0  # model calls made through this cache

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

    prefill = step

    def rewind(self, n: int) -> None:
        """Drop the last n positions."""
        if n < 0 or n > self.length:
            raise ValueError(f"rewind: n={n} must be in [0, {self.length}]")
        if n:
            self.cache.crop(-n)
            del self.tokens[-n:]

    def sync(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Make the cache hold exactly ``token_ids`` and return the logits after the last one.
        Rewinds to the longest common prefix and feeds the rest in one forward."""
        target = list(token_ids)
        common = 0
        for a, b in zip(self.tokens, target):
            if a != b:
                break
            common += 1
        common = min(common, len(target) - 1)  # always feed at least one token to get logits
        self.rewind(self.length - common)
        return self.step(target[common:])

    def reorder(self, index: torch.LongTensor) -> None:
        """Beam search: select / reorder batch rows."""
        self.cache.reorder_cache(index.to(self.device))
        self.tokens = []

    def nbytes(self) -> int:
        total = 0
        for layer in self.cache.layers:
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
        return total
