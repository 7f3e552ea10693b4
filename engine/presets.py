"""Presets: one JSON object each, ``{"version": 1, "name", "description", "strategy", ...knobs,
"stage_order": [...]}``. Sparse (only knobs that differ from neutral) and strict (unknown keys,
wrong types and out-of-range values are rejected with the key and the allowed range, from
DecodingConfig: one source of truth). JSON only: safe for untrusted input.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import ConfigError, DecodingConfig

PRESET_VERSION = 1
MAX_PRESET_BYTES = 16_384
MAX_NAME_LEN = 64
MAX_DESCRIPTION_LEN = 500
META_KEYS = ("version", "name", "description")
BUILTIN_DIR = Path(__file__).resolve().parent.parent / "presets"


class PresetError(ValueError):
    """A preset is invalid; the message names the key and what is allowed."""


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    config: DecodingConfig

    def to_dict(self) -> dict[str, Any]:
        body = self.config.to_dict(sparse=True)
        return {"version": PRESET_VERSION, "name": self.name, "description": self.description, **body}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n"


def sanitize_name(name: str) -> str:
    """A name safe to show and to use in a file name: no path separators or control characters,
    collapsed whitespace, at most MAX_NAME_LEN characters."""
    cleaned = re.sub(r"[\x00-\x1f\x7f/\\:*?\"<>|]+", " ", name)
    cleaned = re.sub(r"\s+", " ", cleaned).strip().strip(".")
    return cleaned[:MAX_NAME_LEN]


def file_stem(name: str) -> str:
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", sanitize_name(name)).strip("-.").lower()
    return stem or "preset"


def parse_preset(data: Any) -> Preset:
    """Validate a decoded JSON value into a Preset. Never raises anything but PresetError."""
    if not isinstance(data, dict):
        raise PresetError(f"preset: expected a JSON object, got {type(data).__name__}")
    version = data.get("version", PRESET_VERSION)
    if version != PRESET_VERSION or isinstance(version, bool):
        raise PresetError(f"version: expected {PRESET_VERSION}, got {str(version)[:40]!r}")
    name = data.get("name", "")
    if not isinstance(name, str) or not sanitize_name(name):
        raise PresetError(f"name: expected a non-empty string of at most {MAX_NAME_LEN} characters, got {str(name)[:40]!r}")
    if len(name) > MAX_NAME_LEN:
        raise PresetError(f"name: longer than {MAX_NAME_LEN} characters")
    description = data.get("description", "")
    if not isinstance(description, str) or len(description) > MAX_DESCRIPTION_LEN:
        raise PresetError(f"description: expected a string of at most {MAX_DESCRIPTION_LEN} characters")
    body = {k: v for k, v in data.items() if k not in META_KEYS}
    try:
        config = DecodingConfig.from_dict(body)
    except ConfigError as exc:
        raise PresetError(str(exc)) from None
    except (TypeError, ValueError, RecursionError) as exc:  # defensive: never let junk escape
        raise PresetError(f"preset: invalid ({type(exc).__name__})") from None
    return Preset(sanitize_name(name), description, config)


def parse_preset_json(text: str | bytes) -> Preset:
    if len(text) > MAX_PRESET_BYTES:
        raise PresetError(f"preset: {len(text)} bytes is over the {MAX_PRESET_BYTES}-byte limit")
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise PresetError(f"preset: not valid JSON ({getattr(exc, 'msg', type(exc).__name__)})") from None
    return parse_preset(data)


def builtin_presets() -> dict[str, Preset]:
    """The built-in library, keyed by file stem, in file-name order."""
    presets = {}
    for path in sorted(BUILTIN_DIR.glob("*.json")):
        presets[path.stem] = parse_preset_json(path.read_text(encoding="utf-8"))
    return presets


def load_preset(name_or_path: str) -> Preset:
    """A built-in preset by name, or a preset JSON file by path."""
    builtins = builtin_presets()
    if name_or_path in builtins:
        return builtins[name_or_path]
    path = Path(name_or_path)
    if path.suffix == ".json" and path.is_file():
        if path.stat().st_size > MAX_PRESET_BYTES:
            raise PresetError(f"preset: {path} is over the {MAX_PRESET_BYTES}-byte limit")
        return parse_preset_json(path.read_bytes())
    raise PresetError(f"preset: {name_or_path!r} is neither a built-in ({', '.join(builtins)}) nor a .json file")
