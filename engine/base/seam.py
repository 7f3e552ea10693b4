"""The model seam: what every model gives the engine and the views, whatever runs it.

A model loaded in this process (what ``engine.backends.local.load_model`` returns) and a served one
(``engine.backends.served.RemoteModel``: llama.cpp's server, an OpenAI-compatible server) both
implement ``Model``. What differs between them is data, ``Capabilities``: a served model's API
hands out a top-N per position, not the model's logits, hidden states, cache or weights. The
strategies declare what they need (``StrategySpec.needs``) and the views ask ``capabilities``,
never the class, so a new backend is a new ``Model`` with its capabilities, and no view changes.
Code outside ``engine/backends/`` names ``Model`` (and ``Cache``), never a backend's class.

On the base floor (docs/architecture.md): no engine import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence, TypeVar, cast

T = TypeVar("T")

# What a view may need of a model beyond a strategy, in words (the same words as a strategy's needs).
VIEW_NEEDS = {
    "quantization": ("weights", "needs the model's own weights"),
    "KV cache": ("kv_cache", "needs the model's own cache"),
}


@dataclass(frozen=True)
class Capabilities:
    """What a model can give and how it runs, as named data (vLLM's logits processors declare what
    they are; llama.cpp's samplers what they accept): callers ask these, never a model's class or
    its source string.

    ``in_process``: its network runs in this process, so a strategy runs its ``stream``; otherwise a
    server answers requests and a strategy runs its ``served`` stream (or is unavailable).
    ``full_logits``: every token's logit at every position. ``hidden_states``: the last hidden state
    (contrastive search, Medusa heads, the logit lens). ``kv_cache``: a KV cache we own (its kinds,
    rewinding, MCTS). ``weights``: its weights here (quantized variants, self-drafters).
    ``scheduled``: its greedy/sampling runs share our batched scheduler (``engine.scheduler``; a
    server batches its own). ``our_chain``: our stage chain and pick choose every token (False: the
    server's sampler picks, fast mode). ``prompt_logprobs``: one request scores every position of a
    sequence (vLLM's ``prompt_logprobs``; llama-server answers one position per request).
    ``our_draws``: its server drafts a sampled run with our chain and our generator's draws (a vLLM
    with deploy/vllm_plugin/dp_draws.py). ``top_n``: tokens per position it hands out (None: every
    token). ``streaming``: it streams a whole generation (fast mode)."""

    in_process: bool
    full_logits: bool
    hidden_states: bool
    kv_cache: bool
    weights: bool
    scheduled: bool
    our_chain: bool = True
    prompt_logprobs: bool = False
    our_draws: bool = False
    top_n: int | None = None
    streaming: bool = False

    def has(self, need: str) -> bool:
        """Whether it has the capability named ``need`` (a field: "kv_cache", "weights", ...)."""
        return getattr(self, need) is True

    def lacks(self, what: str) -> str | None:
        """One line saying why a model with these capabilities cannot give ``what`` (a
        ``VIEW_NEEDS`` key: "quantization", "KV cache"), or None when it can."""
        need, why = VIEW_NEEDS[what]
        return None if self.has(need) else f"{what}: not available for a served model ({why})"


# A model loaded here: everything (its logits, hidden states, cache and weights are in this process).
LOCAL = Capabilities(in_process=True, full_logits=True, hidden_states=True, kv_cache=True, weights=True,
                     scheduled=True, prompt_logprobs=True)


def served_capabilities(top_n: int, *, fast: bool = False, prompt_logprobs: bool = False,
                        our_draws: bool = False) -> Capabilities:
    """A served model's: its API's top-N per position and streamed generations; in ``fast`` mode the
    server's sampler picks; what its API adds (``prompt_logprobs``, ``our_draws``); nothing else."""
    return Capabilities(in_process=False, full_logits=False, hidden_states=False, kv_cache=False, weights=False,
                        scheduled=False, our_chain=not fast, prompt_logprobs=prompt_logprobs, our_draws=our_draws,
                        top_n=top_n, streaming=True)


class Cache(Protocol):
    """A model's positions as a decoding loop holds them (mlx-lm's cache protocol: feed, rewind): the
    tokens held, the logits after feeding more, and ``rewind(n)``. ``engine.cache.KVCache`` is a model
    loaded here's (its own KV cache); a served model's (``engine.backends.served.RemoteCache``)
    remembers the tokens and asks its server for the top-N at the positions fed."""

    tokens: list[int]  # the ids held (batch of one)
    forwards: int  # calls that reached the model (forwards, or requests to the server)

    @property
    def length(self) -> int: ...

    def forward(self, input_ids: Any, *, all_logits: bool = False) -> Any:
        """Feed ``input_ids`` [1, T] after what it holds; ``.logits`` [1, T, V] with ``all_logits``,
        else [1, 1, V] (the last position)."""
        ...

    def step(self, token_ids: Sequence[int]) -> Any:
        """Feed tokens; the last position's logits [1, V] (float32)."""
        ...

    def sync(self, token_ids: Sequence[int]) -> Any:
        """Hold exactly ``token_ids``; the logits after the last one [1, V]."""
        ...

    def rewind(self, n: int) -> None:
        """Drop the last ``n`` positions."""
        ...


class Model(Protocol):
    """What the decoding loop, the trace, the reports and the views read of a model, whatever runs it.

    ``model``: the network itself when it runs in this process (a transformers causal LM: its forward,
    weights, hidden states and config), None when it does not (``capabilities.in_process``): code that
    reads it runs only where the capabilities say it may (a strategy's ``needs``, a view's
    ``require``). ``next_logits`` is the raw next-token call every model answers; ``cache`` the
    positions a run holds."""

    name: str
    eos_token_ids: tuple[int, ...]
    quantization: str
    tokenizer: Any  # encode(text, add_special_tokens) / decode(ids, skip_special_tokens)
    model: Any
    device: Any  # torch.device
    dtype: Any  # torch.dtype of its weights here (None on a server)

    @property
    def source(self) -> str: ...  # what it was loaded or connected from (a directory, a Hub id, "embedded", a server)

    @property
    def backend(self) -> str: ...  # "local", "llamacpp", "openai"

    @property
    def capabilities(self) -> Capabilities: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def has_chat_template(self) -> bool: ...

    def encode(self, prompt: str, chat: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def token_text(self, token_id: int) -> str: ...

    def next_logits(self, ids: Sequence[int], *, top_n: int | None = None, cache: Cache | None = None) -> Any:
        """The raw next-token logits after ``ids`` [1, V] float32. A model loaded here: one forward over
        what ``cache`` (default a fresh one) lacks of them. A served model: its server's top ``top_n``
        (default its own) in one request, log p inside and -inf outside."""
        ...

    def cache(self) -> Cache:
        """A fresh cache of its positions (see ``Cache``)."""
        ...

    def with_mode(self, mode: str, top_n: int | None = None) -> "Model":
        """The same model run in ``mode``: "step" (our chain picks every token, over ``top_n`` tokens
        per step on a server) or "fast" (a server's own sampler picks: ``capabilities.our_chain`` is
        False then). A model loaded here runs step mode only (ValueError for fast)."""
        ...


class WeightedModel(Model, Protocol):
    """A ``Model`` whose weights this process holds (``capabilities.weights``): what the quantization
    and drift reports read of them besides the network."""

    memory_bytes: int  # weights and buffers in memory
    load_seconds: float
    disk_bytes: int  # a 4-bit checkpoint's weight files on disk (0: not loaded from one)
    packed_bytes: int  # its packed 4-bit weights and scales
    measures: dict[str, float]  # measures of the model alone, computed once (held-out perplexity)


def with_weights(lm: Model, what: str) -> WeightedModel:
    """``lm`` as a ``WeightedModel`` when its weights are here (``capabilities.weights``), else
    ValueError saying why ``what`` (a ``VIEW_NEEDS`` key) cannot run on it."""
    reason = lm.capabilities.lacks(what)
    if reason is not None:
        raise ValueError(reason)
    return cast(WeightedModel, lm)


class Models(Protocol):
    """Where models come from, by spec (``engine.backends.registry.ModelRegistry``, or the page's
    registry that checks each one against the operator's policy first)."""

    def get(self, spec: Any, progress: Any = None, *, key: str = "model") -> Model: ...


class LendingModels(Models, Protocol):
    """``Models`` as the reports use them: a variant lent for one measure and released after it
    (``lend``), the memory budget checked before anything is built (``check_room``), what is loaded."""

    def lend(self, spec: Any, use: Callable[[Any], T], *, key: str = "model") -> T: ...

    def check_room(self, need: int, what: str, key: str = "model") -> None: ...

    def loaded(self) -> list[Any]: ...
