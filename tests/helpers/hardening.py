"""Shared by the tests: what tests/engine/test_hardening.py and the tests beside it use."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.common import make_tiny_llama
from engine.backends.local import LoadedModel

__all__ = ['AmateurRegistry', 'tiny_amateur']


@pytest.fixture(scope="module")
def tiny_amateur(tiny_lm) -> LoadedModel:
    return LoadedModel(name="tiny-amateur", model=make_tiny_llama(seed=1), tokenizer=tiny_lm.tokenizer,
                       device=torch.device("cpu"), dtype=torch.float32, quantization="none", source="tiny",
                       eos_token_ids=(2,), memory_bytes=0)


class AmateurRegistry:
    """Hands out the tiny amateur for contrastive decoding (no model loading in these tests)."""

    def __init__(self, amateur):
        self.amateur = amateur

    def get(self, spec, progress=None, **_):
        return self.amateur
