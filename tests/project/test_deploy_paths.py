"""The module paths the Dockerfile, the Makefile and deploy/'s scripts run are in the tree (issue #51: the
image stopped building when a `python -c` named a module a refactor had removed, and nothing noticed).

Each `python -c "..."` snippet is run for real inside a folder holding only what the Dockerfile COPYs
(so a snippet, or the app it starts, that needs a file the image leaves out fails here too); each
`python -m pkg.module` of ours must resolve; each COPY source must exist. Fast: no container."""

from __future__ import annotations

import ast
import importlib.util
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OURS = ("app", "engine", "playground", "deploy", "bench", "presets")
SCRIPTS = [ROOT / "Dockerfile", ROOT / "Makefile", ROOT / ".ci" / "run", *sorted((ROOT / "deploy").glob("*.sh"))]
# `python -c CODE` / `$(PY) -c 'CODE'` / `"$PY" -c "CODE"`: the code in single or double quotes.
SNIPPET = re.compile(r"""(?:python3?|\$\(PY\)|"\$PY"|\$PY|"\$VPY")\s+-c\s+(?:"((?:[^"\\]|\\.)*)"|'([^']*)')""")
MODULE = re.compile(r"""(?:python3?|\$\(PY\)|"\$PY"|\$PY)\s+-m\s+([A-Za-z_][\w.]*)""")


def snippets(path: Path) -> list[str]:
    return [m.group(1) or m.group(2) for m in SNIPPET.finditer(path.read_text(encoding="utf-8"))]


def our_snippets() -> list[tuple[str, str]]:
    """(file, code) for every snippet that imports one of our packages."""
    found = []
    for path in SCRIPTS:
        for code in snippets(path):
            tree = ast.parse(code)
            names = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module] + \
                    [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
            if any(name.split(".")[0] in OURS for name in names):
                found.append((path.relative_to(ROOT).as_posix(), code))
    return found


def dockerfile_copies() -> list[tuple[str, str]]:
    """(source, destination) of each COPY in the Dockerfile (its --chown and other flags left out)."""
    copies = []
    for line in (ROOT / "Dockerfile").read_text(encoding="utf-8").splitlines():
        if line.startswith("COPY "):
            words = [w for w in shlex.split(line[len("COPY "):]) if not w.startswith("--")]
            copies += [(source, words[-1]) for source in words[:-1]]
    return copies


def test_the_scripts_snippets_are_found():
    """The patterns above see the snippets that exist (else the tests below would check nothing)."""
    files = {name for name, _ in our_snippets()}
    assert {"Dockerfile", "Makefile"} <= files
    assert any("embedded_model_dir" in code for name, code in our_snippets() if name == "Dockerfile")


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_module_run_with_dash_m_is_in_the_tree(path):
    for module in MODULE.findall(path.read_text(encoding="utf-8")):
        if module.split(".")[0] in OURS:
            assert importlib.util.find_spec(module) is not None, f"{path.name} runs -m {module}, not in the tree"


def test_every_copy_source_exists():
    copies = dockerfile_copies()
    assert copies, "the Dockerfile copies nothing?"
    for source, _ in copies:
        assert (ROOT / source).exists(), f"Dockerfile: COPY {source}: no such file in the tree"


@pytest.fixture(scope="module")
def image_tree(tmp_path_factory) -> Path:
    """A folder with what the Dockerfile copies into /app, where it copies it."""
    tree = tmp_path_factory.mktemp("image") / "app"
    tree.mkdir()
    for source, dest in dockerfile_copies():
        target = tree / dest if dest.endswith("/") or dest in ("./", ".") else tree / dest
        if (ROOT / source).is_dir():
            shutil.copytree(ROOT / source, target if dest.endswith("/") else target, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            target.mkdir(parents=True, exist_ok=True) if dest.endswith("/") else target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / source, target / Path(source).name if dest.endswith("/") else target)
    return tree


def run_in(tree: Path, code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=tree, capture_output=True, text=True, timeout=600,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "HF_HUB_OFFLINE": "1",
                               "PYTHONPATH": "", "PYTHONNOUSERSITE": "1"})


@pytest.mark.parametrize("where, code", [(name, code) for name, code in our_snippets() if name == "Dockerfile"])
def test_the_dockerfiles_python_runs_in_the_images_tree(image_tree, where, code):
    done = run_in(image_tree, code)
    assert done.returncode == 0, f"{where}: python -c {code!r} failed in the image's tree:\n{done.stderr[-2000:]}"
    assert Path(done.stdout.strip().splitlines()[-1], "model.safetensors").exists()


def test_the_images_command_imports_in_the_images_tree(image_tree):
    """CMD ["python", "app.py"]: everything app.py imports (the whole UI) is inside what the image copies."""
    done = run_in(image_tree, "import app, playground.app, engine.__main__; print('ok')")
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


@pytest.mark.parametrize("where, code", [(name, code) for name, code in our_snippets() if name != "Dockerfile"])
def test_the_other_scripts_python_runs(where, code):
    done = run_in(ROOT, code)
    assert done.returncode == 0, f"{where}: python -c {code!r} failed:\n{done.stderr[-2000:]}"


def test_a_conversion_finished_first_by_another_process_is_taken(tmp_path):
    """make test's background builds, its two workers and the image's RUN all ask for the embedded model's
    folder at once on a fresh machine: a conversion that finds the folder made by another process when it
    is done takes that folder (it used to fail on os.replace: 'Directory not empty')."""
    from engine.backends.local import _convert_gguf, embedded_model_dir, gguf_path

    target = tmp_path / "converted"
    shutil.copytree(embedded_model_dir(), target)  # the other process's finished folder
    before = (target / "model.safetensors").stat().st_mtime_ns
    _convert_gguf(gguf_path(), target, progress=lambda message: None)
    assert (target / "model.safetensors").stat().st_mtime_ns == before  # theirs kept, ours dropped
    assert [p.name for p in tmp_path.iterdir()] == ["converted"]  # no half-written folder left behind
