"""Running a served model (issue #29): llama.cpp's ``llama-server`` (its native ``/completion``)
or any OpenAI-compatible server (vLLM, SGLang, llama-server's own ``/v1``).

The backend answers requests; it does not decide strategies. ``connect_spec`` turns an operator's
``backend:url`` into a ``RemoteModel`` (engine/backends/served.py) with its API class
(``LlamaCppApi``, ``OpenAIApi``: tokenize, detokenize, chat ids, ``next_top`` = the raw top-N after some
ids, ``generate`` = fast mode's streamed answer), and ``top_logits`` reads one raw top-N as logits. The
streams that decode on a served model (greedy and sampling in step mode, verified or not, and fast
mode) live with the other strategies, in ``engine.strategies.served_decode``.

A server's answer is untrusted input (issue #34): every request has one deadline (its own, cut to the
run's time limit) and is closed by the run's cancel (``engine.backends.client``); every answer is
bounded in size and checked field by field (``engine.backends.schema``); a server that is down, slow,
redirects or answers something out of range raises ``RemoteError`` with one line naming the URL (and
the field).
"""

from __future__ import annotations

from typing import Sequence

import torch

from engine.backends.client import DEFAULT_TIMEOUT_S, RemoteError
from engine.backends.llamacpp import connect
from engine.backends.openai import connect_openai
from engine.backends.served import RemoteModel, RemoteSpec, entries_logits


def connect_spec(spec: RemoteSpec, timeout_s: float = DEFAULT_TIMEOUT_S, mode: str = "step") -> RemoteModel:
    """The RemoteModel an operator's ``backend:url`` names (with its vocabulary, EOS and other options;
    ``tokenizer=embedded``: the embedded model's tokenizer, a new instance per connection)."""
    if spec.backend == "openai":
        texts = None
        if spec.tokenizer == "embedded":
            from engine.backends.local import embedded_tokenizer, first_line
            try:
                texts = embedded_tokenizer()
            except (OSError, ValueError, RuntimeError) as exc:  # ModelLoadError is a RuntimeError
                raise RemoteError(f"{spec}: tokenizer=embedded: the embedded model's tokenizer did not load "
                                  f"({first_line(exc)[:200]})") from None
        return connect_openai(spec.url, timeout_s, mode, vocab_size=spec.vocab_size, eos_token_ids=spec.eos_token_ids,
                              top_n=spec.top_n, server_draws=spec.draws, texts=texts)
    return connect(spec.url, timeout_s, mode)


# --- step mode -------------------------------------------------------------------------------------
def top_logits(model: RemoteModel, ids: Sequence[int], top_n: int) -> tuple[torch.Tensor, float]:
    """The server's raw next-token distribution after ``ids``, truncated to its top ``top_n``
    (``model.api.next_top``: one request): logits [1, V] (log p inside the top-N, -inf outside) and
    the tail mass 1 - sum(top-N)."""
    return entries_logits(model, model.api.next_top(ids, top_n))

