"""What a grammar costs, exactly: the model conditioned on the grammar against masked decoding.

Masking step by step (the ``grammar`` stage, every serving engine's structured outputs) samples
each token from the allowed part of the model's next-token distribution, renormalised. That is not
the model's distribution conditioned on producing a string of the grammar (Park et al., "Grammar-
Aligned Decoding", NeurIPS 2024): masking trusts the first tokens it allows and never asks how
likely the model was to carry on as the grammar requires, or to stop where it must.

For a grammar whose strings can be enumerated (a regular expression over a handful of answers), both
distributions over its strings are computed exactly, by one walk of the tree of token prefixes the
grammar allows (every tokenization of every string: the grammar stage allows them all), one forward
per prefix through the KV cache, depth first so its rewinds are short:

- the model conditioned on the grammar: P(s | G) = Σ_t p(t, end) / Σ_all, t over the token paths
  that spell s (p: the raw model at temperature 1, other stages left out);
- masked decoding: Q(s) = Σ_t Π_i p(t_i | t_<i) / Z(t_<i), Z the mass the grammar allows after t_<i.

``allowed_mass`` (Σ_all) is the probability the unconstrained model writes one of the grammar's
strings and stops: what "JSON mode" hides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from engine.backends.local import LoadedModel
from engine.cache import KVCache
from engine.config import ConfigError, DecodingConfig
from engine.control import RunControl, check
from engine.stages import build_stage

MAX_PREFIXES = 2_000  # forwards one report may take; a grammar with more prefixes is not enumerable here
MAX_STRINGS = 64
MAX_DEPTH = 48  # tokens in one string


@dataclass(frozen=True)
class StringOdds:
    """One string of the grammar: its probability under the model conditioned on the grammar
    (``exact``), under masked decoding (``masked``), and how many token paths spell it."""

    text: str
    exact: float
    masked: float
    paths: int


@dataclass
class DistortionReport:
    """Both distributions over the grammar's strings (most likely under the model first), the
    probability the unconstrained model writes one of them and stops (``allowed_mass``), the total
    variation distance between them, KL(masked || exact) in nats, and the forwards it took."""

    prompt: str
    kind: str
    grammar: str
    strings: list[StringOdds] = field(default_factory=list)
    allowed_mass: float = 0.0
    total_variation: float = 0.0
    kl_masked_exact: float = 0.0
    prefixes: int = 0

    def odds(self, text: str) -> StringOdds | None:
        return next((s for s in self.strings if s.text == text), None)


class NotEnumerable(ConfigError):
    """The grammar has too many strings or token prefixes to enumerate here."""


def distortion_report(lm: LoadedModel, prompt: str, config: DecodingConfig, chat: bool = False, *,
                      prompt_ids: Sequence[int] | None = None, max_prefixes: int = MAX_PREFIXES,
                      control: RunControl | None = None) -> DistortionReport:
    """The exact distributions of ``config``'s grammar over its strings after ``prompt`` (see the
    module docstring). NotEnumerable (naming ``grammar``) past ``max_prefixes`` prefixes,
    MAX_STRINGS strings or MAX_DEPTH tokens; ConfigError when the config has no grammar."""
    if "grammar" not in config.active_stages():
        raise ConfigError("grammar", "the distortion view needs a grammar; give one")
    ids = list(prompt_ids) if prompt_ids is not None else lm.encode(prompt, chat)
    stage = build_stage("grammar", config, len(ids), lm.tokenizer, lm.eos_token_ids)
    cache = KVCache(lm.model)
    ends = set(lm.eos_token_ids)
    found: dict[str, list[float]] = {}  # text -> [Σ p(path, end), Σ q(path, end), paths]
    stack: list[tuple[list[int], float, float]] = [([], 0.0, 0.0)]  # (generated, ln p, ln q): depth first
    prefixes = 0
    while stack:
        generated, logp, logq = stack.pop()
        check(control)
        prefixes += 1
        if prefixes > max_prefixes or len(generated) > MAX_DEPTH:
            raise NotEnumerable("grammar", f"more than {max_prefixes:,} token prefixes or {MAX_DEPTH} tokens in a "
                                           "string: too many to enumerate; use a grammar of a few short answers")
        step_logp, allowed = _node(lm, cache, stage, ids + generated)
        log_z = float(torch.logsumexp(step_logp[allowed], dim=0))
        children = []
        for token in allowed.nonzero().flatten().tolist():
            lp = float(step_logp[token])
            if token in ends:
                _add(found, lm.decode(generated), logp + lp, logq + lp - log_z)
            else:
                children.append((generated + [token], logp + lp, logq + lp - log_z))
        stack.extend(reversed(children))
        if len(found) > MAX_STRINGS:
            raise NotEnumerable("grammar", f"more than {MAX_STRINGS} strings: too many to enumerate; use a grammar "
                                           "of a few short answers")
    return _report(prompt, config, found, prefixes)


@torch.inference_mode()
def _node(lm: LoadedModel, cache: KVCache, stage: Any, sequence: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The raw model's log-probabilities [V] (float64) after ``sequence`` and the tokens the grammar
    allows there [V]."""
    logits = cache.sync(sequence).float()  # [1, V]
    masked, _ = stage.apply(torch.tensor([sequence], dtype=torch.long), logits)
    return torch.log_softmax(logits[0].double(), dim=-1), torch.isfinite(masked[0])


def _add(found: dict[str, list[float]], text: str, logp: float, logq: float) -> None:
    entry = found.setdefault(text, [0.0, 0.0, 0])
    entry[0] += math.exp(logp)
    entry[1] += math.exp(logq)
    entry[2] += 1


def _report(prompt: str, config: DecodingConfig, found: dict[str, list[float]], prefixes: int) -> DistortionReport:
    total = sum(p for p, _, _ in found.values())
    # Q is a distribution by construction (every path the mask allows ends at an end token): it is
    # not renormalised here, so a test can check that it sums to 1
    strings = sorted((StringOdds(text, p / total if total > 0 else 0.0, q, int(n)) for text, (p, q, n) in found.items()),
                     key=lambda s: (-s.exact, s.text))
    tv = 0.5 * sum(abs(s.exact - s.masked) for s in strings)
    kl = sum(s.masked * math.log(s.masked / s.exact) for s in strings if s.masked > 0 and s.exact > 0)
    return DistortionReport(prompt, config.grammar_kind, config.grammar, strings, total, tv, kl, prefixes)
