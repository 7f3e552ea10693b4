"""Compare lanes as data: a lane's settings (preset label, strategy, one value per lane control
and a JSON object of any other knobs), turning them into validated configs, lane list operations,
and the last run's results. No model here; validation is the Step view's (playground.knobs)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Sequence

from engine.backends.served import RemoteLabel
from engine.base.seam import Model
from engine.config import KNOBS, ConfigError, DecodingConfig, check_knob
from engine.reports.metrics import first_divergence
from engine.trace import Trace

from ...knobs import checked_values, display_value, knob_errors_text
from ...shared import UserError, config_or_error
from ...user_presets import CUSTOM, find_preset

MIN_LANES, MAX_LANES = 2, 6
MAX_SWEEP_SEEDS = 16
MAX_MORE_CHARS = 4_000
# The knobs every lane shows as a control of its own; any other knob goes in the lane's "more" JSON.
LANE_KNOBS = ("temperature", "top_k", "top_p", "min_p", "seed", "max_new_tokens")
RUN_KNOBS = ("seed", "max_new_tokens")  # a new lane or a picked preset keeps the lane's own
LANE_FIELDS = ("preset", "strategy", *LANE_KNOBS, "more")  # a lane's controls, in the page's order
START_BUDGET = 32  # max_new_tokens of the lanes on a fresh page (short runs, on a CPU)
# Presets offered, in order, to each new lane (the first one not already in use).
LANE_PRESETS = ("greedy", "balanced", "contrastive-search", "min-p", "creative", "anti-repetition")


@dataclass(frozen=True)
class LaneSpec:
    """A lane's settings as the page holds them: preset label, strategy, the LANE_KNOBS controls'
    values (as typed: may be anything) and the "more knobs" JSON text."""

    preset: str
    strategy: str
    knobs: tuple
    more: str = ""

    @classmethod
    def from_values(cls, values: Sequence[Any]) -> "LaneSpec":
        """One lane's control values, in LANE_FIELDS order."""
        preset, strategy, *rest = values
        return cls(preset, strategy, tuple(rest[:len(LANE_KNOBS)]), rest[len(LANE_KNOBS)] or "")

    def values(self) -> tuple:
        """The controls' values, in LANE_FIELDS order."""
        return (self.preset, self.strategy, *self.knobs, self.more)

    def knob(self, name: str) -> Any:
        return self.knobs[LANE_KNOBS.index(name)]


def lane_name(i: int) -> str:
    return f"Lane {i + 1}"


def spec_from_config(cfg: DecodingConfig, label: str = CUSTOM) -> LaneSpec:
    """A config shown in a lane: its LANE_KNOBS in the controls, every other non-neutral knob in
    the JSON box."""
    knobs = tuple(display_value(KNOBS[n], getattr(cfg, n)) for n in LANE_KNOBS)
    rest = {k: v for k, v in cfg.to_dict(sparse=True).items() if k != "strategy" and k not in LANE_KNOBS}
    return LaneSpec(label, cfg.strategy, knobs, json.dumps(rest, ensure_ascii=False) if rest else "")


def parse_more(text: Any) -> tuple[dict[str, Any], list[str]]:
    """The "more knobs" box: a strict JSON object of knobs -> (values, one message per bad knob)."""
    if text is None or (isinstance(text, str) and not text.strip()):
        return {}, []
    if not isinstance(text, str) or len(text) > MAX_MORE_CHARS:
        return {}, [f"more knobs: expected a JSON object of at most {MAX_MORE_CHARS:,} characters"]

    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not allowed")

    try:
        data = json.loads(text, parse_constant=no_constants)
    except ValueError as exc:
        return {}, [f"more knobs: not valid JSON ({str(exc)[:80]}); expected an object such as "
                    '{"repetition_penalty": 1.3}']
    if not isinstance(data, dict):
        return {}, [f"more knobs: expected a JSON object of knobs, got a JSON {type(data).__name__}"]
    out, errors = {}, []
    for key, value in data.items():
        if key == "strategy" or key in LANE_KNOBS:
            errors.append(f"more knobs: {key} has its own control in the lane; set it there")
        elif key == "stage_order":
            out[key] = value  # the config checks the order as a whole
        else:
            try:
                out[key] = check_knob(key, value)
            except ConfigError as exc:
                errors.append(str(exc))
    return out, errors


def lane_config(spec: LaneSpec, name: str) -> DecodingConfig:
    """A lane's validated config; the one-line error names the lane, then every bad knob and value."""
    knobs, errors = checked_values(LANE_KNOBS, spec.knobs)
    more, more_errors = parse_more(spec.more)
    errors += more_errors
    if errors:
        raise UserError(f"{name}: {knob_errors_text(errors)}")
    try:
        return config_or_error({"strategy": spec.strategy, **knobs, **more})
    except UserError as exc:
        raise UserError(f"{name}: {exc}") from None


def spec_from_preset(choice: str, user_presets: Sequence[dict] | None = None,
                     keep: LaneSpec | None = None) -> LaneSpec | None:
    """A preset shown in a lane; ``keep``: the lane whose seed and max_new_tokens stay (a preset
    changes the knobs, not the run); else the preset's seed and the start budget."""
    preset = find_preset(choice, user_presets)
    if preset is None:
        return None
    spec = spec_from_config(preset.config, choice)
    run = {n: keep.knob(n) for n in RUN_KNOBS} if keep else {"max_new_tokens": START_BUDGET}
    return LaneSpec(spec.preset, spec.strategy, tuple(run.get(n, v) for n, v in zip(LANE_KNOBS, spec.knobs)), spec.more)


def default_spec(used: Sequence[LaneSpec]) -> LaneSpec:
    """The first of LANE_PRESETS no lane uses yet (the first one if all are used), with the last
    lane's seed and max_new_tokens, so lanes compare on one seed and budget unless changed."""
    taken = {s.preset for s in used}
    choice = next((p for p in LANE_PRESETS if p not in taken), LANE_PRESETS[0])
    spec = spec_from_preset(choice, keep=used[-1] if used else None)
    if spec is None:
        raise ValueError(f"lanes: the built-in preset {choice!r} is missing")
    return spec


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


def _int(value: Any) -> Any:
    """Number inputs send floats; a whole float becomes an int (anything else is left to validation)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def sweep_seeds(seed: int, count: Any) -> list[int]:
    count = _int(count)
    if not isinstance(count, int) or not 2 <= count <= MAX_SWEEP_SEEDS:
        raise UserError(f"seeds: expected an integer in [2, {MAX_SWEEP_SEEDS}], got {count!r}")
    top = int(KNOBS["seed"].high)
    return [(seed + k) % (top + 1) for k in range(count)]


def served_words(model: str, mode: str) -> str:
    """A served lane's model and mode in words, as its status line ends."""
    return f"on {model}" + (" (fast mode: its own sampler)" if mode == "fast" else "")


def lane_served_words(lm: Model) -> str:
    """Where a lane's model runs, in words: "" on our own engine, else its server (and its mode: fast
    when the server's sampler picks)."""
    if lm.capabilities.in_process:
        return ""
    return served_words(lm.name, "step" if lm.capabilities.our_chain else "fast")


# A lane's phase in a run: each lane's status line is drawn from its own phase, never from which
# lane the last update came from.
WAITING, RUNNING, DONE, STOPPED, FAILED = "waiting", "running", "done", "stopped", "failed"


@dataclass
class CompareSession:
    """The last run: lane names, their traces (None: not run or failed; while running or after a
    Stop, the partial trace of the tokens so far) and errors; ``budgets``: each lane's
    max_new_tokens (else ``max_new_tokens`` for all); ``phases``: each lane's phase (WAITING ...
    FAILED; missing: read from its trace and error); ``stopped``: why the run stopped early
    (RunStopped's reason: "cancelled" | "time_limit"; "" if it did not)."""

    traces: list[Trace | None] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    max_new_tokens: int = 0
    budgets: list[int] = field(default_factory=list)
    phases: list[str] = field(default_factory=list)
    stopped: str = ""
    progress: list[int] = field(default_factory=list)  # while running: each lane's tokens (a beam: search steps) so far
    served: list[str] = field(default_factory=list)  # each lane's served model in words ("" on our engine)

    def budget(self, i: int) -> int:
        return self.budgets[i] if i < len(self.budgets) else self.max_new_tokens

    def on(self, i: int) -> str:
        """Where lane ``i`` runs, in words: its served model (and mode), "" on our own engine."""
        if i < len(self.served):
            return self.served[i]
        trace = self.traces[i] if i < len(self.traces) else None
        label = RemoteLabel.of(trace) if trace is not None else None
        return served_words(trace.model, label.mode) if trace is not None and label is not None else ""

    def made(self, i: int) -> int:
        """Lane ``i``'s tokens so far (a beam search's: its search steps, its tokens come at the end)."""
        trace = self.traces[i] if i < len(self.traces) else None
        return max(len(trace.steps) if trace else 0, self.progress[i] if i < len(self.progress) else 0)

    def phase(self, i: int) -> str:
        """Lane ``i``'s phase: its own, else FAILED with an error, DONE with a trace, WAITING."""
        if i < len(self.phases):
            return self.phases[i]
        if i < len(self.errors) and self.errors[i]:
            return FAILED
        return DONE if i < len(self.traces) and self.traces[i] is not None else WAITING

    @property
    def running(self) -> bool:
        """Whether a run is under way (a lane is running; a lane added since the last run waits)."""
        return RUNNING in self.phases

    def done(self) -> list[tuple[str, Trace]]:
        return [(lane_name(i), t) for i, t in enumerate(self.traces) if t is not None and t.steps]

    def divergence(self) -> int | None:
        finished = [t for _, t in self.done()]
        return first_divergence([t.generated_token_ids for t in finished]) if len(finished) >= 2 else None
