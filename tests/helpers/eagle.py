"""Shared by the tests: what tests/engine/test_eagle.py and tests/playground/test_eagle_view.py use."""

from __future__ import annotations

import torch
from engine.strategies.eagle_head import EagleHead, HeadConfig, feature_layers

__all__ = ['random_head']


def random_head(lm, draft_vocab: int | None = None, seed: int = 0) -> EagleHead:
    """An untrained head for ``lm`` (its candidates are arbitrary: exactness must not depend on them)."""
    torch.manual_seed(seed)
    config = lm.model.config
    size = draft_vocab or lm.vocab_size
    head_config = HeadConfig(lm.name, config.hidden_size, lm.vocab_size, size, feature_layers(config.num_hidden_layers))
    head = EagleHead(config, head_config, torch.randperm(lm.vocab_size)[:size])
    return head.eval().requires_grad_(False).bind(lm.model)
