"""Shared by the tests: what tests/engine/test_medusa.py and the tests beside it use."""

from __future__ import annotations

import torch
from engine.strategies import decode
from engine.strategies.medusa import (MedusaHeads)

__all__ = ['random_heads', 'target_only']


def random_heads(hidden: int, k: int, scale: float, seed: int = 0) -> MedusaHeads:
    heads = MedusaHeads(hidden, k)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        heads.weight.copy_(scale * torch.randn(heads.weight.shape, generator=gen) / hidden ** 0.5)
    return heads.eval().requires_grad_(False)


def target_only(lm, ids, config) -> list[int]:
    base = config.replace(strategy="greedy" if config.is_greedy else "sample")
    return [s.chosen_token_id for s in decode.stream(lm, ids, base)]
