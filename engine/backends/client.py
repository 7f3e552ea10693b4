"""JSON over HTTP to one served model's server: ``JsonClient`` (timeouts, errors as one line
``RemoteError`` naming the server)."""

from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Iterator

DEFAULT_TIMEOUT_S = 30.0

class RemoteError(RuntimeError):
    """A remote server is unreachable, slow, or answered something we cannot use (one line)."""


# --- HTTP ------------------------------------------------------------------------------------------
def _no_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name} in the answer")


@dataclass
class JsonClient:
    """JSON over HTTP to one server; ``timeout_s`` bounds connecting and every read; ``server``
    names it in error lines."""

    url: str
    timeout_s: float = DEFAULT_TIMEOUT_S
    server: str = "llama.cpp server"

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url: expected http://host:port, got {self.url[:80]!r}")
        if not 0 < self.timeout_s <= 3600:
            raise ValueError(f"timeout_s: expected (0, 3600] seconds, got {self.timeout_s!r}")
        self.url = self.url.rstrip("/")

    def get(self, path: str) -> Any:
        return self._call(urllib.request.Request(self.url + path), path)

    def post(self, path: str, body: dict[str, Any]) -> Any:
        return self._call(self._post_request(path, body), path)

    def stream_post(self, path: str, body: dict[str, Any]) -> Iterator[Any]:
        """POST ``body`` and yield the JSON of each Server-Sent Event (``data: {...}`` lines, a blank
        line after each) as it arrives, until ``data: [DONE]`` or the end of the stream. The
        timeout bounds connecting and every read; an event carrying ``error`` raises RemoteError.
        Closing the generator early closes the connection, so the server ends the request."""
        where = f"{self.server} {self.url}{path}"
        response = self._open(self._post_request(path, body), where)
        try:
            data: list[bytes] = []
            while True:
                raw = self._read(response.readline, where)  # b"" at the end of the stream
                line = raw.rstrip(b"\r\n")
                if line.startswith((b"data:", b"error:")):
                    field, _, value = line.partition(b":")
                    if field == b"error":  # llama-server's way of failing mid-stream
                        raise RemoteError(f"{where}: the stream says: {_error_detail(value.strip())}")
                    data.append(value.strip())
                elif not line and data:  # a blank line (or the end) closes an event
                    text, data = b"\n".join(data), []
                    if text == b"[DONE]":
                        return
                    event = self._parse(text, where)
                    if isinstance(event, dict) and event.get("error"):
                        raise RemoteError(f"{where}: the stream says: {_error_detail(text)}")
                    yield event
                if not raw:
                    return
        finally:
            response.close()

    def _post_request(self, path: str, body: dict[str, Any]) -> urllib.request.Request:
        data = json.dumps(body, allow_nan=False).encode()
        return urllib.request.Request(self.url + path, data, {"Content-Type": "application/json"})

    def _call(self, request: urllib.request.Request, path: str) -> Any:
        where = f"{self.server} {self.url}{path}"
        with self._open(request, where) as response:
            text = self._read(response.read, where)
        return self._parse(text, where)

    def _open(self, request: urllib.request.Request, where: str) -> Any:
        """The open response (http.client.HTTPResponse); an HTTP error or no connection raises RemoteError."""
        try:
            return urllib.request.urlopen(request, timeout=self.timeout_s)
        except urllib.error.HTTPError as exc:
            raise RemoteError(f"{where}: HTTP {exc.code}: {_error_detail(exc.read(2000))}") from None
        except (OSError, http.client.HTTPException) as exc:
            raise self._failure(exc, where) from None

    def _read(self, read: Any, where: str) -> bytes:
        """``read()`` on a response; a timeout or a broken connection raises RemoteError."""
        try:
            return read()
        except (OSError, http.client.HTTPException) as exc:
            raise self._failure(exc, where) from None

    def _failure(self, exc: Exception, where: str) -> RemoteError:
        """One line for a failure to connect or to read: a timeout, a refused or broken connection."""
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, (TimeoutError, socket.timeout)):
            return RemoteError(f"{where}: no answer within the {self.timeout_s:g} s timeout")
        if isinstance(exc, http.client.HTTPException):
            return RemoteError(f"{where}: the connection broke off ({type(exc).__name__})")
        return RemoteError(f"{where}: cannot connect ({reason}; timeout {self.timeout_s:g} s)")

    def _parse(self, text: bytes, where: str) -> Any:
        try:
            return json.loads(text, parse_constant=_no_constant)
        except ValueError as exc:
            raise RemoteError(f"{where}: the answer is not JSON ({exc})") from None


def _error_detail(body: bytes) -> str:
    """An error reply in one line: its ``error.message`` (OpenAI's and vLLM's ErrorResponse,
    llama-server's) when it has one, else its text, cut to 300 characters."""
    text = body.decode("utf-8", "replace")
    try:
        error = json.loads(text).get("error")
        message = error.get("message") if isinstance(error, dict) else None
    except (ValueError, AttributeError):
        message = None
    return " ".join(str(message or text).split())[:300]
