"""Compare lanes as data: a lane's settings (strategy + ``key = value`` lines, the CLI's ``--set``
syntax), turning them into validated configs, lane list operations, and the last run's results.
Pure: no Gradio, no model."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Sequence

from engine.config import KNOBS, ConfigError, DecodingConfig, parse_set_value
from engine.metrics import first_divergence
from engine.trace import Trace

from ...shared import UserError, config_or_error
from ...user_presets import find_preset

MIN_LANES, MAX_LANES = 2, 6
MAX_SWEEP_SEEDS = 16
SHARED_KEYS = ("seed", "max_new_tokens")  # set once for all lanes, not per lane
# Presets offered, in order, to each new lane (the first one not already in use).
LANE_PRESETS = ("greedy", "balanced", "contrastive-search", "min-p", "creative", "anti-repetition")


@dataclass(frozen=True)
class LaneSpec:
    """A lane's settings as the page holds them: preset label, strategy, ``key = value`` lines."""

    preset: str
    strategy: str
    knobs: str


def lane_name(i: int) -> str:
    return f"Lane {i + 1}"


def format_knobs(cfg: DecodingConfig) -> str:
    """The config's non-neutral knobs (strategy and shared keys left out) as ``key = value`` lines."""
    lines = []
    for key, value in cfg.to_dict(sparse=True).items():
        if key == "strategy" or key in SHARED_KEYS:
            continue
        if key == "stage_order":
            text = ", ".join(value)
        elif isinstance(value, bool):
            text = str(value).lower()
        elif isinstance(value, list):
            text = json.dumps(value, ensure_ascii=False)
        else:
            text = str(value)
        lines.append(f"{key} = {text}")
    return "\n".join(lines)


def parse_knobs(text: str, name: str) -> dict[str, Any]:
    """``key = value`` lines -> a config dict (types as the CLI's --set; the config validates)."""
    out: dict[str, Any] = {}
    for number, line in enumerate((text or "").splitlines(), start=1):
        if not line.strip() or line.strip().startswith("#"):
            continue
        key, sep, value = line.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise UserError(f"{name}, line {number}: expected key = value, got {line.strip()[:60]!r}")
        if key in SHARED_KEYS:
            raise UserError(f"{name}: {key} is shared by all lanes; set it above the lanes")
        if key == "strategy":
            raise UserError(f"{name}: pick the strategy in the lane's strategy menu, not in its knobs")
        try:
            out[key] = parse_set_value(key, value)
        except ConfigError as exc:
            raise UserError(f"{name}: {exc}") from None
    return out


def lane_config(spec: LaneSpec, name: str, seed: Any, max_new_tokens: Any) -> DecodingConfig:
    """A lane's validated config; errors name the lane and the key."""
    values = {"strategy": spec.strategy, **parse_knobs(spec.knobs, name), "seed": _int(seed),
              "max_new_tokens": _int(max_new_tokens)}
    try:
        return config_or_error(values)
    except UserError as exc:
        raise UserError(f"{name}: {exc}") from None


def _int(value: Any) -> Any:
    """Number inputs send floats; a whole float becomes an int (anything else is left to validation)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def spec_from_preset(choice: str, user_presets: Sequence[dict] | None = None) -> LaneSpec | None:
    preset = find_preset(choice, user_presets)
    if preset is None:
        return None
    return LaneSpec(choice, preset.config.strategy, format_knobs(preset.config))


def default_spec(used: Sequence[LaneSpec]) -> LaneSpec:
    """The first of LANE_PRESETS no lane uses yet (the first one if all are used)."""
    taken = {s.preset for s in used}
    choice = next((p for p in LANE_PRESETS if p not in taken), LANE_PRESETS[0])
    return spec_from_preset(choice)


def add_lane(specs: Sequence[Any], new: Any) -> list:
    if len(specs) >= MAX_LANES:
        raise UserError(f"lanes: at most {MAX_LANES}; remove one first")
    return [*specs, new]


def duplicate_lane(specs: Sequence[Any], i: int, copy: Any = None) -> list:
    """Insert a copy of lane i right after it (``copy`` replaces the copied value, e.g. None for results)."""
    if len(specs) >= MAX_LANES:
        raise UserError(f"lanes: at most {MAX_LANES}; remove one first")
    return [*specs[:i + 1], specs[i] if copy is None else copy, *specs[i + 1:]]


def remove_lane(specs: Sequence[Any], i: int) -> list:
    if len(specs) <= MIN_LANES:
        raise UserError(f"lanes: at least {MIN_LANES} to compare")
    return [*specs[:i], *specs[i + 1:]]


def sweep_seeds(seed: int, count: Any) -> list[int]:
    count = _int(count)
    if not isinstance(count, int) or not 2 <= count <= MAX_SWEEP_SEEDS:
        raise UserError(f"seeds: expected an integer in [2, {MAX_SWEEP_SEEDS}], got {count!r}")
    top = int(KNOBS["seed"].high)
    return [(seed + k) % (top + 1) for k in range(count)]


@dataclass
class CompareSession:
    """The last run: lane names, their traces (None: not run or failed) and errors."""

    traces: list[Trace | None] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    max_new_tokens: int = 0

    def done(self) -> list[tuple[str, Trace]]:
        return [(lane_name(i), t) for i, t in enumerate(self.traces) if t is not None and t.steps]

    def divergence(self) -> int | None:
        finished = [t for _, t in self.done()]
        return first_divergence([t.generated_token_ids for t in finished]) if len(finished) >= 2 else None
