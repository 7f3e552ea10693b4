"""DecodingConfig: the strategy, every knob, and the stage order, validated in ONE place.

Every knob is declared once with its type, bounds and neutral value: the run and strategy knobs
here, each stage's knobs in its spec (engine/stages/, one ``StageSpec`` per stage), and all of
them collected in ``KNOBS``. The CLI, the preset schema and the UI sliders all read their ranges from
``KNOBS``; nothing else hard-codes a bound. A neutral value means "this stage does nothing", so
presets can be sparse. The stage order, names and sampling-only set are derived from the specs.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any

# The base floor only: the knobs and the two registries. The stages and the strategies register
# themselves when engine.stages and engine.strategies are imported (engine/__init__.py does, so
# importing anything under engine/ does), and the tables below are derived again at each change.
from engine.base.knobs import MAX_BIAS_ENTRIES, MAX_STRING_LEN, ConfigError, Knob  # noqa: F401  (re-exported)
from engine.base.stage_spec import STAGES, StageSpec, declared, on_change  # noqa: F401
from engine.base.strategy_spec import STRATEGIES as STRATEGY_SPECS
from engine.base.strategy_spec import on_change as on_strategies_change

# Every strategy, by its spec (engine/strategies/spec.py): the registry itself, so a module that
# imported it sees every strategy registered since (``name in STRATEGIES``, ``list(STRATEGIES)``).
STRATEGIES = STRATEGY_SPECS

# The stages are declared in engine/stages/, one StageSpec each (engine/base/stage_spec.py); the tables
# below are derived from them (``_derive``). The default order is transformers' own
# (generation/utils.py `_get_logits_processor`): processors first (repetition penalty,
# no-repeat-n-gram), then the sampling warpers. Frequency and presence penalties (OpenAI's rule)
# have no transformers counterpart; they sit beside the repetition penalty. `constraints`
# (allowed/banned words) masks before everything so later stages renormalise over it. The samplers
# added for parity with llama.cpp / text-generation-webui slot in where llama.cpp puts them (its
# chain: logit bias, penalties, DRY, top-nσ, top-k, typical, top-p, min-p, XTC, temperature;
# mirostat ends a chain), without moving the stages above relative to each other.
DEFAULT_STAGE_ORDER: tuple[str, ...] = ()  # every stage, by its spec's ``order``
STAGE_NAMES: tuple[str, ...] = ()  # the same names
# Stages that only shape a *sampling* distribution. Greedy decoding ignores them, exactly as
# transformers' generate(do_sample=False) does.
SAMPLING_ONLY_STAGES: frozenset[str] = frozenset()

# KV cache kinds (engine/cache/kv_quant.py builds them), plus "sliding-<N>": a window of the last N positions.
KV_CACHE_KINDS = ("dynamic", "quantized-int8", "quantized-int4")
SLIDING_WINDOW_RANGE = (2, 65_536)  # transformers keeps N - 1 cached positions, so N >= 2


MAX_SEED = 2**32 - 1

# Run knobs; each stage's knobs are in its spec (engine/stages/), each strategy's in its own (engine/strategies/).
_RUN_KNOBS = [
    Knob("seed", "int", 0, 0, MAX_SEED, doc="Seed of the per-run random generator; same seed, same output.", step=1,
         widget="number"),
    Knob("max_new_tokens", "int", 64, 1, 1024, doc="Stop after this many generated tokens.", step=1),
    Knob("stop", "str_list", [], 0, 8, doc="Stop when the generated text contains any of these strings."),
    Knob("top_n", "int", 10, 1, 100, doc="How many tokens per stage the trace stores (statistics use the whole vocabulary).", step=1),
]
# The KV cache, whatever the strategy (each strategy's own knobs are in its spec).
_CACHE_KNOBS = [
    Knob("kv_cache", "str", "dynamic", check=lambda key, value: check_kv_cache(key, value),
         doc="KV cache: dynamic | quantized-int8 | quantized-int4 (HQQ) | sliding-<N> (last N positions)."),
    Knob("kv_residual_length", "int", 32, 1, 1024, doc="Quantized KV cache: the most recent positions kept unquantized (flushed when full).", step=1),
]
KNOBS: dict[str, Knob] = {}  # run knobs, every stage's knobs (default stage order), every strategy's, the KV cache's
CONFIG_KEYS: tuple[str, ...] = ()


def _derive() -> None:
    """The stage tables from the registered specs (again after a stage is registered or removed,
    which tests do; ``KNOBS`` is updated in place, so ``from config import KNOBS`` stays current)."""
    global DEFAULT_STAGE_ORDER, STAGE_NAMES, SAMPLING_ONLY_STAGES, CONFIG_KEYS
    DEFAULT_STAGE_ORDER = STAGE_NAMES = tuple(STAGES)
    SAMPLING_ONLY_STAGES = frozenset(name for name, spec in STAGES.items() if spec.sampling_only)
    KNOBS.clear()
    strategy_knobs = [k for s in STRATEGY_SPECS.values() for k in s.knobs]
    KNOBS.update((k.name, k) for k in [*_RUN_KNOBS, *(k for s in declared() for k in s.knobs), *strategy_knobs,
                                       *_CACHE_KNOBS])
    CONFIG_KEYS = ("strategy", *KNOBS, "stage_order")


on_change(_derive)
on_strategies_change(_derive)


def _check_number(knob: Knob, value: Any) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(knob.name, f"expected a number in {knob.range_text()}, got {_short(value)}")
    if isinstance(value, int) and abs(value) > 2**63:  # also keeps repr() of huge ints out of messages
        raise ConfigError(knob.name, f"number too large; allowed {knob.range_text()}")
    if knob.kind == "int":
        if isinstance(value, float):
            if not value.is_integer():
                raise ConfigError(knob.name, f"expected an integer in {knob.range_text()}, got {value!r}")
            value = int(value)
    else:
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(knob.name, f"expected a finite number in {knob.range_text()}, got {value!r}")
    too_low = value <= knob.low if knob.low_open else value < knob.low
    if knob.floor is not None and value != knob.low and abs(value) < knob.floor:
        too_low = True
    if too_low or value > knob.high:
        raise ConfigError(knob.name, f"{_short(value)} is out of range; allowed {knob.range_text()}")
    return value


def check_knob(name: str, value: Any) -> Any:
    """Validate one knob value and return it normalised (ints as int, floats as float); a knob with
    its own ``check`` (a drafter name, a KV cache kind) has it applied after its kind's."""
    knob = KNOBS.get(name)
    if knob is None:
        raise ConfigError(name, f"unknown key; allowed keys: {', '.join(CONFIG_KEYS)}")
    value = _check_kind(knob, value)
    return knob.check(name, value) if knob.check is not None else value


def _check_kind(knob: Knob, value: Any) -> Any:
    name = knob.name
    if knob.kind in ("float", "int"):
        return _check_number(knob, value)
    if knob.kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(name, f"expected true or false, got {_short(value)}")
        return value
    if knob.kind == "choice":
        for choice in knob.choices:
            if value is choice or (not isinstance(value, bool) and not isinstance(choice, bool) and value == choice):
                return choice
        raise ConfigError(name, f"expected one of {knob.range_text()}, got {_short(value)}")
    if knob.kind == "bias_map":
        out = check_bias_map(knob, value)
        for word in out:
            check_text(name, word)
        return out
    if knob.kind == "text":
        if not isinstance(value, str):
            raise ConfigError(name, f"expected {knob.range_text()}, got {_short(value)}")
        return check_text(name, value, max_len=int(knob.high), allow_empty=True)
    if knob.kind == "str":
        if not isinstance(value, str) or not value or len(value) > MAX_STRING_LEN:
            raise ConfigError(name, f"expected {knob.range_text()}, got {_short(value)}")
        return check_text(name, value)
    return _check_str_list(knob, value)


def _check_str_list(knob: Knob, value: Any) -> list[str]:
    # A bare string is refused, not split into characters: stop="abc" is one stop string or an error.
    if isinstance(value, str):
        raise ConfigError(knob.name, f"expected a list of strings, got a single string {_short(value)}; "
                                     f"write [{_short(value)}]")
    if not isinstance(value, (list, tuple)) or len(value) > knob.high:
        raise ConfigError(knob.name, f"expected {knob.range_text()}, got {_short(value)}")
    for item in value:
        if not isinstance(item, str) or not item or len(item) > MAX_STRING_LEN:
            raise ConfigError(knob.name, f"expected {knob.range_text()}, got item {_short(item)}")
        check_text(knob.name, item)
    return list(value)


_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(key: str, value: Any, *, max_len: int = MAX_STRING_LEN, allow_empty: bool = False) -> str:
    """``value`` if it is a string of at most ``max_len`` characters (non-empty unless
    ``allow_empty``) that is valid Unicode; otherwise a ConfigError naming ``key``.

    Lone surrogates ("\\ud800") are refused here, at the boundary: tokenizers, orjson and UTF-8
    encoding all fail on them later with messages that name nothing."""
    if not isinstance(value, str):
        raise ConfigError(key, f"expected text, got {type(value).__name__}")
    if not value and not allow_empty:
        raise ConfigError(key, "empty; give some text")
    if len(value) > max_len:
        raise ConfigError(key, f"{len(value):,} characters is over the {max_len:,}-character limit")
    if not value.isascii():
        bad = _SURROGATE.search(value)
        if bad:
            raise ConfigError(key, f"invalid text: a lone surrogate (U+{ord(bad.group()):04X}) at character "
                                   f"{bad.start()}; send valid Unicode")
    return value


def check_bias_map(knob: Knob, value: Any) -> dict[str, float]:
    """``{token id or word: bias}`` -> a dict with string keys (JSON's own) and float biases.
    A key of decimal digits is a token id; any other string is a word."""
    if not isinstance(value, dict) or len(value) > MAX_BIAS_ENTRIES:
        raise ConfigError(knob.name, f"expected {knob.range_text()}, got {_short(value)}")
    out: dict[str, float] = {}
    for key, bias in value.items():
        if isinstance(key, int) and not isinstance(key, bool) and 0 <= key < 2**31:
            key = str(key)
        if not isinstance(key, str) or not key or len(key) > MAX_STRING_LEN:
            raise ConfigError(knob.name, f"key {_short(key)}: expected a token id or a word of at most "
                                         f"{MAX_STRING_LEN} characters")
        if key.isdigit() and int(key) >= 2**31:
            raise ConfigError(knob.name, f"token id {_short(key)} is too large")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias) \
                or not knob.low <= bias <= knob.high:
            raise ConfigError(knob.name, f"bias for {key!r} is {_short(bias)}; allowed [{knob.low:g}, {knob.high:g}]")
        out[str(int(key)) if key.isdigit() else key] = float(bias)
    return out


def _short(value: Any) -> str:
    """repr() that never fails (huge ints, deep nesting) and never floods a message."""
    try:
        text = repr(value)
    except (ValueError, RecursionError):
        return f"<{type(value).__name__}>"
    return text if len(text) <= 80 else text[:77] + "..."


def check_stage_order(order: Any) -> tuple[str, ...]:
    """A stage order is a list of distinct stage names; stages left out keep their default place
    after the listed ones."""
    if not isinstance(order, (list, tuple)):
        raise ConfigError("stage_order", f"expected a list of stage names, got {_short(order)}")
    seen: list[str] = []
    for name in order:
        if not isinstance(name, str) or name not in STAGE_NAMES:
            raise ConfigError("stage_order", f"unknown stage {_short(name)}; allowed: {', '.join(STAGE_NAMES)}")
        if name in seen:
            raise ConfigError("stage_order", f"stage {name!r} appears twice")
        seen.append(name)
    return tuple(seen) + tuple(s for s in DEFAULT_STAGE_ORDER if s not in seen)


def check_kv_cache(key: str, value: str) -> str:
    """One of KV_CACHE_KINDS or ``sliding-<N>`` with N in SLIDING_WINDOW_RANGE."""
    low, high = SLIDING_WINDOW_RANGE
    digits = value.removeprefix("sliding-") if value.startswith("sliding-") else ""
    if value in KV_CACHE_KINDS or (digits.isascii() and digits.isdigit() and len(digits) <= 6
                                   and low <= int(digits) <= high):
        return value
    raise ConfigError(key, f"expected {' | '.join(KV_CACHE_KINDS)} | sliding-<N> with N in [{low}, {high:,}], "
                           f"got {_short(value)}")


def check_drafter(key: str, value: str, allowed: tuple[str, ...]) -> str:
    """One of ``allowed`` (a strategy's drafter or amateur choices) or ``model:<id or dir>``."""
    if value in allowed or (value.startswith("model:") and len(value) > len("model:")):
        return value
    raise ConfigError(key, f"expected one of {' | '.join(allowed)} | model:<id or dir>, got {value!r}")


# --- API arguments ------------------------------------------------------------------------------------
MAX_ARGUMENT_DEPTH = 32  # nesting of any API argument (a trace is about 8 deep)
_SCALARS = {bool: "true or false", int: "an integer", float: "a number", str: "text", list: "a list",
            dict: "a JSON object"}


def check_flag(key: str, value: Any) -> bool:
    """``value`` if it is True or False (JSON true / false); otherwise a ConfigError naming ``key``:
    "no", 0, NaN and the like are not silently read as a truth value."""
    if value is True or value is False:
        return value
    raise ConfigError(key, f"expected true or false, got {_short(value)}")


_ITEMS = {bool: "true/false", int: "integers", float: "numbers", str: "text"}


def _accepts(kind: type, value: Any, item: type | None = None) -> bool:
    if kind is list and item is not None:
        return isinstance(value, list) and all(_accepts(item, v) for v in value)
    if kind is bool:
        return value is True or value is False
    if kind is int:
        return (isinstance(value, int) and not isinstance(value, bool)) or \
            (isinstance(value, float) and math.isfinite(value) and value.is_integer())
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, kind)


def _kinds(annotation: Any) -> tuple[tuple[tuple[type, type | None], ...], bool] | None:
    """(the plain JSON types an annotation allows, each with its item type when it is a list of a
    plain type, whether None is allowed), or None when the annotation is not made of them (Any, a
    dataclass...): that argument is left to its handler."""
    args = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else (annotation,)
    kinds, optional = [], False
    for arg in args:
        if arg is type(None):
            optional = True
            continue
        plain = typing.get_origin(arg) or arg
        if plain not in _SCALARS:
            return None
        items = typing.get_args(arg) if plain is list else ()
        kinds.append((plain, items[0] if len(items) == 1 and items[0] in _ITEMS else None))
    return tuple(kinds), optional


def _depth_at_most(value: Any, limit: int) -> bool:
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return False
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend((v, depth + 1) for v in item)
    return True


def check_arguments(fn: Any, args: tuple, kwargs: dict) -> None:
    """The boundary of an API function ``fn`` (a function or functools.partial): every argument
    has the JSON type its annotation names (bool exactly True/False, int/float finite numbers, str,
    list, dict; None where the annotation allows it) and is at most MAX_ARGUMENT_DEPTH deep. A
    ConfigError names the first bad argument and its (truncated) value. A list of a plain type
    (``list[str]``) has each item checked too (``[1, 2]`` is not a list of text)."""
    target = fn.func if isinstance(fn, functools.partial) else fn
    try:
        hints = typing.get_type_hints(target)
    except (NameError, TypeError):
        hints = {}
    parameters = [p for p in inspect.signature(fn).parameters.values() if p.name != "control"]
    try:
        bound = inspect.Signature(parameters).bind_partial(*args, **kwargs)
    except TypeError as exc:
        raise ConfigError("arguments", str(exc)[:200]) from None
    for name, value in bound.arguments.items():
        if not _depth_at_most(value, MAX_ARGUMENT_DEPTH):
            raise ConfigError(name, f"nested more than {MAX_ARGUMENT_DEPTH} levels deep")
        found = _kinds(hints.get(name, Any))
        if found is None:
            continue
        kinds, optional = found
        if (value is None and optional) or any(_accepts(kind, value, item) for kind, item in kinds):
            continue
        allowed = " or ".join([_SCALARS[k] for k, _ in kinds] + (["null"] if optional else []))
        items = "".join(f" (each item {_ITEMS[i]})" for _, i in kinds if i)
        raise ConfigError(name, f"expected {allowed}{items}, got {_short(value)}")


@dataclass(frozen=True, init=False)
class DecodingConfig:
    """Everything that decides a decoding run. Construct with ``DecodingConfig.from_dict`` or
    directly (``DecodingConfig(strategy="sample", temperature=0.7)``); both validate. Field names
    follow transformers' GenerationConfig where one exists.

    The run knobs are fields. Each stage's and each strategy's knobs are declared by its spec
    (engine/stages/, engine/strategies/), not here: their values live in ``spec_knobs`` and read
    as attributes (``config.temperature``, ``config.num_beams``), so adding a stage or a strategy
    adds its knobs without touching this class."""

    strategy: str = "sample"
    seed: int = 0
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()
    top_n: int = 10
    kv_cache: str = "dynamic"
    kv_residual_length: int = 32
    stage_order: tuple[str, ...] = ()  # () or left out: the default order
    spec_knobs: dict[str, Any] = field(default_factory=dict)  # every stage and strategy knob's value, by name

    def __init__(self, strategy: str = "sample", **values: Any):
        """Keyword arguments: any config key (an unknown one is a TypeError, as for a dataclass);
        ``spec_knobs``: stage and strategy knob values to start from (``dataclasses.replace`` passes it)."""
        stage = {name: knob.neutral for name, knob in KNOBS.items() if _declared_by_spec(knob)}
        stage.update((k, v) for k, v in (values.pop("spec_knobs", None) or {}).items() if k in stage)
        object.__setattr__(self, "strategy", strategy)
        for name, default in _FIELD_DEFAULTS.items():
            object.__setattr__(self, name, values.pop(name, default))
        for name in values:
            if name not in stage:
                raise TypeError(f"DecodingConfig.__init__() got an unexpected keyword argument {name!r}")
        stage.update(values)
        object.__setattr__(self, "spec_knobs", stage)
        self._validate()

    def __getattr__(self, name: str) -> Any:
        """A stage or strategy knob's value (only called when ``name`` is not a field)."""
        stage = self.__dict__.get("spec_knobs")
        if stage is not None:
            if name in stage:
                return stage[name]
            knob = KNOBS.get(name)
            if knob is not None and _declared_by_spec(knob):  # registered after this config was made
                return knob.neutral
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __repr__(self) -> str:
        values = [f"strategy={self.strategy!r}"] + [f"{name}={getattr(self, name)!r}" for name in KNOBS]
        return f"DecodingConfig({', '.join(values)}, stage_order={self.stage_order!r})"

    def _validate(self) -> None:
        if not isinstance(self.strategy, str) or self.strategy not in STRATEGIES:
            raise ConfigError("strategy", f"expected one of {' | '.join(STRATEGIES)}, got {_short(self.strategy)}")
        for name, knob in KNOBS.items():  # direct construction is checked exactly like from_dict (no list() coercion)
            value = check_knob(name, getattr(self, name))
            if knob.kind == "str_list":
                value = tuple(value)
            if _declared_by_spec(knob):
                self.spec_knobs[name] = value
            else:
                object.__setattr__(self, name, value)
        object.__setattr__(self, "stage_order", check_stage_order(self.stage_order or DEFAULT_STAGE_ORDER))
        check = STRATEGIES[self.strategy].check
        if check is not None:  # the strategy's knobs together (beam: num_return_sequences <= num_beams, ...)
            check(self)
        for spec in STAGES.values():  # each stage's knobs together (the grammar's text read as its kind says)
            if spec.check is not None:
                spec.check(self)

    # --- construction and serialisation -------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Any) -> "DecodingConfig":
        """Strict: unknown keys and wrong types raise ConfigError naming the key."""
        if not isinstance(data, dict):
            raise ConfigError("config", f"expected a JSON object, got {type(data).__name__}")
        unknown = [k for k in data if k not in CONFIG_KEYS]
        if unknown:
            key = unknown[0]  # echoed quoted unless it is a plain identifier (no markup, no surrogates)
            label = key if isinstance(key, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,39}", key) else _short(key)
            raise ConfigError(label, f"unknown key; allowed keys: {', '.join(CONFIG_KEYS)}")
        kwargs = dict(data)
        for name, value in kwargs.items():
            if name in KNOBS and KNOBS[name].kind == "str_list":
                kwargs[name] = tuple(check_knob(name, value))
        if "strategy" in kwargs and not isinstance(kwargs["strategy"], str):
            raise ConfigError("strategy", f"expected one of {' | '.join(STRATEGIES)}, got {_short(kwargs['strategy'])}")
        return cls(**kwargs)

    def to_dict(self, sparse: bool = False) -> dict[str, Any]:
        """JSON-ready dict. ``sparse`` keeps only keys that differ from their neutral value
        (strategy is always kept)."""
        out: dict[str, Any] = {"strategy": self.strategy}
        for name, knob in KNOBS.items():
            value = getattr(self, name)
            if knob.kind == "str_list":
                value = list(value)
            if not sparse or value != knob.neutral:
                out[name] = value
        if not sparse or self.stage_order != DEFAULT_STAGE_ORDER:
            out["stage_order"] = list(self.stage_order)
        return out

    def replace(self, **changes: Any) -> "DecodingConfig":
        """A copy with some keys changed (validated like from_dict)."""
        merged = self.to_dict()
        merged.update(changes)
        return DecodingConfig.from_dict(merged)

    @property
    def is_greedy(self) -> bool:
        """Greedy pick: the greedy strategy, or temperature 0 under any sampling strategy."""
        return self.strategy == "greedy" or self.temperature == 0.0

    def active_stages(self) -> tuple[str, ...]:
        """The stage names that will actually change the distribution, in the user's order."""
        return tuple(name for name in self.stage_order if _stage_is_active(self, name))


# The fields other than strategy and spec_knobs, with their defaults (DecodingConfig.__init__).
_FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(DecodingConfig)
                   if f.name not in ("strategy", "spec_knobs")}


def _declared_by_spec(knob: Knob) -> bool:
    """A stage's or a strategy's knob (kept in ``spec_knobs``), not a field of DecodingConfig."""
    return knob.stage is not None or knob.strategy is not None


def _stage_is_active(cfg: DecodingConfig, stage: str) -> bool:
    """The stage changes this config's distribution: registered, not dropped by greedy decoding
    (sampling-only), and active by its spec."""
    spec = STAGES.get(stage)
    return spec is not None and not (cfg.is_greedy and spec.sampling_only) and spec.is_active(cfg)


def parse_set_value(key: str, text: str) -> Any:
    """Parse a ``--set KEY=VALUE`` string into the knob's type (JSON-ish, never eval)."""
    import json

    check_text("--set", key, max_len=64)
    check_text(key, text, max_len=MAX_STRING_LEN * 64, allow_empty=True)

    if key == "strategy" or (key in KNOBS and KNOBS[key].kind in ("str", "text")):
        return text
    if key in KNOBS and KNOBS[key].kind == "str_list":
        if text.startswith("["):
            try:
                return json.loads(text)
            except json.JSONDecodeError as exc:
                raise ConfigError(key, f"not a JSON list: {exc.msg}") from None
            except ValueError:  # an integer literal too long to convert
                raise ConfigError(key, "not a JSON list of strings") from None
        return [s for s in text.split(",") if s] if text else []
    if key == "stage_order":
        return [s.strip() for s in text.split(",") if s.strip()]
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if len(text) > 64:  # no knob's number needs more; also keeps int("9" * 5000) out of json.loads
        raise ConfigError(key, f"value of {len(text):,} characters is too long")
    try:
        return json.loads(text)
    except ValueError:
        return text  # let the knob validation name the problem
