"""DP_* numbers: one parser (engine.settings), and a bad value refuses to start in one line."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine import control, scheduler
from engine.settings import INTEGER_SETTINGS, SettingsError, check_environment, env_int, env_seconds
from playground import events
from playground import app as playground_app

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("value", ["0", "-1", "lots", "1.5", "0x10", "1e3"])
def test_max_batch_is_refused_alike_by_the_scheduler_and_the_page(monkeypatch, value):
    monkeypatch.setenv("DP_MAX_BATCH", value)
    with pytest.raises(SettingsError, match="^DP_MAX_BATCH: expected an integer >= 1, got "):
        scheduler.default_max_batch(__import__("torch").device("cpu"))
    with pytest.raises(SettingsError, match="^DP_MAX_BATCH: "):
        events.max_batch()
    with pytest.raises(SettingsError, match="^DP_MAX_BATCH: "):
        events.default_concurrency()
    with pytest.raises(SettingsError, match="^DP_MAX_BATCH: "):
        check_environment()


def test_every_number_reads_the_same_way(monkeypatch):
    for name in INTEGER_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("DP_REQUEST_SECONDS", raising=False)
    check_environment()
    assert events.max_batch() == 16 and events.default_concurrency() == 16
    assert events.session_capacity() == events.DEFAULT_SESSIONS
    assert playground_app.queue_size() == playground_app.DEFAULT_QUEUE_SIZE
    assert control.request_seconds() == control.DEFAULT_REQUEST_SECONDS
    monkeypatch.setenv("DP_MAX_BATCH", " 8 ")
    monkeypatch.setenv("DP_QUEUE_SIZE", "30")
    monkeypatch.setenv("DP_REQUEST_SECONDS", "0")  # 0: no limit
    assert (events.max_batch(), events.default_concurrency(), playground_app.queue_size()) == (8, 8, 30)
    assert control.request_seconds() == 0 and control.RunControl.with_request_limit().deadline_s is None
    for name in INTEGER_SETTINGS:
        monkeypatch.setenv(name, "-5")
        with pytest.raises(SettingsError, match=f"^{name}: expected an integer >= {INTEGER_SETTINGS[name]}, got -5$"):
            check_environment()
        monkeypatch.delenv(name)
    for bad in ("soon", "nan", "-1", "inf"):
        monkeypatch.setenv("DP_REQUEST_SECONDS", bad)
        with pytest.raises(SettingsError, match="^DP_REQUEST_SECONDS: expected a number of seconds >= 0"):
            control.request_seconds()
    with pytest.raises(SettingsError) as long_value:
        env_int("DP_SESSIONS", 1, environ={"DP_SESSIONS": "x" * 10_000})
    assert len(str(long_value.value)) < 100
    assert env_seconds("DP_REQUEST_SECONDS", 5.0, environ={}) == 5.0


@pytest.mark.parametrize("name,value", [("DP_MAX_BATCH", "0"), ("DP_REQUEST_SECONDS", "soon"), ("DP_QUEUE_SIZE", "-2")])
def test_the_app_refuses_to_start_with_a_bad_setting_in_one_line(name, value):
    env = {**os.environ, name: value, "GRADIO_SERVER_PORT": "1"}  # never reaches launch
    result = subprocess.run([sys.executable, "app.py", "--no-preload"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {name}: expected "), result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "Running on" not in result.stdout
