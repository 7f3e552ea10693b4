"""The stages: small named pure objects ``(input_ids, logits) -> logits``, each with its spec.

A stage lives in this one file: its ``Stage`` class, and right under it ``register(StageSpec(...))``
(``engine/stages.py``): its knobs, its place in the default order, sampling-only or not, when it
is active, how the config builds it, whether rows may share one call, the words of its note in the
step chart, and its names in transformers / text-generation-webui / llama.cpp. Everything else
(``config``'s knobs and stage order, ``build_stage``, ``interop``, the stage notes, the knob panel)
reads ``stages.STAGES``. The README's "Add a stage" walks through one.

Where transformers has the processor, a stage wraps it (exact by construction; the oracle tests
guard the wrapping; top-p skips the processor's full sort where the answer is certain without it,
and returns the same tensor bit for bit). Frequency/presence penalties and word constraints are
ours, and so are the samplers of llama.cpp / text-generation-webui that transformers lacks (DRY,
XTC, top-nσ, dynamic temperature, smoothing, mirostat, top-a), each following its reference
definition. Every stage returns a new tensor and never modifies its inputs. Shapes: input_ids
[B, S], logits [B, V].

A stage's ``apply`` returns the new logits and the call's diagnostics as values (the chain records
``knobs | diagnostics``); no stage rewrites its knobs. Two stages carry state across steps:
mirostat (μ, updated by ``accept`` after each pick) and XTC (it draws from the run's generator).
Their state follows llama.cpp's sampler API: ``accept`` / ``reset`` / ``clone``, plus ``state()``
after a call (what that call depended on beyond its knobs, ids and logits: JSON-ready, recorded in
the step's StageTrace.state) and ``load_state``, which puts it into a fresh stage so re-processing a
step (what-if) gives exactly the run's output at that step without replaying. A run that uses them
calls ``chain.Chain.observe`` after every pick and builds the chain with the run's generator;
``Chain.stateful`` says whether it must.

This module imports no ``config`` (``config`` imports it, to read the stages): the config type
below is an annotation only.
"""

from __future__ import annotations

import copy
import json
import math
import shlex
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from transformers.generation import logits_process as tlp

from .numbers import decimal, percent
from .stages import (STAGES, BuildContext, ConfigError, Export, Interop, Knob, StageSpec, number, param, quoted,
                     register, title_number, token_names, truncation_note)

if TYPE_CHECKING:
    from .config import DecodingConfig
    from .trace import StageTrace


class Stage:
    """A named transformation of next-token logits.

    ``apply(input_ids, logits)`` is the stage: it returns the new logits and what the call found
    out (its diagnostics, for row 0: DRY's penalised tokens, XTC's draw, mirostat's μ and kept
    count, ...; {} for most stages), as values: the chain records ``knobs | diagnostics``. A stage
    implements ``apply``; ``run`` is ``apply`` remembering the diagnostics, and calling the stage
    returns the logits alone. ``knobs`` are what it was built with; ``params`` (read-only) is
    ``knobs`` plus the last call's diagnostics, for a caller that holds the stage.

    Stateful stages (``stateful``: state across steps, or draws) follow llama.cpp's sampler API:
    ``accept(input_ids, token_id)`` after every pick (what it learnt, as values), ``reset()`` back to
    a fresh stage, ``clone()`` an independent copy in the same state, and ``state()`` /
    ``load_state(state)``: what the last call depended on besides its knobs, ids and logits, and
    putting it into a stage so its next call behaves as that one (what-if, without replaying)."""

    name: str = "stage"
    stateful: bool = False  # True: keeps state across steps or draws random numbers
    carries: bool = False  # True: state carried across steps (not only a draw): resuming needs its record

    def __init__(self, **knobs: Any):
        self.knobs = knobs
        self._last: dict[str, Any] = {}  # the last call's (and pick's) diagnostics, for ``params``

    def apply(self, input_ids: torch.LongTensor, logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        """The new logits [B, V] and this call's diagnostics (JSON-ready)."""
        raise NotImplementedError

    def run(self, input_ids: torch.LongTensor, logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        """``apply``, remembering the diagnostics for ``params`` (the chain calls this)."""
        out, self._last = self.apply(input_ids, logits)
        return out, self._last

    def __call__(self, input_ids: torch.LongTensor, logits: torch.Tensor) -> torch.Tensor:
        return self.run(input_ids, logits)[0]

    @property
    def params(self) -> dict[str, Any]:
        """The knobs and the last call's diagnostics (a new dict: writing to it changes nothing)."""
        return {**self.knobs, **self._last}

    def accept(self, input_ids: torch.LongTensor, token_id: int) -> dict[str, Any]:
        """Called after every pick with the ids before it [1, S] and the token picked; returns what
        the stage learnt from it (mirostat: μ after, the surprise), {} for most."""
        return {}

    def reset(self) -> None:
        """Back to the state of a freshly built stage."""
        self._last = {}

    def clone(self) -> "Stage":
        """An independent copy in the same state (the run's generator, if any, is shared)."""
        twin = copy.copy(self)
        twin._last = dict(self._last)
        return twin

    def state(self) -> dict[str, Any]:
        """What the last call depended on besides the knobs, ids and logits (JSON-ready); {} for a
        stateless stage."""
        return {}

    def skip(self) -> None:
        """Consume what one call draws from the run's generator, computing nothing (a branch brings
        the generator to its step this way instead of replaying the steps before it)."""

    def resume(self, state: dict[str, Any]) -> None:
        """Carry into this stage what it had carried to the step that recorded ``state`` (its
        ``state()`` there), so a branch from that step goes on as the run did without replaying the
        steps before it: mirostat's μ. Stages whose state is a draw (XTC) take nothing: ``skip``
        already brought the generator to the same draw."""

    def load_state(self, state: dict[str, Any]) -> None:
        """Make the next call behave as the call that reported ``state`` (see ``state``)."""

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.knobs.items())
        return f"{type(self).__name__}({args})"


def _require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(key, f"{value!r} is out of range; allowed {allowed}")


class _Wrapped(Stage):
    """A stage that delegates to one of transformers' logits processors."""

    def __init__(self, processor: Callable, **knobs: Any):
        super().__init__(**knobs)
        self._processor = processor

    def apply(self, input_ids, logits):
        # transformers' processors are out-of-place (test_stage_never_modifies_input guards this)
        return self._processor(input_ids, logits), {}


class Temperature(_Wrapped):
    name = "temperature"

    def __init__(self, temperature: float):
        _require(temperature > 0, "temperature", temperature, "(0, inf) for a stage; 0 means greedy")
        super().__init__(tlp.TemperatureLogitsWarper(temperature), temperature=temperature)


def _temperature_note(stage: StageTrace) -> str:
    t = stage.params.get("temperature", 1.0)
    effect = "sharper" if t < 1 else "flatter" if t > 1 else "unchanged"
    return f"temperature {t:g}: logits ÷ {t:g}, {effect} (entropy {stage.entropy:.2f} nats)"


register(StageSpec(
    "temperature", order=90, sampling_only=True, shareable=True, group="temperature",
    knobs=(Knob("temperature", "float", 1.0, 0.0, 5.0, floor=0.01, doc="Divide logits by T. 1 = neutral, 0 = greedy.",
                step=0.05),),
    # dynamic temperature *replaces* plain temperature (llama.cpp's temp-ext), which steps aside then
    active=lambda c: c.temperature != 1.0 and c.dynatemp_range == 0.0,
    build=lambda c, ctx: Temperature(c.temperature),
    note=_temperature_note,
    heading=lambda s: f"temperature: logits ÷ {param(s, 'temperature')}",
    interop=Interop("TemperatureLogitsWarper", webui=Export("temperature", knobs=("temperature",)),
                    llama=Export("temperature", flag="--temp")),
    oracle="tests/test_processors.py::test_stage_equals_transformers_processor",
))


class TopK(_Wrapped):
    name = "top_k"

    def __init__(self, top_k: int):
        _require(isinstance(top_k, int) and top_k > 0, "top_k", top_k, "integers >= 1")
        super().__init__(tlp.TopKLogitsWarper(top_k=top_k), top_k=top_k)


register(StageSpec(
    "top_k", order=130, sampling_only=True, shareable=True, group="truncation", label="top-k",
    knobs=(Knob("top_k", "int", 0, 0, 100_000, doc="Keep the k most probable tokens. 0 = disabled.", step=1,
                widget="number"),),
    build=lambda c, ctx: TopK(c.top_k),
    note=truncation_note,
    heading=lambda s: f"top-k: keep the top {param(s, 'top_k')}",
    interop=Interop("TopKLogitsWarper", webui=Export("top_k", knobs=("top_k",)), llama=Export("top_k", flag="--top-k")),
    oracle="tests/test_processors.py::test_stage_equals_transformers_processor",
))


class TopP(_Wrapped):
    """transformers' ``TopPLogitsWarper``, without its full sort of the vocabulary where the answer
    is certain from the top candidates (``top_p_fast``): the same tensor, bit for bit."""

    name = "top_p"

    def __init__(self, top_p: float):
        _require(0 < top_p <= 1, "top_p", top_p, "(0, 1]")
        super().__init__(tlp.TopPLogitsWarper(top_p=top_p), top_p=top_p)

    def apply(self, input_ids, logits):
        return top_p_fast(input_ids, logits, self.knobs["top_p"], self._processor), {}


register(StageSpec(
    "top_p", order=140, sampling_only=True, shareable=True, group="truncation", label="top-p",
    knobs=(Knob("top_p", "float", 1.0, 0.0, 1.0, low_open=True, doc="Keep the smallest set whose mass reaches p. "
                "1 = disabled.", step=0.01),),
    build=lambda c, ctx: TopP(c.top_p),
    note=truncation_note,
    heading=lambda s: f"top-p: keep the top {param(s, 'top_p')} of the mass",
    interop=Interop("TopPLogitsWarper", webui=Export("top_p", knobs=("top_p",)), llama=Export("top_p", flag="--top-p")),
    oracle="tests/test_processors.py::test_stage_equals_transformers_processor "
           "tests/test_processors.py::test_top_p_fast_path_equals_transformers_bit_for_bit",
))


TOP_P_FLOOR = 1e-6  # the fast path sorts only the tokens at least this likely


def top_p_fast(input_ids: torch.LongTensor, logits: torch.Tensor, top_p: float, oracle: Callable,
               floor: float = TOP_P_FLOOR) -> torch.Tensor:
    """``oracle(input_ids, logits)`` (transformers' top-p: sort the whole row ascending, remove the
    tokens whose float32 cumulative probability is <= 1 - top_p, keep at least one) computed by
    sorting only the row's tokens of probability >= ``floor`` where that gives the same answer
    (on the embedded model a row has a few to a few hundred such tokens: 3x faster on 4 rows).

    A token is kept iff the probability of the tokens above it is < top_p. In float64 over the
    candidates that boundary is exact, and every token below ``floor`` is below the first removed
    token, so removed too (when every candidate is kept, the first token below the floor has all
    of their mass above it). transformers' float32 cumsum over V sorted values can be off by at
    most about V * 2^-24 * (its running sum there) (first-order bound of a sum in any order; the
    softmax's normaliser, a sum too, scales every probability by at most as much). A row takes
    this path only when both tokens beside the boundary are further than twice that bound from
    top_p and are not tied (a tie's order is the sort's choice); other rows (NaN, +inf, all -inf,
    top_p near 1) go to ``oracle``, and so does everything off the CPU. Shapes: logits [B, V] ->
    [B, V], a new tensor."""
    vocab = logits.shape[-1]
    if top_p >= 0.999 or logits.dtype != torch.float32 or logits.device.type != "cpu":
        return oracle(input_ids, logits)  # a GPU sorts [B, V] in well under a millisecond; row loops sync
    probs = torch.softmax(logits.double(), dim=-1)  # [B, V]
    out = torch.full_like(logits, -float("inf"))
    slow: list[int] = []
    bad = (torch.isnan(logits) | (logits == float("inf"))).any(dim=-1).tolist()
    for b in range(logits.shape[0]):
        index = (probs[b] >= floor).nonzero().squeeze(1) if not bad[b] else None
        if index is None or len(index) == 0 or len(index) > vocab // 2:  # a flat row: sorting it all is as cheap
            slow.append(b)
            continue
        top, order = torch.sort(probs[b, index], descending=True)
        above = top.cumsum(dim=0) - top  # mass strictly above each candidate
        n_keep = int((above < top_p).sum())
        kept = index[order[:n_keep]]
        above_last = float(above[n_keep - 1])
        if n_keep < len(index):  # the first removed token is a candidate
            above_out = float(above[n_keep])
            tied = bool(logits[b, kept[-1]] == logits[b, index[order[n_keep]]])
        else:  # every candidate kept: the first token below the floor has all their mass above it
            above_out, tied = float(top.sum()), False  # (strictly less likely, so never tied)
        bound = 2 * (vocab * 2.0 ** -24 * (1 - above_last) + 1e-6)  # |float32 cumsum - exact|, doubled
        if top_p - above_last <= bound or above_out - top_p <= bound or tied:
            slow.append(b)
            continue
        out[b, kept] = logits[b, kept]
    if slow:
        rows = torch.tensor(slow, device=logits.device)
        out[rows] = oracle(input_ids, logits[rows])  # top-p ignores the ids
    return out


class MinP(_Wrapped):
    name = "min_p"

    def __init__(self, min_p: float):
        _require(0 <= min_p <= 1, "min_p", min_p, "[0, 1]")
        super().__init__(tlp.MinPLogitsWarper(min_p=min_p), min_p=min_p)


register(StageSpec(
    "min_p", order=150, sampling_only=True, shareable=True, group="truncation", label="min-p",
    knobs=(Knob("min_p", "float", 0.0, 0.0, 1.0, doc="Drop tokens below min_p x the top probability. 0 = disabled.",
                step=0.01),),
    build=lambda c, ctx: MinP(c.min_p),
    note=truncation_note,
    heading=lambda s: f"min-p: drop p below {param(s, 'min_p')} × the top p",
    interop=Interop("MinPLogitsWarper", webui=Export("min_p", knobs=("min_p",)), llama=Export("min_p", flag="--min-p")),
    oracle="tests/test_processors.py::test_stage_equals_transformers_processor",
))


class TypicalP(_Wrapped):
    name = "typical_p"

    def __init__(self, typical_p: float):
        _require(0 < typical_p < 1, "typical_p", typical_p, "(0, 1)")
        super().__init__(tlp.TypicalLogitsWarper(mass=typical_p), typical_p=typical_p)


register(StageSpec(
    "typical_p", order=160, sampling_only=True, shareable=True, group="truncation", label="typical-p",
    knobs=(Knob("typical_p", "float", 1.0, 0.0, 1.0, low_open=True, doc="Locally typical sampling mass. 1 = disabled.",
                step=0.01),),
    build=lambda c, ctx: TypicalP(c.typical_p),
    note=truncation_note,
    heading=lambda s: f"typical-p: keep {param(s, 'typical_p')} of the mass nearest typical",
    interop=Interop("TypicalLogitsWarper", webui=Export("typical_p", knobs=("typical_p",)),
                    llama=Export("typ_p", flag="--typical")),
    oracle="tests/test_processors.py::test_stage_equals_transformers_processor",
))


class Epsilon(_Wrapped):
    name = "epsilon"

    def __init__(self, epsilon_cutoff: float):
        _require(0 < epsilon_cutoff < 1, "epsilon_cutoff", epsilon_cutoff, "(0, 1)")
        super().__init__(tlp.EpsilonLogitsWarper(epsilon=epsilon_cutoff), epsilon_cutoff=epsilon_cutoff)


register(StageSpec(
    "epsilon", order=170, sampling_only=True, shareable=True, group="truncation", label="ε cutoff",
    knobs=(Knob("epsilon_cutoff", "float", 0.0, 0.0, 0.999, doc="Drop tokens with probability below epsilon. "
                "0 = disabled.", step=0.0001),),
    build=lambda c, ctx: Epsilon(c.epsilon_cutoff),
    note=truncation_note,
    heading=lambda s: f"ε-cutoff: drop p below {param(s, 'epsilon_cutoff')}",
    interop=Interop("EpsilonLogitsWarper", webui=Export("epsilon_cutoff", knobs=("epsilon_cutoff",), scale=10_000),
                    llama=Export(unmapped="llama.cpp has no absolute probability cutoff; --min-p is the nearest "
                                          "(relative) one")),
    oracle="tests/test_processors.py::test_stage_equals_transformers_processor",
))


class RepetitionPenalty(_Wrapped):
    """CTRL rule over prompt and generated tokens, as transformers: positive logits of seen tokens
    are divided by the penalty, negative ones multiplied."""

    name = "repetition_penalty"

    def __init__(self, repetition_penalty: float):
        _require(repetition_penalty > 0, "repetition_penalty", repetition_penalty, "(0, inf)")
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
    oracle="tests/test_processors.py::test_stage_equals_transformers_processor",
))


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

    def apply(self, input_ids, logits):
        counts = _generated_counts(input_ids, self.prompt_length, logits.shape[-1])
        return logits - self.knobs["frequency_penalty"] * counts.to(logits.dtype), {}


register(StageSpec(
    "frequency_penalty", order=40, group="penalties",
    knobs=(Knob("frequency_penalty", "float", 0.0, -2.0, 2.0, doc="OpenAI rule: subtract penalty x count of each "
                "generated token. 0 = neutral.", step=0.05),),
    build=lambda c, ctx: FrequencyPenalty(c.frequency_penalty, ctx.prompt_length),
    heading=lambda s: f"frequency penalty: −{param(s, 'frequency_penalty')} per repeat",
    interop=Interop(webui=Export("frequency_penalty", knobs=("frequency_penalty",), caveat=_WEBUI_COUNTS_PROMPT),
                    llama=Export("penalties", flag="--frequency-penalty", lines=_llama_whole_context,
                                 caveat=_LLAMA_COUNTS_PROMPT)),
    oracle="tests/test_processors.py::test_frequency_and_presence_penalties_by_hand",
))


class PresencePenalty(Stage):
    """OpenAI's rule: logit -= penalty once for every token present among the generated tokens."""

    name = "presence_penalty"

    def __init__(self, presence_penalty: float, prompt_length: int = 0):
        _require(-2 <= presence_penalty <= 2, "presence_penalty", presence_penalty, "[-2, 2]")
        super().__init__(presence_penalty=presence_penalty)
        self.prompt_length = prompt_length

    def apply(self, input_ids, logits):
        present = _generated_counts(input_ids, self.prompt_length, logits.shape[-1]) > 0
        return logits - self.knobs["presence_penalty"] * present.to(logits.dtype), {}


register(StageSpec(
    "presence_penalty", order=50, group="penalties",
    knobs=(Knob("presence_penalty", "float", 0.0, -2.0, 2.0, doc="OpenAI rule: subtract penalty once from every "
                "generated token. 0 = neutral.", step=0.05),),
    build=lambda c, ctx: PresencePenalty(c.presence_penalty, ctx.prompt_length),
    heading=lambda s: f"presence penalty: −{param(s, 'presence_penalty')} once seen",
    interop=Interop(webui=Export("presence_penalty", knobs=("presence_penalty",), caveat=_WEBUI_COUNTS_PROMPT),
                    llama=Export("penalties", flag="--presence-penalty", lines=_llama_whole_context,
                                 caveat=_LLAMA_COUNTS_PROMPT)),
    oracle="tests/test_processors.py::test_frequency_and_presence_penalties_by_hand",
))


class NoRepeatNGram(_Wrapped):
    name = "no_repeat_ngram"

    def __init__(self, no_repeat_ngram_size: int):
        _require(isinstance(no_repeat_ngram_size, int) and no_repeat_ngram_size > 0, "no_repeat_ngram_size", no_repeat_ngram_size, "integers >= 1")
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
    oracle="tests/test_processors.py::test_stage_equals_transformers_processor",
))


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
    oracle="tests/test_processors.py::test_constraints_mask_allowed_and_banned_sequences",
))


# --- samplers at parity (llama.cpp / text-generation-webui) ------------------------------------------
# References: llama.cpp src/llama-sampling.cpp (temp-ext, top-n-sigma, XTC, mirostat, DRY) and
# text-generation-webui modules/sampler_hijack.py (DRY, quadratic sampling, top-a, dynamic temperature).


def _softmax(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] probabilities in float32 (masked tokens get exactly 0)."""
    return torch.softmax(logits.float(), dim=-1)


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
        _require(dry_multiplier > 0, "dry_multiplier", dry_multiplier, "(0, 10] for a stage")
        _require(dry_base >= 1, "dry_base", dry_base, "[1, 4]")
        _require(dry_allowed_length >= 1, "dry_allowed_length", dry_allowed_length, "[1, 20]")
        _require(dry_penalty_last_n != 0, "dry_penalty_last_n", dry_penalty_last_n, "-1 or >= 1 for a stage")
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
    oracle="tests/test_samplers.py::test_dry_by_hand "
           "tests/test_samplers.py::test_dry_equals_brute_force_on_random_contexts",
))


class Xtc(Stage):
    """XTC, "exclude top choices" (llama.cpp's xtc): with probability ``xtc_probability``, every
    token with p >= threshold is removed except the least likely of them (nothing happens when
    fewer than two reach it). The coin is u ~ U(0, 1) from the run's generator, drawn only when
    0 < probability < 1 (once per call, whatever the logits, so a replay stays aligned); the
    stage fires when u < probability. Its diagnostics: u, whether it fired, and the token kept."""

    name = "xtc"
    stateful = True  # it draws

    def __init__(self, xtc_threshold: float, xtc_probability: float, generator: torch.Generator | None = None):
        _require(0 <= xtc_threshold <= 0.5, "xtc_threshold", xtc_threshold, "[0, 0.5] for a stage (above 0.5 disables)")
        _require(0 < xtc_probability <= 1, "xtc_probability", xtc_probability, "(0, 1] for a stage")
        super().__init__(xtc_threshold=xtc_threshold, xtc_probability=xtc_probability)
        self.generator = generator
        self._loaded_u: float | None = None  # load_state's draw: every call uses it instead of drawing
        self._u: float | None = None  # the last call's draw

    def coin(self) -> float | None:
        """The call's draw u: the loaded one (``load_state``), else one from the run's generator;
        None when the probability is 1 (nothing to draw)."""
        probability = self.knobs["xtc_probability"]
        if probability >= 1:
            return None
        if self._loaded_u is not None:
            return self._loaded_u
        if self.generator is None:
            raise ConfigError("xtc_probability", f"{probability!r} in (0, 1) draws from the run's generator; "
                                                 "none was given (Chain.from_config(..., generator=...))")
        return float(torch.rand((), generator=self.generator, device=self.generator.device))

    def state(self) -> dict[str, Any]:
        return {"u": self._u}

    def load_state(self, state: dict[str, Any]) -> None:
        u = state.get("u")
        if u is not None:
            _require(isinstance(u, (int, float)) and not isinstance(u, bool) and 0 <= u < 1, "xtc.u", u, "[0, 1)")
            self._loaded_u = float(u)

    def reset(self) -> None:
        super().reset()
        self._loaded_u = self._u = None

    def skip(self) -> None:
        self.coin()  # the one draw a call makes (none at probability 1)

    def apply(self, input_ids, logits):
        u = self._u = self.coin()
        fired = u is None or u < self.knobs["xtc_probability"]
        out, kept = logits.clone(), None
        if fired:
            probs = _softmax(logits)
            # the tokens still alive at or above the threshold (a masked token is never a "top choice":
            # with threshold 0 it would otherwise be the least likely one kept, leaving nothing)
            top = (probs >= self.knobs["xtc_threshold"]) & (probs > 0)  # [B, V]
            # the least likely top choice survives (ties: the highest id, an arbitrary but fixed rule),
            # as llama.cpp keeps the last candidate above the threshold
            least = torch.where(top, probs, torch.full_like(probs, 2.0))
            keep_idx = (least == least.min(dim=-1, keepdim=True).values).int().cumsum(-1).argmax(-1)  # [B]
            remove = top & (top.sum(-1, keepdim=True) >= 2)
            remove[torch.arange(out.shape[0]), keep_idx] = False
            out = out.masked_fill(remove, float("-inf"))
            kept = int(keep_idx[0]) if bool(top[0].sum() >= 2) else None
        return out, {"u": u, "fired": fired, "kept_id": kept}


def _xtc_note(stage: StageTrace) -> str:
    p, u = stage.params.get("xtc_probability"), stage.params.get("u")
    coin = f"u={decimal(u, 2)} < {p:g}" if u is not None else f"probability {p:g}"
    if not stage.params.get("fired"):
        return f"XTC did not fire (u={decimal(u, 2)} ≥ {p:g})" if u is not None else "XTC did not fire"
    if stage.params.get("kept_id") is None:
        threshold = stage.params.get("xtc_threshold")
        return f"XTC fired ({coin}) but fewer than two tokens reach {threshold:g}: nothing removed"
    kept = next((t.token for t in stage.top if t.token_id == stage.params["kept_id"]), None)
    kept_text = f"; kept {quoted(kept)}" if kept is not None else ""
    removed = token_names(stage.removed) or f"{percent(stage.mass_removed)} of the mass"
    return f"XTC fired ({coin}): removed {removed}{kept_text}"


register(StageSpec(
    "xtc", order=210, sampling_only=True, group="adaptive", label="XTC", label_value=False,
    knobs=(Knob("xtc_threshold", "float", 0.1, 0.0, 1.0, doc="XTC: tokens at or above this probability are top "
                "choices. Above 0.5 = disabled.", step=0.01),
           Knob("xtc_probability", "float", 0.0, 0.0, 1.0, doc="XTC: chance per step of removing every top choice "
                "but the least likely. 0 = disabled.", step=0.01)),
    active=lambda c: c.xtc_probability > 0 and c.xtc_threshold <= 0.5,
    build=lambda c, ctx: Xtc(c.xtc_threshold, c.xtc_probability, ctx.generator),
    note=_xtc_note,
    heading=lambda s: (f"XTC: drop top tokens above p={param(s, 'xtc_threshold', '.2f')} "
                       f"with probability {param(s, 'xtc_probability', '.1f')}"),
    interop=Interop(webui=Export("xtc", knobs=("xtc_threshold", "xtc_probability")),
                    llama=Export("xtc", lines=lambda c, x: [f"--xtc-probability {number(c.xtc_probability)}",
                                                            f"--xtc-threshold {number(c.xtc_threshold)}"]),
                    export_all_knobs=True),
    oracle="tests/test_samplers.py::test_xtc_removes_top_choices_but_the_least_likely "
           "tests/test_samplers.py::test_xtc_fires_with_its_probability",
))


class TopNSigma(Stage):
    """Top-nσ (llama.cpp's top-n-sigma): keep logits >= max - n·σ, σ the population standard
    deviation of the finite logits. Scaling logits by 1/T scales max and σ alike, so the kept set
    does not depend on temperature. Its diagnostics: σ and the cutoff (row 0)."""

    name = "top_n_sigma"

    def __init__(self, top_n_sigma: float):
        _require(top_n_sigma > 0, "top_n_sigma", top_n_sigma, "(0, 10] for a stage")
        super().__init__(top_n_sigma=top_n_sigma)

    def apply(self, input_ids, logits):
        finite = torch.isfinite(logits)
        count = finite.sum(-1, keepdim=True).clamp(min=1)
        values = logits.float().masked_fill(~finite, 0.0)
        mean = values.sum(-1, keepdim=True) / count
        sigma = (((values - mean) ** 2).masked_fill(~finite, 0.0).sum(-1, keepdim=True) / count).sqrt()  # [B, 1]
        top = logits.float().masked_fill(~finite, float("-inf")).max(-1, keepdim=True).values
        cut = top - self.knobs["top_n_sigma"] * sigma
        return logits.masked_fill(logits < cut, float("-inf")), {"sigma": float(sigma[0]), "cutoff": float(cut[0])}


def _top_n_sigma_note(stage: StageTrace) -> str:
    sigma, cut = stage.params.get("sigma"), stage.params.get("cutoff")
    where = f" (σ = {sigma:.2f}, logits below {cut:.2f} go)" if sigma is not None and cut is not None else ""
    return truncation_note(stage) + where


register(StageSpec(
    "top_n_sigma", order=120, sampling_only=True, group="truncation", label="top-nσ",
    knobs=(Knob("top_n_sigma", "float", 0.0, 0.0, 10.0, doc="Keep logits within n standard deviations of the top "
                "logit. 0 = disabled.", step=0.05),),
    build=lambda c, ctx: TopNSigma(c.top_n_sigma),
    note=_top_n_sigma_note,
    heading=lambda s: f"top-nσ: keep logits within {param(s, 'top_n_sigma')}σ of the top",
    interop=Interop(webui=Export("top_n_sigma", knobs=("top_n_sigma",)),
                    llama=Export("top_n_sigma", flag="--top-nsigma"), export_all_knobs=True),
    oracle="tests/test_samplers.py::test_top_n_sigma_by_hand",
))


class DynamicTemperature(Stage):
    """Entropy-scaled temperature (llama.cpp's temp-ext with delta > 0): over the surviving tokens,
    T = T_min + (T_max - T_min) · (H / log n)^exponent with T_min = max(0, T - range),
    T_max = T + range, H the entropy of softmax(logits) and n the number of finite logits.
    It *replaces* the plain temperature stage (the config turns that one off while it is active);
    T <= 0 keeps only the top token, as llama.cpp. Its diagnostics: the T used and the normalised
    entropy (row 0)."""

    name = "dynamic_temperature"

    def __init__(self, temperature: float, dynatemp_range: float, dynatemp_exponent: float = 1.0):
        _require(dynatemp_range > 0, "dynatemp_range", dynatemp_range, "(0, 5] for a stage")
        _require(dynatemp_exponent > 0, "dynatemp_exponent", dynatemp_exponent, "(0, 10]")
        super().__init__(temperature=temperature, dynatemp_range=dynatemp_range, dynatemp_exponent=dynatemp_exponent)

    def apply(self, input_ids, logits):
        t, delta, exponent = self.knobs["temperature"], self.knobs["dynatemp_range"], self.knobs["dynatemp_exponent"]
        low, high = max(0.0, t - delta), t + delta
        probs = _softmax(logits)
        entropy = torch.special.entr(probs).sum(-1, keepdim=True)  # [B, 1], nats
        n = torch.isfinite(logits).sum(-1, keepdim=True).float()
        normalised = torch.where(n > 1, entropy / n.clamp(min=2).log(), torch.zeros_like(entropy))
        temp = low + (high - low) * normalised.pow(exponent)  # [B, 1]
        scaled = logits / temp.clamp(min=1e-30).to(logits.dtype)
        top_only = logits.masked_fill(logits < logits.max(-1, keepdim=True).values, float("-inf"))
        out = torch.where(temp > 0, scaled, top_only)
        out = torch.where(n > 1, out, logits)  # one candidate: nothing to scale (llama.cpp returns early)
        return out, {"T": float(temp[0]), "normalized_entropy": float(normalised[0])}


def _dynamic_temperature_note(stage: StageTrace) -> str:
    t, h = stage.params.get("T"), stage.params.get("normalized_entropy")
    if t is None:
        return "dynamic temperature"
    return f"dynamic temperature: T = {t:.2f} from normalised entropy {h:.2f} (entropy now {stage.entropy:.2f} nats)"


def _dynamic_temperature_heading(stage: StageTrace) -> str:
    t, r = stage.params.get("temperature"), stage.params.get("dynatemp_range")
    used = stage.params.get("T")
    return f"dynamic temperature {title_number(t)} ± {title_number(r)}" + \
        (f": T={title_number(used, '.2f')}" if isinstance(used, float) else "")


def _dynamic_temperature_webui(c: DecodingConfig, view: Any) -> list[str]:
    low, high = max(0.0, c.temperature - c.dynatemp_range), c.temperature + c.dynatemp_range
    return ["dynamic_temperature: true", f"dynatemp_low: {number(low)}", f"dynatemp_high: {number(high)}",
            f"dynatemp_exponent: {number(c.dynatemp_exponent)}"]


register(StageSpec(
    "dynamic_temperature", order=100, sampling_only=True, group="temperature", label="dynamic temperature",
    label_value=False,
    knobs=(Knob("dynatemp_range", "float", 0.0, 0.0, 5.0, doc="Dynamic temperature: T spans temperature ± range, "
                "scaled by the normalised entropy. 0 = disabled.", step=0.05),
           Knob("dynatemp_exponent", "float", 1.0, 0.0, 10.0, low_open=True, doc="Dynamic temperature: exponent on "
                "the normalised entropy. 1 = linear.", step=0.05)),
    active=lambda c: c.dynatemp_range > 0,
    build=lambda c, ctx: DynamicTemperature(c.temperature, c.dynatemp_range, c.dynatemp_exponent),
    note=_dynamic_temperature_note,
    heading=_dynamic_temperature_heading,
    # llama.cpp: its temperature sampler with a range (temp-ext)
    interop=Interop(webui=Export("dynamic_temperature", lines=_dynamic_temperature_webui),
                    llama=Export("temperature", lines=lambda c, x: [
                        f"--temp {number(c.temperature)}", f"--dynatemp-range {number(c.dynatemp_range)}",
                        f"--dynatemp-exp {number(c.dynatemp_exponent)}"]),
                    export_all_knobs=True),
    oracle="tests/test_samplers.py::test_dynamic_temperature_by_hand",
))


class Smoothing(Stage):
    """Quadratic ("smoothing") sampling, text-generation-webui's QuadraticSamplingLogitsWarper:
    with d = logit - max, k = (3 - curve)/2, s = (curve - 1)/2, every finite logit becomes
    max - k·f·d² + s·f·d³ (curve 1: max - f·d²). The max is per row (the reference takes it over
    the whole batch, the same thing for one sequence)."""

    name = "smoothing"

    def __init__(self, smoothing_factor: float, smoothing_curve: float = 1.0):
        _require(smoothing_factor > 0, "smoothing_factor", smoothing_factor, "(0, 10] for a stage")
        _require(smoothing_curve >= 1, "smoothing_curve", smoothing_curve, "[1, 10]")
        super().__init__(smoothing_factor=smoothing_factor, smoothing_curve=smoothing_curve)

    def apply(self, input_ids, logits):
        f, curve = self.knobs["smoothing_factor"], self.knobs["smoothing_curve"]
        top = logits.max(-1, keepdim=True).values
        d = logits - top
        k, s = (3 - curve) / 2, (curve - 1) / 2
        return torch.where(torch.isfinite(logits), -(k * f * d ** 2) + s * f * d ** 3 + top, logits), {}


register(StageSpec(
    "smoothing", order=110, sampling_only=True, shareable=True, group="temperature",
    knobs=(Knob("smoothing_factor", "float", 0.0, 0.0, 10.0, doc="Quadratic sampling: logit = max - factor x "
                "(max - logit)^2. 0 = disabled.", step=0.01),
           Knob("smoothing_curve", "float", 1.0, 1.0, 10.0, doc="Quadratic sampling: cubic term; 1 = pure quadratic.",
                step=0.05)),
    active=lambda c: c.smoothing_factor > 0,
    build=lambda c, ctx: Smoothing(c.smoothing_factor, c.smoothing_curve),
    heading=lambda s: f"smoothing: factor {param(s, 'smoothing_factor')}, curve {param(s, 'smoothing_curve')}",
    interop=Interop(webui=Export("quadratic_sampling", knobs=("smoothing_factor", "smoothing_curve")),
                    llama=Export(unmapped="llama.cpp has no quadratic (smoothing) sampler"), export_all_knobs=True),
    oracle="tests/test_samplers.py::test_smoothing_by_hand",
))


class Mirostat(Stage):
    """Mirostat v1 and v2 (llama.cpp's mirostat / mirostat-v2), μ starting at 2τ.

    v2: drop tokens whose surprise -log2 p exceeds μ (the top token always stays).
    v1: estimate the Zipf exponent ŝ from the top m = 100 tokens, then keep the top
    k = ((ε̂·2^μ) / (1 - N^-ε̂))^(1/ŝ) tokens, ε̂ = ŝ - 1, N the vocabulary size.
    After the pick, ``accept`` updates μ ← μ - η·(-log2 p(token) - τ), p the token's probability
    in the truncated distribution this stage produced (llama.cpp samples right after mirostat;
    here it is the last stage by default). Its diagnostics: μ before and the tokens kept; ``accept``
    returns μ after and the surprise."""

    name = "mirostat"
    stateful = True
    carries = True  # μ
    M = 100

    def __init__(self, mirostat: int, mirostat_tau: float = 5.0, mirostat_eta: float = 0.1):
        _require(mirostat in (1, 2), "mirostat", mirostat, "1 | 2 for a stage (0 = disabled)")
        _require(mirostat_tau >= 0, "mirostat_tau", mirostat_tau, "[0, 20]")
        _require(0 <= mirostat_eta <= 1, "mirostat_eta", mirostat_eta, "[0, 1]")
        super().__init__(mirostat=mirostat, mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta)
        self.mu = 2.0 * mirostat_tau
        self._mu_used = self.mu  # μ of the last call (accept moves self.mu after it)
        self._probs: tuple[torch.Tensor, torch.Tensor] | None = None  # (before, after) of row 0, [V]

    def _keep_count(self, probs: torch.Tensor, alive: int) -> int:
        """How many of the sorted probabilities [V] (descending) to keep."""
        if self.knobs["mirostat"] == 2:
            return max(1, int((-torch.log2(probs[:alive]) <= self.mu).sum()))
        m = min(self.M - 1, alive - 1)
        i = torch.arange(m, dtype=torch.float64)
        t = torch.log((i + 2) / (i + 1))
        b = torch.log(probs[:m].double() / probs[1:m + 1].double())
        s_hat = float((t * b).sum() / (t * t).sum()) if m > 0 else float("nan")
        eps = s_hat - 1
        k = ((eps * 2.0 ** self.mu) / (1 - probs.shape[0] ** -eps)) ** (1 / s_hat) if m > 0 else float("nan")
        if not isinstance(k, float) or not math.isfinite(k):  # degenerate estimate: keep what is alive
            return alive
        return min(max(int(k), 1), alive)

    def apply(self, input_ids, logits):
        probs = _softmax(logits)
        sorted_p, order = torch.sort(probs[0], descending=True)
        keep = self._keep_count(sorted_p, int((sorted_p > 0).sum()))
        mask = torch.ones_like(probs[0], dtype=torch.bool)
        mask[order[:keep]] = False
        out = logits.masked_fill(mask, float("-inf"))  # B = 1: mirostat keeps one μ per run
        self._probs = (probs[0], _softmax(out)[0])
        self._mu_used = self.mu
        return out, {"mu": self.mu, "kept": keep, "mu_after": None}

    def state(self) -> dict[str, Any]:
        return {"mu": self._mu_used}

    def load_state(self, state: dict[str, Any]) -> None:
        mu = state.get("mu")
        if mu is not None:
            _require(isinstance(mu, (int, float)) and not isinstance(mu, bool) and math.isfinite(mu),
                     "mirostat.mu", mu, "a finite number")
            self.mu = self._mu_used = float(mu)

    def resume(self, state: dict[str, Any]) -> None:
        self.load_state(state)  # μ before the step: what the run had carried there

    def accept(self, input_ids, token_id: int) -> dict[str, Any]:
        if self._probs is None:
            return {}
        before, after = self._probs
        p = float(after[token_id]) if float(after[token_id]) > 0 else float(before[token_id])  # a forced token
        surprise = -math.log2(p) if p > 0 else 64.0  # cap: a token of probability 0 only comes forced
        self.mu = self.mu - self.knobs["mirostat_eta"] * (surprise - self.knobs["mirostat_tau"])
        self._probs = None
        learnt = {"mu_after": self.mu, "surprise": surprise}
        self._last = {**self._last, **learnt}
        return learnt

    def reset(self) -> None:
        super().reset()
        self.mu = self._mu_used = 2.0 * self.knobs["mirostat_tau"]
        self._probs = None


def _mirostat_note(stage: StageTrace) -> str:
    mu, kept = stage.params.get("mu"), stage.params.get("kept", stage.kept)
    if mu is None:
        return "mirostat"
    after = stage.params.get("mu_after")
    then = f"; after the pick μ = {after:.2f}" if after is not None else ""
    return f"mirostat: μ = {mu:.1f} → kept {kept} tokens{then}"


def _mirostat_heading(stage: StageTrace) -> str:
    version, mu = stage.params.get("mirostat"), stage.params.get("mu")
    name = f"Mirostat v{version}" if version in (1, 2) else "Mirostat"
    return (f"{name}: target surprise {param(stage, 'mirostat_tau', '.1f')}"
            + (f", mu {title_number(mu, '.1f')}" if mu is not None else ""))


def _mirostat_webui_caveat(c: DecodingConfig, view: Any) -> str | None:
    if c.mirostat != 1:
        return None
    return "text-generation-webui's Transformers loader runs mirostat 2 only; mode 1 needs its llama.cpp loader"


def _mirostat_llama_caveat(c: DecodingConfig, view: Any) -> str | None:
    if view.greedy or len(view.order) < 2:
        return None
    return "with --mirostat, llama.cpp ignores --samplers and keeps only temperature"


register(StageSpec(
    "mirostat", order=220, sampling_only=True, group="adaptive", label="Mirostat", label_value=False,
    knobs=(Knob("mirostat", "int", 0, 0, 2, doc="Mirostat version: adaptive truncation aiming at a target surprise. "
                "0 = disabled.", step=1),
           Knob("mirostat_tau", "float", 5.0, 0.0, 20.0, doc="Mirostat: target surprise in bits.", step=0.1),
           Knob("mirostat_eta", "float", 0.1, 0.0, 1.0, doc="Mirostat: learning rate of mu.", step=0.01)),
    build=lambda c, ctx: Mirostat(c.mirostat, c.mirostat_tau, c.mirostat_eta),
    note=_mirostat_note,
    heading=_mirostat_heading,
    # llama.cpp's mirostat is no --samplers entry: it replaces the chain, keeping temperature only
    interop=Interop(webui=Export("mirostat", caveat=_mirostat_webui_caveat, lines=lambda c, x: [
                        f"mirostat_mode: {number(c.mirostat)}", f"mirostat_tau: {number(c.mirostat_tau)}",
                        f"mirostat_eta: {number(c.mirostat_eta)}"]),
                    llama=Export(caveat=_mirostat_llama_caveat, lines=lambda c, x: [
                        f"--mirostat {c.mirostat}", f"--mirostat-lr {number(c.mirostat_eta)}",
                        f"--mirostat-ent {number(c.mirostat_tau)}"]),
                    export_all_knobs=True),
    oracle="tests/test_samplers.py::test_mirostat_v2_truncates_by_surprise_and_updates_mu "
           "tests/test_samplers.py::test_mirostat_v1_keeps_k_from_the_zipf_estimate",
))


class Eta(_Wrapped):
    """Eta sampling: transformers' EtaLogitsWarper, eta = min(ε, sqrt(ε)·exp(-H))."""

    name = "eta"

    def __init__(self, eta_cutoff: float):
        _require(0 < eta_cutoff < 1, "eta_cutoff", eta_cutoff, "(0, 1)")
        super().__init__(tlp.EtaLogitsWarper(epsilon=eta_cutoff), eta_cutoff=eta_cutoff)


register(StageSpec(
    "eta", order=180, sampling_only=True, shareable=True, group="truncation", label="η cutoff",
    knobs=(Knob("eta_cutoff", "float", 0.0, 0.0, 0.999, doc="Eta sampling: drop p < min(eta, sqrt(eta) x "
                "exp(-entropy)). 0 = disabled.", step=0.0001),),
    build=lambda c, ctx: Eta(c.eta_cutoff),
    note=truncation_note,
    heading=lambda s: f"η-cutoff: drop p below {param(s, 'eta_cutoff')} (entropy-scaled)",
    interop=Interop("EtaLogitsWarper", webui=Export("eta_cutoff", knobs=("eta_cutoff",), scale=10_000),
                    llama=Export(unmapped="llama.cpp has no eta sampler"), export_all_knobs=True),
    oracle="tests/test_samplers.py::test_wrapped_stage_equals_transformers",
))


class TopA(Stage):
    """Top-a (text-generation-webui's TopALogitsWarper): drop tokens with p < a · p_max²."""

    name = "top_a"

    def __init__(self, top_a: float):
        _require(0 < top_a <= 1, "top_a", top_a, "(0, 1] for a stage")
        super().__init__(top_a=top_a)

    def apply(self, input_ids, logits):
        probs = _softmax(logits)
        p_max = probs.max(-1, keepdim=True).values
        return logits.masked_fill(probs < p_max * p_max * self.knobs["top_a"], float("-inf")), {}


register(StageSpec(
    "top_a", order=200, sampling_only=True, shareable=True, group="truncation", label="top-a",
    knobs=(Knob("top_a", "float", 0.0, 0.0, 1.0, doc="Top-a: drop p < a x p_max^2. 0 = disabled.", step=0.01),),
    build=lambda c, ctx: TopA(c.top_a),
    note=truncation_note,
    heading=lambda s: f"top-a: drop p below {param(s, 'top_a')} × top p²",
    interop=Interop(webui=Export("top_a", knobs=("top_a",)), llama=Export(unmapped="llama.cpp has no top-a sampler"),
                    export_all_knobs=True),
    oracle="tests/test_samplers.py::test_top_a_by_hand",
))


class TopH(_Wrapped):
    """Top-H: transformers' TopHLogitsWarper (among the top 100 tokens, keep adding tokens while
    their entropy terms stay within top_h x the entropy)."""

    name = "top_h"

    def __init__(self, top_h: float):
        _require(0 < top_h <= 1, "top_h", top_h, "(0, 1]")
        super().__init__(tlp.TopHLogitsWarper(top_h=top_h), top_h=top_h)


register(StageSpec(
    "top_h", order=190, sampling_only=True, group="truncation", label="top-H",
    knobs=(Knob("top_h", "float", 0.0, 0.0, 1.0, doc="Top-H: keep top tokens until their entropy exceeds top_h x "
                "the entropy. 0 = disabled.", step=0.01),),
    build=lambda c, ctx: TopH(c.top_h),
    note=truncation_note,
    heading=lambda s: f"top-H: keep entropy within {param(s, 'top_h')} of the whole",
    interop=Interop("TopHLogitsWarper", webui=Export(unmapped="text-generation-webui has no top-H sampler"),
                    llama=Export(unmapped="llama.cpp has no top-H sampler"), export_all_knobs=True),
    oracle="tests/test_samplers.py::test_wrapped_stage_equals_transformers",
))


class LogitBias(_Wrapped):
    """Add a bias to token sequences: transformers' SequenceBiasLogitsProcessor. A single token gets
    its bias at every step; the last token of a longer sequence (a multi-token word) gets it right
    after the tokens before it were generated, as ``banned_words`` bans them."""

    name = "logit_bias"

    def __init__(self, sequence_bias: dict[tuple[int, ...], float], logit_bias: dict[str, float] | None = None):
        _require(bool(sequence_bias), "logit_bias", logit_bias, "a non-empty object for a stage")
        super().__init__(tlp.SequenceBiasLogitsProcessor({k: float(v) for k, v in sequence_bias.items()}),
                         logit_bias=dict(logit_bias or {}))
        self.largest_id = max(max(seq) for seq in sequence_bias)

    def apply(self, input_ids, logits):
        if self.largest_id >= logits.shape[-1]:
            raise ConfigError("logit_bias", f"token id {self.largest_id} is outside the vocabulary "
                                            f"({logits.shape[-1]} tokens)")
        return super().apply(input_ids, logits)


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
    oracle="tests/test_samplers.py::test_wrapped_stage_equals_transformers "
           "tests/test_samplers.py::test_logit_bias_ids_and_words",
))


class MinNewTokens(_Wrapped):
    """EOS masked until ``min_new_tokens`` tokens were generated: transformers'
    MinNewTokensLengthLogitsProcessor."""

    name = "min_new_tokens"

    def __init__(self, min_new_tokens: int, prompt_length: int = 0, eos_token_ids: Sequence[int] = ()):
        _require(isinstance(min_new_tokens, int) and min_new_tokens > 0, "min_new_tokens", min_new_tokens, "[1, 1024]")
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
    oracle="tests/test_samplers.py::test_wrapped_stage_equals_transformers "
           "tests/test_samplers.py::test_min_new_tokens_by_hand",
))


def breaker_token_ids(tokenizer: Any, breakers: Sequence[str]) -> list[int]:
    """DRY's sequence breakers as token ids, as text-generation-webui: the last token of
    ``"a" + breaker`` (the prefix makes the breaker tokenise as it does mid-text)."""
    if breakers and tokenizer is None:
        raise ConfigError("dry_sequence_breakers", "strings need the model's tokenizer; use [] without one")
    return sorted({tokenizer.encode("a" + s, add_special_tokens=False)[-1] for s in breakers})


def build_stage(name: str, config: DecodingConfig, prompt_length: int = 0, tokenizer: Any = None,
                eos_token_ids: Sequence[int] = (), generator: torch.Generator | None = None) -> Stage:
    """One stage from the config's knob(s), by its spec. ``generator``: the run's, for stages that
    draw (XTC)."""
    spec = STAGES.get(name)
    if spec is None:
        raise ConfigError("stage_order", f"unknown stage {name!r}")
    return spec.build(config, BuildContext(prompt_length, tokenizer, eos_token_ids, generator))


# --- many rows at once (the batched scheduler) ---------------------------------------------------------
def share_key(stage: Stage) -> tuple | None:
    """The key under which rows may share one call of ``stage`` (None: it runs per row): its spec
    says ``shareable`` (the output row depends only on that row's logits and on params fixed at
    construction: no input_ids, no state, no draws, params not rewritten per call), and rows whose
    stage has equal params share one call on [G, V]."""
    spec = STAGES.get(stage.name)
    if spec is None or not spec.shareable:
        return None
    return type(stage), tuple(sorted(stage.knobs.items()))
