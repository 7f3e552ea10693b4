"""The draws processor's arguments (a request's ``vllm_xargs``) read into a bounded, typed record (issue #50).

Whoever reaches the server writes these values, and the processor runs inside vLLM's engine core, where
an exception ends the engine and every user's request with it: ``draw_args`` checks every field's type,
size and range before anything is converted, and answers a ``DrawArgs`` or None (the request is then
left as vLLM answers it). It never raises. Only the standard library and torch: it loads beside
dp_draws.py in vLLM's environment (deploy/vllm_serve.py puts this folder on the server's PYTHONPATH),
and our own tests fuzz it without vLLM.

- ``dp_state``: base64 text (ASCII, 6,744 characters) of exactly 5,056 bytes that torch takes as a CPU
  generator's state;
- ``dp_top`` (default 100): an integer in [1, 1000]: an int, an integral float or plain ASCII digits
  (never a bool, inf, nan, a fraction or another script's digits);
- ``dp_chain`` (default none): JSON text of at most 2,048 characters (no NaN or Infinity), a list of at
  most 16 ``[name, value]`` pairs, each name one of ``STAGE_BOUNDS``'s and each value a finite number in
  that stage's bounds: those our engine allows an active stage (engine/stages' knobs and constructors;
  tests/remote/test_vllm_plugin_args.py checks them against the engine).
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

STATE_BYTES = 5056  # a torch CPU (mt19937) generator's state
STATE_CHARS = 4 * math.ceil(STATE_BYTES / 3)  # its base64, padding included
MAX_TOP = 1000
DEFAULT_TOP = 100
MAX_TOP_DIGITS = 4
MAX_STAGES = 16
MAX_CHAIN_CHARS = 2048  # 16 stages with 17-digit values take under 700


class Bounds(NamedTuple):
    """A stage value's type and range: ``low``/``high`` included unless ``low_open``/``high_open``."""

    integer: bool
    low: float
    high: float
    low_open: bool = False
    high_open: bool = False

    def holds(self, value: int | float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below


# What the engine lets a run send for an active stage: temperature 0 or [0.01, 5] (0 is greedy, which
# sends no draws), top_k [1, 100000] (0 is off), top_p (0, 1], min_p [0, 1], typical_p (0, 1) (1 is off,
# and transformers' TypicalLogitsWarper refuses it).
STAGE_BOUNDS = {
    "temperature": Bounds(False, 0.01, 5.0),
    "top_k": Bounds(True, 1, 100_000),
    "top_p": Bounds(False, 0.0, 1.0, low_open=True),
    "min_p": Bounds(False, 0.0, 1.0),
    "typical_p": Bounds(False, 0.0, 1.0, low_open=True, high_open=True),
}


@dataclass(frozen=True)
class DrawArgs:
    """One request's checked arguments: its generator (set to the sent state), its stages in order
    (``(name, value)``: an int for top_k, a float otherwise, each in STAGE_BOUNDS) and its top-N."""

    generator: torch.Generator
    chain: tuple[tuple[str, int | float], ...]
    top: int


def draw_args(extra: Any) -> DrawArgs | None:
    """``extra`` (a request's ``vllm_xargs``) as DrawArgs, or None: not ours (no ``dp_state``) or any
    field malformed."""
    if not isinstance(extra, dict) or "dp_state" not in extra:
        return None
    generator = parse_state(extra["dp_state"])
    top = parse_top(extra.get("dp_top", DEFAULT_TOP))
    chain = parse_chain(extra.get("dp_chain", "[]"))
    if generator is None or top is None or chain is None:
        return None
    return DrawArgs(generator, chain, top)


def parse_state(value: Any) -> torch.Generator | None:
    """A CPU generator set to ``value`` (base64 of a 5,056-byte state torch takes), or None."""
    if not isinstance(value, str) or len(value) != STATE_CHARS or not value.isascii():
        return None
    try:
        state = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return None
    if len(state) != STATE_BYTES:
        return None
    generator = torch.Generator()
    try:
        generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    except (RuntimeError, ValueError):  # torch checks the mt19937 position fields
        return None
    return generator


def parse_top(value: Any) -> int | None:
    """``value`` as an integer in [1, MAX_TOP], or None."""
    if isinstance(value, str):
        if not 0 < len(value) <= MAX_TOP_DIGITS or not (value.isascii() and value.isdigit()):
            return None
        value = int(value)
    number = integral(value)
    return number if number is not None and 1 <= number <= MAX_TOP else None


def integral(value: Any) -> int | None:
    """``value`` as an int when it is one (an int or a finite float with no fraction; never a bool)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return None


def parse_chain(value: Any) -> tuple[tuple[str, int | float], ...] | None:
    """``value`` (JSON text of ``[[name, value], ...]``) as checked stages, or None."""
    if not isinstance(value, str) or len(value) > MAX_CHAIN_CHARS:
        return None
    try:
        stages = json.loads(value, parse_constant=refuse_constant)
    except (ValueError, RecursionError):  # bad JSON, NaN/Infinity, nesting past the interpreter's limit
        return None
    if not isinstance(stages, list) or len(stages) > MAX_STAGES:
        return None
    chain = []
    for pair in stages:
        if not isinstance(pair, list) or len(pair) != 2 or not isinstance(pair[0], str):
            return None
        checked = stage_value(pair[0], pair[1])
        if checked is None:
            return None
        chain.append((pair[0], checked))
    return tuple(chain)


def refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number")


def stage_value(name: str, value: Any) -> int | float | None:
    """``value`` for stage ``name`` (an int for an integer stage, a float otherwise) within its bounds,
    or None: an unknown stage, a bool, a non-number, inf/nan or out of range. Compared before any
    conversion, so an int too big for a float is refused, not raised on."""
    bounds = STAGE_BOUNDS.get(name)
    if bounds is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if bounds.integer:
        number = integral(value)
        return number if number is not None and bounds.holds(number) else None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return float(value) if bounds.holds(value) else None
