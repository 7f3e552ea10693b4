"""The model seam: what every model gives the engine and the views, whatever runs it.

A model loaded in this process (``engine.backends.local.LoadedModel``) and a served one
(``engine.backends.served.RemoteModel``: llama.cpp's server, an OpenAI-compatible server) both
implement ``Model``. What differs between them is data, ``Capabilities``: a served model's API
hands out a top-N per position, not the model's logits, hidden states, cache or weights. The
strategies declare what they need (``StrategySpec.needs``) and the views ask ``capabilities``,
never the class, so a new backend is a new ``Model`` with its capabilities, and no view changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

# What a view may need of a model beyond a strategy, in words (the same words as a strategy's needs).
VIEW_NEEDS = {
    "quantization": ("weights", "needs the model's own weights"),
    "KV cache": ("kv_cache", "needs the model's own cache"),
}


@dataclass(frozen=True)
class Capabilities:
    """What a model can give, as data.

    ``served``: behind a server's API (its strategies are the specs' ``served`` streams; its
    ``mode`` is "step" or "fast"). ``full_logits``: every token's logit at every position.
    ``hidden_states``: the last hidden state (contrastive search, Medusa heads). ``kv_cache``: its
    own cache (KV cache kinds, rewinding, MCTS). ``weights``: its own weights (quantized variants,
    self-drafters). ``top_n``: tokens per position its API returns (None: every token).
    ``streaming``: it streams a whole generation (fast mode)."""

    served: bool
    full_logits: bool
    hidden_states: bool
    kv_cache: bool
    weights: bool
    top_n: int | None = None
    streaming: bool = False

    def lacks(self, what: str) -> str | None:
        """One line saying why a model with these capabilities cannot give ``what`` (a
        ``VIEW_NEEDS`` key: "quantization", "KV cache"), or None when it can."""
        need, why = VIEW_NEEDS[what]
        return None if getattr(self, need) else f"{what}: not available for a served model ({why})"


LOCAL = Capabilities(served=False, full_logits=True, hidden_states=True, kv_cache=True, weights=True)


def served_capabilities(top_n: int) -> Capabilities:
    """A served model's: its API's top-N per position, streamed generations, nothing else."""
    return Capabilities(served=True, full_logits=False, hidden_states=False, kv_cache=False, weights=False,
                        top_n=top_n, streaming=True)


class Model(Protocol):
    """What the decoding loop, the trace and the views read of a model, whatever runs it."""

    name: str
    eos_token_ids: tuple[int, ...]
    quantization: str
    tokenizer: Any  # encode(text, add_special_tokens) / decode(ids, skip_special_tokens)

    @property
    def backend(self) -> str: ...  # "local", "llamacpp", "openai"

    @property
    def capabilities(self) -> Capabilities: ...

    @property
    def device(self) -> Any: ...  # torch.device

    @property
    def vocab_size(self) -> int: ...

    @property
    def has_chat_template(self) -> bool: ...

    def encode(self, prompt: str, chat: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def token_text(self, token_id: int) -> str: ...
