"""A served model as a model: ``RemoteModel`` (what the decoding loop reads of a model: its
tokenizer, EOS ids, vocabulary, token texts), the operator's list (``RemoteSpec``,
``allowed_remote_models``) and what a backend's API returns (``Entry``, ``FastToken``,
``FastAnswer``). The backends' requests are in ``engine.backends.llamacpp`` and
``engine.backends.openai``; the modes that run a served model in ``engine.backends.remote``."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field, fields, replace
from typing import Any, Sequence

import torch

from engine.backends.client import JsonClient, RemoteError
from engine.backends.schema import MAX_CONTEXT
from engine.base.seam import Capabilities, served_capabilities
from engine.settings import SettingsError, env_list

BACKENDS = ("llamacpp", "openai")
# ``tokenizer=``: a tokenizer this app holds that the operator says is the server's own; one token's text
# then comes from it instead of a /detokenize request (checked at connect on TEXTS_SAMPLE ids)
TOKENIZERS = ("embedded",)
TEXTS_SAMPLE = 64
MODES = ("step", "fast")
STEP_TOP_N = 100  # step mode: tokens per step the server returns (our chain works over these)

FAST_PREFIX = "fast:"  # a model pick's value for a served model run in fast mode: ``fast:<server>``


@dataclass(frozen=True)
class ModelPick:
    """A model pick's value as data: the model's source and the mode a served model runs in. One
    encoding for every place that names a model and its mode (Compare's lane picks, Step through's
    model and mode radio, a lesson's ``models``, old links): ``fast:<server>`` is fast mode, anything
    else the source itself in step mode (a model loaded here has only that)."""

    source: str
    mode: str = "step"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode: expected {' or '.join(MODES)}, got {str(self.mode)[:40]!r}")

    @classmethod
    def parse(cls, value: str) -> "ModelPick":
        """``value`` as a ModelPick (``fast:<server>``: that server in fast mode)."""
        fast = value.startswith(FAST_PREFIX)
        return cls(value[len(FAST_PREFIX):] if fast else value, "fast" if fast else "step")

    @property
    def value(self) -> str:
        """The pick's value (``parse``'s inverse)."""
        return FAST_PREFIX + self.source if self.mode == "fast" else self.source


# --- the operator's list ---------------------------------------------------------------------------
@dataclass(frozen=True)
class RemoteSpec:
    """``backend:url[#vocab=V&eos=A+B&top=N&draws=1&tokenizer=embedded]``, e.g.
    ``llamacpp:http://127.0.0.1:8080`` or ``openai:http://gpu1:8000/v1#vocab=128256&eos=128001+128009``:
    vLLM's API reports neither its vocabulary size nor its EOS ids, so the operator gives them
    (llama-server reports both: no options). ``top``: step mode's tokens per step (default STEP_TOP_N),
    for a vLLM started with a lower ``--max-logprobs`` (its default is 20). ``draws=1``: a vLLM started
    with our logits processor (deploy/vllm_plugin/dp_draws.py, as ``make vllm`` starts it) drafts a
    sampled step-mode run's continuation with our chain and draws (engine.backends.remote.server_draws).
    ``tokenizer=embedded``: the server's tokenizer is the embedded model's (``make vllm`` serves that
    model), so the records' token texts come from it here, not from a /detokenize request each (vLLM
    sends its top-N as ids only); ``check_served`` compares TEXTS_SAMPLE of them with the server's."""

    backend: str
    url: str
    vocab_size: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    top_n: int | None = None
    draws: bool = False
    tokenizer: str = ""  # "" (the server's texts) or one of TOKENIZERS

    @classmethod
    def parse(cls, text: str, key: str = "model") -> "RemoteSpec":
        base, _, options = text.partition("#")
        backend, _, url = base.partition(":")
        if backend not in BACKENDS or not url.startswith(("http://", "https://")):
            raise ValueError(f"{key}: expected {' | '.join(BACKENDS)}:http://host:port, got {text[:80]!r}")
        found: dict[str, tuple[int, ...]] = {}
        tokenizer = ""
        for option in filter(None, options.split("&")):
            name, _, value = option.partition("=")
            if backend == "openai" and name == "tokenizer" and value in TOKENIZERS:
                tokenizer = value
                continue
            numbers = value.split("+")
            if backend != "openai" or name not in ("vocab", "eos", "top", "draws") \
                    or not all(n.isdigit() for n in numbers) or (name != "eos" and len(numbers) != 1) \
                    or (name == "top" and not 1 <= int(value) <= 1000) or (name == "draws" and value not in ("0", "1")):
                raise ValueError(f"{key}: option {option[:40]!r} in {text[:80]!r}: expected openai:...#vocab=<n>"
                                 "&eos=<id>+<id>[&top=<1..1000>][&draws=0|1][&tokenizer=embedded] (llamacpp reports "
                                 "both itself)")
            found[name] = tuple(int(n) for n in numbers)
        vocab, top = found.get("vocab"), found.get("top")
        return cls(backend, url.rstrip("/"), vocab_size=vocab[0] if vocab else None, eos_token_ids=found.get("eos", ()),
                   top_n=top[0] if top else None, draws=bool(found.get("draws", (0,))[0]), tokenizer=tokenizer)

    def __str__(self) -> str:
        options = ([f"vocab={self.vocab_size}"] if self.vocab_size else []) + \
            ([f"eos={'+'.join(map(str, self.eos_token_ids))}"] if self.eos_token_ids else []) + \
            ([f"top={self.top_n}"] if self.top_n else []) + (["draws=1"] if self.draws else []) + \
            ([f"tokenizer={self.tokenizer}"] if self.tokenizer else [])
        return f"{self.backend}:{self.url}" + ("#" + "&".join(options) if options else "")


def allowed_remote_models(environ: Any = None) -> tuple[RemoteSpec, ...]:
    """The remote models the operator allows (``DP_REMOTE_MODELS``); a malformed item raises
    SettingsError naming it. A page user can never add one."""
    try:
        return tuple(RemoteSpec.parse(item, "DP_REMOTE_MODELS") for item in env_list("DP_REMOTE_MODELS", environ))
    except ValueError as exc:
        raise SettingsError(str(exc)) from None


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
class RemoteLabel:
    """A served model's run as its trace labels it (``trace.extra["remote"]``, strict JSON): which server
    (``backend``, ``url``), which ``mode`` ("step": our chain over its top-N; "fast": its sampler), its
    ``top_n`` per step, every approximation in words, and the knobs its sampler did not run as ours
    (``unmapped``, ``caveats``: ``{"key", "reason"}`` each; none in step mode). What only some runs have
    is None and left out of the JSON: ``tail_mass`` (step mode: each step's mass outside the top-N),
    ``verified`` (step mode verifying continuations: ``remote.Verified.label``), ``timings``,
    ``streamed`` and ``server_speculative`` (fast mode: the server's own timings and drafting),
    ``requests`` (a served beam search) and ``scoring_calls`` (served speculative decoding)."""

    backend: str
    url: str
    mode: str
    top_n: int
    approximations: list[str]
    unmapped: list[dict[str, str]] = field(default_factory=list)
    caveats: list[dict[str, str]] = field(default_factory=list)
    tail_mass: list[float] | None = None
    verified: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    streamed: bool | None = None
    server_speculative: dict[str, Any] | None = None
    requests: int | None = None
    scoring_calls: int | None = None

    def to_json(self) -> dict[str, Any]:
        """The label as ``trace.extra["remote"]`` holds it: every field in this order, those that are
        None left out."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def of(cls, trace: Any) -> "RemoteLabel | None":
        """``trace``'s label (a Trace, possibly read from JSON), or None for a run of a model loaded here
        (no label, or not an object). A missing field reads as its empty value."""
        found = (getattr(trace, "extra", None) or {}).get("remote")
        if not isinstance(found, dict) or not found:
            return None
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in found.items() if k in known}
        return cls(**({"backend": "", "url": "", "mode": "step", "top_n": 0, "approximations": []} | values))


@dataclass
class RemoteTokenizer:
    """The server's tokenizer, as the stages call a tokenizer (``encode`` without special tokens,
    ``decode`` of one token for DRY's breakers); answers are memoised. ``texts``: a tokenizer held here
    that is the server's own (``RemoteSpec.tokenizer``, checked at connect): one token's text comes from
    it instead of a request."""

    api: Any  # LlamaCppApi | OpenAIApi
    texts: Any = None
    _pieces: dict[int, str] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # a fast tokenizer is not reentrant

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.api.tokenize(text, add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        if len(ids) == 1 and ids[0] in self._pieces:
            return self._pieces[ids[0]]
        if len(ids) == 1 and self.texts is not None:
            with self._lock:
                text = self.texts.decode(ids, skip_special_tokens=False)
        else:
            text = self.api.detokenize(ids) if ids else ""
        if len(ids) == 1:
            self._pieces[ids[0]] = text
        return text


@dataclass
class RemoteModel:
    """A served model (``engine.base.seam.Model``: what the decoding loop reads of a model);
    ``api`` speaks its backend's requests (LlamaCppApi, OpenAIApi), everything else is shared."""

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
    verify: int | None = None  # step mode: continuation tokens verified per request (None: DP_STEP_VERIFY_TOKENS)
    model: Any = None  # no network in this process (engine.base.seam.Model: capabilities.in_process is False)
    dtype: Any = None  # nor weights

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode: expected {' or '.join(MODES)}, got {self.mode!r}")
        if not 1 <= self.top_n <= 1000:
            raise ValueError(f"top_n: expected 1..1000 tokens per step, got {self.top_n!r}")
        if self.verify is not None and not 0 <= self.verify <= 64:
            raise ValueError(f"verify: expected 0..64 continuation tokens per request, got {self.verify!r}")

    def with_mode(self, mode: str, top_n: int | None = None) -> "RemoteModel":
        """The same server (client and memoised token texts shared) run in ``mode``."""
        return replace(self, mode=mode, top_n=self.top_n if top_n is None else top_n)

    @property
    def capabilities(self) -> Capabilities:
        """A top-N per position (step mode asks ``top_n``), streamed generations, what its API adds
        (vLLM's prompt log-probabilities, our draws); its sampler picks in fast mode; no logits,
        hidden states, cache or weights (engine.base.seam)."""
        return served_capabilities(self.top_n, fast=self.mode == "fast", prompt_logprobs=self.api.scores_prompt,
                                   our_draws=self.api.server_draws)

    @property
    def source(self) -> str:
        """What it was connected as: its name (``backend:url``)."""
        return self.name

    def next_logits(self, ids: Sequence[int], *, top_n: int | None = None, cache: Any = None) -> torch.Tensor:
        """The server's raw next-token distribution after ``ids``, truncated to its top ``top_n`` (default
        its own; one request): logits [1, V], log p inside the top-N, -inf outside (``cache``: unused,
        the server keeps its own prompt cache)."""
        return entries_logits(self, self.api.next_top(list(ids), self.top_n if top_n is None else top_n))[0]

    def cache(self) -> "RemoteCache":
        """Its positions as speculative decoding holds them: the server's top-N at each position fed."""
        return RemoteCache(self)

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

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([i for i in ids if i not in self.eos_token_ids])

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def learn_pieces(self, entries: Sequence[Entry]) -> None:
        """Memoise token texts the server sent with its probabilities."""
        for token, _, piece in entries:
            if piece is not None:
                self.tokenizer._pieces.setdefault(token, piece)


# --- a server's top-N as logits, and its cache -------------------------------------------------------
def entries_row(model: RemoteModel, top: list[Entry]) -> tuple[torch.Tensor, torch.Tensor, float]:
    """A server's top-N as step mode's row on its ids: the log-probabilities [1, N] at the ids [N]
    (ascending: every other logit is -inf, ``RunState.advance``'s support) and the tail mass
    1 - sum(top-N)."""
    model.learn_pieces(top)
    outside = [t for t, _, _ in top if not 0 <= t < model.vocab_size]  # the API checked its own bound
    if outside:
        raise RemoteError(f"{model.client.server} {model.url}: token {outside[0]} is outside the "
                          f"vocabulary of {model.vocab_size} (vocab_size)")
    tail = max(0.0, 1.0 - math.fsum(math.exp(lp) for _, lp, _ in top))
    pairs = sorted((t, lp) for t, lp, _ in top)  # by id (the schema refused an id listed twice)
    return (torch.tensor([[lp for _, lp in pairs]], dtype=torch.float32),
            torch.tensor([t for t, _ in pairs], dtype=torch.long), tail)


def entries_logits(model: RemoteModel, top: list[Entry]) -> tuple[torch.Tensor, float]:
    """A server's top-N as logits [1, V] (log p inside, -inf outside) and the tail mass."""
    values, ids, tail = entries_row(model, top)
    logits = torch.full((1, model.vocab_size), -math.inf)
    logits[0, ids] = values[0]
    return logits, tail


class RemoteCache:
    """A served model's cache (``engine.base.seam.Cache``: what speculative decoding's rounds ask of a
    KV cache), answered by its server: the tokens are only remembered, every "forward" is the server's
    top-N at the positions fed (``api.positions``: one request on vLLM, one per position on llama-server)."""

    def __init__(self, model: RemoteModel):
        self.model = model
        self.tokens: list[int] = []
        self.forwards = 0  # "forwards": scoring calls (each one request on vLLM, one per position on llama-server)

    @property
    def length(self) -> int:
        return len(self.tokens)

    def forward(self, input_ids: torch.Tensor, *, all_logits: bool = False) -> Any:
        """Feed ``input_ids`` [1, T]; ``.logits`` [1, T, V] (the top-N after each fed position) with
        ``all_logits``, else [1, 1, V]."""
        start = len(self.tokens) + 1
        self.tokens += input_ids[0].tolist()
        positions = self.model.api.positions(self.tokens, start if all_logits else len(self.tokens), self.model.top_n)
        self.forwards += 1
        rows = torch.cat([entries_logits(self.model, top)[0] for top in positions])  # [T or 1, V]
        return _Output(rows.unsqueeze(0))

    def step(self, token_ids: Sequence[int]) -> torch.Tensor:
        return self.forward(torch.tensor([list(token_ids)])).logits[:, -1, :]

    def sync(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Hold ``token_ids``; the top-N after the last one [1, V]."""
        self.tokens = list(token_ids[:-1])
        return self.step(token_ids[-1:])

    def rewind(self, n: int) -> None:
        if n < 0 or n > self.length:
            raise ValueError(f"rewind: n={n} must be in [0, {self.length}]")
        del self.tokens[len(self.tokens) - n:]


class _Output:
    def __init__(self, logits: torch.Tensor):
        self.logits = logits


# --- is it a model? --------------------------------------------------------------------------------
PROBE_TEXT = "The capital of France is"  # one request at connect: the answer after it must not be flat
FLAT_SPREAD = 1e-4  # nats: a model's top-N spans several; a model whose weights did not load answers all equal


def check_served(model: RemoteModel) -> RemoteModel:
    """``model`` when its server answers like a model that fits its tokenizer, else RemoteError in one
    line: every EOS id inside the vocabulary and read back by the tokenizer as itself; the tokenizer's
    ids inside the vocabulary (the answers' schema checks every id; a misfit gets the #vocab= hint);
    and, from one request after PROBE_TEXT, a top-N that is not flat (a checkpoint vLLM loads without
    the weights it reads answers every token at log 1/V). The request asks step mode's top-N, so a
    server whose logprobs limit is lower says so here."""
    where = f"{model.client.server} {model.url}"
    try:
        ids = model.tokenizer.encode(PROBE_TEXT, add_special_tokens=True)
        if model.tokenizer.texts is not None:
            _check_texts(model, where, ids)
        _check_eos(model, where)
        top = model.api.next_top(ids, model.top_n)
    except RemoteError as exc:
        raise RemoteError(f"{exc}{_connect_hint(model, str(exc))}") from None
    logprobs = [lp for _, lp, _ in top if math.isfinite(lp)]
    if len(logprobs) > 1 and max(logprobs) - min(logprobs) < FLAT_SPREAD:
        raise RemoteError(f"{where}: the served model answers a uniform distribution (its top {len(logprobs)} "
                          f"log-probabilities are all {_as_one_in(logprobs[0])}): its weights did not load")
    model.learn_pieces(top)
    return model


def _as_one_in(logprob: float) -> str:
    """``logprob`` as an error line shows it: ``-10.8000 = log 1/49152`` (the 1/V a uniform answer
    has), the value alone where 1/p would not be a number of a vocabulary's size."""
    if not -math.log(MAX_CONTEXT) - 1 <= logprob <= 0:  # exp(-logprob) overflows a float below -709.78
        return f"{logprob:.6g}"
    return f"{logprob:.4f} = log 1/{round(math.exp(-logprob))}"


NOT_THE_SERVERS = "it is not the server's tokenizer (list the server without tokenizer=)"  # _check_texts' lines end


def _check_texts(model: RemoteModel, where: str, ids: list[int]) -> None:
    """The tokenizer the spec names is the server's: the same size or smaller than the vocabulary, the
    same ids for PROBE_TEXT as the server's (``ids``), and the same text for the first 16 ids (the special
    tokens, as a rule), the EOS ids and TEXTS_SAMPLE ids spread over the vocabulary, each read back by a
    /detokenize."""
    local = model.tokenizer.texts
    size = len(local)
    if size > model.vocab_size:
        raise RemoteError(f"{where}: tokenizer=embedded has {size} tokens, more than the server's vocabulary of "
                          f"{model.vocab_size}: {NOT_THE_SERVERS}")
    ours = list(local(PROBE_TEXT, add_special_tokens=True)["input_ids"])
    if ids != ours:
        raise RemoteError(f"{where}: tokenizer=embedded reads {PROBE_TEXT!r} as {ours[:8]}, the server as {ids[:8]}: "
                          f"{NOT_THE_SERVERS}")
    step = max(1, size // TEXTS_SAMPLE)
    sample = set(range(min(16, size))) | {e for e in model.eos_token_ids if e < size} | set(range(0, size, step))
    for token in sorted(sample):
        server, here = model.api.detokenize([token]), local.decode([token], skip_special_tokens=False)
        if server != here:
            raise RemoteError(f"{where}: tokenizer=embedded reads token {token} as {here[:40]!r}, the server as "
                              f"{server[:40]!r}: {NOT_THE_SERVERS}")


def _check_eos(model: RemoteModel, where: str) -> None:
    """Each EOS id inside the vocabulary, and its text tokenised back as itself."""
    for eos in model.eos_token_ids:
        text = model.tokenizer.decode([eos]) if eos < model.vocab_size else ""
        again = model.tokenizer.encode(text, add_special_tokens=True) if text else []
        if again[-1:] != [eos]:
            raise RemoteError(f"{where}: EOS {eos} does not fit the tokenizer (it reads {text!r}, which tokenises as "
                              f"{again[:4]}; vocabulary {model.vocab_size}): give the model's own EOS ids (#eos=)")


def _connect_hint(model: RemoteModel, line: str) -> str:
    """What the operator can change when connecting failed with ``line``: the logprobs limit (vLLM's 400)
    or the vocabulary they gave (an id outside it: engine.backends.schema's line)."""
    if "max allowed" in line:
        return (f" (step mode asks the top {model.top_n}: start vLLM with --max-logprobs {model.top_n}, "
                "or list it with #top=<its limit>)")
    if f"expected a token id in [0, {model.vocab_size})" in line:
        return f" (the vocabulary of {model.vocab_size} does not fit the tokenizer: give the model's own size, #vocab=)"
    return ""
