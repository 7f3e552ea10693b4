"""The deployment's numeric settings (``DP_*`` environment variables): one parser, one rule.

Every integer or seconds setting is read through ``env_int`` / ``env_seconds``: unset or empty
means the default; anything else must be a whole number at or above the setting's minimum, or the
read raises ``SettingsError`` naming the variable and its value. ``check_environment`` reads them
all once when the app starts, so a bad value refuses to start with one line instead of starting
and failing every run (``DP_MAX_BATCH=0`` used to start with concurrency 16, then every run failed).
"""

from __future__ import annotations

import os
from typing import Mapping

# name -> smallest allowed value (the defaults live with the code that uses each one).
INTEGER_SETTINGS = {
    "DP_MAX_BATCH": 1,         # rows in one batched forward (engine.scheduler)
    "DP_MAX_QUEUE": 0,         # runs waiting for a row (engine.scheduler)
    "DP_CONCURRENCY": 1,       # model events at once (playground.events)
    "DP_SESSIONS": 1,          # sessions whose state is kept (playground.events)
    "DP_RUNS_PER_SESSION": 1,  # model requests one page may have in flight (playground.events)
    "DP_GPU_SECONDS": 1,       # ZeroGPU booking per request (playground.events)
    "DP_QUEUE_SIZE": 1,        # Gradio queue size (playground.app)
}
SECONDS_SETTINGS = {"DP_REQUEST_SECONDS"}  # a number >= 0; 0 means no limit (engine.control)


class SettingsError(ValueError):
    """A ``DP_*`` variable holds a value the app cannot run with."""


def _text(name: str, environ: Mapping[str, str] | None) -> str:
    return (os.environ if environ is None else environ).get(name, "").strip()


def env_int(name: str, default: int, minimum: int | None = None, environ: Mapping[str, str] | None = None) -> int:
    """The integer setting ``name`` (unset or empty: ``default``). ``minimum`` defaults to the
    setting's entry in INTEGER_SETTINGS."""
    minimum = INTEGER_SETTINGS.get(name, 0) if minimum is None else minimum
    text = _text(name, environ)
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise SettingsError(f"{name}: expected an integer >= {minimum}, got {text[:40]!r}") from None
    if value < minimum:
        raise SettingsError(f"{name}: expected an integer >= {minimum}, got {value}")
    return value


def env_seconds(name: str, default: float, environ: Mapping[str, str] | None = None) -> float:
    """A time limit in seconds (unset or empty: ``default``; 0 means none)."""
    text = _text(name, environ)
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise SettingsError(f"{name}: expected a number of seconds >= 0, got {text[:40]!r}") from None
    if not value >= 0 or value == float("inf"):  # NaN fails the comparison
        raise SettingsError(f"{name}: expected a number of seconds >= 0, got {text[:40]!r}")
    return value


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Read every numeric setting once; the first bad one raises SettingsError (one line)."""
    for name in INTEGER_SETTINGS:
        env_int(name, 0, environ=environ)
    for name in SECONDS_SETTINGS:
        env_seconds(name, 0.0, environ=environ)
