"""Shared by the tests: what tests/remote/test_remote_stream.py and the tests beside it use."""

from __future__ import annotations

import json
import urllib.request

__all__ = ['busy']


def busy(url: str) -> bool:
    """Whether llama-server's one slot is still generating (its /slots)."""
    with urllib.request.urlopen(url + "/slots", timeout=5) as answer:
        return any(slot["is_processing"] for slot in json.loads(answer.read()))
