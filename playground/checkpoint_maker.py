"""The 4-bit checkpoints a lesson needs, made on first need (issue #52): a user who ran the README's
two commands (`make setup`, `make run`) has no checkpoints (`make quantize` makes them), so the first
lesson that needs some starts ``deploy/quantize.sh`` in the background, niced, for just its variants,
and its page shows "making the checkpoints: step k of n, about N min left" until they are there.

Resumable: deploy/quantize.py renames each checkpoint into place whole and keeps those already made,
so an app stopped midway makes only the rest the next time. One maker per cache folder: a second
page asking for the same checkpoints follows the first one's progress. The estimate is the CPU
seconds each method took here (docs/quantization.md: one thread), plus the venv's install the first
time, scaled by how much slower than that the finished checkpoints of this run went (the room's load).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from engine.backends import quant_methods
from engine.backends.local import embedded_model_dir
from engine.settings import cache_root, env_text

ROOT = Path(__file__).resolve().parents[1]
# CPU seconds to make one checkpoint of the embedded model, one thread (docs/quantization.md's table).
METHOD_S = {"rtn": 5.0, "gptq": 90.0, "awq": 170.0}
INSTALL_S = 150.0  # llm-compressor's venv, once per machine
# Each start: importing llm-compressor and loading the model (rtn-g64 alone took 117 s of wall clock at load 16,
# 1 s of it quantizing).
STARTUP_S = 60.0
LOG_NAME = "quantize-on-demand.log"


def default_command(variants: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """deploy/quantize.sh for ``variants`` at the lowest priority (the room's runs come first)."""
    return (["nice", "-n", "19", "sh", str(ROOT / "deploy" / "quantize.sh"), sys.executable],
            {"QUANTIZE_VARIANTS": " ".join(variants)})


@dataclass(frozen=True)
class Progress:
    """Where the making stands: ``made`` of ``total`` checkpoints, the seconds left (estimated),
    and the failure's last log line if the maker stopped without making them."""

    made: int
    total: int
    left_s: float
    error: str = ""

    @property
    def done(self) -> bool:
        return self.made >= self.total

    def sentence(self) -> str:
        if self.error:
            return f"making the checkpoints failed: {self.error}"
        minutes = max(1, round(self.left_s / 60))
        return (f"making the checkpoints this lesson needs (once per machine, in the background): step "
                f"{min(self.made + 1, self.total)} of {self.total}, about {minutes} min left")


class Maker:
    """One background run of the checkpoint maker for ``variants`` of the model in ``model_dir``."""

    def __init__(self, model_dir: Path, variants: Sequence[str],
                 command: Callable[[Sequence[str]], tuple[list[str], dict[str, str]]] = default_command) -> None:
        self.model_dir, self.variants, self.command = model_dir, tuple(variants), command
        self.started = time.monotonic()
        self.process: subprocess.Popen | None = None
        self.finished_at: dict[str, float] = {}  # variant -> when this maker first saw it made
        self.install_planned = 0.0  # the install's estimate when the maker started (0: the venv was there)

    def missing(self) -> list[str]:
        made = set(quant_methods.made_variants(self.model_dir))
        return [v for v in self.variants if v not in made]

    def start(self) -> None:
        """Start (or restart, after a stop) the maker for the variants still missing."""
        missing = self.missing()
        if not missing or (self.process is not None and self.process.poll() is None):
            return
        argv, extra = self.command(missing)
        log = quant_methods.checkpoints_dir(self.model_dir).parent / LOG_NAME
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            self.process = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, **extra}, stdout=out, stderr=out,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        self.log, self.started = log, time.monotonic()
        self.install_planned = 0.0 if self.venv_ready() else INSTALL_S

    def progress(self) -> Progress:
        missing = self.missing()
        now = time.monotonic()
        for v in self.variants:
            if v not in missing:
                self.finished_at.setdefault(v, now)
        left = sum(METHOD_S[v.split("-")[0]] for v in missing)
        done_here = [v for v in self.variants if v in self.finished_at and self.finished_at[v] > self.started]
        planned = sum(METHOD_S[v.split("-")[0]] for v in done_here)
        # how much slower than one free core this run goes, from what it finished (1 until then)
        base = self.install_planned + STARTUP_S + planned
        pace = max(1.0, (max(self.finished_at[v] for v in done_here) - self.started) / base) if planned else 1.0
        install = 0.0 if self.venv_ready() else INSTALL_S
        startup = 0.0 if done_here else STARTUP_S  # past once this run made one
        running = self.process is not None and self.process.poll() is None
        elapsed = now - max([self.started, *(self.finished_at[v] for v in done_here)]) if running else 0.0
        left_s = max(30.0, (install + startup + left) * pace - elapsed) if missing else 0.0
        error = ""
        if missing and self.process is not None and self.process.poll() not in (None, 0):
            error = self.last_line()
        elif missing and self.process is not None and self.process.poll() == 0:
            error = f"the maker ended with {', '.join(missing)} still missing ({self.log})"
        return Progress(len(self.variants) - len(missing), len(self.variants), left_s, error)

    def venv_ready(self) -> bool:
        venv = env_text("QUANTIZE_VENV") or str(cache_root() / "llmcompressor-0.14")
        return any(Path(venv).glob(".installed-*"))

    def last_line(self) -> str:
        lines = self.log.read_text(errors="replace").strip().splitlines() if self.log.is_file() else []
        return f"{(lines or ['no output'])[-1][:200]} (log: {self.log})"

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(30)


_makers: dict[tuple[Path, tuple[str, ...]], Maker] = {}
_lock = threading.Lock()
COMMAND = default_command  # what a maker runs (a test puts a stand-in here)


def ensure(variants: Sequence[str]) -> Maker | None:
    """None when every checkpoint in ``variants`` is made; else the (started) maker of the missing ones."""
    model_dir = embedded_model_dir()
    key = (quant_methods.checkpoints_dir(model_dir), tuple(variants))
    with _lock:
        maker = _makers.get(key)
        if maker is None:
            maker = Maker(model_dir, variants, COMMAND)
            if not maker.missing():
                return None
            _makers[key] = maker
        if not maker.missing():
            return None
        maker.start()
        return maker
