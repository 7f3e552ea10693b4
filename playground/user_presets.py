"""The user's own presets, kept in this browser (gr.BrowserState, i.e. localStorage), the merged
picker list (built-ins, then the user's) and preset files (import, export).

Stored shape (``shared.user_presets``): a JSON list of preset objects in the engine's format
(``Preset.to_dict()``), at most MAX_USER_PRESETS, names unique. The browser's copy is untrusted:
every read validates it with ``parse_preset`` and drops what does not parse.

Everything here is pure (lists in, lists out; no Gradio) and raises PresetError with a message for
the page.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from engine.config import DecodingConfig
from engine.reports.lessons import Lesson
from engine.presets import (
    MAX_FILE_BYTES, Preset, PresetError, builtin_presets, file_stem, parse_preset, parse_preset_file,
    presets_to_json, sanitize_name, unique_name,
)

from . import downloads

MAX_USER_PRESETS = 100
CUSTOM = "(custom)"  # the picker's "no preset" entry
USER_PREFIX = "★ "  # user presets in the picker: "★ <name>"

# --- user presets: pure list operations -------------------------------------------------------------


def read_user_presets(stored: Any) -> tuple[list[Preset], list[str]]:
    """The browser-stored list -> valid presets (unique names, capped) and one message per dropped entry."""
    presets: list[Preset] = []
    errors: list[str] = []
    items = stored if isinstance(stored, list) else []
    if stored not in (None, []) and not isinstance(stored, list):
        errors.append("stored presets: not a list; ignored")
    for i, item in enumerate(items[:MAX_USER_PRESETS], start=1):
        try:
            preset = parse_preset(item)
        except PresetError as exc:
            errors.append(f"stored preset {i}: {exc}")
            continue
        if any(p.name == preset.name for p in presets):
            errors.append(f"stored preset {i}: a second {preset.name!r}; dropped")
            continue
        presets.append(preset)
    return presets, errors


def to_stored(presets: Sequence[Preset]) -> list[dict]:
    """The value to write back to the BrowserState."""
    return [p.to_dict() for p in presets]


def save_user_preset(stored: Any, preset: Preset, overwrite: bool = False) -> list[dict]:
    """Add ``preset`` (or replace the one of that name when ``overwrite``)."""
    presets, _ = read_user_presets(stored)
    names = [p.name for p in presets]
    if preset.name in names:
        if not overwrite:
            raise PresetError(f"name: you already have a preset called {preset.name!r}; pick another name")
        presets[names.index(preset.name)] = preset
    elif len(presets) >= MAX_USER_PRESETS:
        raise PresetError(f"presets: you have {MAX_USER_PRESETS}, the most this browser keeps; delete some first")
    else:
        presets.append(preset)
    return to_stored(presets)


def rename_user_preset(stored: Any, old: str, new: str) -> list[dict]:
    presets, _ = read_user_presets(stored)
    new_name = sanitize_name(new or "")
    if not new_name:
        raise PresetError("name: empty; type a new name")
    index = _index(presets, old)
    if new_name != old and any(p.name == new_name for p in presets):
        raise PresetError(f"name: you already have a preset called {new_name!r}")
    presets[index] = presets[index].renamed(new_name)
    return to_stored(presets)


def delete_user_preset(stored: Any, name: str) -> list[dict]:
    presets, _ = read_user_presets(stored)
    del presets[_index(presets, name)]
    return to_stored(presets)


def _index(presets: Sequence[Preset], name: str) -> int:
    for i, preset in enumerate(presets):
        if preset.name == name:
            return i
    raise PresetError(f"preset: no saved preset called {name!r}")


def import_user_presets(stored: Any, text: str | bytes) -> tuple[list[dict], list[str], list[str]]:
    """Add the presets in a file; names that clash get " (2)" etc. Returns (stored, imported names,
    errors): the good presets are kept even when others are bad."""
    presets, _ = read_user_presets(stored)
    result = parse_preset_file(text)
    errors = list(result.errors)
    imported = []
    for preset in result.presets:
        if len(presets) >= MAX_USER_PRESETS:
            errors.append(f"{preset.name!r}: not imported; this browser keeps at most {MAX_USER_PRESETS} presets")
            continue
        name = unique_name(preset.name, [p.name for p in presets])
        presets.append(preset if name == preset.name else preset.renamed(name))
        imported.append(name)
    return to_stored(presets), imported, errors


# --- the merged picker ------------------------------------------------------------------------------


def all_presets(stored: Any) -> dict[str, Preset]:
    """Picker value -> preset: built-ins by file stem, then the user's as "★ name"."""
    merged = dict(builtin_presets())
    for preset in read_user_presets(stored)[0]:
        merged[USER_PREFIX + preset.name] = preset
    return merged


def preset_choices(stored: Any) -> list[str]:
    return [CUSTOM, *all_presets(stored)]


def find_preset(choice: str, stored: Any) -> Preset | None:
    return all_presets(stored).get(choice)


def matching_choice(config: DecodingConfig, stored: Any, name: str = "") -> tuple[str, bool]:
    """The picker entry for a config: (choice, modified). An exact match (seed aside) wins; else the
    entry whose display name is ``name``, marked modified; else (CUSTOM, False)."""
    by_name = None
    for choice, preset in all_presets(stored).items():
        if preset.config.replace(seed=config.seed) == config:
            return choice, False
        if name and preset.name == name and by_name is None:
            by_name = choice
    return (by_name, True) if by_name else (CUSTOM, False)


def lane_configs(lesson: Lesson, stored: Any) -> list[tuple[DecodingConfig, str]]:
    """Each of a lesson's runs: its config and the preset label a lane shows (the preset it equals, else custom)."""
    labels = [matching_choice(p.config, stored) for p in lesson.runs]
    return [(p.config, label if not modified else CUSTOM) for p, (label, modified) in zip(lesson.runs, labels)]


# --- files ------------------------------------------------------------------------------------------


def export_file(presets: Sequence[Preset], stem: str | None = None) -> str:
    """Write presets to a new .json download file; returns its path (for gr.File)."""
    if not presets:
        raise PresetError("export: nothing to export")
    name = file_stem(stem or (presets[0].name if len(presets) == 1 else "presets"))
    return downloads.write_text(f"{name}.json", presets_to_json(presets))


def read_upload(path: str | None) -> bytes:
    """An uploaded file's bytes, refusing big files before reading them."""
    if not path:
        raise PresetError("import: choose a .json file first")
    file = Path(path)
    if file.stat().st_size > MAX_FILE_BYTES:
        raise PresetError(f"import: the file is over the {MAX_FILE_BYTES:,}-byte limit")
    return file.read_bytes()
