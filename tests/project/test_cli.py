"""The CLI: --json prints exactly one trace object; bad arguments exit 2 with one line naming the problem."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=timeout)


BAD_ARGUMENTS = [
    (["--prompt", "hi", "--set", "temperature=9"], "temperature: 9.0 is out of range; allowed 0 or [0.01, 5]"),
    (["--prompt", "hi", "--set", "top_p=abc"], "top_p"),
    (["--prompt", "hi", "--set", "nonsense=1"], "nonsense: unknown key"),
    (["--prompt", "hi", "--set", "novalue"], "expected KEY=VALUE"),
    (["--prompt", "hi", "--preset", "no-such-preset"], "neither a built-in"),
    (["--prompt", "hi", "--quantization", "int3"], "invalid choice"),
    (["--prompt", "   "], "--prompt: empty"),
    ([], "--prompt"),
]


def cli_here(capsys, *args: str) -> tuple[int, str, str]:
    """``python -m engine ARGS`` in this process (the same ``main``, without a new interpreter's
    five seconds of imports): its exit code, stdout and stderr."""
    from engine.__main__ import main

    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as exc:  # argparse's refusals
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_one_line_refusal(code: int, stdout: str, stderr: str, fragment: str) -> None:
    assert code == 2
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and fragment in lines[0], stderr
    assert stdout == ""


@pytest.mark.parametrize("args,fragment", BAD_ARGUMENTS)
def test_bad_arguments_exit_2_with_one_line(capsys, args, fragment):
    assert_one_line_refusal(*cli_here(capsys, *args), fragment)


@pytest.mark.parametrize("args,fragment", [BAD_ARGUMENTS[0], BAD_ARGUMENTS[-1]], ids=["knob", "argparse"])
def test_bad_arguments_exit_2_with_one_line_from_a_shell(args, fragment):
    """The same refusals from a real ``python -m engine`` process: a knob's and argparse's."""
    result = cli(*args, timeout=120)
    assert_one_line_refusal(result.returncode, result.stdout, result.stderr, fragment)


def test_invalid_preset_file_exits_2(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"version": 1, "name": "x", "strategy": "sample", "top_k": -5}))
    code, _, stderr = cli_here(capsys, "--prompt", "hi", "--preset", str(bad))
    assert code == 2 and "top_k" in stderr and "[0, 100000]" in stderr


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
