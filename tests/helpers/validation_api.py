"""Shared by the tests: what tests/playground/test_validation_api.py and the tests beside it use."""

from __future__ import annotations

import httpx

__all__ = ['post_job']


def post_job(base: str, api_name: str, body: str) -> httpx.Response:
    """``POST /gradio_api/call/<api>`` with a raw JSON body; its answer holds the job's event_id."""
    return httpx.post(f"{base}/gradio_api/call{api_name}", content=body, headers={"Content-Type": "application/json"},
                      timeout=60)
