"""Smoke-test a running Decoding Playground: the page answers, and ``/step_trace`` returns a trace.

    python -m deploy.smoke URL [--model embedded] [--wait 300]

Prints one JSON line (page status, tokens generated, seconds) and exits 0 when both answer.
Used by ``make image`` (the container) and tests/project/test_space.py (the Space folder).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request

PROMPT = "The capital of France is"


def wait_for_page(url: str, timeout_s: float) -> int:
    """Poll ``url`` until it answers 200; returns the status, raises TimeoutError past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200 and b"<html" in response.read(4096).lower():
                    return response.status
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"url: {url} did not answer within {timeout_s:.0f} s")
        time.sleep(1)


def step_trace(url: str, model: str, max_new_tokens: int = 4) -> dict:
    """One greedy run through the ``/step_trace`` API endpoint (gradio_client); the trace JSON."""
    from gradio_client import Client

    client = Client(url, verbose=False)
    return client.predict(prompt=PROMPT, config={"strategy": "greedy", "max_new_tokens": max_new_tokens},
                          model=model, api_name="/step_trace")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Smoke-test a running Decoding Playground")
    p.add_argument("url")
    p.add_argument("--model", default="embedded")
    p.add_argument("--wait", type=float, default=300.0, help="seconds to wait for the page")
    args = p.parse_args(argv)
    start = time.monotonic()
    status = wait_for_page(args.url, args.wait)
    page_s = time.monotonic() - start
    trace = step_trace(args.url, args.model)
    tokens = len(trace["generated_token_ids"])
    print(json.dumps({"page_status": status, "page_seconds": round(page_s, 1), "model": trace["model"],
                      "tokens": tokens, "text": trace["text"], "stop_reason": trace["stop_reason"]}))
    return 0 if tokens > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
