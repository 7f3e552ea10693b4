"""A vLLM logits processor that drafts step mode's continuation with our sampler (issue #38).

Step mode asks a server for its greedy continuation and keeps it while our pick (our chain on the
server's raw top-N, our draw from the run's seeded generator) is the server's token
(engine.backends.served_decode.stream_verified). Greedy, our pick is the server's argmax; sampling, it is
the server's token only with our probability of it, so a sampled run cost about a request per two
tokens. With this processor loaded (``deploy/vllm_serve.py`` starts vLLM with
``--logits-processors dp_draws:OurDraws``), a step-mode request may carry in ``vllm_xargs``:

- ``dp_state``: the run's torch CPU generator state (base64 of ``Generator.get_state()``, 5,056 bytes)
  where our next draw starts;
- ``dp_chain``: the run's stages as JSON, ``[[name, value], ...]`` in the user's order (temperature,
  top_k, top_p, min_p, typical_p: transformers' warpers, as engine.stages builds them);
- ``dp_top``: step mode's top-N.

Anyone who reaches the server writes these, and this runs in vLLM's engine core, where an exception ends
the engine and every user's request (issue #50): dp_args.draw_args checks each field's type, size and
range before any is used (a request with one it refuses is left as vLLM answers it), and nothing in
``update_state`` or ``apply`` raises.

For such a request, at each position this processor computes step mode's pick as our engine does:
the raw log-probabilities (vLLM's ``raw_logprobs``, the same float32 op), truncated to their top N, the
chain, the softmax, and the exponential race against V draws of the run's generator
(engine.sampling.sample_rows; the exponentials taken at the N only, as engine.sampling.exponentials_at
takes them: V uniforms, N logs), to float rounding (the chain and softmax run over the N, ours over V
with -inf outside them: the same numbers up to the order of a sum). It leaves only that token (every
other logit -inf), and the request's temperature 0 makes it the server's token. The server's answer is
still verified position by position on our side, so a difference (a tie at the top-N's edge, a stage this
processor does not know) costs one request, never a wrong token. Rows without ``dp_state`` are left as they are.

Loaded inside vLLM's own environment: it imports only torch, transformers, vLLM's interface and dp_args
(beside it).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
from transformers.generation import logits_process as tlp
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from dp_args import draw_args  # beside this file on the server's PYTHONPATH (deploy/vllm_serve.py)

LOG = logging.getLogger("dp_draws")
WARPERS = {
    "temperature": lambda v: tlp.TemperatureLogitsWarper(v),
    "top_k": lambda v: tlp.TopKLogitsWarper(top_k=v),
    "top_p": lambda v: tlp.TopPLogitsWarper(top_p=v),
    "min_p": lambda v: tlp.MinPLogitsWarper(min_p=v),
    "typical_p": lambda v: tlp.TypicalLogitsWarper(mass=v),
}


def exponentials_at(generator: torch.Generator, vocab: int, ids: torch.Tensor) -> torch.Tensor:
    """One step's V exponentials of ``generator`` (``exponential_`` over [1, vocab]) at ``ids`` only, the
    generator moved past all V: engine.sampling.exponentials_at, repeated here (this file loads in vLLM's
    environment, without our engine): the same 64-bit draws as uniforms in double, -log(1 - u) with the C
    library's log at ``ids``, as float32. Where that is not exponential_'s here (``compact_works``), exponential_."""
    if not compact_works():
        return torch.empty((1, vocab), dtype=torch.float32).exponential_(1, generator=generator)[0, ids]
    u = torch.empty(vocab, dtype=torch.float64).uniform_(0.0, 1.0, generator=generator)
    return torch.tensor([-math.log(1.0 - x) for x in u[ids].tolist()], dtype=torch.float64).float()


@cache
def compact_works() -> bool:
    """Whether the uniforms-and-logs path gives exponential_'s numbers and end state (checked once)."""
    ours, theirs = torch.Generator().manual_seed(2), torch.Generator().manual_seed(2)
    u = torch.empty(4099, dtype=torch.float64).uniform_(0.0, 1.0, generator=ours)
    noise = torch.tensor([-math.log(1.0 - x) for x in u.tolist()], dtype=torch.float64).float()
    expected = torch.empty((1, 4099), dtype=torch.float32).exponential_(1, generator=theirs)[0]
    return torch.equal(noise, expected) and torch.equal(ours.get_state(), theirs.get_state())


@dataclass
class RowDraws:
    """One request's draws: its generator, its chain, its top-N."""

    generator: torch.Generator
    chain: list[Any]
    top: int

    def pick(self, values: torch.Tensor, ids: torch.Tensor, vocab: int) -> int:
        """Step mode's pick at this position, from the raw log-probabilities' top N (``values`` [N],
        highest first, and their ``ids``): the chain on them (every other token is -inf, which these
        stages keep at -inf and which adds nothing to a softmax, so the N are enough), the softmax,
        and the race against V draws of the run's generator (all V drawn, as our engine draws them;
        only the N can win, so only theirs are taken)."""
        row = values[None].clone()
        dummy = torch.zeros((1, 1), dtype=torch.long)
        for warper in self.chain:
            row = warper(dummy, row)
        probs = torch.softmax(row.float(), dim=-1)[0]
        return int(ids[int(torch.argmax(probs / exponentials_at(self.generator, vocab, ids)))])


def row_draws(extra: Any) -> RowDraws | None:
    """The request's ``vllm_xargs`` as a RowDraws, or None (not ours, or malformed: left alone). Every
    field is checked by dp_args.draw_args before any is used."""
    args = draw_args(extra)
    if args is None:
        return None
    try:
        chain = [WARPERS[name](value) for name, value in args.chain]
    except ValueError:  # a transformers that bounds a stage more tightly than the engine does
        return None
    return RowDraws(args.generator, chain, args.top)


class OurDraws(LogitsProcessor):
    """The processor: per batch row, the request's RowDraws (if it sent them). It runs in vLLM's engine
    core, where an exception ends the engine and every user's request: nothing here raises. A row whose
    work fails is dropped (its logits stay vLLM's, its request gets vLLM's answer, which the app verifies);
    a batch update it cannot follow drops every row rather than leave one at a wrong index."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, RowDraws] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the greedy pick

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if not batch_update:
            return
        try:
            for index in batch_update.removed:
                self.rows.pop(index, None)
            for added in batch_update.added:
                self.add(added[0], added[1])
            for a, b, direction in batch_update.moved:
                first, second = self.rows.pop(a, None), self.rows.pop(b, None)
                if first is not None:
                    self.rows[b] = first
                if direction == MoveDirectionality.SWAP and second is not None:
                    self.rows[a] = second
        except Exception as exc:  # last resort (never BaseException: a shutdown goes through)
            LOG.warning("dp_draws: a batch update it cannot follow (%s); every row is left to vLLM", type(exc).__name__)
            self.rows.clear()

    def add(self, index: int, params: Any) -> None:
        """Row ``index`` is a new request's (``params``: its SamplingParams)."""
        self.rows.pop(index, None)  # the slot's previous request has gone, whatever comes of this one
        try:
            draws = row_draws(getattr(params, "extra_args", None))
        except Exception as exc:  # last resort: row_draws checks before it converts
            LOG.warning("dp_draws: row %s left to vLLM (%s)", index, type(exc).__name__)
            return
        if draws is not None:
            self.rows[index] = draws

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        try:
            return self.picked(logits)
        except Exception as exc:  # last resort: logits are written once, at the end, so they are still vLLM's
            LOG.warning("dp_draws: a batch left to vLLM (%s)", type(exc).__name__)
            return logits

    def picked(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [B, V] with each of our rows' pick the only finite logit (0). Rows outside the batch
        are skipped; a row whose pick fails is dropped and left as vLLM computed it."""
        if logits.dim() != 2:
            return logits
        batch, vocab = logits.shape
        rows = [(index, draws) for index, draws in self.rows.items() if type(index) is int and 0 <= index < batch]
        if not rows or vocab == 0:
            return logits
        index = torch.tensor([i for i, _ in rows], dtype=torch.long, device=logits.device)
        logprobs = logits[index].float().log_softmax(dim=-1).cpu()  # vLLM's raw_logprobs, the same op
        values, ids = torch.topk(logprobs, min(max(d.top for _, d in rows), vocab))  # highest first
        kept, picks = [], []
        for r, (i, draws) in enumerate(rows):
            try:
                picks.append(draws.pick(values[r, :draws.top], ids[r, :draws.top], vocab))
                kept.append(i)
            except Exception as exc:  # last resort: this row only
                LOG.warning("dp_draws: row %s left to vLLM (%s)", i, type(exc).__name__)
                self.rows.pop(i, None)
        if not kept:
            return logits
        chosen = torch.full((len(kept), vocab), -float("inf"), dtype=logits.dtype, device=logits.device)
        chosen[torch.arange(len(kept), device=logits.device), torch.tensor(picks, device=logits.device)] = 0.0
        logits[torch.tensor(kept, dtype=torch.long, device=logits.device)] = chosen
        return logits
