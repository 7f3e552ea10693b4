"""The stages: small named pure objects ``(input_ids, logits) -> logits``.

Where transformers has the processor, a stage wraps it (exact by construction; the oracle tests
guard the wrapping). Frequency/presence penalties and word constraints are ours. Every stage
returns a new tensor and never modifies its inputs. Shapes: input_ids [B, S], logits [B, V].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from transformers.generation import logits_process as tlp

from .config import ConfigError, DecodingConfig
from .trace import StageTrace, TokenProb


class Stage:
    """A named transformation of next-token logits."""

    name: str = "stage"

    def __init__(self, **params: Any):
        self.params = params

    def __call__(self, input_ids: torch.LongTensor, logits: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"{type(self).__name__}({args})"


def _require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(key, f"{value!r} is out of range; allowed {allowed}")


class _Wrapped(Stage):
    """A stage that delegates to one of transformers' logits processors."""

    def __init__(self, processor: Callable, **params: Any):
        super().__init__(**params)
        self._processor = processor

    def __call__(self, input_ids, logits):
        # transformers' processors are out-of-place (test_stage_never_modifies_input guards this)
        return self._processor(input_ids, logits)


class Temperature(_Wrapped):
    name = "temperature"

    def __init__(self, temperature: float):
        _require(temperature > 0, "temperature", temperature, "(0, inf) for a stage; 0 means greedy")
        super().__init__(tlp.TemperatureLogitsWarper(temperature), temperature=temperature)


class TopK(_Wrapped):
    name = "top_k"

    def __init__(self, top_k: int):
        _require(isinstance(top_k, int) and top_k > 0, "top_k", top_k, "integers >= 1")
        super().__init__(tlp.TopKLogitsWarper(top_k=top_k), top_k=top_k)


class TopP(_Wrapped):
    name = "top_p"

    def __init__(self, top_p: float):
        _require(0 < top_p <= 1, "top_p", top_p, "(0, 1]")
        super().__init__(tlp.TopPLogitsWarper(top_p=top_p), top_p=top_p)


class MinP(_Wrapped):
    name = "min_p"

    def __init__(self, min_p: float):
        _require(0 <= min_p <= 1, "min_p", min_p, "[0, 1]")
        super().__init__(tlp.MinPLogitsWarper(min_p=min_p), min_p=min_p)


class TypicalP(_Wrapped):
    name = "typical_p"

    def __init__(self, typical_p: float):
        _require(0 < typical_p < 1, "typical_p", typical_p, "(0, 1)")
        super().__init__(tlp.TypicalLogitsWarper(mass=typical_p), typical_p=typical_p)


class Epsilon(_Wrapped):
    name = "epsilon"

    def __init__(self, epsilon_cutoff: float):
        _require(0 < epsilon_cutoff < 1, "epsilon_cutoff", epsilon_cutoff, "(0, 1)")
        super().__init__(tlp.EpsilonLogitsWarper(epsilon=epsilon_cutoff), epsilon_cutoff=epsilon_cutoff)


class RepetitionPenalty(_Wrapped):
    """CTRL rule over prompt and generated tokens, as transformers: positive logits of seen tokens
    are divided by the penalty, negative ones multiplied."""

    name = "repetition_penalty"

    def __init__(self, repetition_penalty: float):
        _require(repetition_penalty > 0, "repetition_penalty", repetition_penalty, "(0, inf)")
        super().__init__(tlp.RepetitionPenaltyLogitsProcessor(penalty=repetition_penalty), repetition_penalty=repetition_penalty)


class NoRepeatNGram(_Wrapped):
    name = "no_repeat_ngram"

    def __init__(self, no_repeat_ngram_size: int):
        _require(isinstance(no_repeat_ngram_size, int) and no_repeat_ngram_size > 0, "no_repeat_ngram_size", no_repeat_ngram_size, "integers >= 1")
        super().__init__(tlp.NoRepeatNGramLogitsProcessor(no_repeat_ngram_size), no_repeat_ngram_size=no_repeat_ngram_size)


def _generated_counts(input_ids: torch.LongTensor, prompt_length: int, vocab_size: int) -> torch.Tensor:
    """[B, V] how often each token occurs among the generated (non-prompt) tokens."""
    generated = input_ids[:, prompt_length:]
    counts = torch.zeros(input_ids.shape[0], vocab_size, dtype=torch.float32, device=input_ids.device)
    if generated.shape[1] == 0:
        return counts
    return counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=torch.float32))


class FrequencyPenalty(Stage):
    """OpenAI's rule: logit -= penalty x count(token) over the generated tokens (not the prompt)."""

    name = "frequency_penalty"

    def __init__(self, frequency_penalty: float, prompt_length: int = 0):
        _require(-2 <= frequency_penalty <= 2, "frequency_penalty", frequency_penalty, "[-2, 2]")
        super().__init__(frequency_penalty=frequency_penalty)
        self.prompt_length = prompt_length

    def __call__(self, input_ids, logits):
        counts = _generated_counts(input_ids, self.prompt_length, logits.shape[-1])
        return logits - self.params["frequency_penalty"] * counts.to(logits.dtype)


class PresencePenalty(Stage):
    """OpenAI's rule: logit -= penalty once for every token present among the generated tokens."""

    name = "presence_penalty"

    def __init__(self, presence_penalty: float, prompt_length: int = 0):
        _require(-2 <= presence_penalty <= 2, "presence_penalty", presence_penalty, "[-2, 2]")
        super().__init__(presence_penalty=presence_penalty)
        self.prompt_length = prompt_length

    def __call__(self, input_ids, logits):
        present = _generated_counts(input_ids, self.prompt_length, logits.shape[-1]) > 0
        return logits - self.params["presence_penalty"] * present.to(logits.dtype)


class Constraints(Stage):
    """Allowed and banned token sets: disallowed tokens get -inf (later stages renormalise).

    ``allowed_ids`` empty means no allow-list. ``banned_sequences`` are token sequences: the last
    token of a sequence is banned when the tokens before it were just generated (transformers'
    bad-words rule), so multi-token words are banned without banning their common prefixes."""

    name = "constraints"

    def __init__(self, allowed_ids: Sequence[int] = (), banned_sequences: Sequence[Sequence[int]] = (),
                 allowed_words: Sequence[str] = (), banned_words: Sequence[str] = ()):
        super().__init__(allowed_words=list(allowed_words), banned_words=list(banned_words))
        self.allowed_ids = sorted(set(int(i) for i in allowed_ids))
        self.banned_sequences = [list(map(int, s)) for s in banned_sequences if len(s) > 0]

    def __call__(self, input_ids, logits):
        out = logits.clone()
        if self.allowed_ids:
            mask = torch.ones_like(out, dtype=torch.bool)
            mask[:, self.allowed_ids] = False
            out = out.masked_fill(mask, float("-inf"))
        for seq in self.banned_sequences:
            *prefix, last = seq
            if prefix:
                if input_ids.shape[1] < len(prefix):
                    continue
                tail = input_ids[:, -len(prefix):]
                hit = (tail == torch.tensor(prefix, device=tail.device)).all(dim=1)
                out[hit, last] = float("-inf")
            else:
                out[:, last] = float("-inf")
        return out


def word_token_variants(tokenizer: Any, word: str) -> list[list[int]]:
    """The token sequences a word can appear as: with and without a leading space."""
    variants = []
    for text in (word, " " + word):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if ids and ids not in variants:
            variants.append(ids)
    return variants


def build_constraints(config: DecodingConfig, tokenizer: Any, eos_token_ids: Sequence[int]) -> Constraints:
    allowed: set[int] = set()
    for word in config.allowed_words:
        for ids in word_token_variants(tokenizer, word):
            allowed.update(ids)
    if allowed:
        allowed.update(eos_token_ids)
    banned = [ids for word in config.banned_words for ids in word_token_variants(tokenizer, word)]
    return Constraints(sorted(allowed), banned, config.allowed_words, config.banned_words)


def build_stage(name: str, config: DecodingConfig, prompt_length: int = 0, tokenizer: Any = None,
                eos_token_ids: Sequence[int] = ()) -> Stage:
    """One stage from the config's knob(s)."""
    if name == "temperature":
        return Temperature(config.temperature)
    if name == "top_k":
        return TopK(config.top_k)
    if name == "top_p":
        return TopP(config.top_p)
    if name == "min_p":
        return MinP(config.min_p)
    if name == "typical_p":
        return TypicalP(config.typical_p)
    if name == "epsilon":
        return Epsilon(config.epsilon_cutoff)
    if name == "repetition_penalty":
        return RepetitionPenalty(config.repetition_penalty)
    if name == "frequency_penalty":
        return FrequencyPenalty(config.frequency_penalty, prompt_length)
    if name == "presence_penalty":
        return PresencePenalty(config.presence_penalty, prompt_length)
    if name == "no_repeat_ngram":
        return NoRepeatNGram(config.no_repeat_ngram_size)
    if name == "constraints":
        if tokenizer is None:
            raise ConfigError("allowed_words", "word constraints need a tokenizer")
        return build_constraints(config, tokenizer, eos_token_ids)
    raise ConfigError("stage_order", f"unknown stage {name!r}")


@dataclass
class Chain:
    """An ordered list of stages; the order is data the user chose."""

    stages: list[Stage] = field(default_factory=list)

    @classmethod
    def from_config(cls, config: DecodingConfig, prompt_length: int = 0, tokenizer: Any = None,
                    eos_token_ids: Sequence[int] = ()) -> "Chain":
        return cls([build_stage(n, config, prompt_length, tokenizer, eos_token_ids) for n in config.active_stages()])

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.stages]

    def __call__(self, input_ids: torch.LongTensor, logits: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            logits = stage(input_ids, logits)
        return logits

    def traced(self, input_ids: torch.LongTensor, logits: torch.Tensor, top_n: int,
               token_text: Callable[[int], str]) -> "Traced":
        """Apply the chain to one row (B = 1) and record raw, every stage, and final.
        Cost: one softmax and one top-k per stage, no Python loop over the vocabulary."""
        logits = logits.float()
        recorder = _Recorder(top_n, token_text)
        traces = [recorder.record("raw", logits, {})]
        raw_probs = recorder.prev_probs
        for stage in self.stages:
            logits = stage(input_ids, logits)
            traces.append(recorder.record(stage.name, logits, stage.params))
        traces.append(recorder.copy_as("final", traces[-1]))
        return Traced(logits, traces, raw_probs, recorder.prev_probs)


@dataclass
class Traced:
    """What ``Chain.traced`` returns: the final logits [1, V], the stage records, and the raw and
    final probabilities [V] (so the caller needs no further softmax)."""

    logits: torch.Tensor
    stages: list[StageTrace]
    raw_probs: torch.Tensor
    final_probs: torch.Tensor

    def __iter__(self):
        """Unpacks as ``final_logits, stages``."""
        return iter((self.logits, self.stages))


class _Recorder:
    """Statistics of consecutive distributions; keeps the previous softmax so each stage costs one."""

    def __init__(self, top_n: int, token_text: Callable[[int], str]):
        self.top_n = top_n
        self.token_text = token_text
        self.prev_probs: torch.Tensor | None = None
        self.prev_top: list[TokenProb] = []

    def _tokens(self, ids: torch.Tensor, probs: torch.Tensor) -> list[TokenProb]:
        return [TokenProb(int(i), self.token_text(int(i)), float(p)) for i, p in zip(ids.tolist(), probs.tolist())]

    def record(self, name: str, logits: torch.Tensor, params: dict) -> StageTrace:
        probs = torch.softmax(logits[0], dim=-1)  # [V]; masked tokens get exactly 0
        alive = probs > 0
        kept = int(alive.sum())
        entropy = float(torch.special.entr(probs).sum())
        top_p, top_i = torch.topk(probs, min(self.top_n, kept, probs.shape[0]))  # removed tokens are not "top"
        top = self._tokens(top_i, top_p)
        mass_removed, tv, removed = 0.0, 0.0, []
        if self.prev_probs is not None:
            mass_removed = float(self.prev_probs.masked_fill(alive, 0.0).sum())
            tv = float(0.5 * (probs - self.prev_probs).abs().sum())
            removed = [t for t in self.prev_top if not bool(alive[t.token_id])]
        self.prev_probs, self.prev_top = probs, top
        return StageTrace(name, kept, mass_removed, entropy, tv, top, removed, dict(params))

    @staticmethod
    def copy_as(name: str, last: StageTrace) -> StageTrace:
        return StageTrace(name, last.kept, 0.0, last.entropy, 0.0, list(last.top), [], {})
