"""Is the model's confidence honest? Calibration on the held-out text (issue #54).

The model reads the held-out text shipped in the repo (engine/assets/quant/heldout.txt, the one the
quantization report reads) teacher-forced, in one forward. At every position its confidence is the
top token's probability and it is right when that token is the real next one. The reliability
diagram bins the positions by confidence (``bins`` equal-width bins over [0, 1]) and sets each bin's
mean confidence beside its accuracy; the expected calibration error is
ECE = Σ_b (n_b / N) · |accuracy_b − confidence_b| (Guo et al. 2017). Temperature T divides the
logits: the top token stays the same (so accuracy does not move) while every confidence changes;
the T that minimises the held-out negative log-likelihood (temperature scaling) is found by a
safeguarded Newton search over β = 1/T, in which the NLL is convex. The temperature knob is also a
calibration knob.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from engine.config import ConfigError
from engine.control import RunControl, check
from engine.reports.quant_report import heldout_ids  # the quantization report's held-out text and length

DEFAULT_BINS = 10
MAX_BINS = 50
SWEEP = (0.5, 0.7, 1.0, 1.5, 2.0)
T_LOW, T_HIGH = 0.05, 10.0  # the search range of the best temperature
SEARCH_TOLERANCE = 1e-6  # relative, in β = 1/T
MAX_SEARCH_STEPS = 60
METHOD = ("Teacher-forced on the held-out text: at each position the confidence is the top token's probability, "
          "right when that token is the real next one. Positions are binned by confidence (equal-width bins); "
          "ECE = Σ (n_b / N) · |accuracy_b − confidence_b|. Temperature divides the logits: the top token, hence "
          "the accuracy, stays; the best T minimises the held-out NLL (a safeguarded Newton search over 1/T, where the NLL is convex).")


@dataclass
class ReliabilityBin:
    low: float
    high: float
    count: int
    confidence: float | None  # mean top-token probability of the bin's positions (None: empty bin)
    accuracy: float | None  # share of them whose top token is the real next one


@dataclass
class Calibration:
    """The reliability of the model's confidence at one temperature."""

    temperature: float
    ece: float
    nll: float  # mean negative log-likelihood of the real next tokens, nats
    accuracy: float
    mean_confidence: float
    bins: list[ReliabilityBin] = field(default_factory=list)


@dataclass
class CalibrationReport:
    model: str
    quantization: str
    tokens: int  # positions scored
    at_one: Calibration
    best_temperature: float
    at_best: Calibration
    sweep: list[Calibration] = field(default_factory=list)
    method: str = ""

    def sentence(self) -> str:
        """What the diagram shows, in one sentence from the same numbers."""
        one, best = self.at_one, self.at_best
        way = "over" if one.mean_confidence > one.accuracy else "under"
        return (f"At T = 1 the model is {way}confident: mean confidence {one.mean_confidence:.1%} against "
                f"{one.accuracy:.1%} right on {self.tokens} held-out tokens, ECE {one.ece:.3f}; T = "
                f"{self.best_temperature:.2f} minimises the held-out NLL ({one.nll:.3f} → {best.nll:.3f} nats) and "
                f"brings the ECE to {best.ece:.3f}.")


def check_bins(bins: Any) -> int:
    if isinstance(bins, bool) or not isinstance(bins, int) or not 2 <= bins <= MAX_BINS:
        raise ConfigError("bins", f"expected an integer in [2, {MAX_BINS}], got {bins!r:.40}")
    return bins


def reliability(confidence: torch.Tensor, correct: torch.Tensor, bins: int = DEFAULT_BINS
                ) -> tuple[list[ReliabilityBin], float]:
    """(the bins, the ECE) of confidences [N] in [0, 1] and whether each was right [N] (bool).
    Bin b holds confidences in [b/B, (b+1)/B), the last bin also 1."""
    n = confidence.numel()
    index = (confidence.double() * bins).floor().clamp(0, bins - 1).long()  # [N]
    counts = torch.bincount(index, minlength=bins).tolist()
    conf_sum = torch.zeros(bins, dtype=torch.float64).index_add_(0, index, confidence.double()).tolist()
    right = torch.zeros(bins, dtype=torch.float64).index_add_(0, index, correct.double()).tolist()
    out, ece = [], 0.0
    for b in range(bins):
        c = counts[b]
        if not c:
            out.append(ReliabilityBin(b / bins, (b + 1) / bins, c, None, None))
            continue
        conf, acc = conf_sum[b] / c, right[b] / c
        out.append(ReliabilityBin(b / bins, (b + 1) / bins, c, conf, acc))
        ece += c / n * abs(acc - conf)
    return out, ece


def centered(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits − each row's max [N, V], the targets' entries of it [N]): softmax(β z) = softmax(β c)
    for every β > 0, and every term of the sums below is exp(β c) <= 1 (computed once per report)."""
    c = logits - logits.max(dim=-1, keepdim=True).values
    return c, c.gather(1, targets[:, None])[:, 0]


def nll_at(logits: torch.Tensor, targets: torch.Tensor, beta: float) -> float:
    """Mean −log softmax(β · logits)[target] over the rows of ``logits`` [N, V]."""
    return _nll(*centered(logits, targets), beta)


def _nll(c: torch.Tensor, at: torch.Tensor, beta: float) -> float:
    return float((torch.exp(c * beta).sum(dim=-1).double().log() - beta * at.double()).mean())


def calibration_at(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                   bins: int = DEFAULT_BINS, shifted: tuple[torch.Tensor, torch.Tensor] | None = None) -> Calibration:
    """The reliability at ``temperature`` of next-token ``logits`` [N, V] for ``targets`` [N]
    (``shifted``: ``centered(logits, targets)``, when the caller has it). One exp of the rows gives
    both the top token's p (1 / Σ exp(β c), the top's term being 1) and the NLL (log Σ − β c_y)."""
    c, at = shifted if shifted is not None else centered(logits, targets)
    beta = 1.0 / temperature
    total = torch.exp(c * beta).sum(dim=-1).double()  # [N]
    confidence = 1.0 / total
    correct = logits.argmax(dim=-1) == targets  # the top token does not depend on T
    table, ece = reliability(confidence, correct, bins)
    return Calibration(temperature, ece, float((total.log() - beta * at.double()).mean()),
                       float(correct.double().mean()), float(confidence.mean()), table)


def nll_slope(logits: torch.Tensor, targets: torch.Tensor, beta: float) -> tuple[float, float]:
    """The mean NLL's first and second derivatives in β: mean(E_p[z] − z_y) and mean(Var_p[z]),
    p = softmax(β z) (the second is >= 0: the NLL is convex in β)."""
    return _slope(*centered(logits, targets), beta)


def _slope(c: torch.Tensor, at: torch.Tensor, beta: float) -> tuple[float, float]:
    """``nll_slope`` on ``centered`` rows: one exp, then its sums weighted by c and c², in place."""
    e = torch.exp(c * beta)  # [N, V]
    total = e.sum(dim=-1).double()
    first = e.mul_(c).sum(dim=-1).double() / total  # E[c]
    second = e.mul_(c).sum(dim=-1).double() / total  # E[c²]
    return float((first - at.double()).mean()), float((second - first.square()).clamp(min=0).mean())


def best_temperature(logits: torch.Tensor, targets: torch.Tensor, low: float = T_LOW, high: float = T_HIGH,
                     control: RunControl | None = None,
                     shifted: tuple[torch.Tensor, torch.Tensor] | None = None) -> float:
    """The T in [low, high] minimising the mean NLL. The NLL (−β z_y + logsumexp(β z), β = 1/T) is
    convex in β, so its slope rises through 0 once: Newton's steps on the slope from β = 1, kept
    inside a bracket that each step narrows (bisection where a Newton step would leave it); the
    bracket's ends are evaluated only when the search reaches one."""
    c, at = shifted if shifted is not None else centered(logits, targets)
    a, b = 1.0 / high, 1.0 / low
    beta, ends = min(max(1.0, a), b), {a, b}  # the bracket's ends not evaluated yet
    for _ in range(MAX_SEARCH_STEPS):
        check(control)
        slope, curve = _slope(c, at, beta)
        a, b = (beta, b) if slope < 0 else (a, beta)
        if b - a < SEARCH_TOLERANCE * beta or abs(slope) < 1e-9:
            break
        step = beta - slope / curve if curve > 0 else math.nan
        end = a if not step > a else b if not step < b else None
        if end in ends:  # Newton heads out of the bracket: is the minimum at that end?
            ends.discard(end)
            if (_slope(c, at, end)[0] >= 0) == (end == a):
                return 1.0 / end
        beta = step if a < step < b else (a + b) / 2
    return 1.0 / beta


@torch.inference_mode()
def teacher_forced(lm: Any, ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [T − 1, V] float32, targets [T − 1]): row t predicts ids[t + 1], one forward."""
    logits = lm.model(input_ids=torch.tensor([list(ids)], device=lm.device), use_cache=False).logits[0, :-1].float()
    return logits, torch.tensor(list(ids[1:]), device=logits.device)


def calibration_report(lm: Any, ids: Sequence[int] | None = None, bins: int = DEFAULT_BINS,
                       temperatures: Sequence[float] = SWEEP, *, control: RunControl | None = None) -> CalibrationReport:
    """The model's calibration on ``ids`` (default: the held-out text) at T = 1, at the best T and
    at each of ``temperatures``."""
    if not lm.capabilities.full_logits:
        raise ConfigError("model", "calibration: not available for a served model (it needs every token's logit)")
    bins = check_bins(bins)
    ids = list(ids) if ids is not None else heldout_ids(lm)
    if len(ids) < 2:
        raise ConfigError("text", "needs at least two tokens")
    check(control)
    logits, targets = teacher_forced(lm, ids)
    check(control)
    shifted = centered(logits, targets)
    best = best_temperature(logits, targets, control=control, shifted=shifted)
    sweep = [calibration_at(logits, targets, t, bins, shifted) for t in temperatures]
    return CalibrationReport(getattr(lm, "name", ""), getattr(lm, "quantization", "none"), len(targets),
                             calibration_at(logits, targets, 1.0, bins, shifted), best,
                             calibration_at(logits, targets, best, bins, shifted), sweep, METHOD)
