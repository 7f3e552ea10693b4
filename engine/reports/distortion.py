"""What a grammar costs, exactly: the model conditioned on the grammar against masked decoding.

Masking step by step (the ``grammar`` stage, every serving engine's structured outputs) samples
each token from the allowed part of the model's next-token distribution, renormalised. That is not
the model's distribution conditioned on producing a string of the grammar (Park et al., "Grammar-
Aligned Decoding", NeurIPS 2024): masking trusts the first tokens it allows and never asks how
likely the model was to carry on as the grammar requires, or to stop where it must.

For a grammar whose strings can be enumerated (a regular expression over a handful of answers), both
distributions over its strings are computed exactly, by one walk of the tree of token prefixes the
grammar allows (every tokenization of every string: the grammar stage allows them all), level by
level: the prompt is prefilled once, and the prefixes of one length are scored together, one
batched forward over copies of the prompt's KV cache (``LEVEL_ROWS`` rows at most):

- the model conditioned on the grammar: P(s | G) = Σ_t p(t, end) / Σ_all, t over the token paths
  that spell s (p: the raw model at temperature 1, other stages left out);
- masked decoding: Q(s) = Σ_t Π_i p(t_i | t_<i) / Z(t_<i), Z the mass the grammar allows after t_<i.

``allowed_mass`` (Σ_all) is the probability the unconstrained model writes one of the grammar's
strings and stops: what "JSON mode" hides.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from engine.base.seam import Model
from engine.config import ConfigError, DecodingConfig
from engine.control import RunControl, check
from engine.stages import build_stage

MAX_PREFIXES = 2_000  # forwards one report may take; a grammar with more prefixes is not enumerable here
MAX_STRINGS = 64
MAX_DEPTH = 48  # tokens in one string
LEVEL_ROWS = 64  # prefixes of one length scored in one batched forward


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


def distortion_report(lm: Model, prompt: str, config: DecodingConfig, chat: bool = False, *,
                      prompt_ids: Sequence[int] | None = None, max_prefixes: int = MAX_PREFIXES,
                      control: RunControl | None = None) -> DistortionReport:
    """The exact distributions of ``config``'s grammar over its strings after ``prompt`` (see the
    module docstring). NotEnumerable (naming ``grammar``) past ``max_prefixes`` prefixes,
    MAX_STRINGS strings or MAX_DEPTH tokens; ConfigError when the config has no grammar."""
    if "grammar" not in config.active_stages():
        raise ConfigError("grammar", "the distortion view needs a grammar; give one")
    ids = list(prompt_ids) if prompt_ids is not None else lm.encode(prompt, chat)
    stage = build_stage("grammar", config, len(ids), lm.tokenizer, lm.eos_token_ids)
    prompt_kv, root = _prefill(lm, ids)
    ends = set(lm.eos_token_ids)
    found: dict[str, list[float]] = {}  # text -> [Σ p(path, end), Σ q(path, end), paths]
    level: list[tuple[list[int], float, float]] = [([], 0.0, 0.0)]  # (generated, ln p, ln q), all one length
    prefixes = 0
    while level:
        check(control)
        prefixes += len(level)
        if prefixes > max_prefixes or len(level[0][0]) > MAX_DEPTH:
            raise NotEnumerable("grammar", f"more than {max_prefixes:,} token prefixes or {MAX_DEPTH} tokens in a "
                                           "string: too many to enumerate; use a grammar of a few short answers")
        deeper = []
        for start in range(0, len(level), LEVEL_ROWS):
            rows = level[start:start + LEVEL_ROWS]
            step_logp, allowed = _scored(lm, prompt_kv, root, stage, ids, [g for g, _, _ in rows])  # [R, V] each
            for (generated, logp, logq), row_logp, row_allowed in zip(rows, step_logp, allowed):
                log_z = float(torch.logsumexp(row_logp[row_allowed], dim=0))
                for token in row_allowed.nonzero().flatten().tolist():
                    lp = float(row_logp[token])
                    if token in ends:
                        _add(found, lm.decode(generated), logp + lp, logq + lp - log_z)
                    else:
                        deeper.append((generated + [token], logp + lp, logq + lp - log_z))
            if len(found) > MAX_STRINGS:
                raise NotEnumerable("grammar", f"more than {MAX_STRINGS} strings: too many to enumerate; use a "
                                               "grammar of a few short answers")
        level = deeper
    return _report(prompt, config, found, prefixes)


@torch.inference_mode()
def _prefill(lm: Model, ids: list[int]) -> tuple[Any, torch.Tensor]:
    """The prompt's KV cache and the raw logits [1, V] (float32) after it."""
    out = lm.model(input_ids=torch.tensor([ids], device=lm.device), use_cache=True, logits_to_keep=1)
    return out.past_key_values, out.logits[:, -1].float()


@torch.inference_mode()
def _scored(lm: Model, prompt_kv: Any, root: torch.Tensor, stage: Any, ids: list[int],
            generated: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The raw model's log-probabilities [R, V] (float64) after the prompt and each of ``generated``
    (prefixes of one length: one forward over R copies of the prompt's cache), and the tokens the
    grammar allows there [R, V]."""
    if not generated[0]:
        logits = root  # [1, V]: the prompt alone
    else:
        cache = copy.deepcopy(prompt_kv)
        cache.batch_repeat_interleave(len(generated))
        out = lm.model(input_ids=torch.tensor(generated, device=lm.device), past_key_values=cache, use_cache=True,
                       logits_to_keep=1)
        logits = out.logits[:, -1].float()  # [R, V]
    logits = logits.cpu()
    masked, _ = stage.apply(torch.tensor([ids + g for g in generated], dtype=torch.long), logits)
    return torch.log_softmax(logits.double(), dim=-1), torch.isfinite(masked)


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
