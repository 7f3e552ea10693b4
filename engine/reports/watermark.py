"""The green-list watermark's detector, and what washes the watermark out (issue #54).

``detect`` reads any ids (a run's generated tokens, or a pasted text encoded) with the key, γ,
seeding scheme and context the text was written under, as transformers' ``WatermarkDetector``
does: every token that has ``context`` tokens before it (selfhash: ``context`` − 1) is scored
green or red; with T scored tokens of which G green, z = (G − γT) / √(T γ (1 − γ)) and the one-sided
p-value ½ erfc(z / √2). It also says how many tokens the observed green rate needs to pass the
threshold, and after how many scored tokens the running z first did.

``robustness`` measures what breaks it on one prompt: the temperature, a top-k before or after the
watermark stage, a share of tokens replaced (an edit, a stand-in for paraphrase) or a hand-edited
text, and the low-entropy steps: the paper's spike entropy S = Σ p_k / (1 + ζ p_k), ζ = (1 − γ)(e^δ − 1)
/ (1 + (e^δ − 1)γ), of the model's raw distribution at each step, which bounds how often a step can
turn green (a peaked distribution cannot be bent by δ).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from engine.config import KNOBS, ConfigError, DecodingConfig, check_knob
from engine.control import RunControl, check
from engine.stages.watermark import green_permutation

DEFAULT_THRESHOLD = 4.0  # the paper's z threshold (transformers' detector defaults to 3)
MAX_DETECT_TOKENS = 4096
MAX_THRESHOLD = 20.0


@dataclass(frozen=True)
class WatermarkKey:
    """What the detector must share with the writer: γ, the seeding scheme, the key, the context."""

    gamma: float = 0.25
    seeding: str = "lefthash"
    key: int = KNOBS["watermark_key"].neutral
    context: int = 1

    def __post_init__(self) -> None:
        for name, value in (("watermark_gamma", self.gamma), ("watermark_seeding", self.seeding),
                            ("watermark_key", self.key), ("watermark_context", self.context)):
            check_knob(name, value)

    @classmethod
    def of(cls, config: DecodingConfig) -> "WatermarkKey":
        return cls(config.watermark_gamma, config.watermark_seeding, config.watermark_key, config.watermark_context)

    @property
    def window(self) -> int:
        """Ids per scored n-gram: the context and the token (selfhash's context includes the token)."""
        return self.context + 1 - int(self.seeding == "selfhash")


@dataclass
class ScoredToken:
    token_id: int
    token: str
    scored: bool  # False: fewer ids before it than the seeding needs (or a repeat, ignore_repeated)
    green: bool | None


@dataclass
class Detection:
    gamma: float
    seeding: str
    context: int
    threshold: float
    scored: int
    green: int
    green_fraction: float | None
    z: float | None
    p_value: float | None
    detected: bool
    tokens_needed: int | None  # scored tokens the observed green rate needs for z > threshold (None: never)
    first_detected_at: int | None  # scored tokens after which the running z first passed the threshold
    tokens: list[ScoredToken] = field(default_factory=list)
    z_series: list[float] = field(default_factory=list)  # the running z after each scored token

    def sentence(self) -> str:
        """What the coloured text shows, in one sentence from the same numbers."""
        if not self.scored:
            return "No token could be scored: the text is shorter than the seeding's context."
        verdict = "watermarked" if self.detected else "not detected"
        need = (f"at this green rate {self.tokens_needed:,} tokens would pass z = {self.threshold:g}"
                if self.tokens_needed is not None else "at this green rate no length would pass")
        return (f"{self.green} of {self.scored} scored tokens are green ({self.green_fraction:.0%}; chance: "
                f"{self.gamma:.0%}): z = {self.z:.2f}, p = {self.p_value:.2g}, {verdict} at z > {self.threshold:g}; "
                f"{need}.")


def z_score(green: int, scored: int, gamma: float) -> float:
    """(G − γT) / √(T γ (1 − γ))."""
    return (green - gamma * scored) / math.sqrt(scored * gamma * (1 - gamma))


def tokens_needed(fraction: float, gamma: float, threshold: float) -> int | None:
    """The smallest T with z > threshold at green share ``fraction`` (None when fraction <= γ)."""
    if fraction <= gamma:
        return None
    t = threshold ** 2 * gamma * (1 - gamma) / (fraction - gamma) ** 2
    return max(1, math.floor(t) + 1)


def check_threshold(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0 < value <= MAX_THRESHOLD:
        raise ConfigError("z_threshold", f"expected a number in (0, {MAX_THRESHOLD:g}], got {value!r:.40}")
    return float(value)


def detect(ids: Sequence[int], vocab_size: int, key: WatermarkKey = WatermarkKey(), threshold: float = DEFAULT_THRESHOLD,
           ignore_repeated: bool = False, token_text: Callable[[int], str] = str,
           control: RunControl | None = None) -> Detection:
    """Score ``ids`` (the text alone: the prompt, if any, left out, as transformers advises)."""
    threshold = check_threshold(threshold)
    if len(ids) > MAX_DETECT_TOKENS:
        raise ConfigError("text", f"{len(ids):,} tokens is over the {MAX_DETECT_TOKENS:,}-token limit")
    if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab_size for i in ids):
        raise ConfigError("ids", f"token ids must be integers in [0, {vocab_size})")
    n, size = key.window, int(vocab_size * key.gamma)
    selfhash = key.seeding == "selfhash"
    seen: dict[tuple[int, ...], bool] = {}
    tokens = [ScoredToken(i, token_text(i), False, None) for i in ids[: n - 1]]
    green = scored = 0
    series: list[float] = []
    for j in range(n - 1, len(ids)):
        if (j & 63) == 0:
            check(control)
        gram = tuple(ids[j - n + 1: j + 1])
        repeat = gram in seen
        if not repeat:
            context = torch.tensor(gram if selfhash else gram[:-1], dtype=torch.long)
            perm = green_permutation(context, vocab_size, key.seeding, key.key, key.context)
            seen[gram] = bool((perm[:size] == gram[-1]).any())
        counted = not (ignore_repeated and repeat)
        tokens.append(ScoredToken(ids[j], token_text(ids[j]), counted, seen[gram]))
        if counted:
            scored += 1
            green += seen[gram]
            series.append(z_score(green, scored, key.gamma))
    return _detection(key, threshold, scored, green, tokens, series)


def _detection(key: WatermarkKey, threshold: float, scored: int, green: int, tokens: list[ScoredToken],
               series: list[float]) -> Detection:
    if not scored:
        return Detection(key.gamma, key.seeding, key.context, threshold, 0, 0, None, None, None, False, None, None,
                         tokens, series)
    z = z_score(green, scored, key.gamma)
    first = next((k + 1 for k, value in enumerate(series) if value > threshold), None)
    return Detection(key.gamma, key.seeding, key.context, threshold, scored, green, green / scored, z,
                     0.5 * math.erfc(z / math.sqrt(2)), z > threshold,
                     tokens_needed(green / scored, key.gamma, threshold), first, tokens, series)


# --- what washes it out -----------------------------------------------------------------------------
def spike_entropy(probs: torch.Tensor, gamma: float, delta: float) -> torch.Tensor:
    """The paper's spike entropy S = Σ_k p_k / (1 + ζ p_k) of each row of ``probs`` [R, V], with
    ζ = (1 − γ)(e^δ − 1) / (1 + (e^δ − 1)γ): near 1 for a flat row, 1 / (1 + ζ) for a one-hot one."""
    alpha = math.exp(delta)
    zeta = (1 - gamma) * (alpha - 1) / (1 + (alpha - 1) * gamma)
    return (probs / (1 + zeta * probs)).sum(dim=-1)


def green_bound(spike: float, gamma: float, delta: float) -> float:
    """The paper's lower bound on a step's chance of a green token: γα S / (1 + (α − 1)γ), α = e^δ."""
    alpha = math.exp(delta)
    return gamma * alpha * spike / (1 + (alpha - 1) * gamma)


@dataclass
class Washout:
    """One variant of the run and what it leaves of the watermark."""

    case: str
    z: float | None
    green_fraction: float | None
    scored: int
    detected: bool
    text: str = ""


@dataclass
class SpikeSplit:
    """The steps split at the median spike entropy of the raw distribution: how often each half
    is green, against the paper's bound averaged over it."""

    median_spike: float
    low_green: float | None  # green share of the low-spike (peaked) steps
    high_green: float | None
    low_bound: float | None
    high_bound: float | None


@dataclass
class Robustness:
    gamma: float
    delta: float
    seeding: str
    threshold: float
    rows: list[Washout] = field(default_factory=list)
    spike: SpikeSplit | None = None

    def sentence(self) -> str:
        """The table in one sentence, from the same numbers."""
        base, control = self.rows[0], self.rows[1] if len(self.rows) > 1 else None
        tries = [r for r in self.rows[2:] if r.z is not None]  # the attempts to wash it out (rows[1]: no stage)
        head = f"The watermarked run scores z = {_z(base.z)}"
        if control is not None:
            head += f" (the same prompt without the stage: z = {_z(control.z)})"
        if tries:
            weakest = min(tries, key=lambda r: r.z if r.z is not None else math.inf)
            head += f"; of the attempts to wash it out, {weakest.case} brings it lowest, to z = {_z(weakest.z)}"
        if self.spike is None or self.spike.low_green is None:
            return head + "."
        return (head + f"; peaked steps (spike entropy below {self.spike.median_spike:.2f}) turn green "
                       f"{self.spike.low_green:.0%} of the time, flat ones {self.spike.high_green:.0%}.")


def _z(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def replaced(ids: Sequence[int], share: float, vocab_size: int, seed: int = 0) -> list[int]:
    """``ids`` with a ``share`` of positions (chosen by a seeded draw) replaced by random tokens:
    an edit that keeps the length (a crude stand-in for a paraphrase)."""
    rng = random.Random(seed)
    out = list(ids)
    for i in rng.sample(range(len(out)), round(share * len(out))):
        out[i] = rng.randrange(vocab_size)
    return out


ROBUST_TEMPERATURES = (0.7, 1.0, 1.5)
ROBUST_TOP_K = 5
ROBUST_SHARES = (0.1, 0.25, 0.5)
Runner = Callable[[DecodingConfig], Any]  # a config -> its Trace (the caller's way to run: runner.run, Shared.run)


def robustness(lm: Any, prompt_ids: Sequence[int], config: DecodingConfig, run: Runner, *,
               edited_text: str | None = None, threshold: float = DEFAULT_THRESHOLD,
               temperatures: Sequence[float] = ROBUST_TEMPERATURES, top_k: int = ROBUST_TOP_K,
               shares: Sequence[float] = ROBUST_SHARES, control: RunControl | None = None) -> Robustness:
    """Run ``config`` (its watermark on) and the variants that may wash the watermark out, each
    detected with the same key: no watermark, each temperature (sampling, same seed), top-k
    ``top_k`` before and after the watermark stage, a share of tokens replaced, ``edited_text``
    (a hand-edited copy of the run's text, encoded without special tokens), and the spike-entropy
    split of the watermarked run's steps."""
    if config.watermark_delta <= 0:
        raise ConfigError("watermark_delta", "0 plants no watermark; set δ above 0 to measure what washes it out")
    threshold, key = check_threshold(threshold), WatermarkKey.of(config)
    out = Robustness(key.gamma, config.watermark_delta, key.seeding, threshold)

    def scored(case: str, ids: Sequence[int], text: str = "") -> Detection:
        found = detect(list(ids), lm.vocab_size, key, threshold, control=control)
        out.rows.append(Washout(case, found.z, found.green_fraction, found.scored, found.detected, text))
        return found

    base = run(config)
    found = scored("as configured", base.generated_token_ids, base.text)
    for case, variant in _variants(config, temperatures, top_k):
        check(control)
        trace = run(variant)
        scored(case, trace.generated_token_ids, trace.text)
    for share in shares:
        ids = replaced(base.generated_token_ids, share, lm.vocab_size, config.seed)
        scored(f"{share:.0%} of tokens replaced", ids, lm.decode(ids))
    if edited_text:
        scored("the hand-edited text", lm.encode(edited_text), edited_text)
    out.spike = _spike_split(lm, prompt_ids, base.generated_token_ids, found, key, config.watermark_delta, control)
    return out


def _variants(config: DecodingConfig, temperatures: Sequence[float], top_k: int) -> list[tuple[str, DecodingConfig]]:
    """(case, config) of each re-run: δ = 0, each temperature, top-k before / after the watermark."""
    order = [s for s in config.stage_order if s not in ("top_k", "watermark")]
    at = order.index("mirostat") if "mirostat" in order else len(order)
    before = order[:at] + ["top_k", "watermark"] + order[at:]
    after = order[:at] + ["watermark", "top_k"] + order[at:]
    sampled = config.replace(strategy="sample") if config.strategy == "greedy" else config
    out = [("no watermark (δ 0)", config.replace(watermark_delta=0.0))]
    out += [(f"temperature {t:g}", sampled.replace(temperature=t)) for t in temperatures]
    out += [(f"top-k {top_k} before the watermark", sampled.replace(top_k=top_k, stage_order=before)),
            (f"top-k {top_k} after the watermark", sampled.replace(top_k=top_k, stage_order=after))]
    return out


@torch.inference_mode()
def _spike_split(lm: Any, prompt_ids: Sequence[int], ids: Sequence[int], found: Detection, key: WatermarkKey,
                 delta: float, control: RunControl | None) -> SpikeSplit | None:
    """The raw model's spike entropy at each generated step (one teacher-forced forward), split at
    its median: the green share and the paper's bound in each half."""
    if not lm.capabilities.full_logits or len(ids) < 2:
        return None
    check(control)
    logits = lm.model(input_ids=torch.tensor([[*prompt_ids, *ids[:-1]]], device=lm.device), use_cache=False,
                      logits_to_keep=len(ids)).logits[0].float()  # [len(ids), V]: row j predicts ids[j]
    spikes = spike_entropy(torch.softmax(logits, dim=-1), key.gamma, delta).tolist()
    pairs = [(s, t.green) for s, t in zip(spikes, found.tokens) if t.scored]
    if len(pairs) < 2:
        return None
    median = sorted(s for s, _ in pairs)[len(pairs) // 2]
    low = [(s, g) for s, g in pairs if s < median]
    high = [(s, g) for s, g in pairs if s >= median]

    def share(half: list) -> float | None:
        return sum(g for _, g in half) / len(half) if half else None

    def bound(half: list) -> float | None:
        return sum(green_bound(s, key.gamma, delta) for s, _ in half) / len(half) if half else None

    return SpikeSplit(median, share(low), share(high), bound(low), bound(high))
