"""The CLI: --json prints exactly one trace object; bad arguments exit 2 with one line naming the problem."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=timeout)


@pytest.mark.parametrize("args,fragment", [
    (["--prompt", "hi", "--set", "temperature=9"], "temperature: 9.0 is out of range; allowed 0 or [0.01, 5]"),
    (["--prompt", "hi", "--set", "top_p=abc"], "top_p"),
    (["--prompt", "hi", "--set", "nonsense=1"], "nonsense: unknown key"),
    (["--prompt", "hi", "--set", "novalue"], "expected KEY=VALUE"),
    (["--prompt", "hi", "--preset", "no-such-preset"], "neither a built-in"),
    (["--prompt", "hi", "--quantization", "int3"], "invalid choice"),
    (["--prompt", "   "], "--prompt: empty"),
    ([], "--prompt"),
])
def test_bad_arguments_exit_2_with_one_line(args, fragment):
    result = cli(*args, timeout=120)
    assert result.returncode == 2
    lines = [ln for ln in result.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and fragment in lines[0], result.stderr
    assert result.stdout == ""


def test_invalid_preset_file_exits_2(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"version": 1, "name": "x", "strategy": "sample", "top_k": -5}))
    result = cli("--prompt", "hi", "--preset", str(bad), timeout=120)
    assert result.returncode == 2 and "top_k" in result.stderr and "[0, 100000]" in result.stderr


@pytest.mark.slow
def test_json_output_is_one_trace_object():
    result = cli("--preset", "balanced", "--prompt", "The sky is", "--set", "max_new_tokens=6", "--set", "seed=7", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)  # exactly one JSON document on stdout
    assert data["strategy"] == "sample" and data["config"]["seed"] == 7
    assert len(data["generated_token_ids"]) == len(data["steps"]) <= 6
    assert [s["name"] for s in data["steps"][0]["stages"]] == ["raw", "temperature", "top_p", "final"]


@pytest.mark.slow
def test_readable_output_and_chat_flag():
    result = cli("--preset", "greedy", "--prompt", "Say hi.", "--chat", "--set", "max_new_tokens=4")
    assert result.returncode == 0, result.stderr
    assert "SmolLM2-135M-Instruct · greedy" in result.stdout
    assert len([ln for ln in result.stdout.splitlines() if ln.strip().startswith(("0 ", "1 "))]) >= 1
