"""Shared by the tests: what tests/engine/test_drift.py and the tests beside it use."""

from __future__ import annotations

from engine.backends.local import ModelLoadError, ModelSpec

__all__ = ['OneModelRegistry']


class OneModelRegistry:
    """Registry stand-in holding one real (tiny) model as "none"; other variants fail to load."""

    def __init__(self, lm):
        self.lm = lm

    def get(self, spec: ModelSpec, progress=None):
        if spec.quantization != "none":
            raise ModelLoadError(f"Could not {spec.quantization}-quantize 'tiny': not in this registry")
        return self.lm

    def loaded(self):
        return [ModelSpec("tiny", "none")]

    def lend(self, spec: ModelSpec, use, *, key="model"):
        return use(self.get(spec))

    def check_room(self, need: int, what: str, key: str = "model") -> None:
        """No memory budget here."""
