"""A served model as a model (issue #29): llama.cpp's ``llama-server`` (its native ``/completion``)
or any OpenAI-compatible server (vLLM, SGLang, llama-server's own ``/v1``).

One implementation of the modes, two small API classes for the requests (``LlamaCppApi``,
``OpenAIApi``: tokenize, detokenize, chat ids, ``next_top`` = the raw top-N after some ids,
``generate`` = fast mode's streamed answer). Both modes end in an ordinary engine ``Trace``, run
through ``engine.runner.stream`` (the registry is keyed by ``RemoteModel.backend``;
``RemoteModel.mode`` picks the mode):

- **step mode** (``stream_step``, the default): one request per token (one token generated, top-N
  log-probabilities; the server's prefix cache re-reads only the new token). The raw top-N become
  logits (log p inside the top-N, -inf outside); our own stage chain and our own seeded draw
  (``engine.core.RunState``, the local engine's loop body) pick the token. Exact up to the
  truncation to the top-N, which the trace labels (the tail mass per step).
- **fast mode**: one streamed request for the whole text (Server-Sent Events: a step is shown as
  its token arrives); the server's sampler picks (its own random generator: the same seed gives a
  different text than ours). Each step shows the server's top-N (llama.cpp: final and, from a
  second request with the same seed after the stream, raw; OpenAI: its ``logprobs``).

``RemoteModel`` quacks like ``engine.models.LoadedModel`` where the decoding loop needs it
(tokenizer, EOS ids, vocabulary size, token text, decode). Every request has a timeout; a server
that is down, slow or answers an error raises ``RemoteError`` with one line naming the URL.

Which of our knobs a server's sampler cannot express is listed per fast-mode run (``unmapped``),
with the knobs that map with a difference (``caveats``); llama.cpp's ``samplers`` list follows our
stage order.
"""

from __future__ import annotations

import http.client
import json
import math
import socket
import time
import urllib.error
import urllib.request
from contextlib import closing
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Sequence

import torch

from .config import KNOBS, DecodingConfig
from .core import RunState, assemble
from .sampling import NoTokensLeft
from .interop import LLAMA_SAMPLER, LLAMA_UNMAPPED, PENALTY_STAGES, Note
from .settings import SettingsError, env_list
from .trace import Event, StageTrace, StepTrace, TokenProb, Trace

BACKENDS = ("llamacpp", "openai")
DEFAULT_TIMEOUT_S = 30.0
MODES = ("step", "fast")
STEP_TOP_N = 100  # step mode: tokens per step the server returns (our chain works over these)
STOP_TYPES = {"eos": "eos", "word": "stop_string", "limit": "max_new_tokens"}  # llama.cpp -> ours
STRATEGIES = ("greedy", "sample")  # what a remote model runs so far
# Our stages llama.cpp has no sampler for (interop's reasons), plus the word constraints.
UNMAPPED = {**LLAMA_UNMAPPED, "allowed_words": "llama.cpp has no word allow-list (a grammar would be needed)",
            "banned_words": "llama.cpp bans token ids (logit_bias false), not words"}


class RemoteError(RuntimeError):
    """A remote server is unreachable, slow, or answered something we cannot use (one line)."""


# --- the operator's list ---------------------------------------------------------------------------
@dataclass(frozen=True)
class RemoteSpec:
    """``backend:url[#vocab=V&eos=A+B&top=N]``, e.g. ``llamacpp:http://127.0.0.1:8080`` or
    ``openai:http://gpu1:8000/v1#vocab=128256&eos=128001+128009``: vLLM's API reports neither its
    vocabulary size nor its EOS ids, so the operator gives them (llama-server reports both: no options).
    ``top``: step mode's tokens per step (default STEP_TOP_N), for a vLLM started with a lower
    ``--max-logprobs`` (its default is 20)."""

    backend: str
    url: str
    vocab_size: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    top_n: int | None = None

    @classmethod
    def parse(cls, text: str, key: str = "model") -> "RemoteSpec":
        base, _, options = text.partition("#")
        backend, _, url = base.partition(":")
        if backend not in BACKENDS or not url.startswith(("http://", "https://")):
            raise ValueError(f"{key}: expected {' | '.join(BACKENDS)}:http://host:port, got {text[:80]!r}")
        found: dict[str, tuple[int, ...]] = {}
        for option in filter(None, options.split("&")):
            name, _, value = option.partition("=")
            numbers = value.split("+")
            if backend != "openai" or name not in ("vocab", "eos", "top") or not all(n.isdigit() for n in numbers) \
                    or (name != "eos" and len(numbers) != 1) or (name == "top" and not 1 <= int(value) <= 1000):
                raise ValueError(f"{key}: option {option[:40]!r} in {text[:80]!r}: expected openai:...#vocab=<n>"
                                 "&eos=<id>+<id>[&top=<1..1000>] (llamacpp reports both itself)")
            found[name] = tuple(int(n) for n in numbers)
        return cls(backend, url.rstrip("/"), *found.get("vocab", (None,)), found.get("eos", ()),
                   *found.get("top", (None,)))

    def __str__(self) -> str:
        options = ([f"vocab={self.vocab_size}"] if self.vocab_size else []) + \
            ([f"eos={'+'.join(map(str, self.eos_token_ids))}"] if self.eos_token_ids else []) + \
            ([f"top={self.top_n}"] if self.top_n else [])
        return f"{self.backend}:{self.url}" + ("#" + "&".join(options) if options else "")


def allowed_remote_models(environ: Any = None) -> tuple[RemoteSpec, ...]:
    """The remote models the operator allows (``DP_REMOTE_MODELS``); a malformed item raises
    SettingsError naming it. A page user can never add one."""
    try:
        return tuple(RemoteSpec.parse(item, "DP_REMOTE_MODELS") for item in env_list("DP_REMOTE_MODELS", environ))
    except ValueError as exc:
        raise SettingsError(str(exc)) from None


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


# --- the model -------------------------------------------------------------------------------------
# A token of a server's top-N: (id, log-probability, its text when the server sent it, else None).
Entry = tuple[int, float, "str | None"]


@dataclass
class FastToken:
    """One token of a fast-mode generation as it streams in: its id, the probability the server
    picked it with, and the server's top-N (``final``: after its sampler; ``raw``: the model's),
    either None when the backend does not send it."""

    token: int
    prob: float
    final: list[Entry] | None
    raw: list[Entry] | None
    raw_prob: float | None = None  # its raw p when it lies outside ``raw`` (vLLM sends it as an N+1st entry)


@dataclass
class FastAnswer:
    """How a fast-mode generation ended (after its FastTokens): why it stopped, what the run
    approximates, the knobs the server did not run as ours (``notes``), the server's timings, and
    ``raw``: the raw top-N per token from llama.cpp's second request (None when not asked or left
    out; it may cover fewer tokens than were streamed, see ``LlamaCppApi.generate``); ``final``:
    (probability, top-N after the sampler) per token from a whole request, for tokens the stream
    sent without them (llama-server's own speculation; None when none lacked them)."""

    finish_reason: str
    approximations: list[str]
    notes: dict[str, list[dict[str, str]]]
    timings: dict[str, Any] = field(default_factory=dict)
    raw: list[list[Entry]] | None = None
    final: list[tuple[float, list[Entry]]] | None = None


@dataclass
class RemoteTokenizer:
    """The server's tokenizer, as the stages call a tokenizer (``encode`` without special tokens,
    ``decode`` of one token for DRY's breakers); answers are memoised."""

    api: Any  # LlamaCppApi | OpenAIApi
    _pieces: dict[int, str] = field(default_factory=dict, repr=False)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.api.tokenize(text, add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        if len(ids) == 1 and ids[0] in self._pieces:
            return self._pieces[ids[0]]
        text = self.api.detokenize(ids) if ids else ""
        if len(ids) == 1:
            self._pieces[ids[0]] = text
        return text


@dataclass
class RemoteModel:
    """A served model, shaped like ``LoadedModel`` where the decoding loop reads it; ``api`` speaks
    its backend's requests (LlamaCppApi, OpenAIApi), everything else is shared."""

    name: str
    api: Any  # LlamaCppApi | OpenAIApi
    tokenizer: RemoteTokenizer
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    context: int = 4096  # the server's context length (n_ctx)
    chat_template: bool = True  # the server has one (its /props)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    quantization: str = "server"
    mode: str = "step"  # how runner.stream runs greedy/sample on it: "step" (our chain) or "fast" (it samples)
    top_n: int = STEP_TOP_N  # step mode: tokens per step the server returns

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode: expected {' or '.join(MODES)}, got {self.mode!r}")
        if not 1 <= self.top_n <= 1000:
            raise ValueError(f"top_n: expected 1..1000 tokens per step, got {self.top_n!r}")

    def with_mode(self, mode: str, top_n: int | None = None) -> "RemoteModel":
        """The same server (client and memoised token texts shared) run in ``mode``."""
        return replace(self, mode=mode, top_n=self.top_n if top_n is None else top_n)

    @property
    def backend(self) -> str:
        """Which API it speaks; engine.runner looks its strategies up by this."""
        return self.api.backend

    @property
    def client(self) -> JsonClient:
        return self.api.client

    @property
    def url(self) -> str:
        return self.client.url

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        """The prompt's ids as the server reads a text prompt (its chat template when ``chat``)."""
        if chat:
            if not self.chat_template:
                raise ValueError(f"chat: the model at {self.url} has no chat template; turn the chat template off")
            return self.api.chat_ids(prompt)
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([i for i in ids if i not in self.eos_token_ids])

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def learn_pieces(self, entries: Sequence[Entry]) -> None:
        """Memoise token texts the server sent with its probabilities."""
        for token, _, piece in entries:
            if piece is not None:
                self.tokenizer._pieces.setdefault(token, piece)


def _piece(entry: dict[str, Any]) -> str | None:
    """A llama-server top-N entry's text, from its ``bytes`` (a token may be part of a character)."""
    raw = entry.get("bytes")
    return bytes(raw).decode("utf-8", "replace") if raw is not None else entry.get("token")


def _llama_entries(top: list[dict[str, Any]], key: str = "logprob") -> list[Entry]:
    """llama-server's ``[{id, token, bytes, logprob | prob}]`` as Entries (log-probabilities)."""
    out = []
    for e in top:
        value = e.get(key)
        lp = -math.inf if value is None else float(value) if key == "logprob" else \
            (math.log(value) if value > 0 else -math.inf)
        out.append((int(e["id"]), lp, _piece(e)))
    return out


@dataclass
class LlamaCppApi:
    """llama-server's native API: /completion (``n_probs``, ``post_sampling_probs``, its sampler
    chain), /tokenize, /detokenize, /apply-template."""

    client: JsonClient
    context: int = 4096
    backend: str = "llamacpp"

    def tokenize(self, text: str, special: bool) -> list[int]:
        answer = self.client.post("/tokenize", {"content": text, "add_special": special, "parse_special": special})
        return [int(t) for t in answer["tokens"]]

    def detokenize(self, ids: list[int]) -> str:
        return self.client.post("/detokenize", {"tokens": ids})["content"]

    def chat_ids(self, prompt: str) -> list[int]:
        text = self.client.post("/apply-template", {"messages": [{"role": "user", "content": prompt}]})["prompt"]
        return self.tokenize(text, True)

    def next_top(self, ids: Sequence[int], top_n: int) -> list[Entry]:
        """The model's raw top-N after ``ids`` (one token generated by top-k 1, not used)."""
        answer = self.client.post("/completion", {
            "prompt": list(ids), "n_predict": 1, "n_probs": top_n, "post_sampling_probs": False,
            "cache_prompt": True, "samplers": ["top_k"], "top_k": 1, "return_tokens": True})
        try:
            return _llama_entries(answer["completion_probabilities"][0]["top_logprobs"])
        except (KeyError, IndexError, TypeError):
            raise RemoteError(f"llama.cpp server {self.client.url}/completion: no top_logprobs in the answer") \
                from None

    def positions(self, ids: Sequence[int], start: int, top_n: int) -> list[list[Entry]]:
        """The raw top-N after ``ids[:i]`` for i = start .. len(ids): one request each (the prefix
        cache re-reads one token); a token outside a top-N has no probability here."""
        return [self.next_top(ids[:i], top_n) for i in range(start, len(ids) + 1)]

    def generate(self, ids: Sequence[int], config: DecodingConfig, raw: bool) -> Iterator[FastToken | FastAnswer]:
        """Fast mode: one streamed request; its sampler chain runs ``config`` (``llamacpp_request``):
        a FastToken (with the top-N after its sampler) as each token is sampled, then the
        FastAnswer. ``raw``: after the stream, a second request (not streamed) with the same seed
        adds the raw top-N (left out, and said so, if it sampled another text)."""
        request = llamacpp_request(config, self.context)
        where = f"llama.cpp server {self.client.url}/completion"
        tokens: list[int] = []
        bare = 0  # tokens streamed without probabilities (accepted drafts of the server's own speculation)
        last: dict[str, Any] = {}
        body = self._body(ids, config, request, True) | {"stream": True}
        with closing(self.client.stream_post("/completion", body)) as chunks:  # closed: the server stops too
            for chunk in chunks:
                for token, entry in _chunk_tokens(chunk, where):
                    tokens.append(token)
                    if entry is None:
                        bare += 1
                        yield FastToken(token, math.nan, None, None)
                    else:
                        yield FastToken(token, float(entry["prob"]),
                                        _llama_entries(entry.get("top_probs") or [], "prob"), None)
                if chunk.get("stop"):
                    last = chunk
                    break
        if not last:
            raise RemoteError(f"{where}: the stream ended before its last chunk (stop: true)")
        approximations = ["the server sampled (its own generator and sampler code); no draw u is known",
                          "entropies are over the top-N only"]
        answer = FastAnswer(STOP_TYPES.get(last.get("stop_type", ""), "max_new_tokens"), approximations,
                            request.notes(), last.get("timings", {}))
        if raw:
            answer.raw = self._raw_tops(ids, config, request, tokens, approximations)
        if bare:
            answer.final = self._final_tops(ids, config, request, tokens, approximations, bare)
        yield answer

    def _final_tops(self, ids: Sequence[int], config: DecodingConfig, request: "LlamaRequest", tokens: list[int],
                    approximations: list[str], bare: int) -> list[tuple[float, list[Entry]]] | None:
        """(p, top-N after the sampler) of each of ``tokens`` from a whole request with the same
        seed: llama-server streams the drafts its own speculation accepted without probabilities
        (a whole answer has them). None, said, when it sampled another text."""
        again = self.client.post("/completion", self._body(ids, config, request, True))
        probs = again.get("completion_probabilities") or []
        if [int(t) for t in again.get("tokens") or [e["id"] for e in probs]] != tokens:
            approximations.append(f"{bare} tokens came from the server's own speculation without probabilities, and "
                                  "the request for them sampled another text: they have none")
            return None
        approximations.append(f"{bare} tokens came from the server's own speculation without probabilities (the "
                              "stream leaves them out); theirs are from a second, whole request with the same seed")
        return [(float(e["prob"]), _llama_entries(e.get("top_probs") or [], "prob")) for e in probs]

    def _raw_tops(self, ids: Sequence[int], config: DecodingConfig, request: "LlamaRequest", tokens: list[int],
                  approximations: list[str]) -> list[list[Entry]] | None:
        """The raw top-N of each of ``tokens`` from a second request with the same seed (None, said
        in ``approximations``, when it sampled another text). A whole (non-streamed) answer has no
        probabilities for the tokens that completed a stop string: those steps get none."""
        again = self.client.post("/completion", self._body(ids, config, request, False))
        probs = again.get("completion_probabilities") or []
        if [int(t) for t in again.get("tokens") or [e["id"] for e in probs]] != tokens:
            approximations.append("the raw request sampled another text: raw probabilities left out")
            return None
        if len(probs) < len(tokens):
            approximations.append("the tokens that completed a stop string have no raw top-N (llama.cpp leaves "
                                  "them out of a whole answer)")
        return [_llama_entries(e.get("top_logprobs") or []) for e in probs]

    def _body(self, ids: Sequence[int], config: DecodingConfig, request: "LlamaRequest",
              post_sampling: bool) -> dict[str, Any]:
        """A fast-mode /completion body: the mapped knobs; the top-N after its sampler
        (``post_sampling``) or the model's."""
        return {**request.fields, "prompt": list(ids), "n_predict": config.max_new_tokens, "n_probs": config.top_n,
                "post_sampling_probs": post_sampling, "cache_prompt": True, "return_tokens": True,
                "stop": list(config.stop)}


def _chunk_tokens(chunk: Any, where: str) -> list[tuple[int, dict[str, Any] | None]]:
    """A streamed /completion chunk's tokens, each with its ``completion_probabilities`` entry
    (``id``, ``prob``, ``top_probs``), none in the last chunk. A chunk of ``tokens`` without any
    entries is what llama-server streams for drafts its own speculation accepted: (id, None) each.
    Another shape raises RemoteError."""
    entries = chunk.get("completion_probabilities", []) if isinstance(chunk, dict) else None
    tokens = chunk.get("tokens") if isinstance(chunk, dict) else None
    if entries == [] and isinstance(tokens, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                                          for t in tokens):
        return [(t, None) for t in tokens]
    if not isinstance(entries, list) or len(entries) != len(tokens or entries) \
            or not all(isinstance(e, dict) and "id" in e and "prob" in e for e in entries):
        raise RemoteError(f"{where}: a streamed chunk without completion_probabilities (id, prob) per token")
    return [(int(e["id"]), e) for e in entries]


def connect(url: str, timeout_s: float = DEFAULT_TIMEOUT_S, mode: str = "step") -> RemoteModel:
    """A RemoteModel over the llama-server at ``url`` (asks it for its vocabulary and EOS), run by
    ``engine.runner`` in ``mode`` ("step": our chain over its top-N; "fast": it samples)."""
    client = JsonClient(url, timeout_s)
    models = client.get("/v1/models")
    try:
        info = models["data"][0]
        vocab, context = int(info["meta"]["n_vocab"]), int(info["meta"].get("n_ctx") or 4096)
    except (KeyError, IndexError, TypeError, ValueError):
        raise RemoteError(f"llama.cpp server {client.url}/v1/models: no model with meta.n_vocab in the answer") \
            from None
    api = LlamaCppApi(client, context)
    tokenizer = RemoteTokenizer(api)
    props = client.get("/props")
    eos_text = props.get("eos_token") or ""
    eos = tuple(tokenizer.encode(eos_text, add_special_tokens=True)) if eos_text else ()
    return check_served(RemoteModel(f"llamacpp:{client.url}", api, tokenizer, vocab, eos if len(eos) == 1 else (),
                                    context, bool(props.get("chat_template")), mode=mode))


# --- is it a model? --------------------------------------------------------------------------------
PROBE_TEXT = "The capital of France is"  # one request at connect: the answer after it must not be flat
FLAT_SPREAD = 1e-4  # nats: a model's top-N spans several; a model whose weights did not load answers all equal


def check_served(model: RemoteModel) -> RemoteModel:
    """``model`` when its server answers like a model that fits its tokenizer, else RemoteError in one
    line: every EOS id inside the vocabulary and read back by the tokenizer as itself; the tokenizer's
    ids inside the vocabulary; and, from one request after PROBE_TEXT, a top-N that is not flat (a
    checkpoint vLLM loads without the weights it reads answers every token at log 1/V) and inside the
    vocabulary. The request asks step mode's top-N, so a server whose logprobs limit is lower says so here."""
    where = f"{model.client.server} {model.url}"
    for eos in model.eos_token_ids:
        text = model.tokenizer.decode([eos]) if eos < model.vocab_size else ""
        again = model.tokenizer.encode(text, add_special_tokens=True) if text else []
        if again[-1:] != [eos]:
            raise RemoteError(f"{where}: EOS {eos} does not fit the tokenizer (it reads {text!r}, which tokenises as "
                              f"{again[:4]}; vocabulary {model.vocab_size}): give the model's own EOS ids (#eos=)")
    ids = model.tokenizer.encode(PROBE_TEXT, add_special_tokens=True)
    try:
        top = model.api.next_top(ids, model.top_n)
    except RemoteError as exc:
        hint = f" (step mode asks the top {model.top_n}: start vLLM with --max-logprobs {model.top_n}" \
               ", or list it with #top=<its limit>)" if "max allowed" in str(exc) else ""
        raise RemoteError(f"{exc}{hint}") from None
    outside = [t for t in ids + [t for t, _, _ in top] if t >= model.vocab_size]
    if outside:
        raise RemoteError(f"{where}: token {outside[0]} is outside the vocabulary of {model.vocab_size}: the "
                          "vocabulary does not fit the tokenizer (give the model's own size, #vocab=)")
    logprobs = [lp for _, lp, _ in top if math.isfinite(lp)]
    if len(logprobs) > 1 and max(logprobs) - min(logprobs) < FLAT_SPREAD:
        raise RemoteError(f"{where}: the served model answers a uniform distribution (its top {len(logprobs)} "
                          f"log-probabilities are all {logprobs[0]:.4f} = log 1/{round(math.exp(-logprobs[0]))}): "
                          "its weights did not load")
    model.learn_pieces(top)
    return model


# --- the OpenAI-compatible API (vLLM, SGLang, llama-server's /v1) ---------------------------------
VOCAB_BOUND = 262_144  # ids a server that does not report its vocabulary may send (Gemma 3's 262144 the largest)
# Our knobs (each its stage's name) an OpenAI-compatible completion request expresses (vLLM's sampling
# parameters) -> the request field; fast mode only.
OPENAI_FIELDS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                 "repetition_penalty": "repetition_penalty", "frequency_penalty": "frequency_penalty",
                 "presence_penalty": "presence_penalty"}


def _openai_tokens(choice: dict[str, Any], n: int) -> list[tuple[int, float, list[Entry]]]:
    """Each generated token of a /v1/completions choice as (id, logprob, its top-N, best first), from
    either logprobs format: vLLM's (OpenAI's legacy ``tokens`` / ``token_logprobs`` / ``top_logprobs``,
    with ``return_tokens_as_token_ids``: keys ``token_id:<id>``) or llama-server's (``content``:
    ``[{id, logprob, bytes, top_logprobs}]``). ``n``: the N asked; vLLM's top list puts the sampled
    token first, and holds N + 1 entries when it lies outside the top N: that entry is left out of
    the top-N (its log-probability is the token's own)."""
    logprobs = choice.get("logprobs") or {}
    if "content" in logprobs:
        return [(int(e["id"]), float(e["logprob"]), _llama_entries(e.get("top_logprobs") or []))
                for e in logprobs["content"]]
    out = []
    for token, lp, top in zip(logprobs.get("tokens") or [], logprobs.get("token_logprobs") or [],
                              logprobs.get("top_logprobs") or []):
        entries = [(_token_id(k), float(v), None) for k, v in (top or {}).items()]
        if len(entries) == n + 1 and entries[0][0] == _token_id(token):
            entries = entries[1:]  # the sampled token, outside the top N
        out.append((_token_id(token), float(lp), sorted(entries, key=lambda e: -e[1])))
    return out


def _token_id(key: str) -> int:
    """``token_id:123`` (vLLM's ``return_tokens_as_token_ids``) -> 123."""
    prefix, _, number = key.partition(":")
    if prefix != "token_id" or not number.isdigit():
        raise ValueError(f"expected token_id:<id>, got {key[:40]!r}")
    return int(number)


@dataclass
class OpenAIApi:
    """An OpenAI-compatible server: /v1/completions with ``logprobs`` (top-N per token; vLLM adds
    ``prompt_logprobs``), and /tokenize, /detokenize at the server root (not under /v1), in vLLM's
    form (``prompt``, ``add_special_tokens`` -> ``tokens``) or llama-server's (``content``)."""

    client: JsonClient  # the /v1 base
    root: JsonClient  # the server root: /tokenize, /detokenize
    model_id: str
    dialect: str = "vllm"  # "vllm" | "llamacpp": how its root tokenises, and whether prompt_logprobs exist
    backend: str = "openai"
    stop_token_ids: tuple[int, ...] = ()  # the operator's EOS ids: fast mode stops on each, as step mode does

    def tokenize(self, text: str, special: bool) -> list[int]:
        body = {"content": text, "add_special": special, "parse_special": special} if self.dialect == "llamacpp" \
            else {"model": self.model_id, "prompt": text, "add_special_tokens": special}
        return [int(t) for t in self._root("/tokenize", body)["tokens"]]

    def detokenize(self, ids: list[int]) -> str:
        answer = self._root("/detokenize", {"model": self.model_id, "tokens": ids})
        return answer["content" if self.dialect == "llamacpp" else "prompt"]

    def chat_ids(self, prompt: str) -> list[int]:
        messages = [{"role": "user", "content": prompt}]
        if self.dialect == "llamacpp":
            return self.tokenize(self._root("/apply-template", {"messages": messages})["prompt"], True)
        body = {"model": self.model_id, "messages": messages, "add_generation_prompt": True}
        return [int(t) for t in self._root("/tokenize", body)["tokens"]]

    def _root(self, path: str, body: dict[str, Any]) -> Any:
        """A request at the server root; a server without the endpoint is one line saying so."""
        try:
            return self.root.post(path, body)
        except RemoteError as exc:
            if ": HTTP 404" in str(exc):
                raise RemoteError(f"OpenAI-compatible server {self.root.url}{path}: missing (HTTP 404); "
                                  "step mode needs the server's tokenizer (vLLM and llama-server have it)") from None
            raise

    def _complete(self, body: dict[str, Any]) -> dict[str, Any]:
        answer = self.client.post("/completions", {"model": self.model_id, "return_tokens_as_token_ids": True,
                                                   "return_token_ids": True, **body})
        try:
            return answer["choices"][0]
        except (KeyError, IndexError, TypeError):
            raise RemoteError(f"OpenAI-compatible server {self.client.url}/completions: no choices in the answer") \
                from None

    def next_top(self, ids: Sequence[int], top_n: int) -> list[Entry]:
        """The model's top-N after ``ids``: one token at temperature 0 with ``logprobs`` = N (vLLM
        returns the raw model's under its default ``--logprobs-mode raw_logprobs``)."""
        choice = self._complete({"prompt": list(ids), "max_tokens": 1, "logprobs": top_n, "temperature": 0})
        try:
            return _openai_tokens(choice, top_n)[0][2]
        except (IndexError, KeyError, TypeError, ValueError) as exc:
            raise RemoteError(f"OpenAI-compatible server {self.client.url}/completions: no top logprobs in the "
                              f"answer ({exc})") from None

    def prompt_logprobs(self, ids: Sequence[int], top_n: int) -> list[dict[int, float] | None]:
        """vLLM's ``prompt_logprobs``: for each position of ``ids``, the log-probabilities of its
        token and the top-N there (None for the first). llama-server has none: one line says so."""
        return self._scored(ids, top_n)[0]

    def _scored(self, ids: Sequence[int], top_n: int) -> tuple[list[dict[int, float] | None], list[Entry]]:
        """One request: ``prompt_logprobs`` (rows as above) and the top-N after the whole of ``ids``."""
        if self.dialect != "vllm":
            raise RemoteError(f"OpenAI-compatible server {self.client.url}/completions: prompt_logprobs: "
                              "not supported by llama-server's OpenAI endpoint (vLLM has them)")
        choice = self._complete({"prompt": list(ids), "max_tokens": 1, "prompt_logprobs": top_n, "logprobs": top_n,
                                 "temperature": 0})
        rows = choice.get("prompt_logprobs")
        if rows is None:
            raise RemoteError(f"OpenAI-compatible server {self.client.url}/completions: prompt_logprobs: "
                              f"{top_n} asked, none in the answer")
        last = _openai_tokens(choice, top_n)[0][2]
        return [None if row is None else {int(k): float(v["logprob"]) for k, v in row.items()} for row in rows], last

    def positions(self, ids: Sequence[int], start: int, top_n: int) -> list[list[Entry]]:
        """The top-N after ``ids[:i]`` for i = start .. len(ids), each with the log-probability of
        the token ``ids`` has next (exact even outside the top-N): one request on vLLM
        (``prompt_logprobs``), one per position on llama-server's endpoint (no prompt_logprobs)."""
        if self.dialect != "vllm":
            return [self.next_top(ids[:i], top_n) for i in range(start, len(ids) + 1)]
        rows, last = self._scored(ids, top_n)
        return [[(t, lp, None) for t, lp in (rows[i] or {}).items()] for i in range(start, len(ids))] + [last]

    def generate(self, ids: Sequence[int], config: DecodingConfig, raw: bool) -> Iterator[FastToken | FastAnswer]:
        """Fast mode: one streamed request; the server samples with the knobs it has
        (``OPENAI_FIELDS``): a FastToken (its top-N ``logprobs``: raw or processed, the server's
        ``--logprobs-mode``) as each token arrives, then the FastAnswer. ``raw`` changes nothing
        (the top-N are the only ones it sends)."""
        fields, notes = _openai_fields(config)
        where = f"OpenAI-compatible server {self.client.url}/completions"
        finish, stop_reason = "", None
        body = {"model": self.model_id, "return_tokens_as_token_ids": True, "return_token_ids": True,
                "prompt": list(ids), "stream": True, "max_tokens": config.max_new_tokens, "logprobs": config.top_n,
                "seed": config.seed, "stop": list(config.stop), **fields}
        if self.stop_token_ids:
            body["stop_token_ids"] = list(self.stop_token_ids)
        with closing(self.client.stream_post("/completions", body)) as chunks:  # closed: the server stops too
            for chunk in chunks:
                choices = chunk.get("choices") if isinstance(chunk, dict) else None
                if not isinstance(choices, list):
                    raise RemoteError(f"{where}: a streamed chunk without choices")
                for choice in choices[:1]:  # a usage-only chunk has none
                    try:
                        tokens = _openai_tokens(choice, config.top_n)
                    except (KeyError, TypeError, ValueError) as exc:
                        raise RemoteError(f"{where}: a streamed chunk without token logprobs ({exc})") from None
                    for token, lp, top in tokens:
                        yield FastToken(token, math.exp(lp), None, top, raw_prob=math.exp(lp))
                    finish = choice.get("finish_reason") or finish
                    stop_reason = choice.get("stop_reason", stop_reason)
        reason = {"stop": "eos", "length": "max_new_tokens"}.get(finish, "max_new_tokens")
        if reason == "eos" and isinstance(stop_reason, str):  # vLLM: the stop string that ended it
            reason = "stop_string"  # (an int stop_reason is the stop token that ended it: one of our EOS ids)
        approximations = ["the server sampled (its own generator and sampler code); no draw u is known",
                          "the top-N per token are the server's logprobs: the raw model's on llama-server and "
                          "under vLLM's default --logprobs-mode raw_logprobs, processed under processed_logprobs",
                          "entropies are over the top-N only"]
        yield FastAnswer(reason, approximations, notes)


def _openai_fields(config: DecodingConfig) -> tuple[dict[str, Any], dict[str, list[dict[str, str]]]]:
    """Our knobs as an OpenAI-compatible completion request's sampling fields (``OPENAI_FIELDS``),
    and the notes: knobs it cannot express (``unmapped``), differences (``caveats``)."""
    active = config.active_stages()
    # every field sent, neutral or not, so no server default (llama-server: top-k 40...) leaks in
    fields = {name: getattr(config, knob) for knob, name in OPENAI_FIELDS.items()}
    fields["top_k"] = fields["top_k"] or -1  # 0 is our "off"; -1 is theirs
    if config.is_greedy:
        fields["temperature"] = 0.0
    unmapped = [{"key": k.name, "reason": "the OpenAI-compatible API has no such sampling parameter"}
                for k in KNOBS.values() if k.stage in active and k.stage not in OPENAI_FIELDS
                and getattr(config, k.name) != k.neutral]
    caveats = [{"key": "stage_order", "reason": "the server applies its own fixed order, not ours"}]
    if not config.is_greedy:
        caveats.append({"key": "seed", "reason": "the server has its own random generator: the same seed "
                                                 "gives another text (step mode draws with ours)"})
    return fields, {"unmapped": unmapped, "caveats": caveats}


def connect_openai(url: str, timeout_s: float = DEFAULT_TIMEOUT_S, mode: str = "step", *,
                   vocab_size: int | None = None, eos_token_ids: Sequence[int] = (),
                   top_n: int | None = None) -> RemoteModel:
    """A RemoteModel over an OpenAI-compatible server whose API is at ``url`` (``.../v1``). Its
    first model is used; a llama-server (its /v1/models carries ``meta``) also tells its vocabulary
    and EOS, a vLLM does not: give ``vocab_size`` and ``eos_token_ids`` (else ids up to
    VOCAB_BOUND are accepted and a run stops at max_new_tokens or a stop string). ``top_n``: step
    mode's tokens per step (default STEP_TOP_N). Checked by ``check_served`` (one request)."""
    client = JsonClient(url, timeout_s, "OpenAI-compatible server")
    root = JsonClient(url[:-3] if url.rstrip("/").endswith("/v1") else url, timeout_s, "OpenAI-compatible server")
    try:
        info = client.get("/models")["data"][0]
        model_id = str(info["id"])
    except (KeyError, IndexError, TypeError):
        raise RemoteError(f"OpenAI-compatible server {client.url}/models: no model in the answer") from None
    meta = info.get("meta") if isinstance(info.get("meta"), dict) else None
    api = OpenAIApi(client, root, model_id, "llamacpp" if meta else "vllm",
                    stop_token_ids=() if meta else tuple(eos_token_ids))
    tokenizer = RemoteTokenizer(api)
    context = int((meta or {}).get("n_ctx") or info.get("max_model_len") or 4096)
    vocab = vocab_size or int((meta or {}).get("n_vocab") or VOCAB_BOUND)
    chat = True
    if meta:
        props = root.get("/props")
        eos_text = props.get("eos_token") or ""
        found = tuple(tokenizer.encode(eos_text, add_special_tokens=True)) if eos_text else ()
        eos_token_ids = eos_token_ids or (found if len(found) == 1 else ())
        chat = bool(props.get("chat_template"))
    return check_served(RemoteModel(f"openai:{client.url}", api, tokenizer, vocab, tuple(eos_token_ids), context, chat,
                                    mode=mode, top_n=top_n or STEP_TOP_N))


def connect_spec(spec: RemoteSpec, timeout_s: float = DEFAULT_TIMEOUT_S, mode: str = "step") -> RemoteModel:
    """The RemoteModel an operator's ``backend:url`` names (with its vocabulary and EOS options)."""
    if spec.backend == "openai":
        return connect_openai(spec.url, timeout_s, mode, vocab_size=spec.vocab_size, eos_token_ids=spec.eos_token_ids,
                              top_n=spec.top_n)
    return connect(spec.url, timeout_s, mode)


# --- our knobs -> its request ----------------------------------------------------------------------
@dataclass(frozen=True)
class LlamaRequest:
    """``fields``: the /completion fields. ``unmapped``: knobs llama.cpp cannot express (left out).
    ``caveats``: knobs that mapped, with a difference in behaviour worth knowing."""

    fields: dict[str, Any]
    unmapped: tuple[Note, ...]
    caveats: tuple[Note, ...]

    def notes(self) -> dict[str, list[dict[str, str]]]:
        """Both lists as JSON, for a trace's ``extra``."""
        return {"unmapped": [{"key": n.key, "reason": n.reason} for n in self.unmapped],
                "caveats": [{"key": n.key, "reason": n.reason} for n in self.caveats]}


def llamacpp_request(config: DecodingConfig, context: int = 4096) -> LlamaRequest:
    """The request that runs ``config`` on llama.cpp's own sampler chain. ``samplers`` is the active
    stages in the user's order; under greedy it ends with top-k 1. Every value is sent, neutral or not, so the
    server's defaults (temperature 0.8, top-k 40...) never leak in. ``context``: the server's
    context length, the window of "the whole context" (its request fields refuse -1)."""
    c = config
    fields: dict[str, Any] = {
        "temperature": c.temperature, "dynatemp_range": c.dynatemp_range, "dynatemp_exponent": c.dynatemp_exponent,
        "top_k": c.top_k, "top_p": c.top_p, "min_p": c.min_p, "typical_p": c.typical_p,
        "repeat_penalty": c.repetition_penalty, "frequency_penalty": c.frequency_penalty,
        "presence_penalty": c.presence_penalty, "repeat_last_n": context,
        "dry_multiplier": c.dry_multiplier, "dry_base": c.dry_base, "dry_allowed_length": c.dry_allowed_length,
        "dry_penalty_last_n": context if c.dry_penalty_last_n == -1 else c.dry_penalty_last_n,
        "dry_sequence_breakers": list(c.dry_sequence_breakers),
        "xtc_probability": c.xtc_probability, "xtc_threshold": c.xtc_threshold, "top_n_sigma": c.top_n_sigma,
        "mirostat": 0 if c.is_greedy else c.mirostat, "mirostat_tau": c.mirostat_tau,
        "mirostat_eta": c.mirostat_eta, "seed": c.seed, "min_keep": 0,
        "logit_bias": _bias_pairs(c.logit_bias),
    }
    samplers: list[str] = []
    unmapped: list[Note] = []
    order = c.active_stages()
    for stage in order:
        name = "penalties" if stage in PENALTY_STAGES else LLAMA_SAMPLER.get(stage, (None,))[0]
        if name and name not in samplers:
            samplers.append(name)
        elif name is None and stage not in ("logit_bias", "mirostat"):  # sent as fields, not samplers
            knobs = [k.name for k in KNOBS.values() if k.stage == stage and getattr(c, k.name) != k.neutral]
            unmapped += [Note(k, UNMAPPED.get(k, "llama.cpp has no such sampler")) for k in knobs]
    if c.is_greedy:
        samplers.append("top_k")
        fields["top_k"] = 1
    elif not samplers:
        samplers.append("temperature")  # T = 1: changes nothing, and the list is never empty
    fields["samplers"] = samplers
    return LlamaRequest(fields, tuple(unmapped), tuple(_caveats(c, order)))


def _bias_pairs(bias: dict[str, float]) -> list[list[Any]]:
    """Our ``{token id or word: bias}`` as its ``[[id or text, bias]]``; a word as itself and with a
    leading space, as our stage biases it (the server tokenises the text)."""
    pairs: list[list[Any]] = []
    for key, value in bias.items():
        pairs += [[int(key), value]] if key.isdigit() else [[key, value], [" " + key, value]]
    return pairs


def _caveats(config: DecodingConfig, order: Sequence[str]) -> list[Note]:
    out = []
    if "logit_bias" in order and [s for s in order if s != "constraints"][0] != "logit_bias":
        out.append(Note("logit_bias", "llama.cpp applies logit_bias first, before every sampler"))
    if any(not k.isdigit() for k in config.logit_bias):
        out.append(Note("logit_bias", "words are tokenised by the server (the word and ' word'), "
                                      "not by our word variants"))
    if {"frequency_penalty", "presence_penalty"} & set(order):
        out.append(Note("frequency_penalty", "llama.cpp counts prompt tokens too; we count generated tokens only"))
    if config.mirostat and not config.is_greedy:
        out.append(Note("mirostat", "llama.cpp's mirostat replaces the chain, keeping temperature only"))
    if not config.is_greedy:
        out.append(Note("seed", "llama.cpp has its own random generator: the same seed gives another text "
                                "(step mode draws with ours)"))
    return out


def check_strategy(config: DecodingConfig) -> None:
    if config.strategy not in STRATEGIES:
        raise ValueError(f"strategy: {config.strategy!r} does not run on a remote model yet; "
                         f"use {' or '.join(STRATEGIES)}")


# --- step mode -------------------------------------------------------------------------------------
def top_logits(model: RemoteModel, ids: Sequence[int], top_n: int) -> tuple[torch.Tensor, float]:
    """The server's raw next-token distribution after ``ids``, truncated to its top ``top_n``
    (``model.api.next_top``: one request): logits [1, V] (log p inside the top-N, -inf outside) and
    the tail mass 1 - sum(top-N)."""
    return entries_logits(model, model.api.next_top(ids, top_n))


def entries_logits(model: RemoteModel, top: list[Entry]) -> tuple[torch.Tensor, float]:
    """A server's top-N as logits [1, V] (log p inside, -inf outside) and the tail mass."""
    model.learn_pieces(top)
    token_ids = torch.tensor([t for t, _, _ in top], dtype=torch.long)
    logprobs = torch.tensor([lp for _, lp, _ in top], dtype=torch.float32)
    if len(top) and int(token_ids.max()) >= model.vocab_size:
        raise RemoteError(f"{model.client.server} {model.url}: token {int(token_ids.max())} is outside the "
                          f"vocabulary of {model.vocab_size} (vocab_size)")
    logits = torch.full((1, model.vocab_size), -math.inf)
    logits[0, token_ids] = logprobs
    return logits, max(0.0, 1.0 - float(logprobs.double().exp().sum()))


def stream_step(model: RemoteModel, prompt_ids: Sequence[int], config: DecodingConfig, *,
                top_n: int = STEP_TOP_N, tails: list[float] | None = None, prefix: Sequence[int] = (),
                force: int | None = None) -> Iterator[StepTrace]:
    """Step mode: a StepTrace per token, each from one request (``tails`` collects each step's
    tail mass). ``prefix`` / ``force`` continue a run as ``decode.stream`` does: the kept tokens
    are just a longer prompt to the server (a stateful chain first replays their positions, one
    request each)."""
    check_strategy(config)
    state = RunState(model, prompt_ids, config, prefix=prefix, force=force)  # type: ignore[arg-type]
    if state.needs_replay:
        start = len(prompt_ids)
        state.replay(torch.cat([top_logits(model, state.sequence[:start + i], top_n)[0] for i in range(len(prefix))]))
    while True:
        logits, tail = top_logits(model, state.ids[0].tolist(), top_n)
        if tails is not None:
            tails.append(tail)
        step = state.advance(logits)
        yield step
        if step.finish_reason is not None:
            return


# Step mode's approximations, by the stages they touch (measured against llama.cpp's own samplers in
# tests/test_remote_llamacpp.py: temperature, top-k, min-p, XTC, DRY and typical after a top-k agree exactly).
STEP_APPROXIMATIONS = (
    ({"top_p", "typical_p", "eta", "top_h", "mirostat", "epsilon", "top_a"},
     "top-p, typical, eta, top-H, mirostat and the cutoffs weigh the top-N renormalised (the tail mass is left out)"),
    ({"top_n_sigma", "dynamic_temperature"},
     "top-nσ's σ and dynamic temperature's entropy are over the top-N, not the whole vocabulary"),
    ({"repetition_penalty"}, "the repetition penalty (divide positive logits, multiply negative ones) sees "
                             "log-probabilities, all negative, not the model's logits"),
    ({*PENALTY_STAGES, "dry", "logit_bias"}, "penalties and biases cannot lift a token from outside the top-N"),
)


def step_approximations(config: DecodingConfig, top_n: int) -> list[str]:
    """What step mode cannot do exactly for ``config``, in words (the trace carries them)."""
    stages = set(config.active_stages())
    return [f"the raw distribution is the server's top {top_n}, renormalised; the tail mass (1 - their sum) is "
            "recorded per step and no token outside them can be picked"] + \
        [text for touched, text in STEP_APPROXIMATIONS if stages & touched]


def stream(model: RemoteModel, prompt: str, prompt_ids: Sequence[int], config: DecodingConfig, *,
           chat: bool = False, prefix: Sequence[int] = (), force: int | None = None) -> Iterator[Event]:
    """What ``engine.runner.stream`` runs for a remote model: an Event per token, then one holding
    the Trace (labelled: ``extra["remote"]``), in the model's ``mode``. Fast mode cannot continue
    from a step (the server samples the whole text): ``prefix`` / ``force`` raise ValueError."""
    if model.mode == "fast":
        if prefix or force is not None:
            raise ValueError(f"{'prefix' if prefix else 'force'}: a fast-mode run of {model.url} cannot continue "
                             "from a step (the server samples); use step mode")
        yield from _stream_fast(model, prompt, prompt_ids, config, chat)
        return
    tails: list[float] = []
    steps: list[StepTrace] = []
    ended = False
    try:
        for step in stream_step(model, prompt_ids, config, top_n=model.top_n, tails=tails, prefix=prefix, force=force):
            steps.append(step)
            yield Event(steps=[step])
    except NoTokensLeft:  # a step with nothing left to pick ends the run, saying why
        ended = True
    trace = assemble(model, prompt, prompt_ids, config, steps, chat)  # type: ignore[arg-type]
    if ended:
        trace.end_with_no_tokens_left()
    trace.extra["remote"] = _label(model, "step", model.top_n, step_approximations(config, model.top_n)) | {
        "tail_mass": tails}
    yield Event(trace=trace)


def _collect(events: Iterator[Event]) -> Trace:
    return next(e.trace for e in events if e.trace is not None)


def run_step(model: RemoteModel, prompt: str, config: DecodingConfig, *, chat: bool = False,
             top_n: int = STEP_TOP_N) -> Trace:
    """A whole step-mode run as a Trace, labelled (``extra["remote"]``)."""
    stepper = model.with_mode("step", top_n)
    return _collect(stream(stepper, prompt, stepper.encode(prompt, chat), config, chat=chat))


def _label(model: RemoteModel, mode: str, top_n: int, approximations: list[str],
           notes: dict[str, list] | None = None) -> dict:
    """``extra["remote"]``; ``notes``: in fast mode, the knobs the server's sampler did not run as
    ours (step mode runs our own chain: nothing unmapped)."""
    return {"backend": model.backend, "url": model.url, "mode": mode, "top_n": top_n,
            "approximations": approximations} | (notes or {"unmapped": [], "caveats": []})


# --- fast mode -------------------------------------------------------------------------------------
def _stage(name: str, entries: list[Entry], vocab_size: int) -> StageTrace:
    """A stage record from the server's top-N; entropy over the top-N only, kept = the whole
    vocabulary for raw, the non-zero top-N for final."""
    probs = [math.exp(lp) if math.isfinite(lp) else 0.0 for _, lp, _ in entries]
    top = [TokenProb(token, piece or "", p) for (token, _, piece), p in zip(entries, probs)]
    entropy = -sum(p * math.log(p) for p in probs if p > 0)
    kept = vocab_size if name == "raw" else sum(1 for p in probs if p > 0)
    return StageTrace(name, kept, 0.0, entropy, 0.0, top)


def run_fast(model: RemoteModel, prompt: str, config: DecodingConfig, *, chat: bool = False,
             raw: bool = True) -> Trace:
    """Fast mode: the server generates the whole text in one streamed request (its top-N per
    token, raw and final as the backend gives them; ``raw``: llama.cpp, a second request for the
    raw top-N)."""
    fast = model.with_mode("fast")
    return _collect(_stream_fast(fast, prompt, fast.encode(prompt, chat), config, chat, raw=raw))


def _stream_fast(model: RemoteModel, prompt: str, prompt_ids: Sequence[int], config: DecodingConfig, chat: bool,
                 raw: bool = True) -> Iterator[Event]:
    """Fast mode's Events: one streamed request (``api.generate``), an Event per token as it
    arrives (its ``elapsed_ms`` since the request began), then the labelled Trace. llama.cpp's raw
    top-N come from a second request after the stream: the Events show the final stage only,
    the Trace's steps raw and final."""
    check_strategy(config)
    start = time.perf_counter()
    steps: list[StepTrace] = []
    answer: FastAnswer | None = None
    with closing(model.api.generate(prompt_ids, config, raw)) as generated:  # a Stop closes the request
        for item in generated:
            if isinstance(item, FastAnswer):
                answer = item
                continue
            step = _fast_step(model, len(steps), item, (time.perf_counter() - start) * 1000)
            steps.append(step)
            yield Event(steps=[step])
    assert answer is not None, "api.generate ends with its FastAnswer"
    if answer.final:
        steps = [_with_final(model, step, p, top) if not step.stages else step
                 for step, (p, top) in zip(steps, answer.final)] + steps[len(answer.final):]
    if answer.raw:
        steps = [_with_raw(model, step, top) for step, top in zip(steps, answer.raw)] + steps[len(answer.raw):]
    if steps:
        steps[-1] = replace(steps[-1], finish_reason=answer.finish_reason)
    trace = assemble(model, prompt, prompt_ids, config, steps, chat)  # type: ignore[arg-type]
    approximations = list(answer.approximations)
    outside = sum(1 for s in steps if math.isnan(s.raw_prob))
    if outside and answer.raw:
        approximations.append(f"{outside} of the {len(steps)} tokens lie outside the raw top {config.top_n}, so their "
                              "raw p is unknown and so are the raw mean log-prob and perplexity")
    trace.extra["remote"] = _label(model, "fast", config.top_n, approximations, answer.notes) | {
        "timings": answer.timings, "streamed": True} | server_speculative(answer.timings)
    yield Event(trace=trace)


def server_speculative(timings: dict[str, Any]) -> dict[str, Any]:
    """llama-server's own speculative decoding in a fast-mode answer (a server started with a draft
    model, ``-md``, or ``--spec-type ngram-*``): ``{"server_speculative": {"drafted", "accepted",
    "acceptance_rate"}}`` from its ``timings.draft_n`` / ``draft_n_accepted``; {} when it did not draft."""
    try:
        drafted, accepted = int(timings["draft_n"]), int(timings["draft_n_accepted"])
    except (KeyError, TypeError, ValueError):
        return {}
    if drafted <= 0:
        return {}
    return {"server_speculative": {"drafted": drafted, "accepted": accepted, "acceptance_rate": accepted / drafted}}


def _fast_step(model: RemoteModel, index: int, token: FastToken, elapsed_ms: float) -> StepTrace:
    """A streamed token as a step: its stages are the top-N the backend sent (raw, final)."""
    stages = []
    for name, entries in (("raw", token.raw), ("final", token.final)):
        if entries is not None:
            model.learn_pieces(entries)
            stages.append(_stage(name, entries, model.vocab_size))
    raw_prob = _prob_of(token.token, token.raw) if token.raw is not None else math.nan
    if math.isnan(raw_prob) and token.raw_prob is not None:
        raw_prob = token.raw_prob
    return StepTrace(index, token.token, model.token_text(token.token), token.prob, raw_prob, None, None, None,
                     stages[-1].entropy if stages else math.nan, stages[0].entropy if stages else math.nan,
                     stages, elapsed_ms=elapsed_ms)


def _with_final(model: RemoteModel, step: StepTrace, prob: float, final: list[Entry]) -> StepTrace:
    """``step`` (streamed without probabilities) with its p and final top-N from a whole request."""
    model.learn_pieces(final)
    stage = _stage("final", final, model.vocab_size)
    return replace(step, chosen_prob=prob, stages=[stage], entropy=stage.entropy, raw_entropy=stage.entropy)


def _with_raw(model: RemoteModel, step: StepTrace, raw: list[Entry]) -> StepTrace:
    """``step`` with the raw top-N of a later request as its first stage."""
    model.learn_pieces(raw)
    stage = _stage("raw", raw, model.vocab_size)
    return replace(step, stages=[stage, *step.stages], raw_prob=_prob_of(step.chosen_token_id, raw),
                   raw_entropy=stage.entropy)


def _prob_of(token: int, entries: list[Entry]) -> float:
    """``token``'s probability in a top-N; NaN outside it (unknown: below the N-th, not 0)."""
    return next((math.exp(lp) for t, lp, _ in entries if t == token), math.nan)
