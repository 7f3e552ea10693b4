"""Fake served-model servers for the fault tests (issue #34): a llama-server (native /completion)
and an OpenAI-compatible server (vLLM's /v1/completions), each a socket thread on 127.0.0.1 that
answers well, or with one fault on its run requests (``FakeServer.fault``): a 600 MB line without
a newline, a stream that never ends, a 200 MB body, one byte per second, a redirect to another
loopback listener, a number, an id or a type that is wrong, or keep-alive comments (or events that
carry no token) forever. Either also answers vLLM's /metrics when given a page (``FakeServer.metrics``).

Every loop here is bounded in count and in time: a lazy answer is sent in 64 KiB pieces and stops
when the client closes, at its size, or after ``SEND_LIMIT_S``; a connection's reads time out;
``FakeServer.close`` stops the accept loop. Nothing listens beyond 127.0.0.1.
"""

from __future__ import annotations

import json
import math
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

VOCAB = 1000
EOS = 2
TOP_IDS = list(range(10, 110))  # the fake model's top-100, most likely first
SEND_LIMIT_S = 60.0  # no answer of a fake server lasts longer
PING_S = 0.05  # a "pings" or "empty" fault's pause between two comments or events
PIECE = 64 << 10


def logprobs(n: int) -> list[float]:
    """Log-probabilities of the top ``n`` (geometric, adding up to < 1): the fake model's."""
    weights = [0.5 ** (i + 1) for i in range(n)]
    return [math.log(w) for w in weights]


def piece(token: int) -> str:
    return f" t{token}"


# --- the two APIs' good answers --------------------------------------------------------------------
def llama_top(n: int, key: str = "logprob") -> list[dict[str, Any]]:
    lps = logprobs(n)
    return [{"id": t, "token": piece(t), "bytes": list(piece(t).encode()),
             key: lp if key == "logprob" else math.exp(lp)} for t, lp in zip(TOP_IDS, lps)]


def generated(n: int) -> list[int]:
    """The fake model's text: its most likely token, then the next, ... (never EOS)."""
    return [TOP_IDS[i % 5] for i in range(n)]


def llama_step(body: dict) -> dict:
    top = llama_top(int(body.get("n_probs", 10)))
    return {"completion_probabilities": [{"id": top[0]["id"], "logprob": top[0]["logprob"], "top_logprobs": top}],
            "tokens": [top[0]["id"]], "stop": True, "stop_type": "limit"}


def llama_event(token: int, n: int, key: str = "prob") -> dict:
    """A streamed token: its top-N after the sampler (``key`` "prob": fast mode's stream) or the model's
    (``key`` "logprob": ``post_sampling_probs`` false, step mode's streamed continuation)."""
    top = llama_top(n, key)
    value, tops = (0.5, "top_probs") if key == "prob" else (math.log(0.5), "top_logprobs")
    return {"completion_probabilities": [{"id": token, "token": piece(token), "bytes": list(piece(token).encode()),
                                          key: value, tops: top}], "tokens": [token], "stop": False}


def llama_key(body: dict) -> str:
    """The probabilities a /completion request asks: after the sampler ("prob") or the model's."""
    return "prob" if body.get("post_sampling_probs") else "logprob"


LLAMA_LAST = {"stop": True, "stop_type": "limit", "timings": {"predicted_n": 0, "predicted_ms": 1.5}}


def llama_whole(body: dict) -> dict:
    """A whole fast-mode answer (the raw second request): the same tokens as the stream."""
    n, top_n = int(body["n_predict"]), int(body["n_probs"])
    key = "prob" if body.get("post_sampling_probs") else "logprob"
    entries = [{"id": t, "token": piece(t), key: (0.5 if key == "prob" else math.log(0.5)),
                ("top_probs" if key == "prob" else "top_logprobs"): llama_top(top_n, key)} for t in generated(n)]
    return {"completion_probabilities": entries, "tokens": generated(n), "stop": True}


def openai_logprobs(tokens: list[int], n: int) -> dict:
    lps = logprobs(n)
    top = {f"token_id:{t}": lp for t, lp in zip(TOP_IDS, lps)}
    return {"tokens": [f"token_id:{t}" for t in tokens], "token_logprobs": [math.log(0.5)] * len(tokens),
            "top_logprobs": [dict(top) for _ in tokens]}


def openai_step(body: dict) -> dict:
    return {"choices": [{"index": 0, "text": piece(TOP_IDS[0]), "logprobs": openai_logprobs([TOP_IDS[0]],
                                                                                          int(body["logprobs"])),
                         "finish_reason": "length", "stop_reason": None}]}


def openai_event(token: int, n: int, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "text": piece(token), "logprobs": openai_logprobs([token], n),
                         "finish_reason": finish, "stop_reason": None}]}


def sse(event: Any) -> bytes:
    return b"data: " + (event if isinstance(event, bytes) else json.dumps(event).encode()) + b"\n\n"


# --- faults ----------------------------------------------------------------------------------------
BAD = "@@BAD@@"  # where a bad value goes in an answer; replaced by the fault's raw JSON text


@dataclass
class Fault:
    """What a fake server does to its run requests (/completion, /v1/completions; ``paths``: also
    others). ``kind``: "value" (``raw`` JSON text put at ``at`` in the good answer; ``at`` "flat": at
    every log-probability of it), "huge_line", "forever", "comments", "pings" (a keep-alive comment
    every PING_S, never an event), "empty" (an event without a token every PING_S), "huge_body",
    "declared_body", "slow", "redirect". ``only``: "stream" or "whole" to touch only streamed or only
    whole answers (a stream's faults: streams only)."""

    kind: str
    at: str = ""
    raw: str = ""
    paths: tuple[str, ...] = ()
    only: str = ""

    def applies(self, stream: bool) -> bool:
        only = self.only or ("stream" if self.kind in ("forever", "comments", "pings", "empty") else "")
        return not only or only == ("stream" if stream else "whole")


# Where a value fault goes, per backend and mode: a function that puts BAD into a good answer (step mode's:
# a one-token answer or an event of its streamed continuation, both with the model's log-probabilities).
# ``at`` "flat": every log-probability (or probability) of the answer, the token's own and its whole top-N.
def _every(entries: list[dict], key: str) -> None:
    for entry in entries:
        entry[key] = BAD


def _llama_step_at(answer: dict, at: str) -> None:
    entry = answer["completion_probabilities"][0]
    {"id": lambda: entry["top_logprobs"][0].__setitem__("id", BAD),
     "logprob": lambda: entry["top_logprobs"][0].__setitem__("logprob", BAD),
     "flat": lambda: _every([entry, *entry["top_logprobs"]], "logprob"),
     "top": lambda: entry.__setitem__("top_logprobs", BAD),
     "list": lambda: answer.__setitem__("completion_probabilities", BAD)}[at]()


def _llama_fast_at(event: dict, at: str) -> None:
    entry = event["completion_probabilities"][0]
    {"id": lambda: entry.__setitem__("id", BAD),
     "logprob": lambda: entry["top_probs"][0].__setitem__("prob", BAD),
     "flat": lambda: _every([entry, *entry["top_probs"]], "prob"),
     "prob": lambda: entry.__setitem__("prob", BAD),
     "top": lambda: entry.__setitem__("top_probs", BAD),
     "list": lambda: event.__setitem__("completion_probabilities", BAD)}[at]()


def _openai_at(answer: dict, at: str) -> None:
    choice = answer["choices"][0]
    logprobs = choice["logprobs"]
    first = next(iter(logprobs["top_logprobs"][0]))
    {"id": lambda: logprobs["tokens"].__setitem__(0, "token_id:" + BAD),
     "logprob": lambda: logprobs["top_logprobs"][0].__setitem__(first, BAD),
     "flat": lambda: (logprobs["token_logprobs"].__setitem__(0, BAD),
                      logprobs["top_logprobs"][0].update(dict.fromkeys(logprobs["top_logprobs"][0], BAD))),
     "prob": lambda: logprobs["token_logprobs"].__setitem__(0, BAD),
     "top": lambda: logprobs["top_logprobs"].__setitem__(0, BAD),
     "list": lambda: answer.__setitem__("choices", BAD)}[at]()


def with_bad(answer: dict, put: Callable[[dict, str], None], fault: Fault) -> bytes:
    """``answer`` as JSON text with the fault's raw text where ``put`` placed BAD."""
    put(answer, fault.at)
    text = json.dumps(answer)
    if f'"token_id:{BAD}"' in text:  # inside a string: the raw text stays a string's content
        return text.replace(BAD, fault.raw.strip('"')).encode()
    return text.replace(f'"{BAD}"', fault.raw).encode()


# --- the server ------------------------------------------------------------------------------------
@dataclass
class Request:
    method: str
    path: str
    body: dict


@dataclass
class FakeServer:
    """A fake ``backend`` ("llamacpp" | "openai") on 127.0.0.1: ``url`` is what an operator lists
    (openai: its /v1); ``fault`` applies to run requests; ``requests`` counts what it was asked,
    ``sent`` the bytes its run answers sent, ``open`` the connections it is answering now.
    ``metrics``: what GET /metrics answers (called per read: a page can change), as vLLM's text."""

    backend: str
    fault: Fault | None = None
    redirect_to: str = ""
    metrics: Callable[[], bytes] | None = None
    requests: list[str] = field(default_factory=list)
    sent: int = 0
    open: int = 0

    def __post_init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.port = self.listener.getsockname()[1]
        self._stop = threading.Event()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return self.root + ("/v1" if self.backend == "openai" else "")

    @property
    def spec(self) -> str:
        """The DP_REMOTE_MODELS item listing it (openai: with its vocabulary and EOS)."""
        return f"llamacpp:{self.url}" if self.backend == "llamacpp" else f"openai:{self.url}#vocab={VOCAB}&eos={EOS}"

    def close(self) -> None:
        self._stop.set()
        self.listener.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except (TimeoutError, OSError):
                continue
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with self._lock:
            self.open += 1
        with conn:
            conn.settimeout(10)
            try:
                request = read_request(conn)
                with self._lock:
                    self.requests.append(request.path)
                self._answer(conn, request)
            except OSError:  # the client closed: what a bounded client does
                pass
            finally:
                with self._lock:
                    self.open -= 1

    def _answer(self, conn: socket.socket, request: Request) -> None:
        fault = self.fault
        run = request.path in ("/completion", "/v1/completions")
        if fault is not None and (run or request.path in fault.paths) and fault.applies(bool(request.body.get("stream"))):
            return self._faulty(conn, request, fault)
        if request.path in ("/completion", "/v1/completions") and request.body.get("stream"):
            return self._send(conn, "text/event-stream", self._stream(request.body), None)
        if request.path == "/metrics" and self.metrics is not None:
            page = self.metrics()
            return self._send(conn, "text/plain; version=0.0.4", [page], len(page))
        answer = self._good(request)
        if answer is None:
            return send(conn, 404, b'{"error": {"message": "not found"}}')
        send(conn, 200, json.dumps(answer).encode())

    def _good(self, request: Request) -> Any:
        path, body = request.path, request.body
        if path in ("/v1/models", "/models"):
            model = {"id": "fake", "max_model_len": 4096}
            return {"data": [model | ({"meta": {"n_vocab": VOCAB, "n_ctx": 4096}} if self.backend == "llamacpp" else {})]}
        if path == "/props":
            return {"eos_token": "</s>", "chat_template": "{{ messages }}"}
        if path == "/tokenize":
            text = body.get("content", body.get("prompt", ""))
            return {"tokens": [EOS] if text == "</s>" else [3 + ord(c) % 900 for c in str(text)]}
        if path == "/detokenize":
            # EOS reads back as the text /props names and /tokenize maps to it (connecting checks both)
            text = "".join("</s>" if t == EOS else piece(t) for t in body.get("tokens", []))
            return {"content": text} if self.backend == "llamacpp" else {"prompt": text}
        if path == "/apply-template":
            return {"prompt": "User: " + str(body["messages"][0]["content"])}
        if path == "/completion":  # step mode asks one token and sends no seed; fast mode's whole request does
            return llama_step(body) if body.get("n_predict") == 1 and "seed" not in body else llama_whole(body)
        if path == "/v1/completions":
            return openai_step(body)
        return None

    def _stream(self, body: dict) -> Iterator[bytes]:
        n = int(body.get("n_predict", body.get("max_tokens", 1)))
        top_n = int(body.get("n_probs", body.get("logprobs", 10)))
        for i, token in enumerate(generated(n)):
            if self.backend == "llamacpp":
                yield sse(llama_event(token, top_n, llama_key(body)))
            else:
                yield sse(openai_event(token, top_n, "length" if i == n - 1 else None))
        yield sse(LLAMA_LAST) if self.backend == "llamacpp" else sse(b"[DONE]")

    def _faulty(self, conn: socket.socket, request: Request, fault: Fault) -> None:
        stream = bool(request.body.get("stream"))
        kind = "text/event-stream" if stream else "application/json"
        if fault.kind == "redirect":
            return send(conn, 302, b"", [("Location", self.redirect_to + request.path)])
        if fault.kind == "value":
            return self._send(conn, kind, [self._bad_value(request, fault)], None)
        if fault.kind == "huge_line":  # 600 MB with no newline, sent lazily
            return self._send(conn, kind, repeat(b"data: " if stream else b"", b"a", 600 << 20), None)
        if fault.kind == "huge_body":  # 200 MB, no Content-Length: it ends when the connection does
            return self._send(conn, kind, repeat(b'{"completion_probabilities": [', b"{}, ", 200 << 20), None)
        if fault.kind == "declared_body":  # 200 MB said up front
            return self._send(conn, kind, repeat(b"[", b"0, ", 200 << 20), 200 << 20)
        if fault.kind == "forever":  # well-formed tokens, never the last chunk
            top_n = int(request.body.get("n_probs", request.body.get("logprobs", 10)))
            event = sse(llama_event(TOP_IDS[0], top_n, llama_key(request.body)) if self.backend == "llamacpp"
                        else openai_event(TOP_IDS[0], top_n))
            return self._send(conn, kind, (event for _ in range(10**6)), None)
        if fault.kind == "comments":  # comment lines, never an event
            return self._send(conn, kind, (b": ping\n" * 9000 for _ in range(10**6)), None)
        if fault.kind in ("pings", "empty"):  # a keep-alive comment, or an event without a token, every PING_S
            nothing = {"completion_probabilities": [], "tokens": []} if self.backend == "llamacpp" else {"choices": []}
            empty = sse(nothing)
            return self._send(conn, kind, (b": ping\n\n" if fault.kind == "pings" else empty for _ in range(10**6)),
                              None, pause_s=PING_S)
        if fault.kind == "slow":  # a good answer, one byte per second
            good = b"".join(self._stream(request.body)) if stream else json.dumps(self._good(request)).encode()
            return self._send(conn, kind, (good[i:i + 1] for i in range(len(good))), None, pause_s=1.0)
        raise ValueError(f"unknown fault {fault.kind!r}")

    def _bad_value(self, request: Request, fault: Fault) -> bytes:
        body, stream = request.body, bool(request.body.get("stream"))
        top_n = int(body.get("n_probs", body.get("logprobs", 10)))
        if self.backend == "llamacpp":
            if stream:  # fast mode's stream (after the sampler), or step mode's streamed continuation
                key = llama_key(body)
                put = _llama_step_at if key == "logprob" else _llama_fast_at
                event = with_bad(llama_event(TOP_IDS[0], top_n, key), put, fault)
                return sse(event) + sse(LLAMA_LAST)
            if request.path == "/completion":
                return with_bad(llama_step(body), _llama_step_at, fault)
        elif request.path == "/v1/completions":
            if stream:
                return sse(with_bad(openai_event(TOP_IDS[0], top_n, "length"), _openai_at, fault)) + sse(b"[DONE]")
            return with_bad(openai_step(body), _openai_at, fault)
        text = json.dumps(self._good(request))  # a path of fault.paths: the vocabulary, or the model id
        return text.replace(f'"n_vocab": {VOCAB}', f'"n_vocab": {fault.raw}').replace('"id": "fake"',
                                                                                   f'"id": {fault.raw}').encode()

    def _send(self, conn: socket.socket, kind: str, pieces: Any, length: int | None, pause_s: float = 0.0) -> None:
        """Headers, then ``pieces`` one by one until they end, the client closes (OSError) or
        SEND_LIMIT_S passes."""
        headers = [("Content-Type", kind)] + ([("Content-Length", str(length))] if length is not None else [])
        send(conn, 200, None, headers)
        deadline = time.monotonic() + SEND_LIMIT_S
        for chunk in pieces:
            if time.monotonic() > deadline or self._stop.is_set():
                return
            conn.sendall(chunk)
            with self._lock:
                self.sent += len(chunk)
            if pause_s:
                time.sleep(pause_s)


def repeat(head: bytes, unit: bytes, total: int) -> Iterator[bytes]:
    """``head`` then ``unit`` repeated to ``total`` bytes, in PIECE-sized pieces, made as sent."""
    yield head
    block = unit * (PIECE // len(unit))
    for _ in range(total // len(block)):
        yield block


def read_request(conn: socket.socket) -> Request:
    """One HTTP request (headers at most 64 KiB, a body at most 1 MiB)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk or len(data) > 65536:
            raise OSError("no request")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = min(int(headers.get("content-length", "0")), 1 << 20)
    while len(rest) < length:
        chunk = conn.recv(65536)
        if not chunk:
            break
        rest += chunk
    return Request(method, path, json.loads(rest) if rest else {})


def send(conn: socket.socket, status: int, body: bytes | None, headers: list[tuple[str, str]] = ()) -> None:
    """A response head (and ``body``, with its length, when given); HTTP/1.1, the connection closes."""
    reason = {200: "OK", 302: "Found", 404: "Not Found"}.get(status, "Status")
    head = [f"HTTP/1.1 {status} {reason}", "Connection: close", *(f"{k}: {v}" for k, v in headers)]
    if body is not None:
        head.append(f"Content-Length: {len(body)}")
    conn.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + (body or b""))


class CountingListener:
    """A loopback listener the operator did not list: it counts the connections that reach it
    (a redirect followed would be one) and closes them."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.connections = 0
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except (TimeoutError, OSError):
                continue
            self.connections += 1
            conn.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 20\r\n\r\nSECRET-INTERNAL-DATA")
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self.listener.close()


def rss_mb() -> float:
    """This process's resident memory (VmRSS), in MB."""
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


class PeakRss:
    """The peak of ``rss_mb`` while the block runs (sampled every 20 ms by a thread)."""

    def __enter__(self) -> "PeakRss":
        self.before = self.peak = rss_mb()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, rss_mb())

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(5)
        self.after = rss_mb()
        self.peak = max(self.peak, self.after)

    @property
    def growth(self) -> float:
        """Peak minus before, MB."""
        return self.peak - self.before


# --- in a process of its own ------------------------------------------------------------------------
class FakeServerProcess:
    """A FakeServer in a child process (``python -m tests.helpers.fault_servers <backend>``), as a real
    server is: its work never competes with the app for this process's GIL, so a local user timed
    beside it measures the app. Driven over the child's stdin/stdout, a JSON line each way; the
    same attributes as FakeServer (``fault`` and ``redirect_to`` set, ``open`` / ``sent`` read)."""

    def __init__(self, backend: str, fault: Fault | None = None, redirect_to: str = ""):
        import subprocess
        import sys
        from pathlib import Path

        self.backend = backend
        self._process = subprocess.Popen([sys.executable, "-m", "tests.helpers.fault_servers", backend],
                                         cwd=Path(__file__).resolve().parents[2], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True)
        self._lock = threading.Lock()
        self.port = json.loads(self._process.stdout.readline())["port"]
        self.fault, self.redirect_to = fault, redirect_to

    def _ask(self, message: dict) -> dict:
        with self._lock:
            self._process.stdin.write(json.dumps(message) + "\n")
            self._process.stdin.flush()
            return json.loads(self._process.stdout.readline())

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name == "fault":
            self._ask({"fault": None if value is None else value.__dict__})
        elif name == "redirect_to":
            self._ask({"redirect_to": value})

    @property
    def open(self) -> int:
        return self._ask({"stats": True})["open"]

    @property
    def runs(self) -> int:
        """Run requests (/completion, /v1/completions) received so far."""
        return self._ask({"stats": True})["runs"]

    @property
    def sent(self) -> int:
        return self._ask({"stats": True})["sent"]

    root, url, spec = FakeServer.root, FakeServer.url, FakeServer.spec

    def close(self) -> None:
        self._process.stdin.close()
        try:
            self._process.wait(10)
        except Exception:  # noqa: BLE001 (a child that will not stop is killed)
            self._process.kill()


def serve(backend: str) -> None:
    """The child's side: a FakeServer, its port on stdout, then one JSON command a line on stdin
    (``fault``, ``redirect_to``, ``stats``), each answered with a JSON line, until stdin closes."""
    import sys

    server = FakeServer(backend)
    print(json.dumps({"port": server.port}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if "fault" in command:
            server.fault = None if command["fault"] is None else Fault(**{**command["fault"],
                                                                           "paths": tuple(command["fault"]["paths"])})
        if "redirect_to" in command:
            server.redirect_to = command["redirect_to"]
        runs = sum(1 for path in list(server.requests) if path in ("/completion", "/v1/completions"))
        print(json.dumps({"open": server.open, "sent": server.sent, "runs": runs}), flush=True)
    server.close()


if __name__ == "__main__":
    import sys

    serve(sys.argv[1])
