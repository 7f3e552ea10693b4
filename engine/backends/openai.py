"""An OpenAI-compatible server (vLLM, SGLang, llama-server's own /v1): /v1/completions with
``logprobs`` (vLLM adds ``prompt_logprobs``), /tokenize and /detokenize at the server root;
``connect_openai``; our knobs as its sampling fields (each stage's ``served.openai``)."""

from __future__ import annotations

import math
from contextlib import closing
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from engine.backends.client import DEFAULT_TIMEOUT_S, JsonClient, RemoteError
from engine.backends.llamacpp import llama_entries
from engine.backends.served import Entry, FastAnswer, FastToken, RemoteModel, RemoteTokenizer
from engine.config import KNOBS, DecodingConfig
from engine.stages import STAGES

VOCAB_BOUND = 262_144  # ids a server that does not report its vocabulary may send (Gemma 3's 262144 the largest)

def _openai_tokens(choice: dict[str, Any]) -> list[tuple[int, float, list[Entry]]]:
    """Each generated token of a /v1/completions choice as (id, logprob, its top-N), from either
    logprobs format: vLLM's (OpenAI's legacy ``tokens`` / ``token_logprobs`` / ``top_logprobs``,
    with ``return_tokens_as_token_ids``: keys ``token_id:<id>``) or llama-server's (``content``:
    ``[{id, logprob, bytes, top_logprobs}]``)."""
    logprobs = choice.get("logprobs") or {}
    if "content" in logprobs:
        return [(int(e["id"]), float(e["logprob"]), llama_entries(e.get("top_logprobs") or []))
                for e in logprobs["content"]]
    tops = logprobs.get("top_logprobs") or []
    return [(_token_id(token), float(lp), [(_token_id(k), float(v), None) for k, v in (top or {}).items()])
            for token, lp, top in zip(logprobs.get("tokens") or [], logprobs.get("token_logprobs") or [], tops)]


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
            return _openai_tokens(choice)[0][2]
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
        last = _openai_tokens(choice)[0][2]
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
        (each stage's ``served.openai``): a FastToken (its top-N ``logprobs``: raw or processed, the server's
        ``--logprobs-mode``) as each token arrives, then the FastAnswer. ``raw`` changes nothing
        (the top-N are the only ones it sends)."""
        fields, notes = _openai_fields(config, self.dialect)
        where = f"OpenAI-compatible server {self.client.url}/completions"
        finish, stop_reason = "", None
        body = {"model": self.model_id, "return_tokens_as_token_ids": True, "return_token_ids": True,
                "prompt": list(ids), "stream": True, "max_tokens": config.max_new_tokens, "logprobs": config.top_n,
                "seed": config.seed, "stop": list(config.stop), **fields}
        with closing(self.client.stream_post("/completions", body)) as chunks:  # closed: the server stops too
            for chunk in chunks:
                choices = chunk.get("choices") if isinstance(chunk, dict) else None
                if not isinstance(choices, list):
                    raise RemoteError(f"{where}: a streamed chunk without choices")
                for choice in choices[:1]:  # a usage-only chunk has none
                    try:
                        tokens = _openai_tokens(choice)
                    except (KeyError, TypeError, ValueError) as exc:
                        raise RemoteError(f"{where}: a streamed chunk without token logprobs ({exc})") from None
                    for token, lp, top in tokens:
                        yield FastToken(token, math.exp(lp), None, top)
                    finish = choice.get("finish_reason") or finish
                    stop_reason = choice.get("stop_reason", stop_reason)
        reason = {"stop": "eos", "length": "max_new_tokens"}.get(finish, "max_new_tokens")
        if reason == "eos" and isinstance(stop_reason, str):  # vLLM: the stop string that ended it
            reason = "stop_string"
        approximations = ["the server sampled (its own generator and sampler code); no draw u is known",
                          "the top-N per token are the server's logprobs: the raw model's on llama-server and "
                          "under vLLM's default --logprobs-mode raw_logprobs, processed under processed_logprobs",
                          "entropies are over the top-N only"]
        yield FastAnswer(reason, approximations, notes)


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
        fields.update((served.openai_llamacpp if dialect == "llamacpp" and served.openai_llamacpp else served.openai)(config))
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
                   vocab_size: int | None = None, eos_token_ids: Sequence[int] = ()) -> RemoteModel:
    """A RemoteModel over an OpenAI-compatible server whose API is at ``url`` (``.../v1``). Its
    first model is used; a llama-server (its /v1/models carries ``meta``) also tells its vocabulary
    and EOS, a vLLM does not: give ``vocab_size`` and ``eos_token_ids`` (else ids up to
    VOCAB_BOUND are accepted and a run stops at max_new_tokens or a stop string)."""
    client = JsonClient(url, timeout_s, "OpenAI-compatible server")
    root = JsonClient(url[:-3] if url.rstrip("/").endswith("/v1") else url, timeout_s, "OpenAI-compatible server")
    try:
        info = client.get("/models")["data"][0]
        model_id = str(info["id"])
    except (KeyError, IndexError, TypeError):
        raise RemoteError(f"OpenAI-compatible server {client.url}/models: no model in the answer") from None
    meta = info.get("meta") if isinstance(info.get("meta"), dict) else None
    api = OpenAIApi(client, root, model_id, "llamacpp" if meta else "vllm")
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
    return RemoteModel(f"openai:{client.url}", api, tokenizer, vocab, tuple(eos_token_ids), context, chat, mode=mode)
