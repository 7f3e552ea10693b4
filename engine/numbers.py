"""How a probability or a probability mass is written, everywhere a person reads one (issue #35).

Rounding must never hide a number: a chosen token at p = 3e-5 written "0.0%", a slice
[0.90512, 0.90513) written "[0.905, 0.905)", or a near-certain 0.99996 written "100.0%" each says
something false. The rule, one place for the engine's sentences and the playground's charts:

- ``percent(p)``: one decimal place (``27.9%``) down to 1%, then two significant digits
  (``0.53%``, ``0.00066%``; below 1e-6 %, ``6.6e-08%``); exactly 0 is ``0%`` and exactly 1 is
  ``100%``; a value that one decimal would round to 100% (or to 0%) gets the digits it needs.
- ``decimal(x)``: a plain probability in [0, 1] (p and q of a speculative draft, a draw u):
  ``digits`` decimal places, or two significant digits for a small non-zero value.
- ``interval(low, high)``: a slice of [0, 1) with the digits that keep its two ends apart.

NaN or None reads "unknown" (a served model's p outside its top-N is unknown, not 0).
"""

from __future__ import annotations

import math

UNKNOWN = "unknown"
MAX_DECIMALS = 12  # past this a float's digits are noise


def _unknown(value: float | None) -> bool:
    return value is None or isinstance(value, bool) or not math.isfinite(value)


def _significant(value: float, digits: int = 2) -> str:
    """``value`` > 0 with ``digits`` significant digits, in decimal while it stays short."""
    if value < 1e-6:
        return f"{value:.{digits - 1}e}"
    places = digits - 1 - math.floor(math.log10(value))
    return f"{value:.{max(0, places)}f}"


def percent(p: float | None) -> str:
    """``p`` (a probability or a mass in [0, 1]) as a percentage; see the module doc."""
    if p is None or _unknown(p):
        return UNKNOWN
    if p == 0 or p == 1:
        return f"{p:.0%}"
    sign, p = ("−", -p) if p < 0 else ("", p)
    value = p * 100
    if value < 1:
        return f"{sign}{_significant(value)}%"
    places = 1
    while places < MAX_DECIMALS and p < 1 and float(f"{value:.{places}f}") >= 100:
        places += 1  # 99.996% is not 100.0%
    return f"{sign}{value:.{places}f}%"


def decimal(x: float | None, digits: int = 3) -> str:
    """``x`` with ``digits`` decimal places; a non-zero value those would write as 0 (or as 1,
    when it is below 1) gets two significant digits of itself (or of 1 − x)."""
    if x is None or _unknown(x):
        return UNKNOWN
    text = f"{x:.{digits}f}"
    if x != 0 and float(text) == 0:
        return ("-" if x < 0 else "") + _significant(abs(x))
    if 0 < x < 1 and float(text) >= 1:
        places = digits
        while places < MAX_DECIMALS and float(f"{x:.{places}f}") >= 1:
            places += 1
        return f"{x:.{places}f}"
    return text


def interval_places(low: float, high: float, digits: int = 3) -> int:
    """Decimal places that write [low, high) with two significant digits of its width (at least
    ``digits``), so two different ends never read the same."""
    width = high - low
    if not width > 0 or not math.isfinite(width):
        return digits
    return min(MAX_DECIMALS, max(digits, 1 - math.floor(math.log10(width))))


def interval(low: float | None, high: float | None, digits: int = 3) -> str:
    """The slice [low, high) of [0, 1), e.g. "[0.300, 0.512)" or "[0.905120, 0.905130)"."""
    if low is None or high is None or _unknown(low) or _unknown(high):
        return f"[{UNKNOWN})"
    places = interval_places(low, high, digits)
    return f"[{low:.{places}f}, {high:.{places}f})"
