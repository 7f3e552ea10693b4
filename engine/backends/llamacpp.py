"""llama.cpp's ``llama-server``, its native API: /completion (``n_probs``,
``post_sampling_probs``, its sampler chain), /tokenize, /detokenize, /apply-template; ``connect``;
and our knobs as its request (``llamacpp_request``: its ``samplers`` list follows our stage order,
with what it cannot express listed).

Every field read from an answer goes through ``engine.backends.schema.Schema`` (ids in the
vocabulary, probabilities in range, types, counts): a bad one is one RemoteError line naming the
server and the field. Fast mode reads at most ``max_new_tokens`` tokens, whatever the server sends
(``generate``)."""

from __future__ import annotations

import math
from contextlib import closing
from dataclasses import dataclass
from typing import Any, Generator, Iterator, Sequence

from engine.backends.client import DEFAULT_TIMEOUT_S, AnswerTooLarge, JsonClient, RemoteError
from engine.backends.schema import MAX_PIECE_CHARS, VOCAB_BOUND, Schema
from engine.backends.served import Entry, FastAnswer, FastToken, RemoteModel, RemoteTokenizer, check_served
from engine.config import KNOBS, DecodingConfig
from engine.interop import LLAMA_SAMPLER, LLAMA_UNMAPPED, PENALTY_STAGES, Note
from engine.stages import STAGES

STOP_TYPES = {"eos": "eos", "word": "stop_string", "limit": "max_new_tokens"}  # llama.cpp -> ours
# Our stages llama.cpp has no sampler for (interop's reasons), plus the word constraints.
UNMAPPED = {**LLAMA_UNMAPPED, "allowed_words": "llama.cpp has no word allow-list (a grammar would be needed)",
            "banned_words": "llama.cpp bans token ids (logit_bias false), not words"}


# Tokens one streamed chunk may carry: one, or the drafts llama-server's own speculation accepted at once.
MAX_CHUNK_TOKENS = 64
# Chunks without a token a fast-mode stream may send after its last token (the stop chunk; a usage chunk).
MAX_TRAILING_CHUNKS = 4


def _piece(entry: dict[str, Any], schema: Schema, field: str) -> str | None:
    """A llama-server top-N entry's text, from its ``bytes`` (a token may be part of a character)."""
    raw = entry.get("bytes")
    if raw is not None:
        values = schema.array(raw, f"{field}.bytes", 4 * MAX_PIECE_CHARS)
        if not all(isinstance(b, int) and not isinstance(b, bool) and 0 <= b < 256 for b in values):
            raise schema.fail(f"{field}.bytes", "expected byte values in [0, 256)")
        return bytes(values).decode("utf-8", "replace")
    token = entry.get("token")
    return None if token is None else schema.text(token, f"{field}.token", MAX_PIECE_CHARS)


def llama_entries(top: Any, schema: Schema, field: str, most: int, key: str = "logprob") -> list[Entry]:
    """llama-server's ``[{id, token, bytes, logprob | prob}]`` as Entries (log-probabilities),
    every field checked (``schema``; ``field`` names the list in an error line; at most ``most``
    entries: the N asked + 1). A null log-probability is llama-server's probability 0."""
    out = []
    for i, e in enumerate(schema.array(top, field, most)):
        name = f"{field}[{i}]"
        schema.obj(e, name)
        token = schema.token(schema.get(e, "id", name), f"{name}.id")
        if key == "logprob":
            lp = schema.logprob(e.get("logprob"), f"{name}.logprob", nullable=True)
        else:
            p = schema.prob(schema.get(e, "prob", name), f"{name}.prob")
            lp = math.log(p) if p > 0 else -math.inf
        out.append((token, lp, _piece(e, schema, name)))
    return schema.top(out, field, most)


@dataclass
class LlamaCppApi:
    """llama-server's native API: /completion (``n_probs``, ``post_sampling_probs``, its sampler
    chain), /tokenize, /detokenize, /apply-template."""

    client: JsonClient
    context: int = 4096
    backend: str = "llamacpp"
    vocab_size: int = VOCAB_BOUND  # the ids its answers may hold (connect sets the server's n_vocab)
    # What it adds to a served model's capabilities (engine.base.seam): no prompt log-probabilities (one
    # position per request), no logits processor of ours
    scores_prompt = False
    server_draws = False

    def schema(self, path: str) -> Schema:
        """The checks for an answer to ``path`` (engine.backends.schema)."""
        return Schema(f"{self.client.server} {self.client.url}{path}", self.vocab_size)

    def tokenize(self, text: str, special: bool) -> list[int]:
        answer = self.client.post("/tokenize", {"content": text, "add_special": special, "parse_special": special})
        s = self.schema("/tokenize")
        return s.tokens(s.get(answer, "tokens"), "tokens", len(text.encode()) + 16)

    def detokenize(self, ids: list[int]) -> str:
        s = self.schema("/detokenize")
        return s.text(s.get(self.client.post("/detokenize", {"tokens": ids}), "content"), "content",
                      MAX_PIECE_CHARS * max(1, len(ids)))

    def chat_ids(self, prompt: str) -> list[int]:
        s = self.schema("/apply-template")
        text = s.get(self.client.post("/apply-template", {"messages": [{"role": "user", "content": prompt}]}), "prompt")
        return self.tokenize(s.text(text, "prompt"), True)

    def next_top(self, ids: Sequence[int], top_n: int) -> list[Entry]:
        """The model's raw top-N after ``ids`` (one token generated by top-k 1, not used)."""
        answer = self.client.post("/completion", {
            "prompt": list(ids), "n_predict": 1, "n_probs": top_n, "post_sampling_probs": False,
            "cache_prompt": True, "samplers": ["top_k"], "top_k": 1, "return_tokens": True})
        s = self.schema("/completion")
        probs = s.array(s.get(answer, "completion_probabilities"), "completion_probabilities", MAX_CHUNK_TOKENS)
        if not probs:
            raise s.fail("completion_probabilities", "empty: no top_logprobs in the answer")
        field = "completion_probabilities[0]"
        return llama_entries(s.get(probs[0], "top_logprobs", field), s, f"{field}.top_logprobs", top_n + 1)

    def continuation(self, ids: Sequence[int], count: int, top_n: int) -> Iterator[tuple[int, list[Entry]]]:
        """The server's greedy continuation of ``ids``, at most ``count`` tokens, streamed: (token, the
        raw top-N at its position) as each is made (``post_sampling_probs`` false: the model's softmax
        before any sampler, as ``next_top``'s); fewer when it stops (EOS, whose position is streamed
        too). Closing the iterator early closes the connection and the server stops making the rest
        (``remote.stream_verified`` closes it at its first disagreement). More than ``count`` tokens,
        or a stream that ends before its last chunk, is one RemoteError line."""
        body = {"prompt": list(ids), "n_predict": count, "n_probs": top_n, "post_sampling_probs": False,
                "cache_prompt": True, "samplers": ["top_k"], "top_k": 1, "return_tokens": True, "stream": True}
        s = self.schema("/completion")
        read = 0
        with closing(self.client.stream_post("/completion", body)) as chunks:
            for i, chunk in enumerate(chunks):
                for token, top in _chunk_tokens(chunk, s, f"stream[{i}]", top_n + 1, "logprob"):
                    read += 1
                    if top is None:  # a token without its top-N would shift every position after it
                        raise s.fail(f"stream[{i}].tokens", "a token without completion_probabilities")
                    if read > count:
                        raise s.fail(f"stream[{i}].completion_probabilities", f"more tokens than the {count} asked")
                    yield token, top[1]
                if _stopped(chunk, s, f"stream[{i}]"):
                    return
        raise RemoteError(f"{s.where}: the stream ended before its last chunk (stop: true)")

    def positions(self, ids: Sequence[int], start: int, top_n: int) -> list[list[Entry]]:
        """The raw top-N after ``ids[:i]`` for i = start .. len(ids): one request each (the prefix
        cache re-reads one token); a token outside a top-N has no probability here."""
        return [self.next_top(ids[:i], top_n) for i in range(start, len(ids) + 1)]

    def generate(self, ids: Sequence[int], config: DecodingConfig, raw: bool) -> Iterator[FastToken | FastAnswer]:
        """Fast mode: one streamed request; its sampler chain runs ``config`` (``llamacpp_request``):
        a FastToken (with the top-N after its sampler) as each token is sampled, then the
        FastAnswer. ``raw``: after the stream, a second request (not streamed) with the same seed
        adds the raw top-N (left out, and said so, if it sampled another text). At most
        ``config.max_new_tokens`` tokens are read: a server that sends more is cut off there (the
        stream closed, the answer saying so)."""
        request = llamacpp_request(config, self.context)
        tokens: list[int] = []
        bare = 0  # tokens streamed without probabilities (accepted drafts of the server's own speculation)
        body = self._body(ids, config, request, True) | {"stream": True}
        stream = _Stream(self.schema("/completion"), config)
        with closing(stream.tokens(self.client.stream_post("/completion", body))) as streamed:  # a Stop closes it
            for token, top in streamed:
                tokens.append(token)
                if top is None:
                    bare += 1
                    yield FastToken(token, math.nan, None, None)
                else:
                    yield FastToken(token, top[0], top[1], None)
        approximations = ["the server sampled (its own generator and sampler code); no draw u is known",
                          "entropies are over the top-N only", *stream.notes]
        answer = FastAnswer(stream.stop_reason, approximations, request.notes(), stream.timings)
        if raw:
            answer.raw = self._raw_tops(ids, config, request, tokens, approximations)
        if bare:
            answer.final = self._final_tops(ids, config, request, tokens, approximations, bare)
        yield answer

    def _whole(self, ids: Sequence[int], config: DecodingConfig, request: "LlamaRequest",
               post_sampling: bool) -> tuple[Schema, list[int], list[dict[str, Any]]]:
        """A whole (not streamed) fast-mode request with the same seed: its schema, its token ids
        and its ``completion_probabilities`` entries, checked. An answer over the size limit
        (AnswerTooLarge) reads as no tokens: the caller leaves those probabilities out, saying so."""
        try:
            again = self.client.post("/completion", self._body(ids, config, request, post_sampling))
        except AnswerTooLarge:
            return self.schema("/completion"), [], []
        s = self.schema("/completion")
        most = config.max_new_tokens
        probs = s.array(s.obj(again, "the answer").get("completion_probabilities") or [], "completion_probabilities",
                        most)
        entries = [s.obj(e, f"completion_probabilities[{i}]") for i, e in enumerate(probs)]
        if again.get("tokens"):
            got = s.tokens(again["tokens"], "tokens", most)
        else:
            got = [s.token(s.get(e, "id", f"completion_probabilities[{i}]"), f"completion_probabilities[{i}].id")
                   for i, e in enumerate(entries)]
        return s, got, entries

    def _final_tops(self, ids: Sequence[int], config: DecodingConfig, request: "LlamaRequest", tokens: list[int],
                    approximations: list[str], bare: int) -> list[tuple[float, list[Entry]]] | None:
        """(p, top-N after the sampler) of each of ``tokens`` from a whole request with the same
        seed: llama-server streams the drafts its own speculation accepted without probabilities
        (a whole answer has them). None, said, when it sampled another text."""
        s, got, entries = self._whole(ids, config, request, True)
        if got != tokens:
            approximations.append(f"{bare} tokens came from the server's own speculation without probabilities, and "
                                  "the request for them sampled another text: they have none")
            return None
        approximations.append(f"{bare} tokens came from the server's own speculation without probabilities (the "
                              "stream leaves them out); theirs are from a second, whole request with the same seed")
        return [(s.prob(s.get(e, "prob", f"completion_probabilities[{i}]"), f"completion_probabilities[{i}].prob"),
                 llama_entries(e.get("top_probs") or [], s, f"completion_probabilities[{i}].top_probs",
                               config.top_n + 1, "prob"))
                for i, e in enumerate(entries)]

    def _raw_tops(self, ids: Sequence[int], config: DecodingConfig, request: "LlamaRequest", tokens: list[int],
                  approximations: list[str]) -> list[list[Entry]] | None:
        """The raw top-N of each of ``tokens`` from a second request with the same seed (None, said
        in ``approximations``, when it sampled another text). A whole (non-streamed) answer has no
        probabilities for the tokens that completed a stop string: those steps get none."""
        s, got, entries = self._whole(ids, config, request, False)
        if not got and tokens:
            approximations.append("the raw request's answer was over the size limit (engine.backends.client): raw "
                                  "probabilities left out")
            return None
        if got != tokens:
            approximations.append("the raw request sampled another text: raw probabilities left out")
            return None
        if len(entries) < len(tokens):
            approximations.append("the tokens that completed a stop string have no raw top-N (llama.cpp leaves "
                                  "them out of a whole answer)")
        return [llama_entries(e.get("top_logprobs") or [], s, f"completion_probabilities[{i}].top_logprobs",
                              config.top_n + 1) for i, e in enumerate(entries)]

    def _body(self, ids: Sequence[int], config: DecodingConfig, request: "LlamaRequest",
              post_sampling: bool) -> dict[str, Any]:
        """A fast-mode /completion body: the mapped knobs; the top-N after its sampler
        (``post_sampling``) or the model's."""
        return {**request.fields, "prompt": list(ids), "n_predict": config.max_new_tokens, "n_probs": config.top_n,
                "post_sampling_probs": post_sampling, "cache_prompt": True, "return_tokens": True,
                "stop": list(config.stop)}


class _Stream:
    """Reads a streamed /completion: its tokens (at most ``config.max_new_tokens``), then how it
    stopped (``stop_reason``, ``timings``) and what the reading had to say (``notes``)."""

    def __init__(self, schema: Schema, config: DecodingConfig):
        self.schema, self.config = schema, config
        self.stop_reason = "max_new_tokens"
        self.timings: dict[str, Any] = {}
        self.notes: list[str] = []

    def tokens(self, chunks: Generator[Any, None, None]
               ) -> Generator[tuple[int, tuple[float, list[Entry]] | None], None, None]:
        """(id, (p, top-N after the sampler) or None) per token as the chunks arrive. Ends at the
        chunk with ``stop: true``; past ``max_new_tokens`` tokens, or ``MAX_TRAILING_CHUNKS``
        chunks after the last one without the stop, the stream is closed (the server stops too)."""
        s, limit = self.schema, self.config.max_new_tokens
        count, trailing = 0, 0
        with closing(chunks):  # closed, also early: the server ends the request
            for i, chunk in enumerate(chunks):
                parsed = _chunk_tokens(chunk, s, f"stream[{i}]", self.config.top_n + 1)
                if count >= limit and (parsed or trailing >= MAX_TRAILING_CHUNKS):
                    self.notes.append(f"the server went on past max_new_tokens ({limit}); the stream was cut there")
                    return
                trailing += count >= limit
                yield from parsed[:limit - count]
                count += len(parsed[:limit - count])
                if self._stopped(chunk, f"stream[{i}]"):
                    return
        if count < limit:
            raise RemoteError(f"{s.where}: the stream ended before its last chunk (stop: true)")

    def _stopped(self, chunk: dict[str, Any], field: str) -> bool:
        """Whether ``chunk`` is the last one (``stop: true``); reads its stop type and timings."""
        s = self.schema
        if not _stopped(chunk, s, field):
            return False
        stop_type = s.optional_text(chunk.get("stop_type"), f"{field}.stop_type")
        self.stop_reason = STOP_TYPES.get(stop_type or "", "max_new_tokens")
        self.timings = s.timings(chunk.get("timings"), f"{field}.timings")
        return True


def _stopped(chunk: dict[str, Any], s: Schema, field: str) -> bool:
    """Whether a streamed /completion chunk is the last one (``stop: true``), its ``stop`` checked."""
    stop = chunk.get("stop")
    if stop is not None and not isinstance(stop, bool):
        raise s.fail(f"{field}.stop", f"expected true or false, got {type(stop).__name__}")
    return bool(stop)


def _chunk_tokens(chunk: Any, s: Schema, field: str, most: int,
                  key: str = "prob") -> list[tuple[int, tuple[float, list[Entry]] | None]]:
    """A streamed /completion chunk's tokens, each with (its value, its top-N) from its
    ``completion_probabilities`` entry: ``key`` "prob" (``id``, ``prob``, ``top_probs``: after the
    sampler, fast mode) or "logprob" (``id``, ``logprob``, ``top_logprobs``: the model's,
    ``post_sampling_probs`` false); at most ``most`` of them, none in the last chunk. A chunk of
    ``tokens`` without any entries is what llama-server streams for drafts its own speculation
    accepted: (id, None) each. Another shape raises RemoteError; so does a value out of range (``s``,
    naming the field)."""
    entries = chunk.get("completion_probabilities", []) if isinstance(chunk, dict) else None
    tokens = chunk.get("tokens") if isinstance(chunk, dict) else None
    if entries == [] and isinstance(tokens, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                                          for t in tokens):
        return [(t, None) for t in s.tokens(tokens, f"{field}.tokens", MAX_CHUNK_TOKENS)]
    if not isinstance(entries, list) or len(entries) != len(tokens or entries) \
            or not all(isinstance(e, dict) and "id" in e and key in e for e in entries):
        raise RemoteError(f"{s.where}: a streamed chunk without completion_probabilities (id, {key}) per token")
    tops = "top_probs" if key == "prob" else "top_logprobs"
    out: list[tuple[int, tuple[float, list[Entry]] | None]] = []
    for i, e in enumerate(s.array(entries, f"{field}.completion_probabilities", MAX_CHUNK_TOKENS)):
        name = f"{field}.completion_probabilities[{i}]"
        if key == "prob":
            value, top = s.prob(e[key], f"{name}.prob"), e.get(tops) or []
        else:  # the model's top-N is what a step-mode position is read from: it must be there
            value, top = s.logprob(e[key], f"{name}.logprob", nullable=True), s.get(e, tops, name)
        out.append((s.token(e["id"], f"{name}.id"), (value, llama_entries(top, s, f"{name}.{tops}", most, key))))
    return out


def connect(url: str, timeout_s: float = DEFAULT_TIMEOUT_S, mode: str = "step") -> RemoteModel:
    """A RemoteModel over the llama-server at ``url`` (asks it for its vocabulary and EOS), run by
    ``engine.runner`` in ``mode`` ("step": our chain over its top-N; "fast": it samples)."""
    client = JsonClient(url, timeout_s)
    s = Schema(f"llama.cpp server {client.url}/v1/models")
    data = s.array(s.get(client.get("/v1/models"), "data"), "data", 1000)
    if not data:
        raise s.fail("data", "no model with meta.n_vocab in the answer")
    meta = s.obj(s.get(data[0], "meta", "data[0]"), "data[0].meta")
    vocab = s.count(s.get(meta, "n_vocab", "data[0].meta"), "data[0].meta.n_vocab")
    context = s.count(meta.get("n_ctx") or 4096, "data[0].meta.n_ctx")
    api = LlamaCppApi(client, context, vocab_size=vocab)
    tokenizer = RemoteTokenizer(api)
    props = api.schema("/props").obj(client.get("/props"), "the answer")
    eos_text = api.schema("/props").optional_text(props.get("eos_token"), "eos_token", MAX_PIECE_CHARS) or ""
    eos = tuple(tokenizer.encode(eos_text, add_special_tokens=True)) if eos_text else ()
    return check_served(RemoteModel(f"llamacpp:{client.url}", api, tokenizer, vocab, eos if len(eos) == 1 else (),
                                    context, bool(props.get("chat_template")), mode=mode))


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
    fields: dict[str, Any] = {"seed": c.seed, "min_keep": 0}
    for spec in STAGES.values():  # each stage's own fields (engine/stages: ``served.llamacpp``)
        if spec.served.llamacpp is not None:
            fields.update(spec.served.llamacpp(c, context))
    samplers: list[str] = []
    unmapped: list[Note] = []
    order = c.active_stages()
    for stage in order:
        name = "penalties" if stage in PENALTY_STAGES else LLAMA_SAMPLER.get(stage, (None,))[0]
        if name and name not in samplers:
            samplers.append(name)
        elif name is None and STAGES[stage].served.llamacpp is None:  # else sent as fields (logit_bias, mirostat, grammar)
            knobs = [k.name for k in KNOBS.values() if k.stage == stage and getattr(c, k.name) != k.neutral]
            unmapped += [Note(k, UNMAPPED.get(k, "llama.cpp has no such sampler")) for k in knobs]
        unmapped += [Note(k, reason) for k, reason in STAGES[stage].served.refusals(c, "llamacpp")]
    if c.is_greedy:
        samplers.append("top_k")
        fields["top_k"] = 1
    elif not samplers:
        samplers.append("temperature")  # T = 1: changes nothing, and the list is never empty
    fields["samplers"] = samplers
    return LlamaRequest(fields, tuple(unmapped), tuple(_caveats(c, order)))


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
