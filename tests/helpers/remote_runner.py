"""Shared by the tests: what tests/remote/test_remote_runner.py and the tests beside it use."""

from __future__ import annotations

from engine.backends import client, llamacpp, served

__all__ = ['offline_model']


def offline_model() -> served.RemoteModel:
    """A RemoteModel that never connects (nothing listens on port 1)."""
    api = llamacpp.LlamaCppApi(client.JsonClient("http://127.0.0.1:1", 1))
    return served.RemoteModel("llamacpp:http://127.0.0.1:1", api, served.RemoteTokenizer(api), 100, (0,))
