"""Shared by the tests: what tests/remote/test_vllm_live.py and the tests beside it use."""

from __future__ import annotations

import json
import urllib.request
from typing import Any
from deploy.vllm_serve import SERVED_NAME

__all__ = ['vllm_greedy']


def post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's own answer to ``body`` (no engine code in between)."""
    request = urllib.request.Request(url + path, json.dumps({"model": SERVED_NAME, **body}).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as answer:
        return json.load(answer)


def vllm_greedy(url: str, ids: list[int], tokens: int, **more: Any) -> dict[str, Any]:
    """vLLM's own greedy completion of ``ids`` (its first choice)."""
    return post(url, "/v1/completions", {"prompt": ids, "max_tokens": tokens, "temperature": 0,
                                         "return_token_ids": True, **more})["choices"][0]
