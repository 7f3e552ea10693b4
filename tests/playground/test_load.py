"""24 concurrent gradio_client sessions against one server on 127.0.0.1: no errors, no cross-talk
(each session sends its own marker prompt and seed and must get its own trace back), and every
seeded result equals the same request run again serially. Bounded: 8 tokens per request, loopback
only, a time limit per request."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from tests.helpers.api import api_client

pytestmark = pytest.mark.slow

SESSIONS = 24
TOKENS = 8
REQUEST_SECONDS = 600


def _client(url: str):

    # httpx's 5 s default is shorter than a busy 2-core server takes to answer 24 sessions at once
    return api_client(url, REQUEST_SECONDS)


def _request(client, i: int) -> dict:
    prompt = f"Marker {i:02d}: tell me about the number {i}."
    return client.submit(prompt, {"max_new_tokens": TOKENS, "seed": 1000 + i}, "balanced", False, "embedded", "none",
                         api_name="/step_trace").result(timeout=REQUEST_SECONDS)


def test_concurrent_sessions_match_a_serial_rerun(live_app):
    assert live_app.startswith("http://127.0.0.1:")
    clients = [_client(live_app) for _ in range(SESSIONS)]  # one session each
    with ThreadPoolExecutor(max_workers=SESSIONS) as pool:
        futures = [pool.submit(_request, clients[i], i) for i in range(SESSIONS)]
        results, errors = [], []
        for i, future in enumerate(futures):
            try:
                results.append(future.result())
            except Exception as exc:
                errors.append(f"session {i}: {exc}")
    assert errors == []
    for i, data in enumerate(results):  # each answer belongs to its own request
        assert data["prompt"] == f"Marker {i:02d}: tell me about the number {i}."
        assert data["config"]["seed"] == 1000 + i and 1 <= len(data["generated_token_ids"]) <= TOKENS
    serial = [_request(clients[i], i)["generated_token_ids"] for i in range(SESSIONS)]  # one at a time
    assert serial == [data["generated_token_ids"] for data in results]
