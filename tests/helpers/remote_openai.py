"""Shared by the tests: what tests/remote/test_remote_openai.py and the tests beside it use."""

from __future__ import annotations

import http.server
import json
import threading
import time
from pathlib import Path
from typing import Any, Iterator
import pytest
from engine.backends import openai, served

__all__ = ['VOCAB', 'chunks', 'listed', 'recorded', 'vllm']


VLLM = Path(__file__).parents[1] / "data" / "vllm"


EOS, VOCAB = 2, 49152  # SmolLM2's, as the operator lists them (#vocab=49152&eos=2)


def fixture(name: str) -> Any:
    return json.loads((VLLM / name).read_text())


def recorded(scenario: str, path: str = "/v1/completions", name: str = "exchanges.json") -> list[dict]:
    """The recorded exchanges of ``scenario`` at ``path``, in the order they were made."""
    return [e for e in fixture(name)["exchanges"] if e["scenario"] == scenario and e["path"] == path]


def chunks(scenario: str) -> list[dict]:
    """The JSON chunks of ``scenario``'s recorded stream (keep-alive comments and [DONE] left out)."""
    [stream] = [e for e in recorded(scenario) if "sse" in e]
    lines = [line[len("data: "):] for line in stream["sse"].splitlines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


class VllmHandler(http.server.BaseHTTPRequestHandler):
    """Answers as the recorded vLLM answered the same request (``server.exchanges``: the method, path
    and body must match; an unrecorded request is a 404 saying so). ``server.state`` holds the bodies
    received, an error to reply to completions (``fail``: (status, file)), a stream error
    (``stream_error``), a delay, and whether /tokenize exists."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        self._answer(None)

    def do_POST(self):  # noqa: N802
        state = self.server.state
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        state["requests"].append((self.path, body))
        time.sleep(state.get("delay", 0))
        if state.get("fail") and self.path == "/v1/completions":
            status, name = state["fail"]
            return self._reply(status, fixture(name)["body"])
        if self.path == "/tokenize" and not state.get("tokenize", True):
            return self._reply(404, {"detail": "Not Found"})
        if state.get("stream_error") and body.get("stream"):
            return self._stream(recorded("stream_error")[0]["sse"])
        self._answer(body)

    def _answer(self, body: Any) -> None:
        for exchange in self.server.exchanges:
            if (exchange["method"], exchange["path"], exchange["body"]) == (self.command, self.path, body):
                return self._stream(exchange["sse"]) if "sse" in exchange else self._reply(200, exchange["answer"])
        self._reply(404, {"detail": f"not recorded: {self.command} {self.path} {json.dumps(body)[:200]}"})

    def _reply(self, status: int, data: Any) -> None:
        text = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(text)))
        self.end_headers()
        self.wfile.write(text)

    def _stream(self, sse: str) -> None:
        """Server-Sent Events as recorded, then the connection closes (HTTP/1.0)."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(sse.encode())

    def log_message(self, *args):
        pass


def replay(name: str) -> Iterator[tuple[str, dict]]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), VllmHandler)
    server.state, server.exchanges = {"requests": []}, fixture(name)["exchanges"]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1", server.state
    server.shutdown()


@pytest.fixture
def vllm(monkeypatch) -> Iterator[tuple[str, dict]]:
    """(the /v1 URL, the state) of a local server replaying the real vLLM over the converted folder.
    Step mode asks one token per request there: the recordings are of that (tests/data/vllm/record.py);
    verifying continuations (#38) is tested against the live vLLM (tests/remote/test_remote_verified.py)."""
    monkeypatch.setenv("DP_STEP_VERIFY_TOKENS", "0")
    yield from replay("exchanges.json")


def listed(url: str, *eos: int) -> served.RemoteModel:
    """The replayed server connected as the operator lists it (#vocab=49152&eos=2 by default)."""
    return openai.connect_openai(url, timeout_s=5, vocab_size=VOCAB, eos_token_ids=eos or (EOS,))
