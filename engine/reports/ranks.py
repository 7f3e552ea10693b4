"""Every token's rank under the model (GLTR; Gehrmann, Strobelt and Rush 2019), issue #54.

A text (generated here or pasted) is read teacher-forced in ONE forward: each token's rank among
the model's next-token logits at the position before it (1 = the model's top choice) and its
probability there. Tokens are coloured by bucket: top-10, top-100, top-1,000, beyond. Machine text
sampled without much temperature lives in the top-10; a person's text reaches further down. The
first token of a text with no context has no position before it and is not ranked. Bounded
(``MAX_RANK_TOKENS`` tokens of text) and checked for cancellation around the forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from engine.config import ConfigError
from engine.control import RunControl, check

MAX_RANK_TOKENS = 512  # the logits kept are [n, V] float32: 100 MB at 512 tokens of a 49k vocabulary
BUCKETS = ((10, "top-10"), (100, "top-100"), (1000, "top-1000"))
BEYOND = "beyond"
UNRANKED = "no context"
BUCKET_NAMES = tuple(name for _, name in BUCKETS) + (BEYOND,)


def bucket(rank: int | None) -> str:
    """The GLTR bucket of a 1-based rank."""
    if rank is None:
        return UNRANKED
    return next((name for top, name in BUCKETS if rank <= top), BEYOND)


@dataclass
class RankedToken:
    token_id: int
    token: str
    rank: int | None  # 1 = the model's most likely next token; None: no position before it
    prob: float | None
    bucket: str


@dataclass
class TokenRanks:
    """The ranked tokens of a text and the histogram of their buckets (``BUCKET_NAMES`` order)."""

    model: str
    context_tokens: int
    tokens: list[RankedToken] = field(default_factory=list)
    histogram: dict[str, int] = field(default_factory=dict)

    @property
    def ranked(self) -> int:
        return sum(self.histogram.values())

    def share(self, name: str) -> float:
        """The share of the ranked tokens in bucket ``name``."""
        return self.histogram.get(name, 0) / self.ranked if self.ranked else 0.0

    def sentence(self) -> str:
        """What the colours and the histogram show, in one sentence from the same numbers."""
        if not self.ranked:
            return "No token could be ranked (a one-token text with no context)."
        parts = ", ".join(f"{self.share(name):.0%} {name}" for name in BUCKET_NAMES)
        rank, worst = max(((t.rank, t) for t in self.tokens if t.rank is not None), key=lambda pair: pair[0])
        return (f"Of {self.ranked} ranked tokens: {parts}; the least expected is {worst.token!r} "
                f"(rank {rank:,}).")


def check_ids(key: str, ids: Sequence[int], limit: int = MAX_RANK_TOKENS) -> None:
    """ConfigError naming ``key`` when ``ids`` is empty or longer than ``limit`` tokens."""
    if not ids:
        raise ConfigError(key, "empty; give some text to rank")
    if len(ids) > limit:
        raise ConfigError(key, f"{len(ids):,} tokens is over the {limit:,}-token limit")


@torch.inference_mode()
def rank_ids(lm: Any, context_ids: Sequence[int], ids: Sequence[int], *,
             control: RunControl | None = None) -> TokenRanks:
    """Each of ``ids``' rank and probability after ``context_ids`` and the ids before it, from one
    forward of the whole sequence (the model's own logits, ``logits_to_keep`` = the positions read)."""
    if not lm.capabilities.full_logits:
        raise ConfigError("model", "token ranks: not available for a served model (a rank beyond its top-N "
                                   "is unknown)")
    check_ids("text", ids)
    full = [*context_ids, *ids]
    keep = len(ids) if context_ids else len(ids) - 1  # the positions that predict a token of ``ids``
    out = TokenRanks(getattr(lm, "name", ""), len(context_ids), histogram=dict.fromkeys(BUCKET_NAMES, 0))
    ranks: list[int | None] = [None] * (len(ids) - keep)
    probs: list[float | None] = [None] * (len(ids) - keep)
    if keep:
        check(control)
        logits = lm.model(input_ids=torch.tensor([full[:-1]], device=lm.device), use_cache=False,
                          logits_to_keep=keep).logits[0].float()  # [keep, V]: row j predicts ids[-keep + j]
        check(control)
        target = torch.tensor(list(ids[len(ids) - keep:]), device=logits.device)[:, None]  # [keep, 1]
        chosen = logits.gather(1, target)  # [keep, 1]
        ranks += ((logits > chosen).sum(-1) + 1).tolist()
        probs += torch.log_softmax(logits, dim=-1).gather(1, target)[:, 0].exp().tolist()
    for token, rank, prob in zip(ids, ranks, probs):
        name = bucket(rank)
        out.tokens.append(RankedToken(int(token), lm.token_text(int(token)), rank, prob, name))
        if rank is not None:
            out.histogram[name] += 1
    return out
