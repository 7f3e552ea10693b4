"""Constraints: word allow/ban lists, logit bias and the minimum length (EOS masked)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch
from transformers.generation import logits_process as tlp

from engine.stages.spec import (BuildContext, ConfigError, Export, Interop, Knob, StageSpec, number, param,
                                register, truncation_note)
from engine.stages.spec import STEP_LIFT, Served
from engine.numbers import percent
from engine.stages.base import Stage, Wrapped, require

if TYPE_CHECKING:
    from engine.config import DecodingConfig
    from engine.trace import StageTrace


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

    def apply(self, input_ids, logits):
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
        return out, {}


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


def _constraints_heading(stage: StageTrace) -> str:
    allowed, banned = stage.params.get("allowed_words") or [], stage.params.get("banned_words") or []
    parts = ([f"only {len(allowed)} word" + ("" if len(allowed) == 1 else "s")] if allowed else []) + \
            ([f"ban {len(banned)} word" + ("" if len(banned) == 1 else "s")] if banned else [])
    return "constraints: " + (", ".join(parts) or "none")


def _build_constraints(config: DecodingConfig, ctx: BuildContext) -> Constraints:
    if ctx.tokenizer is None:
        raise ConfigError("allowed_words", "word constraints need a tokenizer")
    return build_constraints(config, ctx.tokenizer, ctx.eos_token_ids)


register(StageSpec(
    "constraints", order=10, label="word constraints",
    knobs=(Knob("allowed_words", "str_list", [], 0, 64, doc="Only tokens of these words (and EOS) may be generated. "
                "Empty = no constraint."),
           Knob("banned_words", "str_list", [], 0, 64, doc="Tokens of these words can never be generated. "
                "Empty = none banned.")),
    active=lambda c: bool(c.allowed_words or c.banned_words),
    build=_build_constraints,
    note=truncation_note,
    heading=_constraints_heading,
    interop=Interop(webui=Export(unmapped="text-generation-webui bans tokens by id, not by word; there is no word "
                                          "list to carry over"),
                    llama=Export(unmapped="llama.cpp bans tokens by id, not by word; there is no word list to "
                                          "carry over")),
    oracle="tests/engine/test_processors.py::test_constraints_mask_allowed_and_banned_sequences",
))


class LogitBias(Wrapped):
    """Add a bias to token sequences: transformers' SequenceBiasLogitsProcessor. A single token gets
    its bias at every step; the last token of a longer sequence (a multi-token word) gets it right
    after the tokens before it were generated, as ``banned_words`` bans them."""

    name = "logit_bias"

    def __init__(self, sequence_bias: dict[tuple[int, ...], float], logit_bias: dict[str, float] | None = None):
        require(bool(sequence_bias), "logit_bias", logit_bias, "a non-empty object for a stage")
        # transformers' list form ([ids, bias] each), which it reads into the same {ids: bias} in the same order
        super().__init__(tlp.SequenceBiasLogitsProcessor([[list(k), float(v)] for k, v in sequence_bias.items()]),
                         logit_bias=dict(logit_bias or {}))
        self.largest_id = max(max(seq) for seq in sequence_bias)

    def apply(self, input_ids, logits):
        if self.largest_id >= logits.shape[-1]:
            raise ConfigError("logit_bias", f"token id {self.largest_id} is outside the vocabulary "
                                            f"({logits.shape[-1]} tokens)")
        return super().apply(input_ids, logits)


def llama_bias_pairs(bias: dict[str, float]) -> list[list[Any]]:
    """Our ``{token id or word: bias}`` as llama-server's ``[[id or text, bias]]``; a word as itself
    and with a leading space, as our stage biases it (the server tokenises the text)."""
    pairs: list[list[Any]] = []
    for key, value in bias.items():
        pairs += [[int(key), value]] if key.isdigit() else [[key, value], [" " + key, value]]
    return pairs


def build_logit_bias(config: DecodingConfig, tokenizer: Any) -> LogitBias:
    """Token-id keys bias that token; word keys bias every tokenisation of the word (with and
    without a leading space). Biases landing on the same sequence add up."""
    sequences: dict[tuple[int, ...], float] = {}
    for key, bias in config.logit_bias.items():
        if key.isdigit():
            variants = [[int(key)]]
        elif tokenizer is None:
            raise ConfigError("logit_bias", f"word {key!r} needs the model's tokenizer; use token ids without one")
        else:
            variants = word_token_variants(tokenizer, key)
        for ids in variants:
            sequences[tuple(ids)] = sequences.get(tuple(ids), 0.0) + bias
    return LogitBias(sequences, config.logit_bias)


def _logit_bias_heading(stage: StageTrace) -> str:
    n = len(stage.params.get("logit_bias") or {})
    return f"logit bias on {n} word" + ("" if n == 1 else "s")


def _logit_bias_llama_words(c: DecodingConfig, view: Any) -> list[tuple[str, str]]:
    if all(k.isdigit() for k in c.logit_bias):
        return []
    return [("logit_bias", "llama.cpp biases token ids only; the words were left out")]


register(StageSpec(
    "logit_bias", order=20, group="penalties", label="logit bias",
    knobs=(Knob("logit_bias", "bias_map", {}, -100.0, 100.0, doc="Add a bias to tokens: {token id or word: bias}. "
                "Words are biased with and without a leading space."),),
    build=lambda c, ctx: build_logit_bias(c, ctx.tokenizer),
    heading=_logit_bias_heading,
    interop=Interop("SequenceBiasLogitsProcessor",
                    webui=Export(unmapped="not part of a text-generation-webui preset; send it in the API request's "
                                          "logit_bias field (token ids)"),
                    llama=Export(unmapped=_logit_bias_llama_words, lines=lambda c, x: [
                        f"--logit-bias {k}{'+' if b >= 0 else '-'}{number(abs(b))}"
                        for k, b in c.logit_bias.items() if k.isdigit()]),
                    export_all_knobs=True),
    oracle="tests/engine/test_samplers.py::test_wrapped_stage_equals_transformers "
           "tests/engine/test_samplers.py::test_logit_bias_ids_and_words",
    served=Served(lambda c, context: {"logit_bias": llama_bias_pairs(c.logit_bias)}, step_caveats=(STEP_LIFT,)),
))


class MinNewTokens(Wrapped):
    """EOS masked until ``min_new_tokens`` tokens were generated: transformers'
    MinNewTokensLengthLogitsProcessor."""

    name = "min_new_tokens"

    def __init__(self, min_new_tokens: int, prompt_length: int = 0, eos_token_ids: Sequence[int] = ()):
        require(isinstance(min_new_tokens, int) and min_new_tokens > 0, "min_new_tokens", min_new_tokens, "[1, 1024]")
        processor = tlp.MinNewTokensLengthLogitsProcessor(prompt_length, min_new_tokens, list(eos_token_ids))
        super().__init__(processor, min_new_tokens=min_new_tokens)


def _min_new_tokens_note(stage: StageTrace) -> str:
    n = stage.params.get("min_new_tokens")
    if stage.mass_removed > 0:
        return f"min new tokens {n}: EOS masked ({percent(stage.mass_removed)} of the mass)"
    return f"min new tokens {n}: nothing masked"


register(StageSpec(
    "min_new_tokens", order=80, group="penalties", label="min new tokens",
    knobs=(Knob("min_new_tokens", "int", 0, 0, 1024, doc="EOS is masked until this many tokens were generated. "
                "0 = disabled.", step=1),),
    build=lambda c, ctx: MinNewTokens(c.min_new_tokens, ctx.prompt_length, ctx.eos_token_ids),
    note=_min_new_tokens_note,
    heading=lambda s: f"min new tokens: no end before {param(s, 'min_new_tokens')}",
    interop=Interop("MinNewTokensLengthLogitsProcessor",
                    webui=Export(unmapped="not part of a text-generation-webui preset"),
                    llama=Export(unmapped="llama.cpp has no minimum-length setting"), export_all_knobs=True),
    oracle="tests/engine/test_samplers.py::test_wrapped_stage_equals_transformers "
           "tests/engine/test_samplers.py::test_min_new_tokens_by_hand",
))
