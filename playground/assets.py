"""The page's JavaScript and CSS, kept as files in playground/static/ (one snippet a file, named after
the module that uses it) and read once, when that module is imported, into the constant it passes to
Gradio (``js=``, ``js_on_load=``, ``css=``, ``head=``).

A file may hold placeholders, ``__NAME__`` in capitals, where a Python value goes (an element id, a
width, another snippet): ``static_text(name, NAME=value)`` puts each value in. Every placeholder a file
holds must be given and every value given must have its placeholder, so nothing is left unfilled.
A placeholder stands where the value is used as an expression, so each file parses as JavaScript as
it is (tests/browser/test_static_assets.py).

An element id is named ``__ID_<NAME>__`` and filled by itself, with the JSON string of
``playground.ids.<NAME>`` (the one table of the ids the page's scripts name)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from .ids import IDS

STATIC = Path(__file__).resolve().parent / "static"
PLACEHOLDER = re.compile(r"__([A-Z][A-Z0-9_]*)__")
ID_PREFIX = "ID_"  # __ID_STEP_CHART__: ids.STEP_CHART as a JSON string


class AssetError(RuntimeError):
    """A static file is missing, or its placeholders and the values given disagree."""


def static_text(name: str, **values: str) -> str:
    """The text of playground/static/``name`` (its final newline dropped), each ``__KEY__`` replaced
    by ``values[KEY]`` and each ``__ID_NAME__`` by ids.NAME's JSON string, in one pass (a value's own
    text is not searched for placeholders)."""
    path = STATIC / name
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise AssetError(f"{path} is missing: the page's JavaScript and CSS ship in playground/static/") from None
    held = set(PLACEHOLDER.findall(text))
    ids = {key for key in held if key.startswith(ID_PREFIX)}
    unknown = sorted(key for key in ids if key.removeprefix(ID_PREFIX) not in IDS)
    if unknown:
        raise AssetError(f"playground/static/{name}: names element ids {unknown} that playground/ids.py lacks")
    if held - ids != set(values):
        raise AssetError(f"playground/static/{name}: holds placeholders {sorted(held - ids)}, values given for "
                         f"{sorted(values)}")
    filled = values | {key: json.dumps(IDS[key.removeprefix(ID_PREFIX)]) for key in ids}
    return PLACEHOLDER.sub(lambda m: filled[m.group(1)], text.removesuffix("\n"))
