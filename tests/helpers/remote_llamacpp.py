"""Shared by the tests: what tests/remote/test_remote_llamacpp.py and the tests beside it use."""

from __future__ import annotations

import pytest
from engine.backends import served

__all__ = ['PROMPT', 'llamacpp_greedy', 'server_test']


def server_test(fn):
    """Marks a test that needs the real llama-server (the build may still be running: long timeout)."""
    return pytest.mark.remote(pytest.mark.slow(pytest.mark.timeout(2400)(fn)))


PROMPT = "The capital of France is Paris. The capital of Italy is"


# --- against the real server -----------------------------------------------------------------------
def llamacpp_greedy(model: served.RemoteModel, ids: list[int], n: int) -> list[int]:
    """llama.cpp's own greedy: its sampler chain reduced to top-k 1."""
    answer = model.client.post("/completion", {"prompt": ids, "n_predict": n, "temperature": 0, "top_k": 1,
                                               "samplers": ["top_k"], "return_tokens": True, "cache_prompt": False})
    return answer["tokens"]
