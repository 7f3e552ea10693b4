"""Shared by the tests: what tests/playground/test_search_view.py and the tests beside it use."""

from __future__ import annotations

import pytest
from engine.backends.registry import ModelRegistry
from playground.shared import Shared
from playground.views import search

__all__ = ['mcts_out', 'shared']


@pytest.fixture
def shared() -> Shared:
    return Shared(registry=ModelRegistry(), model=None, quantization=None, user_presets=None)


def mcts_out() -> search.MctsOutputs:
    return search.MctsOutputs(*[f"mcts.{n}" for n in ("status", "text", "position", "tree", "visits", "quality",
                                                      "quality_table", "download", "session")])
