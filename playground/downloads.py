"""Files the page offers for download (trace JSON, reports, exported presets), all under one
private, app-owned directory per process whose old files are deleted.

The directory (mode 0700, under env ``DP_DOWNLOAD_DIR`` or the system temp folder) holds the
download files (``downloads/``, files 0600) and Gradio's own file cache (``gradio/``: the app points
``GRADIO_TEMP_DIR`` there before building its page, see ``use_private_cache``), so users' prompts
never sit in the world-readable shared ``/tmp/gradio`` and other users of the machine cannot read
them. It is removed when the server closes (``remove_on_close``: the last app of the process to
close), when the process exits, and
when the process is told to stop (SIGTERM, SIGHUP: ``remove_on_signal``, which ``app.py`` sets; a
signal's default action would end the process without running exit handlers).

Each file gets its own fresh sub-folder (so two users' "balanced.yaml" never collide and the name
the user sees is the name given). Sub-folders older than ``DOWNLOAD_TTL_S`` are deleted whenever a
new file is written. Gradio copies served files into its cache; the app's ``delete_cache``
setting (``GRADIO_DELETE_CACHE``) clears those while it runs.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from engine.settings import env_text
from engine.trace import finite

DOWNLOAD_TTL_S = 600.0  # a download link works for this long after its file was written
# Gradio's own copies: checked every hour, deleted when over an hour old (frequency, age in seconds).
GRADIO_DELETE_CACHE = (3600, 3600)

_lock = threading.Lock()
_roots: list[Path] = []  # this process's private directory (the last one made); made on first use


def private_root() -> Path:
    """This process's private directory (mode 0700), made on first use (again after ``remove``)
    and removed at exit."""
    with _lock:
        if _roots and _roots[-1].is_dir():
            return _roots[-1]
        base = Path(env_text("DP_DOWNLOAD_DIR") or tempfile.gettempdir())
        root = Path(tempfile.mkdtemp(prefix="decoding-playground-", dir=base))  # mode 0700
        for sub in ("downloads", "gradio"):
            (root / sub).mkdir(mode=0o700)
        if not _roots:
            atexit.register(remove)
        _roots.append(root)
        return root


def download_dir() -> Path:
    """Where download files go: ``downloads/`` of the private directory."""
    return private_root() / "downloads"


def use_private_cache() -> Path:
    """Point Gradio's file cache (env ``GRADIO_TEMP_DIR``, read by every component as it is built)
    into the private directory; the app calls this before building its Blocks."""
    cache = private_root() / "gradio"
    os.environ["GRADIO_TEMP_DIR"] = str(cache)
    return cache


def remove() -> None:
    """Delete every private directory this process made (at exit and when the server closes)."""
    with _lock:
        for root in _roots:
            shutil.rmtree(root, ignore_errors=True)


STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


def remove_on_signal() -> None:
    """On SIGTERM / SIGHUP, delete the private directory, then end as the signal would have (the
    handler there before is called instead, if there was one; an ignored signal stays ignored,
    e.g. SIGHUP under nohup). Call from the main thread."""
    for signum in STOP_SIGNALS:
        previous = signal.getsignal(signum)
        if previous == signal.SIG_IGN:
            continue

        def on_signal(number: int, frame: Any, previous: Any = previous) -> None:
            remove()
            if callable(previous):
                previous(number, frame)
                return
            signal.signal(number, signal.SIG_DFL)
            os.kill(os.getpid(), number)

        signal.signal(signum, on_signal)


_open_apps: set[int] = set()  # the apps of this process that share the private directory, not yet closed


def remove_on_close(demo: Any) -> None:
    """Make ``demo.close()`` (the server closing) delete the private directory too, once no other
    app of this process uses it: every app built here shares it (Gradio's cache of each is in it),
    and closing one app had deleted the cache of another still serving (its uploads then failed)."""
    close = demo.close
    with _lock:
        _open_apps.add(id(demo))

    def close_and_remove(*args: Any, **kwargs: Any) -> Any:
        try:
            return close(*args, **kwargs)
        finally:
            with _lock:
                was_open = id(demo) in _open_apps
                _open_apps.discard(id(demo))
                last = was_open and not _open_apps
            if last:
                remove()

    demo.close = close_and_remove


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
    folder.mkdir(mode=0o700)
    path = folder / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # readable by this user only
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    return str(path)


def json_file(name: str, data: Any) -> str:
    """``data`` as an indented, strict JSON file; returns its path. A value a run could not know
    (NaN, e.g. a served model's raw p outside its top-N) or an infinite one is written as null, as
    the trace JSON everywhere else (engine.trace.finite)."""
    return write_text(name, json.dumps(finite(data), indent=1, ensure_ascii=False, allow_nan=False))


def trace_file(trace: Any, prefix: str = "trace") -> str:
    """A Trace as ``<prefix>.json`` for a download button."""
    return json_file(f"{prefix}.json", trace.to_dict())
