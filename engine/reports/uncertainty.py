"""Entropy and varentropy per step over a run, and the steps where the model hesitates (issue #54).

Entropy H = −Σ p log p says how spread the next-token distribution is; varentropy
V = Σ p (−log p − H)² (the variance of the surprisal) says whether that spread is even (low V:
many tokens of about the same weight) or uneven (high V: a few candidates stand out of a long
tail). Entropy-adaptive samplers (entropix) read the pair as four quadrants; a step in the
high-H, high-V quadrant is one where the model is unsure *and* torn between distinct options: a
**hesitation**. Both are recorded in every stage of a trace (``engine.chain`` computes them over
the whole vocabulary); this module reads them back per step and marks the hesitations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from engine.config import ConfigError
from engine.trace import StepTrace

# Defaults for the embedded model's raw distributions (a 64-token chat answer spans H 0.5-5.6 nats,
# V 1.8-9.8 nats²): about one step in six lands above both. Every caller may pass its own.
HESITATION_ENTROPY = 3.0  # nats
HESITATION_VARENTROPY = 6.0  # nats²
MAX_THRESHOLD = 100.0
QUADRANTS = {  # (high entropy, high varentropy) -> words
    (False, False): "confident",
    (False, True): "a few strong candidates",
    (True, False): "evenly unsure",
    (True, True): "hesitating",
}


def entropy_varentropy(probs: torch.Tensor) -> tuple[float, float]:
    """H (nats) and V (nats²) of one distribution ``probs`` [V], the direct formulas in float64
    (the reference the chain's vectorised capture is tested against)."""
    p = probs.double()
    p = p[p > 0]
    surprisal = -p.log()
    h = float((p * surprisal).sum())
    return h, float((p * (surprisal - h) ** 2).sum())


@dataclass
class UncertainStep:
    index: int
    token: str
    entropy: float  # nats, of the distribution read (raw or final)
    varentropy: float | None  # nats²; None where the trace did not record it
    quadrant: str  # QUADRANTS' words
    hesitant: bool


@dataclass
class UncertaintySeries:
    """Per step H and V of the raw (``raw``) or final distribution, the quadrant of each, and the
    hesitation steps (H >= ``entropy_threshold`` and V >= ``varentropy_threshold``)."""

    raw: bool
    entropy_threshold: float
    varentropy_threshold: float
    steps: list[UncertainStep] = field(default_factory=list)
    hesitations: list[int] = field(default_factory=list)  # step indices
    recorded: bool = True  # False: the trace has no varentropy (a served model's top-N, an older trace)

    def sentence(self) -> str:
        """What the chart shows, in one sentence from the same numbers."""
        which = "raw" if self.raw else "final"
        if not self.steps:
            return "No steps."
        if not self.recorded:
            return f"This trace has no varentropy (a served model's top-N or an older trace): {which} entropy only."
        worst = max(self.steps, key=lambda s: s.entropy)
        marked = ", ".join(str(i) for i in self.hesitations[:12]) + ("…" if len(self.hesitations) > 12 else "")
        head = (f"{len(self.hesitations)} of {len(self.steps)} steps hesitate ({which} H ≥ {self.entropy_threshold:g} "
                f"nats and V ≥ {self.varentropy_threshold:g} nats²)")
        return head + (f": steps {marked}" if self.hesitations else "") + \
            f"; the most uncertain step is {worst.index} (H {worst.entropy:.2f} nats)."


def check_threshold(key: str, value: object) -> float:
    """A threshold in [0, MAX_THRESHOLD]; ConfigError naming ``key`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0 <= value <= MAX_THRESHOLD:
        raise ConfigError(key, f"expected a number in [0, {MAX_THRESHOLD:g}], got {value!r:.40}")
    return float(value)


def uncertainty_series(steps: Sequence[StepTrace], raw: bool = True, entropy_threshold: float = HESITATION_ENTROPY,
                       varentropy_threshold: float = HESITATION_VARENTROPY) -> UncertaintySeries:
    """The run's steps read as (H, V) pairs and quadrants; ``raw``: the model's own distribution
    (what an entropy-adaptive sampler reads), else the final one the token was drawn from."""
    h_cut = check_threshold("entropy_threshold", entropy_threshold)
    v_cut = check_threshold("varentropy_threshold", varentropy_threshold)
    out = UncertaintySeries(raw, h_cut, v_cut)
    for step in steps:
        h = step.raw_entropy if raw else step.entropy
        v = step.raw_varentropy if raw else step.varentropy
        high_h, high_v = h >= h_cut, v is not None and v >= v_cut
        out.recorded = out.recorded and v is not None
        out.steps.append(UncertainStep(step.index, step.chosen_token, h, v, QUADRANTS[(high_h, high_v)],
                                       high_h and high_v))
        if high_h and high_v:
            out.hesitations.append(step.index)
    return out
