"""A configuration key and its error: ``Knob`` (kind, bounds, neutral value, doc) and ``ConfigError``
(names the key). Every knob is declared by the spec that owns it (a stage's, a strategy's) or by
``engine.config`` (the run and KV-cache knobs); ``config.KNOBS`` collects them and validates.

On the base floor: no engine import, so the specs, the config and every room can read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

MAX_STRING_LEN = 200
MAX_BIAS_ENTRIES = 64


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the key, the value and what is allowed."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}")


@dataclass(frozen=True)
class Knob:
    """One configuration key: its type, bounds, neutral value and a one-line doc for the UI."""

    name: str
    kind: str  # "float" | "int" | "bool" | "str" | "text" | "str_list" | "choice" | "bias_map"
    neutral: Any
    low: float = 0.0  # bounds: read only by the kinds that have them (numbers, lists, texts, bias maps)
    high: float = 0.0
    low_open: bool = False  # True: low itself is not allowed
    # Smallest allowed non-zero magnitude ("0 or >= floor"): keeps 1/T and logit/penalty away from
    # float underflow, which turns a whole distribution into NaN.
    floor: float | None = None
    choices: tuple = ()
    doc: str = ""
    stage: str | None = None  # the stage this knob drives, if any (a StageSpec sets it on its knobs)
    strategy: str | None = None  # the strategy that owns it, if any (a StrategySpec sets it on its knobs)
    check: Callable[[str, Any], Any] | None = None  # further check of a valid value (key, value) -> value
    step: float | None = None  # UI slider step
    widget: str = ""  # the knob panel's control: "" (by kind), "number" (a box, no slider), "json" (a JSON list)

    def range_text(self) -> str:
        if self.kind == "int":
            return f"[{int(self.low)}, {int(self.high)}]"
        if self.kind == "float":
            left = "(" if self.low_open else "["
            if self.floor is not None:
                return f"{self.low:g} or [{self.floor:g}, {self.high:g}]"
            return f"{left}{self.low:g}, {self.high:g}]"
        if self.kind == "choice":
            return " | ".join(str(c).lower() if isinstance(c, bool) else str(c) for c in self.choices)
        if self.kind == "str_list":
            return f"a list of at most {int(self.high)} strings of at most {MAX_STRING_LEN} characters"
        if self.kind == "bias_map":
            return (f"an object of at most {MAX_BIAS_ENTRIES} entries {{token id or word: bias in "
                    f"[{self.low:g}, {self.high:g}]}}")
        if self.kind == "str":
            return f"a string of at most {MAX_STRING_LEN} characters"
        if self.kind == "text":  # a longer text, lines and all (a grammar); empty is its neutral value
            return f"a text of at most {int(self.high):,} characters"
        return "true | false"
