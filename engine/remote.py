"""A llama.cpp server (``llama-server``, its native ``/completion`` API) as a model (issue #29).

Two modes, both ending in an ordinary engine ``Trace`` so the existing views can draw them:

- **step mode** (``stream_step`` / ``run_step``): one request per token (``n_predict`` 1,
  ``cache_prompt`` on, so the server re-reads only the new token). The server's *raw* top-N
  probabilities become logits (log p inside the top-N, -inf outside); our own stage chain and our
  own seeded draw (``engine.core.RunState``, the local engine's loop body) pick the token. Exact up
  to the truncation to the top-N, which the trace labels.
- **fast mode** (``run_fast``): one request for the whole text; the server's sampler picks (its own
  random generator: the same seed gives a different text than ours). Each step shows the server's
  final (post-sampling) top-N and, from a second request with the same seed, its raw top-N.

``RemoteModel`` quacks like ``engine.models.LoadedModel`` where the decoding loop needs it
(tokenizer, EOS ids, vocabulary size, token text, decode), over the server's ``/tokenize``,
``/detokenize``, ``/props`` and ``/v1/models``. Every request has a timeout; a server that is
down or slow raises ``RemoteError`` with one line naming the URL and the timeout.

Which of our knobs llama.cpp cannot express is listed per run (``LlamaRequest.unmapped``, from
``UNMAPPED``), with the knobs that map with a difference (``caveats``); the stage order becomes
its ``samplers`` list.
"""

from __future__ import annotations

import json
import math
import socket
import time
import urllib.error
import urllib.request
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
    """``backend:url``, e.g. ``llamacpp:http://127.0.0.1:8080``."""

    backend: str
    url: str

    @classmethod
    def parse(cls, text: str, key: str = "model") -> "RemoteSpec":
        backend, _, url = text.partition(":")
        if backend not in BACKENDS or not url.startswith(("http://", "https://")):
            raise ValueError(f"{key}: expected {' | '.join(BACKENDS)}:http://host:port, got {text[:80]!r}")
        return cls(backend, url.rstrip("/"))

    def __str__(self) -> str:
        return f"{self.backend}:{self.url}"


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
class LlamaCppClient:
    """JSON over HTTP to one llama-server; ``timeout_s`` bounds connecting and every read."""

    url: str
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url: expected http://host:port, got {self.url[:80]!r}")
        if not 0 < self.timeout_s <= 3600:
            raise ValueError(f"timeout_s: expected (0, 3600] seconds, got {self.timeout_s!r}")
        self.url = self.url.rstrip("/")

    def get(self, path: str) -> Any:
        return self._call(urllib.request.Request(self.url + path), path)

    def post(self, path: str, body: dict[str, Any]) -> Any:
        data = json.dumps(body, allow_nan=False).encode()
        request = urllib.request.Request(self.url + path, data, {"Content-Type": "application/json"})
        return self._call(request, path)

    def _call(self, request: urllib.request.Request, path: str) -> Any:
        where = f"llama.cpp server {self.url}{path}"
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                text = response.read()
        except urllib.error.HTTPError as exc:
            detail = " ".join(exc.read(300).decode("utf-8", "replace").split())
            raise RemoteError(f"{where}: HTTP {exc.code}: {detail}") from None
        except (TimeoutError, socket.timeout):
            raise RemoteError(f"{where}: no answer within the {self.timeout_s:g} s timeout") from None
        except (urllib.error.URLError, ConnectionError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, (TimeoutError, socket.timeout)):
                raise RemoteError(f"{where}: no answer within the {self.timeout_s:g} s timeout") from None
            raise RemoteError(f"{where}: cannot connect ({reason}; timeout {self.timeout_s:g} s)") from None
        try:
            return json.loads(text, parse_constant=_no_constant)
        except ValueError as exc:
            raise RemoteError(f"{where}: the answer is not JSON ({exc})") from None


# --- the model -------------------------------------------------------------------------------------
@dataclass
class RemoteTokenizer:
    """The server's tokenizer, as the stages call a tokenizer (``encode`` without special tokens,
    ``decode`` of one token for DRY's breakers); answers are memoised."""

    client: LlamaCppClient
    _pieces: dict[int, str] = field(default_factory=dict, repr=False)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        answer = self.client.post("/tokenize", {"content": text, "add_special": add_special_tokens,
                                                "parse_special": add_special_tokens})
        return [int(t) for t in answer["tokens"]]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        if len(ids) == 1 and ids[0] in self._pieces:
            return self._pieces[ids[0]]
        text = self.client.post("/detokenize", {"tokens": ids})["content"] if ids else ""
        if len(ids) == 1:
            self._pieces[ids[0]] = text
        return text


@dataclass
class RemoteModel:
    """A llama-server's model, shaped like ``LoadedModel`` where the decoding loop reads it."""

    name: str
    client: LlamaCppClient
    tokenizer: RemoteTokenizer
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    context: int = 4096  # the server's context length (n_ctx)
    chat_template: bool = True  # the server has one (its /props)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    quantization: str = "server"
    backend: str = "llamacpp"  # engine.runner looks its strategies up by this
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
            text = self.client.post("/apply-template", {"messages": [{"role": "user", "content": prompt}]})["prompt"]
            return self.tokenizer.encode(text, add_special_tokens=True)
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([i for i in ids if i not in self.eos_token_ids])

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def learn_pieces(self, entries: Sequence[dict[str, Any]]) -> None:
        """Memoise token texts the server sent with its probabilities (``id``, ``bytes``)."""
        for entry in entries:
            piece = bytes(entry.get("bytes") or []).decode("utf-8", "replace")
            self.tokenizer._pieces.setdefault(int(entry["id"]), piece)


def connect(url: str, timeout_s: float = DEFAULT_TIMEOUT_S, mode: str = "step") -> RemoteModel:
    """A RemoteModel over the llama-server at ``url`` (asks it for its vocabulary and EOS), run by
    ``engine.runner`` in ``mode`` ("step": our chain over its top-N; "fast": it samples)."""
    client = LlamaCppClient(url, timeout_s)
    models = client.get("/v1/models")
    try:
        info = models["data"][0]
        vocab, context = int(info["meta"]["n_vocab"]), int(info["meta"].get("n_ctx") or 4096)
    except (KeyError, IndexError, TypeError, ValueError):
        raise RemoteError(f"llama.cpp server {client.url}/v1/models: no model with meta.n_vocab in the answer") \
            from None
    tokenizer = RemoteTokenizer(client)
    props = client.get("/props")
    eos_text = props.get("eos_token") or ""
    eos = tuple(tokenizer.encode(eos_text, add_special_tokens=True)) if eos_text else ()
    return RemoteModel(f"llamacpp:{client.url}", client, tokenizer, vocab, eos if len(eos) == 1 else (), context,
                       bool(props.get("chat_template")), mode=mode)


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
    """The server's raw next-token distribution after ``ids``, truncated to its top ``top_n``:
    logits [1, V] (log p inside the top-N, -inf outside) and the tail mass 1 - sum(top-N)."""
    answer = model.client.post("/completion", {
        "prompt": list(ids), "n_predict": 1, "n_probs": top_n, "post_sampling_probs": False,
        "cache_prompt": True, "samplers": ["top_k"], "top_k": 1, "return_tokens": True})
    try:
        top = answer["completion_probabilities"][0]["top_logprobs"]
    except (KeyError, IndexError, TypeError):
        raise RemoteError(f"llama.cpp server {model.url}/completion: no top_logprobs in the answer") from None
    model.learn_pieces(top)
    token_ids = torch.tensor([int(t["id"]) for t in top], dtype=torch.long)
    logprobs = torch.tensor([float(t["logprob"]) if t["logprob"] is not None else -math.inf for t in top])
    logits = torch.full((1, model.vocab_size), -math.inf)
    logits[0, token_ids] = logprobs
    return logits, max(0.0, 1.0 - float(logprobs.exp().sum()))


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
    trace.extra["remote"] = _label(model, config, "step", model.top_n, step_approximations(config, model.top_n)) | {
        "tail_mass": tails}
    yield Event(trace=trace)


def _collect(events: Iterator[Event]) -> Trace:
    return next(e.trace for e in events if e.trace is not None)


def run_step(model: RemoteModel, prompt: str, config: DecodingConfig, *, chat: bool = False,
             top_n: int = STEP_TOP_N) -> Trace:
    """A whole step-mode run as a Trace, labelled (``extra["remote"]``)."""
    stepper = model.with_mode("step", top_n)
    return _collect(stream(stepper, prompt, stepper.encode(prompt, chat), config, chat=chat))


def _label(model: RemoteModel, config: DecodingConfig, mode: str, top_n: int, approximations: list[str]) -> dict:
    """``extra["remote"]``; in fast mode with the knobs llama.cpp's sampler did not run as ours
    (step mode runs our own chain: nothing unmapped)."""
    notes = llamacpp_request(config, model.context).notes() if mode == "fast" else {"unmapped": [], "caveats": []}
    return {"backend": model.backend, "url": model.url, "mode": mode, "top_n": top_n,
            "approximations": approximations} | notes


# --- fast mode -------------------------------------------------------------------------------------
def _completion(model: RemoteModel, prompt_ids: Sequence[int], config: DecodingConfig, post_sampling: bool) -> dict:
    return model.client.post("/completion", {
        **llamacpp_request(config, model.context).fields, "prompt": list(prompt_ids),
        "n_predict": config.max_new_tokens, "n_probs": config.top_n,
        "post_sampling_probs": post_sampling, "cache_prompt": True, "return_tokens": True, "stop": list(config.stop)})


def _stage(name: str, entries: list[dict], key: str, vocab_size: int) -> StageTrace:
    """A stage record from the server's top-N (``key``: "logprob" or "prob"); entropy over the
    top-N only, kept = the whole vocabulary for raw, the non-zero top-N for final."""
    probs = [math.exp(e[key]) if key == "logprob" else float(e[key]) for e in entries]
    probs = [p if math.isfinite(p) else 0.0 for p in probs]
    top = [TokenProb(int(e["id"]), bytes(e.get("bytes") or []).decode("utf-8", "replace"), p)
           for e, p in zip(entries, probs)]
    entropy = -sum(p * math.log(p) for p in probs if p > 0)
    kept = vocab_size if name == "raw" else sum(1 for p in probs if p > 0)
    return StageTrace(name, kept, 0.0, entropy, 0.0, top)


def run_fast(model: RemoteModel, prompt: str, config: DecodingConfig, *, chat: bool = False,
             raw: bool = True) -> Trace:
    """Fast mode: the server generates the whole text in one request (its final top-N per token);
    ``raw``: a second request with the same seed adds its raw top-N (dropped, and said so, if it
    sampled another text)."""
    fast = model.with_mode("fast")
    return _collect(_stream_fast(fast, prompt, fast.encode(prompt, chat), config, chat, raw=raw))


def _stream_fast(model: RemoteModel, prompt: str, prompt_ids: Sequence[int], config: DecodingConfig, chat: bool,
                 raw: bool = True) -> Iterator[Event]:
    """Fast mode's Events: one request for the whole text, then an Event per token it holds and
    the labelled Trace."""
    check_strategy(config)
    start = time.perf_counter()
    final = _completion(model, prompt_ids, config, True)
    wall_ms = (time.perf_counter() - start) * 1000
    probs = final.get("completion_probabilities") or []
    approximations = ["the server sampled (its own generator and sampler code); no draw u is known",
                      "entropies are over the top-N only"]
    raw_probs: list[dict] = []
    if raw:
        again = _completion(model, prompt_ids, config, False).get("completion_probabilities") or []
        if [e["id"] for e in again] == [e["id"] for e in probs]:
            raw_probs = again
        else:
            approximations.append("the raw request sampled another text: raw probabilities left out")
    steps = []
    per_token = wall_ms / max(1, len(probs))
    for i, entry in enumerate(probs):
        model.learn_pieces(entry.get("top_probs") or [])
        stages = [_stage("final", entry.get("top_probs") or [], "prob", model.vocab_size)]
        raw_prob = float("nan")
        if raw_probs:
            stages.insert(0, _stage("raw", raw_probs[i]["top_logprobs"], "logprob", model.vocab_size))
            raw_prob = math.exp(raw_probs[i]["logprob"]) if raw_probs[i]["logprob"] is not None else 0.0
        token = int(entry["id"])
        steps.append(StepTrace(i, token, model.token_text(token), float(entry["prob"]), raw_prob, None, None, None,
                               stages[-1].entropy, stages[0].entropy, stages, elapsed_ms=per_token * (i + 1)))
    if steps:
        steps[-1].finish_reason = STOP_TYPES.get(final.get("stop_type", ""), "max_new_tokens")
    for step in steps:
        yield Event(steps=[step])
    trace = assemble(model, prompt, prompt_ids, config, steps, chat)  # type: ignore[arg-type]
    trace.extra["remote"] = _label(model, config, "fast", config.top_n, approximations) | {
        "timings": final.get("timings", {})}
    yield Event(trace=trace)
