"""The final pick: greedy, or a seeded categorical draw that reports where the draw landed.

Sampling is an exponential race: every token i gets E_i ~ Exp(1) from the run's generator and the
token with the largest p_i / E_i wins. That is exactly what ``torch.multinomial(probs, 1)`` does
inside transformers' ``generate(do_sample=True)``, so a seeded run here reproduces a seeded
``generate`` token for token.

The race also yields an honest uniform draw for the classic inverse-CDF picture: the race's winning
time T = E_w / p_w is Exp(1) and independent of which token won, so frac = 1 - exp(-T) is U(0, 1)
independent of the winner, and u = F(w-) + p_w * frac is exactly U(0, 1) with the inverse CDF of u
(tokens sorted by probability, highest first) equal to the winner.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


NO_TOKENS_LEFT = "no_tokens_left"


class NoTokensLeft(Exception):
    """The final distribution of a step has no token to pick: every logit is masked (-inf), or the
    stages produced NaN/+inf. The run ends there with ``stop_reason`` "no_tokens_left" (the runner
    catches this), instead of picking token 0 from a NaN distribution."""

    def __init__(self, step: int | None = None):
        self.step = step
        super().__init__(NO_TOKENS_LEFT if step is None else f"{NO_TOKENS_LEFT} at step {step}")


def has_tokens(final: torch.Tensor) -> bool:
    """True when ``final`` (logits [..., V], -inf = masked) leaves at least one token to pick in
    every row: no NaN, no +inf, and some finite entry per row (``rows_with_tokens`` for all rows)."""
    return all(rows_with_tokens(final.reshape(-1, final.shape[-1])))


def ensure_tokens(final: torch.Tensor, step: int | None = None) -> torch.Tensor:
    """``final`` unchanged, or NoTokensLeft when it has nothing to pick (see ``has_tokens``).
    Every strategy calls this on its final logits before picking."""
    if not has_tokens(final):
        raise NoTokensLeft(step)
    return final


@dataclass(frozen=True)
class Pick:
    token_id: int
    prob: float
    draw: float | None = None  # u in [0, 1)
    low: float | None = None  # the chosen token's interval [low, high) on the sorted CDF
    high: float | None = None


def greedy(logits: torch.Tensor) -> Pick:
    """argmax of the final logits [1, V] (ties: the lowest token id, like torch.argmax)."""
    token = int(torch.argmax(logits[0]))
    prob = float(torch.softmax(logits[0].float(), dim=-1)[token])
    return Pick(token, prob)


def exponential_noise(shape: torch.Size, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.float32, device=device).exponential_(1, generator=generator)


def sample(logits: torch.Tensor, generator: torch.Generator) -> Pick:
    """Draw from softmax(logits) [1, V] with the run's generator (consumes V draws)."""
    return sample_probs(torch.softmax(logits.float(), dim=-1)[0], generator)


def sample_probs(probs: torch.Tensor, generator: torch.Generator) -> Pick:
    """Draw from probabilities [V] (the softmax of the final logits, as generate() computes it):
    the one-row case of ``sample_rows``."""
    return sample_rows(probs[None], [generator])[0]


def skip_draws(generator: torch.Generator, steps: int, vocab_size: int, device: torch.device) -> None:
    """Advance the generator past ``steps`` sampling steps (used to resume a run mid-way)."""
    for _ in range(steps):
        exponential_noise(torch.Size([1, vocab_size]), generator, device)


def rows_with_tokens(final: torch.Tensor) -> list[bool]:
    """``has_tokens`` for each row of ``final`` [R, V], in one pass over the batch: a row's max is
    NaN when it holds a NaN (amax propagates NaN), +inf when it holds +inf, and -inf when no entry
    is finite, so the row has tokens exactly when its max is finite."""
    return torch.isfinite(final.float().amax(dim=-1)).tolist()


def mass_before(probs: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """Each row's probability mass where ``before`` [R, V] holds, summed in float64 -> [R]
    (``where`` needs no negated mask: the same sums bit for bit as ``masked_fill(~before)``)."""
    return torch.where(before, probs, 0.0).double().sum(dim=-1)


def sample_rows(probs: torch.Tensor, generators: list[torch.Generator]) -> list[Pick]:
    """Draw from each row of ``probs`` [R, V] with ``generators[r]`` (V draws each, as alone): the
    exponential race (token i gets E_i ~ Exp(1); the largest p_i / E_i wins, as torch.multinomial
    draws), and the winner's interval [low, high) on the sorted CDF (higher probability first, ties
    by lower id) with u = low + p * (1 - exp(-E_w / p_w)), computed on [R, V]."""
    noise = torch.cat([exponential_noise(torch.Size([1, probs.shape[1]]), g, probs.device) for g in generators])  # [R, V]
    tokens = torch.argmax(probs / noise, dim=-1, keepdim=True)  # [R, 1]
    p = probs.gather(1, tokens)  # [R, 1]
    times = noise.gather(1, tokens) / p  # [R, 1]: the race's winning times, as sample_probs divides them
    ids = torch.arange(probs.shape[1], device=probs.device)
    before = (probs > p) | ((probs == p) & (ids < tokens))  # [R, V]: sorted before the winner
    low = mass_before(probs, before)  # [R]
    out = []
    for token, prob, t, lo in zip(tokens[:, 0].tolist(), p[:, 0].tolist(), times[:, 0].tolist(), low.tolist()):
        out.append(Pick(token, prob, lo + prob * -math.expm1(-t), lo, lo + prob))
    return out
