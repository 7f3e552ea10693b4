"""An OpenAI-compatible server (vLLM, SGLang, llama-server's own /v1): /v1/completions with
``logprobs`` (vLLM adds ``prompt_logprobs``), /tokenize and /detokenize at the server root;
``connect_openai``; our knobs as its sampling fields (each stage's ``served.openai``).

Every field read from an answer goes through ``engine.backends.schema.Schema`` (ids in the
vocabulary, log-probabilities finite and <= 0, types, counts): a bad one is one RemoteError line
naming the server and the field. Fast mode reads at most ``max_new_tokens`` tokens, whatever the
server sends."""

from __future__ import annotations

import math
from contextlib import closing
from dataclasses import dataclass
from typing import Any, Generator, Iterator, Sequence

from engine.backends.client import DEFAULT_TIMEOUT_S, JsonClient, RemoteError
from engine.backends.llamacpp import MAX_CHUNK_TOKENS, MAX_TRAILING_CHUNKS, llama_entries
from engine.backends.schema import LOGPROB_FLOOR, MAX_CONTEXT, MAX_PIECE_CHARS, PROB_SLACK, VOCAB_BOUND, Schema
from engine.backends.served import (STEP_TOP_N, Entry, FastAnswer, FastToken, RemoteModel, RemoteTokenizer,
                                    check_served)
from engine.config import KNOBS, DecodingConfig
from engine.stages import STAGES

TEMPLATE_TOKENS = 4096  # tokens a chat template may add around the user's prompt


def _openai_tokens(choice: Any, s: Schema, field: str, most: int, top_n: int) -> list[tuple[int, float, list[Entry]]]:
    """Each generated token of a /v1/completions choice as (id, logprob, its top-N), from either
    logprobs format: vLLM's (OpenAI's legacy ``tokens`` / ``token_logprobs`` / ``top_logprobs``,
    with ``return_tokens_as_token_ids``: keys ``token_id:<id>``) or llama-server's (``content``:
    ``[{id, logprob, bytes, top_logprobs}]``); every field checked (at most ``most`` tokens, each
    top-N at most ``top_n`` + 1 entries). vLLM's top list puts the sampled token first, and holds
    N + 1 entries when it lies outside the top N: that entry is left out of the token's top-N (its
    log-probability is the token's own); the top-N come best first."""
    logprobs = s.obj(s.obj(choice, field).get("logprobs") or {}, f"{field}.logprobs")
    field = f"{field}.logprobs"
    if "content" in logprobs:
        out = []
        for i, e in enumerate(s.array(logprobs["content"], f"{field}.content", most)):
            name = f"{field}.content[{i}]"
            out.append((s.token(s.get(e, "id", name), f"{name}.id"),
                        s.logprob(s.get(e, "logprob", name), f"{name}.logprob", nullable=True),
                        llama_entries(e.get("top_logprobs") or [], s, f"{name}.top_logprobs", top_n + 1)))
        return out
    tokens = s.array(logprobs.get("tokens") or [], f"{field}.tokens", most)
    lps = s.array(logprobs.get("token_logprobs") or [], f"{field}.token_logprobs", most)
    tops = s.array(logprobs.get("top_logprobs") or [], f"{field}.top_logprobs", most)
    if not len(tokens) == len(lps) == len(tops):
        raise s.fail(field, f"tokens, token_logprobs and top_logprobs differ in length "
                            f"({len(tokens)}, {len(lps)}, {len(tops)})")
    out = []
    for i, (token, lp, top) in enumerate(zip(tokens, lps, tops)):
        token_id = _token_id(token, s, f"{field}.tokens[{i}]")
        entries = _top(top, s, f"{field}.top_logprobs[{i}]", top_n + 1)
        if len(entries) == top_n + 1 and entries[0][0] == token_id:
            entries = entries[1:]  # the sampled token, outside the top N
        out.append((token_id, s.logprob(lp, f"{field}.token_logprobs[{i}]"), sorted(entries, key=lambda e: -e[1])))
    return out


def _top(top: Any, s: Schema, field: str, most: int) -> list[Entry]:
    """vLLM's ``{"token_id:<id>": logprob}`` top-N as Entries, checked: an entry that passes every check
    is read at once; one that fails is checked again field by field for the line naming it (a step
    reads N of them per token: the names are built only for a bad one)."""
    entries: list[Entry] = []
    for k, v in s.obj(top or {}, field).items():
        token = _plain_id(k)
        if token is not None and token < s.vocab and type(v) is float and LOGPROB_FLOOR <= v <= PROB_SLACK:
            entries.append((token, min(v, 0.0), None))
        else:
            name = f"{field}[{str(k)[:20]!r}]"
            entries.append((_token_id(k, s, name), s.logprob(v, name), None))
    return s.top(entries, field, most)


def _plain_id(key: Any) -> int | None:
    """``token_id:<at most 10 ASCII digits>`` -> the id, else None."""
    if type(key) is str and key.startswith("token_id:") and 9 < len(key) <= 19:
        number = key[9:]
        if number.isascii() and number.isdigit():
            return int(number)
    return None


def _token_id(key: Any, s: Schema, field: str) -> int:
    """``token_id:123`` (vLLM's ``return_tokens_as_token_ids``) -> 123, in the vocabulary."""
    prefix, _, number = s.text(key, field, MAX_PIECE_CHARS).partition(":")
    if prefix != "token_id" or not (number.isascii() and number.isdigit()) or len(number) > 10:
        raise s.fail(field, f"expected token_id:<id>, got {key[:40]!r}")
    return s.token(int(number), field)


def _row(row: Any, s: Schema, field: str, most: int) -> dict[int, float]:
    """A prompt_logprobs row, ``{"<id>": {"logprob": x, ...}}``, as {id: logprob}, checked: the
    prompt's own token and the top-N (at most ``most`` entries, probabilities adding up to <= 1)."""
    entries: list[Entry] = [(_id_key(k, s, f"{field}[{k[:20]!r}]"),
                s.logprob(s.get(v, "logprob", f"{field}[{k[:20]!r}]"), f"{field}[{k[:20]!r}].logprob"), None)
               for k, v in s.obj(row, field).items()]
    return {token: lp for token, lp, _ in s.top(entries, field, most)}


def _id_key(key: str, s: Schema, field: str) -> int:
    """A prompt_logprobs row's key (a token id as a string), in the vocabulary."""
    if not (key.isascii() and key.isdigit()) or len(key) > 10:
        raise s.fail(field, f"expected a token id, got {key[:40]!r}")
    return s.token(int(key), field)


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
    vocab_size: int = VOCAB_BOUND  # the ids its answers may hold (the operator's vocab=, or llama-server's n_vocab)
    server_draws: bool = False  # a vLLM with deploy/vllm_plugin/dp_draws.py loaded (the spec's draws=1)

    @property
    def scores_prompt(self) -> bool:
        """One request scores every position of a sequence: vLLM's ``prompt_logprobs`` (llama-server's
        OpenAI-compatible endpoint has none)."""
        return self.dialect == "vllm"

    def schema(self, path: str, root: bool = False) -> Schema:
        """The checks for an answer to ``path`` (at the server root when ``root``)."""
        client = self.root if root else self.client
        return Schema(f"{client.server} {client.url}{path}", self.vocab_size)

    def tokenize(self, text: str, special: bool) -> list[int]:
        body = {"content": text, "add_special": special, "parse_special": special} if self.dialect == "llamacpp" \
            else {"model": self.model_id, "prompt": text, "add_special_tokens": special}
        s = self.schema("/tokenize", root=True)
        return s.tokens(s.get(self._root("/tokenize", body), "tokens"), "tokens", len(text.encode()) + 16)

    def detokenize(self, ids: list[int]) -> str:
        key = "content" if self.dialect == "llamacpp" else "prompt"
        s = self.schema("/detokenize", root=True)
        answer = self._root("/detokenize", {"model": self.model_id, "tokens": ids})
        return s.text(s.get(answer, key), key, MAX_PIECE_CHARS * max(1, len(ids)))

    def chat_ids(self, prompt: str) -> list[int]:
        messages = [{"role": "user", "content": prompt}]
        if self.dialect == "llamacpp":
            s = self.schema("/apply-template", root=True)
            text = s.get(self._root("/apply-template", {"messages": messages}), "prompt")
            return self.tokenize(s.text(text, "prompt"), True)
        body = {"model": self.model_id, "messages": messages, "add_generation_prompt": True}
        s = self.schema("/tokenize", root=True)
        return s.tokens(s.get(self._root("/tokenize", body), "tokens"), "tokens",
                        len(prompt.encode()) + TEMPLATE_TOKENS)

    def _root(self, path: str, body: dict[str, Any]) -> Any:
        """A request at the server root; a server without the endpoint is one line saying so."""
        try:
            return self.root.post(path, body)
        except RemoteError as exc:
            if ": HTTP 404" in str(exc):
                raise RemoteError(f"OpenAI-compatible server {self.root.url}{path}: missing (HTTP 404); "
                                  "step mode needs the server's tokenizer (vLLM and llama-server have it)") from None
            raise

    def _complete(self, body: dict[str, Any]) -> tuple[Schema, dict[str, Any]]:
        """A /completions request: its schema and its first choice (an object)."""
        answer = self.client.post("/completions", {"model": self.model_id, "return_tokens_as_token_ids": True,
                                                   "return_token_ids": True, **body})
        s = self.schema("/completions")
        choices = s.array(s.get(answer, "choices"), "choices", 16)
        if not choices:
            raise s.fail("choices", "empty: no choices in the answer")
        return s, s.obj(choices[0], "choices[0]")

    def next_top(self, ids: Sequence[int], top_n: int) -> list[Entry]:
        """The model's top-N after ``ids``: one token at temperature 0 with ``logprobs`` = N (vLLM
        returns the raw model's under its default ``--logprobs-mode raw_logprobs``)."""
        s, choice = self._complete({"prompt": list(ids), "max_tokens": 1, "logprobs": top_n, "temperature": 0})
        tokens = _openai_tokens(choice, s, "choices[0]", MAX_CHUNK_TOKENS, top_n)
        if not tokens:
            raise s.fail("choices[0].logprobs", "no top logprobs in the answer")
        return tokens[0][2]

    def continuation(self, ids: Sequence[int], count: int, top_n: int,
                     draws: dict[str, Any] | None = None) -> Iterator[tuple[int, list[Entry]]]:
        """The server's greedy continuation of ``ids`` (temperature 0), at most ``count`` tokens, streamed:
        (token, its top-N ``logprobs``) as each is made (the raw model's under vLLM's default
        ``--logprobs-mode raw_logprobs``, as ``next_top``'s); fewer when it stops. Closing the iterator
        early closes the connection and the server aborts the request (``remote.stream_verified``
        closes it at its first disagreement). More than ``count`` tokens is one RemoteError line. ``draws``
        (``remote.server_draws``, for a server with our logits processor): its tokens are our draws instead
        of its argmax."""
        body = {"model": self.model_id, "return_tokens_as_token_ids": True, "return_token_ids": True,
                "prompt": list(ids), "max_tokens": count, "logprobs": top_n, "temperature": 0, "stream": True,
                **({"vllm_xargs": draws} if draws else {})}
        s = self.schema("/completions")
        read = 0
        with closing(self.client.stream_post("/completions", body)) as chunks:
            for i, chunk in enumerate(chunks):
                choice = _first_choice(chunk, s, i)
                for token, _, top in (_openai_tokens(choice, s, f"stream[{i}].choices[0]", MAX_CHUNK_TOKENS, top_n)
                                      if choice is not None else ()):
                    read += 1
                    if read > count:
                        raise s.fail(f"stream[{i}].choices[0].logprobs", f"more tokens than the {count} asked")
                    yield token, top

    def prompt_logprobs(self, ids: Sequence[int], top_n: int) -> list[dict[int, float] | None]:
        """vLLM's ``prompt_logprobs``: for each position of ``ids``, the log-probabilities of its
        token and the top-N there (None for the first). llama-server has none: one line says so."""
        return self._scored(ids, top_n)[0]

    def _scored(self, ids: Sequence[int], top_n: int) -> tuple[list[dict[int, float] | None], list[Entry]]:
        """One request: ``prompt_logprobs`` (rows as above) and the top-N after the whole of ``ids``."""
        if self.dialect != "vllm":
            raise RemoteError(f"OpenAI-compatible server {self.client.url}/completions: prompt_logprobs: "
                              "not supported by llama-server's OpenAI endpoint (vLLM has them)")
        s, choice = self._complete({"prompt": list(ids), "max_tokens": 1, "prompt_logprobs": top_n,
                                    "logprobs": top_n, "temperature": 0})
        rows = choice.get("prompt_logprobs")
        if rows is None:
            raise RemoteError(f"OpenAI-compatible server {self.client.url}/completions: prompt_logprobs: "
                              f"{top_n} asked, none in the answer")
        field = "choices[0].prompt_logprobs"
        if len(s.array(rows, field, len(ids))) != len(ids):
            raise s.fail(field, f"{len(rows)} rows for a prompt of {len(ids)} tokens")
        tokens = _openai_tokens(choice, s, "choices[0]", MAX_CHUNK_TOKENS, top_n)
        if not tokens:
            raise s.fail("choices[0].logprobs", "no top logprobs in the answer")
        return [None if row is None else _row(row, s, f"{field}[{i}]", top_n + 1) for i, row in enumerate(rows)], \
            tokens[0][2]

    def positions(self, ids: Sequence[int], start: int, top_n: int) -> list[list[Entry]]:
        """The top-N after ``ids[:i]`` for i = start .. len(ids), each with the log-probability of
        the token ``ids`` has next (exact even outside the top-N): one request on vLLM
        (``prompt_logprobs``), one per position on llama-server's endpoint (no prompt_logprobs)."""
        if self.dialect != "vllm":
            return [self.next_top(ids[:i], top_n) for i in range(start, len(ids) + 1)]
        rows, last = self._scored(ids, top_n)
        scored: list[list[Entry]] = [[(t, lp, None) for t, lp in (rows[i] or {}).items()]
                                     for i in range(start, len(ids))]
        return scored + [last]

    def generate(self, ids: Sequence[int], config: DecodingConfig, raw: bool) -> Iterator[FastToken | FastAnswer]:
        """Fast mode: one streamed request; the server samples with the knobs it has
        (each stage's ``served.openai``): a FastToken (its top-N ``logprobs``: raw or processed, the server's
        ``--logprobs-mode``) as each token arrives, then the FastAnswer. ``raw`` changes nothing
        (the top-N are the only ones it sends). At most ``config.max_new_tokens`` tokens are read:
        a server that sends more is cut off there (the stream closed, the answer saying so)."""
        fields, notes = _openai_fields(config, self.dialect)
        body = {"model": self.model_id, "return_tokens_as_token_ids": True, "return_token_ids": True,
                "prompt": list(ids), "stream": True, "max_tokens": config.max_new_tokens, "logprobs": config.top_n,
                "seed": config.seed, "stop": list(config.stop), **fields}
        if self.stop_token_ids:
            body["stop_token_ids"] = list(self.stop_token_ids)
        stream = _Stream(self.schema("/completions"), config)
        with closing(stream.tokens(self.client.stream_post("/completions", body))) as streamed:  # a Stop closes it
            for token, lp, top in streamed:
                yield FastToken(token, math.exp(lp), None, top, raw_prob=math.exp(lp))
        approximations = ["the server sampled (its own generator and sampler code); no draw u is known",
                          "the top-N per token are the server's logprobs: the raw model's on llama-server and "
                          "under vLLM's default --logprobs-mode raw_logprobs, processed under processed_logprobs",
                          "entropies are over the top-N only", *stream.notes]
        yield FastAnswer(stream.stop_reason(), approximations, notes)


def _first_choice(chunk: Any, s: Schema, i: int) -> Any | None:
    """Streamed chunk ``i``'s first choice, or None (a usage-only chunk has none); a chunk that is not
    an object, or whose ``choices`` is missing or not a list of at most 16, is one line naming the field."""
    choices = s.array(s.get(s.obj(chunk, f"stream[{i}]"), "choices", f"stream[{i}]"), f"stream[{i}].choices", 16)
    return choices[0] if choices else None


class _Stream:
    """Reads a streamed /v1/completions: its tokens (at most ``config.max_new_tokens``), then how it
    stopped (``stop_reason()``) and what the reading had to say (``notes``)."""

    def __init__(self, schema: Schema, config: DecodingConfig):
        self.schema, self.config = schema, config
        self.finish: str | None = None
        self.stopped_by: str | int | None = None  # vLLM's stop_reason: the stop string (or token) that ended it
        self.notes: list[str] = []

    def tokens(self, chunks: Generator[Any, None, None]) -> Generator[tuple[int, float, list[Entry]], None, None]:
        """(id, logprob, top-N) per token as the chunks arrive, until the stream ends; past
        ``max_new_tokens`` tokens, or ``MAX_TRAILING_CHUNKS`` chunks after the last one, the
        stream is closed (the server stops too)."""
        s, limit = self.schema, self.config.max_new_tokens
        count, trailing = 0, 0
        with closing(chunks):
            for i, chunk in enumerate(chunks):
                choice = _first_choice(chunk, s, i)
                parsed = self._choice(choice, f"stream[{i}].choices[0]") if choice is not None else []
                if count >= limit and (parsed or trailing >= MAX_TRAILING_CHUNKS):
                    self.notes.append(f"the server went on past max_new_tokens ({limit}); the stream was cut there")
                    self.finish = "length"
                    return
                trailing += count >= limit
                yield from parsed[:limit - count]
                count += len(parsed[:limit - count])

    def _choice(self, choice: Any, field: str) -> list[tuple[int, float, list[Entry]]]:
        s = self.schema
        tokens = _openai_tokens(choice, s, field, MAX_CHUNK_TOKENS, self.config.top_n)
        self.finish = s.optional_text(choice.get("finish_reason"), f"{field}.finish_reason") or self.finish
        stopped_by = choice.get("stop_reason", self.stopped_by)
        if stopped_by is not None and not isinstance(stopped_by, (str, int)) or isinstance(stopped_by, bool):
            raise s.fail(f"{field}.stop_reason", f"expected a string, a token id or null, got "
                                                 f"{type(stopped_by).__name__}")
        self.stopped_by = stopped_by
        return tokens

    def stop_reason(self) -> str:
        reason = {"stop": "eos", "length": "max_new_tokens"}.get(self.finish or "", "max_new_tokens")
        if reason == "eos" and isinstance(self.stopped_by, str):  # vLLM: the stop string that ended it
            reason = "stop_string"  # (an int stop_reason is the stop token that ended it: one of our EOS ids)
        return reason


def _openai_fields(config: DecodingConfig, dialect: str = "vllm") -> tuple[dict[str, Any], dict[str, list[dict[str, str]]]]:
    """Our knobs as an OpenAI-compatible completion request's sampling fields (each stage's ``served.openai``;
    on llama-server's own endpoint, ``dialect`` "llamacpp", its ``served.openai_llamacpp`` where it has one),
    and the notes: knobs it cannot express (``unmapped``), differences (``caveats``)."""
    active = config.active_stages()
    # every field sent, neutral or not, so no server default (llama-server: top-k 40...) leaks in;
    # each stage's own fields (engine/stages: ``served.openai``)
    fields: dict[str, Any] = {}
    mapped = [name for name, spec in STAGES.items() if spec.served.openai is not None]
    for name in mapped:
        served = STAGES[name].served
        to_fields = served.openai_llamacpp if dialect == "llamacpp" and served.openai_llamacpp else served.openai
        if to_fields is not None:  # (every mapped stage has its openai fields)
            fields.update(to_fields(config))
    if config.is_greedy:
        fields["temperature"] = 0.0
    unmapped = [{"key": k.name, "reason": "the OpenAI-compatible API has no such sampling parameter"}
                for k in KNOBS.values() if k.stage in active and k.stage not in mapped
                and getattr(config, k.name) != k.neutral]
    server = "llamacpp" if dialect == "llamacpp" else "vllm"
    unmapped += [{"key": k, "reason": reason} for stage in active for k, reason in STAGES[stage].served.refusals(config, server)]
    caveats = [{"key": "stage_order", "reason": "the server applies its own fixed order, not ours"}]
    if not config.is_greedy:
        caveats.append({"key": "seed", "reason": "the server has its own random generator: the same seed "
                                                 "gives another text (step mode draws with ours)"})
    return fields, {"unmapped": unmapped, "caveats": caveats}


def connect_openai(url: str, timeout_s: float = DEFAULT_TIMEOUT_S, mode: str = "step", *,
                   vocab_size: int | None = None, eos_token_ids: Sequence[int] = (),
                   top_n: int | None = None, server_draws: bool = False, texts: Any = None) -> RemoteModel:
    """A RemoteModel over an OpenAI-compatible server whose API is at ``url`` (``.../v1``). Its
    first model is used; a llama-server (its /v1/models carries ``meta``) also tells its vocabulary
    and EOS, a vLLM does not: give ``vocab_size`` and ``eos_token_ids`` (else ids up to
    VOCAB_BOUND are accepted and a run stops at max_new_tokens or a stop string). ``top_n``: step
    mode's tokens per step (default STEP_TOP_N). ``server_draws``: the server has our logits processor
    (``RemoteSpec.draws``). ``texts``: a tokenizer held here that is the server's (``RemoteSpec.tokenizer``:
    token texts without requests). Checked by ``check_served``."""
    client = JsonClient(url, timeout_s, "OpenAI-compatible server")
    root = JsonClient(url[:-3] if url.rstrip("/").endswith("/v1") else url, timeout_s, "OpenAI-compatible server")
    s = Schema(f"OpenAI-compatible server {client.url}/models")
    data = s.array(s.get(client.get("/models"), "data"), "data", 1000)
    if not data:
        raise s.fail("data", "no model in the answer")
    info = s.obj(data[0], "data[0]")
    model_id = s.text(s.get(info, "id", "data[0]"), "data[0].id", MAX_PIECE_CHARS)
    meta = info.get("meta") if isinstance(info.get("meta"), dict) else None
    context = s.count((meta or {}).get("n_ctx") or info.get("max_model_len") or 4096, "data[0].max_model_len")
    vocab = vocab_size or s.count((meta or {}).get("n_vocab") or VOCAB_BOUND, "data[0].meta.n_vocab", 1, MAX_CONTEXT)
    api = OpenAIApi(client, root, model_id, "llamacpp" if meta else "vllm", vocab_size=vocab,
                    stop_token_ids=() if meta else tuple(eos_token_ids), server_draws=server_draws and not meta)
    tokenizer = RemoteTokenizer(api, texts)
    chat = True
    if meta:
        props = api.schema("/props", root=True).obj(root.get("/props"), "the answer")
        eos_text = api.schema("/props", root=True).optional_text(props.get("eos_token"), "eos_token",
                                                                 MAX_PIECE_CHARS) or ""
        found = tuple(tokenizer.encode(eos_text, add_special_tokens=True)) if eos_text else ()
        eos_token_ids = eos_token_ids or (found if len(found) == 1 else ())
        chat = bool(props.get("chat_template"))
    return check_served(RemoteModel(f"openai:{client.url}", api, tokenizer, vocab, tuple(eos_token_ids), context, chat,
                                    mode=mode, top_n=top_n or STEP_TOP_N))
