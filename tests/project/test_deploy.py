"""Deployment pieces that need no network and no container: the Space folder `make space` writes,
the Dockerfile (hadolint and the facts the README promises), and app.py's deployment defaults."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

import app
from deploy.make_space import build_space

ROOT = Path(__file__).resolve().parents[2]
HADOLINT = Path(sys.executable).parent / "hadolint"


def front_matter(readme: str) -> dict[str, object]:
    """The README's front matter: ``key: value`` lines, and ``key:`` followed by ``  - item`` lines."""
    head = readme.split("---\n")[1]
    meta: dict[str, object] = {}
    items: list[str] = []
    for line in head.splitlines():
        if line.startswith("  - "):
            items.append(line[4:])  # belongs to the last "key:" line without a value
            continue
        key, _, value = line.partition(":")
        items = []
        meta[key] = value.strip().strip('"') if value.strip() else items
    return meta


@pytest.fixture(scope="module")
def space(tmp_path_factory) -> Path:
    return build_space(tmp_path_factory.mktemp("space") / "space")


def test_space_front_matter(space):
    meta = front_matter((space / "README.md").read_text(encoding="utf-8"))
    assert meta["sdk"] == "gradio"
    assert meta["sdk_version"] == importlib.metadata.version("gradio")
    assert meta["python_version"] == f"{sys.version_info.major}.{sys.version_info.minor}"
    assert meta["app_file"] == "app.py"
    assert meta["suggested_hardware"] == "zero-a10g"
    assert meta["models"] == [app.HUB_DEFAULT, *app.GPU_HUB_MODELS]
    assert 0 < len(meta["short_description"]) <= 60  # the Hub rejects longer ones
    assert "{" not in (space / "README.md").read_text(encoding="utf-8")  # every placeholder filled


def test_space_files_and_requirements(space):
    for name in ("app.py", "engine/backends/local.py", "engine/__init__.py", "playground/app.py", "presets"):
        assert (space / name).exists(), name
    assert sorted(p.name for p in (space / "presets").glob("*.json")) == \
        sorted(p.name for p in (ROOT / "presets").glob("*.json"))
    assert not list(space.rglob("__pycache__"))
    lines = (space / "requirements.txt").read_text(encoding="utf-8").splitlines()
    names = {re.split(r"[<>=]", line)[0] for line in lines if line and not line.startswith("#")}
    project = {re.split(r"[<>=]", line)[0] for line in (ROOT / "requirements.txt").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {"torch", "spaces"} | project <= names
    assert f"gradio=={importlib.metadata.version('gradio')}" in lines


def test_space_refuses_unknown_hardware(tmp_path):
    with pytest.raises(ValueError, match="hardware: .*'h100'"):
        build_space(tmp_path / "space", hardware="h100")


def test_dockerfile_passes_hadolint():
    result = subprocess.run([str(HADOLINT), str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_and_make_share_the_install_script():
    dockerfile = (ROOT / "Dockerfile").read_text()
    makefile = (ROOT / "Makefile").read_text()
    assert "deploy/install.sh /opt/venv/bin/python" in dockerfile
    assert "sh deploy/install.sh $(PY) $(TORCH_SPEC)" in makefile
    assert re.search(r"^USER 1000$", dockerfile, re.M)
    assert "HOME=/home/app" in dockerfile and "GRADIO_SERVER_NAME=0.0.0.0" in dockerfile
    assert "EXPOSE 7860" in dockerfile and "HEALTHCHECK" in dockerfile
    assert "embedded_model_dir()" in dockerfile  # converted at build time


def test_space_defaults_without_embedded_on_cpu():
    env = {"SPACE_ID": "someone/decoding-playground"}
    app.apply_deployment_defaults(env, has_gpu=False, has_embedded=False)
    assert env["DP_MODEL"] == app.HUB_DEFAULT
    assert env["DP_MODELS"] == app.HUB_DEFAULT
    assert env["DP_PUBLIC"] == "1" and env["GRADIO_SERVER_NAME"] == "0.0.0.0"
    assert {k: env[k] for k in app.PUBLIC_LIMITS} == app.PUBLIC_LIMITS


def test_space_defaults_on_gpu_offer_larger_models_and_keep_operator_values():
    env = {"SPACE_ID": "x/y", "DP_QUEUE_SIZE": "30"}
    app.apply_deployment_defaults(env, has_gpu=True, has_embedded=True)
    assert env["DP_MODEL"] == "embedded"
    assert env["DP_MODELS"].split(",") == ["embedded", app.HUB_DEFAULT, *app.GPU_HUB_MODELS]
    assert env["DP_QUEUE_SIZE"] == "30"


def test_local_run_is_not_public():
    env: dict[str, str] = {}
    app.apply_deployment_defaults(env, has_gpu=False, has_embedded=True)
    assert env == {"DP_MODEL": "embedded"}
    env = {"DP_PUBLIC": "1"}
    app.apply_deployment_defaults(env, has_gpu=False, has_embedded=True)
    assert env["DP_MODELS"] == f"embedded,{app.HUB_DEFAULT}" and "GRADIO_SERVER_NAME" not in env


def test_space_policy_refuses_paths_and_other_hub_ids(monkeypatch):
    from engine.backends.local import ModelLoadError
    from engine.backends.registry import model_policy

    env = {"SPACE_ID": "x/y"}
    app.apply_deployment_defaults(env, has_gpu=False, has_embedded=True)
    for key in ("DP_ALLOW_LOCAL_MODELS", "DP_MODELS", "DP_MODEL", "DP_PUBLIC"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("DP_ALLOW_LOCAL_MODELS", "1")  # ignored in public mode
    policy = model_policy()
    assert policy.check(app.HUB_DEFAULT) == app.HUB_DEFAULT
    for source in ("/etc", str(ROOT), "gpt2", f"model:{ROOT}"):
        with pytest.raises(ModelLoadError, match="model: .* not offered here"):
            policy.check(source)


@pytest.mark.slow
def test_preload_falls_back_to_embedded_when_the_hub_is_offline(monkeypatch):
    from huggingface_hub import constants

    from engine.backends.registry import ModelRegistry

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    registry = ModelRegistry()
    assert app.preload(registry, app.HUB_DEFAULT + "-not-cached", "none") == "embedded"
    assert [spec.source for spec in registry.loaded()] == ["embedded"]


@pytest.mark.slow
def test_the_gpu_check_runs_its_checks_as_a_dry_run_on_the_cpu(tmp_path):
    """deploy/gpu_check.py is run by hand on a GPU machine (CI has none): its dry run (the CPU
    against itself) keeps the script working and every check passing where nothing can differ."""
    out = tmp_path / "checks.json"
    done = subprocess.run([sys.executable, "-m", "deploy.gpu_check", "--device", "cpu", "--tokens", "3",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    import json

    rows = json.loads(out.read_text())["checks"]
    assert len(rows) == 20 and all(r["ok"] for r in rows) and "20 of 20 checks passed" in done.stdout
    assert {r["check"].split(" ")[1] for r in rows if r["check"].startswith("float32 ")} >= {
        "greedy", "beam", "contrastive_search", "speculative", "mcts", "sampling", "batched"}
    no_gpu = subprocess.run([sys.executable, "-m", "deploy.gpu_check"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert no_gpu.returncode == 2 and "no CUDA device here" in no_gpu.stdout
