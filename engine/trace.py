"""Trace records: plain dataclasses that record everything a decoding run did.

Everything the UI shows is a pure function of these. ``to_json`` / ``from_json`` round-trip them;
``from_dict`` rebuilds nested dataclasses from their type hints, so strategy modules (beam,
speculative, ...) add their own typed records without touching this file's serialiser. A Trace
read back (``Trace.from_json``, ``Trace.from_dict``, ``untrusted_trace``) holds its strategy's
records typed again (``record_fields``): a BeamTrace in ``beam``, SpecRounds / MedusaRounds in
``rounds``, SearchSteps / ContrastSteps / MctsPositions in ``extra``.

Strict JSON: ``to_json`` never writes NaN or Infinity (``allow_nan=False``). Non-finite values are
prevented at the source (a step whose final distribution is all masked or NaN ends the run with
stop_reason "no_tokens_left", see ``engine.sampling.ensure_tokens``); the few legitimately
infinite numbers a record may hold (a -inf score of a masked candidate, a log-prob of 0) are written
as ``null``, which every consumer reads as "no value". ``from_json`` reads them back as None.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, NoReturn

from engine.config import KNOBS, STAGE_NAMES, ConfigError
from engine.base.strategy_spec import STRATEGIES

STOP_REASONS = ("eos", "stop_string", "max_new_tokens", "no_tokens_left")


@dataclass
class TokenProb:
    token_id: int
    token: str
    prob: float


@dataclass
class StageTrace:
    """The distribution after one stage (or ``raw`` / ``final``).

    ``kept``: tokens with non-zero probability (over the whole vocabulary). ``mass_removed``: the
    probability mass, under the previous stage's distribution, of the tokens this stage removed.
    ``removed``: those of the previous stage's top-N that this stage removed (with their previous
    probability), so a chart can mark them. ``tv_distance``: total variation distance from the
    previous stage's distribution (how much the stage moved mass, even when it removed nothing).
    ``state``: what a stateful stage's output depended on besides the knobs, the ids and the
    logits (mirostat's μ before the step, XTC's draw u), as ``Stage.state()`` reports it; loading it
    into a fresh stage (``Stage.load_state``) reproduces this step exactly (what-if). Empty for the
    stateless stages. ``chosen_prob``: the picked token's probability after this stage when
    ``top`` does not hold it (a stage between raw and final; None otherwise: ``top``, the step's
    raw_prob or its chosen_prob say it). ``varentropy``: the variance of the surprisal,
    Σ p (−log p − H)² in nats² over the whole vocabulary (None where it was not recorded: a served
    model's top-N, an older trace)."""

    name: str
    kept: int
    mass_removed: float
    entropy: float
    tv_distance: float
    top: list[TokenProb]
    removed: list[TokenProb] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)
    chosen_prob: float | None = None
    varentropy: float | None = None


@dataclass
class StepTrace:
    """One generated token. ``draw`` is the uniform u in [0, 1) that picked the token under the
    inverse-CDF view of the final distribution, with tokens sorted by probability (highest first);
    the chosen token owns the interval [draw_low, draw_high). None for greedy or forced picks.
    ``varentropy`` / ``raw_varentropy``: the final and raw stages' (nats²); left out, they are
    read from ``stages`` (None where the stages lack them)."""

    index: int
    chosen_token_id: int
    chosen_token: str
    chosen_prob: float
    raw_prob: float  # the chosen token's probability under the unprocessed model
    draw: float | None
    draw_low: float | None
    draw_high: float | None
    entropy: float  # of the final distribution, in nats
    raw_entropy: float
    stages: list[StageTrace]
    elapsed_ms: float = 0.0  # since the run started (prefill included)
    forced: bool = False  # chosen by the user (branching), not by the sampler
    finish_reason: str | None = None  # set on the last step: one of STOP_REASONS
    varentropy: float | None = None  # of the final distribution, nats²
    raw_varentropy: float | None = None

    def __post_init__(self) -> None:
        if self.stages and self.varentropy is None:
            self.varentropy = getattr(self.stages[-1], "varentropy", None)
        if self.stages and self.raw_varentropy is None:
            self.raw_varentropy = getattr(self.stages[0], "varentropy", None)


@dataclass
class Timing:
    ttft_ms: float
    tokens_per_s: float
    total_ms: float


@dataclass
class Trace:
    """A whole run. Strategy-specific records live in ``beam`` / ``rounds`` / ``extra``."""

    model: str
    strategy: str
    config: dict[str, Any]
    prompt: str
    prompt_token_ids: list[int]
    text: str
    generated_token_ids: list[int]
    stop_reason: str
    steps: list[StepTrace]
    timing: Timing
    chat: bool = False
    quantization: str = "none"
    device: str = "cpu"
    branch_of: int | None = None  # the step this run branched from, if it is a branch
    beam: Any = None
    rounds: Any = None
    summary: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    def end_with_no_tokens_left(self) -> None:
        """Mark the run as ended by a step with nothing left to pick (``NoTokensLeft``): its
        stop_reason, and its last step's finish_reason, become "no_tokens_left"."""
        self.stop_reason = "no_tokens_left"
        if self.steps:
            self.steps[-1].finish_reason = "no_tokens_left"

    def to_json(self, indent: int | None = None) -> str:
        return dumps_strict(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Trace":
        """The Trace of JSON ``data``, its strategy's records typed (``record_fields``)."""
        trace = from_dict(cls, data)
        for name, cls_ in record_fields(trace.strategy).items():
            if name in ("beam", "rounds"):
                setattr(trace, name, from_dict(cls_, getattr(trace, name)))
            elif name in trace.extra:
                trace.extra[name] = from_dict(cls_, trace.extra[name])
        return trace

    @classmethod
    def from_json(cls, text: str) -> "Trace":
        return cls.from_dict(json.loads(text))


@dataclass
class Event:
    """One streamed event of any strategy.

    ``steps``: the tokens this event adds to the output, in order (one for greedy/sampling and the
    contrastive strategies, several for a speculative round, none for a beam search step, whose
    output is only known at the end). ``record``: the strategy's own record of this event, or None.
    ``trace``: set on the last event only."""

    steps: list[StepTrace] = field(default_factory=list)
    record: Any = None
    trace: Trace | None = None

    @property
    def done(self) -> bool:
        return self.trace is not None


def dumps_strict(data: Any, indent: int | None = None) -> str:
    """json.dumps that never emits NaN/Infinity (they become null first, see the module doc)."""
    return json.dumps(finite(data), indent=indent, ensure_ascii=False, allow_nan=False)


def finite(data: Any) -> Any:
    """``data`` (JSON-ready) with every non-finite float replaced by None."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: finite(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [finite(x) for x in data]
    return data


def to_dict(record: Any) -> Any:
    """Dataclasses -> JSON-ready dicts, recursively (tuples become lists)."""
    if dataclasses.is_dataclass(record) and not isinstance(record, type):
        return {f.name: to_dict(getattr(record, f.name)) for f in dataclasses.fields(record)}
    if isinstance(record, (list, tuple)):
        return [to_dict(x) for x in record]
    if isinstance(record, dict):
        return {str(k): to_dict(v) for k, v in record.items()}
    return record


def record_fields(strategy: str) -> dict[str, Any]:
    """Where a ``strategy``'s trace keeps its typed records: ``beam`` / ``rounds`` (the Trace
    fields) or a key of ``extra``, mapped to the record type (a dataclass or list[...] of one):
    its spec's ``records`` (engine.base.strategy_spec), {} for a strategy without records."""
    spec = STRATEGIES.get(strategy)
    return dict(spec.records) if spec is not None else {}


def from_dict(cls: Any, data: Any) -> Any:
    """Rebuild ``cls`` (a dataclass, list[...], X | None, or a plain type) from JSON data; a
    dataclass that is already a ``cls`` is returned as it is."""
    if data is None:
        return None
    origin = typing.get_origin(cls)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(cls) if a is not type(None)]
        return from_dict(options[0], data) if len(options) == 1 else data
    if origin in (list, tuple):
        (item,) = typing.get_args(cls)[:1] or (Any,)
        return [from_dict(item, x) for x in data]
    if isinstance(cls, type) and dataclasses.is_dataclass(cls):
        if isinstance(data, cls):
            return data
        hints = typing.get_type_hints(cls)
        kwargs = {f.name: from_dict(hints[f.name], data[f.name]) for f in dataclasses.fields(cls) if f.name in data}
        return cls(**kwargs)
    return data


# --- traces from outside (an API argument, a pasted file) ---------------------------------------------
# Bounded by what a run can produce, so a forged trace costs no more than a real one.
MAX_TRACE_STEPS = int(KNOBS["max_new_tokens"].high)  # steps and generated ids
MAX_TRACE_TOP = int(KNOBS["top_n"].high)  # top / removed tokens per stage
MAX_TRACE_STAGES = len(STAGE_NAMES) + 2  # raw, every stage, final
MAX_PROMPT_IDS = 8_192  # the app's prompt-token limit is lower (playground/shared.py checks it)
MAX_TRACE_TEXT = 200_000  # characters of the prompt / text fields
MAX_SHORT_TEXT = 1_000  # a token's text, a name
MAX_TRACE_JSON_CHARS = 64_000_000
MAX_DEPTH = 12  # nesting of the free-form fields (config, params, state, summary, extra, beam, rounds)
MAX_FREE_NODES = 500_000


def _fail(field: str, message: str) -> NoReturn:
    raise ConfigError(field, message)


def _list(data: dict, key: str, limit: int, where: str) -> list:
    value = data.get(key, [])
    if not isinstance(value, list):
        _fail(where, f"expected a list, got {type(value).__name__}")
    if len(value) > limit:
        _fail(where, f"{len(value):,} items is over the {limit:,}-item limit of a run")
    return value


def _text(data: dict, key: str, limit: int, where: str) -> None:
    value = data.get(key)
    if value is None:
        return
    if not isinstance(value, str):
        _fail(where, f"expected text, got {type(value).__name__}")
    if len(value) > limit:
        _fail(where, f"{len(value):,} characters is over the {limit:,}-character limit")


def _free(value: Any, where: str, budget: list[int]) -> None:
    """A free-form JSON value: at most MAX_DEPTH deep, strings of at most MAX_TRACE_TEXT, and its
    nodes counted against ``budget`` (walked without recursion, so depth cannot overflow the stack)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        budget[0] -= 1
        if budget[0] < 0:
            _fail(where, f"over {MAX_FREE_NODES:,} values in the trace's free-form fields")
        if depth > MAX_DEPTH:
            _fail(where, f"nested more than {MAX_DEPTH} levels deep")
        if isinstance(item, str) and len(item) > MAX_TRACE_TEXT:
            _fail(where, f"a string of {len(item):,} characters is over the {MAX_TRACE_TEXT:,}-character limit")
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)


def _tokens(stage: dict, key: str, where: str) -> None:
    for k, token in enumerate(_list(stage, key, MAX_TRACE_TOP, f"{where}.{key}")):
        if not isinstance(token, dict):
            _fail(f"{where}.{key}[{k}]", f"expected an object, got {type(token).__name__}")
        _text(token, "token", MAX_SHORT_TEXT, f"{where}.{key}[{k}].token")


def check_trace_size(data: Any) -> None:
    """ConfigError naming the field when a trace JSON object from outside is larger than a run can
    make: steps and generated ids (max_new_tokens), stages, top/removed tokens (top_n), string
    lengths and the nesting of its free-form fields."""
    if not isinstance(data, dict):
        _fail("trace", f"expected a trace JSON object, got {type(data).__name__}")
    _list(data, "prompt_token_ids", MAX_PROMPT_IDS, "prompt_token_ids")
    _list(data, "generated_token_ids", MAX_TRACE_STEPS, "generated_token_ids")
    for key in ("prompt", "text"):
        _text(data, key, MAX_TRACE_TEXT, key)
    for key in ("model", "strategy", "stop_reason", "quantization", "device"):
        _text(data, key, MAX_SHORT_TEXT, key)
    budget = [MAX_FREE_NODES]
    for i, step in enumerate(_list(data, "steps", MAX_TRACE_STEPS, "steps")):
        if not isinstance(step, dict):
            _fail(f"steps[{i}]", f"expected an object, got {type(step).__name__}")
        _text(step, "chosen_token", MAX_SHORT_TEXT, f"steps[{i}].chosen_token")
        for j, stage in enumerate(_list(step, "stages", MAX_TRACE_STAGES, f"steps[{i}].stages")):
            where = f"steps[{i}].stages[{j}]"
            if not isinstance(stage, dict):
                _fail(where, f"expected an object, got {type(stage).__name__}")
            _text(stage, "name", MAX_SHORT_TEXT, f"{where}.name")
            _tokens(stage, "top", where)
            _tokens(stage, "removed", where)
            for key in ("params", "state"):
                _free(stage.get(key), f"{where}.{key}", budget)
    for key in ("config", "timing", "summary", "extra", "beam", "rounds"):
        _free(data.get(key), key, budget)


def untrusted_trace(value: Any, key: str = "trace") -> Trace:
    """A trace from outside (JSON text or an already parsed object) as a Trace, size-checked first
    (``check_trace_size``); ConfigError naming ``key`` and the field otherwise."""
    if isinstance(value, str):
        if len(value) > MAX_TRACE_JSON_CHARS:
            _fail(key, f"{len(value):,} characters is over the {MAX_TRACE_JSON_CHARS:,}-character limit")
        try:
            value = json.loads(value, parse_constant=lambda name: _fail(key, f"not a trace: {name} is not valid JSON"))
        except RecursionError:
            _fail(key, "not a trace: nested too deeply")
        except ValueError as exc:
            if isinstance(exc, ConfigError):
                raise
            _fail(key, f"not a trace: not valid JSON ({str(exc)[:80]})")
    if not isinstance(value, dict):
        _fail(key, f"not a trace: expected a trace JSON object, got {type(value).__name__}")
    try:
        check_trace_size(value)
    except ConfigError as exc:
        raise ConfigError(key, str(exc)) from None
    try:
        return Trace.from_dict(value)
    except (TypeError, KeyError, ValueError, AttributeError, RecursionError) as exc:
        _fail(key, f"not a trace: {type(exc).__name__}: {str(exc)[:120]}")
