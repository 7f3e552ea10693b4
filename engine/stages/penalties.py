"""Penalties: the repetition, frequency and presence penalties, the n-gram ban and DRY (they look
at the tokens already generated)."""

from __future__ import annotations

import json
import shlex
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from transformers.generation import logits_process as tlp

from engine.stages.spec import (BuildContext, ConfigError, Export, Interop, Knob, StageSpec, number, param,
                                quoted, register, truncation_note)
from engine.stages.spec import STEP_LIFT, STEP_REPETITION, Served, same_fields
from engine.stages.base import Stage, Wrapped, require

if TYPE_CHECKING:
    from engine.config import DecodingConfig
    from engine.trace import StageTrace


class RepetitionPenalty(Wrapped):
    """CTRL rule over prompt and generated tokens, as transformers: positive logits of seen tokens
    are divided by the penalty, negative ones multiplied."""

    name = "repetition_penalty"

    def __init__(self, repetition_penalty: float):
        require(repetition_penalty > 0, "repetition_penalty", repetition_penalty, "(0, inf)")
        super().__init__(tlp.RepetitionPenaltyLogitsProcessor(penalty=repetition_penalty), repetition_penalty=repetition_penalty)


# llama.cpp's one "penalties" sampler runs the three penalties, over the last --repeat-last-n tokens


def _llama_whole_context(config: DecodingConfig, view: Any) -> list[str]:
    return ["--repeat-last-n -1"]  # -1 = the whole context, as transformers' repetition penalty


_WEBUI_COUNTS_PROMPT = "text-generation-webui counts prompt tokens too; the playground counts generated tokens only"
_LLAMA_COUNTS_PROMPT = ("llama.cpp counts prompt tokens too (--repeat-last-n -1: the whole context); "
                        "the playground counts generated tokens only")

register(StageSpec(
    "repetition_penalty", order=30, group="penalties",
    knobs=(Knob("repetition_penalty", "float", 1.0, 0.01, 10.0, doc="CTRL rule: divide positive / multiply negative "
                "logits of seen tokens. 1 = neutral.", step=0.05),),
    build=lambda c, ctx: RepetitionPenalty(c.repetition_penalty),
    heading=lambda s: f"repetition penalty: seen tokens ÷ {param(s, 'repetition_penalty')}",
    interop=Interop("RepetitionPenaltyLogitsProcessor",
                    webui=Export("repetition_penalty", knobs=("repetition_penalty",),
                                 lines=lambda c, x: ["repetition_penalty_range: 0"]),  # 0 = the whole context
                    llama=Export("penalties", flag="--repeat-penalty", lines=_llama_whole_context)),
    oracle="tests/engine/test_processors.py::test_stage_equals_transformers_processor",
    served=Served(lambda c, context: {"repeat_penalty": c.repetition_penalty, "repeat_last_n": context},
                  same_fields("repetition_penalty"), step_caveats=(STEP_REPETITION, STEP_LIFT)),
))


def _generated_counts(input_ids: torch.Tensor, prompt_length: int, vocab_size: int) -> torch.Tensor:
    """[B, V] how often each token occurs among the generated (non-prompt) tokens."""
    generated = input_ids[:, prompt_length:]
    counts = torch.zeros(input_ids.shape[0], vocab_size, dtype=torch.float32, device=input_ids.device)
    if generated.shape[1] == 0:
        return counts
    return counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=torch.float32))


class GeneratedPenalty(Stage):
    """OpenAI's penalties: logit -= penalty x ``weight`` of each token's count among the generated
    tokens (not the prompt); the knob is named as the stage, in [-2, 2]."""

    def __init__(self, penalty: float, prompt_length: int = 0):
        require(-2 <= penalty <= 2, self.name, penalty, "[-2, 2]")
        super().__init__(**{self.name: penalty})
        self.prompt_length = prompt_length

    def weight(self, counts: torch.Tensor) -> torch.Tensor:
        """[B, V] what the penalty multiplies, from [B, V] counts."""
        raise NotImplementedError

    def apply(self, input_ids, logits):
        counts = _generated_counts(input_ids, self.prompt_length, logits.shape[-1])
        return logits - self.knobs[self.name] * self.weight(counts).to(logits.dtype), {}


class FrequencyPenalty(GeneratedPenalty):
    """OpenAI's rule: logit -= penalty x count(token) over the generated tokens (not the prompt)."""

    name = "frequency_penalty"

    def weight(self, counts: torch.Tensor) -> torch.Tensor:
        return counts


register(StageSpec(
    "frequency_penalty", order=40, group="penalties",
    knobs=(Knob("frequency_penalty", "float", 0.0, -2.0, 2.0, doc="OpenAI rule: subtract penalty x count of each "
                "generated token. 0 = neutral.", step=0.05),),
    build=lambda c, ctx: FrequencyPenalty(c.frequency_penalty, ctx.prompt_length),
    heading=lambda s: f"frequency penalty: −{param(s, 'frequency_penalty')} per repeat",
    interop=Interop(webui=Export("frequency_penalty", knobs=("frequency_penalty",), caveat=_WEBUI_COUNTS_PROMPT),
                    llama=Export("penalties", flag="--frequency-penalty", lines=_llama_whole_context,
                                 caveat=_LLAMA_COUNTS_PROMPT)),
    oracle="tests/engine/test_processors.py::test_frequency_and_presence_penalties_by_hand",
    served=Served(same_fields("frequency_penalty"), same_fields("frequency_penalty"), step_caveats=(STEP_LIFT,)),
))


class PresencePenalty(GeneratedPenalty):
    """OpenAI's rule: logit -= penalty once for every token present among the generated tokens."""

    name = "presence_penalty"

    def weight(self, counts: torch.Tensor) -> torch.Tensor:
        return counts > 0


register(StageSpec(
    "presence_penalty", order=50, group="penalties",
    knobs=(Knob("presence_penalty", "float", 0.0, -2.0, 2.0, doc="OpenAI rule: subtract penalty once from every "
                "generated token. 0 = neutral.", step=0.05),),
    build=lambda c, ctx: PresencePenalty(c.presence_penalty, ctx.prompt_length),
    heading=lambda s: f"presence penalty: −{param(s, 'presence_penalty')} once seen",
    interop=Interop(webui=Export("presence_penalty", knobs=("presence_penalty",), caveat=_WEBUI_COUNTS_PROMPT),
                    llama=Export("penalties", flag="--presence-penalty", lines=_llama_whole_context,
                                 caveat=_LLAMA_COUNTS_PROMPT)),
    oracle="tests/engine/test_processors.py::test_frequency_and_presence_penalties_by_hand",
    served=Served(same_fields("presence_penalty"), same_fields("presence_penalty"), step_caveats=(STEP_LIFT,)),
))


class NoRepeatNGram(Wrapped):
    name = "no_repeat_ngram"

    def __init__(self, no_repeat_ngram_size: int):
        require(isinstance(no_repeat_ngram_size, int) and no_repeat_ngram_size > 0, "no_repeat_ngram_size", no_repeat_ngram_size, "integers >= 1")
        super().__init__(tlp.NoRepeatNGramLogitsProcessor(no_repeat_ngram_size), no_repeat_ngram_size=no_repeat_ngram_size)


register(StageSpec(
    "no_repeat_ngram", order=70, group="repetition", label="no-repeat-n-gram",
    knobs=(Knob("no_repeat_ngram_size", "int", 0, 0, 10, doc="Ban any n-gram of this size from occurring twice. "
                "0 = disabled.", step=1),),
    build=lambda c, ctx: NoRepeatNGram(c.no_repeat_ngram_size),
    note=truncation_note,
    heading=lambda s: f"no repeated {param(s, 'no_repeat_ngram_size')}-grams",
    interop=Interop("NoRepeatNGramLogitsProcessor",
                    webui=Export("no_repeat_ngram", knobs=("no_repeat_ngram_size",)),
                    llama=Export(unmapped="llama.cpp has no n-gram ban (its DRY sampler penalises repeats instead of "
                                          "banning them)")),
    oracle="tests/engine/test_processors.py::test_stage_equals_transformers_processor",
))


class Dry(Stage):
    """DRY, "don't repeat yourself" (text-generation-webui's DRYLogitsProcessor, llama.cpp's dry):
    if the context ends with a phrase that occurred before, the token that followed it back then
    would extend the repeat; with n the longest such match, it loses multiplier x base^(n - allowed)
    from its logit when n >= allowed_length. A sequence-breaker token stops a match (it is never
    part of one). Matches are at most 50 tokens long, as in both references. Its diagnostics: the
    five largest penalties of row 0 (token, phrase, length, penalty)."""

    name = "dry"
    MAX_MATCH = 50

    def __init__(self, dry_multiplier: float, dry_base: float = 1.75, dry_allowed_length: int = 2,
                 dry_penalty_last_n: int = -1, breaker_ids: Sequence[int] = (), token_text: Callable | None = None):
        require(dry_multiplier > 0, "dry_multiplier", dry_multiplier, "(0, 10] for a stage")
        require(dry_base >= 1, "dry_base", dry_base, "[1, 4]")
        require(dry_allowed_length >= 1, "dry_allowed_length", dry_allowed_length, "[1, 20]")
        require(dry_penalty_last_n != 0, "dry_penalty_last_n", dry_penalty_last_n, "-1 or >= 1 for a stage")
        super().__init__(dry_multiplier=dry_multiplier, dry_base=dry_base, dry_allowed_length=dry_allowed_length,
                         dry_penalty_last_n=dry_penalty_last_n)
        self.breakers = frozenset(int(i) for i in breaker_ids)
        self.token_text = token_text

    def match_lengths(self, context: list[int]) -> dict[int, int]:
        """{next token: longest repeated suffix it would extend} for one row of token ids."""
        if not context or context[-1] in self.breakers:
            return {}
        lengths: dict[int, int] = {}
        for i in range(len(context) - 1):  # every earlier occurrence of the last token
            follower = context[i + 1]
            if context[i] != context[-1] or follower in self.breakers:
                continue
            n = 1
            while n < self.MAX_MATCH and i - n >= 0 and context[i - n] == context[-n - 1] \
                    and context[-n - 1] not in self.breakers:
                n += 1
            lengths[follower] = max(n, lengths.get(follower, 0))
        return lengths

    def apply(self, input_ids, logits):
        out = logits.clone()
        last_n = self.knobs["dry_penalty_last_n"]
        penalties = []
        for row in range(input_ids.shape[0]):
            context = input_ids[row].tolist()
            context = context[-last_n:] if last_n > 0 else context
            for token, n in self.match_lengths(context).items():
                if n >= self.knobs["dry_allowed_length"] and token < out.shape[-1]:
                    penalty = self.knobs["dry_multiplier"] * self.knobs["dry_base"] ** (n - self.knobs["dry_allowed_length"])
                    out[row, token] -= penalty
                    if row == 0:
                        penalties.append((penalty, token, n, context[-n:]))
        return out, {"penalized": [self._describe(*p) for p in sorted(penalties, reverse=True)[:5]]}

    def _describe(self, penalty: float, token: int, n: int, phrase: list[int]) -> dict:
        text = self.token_text or str
        return {"token_id": token, "token": text(token), "length": n, "penalty": penalty,
                "phrase": "".join(text(t) for t in phrase)}


def _dry_note(stage: StageTrace) -> str:
    hits = stage.params.get("penalized") or []
    if not hits:
        return "DRY: no token would extend a repeated phrase"
    top = hits[0]
    more = f" (+{len(hits) - 1} more)" if len(hits) > 1 else ""
    return (f"DRY: {quoted(top['token'])} would extend the repeated phrase {quoted(top['phrase'])} "
            f"(length {top['length']}): −{top['penalty']:.2g} logits{more}")


DRY_DEFAULT_BREAKERS = ["\n", ":", "\"", "*"]  # also text-generation-webui's and llama.cpp's default


def _dry_llama_fields(c: DecodingConfig, context: int) -> dict[str, Any]:
    """DRY's llama-server fields; its window of "the whole context" is the server's context length
    (its request refuses -1)."""
    return {"dry_multiplier": c.dry_multiplier, "dry_base": c.dry_base, "dry_allowed_length": c.dry_allowed_length,
            "dry_penalty_last_n": context if c.dry_penalty_last_n == -1 else c.dry_penalty_last_n,
            "dry_sequence_breakers": list(c.dry_sequence_breakers)}


def _build_dry(c: DecodingConfig, ctx: BuildContext) -> Dry:
    text = (lambda i: ctx.tokenizer.decode([i])) if ctx.tokenizer is not None else None
    return Dry(c.dry_multiplier, c.dry_base, c.dry_allowed_length, c.dry_penalty_last_n,
               breaker_token_ids(ctx.tokenizer, c.dry_sequence_breakers), text)


def _dry_webui_lines(c: DecodingConfig, view: Any) -> list[str]:
    if list(c.dry_sequence_breakers) == DRY_DEFAULT_BREAKERS:
        return []
    # user text: JSON (ASCII, escaped) inside a single-quoted YAML scalar, so it stays one value
    text = json.dumps(list(c.dry_sequence_breakers), ensure_ascii=True).replace("'", "''")
    return [f"dry_sequence_breakers: '{text}'"]


def _dry_llama_flags(c: DecodingConfig, view: Any) -> list[str]:
    flags = [f"--dry-multiplier {number(c.dry_multiplier)}", f"--dry-base {number(c.dry_base)}",
             f"--dry-allowed-length {c.dry_allowed_length}", f"--dry-penalty-last-n {c.dry_penalty_last_n}"]
    breakers = list(c.dry_sequence_breakers)
    if breakers != DRY_DEFAULT_BREAKERS:
        flags += [f"--dry-sequence-breaker {shlex.quote(b)}" for b in breakers] or ["--dry-sequence-breaker none"]
    return flags


def _dry_webui_unmapped(c: DecodingConfig, view: Any) -> list[tuple[str, str]]:
    if c.dry_penalty_last_n == -1:
        return []
    return [("dry_penalty_last_n", "text-generation-webui scans repetition_penalty_range tokens for DRY (shared with "
                                   "the repetition penalty); it has no DRY-only range")]


register(StageSpec(
    "dry", order=60, group="repetition", label="DRY",
    knobs=(Knob("dry_multiplier", "float", 0.0, 0.0, 10.0, doc="DRY: penalty multiplier for tokens that extend a "
                "repeated phrase. 0 = disabled.", step=0.05),
           Knob("dry_base", "float", 1.75, 1.0, 4.0, doc="DRY: the penalty grows as base^(length - allowed_length).",
                step=0.05),
           Knob("dry_allowed_length", "int", 2, 1, 20, doc="DRY: repeats up to this length are not penalised.", step=1),
           Knob("dry_penalty_last_n", "int", -1, -1, 131_072, doc="DRY: tokens of context scanned for repeats. "
                "-1 = all, 0 = disabled.", step=1, widget="number"),
           Knob("dry_sequence_breakers", "str_list", list(DRY_DEFAULT_BREAKERS), 0, 16,
                doc="DRY: strings whose tokens stop a repeat match.", widget="json")),
    active=lambda c: c.dry_multiplier > 0 and c.dry_penalty_last_n != 0,
    build=_build_dry,
    note=_dry_note,
    heading=lambda s: (f"DRY: repeats over {param(s, 'dry_allowed_length')} tokens cost "
                       f"{param(s, 'dry_multiplier')}·{param(s, 'dry_base')}^n"),
    interop=Interop(webui=Export("dry", knobs=("dry_multiplier", "dry_base", "dry_allowed_length"),
                                 lines=_dry_webui_lines, unmapped=_dry_webui_unmapped),
                    llama=Export("dry", lines=_dry_llama_flags), export_all_knobs=True),
    oracle="tests/engine/test_samplers.py::test_dry_by_hand "
           "tests/engine/test_samplers.py::test_dry_equals_brute_force_on_random_contexts",
    served=Served(_dry_llama_fields, step_caveats=(STEP_LIFT,)),
))


def breaker_token_ids(tokenizer: Any, breakers: Sequence[str]) -> list[int]:
    """DRY's sequence breakers as token ids, as text-generation-webui: the last token of
    ``"a" + breaker`` (the prefix makes the breaker tokenise as it does mid-text)."""
    if breakers and tokenizer is None:
        raise ConfigError("dry_sequence_breakers", "strings need the model's tokenizer; use [] without one")
    return sorted({tokenizer.encode("a" + s, add_special_tokens=False)[-1] for s in breakers})
