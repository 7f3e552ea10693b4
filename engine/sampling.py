"""The final pick: greedy, or a seeded categorical draw that reports where the draw landed.

Sampling is an exponential race: every token i gets E_i ~ Exp(1) from the run's generator and the
token with the largest p_i / E_i wins. That is exactly what ``torch.multinomial(probs, 1)`` does
inside transformers' ``generate(do_sample=True)``, so a seeded run here reproduces a seeded
``generate`` token for token.

The race also yields an honest uniform draw for the classic inverse-CDF picture: the race's winning
time T = E_w / p_w is Exp(1) and independent of which token won, so frac = 1 - exp(-T) is U(0, 1)
independent of the winner, and u = F(w-) + p_w * frac is exactly U(0, 1) with the inverse CDF of u
(tokens sorted by probability, highest first) equal to the winner.

Only the tokens with nonzero probability can win, and a served model's step (its top-N, every other
logit -inf) or a truncated distribution has few of them. torch's CPU ``exponential_`` is a scalar loop
(one 64-bit draw and one double ``log`` per entry: 0.7 ms over V = 49,152 here, most of a sampled step's
pick); a row with at most COMPACT_MOST nonzero entries draws the same V uniforms (``uniform_`` on a double
tensor takes the same 64-bit draws) and takes the log at its nonzero entries only
(``exponentials_at``): the same exponentials there bit for bit, the generator left where V exponentials
leave it, the same winner, time and interval (``compact_draws_work`` checks this at first use, else
every row races over V).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import numpy as np
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
    """Advance the generator past ``steps`` sampling steps (used to resume a run mid-way): on a CPU
    generator, each step's double uniforms (the same 64-bit draws, without the logs)."""
    compact = _compact(generator)
    for _ in range(steps):
        if compact:
            _uniforms(generator, vocab_size)
        else:
            exponential_noise(torch.Size([1, vocab_size]), generator, device)


# --- one step's exponentials at a few positions (see the module's docstring) -------------------------------
COMPACT_MOST = 1024  # a row with at most this many nonzero probabilities races on them only


def _uniforms(generator: torch.Generator, count: int) -> torch.Tensor:
    """``count`` uniforms in [0, 1) as torch's CPU ``exponential_`` draws them: one 64-bit draw each,
    its low 53 bits over 2^53, in double (``uniform_`` on a double tensor)."""
    return torch.empty(count, dtype=torch.float64).uniform_(0.0, 1.0, generator=generator)


def _exponentials(u: list[float]) -> torch.Tensor:
    """-log(1 - u) with the C library's scalar log (as torch's CPU kernel computes it), as float32."""
    return torch.tensor([-math.log(1.0 - x) for x in u], dtype=torch.float64).float()


def exponentials_at(generator: torch.Generator, vocab_size: int,
                    ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's exponentials (``exponential_noise([1, vocab_size])``) at ``ids`` only -> (E at ``ids``
    [n] float32, the step's uniforms [vocab_size] double); the generator moves past all vocab_size draws,
    as exponential_noise moves it. Bit for bit exponential_'s where ``compact_draws_work()``."""
    u = _uniforms(generator, vocab_size)
    return _exponentials(u[ids].tolist()), u


def _compact(generator: torch.Generator | None) -> bool:
    return generator is not None and generator.device.type == "cpu" and compact_draws_work()


@cache
def compact_draws_work() -> bool:
    """Whether ``exponentials_at`` gives ``exponential_``'s numbers and end state on this torch, checked
    once bit for bit on a few seeds and sizes; False: every draw takes exponential_ over V."""
    for seed, size in ((0, 1), (1, 7), (2, 4099), (12345, 8192)):
        ours, theirs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        noise, _ = exponentials_at(ours, size, torch.arange(size))
        expected = exponential_noise(torch.Size([1, size]), theirs, torch.device("cpu"))[0]
        if not torch.equal(noise, expected) or not torch.equal(ours.get_state(), theirs.get_state()):
            return False
    return True


def rows_with_tokens(final: torch.Tensor) -> list[bool]:
    """``has_tokens`` for each row of ``final`` [R, V], in one pass over the batch: a row's max is
    NaN when it holds a NaN (amax propagates NaN), +inf when it holds +inf, and -inf when no entry
    is finite, so the row has tokens exactly when its max is finite."""
    return torch.isfinite(final.float().amax(dim=-1)).tolist()


def sample_rows(probs: torch.Tensor, generators: list[torch.Generator]) -> list[Pick]:
    """Draw from each row of ``probs`` [R, V] with ``generators[r]`` (V draws each, as alone): the
    exponential race (token i gets E_i ~ Exp(1); the largest p_i / E_i wins, as torch.multinomial
    draws), and the winner's interval [low, high) on the sorted CDF (higher probability first, ties
    by lower id) with u = low + p * (1 - exp(-E_w / p_w)). A row with at most COMPACT_MOST nonzero
    probabilities on a CPU generator races on those only (``exponentials_at``), the others on [R, V]
    at once; both give the same pick bit for bit."""
    counts = (probs != 0).sum(dim=-1).tolist()  # NaN counts as nonzero: it wins a race over V, and here too
    out: list[Pick | None] = [None] * len(generators)
    for r, (count, generator) in enumerate(zip(counts, generators)):
        if 0 < count <= COMPACT_MOST and probs.device.type == "cpu" and _compact(generator):
            ids = (probs[r] != 0).nonzero()[:, 0]  # [n], ascending
            out[r] = sample_at(probs[r, ids], ids, probs.shape[1], generator)
    full = [r for r, chosen in enumerate(out) if chosen is None]
    if full:
        rows = probs if len(full) == len(generators) else probs[full]
        for r, chosen in zip(full, _race_rows(rows, [generators[r] for r in full])):
            out[r] = chosen
    picks = [chosen for chosen in out if chosen is not None]
    if len(picks) != len(out):
        raise RuntimeError("sample_rows: a row was left without its pick")
    return picks


def _race_rows(probs: torch.Tensor, generators: list[torch.Generator]) -> list[Pick]:
    """The race over [R, V]: V exponentials per row from its generator."""
    noise = torch.cat([exponential_noise(torch.Size([1, probs.shape[1]]), g, probs.device) for g in generators])  # [R, V]
    tokens = torch.argmax(probs / noise, dim=-1, keepdim=True)  # [R, 1]
    p = probs.gather(1, tokens)  # [R, 1]
    times = noise.gather(1, tokens) / p  # [R, 1]: the race's winning times, as sample_probs divides them
    ids = torch.arange(probs.shape[1], device=probs.device)
    before = (probs > p) | ((probs == p) & (ids < tokens))  # [R, V]: sorted before the winner
    out = []
    for r, (token, prob, t) in enumerate(zip(tokens[:, 0].tolist(), p[:, 0].tolist(), times[:, 0].tolist())):
        out.append(_picked(token, prob, t, probs[r][before[r]].cpu().numpy()))
    return out


def sample_at(probs: torch.Tensor, ids: torch.Tensor, vocab_size: int, generator: torch.Generator) -> Pick:
    """``sample_rows``' pick for one row [vocab_size] that is 0 outside ``ids`` ([n], ascending; its
    values there ``probs`` [n]), raced on those only where the generator allows (a CPU one, and
    ``compact_draws_work``; else over V): the same exponentials there, the same division, the same winner
    (in id order, argmax's first maximum is the same token as over V), the same interval. Over V a
    zero-probability token whose exponential is exactly 0 (a uniform of exactly 0, once in 2^53 draws)
    makes 0 / 0 = NaN, which argmax takes: that rare step races over V from the same uniforms."""
    if not _compact(generator) or probs.device.type != "cpu":
        row = torch.zeros(vocab_size, dtype=probs.dtype, device=probs.device)
        return _race_rows(row.index_copy_(0, ids.to(probs.device), probs)[None], [generator])[0]
    noise, u = exponentials_at(generator, vocab_size, ids)
    # on n numbers numpy's operations are the same IEEE float32 ones as torch's at a tenth of the dispatch cost
    q, e, ids_ = probs.numpy(), noise.numpy(), ids.numpy()
    if u.numpy().min() == 0.0:  # the once-in-2^53 case above: every exponential, as exponential_ makes them
        q = torch.zeros(vocab_size, dtype=probs.dtype).index_copy_(0, ids, probs).numpy()
        ids_, e = np.arange(vocab_size), _exponentials(u.tolist()).numpy()
    with np.errstate(divide="ignore", invalid="ignore"):  # p / 0 = inf and 0 / 0 = NaN, as in torch, unsaid
        w = int(np.argmax(q / e))  # the first maximum (or NaN), as torch.argmax
        p = q[w]
        time = float(e[w] / p)
    before = (q > p) | ((q == p) & (np.arange(q.shape[0]) < w))  # sorted before the winner
    return _picked(int(ids_[w]), float(p), time, q[before])


def _picked(token: int, prob: float, time: float, before: np.ndarray) -> Pick:
    """The Pick of ``token`` won at race time ``time``: ``before`` holds the probabilities sorted
    before it, in id order, summed in float64 (the same terms in the same order, and the same sum, on
    both races)."""
    low = float(before.astype(np.float64).sum())
    return Pick(token, prob, low + prob * -math.expm1(-time), low, low + prob)
