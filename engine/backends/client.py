"""JSON over HTTP to one served model's server: ``JsonClient``, and ``RemoteError``, the one line
that names the server and what went wrong.

A server the operator lists is still untrusted input (issue #34): it may be broken, slow, a
different version or compromised. So the client (``http.client`` from the standard library, one
connection per request, ``Connection: close``) holds these rules:

- **No redirects.** A 3xx answer is one RemoteError line naming the server and the status; the
  ``Location`` is never connected to (a redirect would take the request to a host the operator
  did not list) and never shown.
- **One deadline per request**, fixed when the request starts: nothing the server sends moves it. A
  plain request must be answered whole within ``timeout_s`` of its start; a stream must end within
  ``stream_s`` of its start, and besides go quiet for at most ``timeout_s``: its first event must
  come within ``timeout_s`` of the start and each next within ``timeout_s`` of the one before (a
  keep-alive comment is no event), never past the stream's deadline. Both are cut to the run's own
  time limit (``engine.control.active_control()``, the control of the run this thread works for).
  Every socket operation (connect, send, each read) gets a timeout of the time left, so a server that
  answers one byte per second, or a comment a second, is cut off at the deadline, not per byte.
  A read that ends because the run's limit passed raises the run's ``RunStopped`` (time limit).
- **Cancel closes the connection.** Each open socket registers a closer with the active
  control (``RunControl.on_cancel``); a Stop (or a closed tab) shuts the socket down from the
  cancelling thread, so a read blocked on a silent server returns at once and the run raises
  ``RunStopped`` (cancelled).
- **Bounded sizes, read incrementally.** A line of a stream is at most ``MAX_LINE_BYTES``, a
  stream at most ``MAX_STREAM_LINES`` lines and ``MAX_STREAM_BYTES``, a whole answer at most
  ``MAX_BODY_BYTES`` (its ``Content-Length`` is checked before reading), an error reply's text
  ``MAX_ERROR_BYTES``; the status line and headers are http.client's (64 KiB a line, 100 headers).
  Past a limit: one line naming the server and the limit (``AnswerTooLarge``, a RemoteError), and
  the connection is closed.
- **Strict JSON.** ``NaN``, ``Infinity`` and numbers that overflow a float (``1e999``) are refused
  as not JSON; so is nesting deeper than Python's recursion allows. What the fields mean (ids in
  the vocabulary, probabilities in range) is checked by ``engine.backends.schema``.

The sizes: the largest legitimate answer is llama-server's whole (unstreamed) ``/completion`` with
the top 100 log-probabilities of 1024 tokens (fast mode's raw request at our knobs' maximum). Each
of its ~103,000 entries carries an id, the token's text, its bytes and a log-probability: ~90
bytes for a typical token, 8-10 MB in all; 25 MiB when every entry is one of the embedded model's
100 longest tokens (81 bytes; ``tests/remote/test_fault_servers.py`` builds that answer and reads it).
``MAX_BODY_BYTES`` = 32 MiB holds it. (A model whose top tokens are all much longer could pass it:
that optional raw request is then left out and the trace says so, see ``engine.backends.llamacpp``.)
A streamed chunk is one token's top 100: 25 KiB in that worst case, far under ``MAX_LINE_BYTES`` =
1 MiB; a stream of 1024 of them is ~2,000 lines and 25 MiB, under ``MAX_STREAM_LINES`` = 16,384
(8 lines a token) and ``MAX_STREAM_BYTES`` = 256 MiB (a stream is read a line at a time, so this
bounds the work, not the memory).

What a request may cost, then: a few MiB of buffers while it reads and one body of at most 32 MiB
(its parsed JSON a few times that) while it is parsed, freed when the request ends (measured in
``tests/remote/test_fault_servers.py``: +35 MB peak for a 600 MB answer). Not bounded by a timeout:
resolving a host name (``getaddrinfo``; list servers by IP address to avoid it) and a TLS
handshake's reads (each bounded by the time left when it starts).
"""

from __future__ import annotations

import http.client
import io
import json
import math
import mmap
import socket
import ssl
import time
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Generator, Iterator, cast
from urllib.parse import urlsplit

from engine.control import RunControl, RunStopped, active_control

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_STREAM_S = 600.0  # a whole stream, when no run's limit is shorter (1024 tokens at 2 a second: 512 s)
MAX_LINE_BYTES = 1 << 20  # one line of a Server-Sent Events stream (a streamed token's top 100: ~26 KB)
MAX_STREAM_BYTES = 256 << 20  # one whole stream (1024 streamed tokens of top 100: 25 MiB at most measured)
MAX_STREAM_LINES = 16_384  # lines of one stream (1024 tokens: ~2,000 lines)
MAX_BODY_BYTES = 32 << 20  # one whole answer (top 100 of 1024 tokens, llama-server's entries: 9-26 MB)
MAX_ERROR_BYTES = 2000  # what an error reply (HTTP 4xx/5xx) may say, before it is cut to one line
READ_CHUNK = 64 << 10


class RemoteError(RuntimeError):
    """A remote server is unreachable, slow, or answered something we cannot use (one line)."""


class AnswerTooLarge(RemoteError):
    """An answer past one of the size limits (its line says which)."""


# --- strict JSON -----------------------------------------------------------------------------------
def _no_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name} in the answer")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is too large for a float")
    return value


def strict_loads(text: bytes | str) -> Any:
    """``json.loads`` that refuses NaN, Infinity and numbers too large for a float (ValueError)."""
    try:
        return json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:
        raise ValueError("nested too deeply") from None


# --- one request's clock and socket ----------------------------------------------------------------
class Deadline:
    """When the request must be done: ``limit_s`` from now, cut to the run's time limit
    (``control``), fixed here (``end``). A stream's (``quiet_s`` set) next event is due sooner: within
    ``quiet_s`` of the last one (``heard``), never past ``end``. ``at``: the instant the next read must
    be done by; ``left()`` is the timeout a socket operation gets."""

    def __init__(self, limit_s: float, control: RunControl | None, quiet_s: float | None = None):
        self.control, self.quiet_s = control, quiet_s
        self.end = time.monotonic() + limit_s
        run_deadline = control.deadline() if control is not None else None
        self.by_run = run_deadline is not None and run_deadline <= self.end
        if run_deadline is not None and self.by_run:
            self.end = run_deadline
        self.heard()

    def heard(self) -> None:
        """An event arrived: the next is due within ``quiet_s`` (a plain request: at ``end``)."""
        self.at = self.end if self.quiet_s is None else min(self.end, time.monotonic() + self.quiet_s)

    @property
    def quiet(self) -> bool:
        """Whether the time now due is the quiet limit's, not the request's end."""
        return self.at < self.end

    def left(self) -> float:
        """Seconds left; TimeoutError once none are."""
        left = self.at - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline")
        return left


class DeadlineReader(io.RawIOBase):
    """A socket's reads, each with a timeout of the time ``deadline`` leaves: a server that
    sends one byte per second is cut off at the deadline, not after a timeout per byte."""

    def __init__(self, sock: socket.socket, deadline: Deadline):
        self.sock, self.deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        self.sock.settimeout(self.deadline.left())
        return self.sock.recv_into(buffer)


class DeadlineSocket:
    """What ``http.client.HTTPResponse`` reads from: its ``makefile`` is a buffered DeadlineReader."""

    def __init__(self, sock: socket.socket, deadline: Deadline):
        self.sock, self.deadline = sock, deadline

    def makefile(self, mode: str, *args: Any, **kwargs: Any) -> io.BufferedReader:
        return io.BufferedReader(DeadlineReader(self.sock, self.deadline))


def shutdown(sock: socket.socket) -> None:
    """Shut ``sock`` down from any thread: a read blocked on it returns at once (plain
    ``socket.shutdown``, also for a TLS socket, whose own shutdown would talk TLS)."""
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:  # not connected (yet, or any more): nothing is blocked on it
        pass


@dataclass
class Exchange:
    """One open request: its socket, the response being read, its clock, and the closer it
    registered with the run's control (``unregister``)."""

    sock: socket.socket
    response: http.client.HTTPResponse
    deadline: Deadline
    unregister: Callable[[], None]

    def close(self) -> None:
        self.unregister()
        self.response.close()
        self.sock.close()


# --- the client ------------------------------------------------------------------------------------
@dataclass
class JsonClient:
    """JSON over HTTP to one server (the rules in the module doc); ``timeout_s`` bounds a whole
    request (a stream: the wait for each event), ``stream_s`` a whole stream; ``server`` names it in
    error lines."""

    url: str
    timeout_s: float = DEFAULT_TIMEOUT_S
    server: str = "llama.cpp server"
    stream_s: float = DEFAULT_STREAM_S
    max_body_bytes: ClassVar[int] = MAX_BODY_BYTES  # a whole answer's limit (a subclass reading less sets its own)

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url: expected http://host:port, got {self.url[:80]!r}")
        if not 0 < self.timeout_s <= 3600:
            raise ValueError(f"timeout_s: expected (0, 3600] seconds, got {self.timeout_s!r}")
        if not 0 < self.stream_s <= 3600:
            raise ValueError(f"stream_s: expected (0, 3600] seconds, got {self.stream_s!r}")
        self.url = self.url.rstrip("/")
        parts = urlsplit(self.url)
        try:
            self._port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise ValueError(f"url: bad port in {self.url[:80]!r}") from None
        if not parts.hostname:
            raise ValueError(f"url: expected http://host:port, got {self.url[:80]!r}")
        self._host, self._tls, self._base = parts.hostname, parts.scheme == "https", parts.path.rstrip("/")

    def get(self, path: str) -> Any:
        return self._call("GET", path, None)

    def post(self, path: str, body: dict[str, Any]) -> Any:
        return self._call("POST", path, body)

    def stream_post(self, path: str, body: dict[str, Any]) -> Generator[Any, None, None]:
        """POST ``body`` and yield the JSON of each Server-Sent Event (``data: {...}`` lines, a blank
        line after each) as it arrives, until ``data: [DONE]`` or the end of the stream. The whole
        stream must end within ``stream_s``, each event arrive within ``timeout_s`` of the one before
        (both within the run's limit); lines, the stream and its JSON are bounded (module doc); an
        event carrying ``error`` raises RemoteError. Closing the generator early closes the
        connection, so the server ends the request."""
        where = self._where(path)
        exchange = self._open("POST", path, body, where, stream=True)
        try:
            yield from self._events(exchange, where)
        finally:
            exchange.close()

    def _events(self, exchange: Exchange, where: str) -> Iterator[Any]:
        data: list[bytes] = []
        total = 0
        for count in range(1, MAX_STREAM_LINES + 2):
            if count > MAX_STREAM_LINES:
                raise AnswerTooLarge(f"{where}: the stream is over the {MAX_STREAM_LINES:,}-line limit")
            raw = self._read(exchange, lambda: exchange.response.readline(MAX_LINE_BYTES + 1), where)
            total += len(raw)
            if len(raw) > MAX_LINE_BYTES:
                raise AnswerTooLarge(f"{where}: a streamed line is over the {MAX_LINE_BYTES >> 20} MiB limit")
            if total > MAX_STREAM_BYTES:
                raise AnswerTooLarge(f"{where}: the stream is over the {MAX_STREAM_BYTES >> 20} MiB limit")
            line = raw.rstrip(b"\r\n")
            if line.startswith((b"data:", b"error:")):
                field, _, value = line.partition(b":")
                if field == b"error":  # llama-server's way of failing mid-stream
                    raise RemoteError(f"{where}: the stream says: {error_detail(value.strip())}")
                data.append(value.strip())
            elif not line and data:  # a blank line (or the end) closes an event
                text, data = b"\n".join(data), []
                if text == b"[DONE]":
                    return
                event = self._parse(text, where)
                if isinstance(event, dict) and event.get("error"):
                    raise RemoteError(f"{where}: the stream says: {error_detail(text)}")
                yield event
                exchange.deadline.heard()  # the next event is due within timeout_s; the stream's end stays
            if not raw:
                return

    def _call(self, method: str, path: str, body: dict[str, Any] | None) -> Any:
        where = self._where(path)
        exchange = self._open(method, path, body, where)
        try:
            return self._parse(self._read_body(exchange, where), where)
        finally:
            exchange.close()

    def _read_body(self, exchange: Exchange, where: str) -> bytes:
        """The whole answer, read in chunks, at most ``max_body_bytes``: a read never asks past the
        limit + 1 byte, so an answer over it is cut there, not after a bigger one's worth. The chunks go
        into an anonymous memory map (address space only until written), unmapped when the request
        ends: an answer cut at the limit gives all its memory back to the system at once (a malloc'd
        buffer of that size would raise glibc's mmap threshold and stay in the process)."""
        limit = self.max_body_bytes
        length = exchange.response.getheader("Content-Length")
        digits = (length or "").strip()
        if digits.isascii() and digits.isdigit() and int(digits) > limit:
            raise AnswerTooLarge(f"{where}: the answer ({int(digits):,} bytes) is over the {limit >> 20} MiB limit")
        with mmap.mmap(-1, limit + 1) as buffer:
            size = 0
            while True:
                with memoryview(buffer)[size:min(size + READ_CHUNK, limit + 1)] as chunk:
                    count = self._read(exchange, lambda: exchange.response.readinto(chunk), where)
                if not count:
                    return buffer[:size]
                size += count
                if size > limit:
                    raise AnswerTooLarge(f"{where}: the answer is over the {limit >> 20} MiB limit")

    def _where(self, path: str) -> str:
        return f"{self.server} {self.url}{path}"

    def _open(self, method: str, path: str, body: dict[str, Any] | None, where: str,
              stream: bool = False) -> Exchange:
        """Connect, send, and read the status and headers (``stream``: the deadline of a stream); a
        status other than 2xx (redirects included: never followed) raises RemoteError, as does a
        failure to connect or to read."""
        control = active_control()
        deadline = Deadline(self.stream_s, control, self.timeout_s) if stream else Deadline(self.timeout_s, control)
        sock = None
        unregister: Callable[[], None] = lambda: None
        try:
            sock, unregister = self._connect(deadline, control)
            self._send(sock, deadline, method, path, body)
            # HTTPResponse reads its socket through makefile() alone, which DeadlineSocket gives
            response = http.client.HTTPResponse(cast(socket.socket, DeadlineSocket(sock, deadline)), method=method)
            exchange = Exchange(sock, response, deadline, unregister)
            response.begin()  # the status line and headers: http.client bounds their sizes
            if control is not None and control.cancelled:
                raise ConnectionAbortedError("cancelled")
        except (OSError, http.client.HTTPException, ValueError) as exc:
            unregister()
            connected = sock is not None and _connected(sock)
            if sock is not None:
                sock.close()
            raise self._failure(exc, where, deadline, connected) from None
        if not 200 <= response.status < 300:
            try:
                raise self._status_error(exchange, where)
            finally:
                exchange.close()
        return exchange

    def _connect(self, deadline: Deadline, control: RunControl | None) -> tuple[socket.socket, Callable[[], None]]:
        """A connected socket (TLS for https) and its closer's unregistration; OSError if none."""
        family, kind, proto, _, address = socket.getaddrinfo(self._host, self._port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        unregister = control.on_cancel(lambda: shutdown(sock)) if control is not None else (lambda: None)
        try:
            sock.settimeout(deadline.left())
            sock.connect(address)
            if control is not None and control.cancelled:  # cancelled before the socket was connected
                raise ConnectionAbortedError("cancelled")
            if self._tls:  # the closer reads ``sock``, so it shuts down the TLS socket from here on
                sock = ssl.create_default_context().wrap_socket(sock, server_hostname=self._host)
        except BaseException:
            unregister()
            sock.close()
            raise
        return sock, unregister

    def _send(self, sock: socket.socket, deadline: Deadline, method: str, path: str,
              body: dict[str, Any] | None) -> None:
        data = json.dumps(body, allow_nan=False).encode() if body is not None else b""
        host = self._host if ":" not in self._host else f"[{self._host}]"
        head = [f"{method} {self._base}{path} HTTP/1.1", f"Host: {host}:{self._port}", "Connection: close",
                "Accept: application/json, text/event-stream", "User-Agent: decoding-playground"]
        if body is not None:
            head += ["Content-Type: application/json", f"Content-Length: {len(data)}"]
        sock.settimeout(deadline.left())  # sendall: the timeout bounds the whole send
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode("ascii") + data)

    def _status_error(self, exchange: Exchange, where: str) -> RemoteError:
        status = exchange.response.status
        if 300 <= status < 400:
            return RemoteError(f"{where}: HTTP {status}, a redirect: not followed (only the address the operator "
                               "listed is used)")
        try:
            detail = exchange.response.read(MAX_ERROR_BYTES)
        except (OSError, http.client.HTTPException, ValueError):
            detail = b""
        return RemoteError(f"{where}: HTTP {status}: {error_detail(detail)}")

    def _read(self, exchange: Exchange, read: Callable[[], Any], where: str) -> Any:
        """``read()`` on the open response; a timeout, a closed or broken connection raises
        RemoteError, or RunStopped when the run was cancelled or its time limit passed (a socket
        shut down by the cancel reads as its end: that is the cancel, not the answer's end)."""
        try:
            data = read()
        except (OSError, http.client.HTTPException, ValueError) as exc:
            failure: Exception | None = self._failure(exc, where, exchange.deadline, connected=True)
        else:
            failure = None
        if failure is not None:  # raised here, not in the except: the read's frames (and the buffers they hold) are freed
            raise failure
        control = exchange.deadline.control
        if control is not None and control.cancelled:
            raise RunStopped("cancelled", "stopped: the run was cancelled")
        return data

    def _failure(self, exc: Exception, where: str, deadline: Deadline, connected: bool) -> Exception:
        """One line for a failure to connect or to read: the run's own stop (cancelled: the socket
        was shut down under the read; past its time limit), a timeout, a refused or broken
        connection."""
        control = deadline.control
        if control is not None and control.cancelled:
            return RunStopped("cancelled", "stopped: the run was cancelled")
        timed_out = isinstance(exc, (TimeoutError, socket.timeout)) or time.monotonic() >= deadline.at
        if timed_out and deadline.by_run and not deadline.quiet and control is not None:
            return control.time_limit_error()
        if timed_out and deadline.quiet_s is not None and not deadline.quiet:
            return RemoteError(f"{where}: the stream did not end within its {self.stream_s:g} s limit")
        if timed_out:
            return RemoteError(f"{where}: no answer within the {self.timeout_s:g} s timeout")
        if isinstance(exc, http.client.HTTPException) and not isinstance(exc, (http.client.IncompleteRead,
                                                                              http.client.RemoteDisconnected)):
            return RemoteError(f"{where}: the answer is not valid HTTP ({type(exc).__name__})")
        if connected or isinstance(exc, http.client.HTTPException):
            return RemoteError(f"{where}: the connection broke off ({type(exc).__name__})")
        return RemoteError(f"{where}: cannot connect ({exc}; timeout {self.timeout_s:g} s)")

    def _parse(self, text: bytes, where: str) -> Any:
        try:
            return strict_loads(text)
        except ValueError as exc:
            raise RemoteError(f"{where}: the answer is not JSON ({str(exc)[:120]})") from None


def _connected(sock: socket.socket) -> bool:
    try:
        sock.getpeername()
        return True
    except OSError:
        return False


def error_detail(body: bytes) -> str:
    """An error reply in one line: its ``error.message`` (OpenAI's and vLLM's ErrorResponse,
    llama-server's) when it has one, else its text, cut to 300 characters."""
    text = body[:MAX_ERROR_BYTES].decode("utf-8", "replace")
    try:
        error = strict_loads(text).get("error")
        message = error.get("message") if isinstance(error, dict) else None
    except (ValueError, AttributeError):
        message = None
    return " ".join(str(message or text).split())[:300]
