"""Files the page offers for download (trace JSON, reports, exported presets), all under one
app-owned directory whose old files are deleted.

Each file gets its own fresh sub-folder (so two users' "balanced.yaml" never collide and the name
the user sees is the name given). Sub-folders older than ``DOWNLOAD_TTL_S`` are deleted whenever a
new file is written, and the whole directory when the process exits. Gradio copies served files
into its own cache; the app's ``delete_cache`` setting (``GRADIO_DELETE_CACHE``) clears those.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

DOWNLOAD_TTL_S = 600.0  # a download link works for this long after its file was written
# Gradio's own copies: checked every hour, deleted when over an hour old (frequency, age in seconds).
GRADIO_DELETE_CACHE = (3600, 3600)


@functools.cache  # one directory per process, made on first use so importing creates nothing
def download_dir() -> Path:
    """This process's download directory (under env ``DP_DOWNLOAD_DIR`` or the system temp
    folder), removed at exit."""
    base = Path(os.environ.get("DP_DOWNLOAD_DIR") or tempfile.gettempdir())
    root = Path(tempfile.mkdtemp(prefix="decoding-playground-", dir=base))
    atexit.register(shutil.rmtree, root, True)
    return root


def prune(max_age_s: float = DOWNLOAD_TTL_S) -> int:
    """Delete download folders older than ``max_age_s``; returns how many were deleted."""
    root = download_dir()
    cutoff = time.time() - max_age_s
    removed = 0
    for folder in root.iterdir():
        try:
            if folder.stat().st_mtime < cutoff:
                shutil.rmtree(folder, ignore_errors=True)
                removed += 1
        except FileNotFoundError:  # another request pruned it first
            continue
    return removed


def write_text(name: str, text: str) -> str:
    """Write ``text`` to a new file called ``name`` (a bare file name); returns its path."""
    if Path(name).name != name or name in ("", ".", ".."):
        raise ValueError(f"name: {name!r} is not a bare file name")
    prune()
    folder = download_dir() / uuid.uuid4().hex
    folder.mkdir()
    path = folder / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def json_file(name: str, data: Any) -> str:
    """``data`` as an indented, strict JSON file (no NaN / Infinity); returns its path."""
    return write_text(name, json.dumps(data, indent=1, ensure_ascii=False, allow_nan=False))


def trace_file(trace: Any, prefix: str = "trace") -> str:
    """A Trace as ``<prefix>.json`` for a download button."""
    return json_file(f"{prefix}.json", trace.to_dict())
