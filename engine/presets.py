"""Presets: one JSON object each, ``{"version": 1, "name", "description", "strategy", ...knobs,
"stage_order": [...]}``. Sparse (only knobs that differ from neutral) and strict (unknown keys,
wrong types and out-of-range values are rejected with the key and the allowed range, from
DecodingConfig: one source of truth). JSON only: safe for untrusted input.

A preset *file* (import/export) holds one preset object or a JSON list of them.
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Sequence

from engine import config as engine_config
from engine.config import (KNOBS, STAGE_NAMES, STRATEGIES, ConfigError, DecodingConfig, check_knob, check_stage_order,
                           check_text)

PRESET_VERSION = 1
MAX_PRESET_BYTES = 16_384
MAX_FILE_BYTES = 1_048_576  # an exported library: up to MAX_FILE_PRESETS presets
MAX_FILE_PRESETS = 200
MAX_NAME_LEN = 64
MAX_DESCRIPTION_LEN = 500
META_KEYS = ("version", "name", "description")


def preset_keys() -> tuple[str, ...]:
    """Every key a preset may hold: its own and the config's (every registered stage's and
    strategy's knobs: read at the call, so a strategy registered later counts)."""
    return (*META_KEYS, *engine_config.CONFIG_KEYS)
BUILTIN_DIR = Path(__file__).resolve().parent.parent / "presets"


class PresetError(ValueError):
    """A preset is invalid; the message names the key and what is allowed."""


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    config: DecodingConfig

    @classmethod
    def create(cls, name: str, description: str, config: DecodingConfig) -> "Preset":
        """A validated preset (name sanitised, description checked) for a config."""
        return parse_preset({"name": name, "description": description, **config.to_dict(sparse=True)})

    def to_dict(self) -> dict[str, Any]:
        """The canonical JSON object: meta keys, then the sparse config."""
        body = self.config.to_dict(sparse=True)
        return {"version": PRESET_VERSION, "name": self.name, "description": self.description, **body}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False, allow_nan=False) + "\n"

    def renamed(self, name: str) -> "Preset":
        return Preset.create(name, self.description, self.config)


def sanitize_name(name: str) -> str:
    """A name safe to show and to use in a file name: no path separators or control characters,
    collapsed whitespace, at most MAX_NAME_LEN characters."""
    cleaned = re.sub(r"[\x00-\x1f\x7f/\\:*?\"<>|]+", " ", name)
    cleaned = re.sub(r"\s+", " ", cleaned).strip(" .")
    return cleaned[:MAX_NAME_LEN].rstrip(" .")


def file_stem(name: str) -> str:
    """An ASCII file-name stem for a preset name (``"Beam search (4)"`` -> ``"beam-search-4"``)."""
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", sanitize_name(name))
    stem = re.sub(r"\.{2,}", ".", stem).strip("-.").lower()
    return stem or "preset"


def unique_name(name: str, taken: Iterable[str]) -> str:
    """``name``, or ``name (2)``, ``name (3)``... whichever is not in ``taken`` (within the length cap)."""
    taken = set(taken)
    base = sanitize_name(name) or "preset"
    candidate, n = base, 1
    while candidate in taken:
        n += 1
        suffix = f" ({n})"
        candidate = base[: MAX_NAME_LEN - len(suffix)].rstrip() + suffix
    return candidate


def short_repr(value: Any, limit: int = 40) -> str:
    """repr() that never fails (huge ints, deep nesting) and never floods a message."""
    try:
        text = repr(value)
    except (ValueError, RecursionError):
        return f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_meta(data: dict) -> tuple[str, str]:
    version = data.get("version", PRESET_VERSION)
    if isinstance(version, bool) or version != PRESET_VERSION:
        raise PresetError(f"version: expected {PRESET_VERSION}, got {short_repr(version)}")
    name = data.get("name", "")
    if not isinstance(name, str) or not sanitize_name(name) or len(name) > MAX_NAME_LEN:
        raise PresetError(f"name: expected a non-empty string of at most {MAX_NAME_LEN} characters, "
                          f"got {short_repr(name)}")
    description = data.get("description", "")
    if not isinstance(description, str) or len(description) > MAX_DESCRIPTION_LEN:
        raise PresetError(f"description: expected a string of at most {MAX_DESCRIPTION_LEN} characters, "
                          f"got {short_repr(description)}")
    try:  # lone surrogates: refused here, not by the encoder of whatever writes the name later
        check_text("name", name, max_len=MAX_NAME_LEN)
        check_text("description", description, max_len=MAX_DESCRIPTION_LEN, allow_empty=True)
    except ConfigError as exc:
        raise PresetError(str(exc)) from None
    return sanitize_name(name), description


def _check_body(body: dict) -> None:
    """Validate key by key, so every message names its key even for values whose own repr fails."""
    for key, value in body.items():
        if key not in engine_config.CONFIG_KEYS:
            suggestion = _suggest(key)  # a close match says enough; otherwise list every key
            raise PresetError(f"{_key_label(key)}: unknown key" + (suggestion or f"; allowed keys: {', '.join(preset_keys())}"))
        try:
            if key == "stage_order":
                check_stage_order(value)
            elif key == "strategy":
                if not isinstance(value, str):
                    raise ConfigError("strategy", f"expected a string, got {short_repr(value)}")
            else:
                check_knob(key, value)
        except ConfigError as exc:
            raise PresetError(str(exc)) from None
        except (TypeError, ValueError, RecursionError, OverflowError):
            raise PresetError(f"{key}: invalid value {short_repr(value)}; allowed {_allowed(key)}") from None


def _key_label(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,39}", key) else short_repr(key)


def _suggest(key: str) -> str:
    close = difflib.get_close_matches(key[:40], preset_keys(), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _allowed(key: str) -> str:
    if key == "stage_order":
        return f"a list of distinct stage names: {', '.join(STAGE_NAMES)}"
    if key == "strategy":
        return " | ".join(STRATEGIES)
    return KNOBS[key].range_text()


def parse_preset(data: Any) -> Preset:
    """Validate a decoded JSON value into a Preset. Never raises anything but PresetError, and
    never returns a partial preset."""
    if not isinstance(data, dict):
        raise PresetError(f"preset: expected a JSON object, got {type(data).__name__}")
    for key in data:
        if not isinstance(key, str):
            # only Python callers can pass these; JSON keys are always strings
            raise PresetError(f"{short_repr(key)}: keys must be strings")
    name, description = _check_meta(data)
    body = {k: v for k, v in data.items() if k not in META_KEYS}
    _check_body(body)
    try:
        config = DecodingConfig.from_dict(body)
    except ConfigError as exc:  # cross-key rules (e.g. num_beam_groups must divide num_beams)
        raise PresetError(str(exc)) from None
    except (TypeError, ValueError, RecursionError, OverflowError) as exc:  # defensive: never let junk escape
        raise PresetError(f"preset: invalid ({type(exc).__name__})") from None
    return Preset(name, description, config)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key[:40]!r}")
        out[key] = value
    return out


def loads_strict(text: str | bytes, what: str, limit: int) -> Any:
    """json.loads with a size cap, no NaN/Infinity, no duplicate keys. Raises PresetError only."""
    if not isinstance(text, (str, bytes, bytearray)):
        raise PresetError(f"{what}: expected JSON text, got {type(text).__name__}")
    if len(text) > limit:
        raise PresetError(f"{what}: {len(text):,} bytes is over the {limit:,}-byte limit")
    try:
        return json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as exc:
        raise PresetError(f"{what}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except (ValueError, RecursionError, UnicodeDecodeError, TypeError) as exc:
        # ValueError: a rejected constant, a duplicate key, or an integer too long to convert
        raise PresetError(f"{what}: not valid JSON ({short_repr(str(exc), 80)})") from None


def parse_preset_json(text: str | bytes) -> Preset:
    return parse_preset(loads_strict(text, "preset", MAX_PRESET_BYTES))


@dataclass(frozen=True)
class ImportResult:
    """Presets read from a file: the good ones, and one message per bad one."""

    presets: tuple[Preset, ...]
    errors: tuple[str, ...]


def parse_preset_file(text: str | bytes) -> ImportResult:
    """A preset file: one preset object or a list of them. Bad entries become messages naming their
    position (and name, when readable); the good ones are still returned. A file that is not JSON,
    too big, or neither an object nor a list yields only an error."""
    try:
        data = loads_strict(text, "file", MAX_FILE_BYTES)
    except PresetError as exc:
        return ImportResult((), (str(exc),))
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list):
        return ImportResult((), (f"file: expected a preset object or a list of them, got {type(data).__name__}",))
    errors = [f"file: {len(data)} presets is over the {MAX_FILE_PRESETS}-preset limit; the rest were skipped"] \
        if len(data) > MAX_FILE_PRESETS else []
    presets = []
    for i, item in enumerate(data[:MAX_FILE_PRESETS], start=1):
        try:
            presets.append(parse_preset(item))
        except PresetError as exc:
            label = item.get("name") if isinstance(item, dict) and isinstance(item.get("name"), str) else None
            where = f"preset {i}" + (f" ({short_repr(label)})" if label else "")
            errors.append(f"{where}: {exc}")
    return ImportResult(tuple(presets), tuple(errors))


def presets_to_json(presets: Sequence[Preset]) -> str:
    """Export: one preset as an object, several as a list (both read back by parse_preset_file)."""
    if len(presets) == 1:
        return presets[0].to_json()
    return json.dumps([p.to_dict() for p in presets], indent=2, ensure_ascii=False, allow_nan=False) + "\n"


@lru_cache(maxsize=1)
def _builtin_items() -> tuple[tuple[str, Preset], ...]:
    return tuple((path.stem, parse_preset_json(path.read_bytes())) for path in sorted(BUILTIN_DIR.glob("*.json")))


def builtin_presets() -> dict[str, Preset]:
    """The built-in library, keyed by file stem, in file-name order (read once per process)."""
    return dict(_builtin_items())


def load_preset(source: Any, *, allow_paths: bool = False) -> Preset:
    """A preset from a built-in name, a JSON object (a dict, or JSON text starting with ``{``), or,
    only when ``allow_paths`` (the CLI), a ``.json`` file path.

    The page and the API call it with ``allow_paths=False``: nothing the user types can make the
    server read a file, and a refused name gets one answer whatever it names (no "is a file")."""
    if isinstance(source, Preset):
        return source
    if isinstance(source, dict):
        return parse_preset(source)
    try:
        check_text("preset", source, max_len=MAX_PRESET_BYTES)
    except ConfigError as exc:
        raise PresetError(str(exc)) from None
    builtins = builtin_presets()
    if source in builtins:
        return builtins[source]
    if source.lstrip().startswith("{"):
        return parse_preset_json(source)
    if allow_paths:
        return _load_preset_file(source, builtins)
    names = ", ".join(builtins)
    names = names if len(names) <= 120 else names[:names.rfind(", ", 0, 120)] + ", ..."  # the message stays one short line
    raise PresetError(f"preset: {short_repr(source)} is not a built-in preset ({names}); "
                      "give a built-in name or a preset JSON object")


def _load_preset_file(path_text: str, builtins: dict[str, Preset]) -> Preset:
    path = Path(path_text)
    if path.suffix != ".json" or not path.is_file():
        raise PresetError(f"preset: {short_repr(path_text)} is neither a built-in ({', '.join(builtins)}) "
                          "nor a .json file")
    if path.stat().st_size > MAX_PRESET_BYTES:
        raise PresetError(f"preset: {short_repr(path_text)} is over the {MAX_PRESET_BYTES}-byte limit")
    return parse_preset_json(path.read_bytes())
