"""Shared by the tests: what tests/playground/test_api_fuzz.py and the tests beside it use."""

from __future__ import annotations

import json

__all__ = ['_raw']


CALL_SECONDS = 90


def _strict_loads(text: str):
    def refuse(name):
        raise ValueError(f"non-strict JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def _raw(base: str, api_name: str, body: str) -> tuple[str | None, object]:
    """A raw HTTP call (as curl or a non-Python client makes it, NaN and missing arguments allowed):
    the final event's kind and its data, parsed as strict JSON."""
    import httpx

    res = httpx.post(f"{base}/gradio_api/call{api_name}", content=body,
                     headers={"Content-Type": "application/json"}, timeout=60)
    if res.status_code != 200:
        return "http", res.text[:200]
    text = httpx.get(f"{base}/gradio_api/call{api_name}/{res.json()['event_id']}", timeout=CALL_SECONDS).text
    kind, data = None, None
    for line in text.splitlines():
        if line.startswith("event: "):
            kind = line[7:].strip()
        elif line.startswith("data: ") and kind in ("complete", "error"):
            data = _strict_loads(line[6:])
    return kind, data
