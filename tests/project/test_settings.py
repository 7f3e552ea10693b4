"""DP_* settings: one table and one reader per kind (engine.settings), every variable listed there
and in docs/deployment.md, and a bad value refuses to start in one line."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import app
from engine import control, scheduler, settings
from engine.backends import local, registry
from engine.settings import INTEGER_SETTINGS, SettingsError, check_environment, env_int, env_seconds
from playground import app as playground_app
from playground import events, examples
from playground import whatif_service

ROOT = Path(__file__).resolve().parents[2]


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


@pytest.mark.parametrize("name,value", [("DP_MAX_BATCH", "0"), ("DP_REQUEST_SECONDS", "soon"), ("DP_QUEUE_SIZE", "-2"),
                                        ("DP_PUBLIC", "ture"), ("DP_DTYPE", "float64")])
def test_the_app_refuses_to_start_with_a_bad_setting_in_one_line(name, value):
    env = {**os.environ, name: value, "GRADIO_SERVER_PORT": "1"}  # never reaches launch
    result = subprocess.run([sys.executable, "app.py", "--no-preload"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {name}: expected "), result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "Running on" not in result.stdout


# --- the table: every variable in the code, in SETTINGS and in docs/deployment.md -------------------
SOURCES = [ROOT / "app.py", *(p for d in ("engine", "playground", "deploy") for p in (ROOT / d).rglob("*")
                              if p.suffix in (".py", ".sh", ".md") and p.is_file())]
KINDS = {"flag": "flag", "text": "text", "list": "comma-separated list", "seconds": "seconds ≥ 0",
         "platform": "set by Hugging Face"}


def readme_row(setting: settings.Setting) -> str:
    """docs/deployment.md's row for one setting (section 5, "Every setting"), built from the table."""
    kind = (f"integer ≥ {setting.minimum}" if setting.kind == "int"
            else " / ".join(f"`{c}`" for c in setting.choices) if setting.kind == "choice" else KINDS[setting.kind])
    return f"| `{setting.name}` | {kind} | {setting.default_text} | {setting.does} |"


def test_every_dp_variable_in_the_code_is_in_the_table_and_the_docs():
    used = {name for path in SOURCES for name in re.findall(r"\bDP_[A-Z][A-Z_]*[A-Z]\b", path.read_text("utf-8"))}
    assert {"DP_PUBLIC", "DP_MODELS", "DP_EXAMPLES", "DP_BROWSER_SECRET", "DP_MAX_BATCH"} <= used  # the scan works
    assert used - set(settings.BY_NAME) == set()
    page = (ROOT / "docs" / "deployment.md").read_text("utf-8")
    for setting in settings.SETTINGS:
        assert readme_row(setting) in page, f"docs/deployment.md 'Every setting' row of {setting.name} is stale"
    assert len(settings.BY_NAME) == len(settings.SETTINGS)  # one entry per name
    rest = "".join(p.read_text("utf-8") for p in SOURCES if p.name != "settings.py")
    assert [s.name for s in settings.SETTINGS if s.name not in rest] == []  # no entry nothing reads


def test_only_engine_settings_reads_the_environment():
    """Every other module asks engine.settings; a write (os.environ[...] = / setdefault) is allowed."""
    readers = re.compile(r"environ\.get\(|getenv\(|environ\[[^\]]+\](?!\s*=[^=])")
    found = [f"{p.relative_to(ROOT)}:{i}" for p in SOURCES if p.suffix == ".py" and p.name != "settings.py"
             for i, line in enumerate(p.read_text("utf-8").splitlines(), 1) if readers.search(line)]
    assert found == []


# --- the readers agree with the old ones on every value the old ones understood ---------------------
def old_default_off(value):  # app.is_public / engine.backends.local._env_flag (DP_PUBLIC, DP_ALLOW_LOCAL_MODELS)
    return value.strip().lower() in ("1", "true", "yes", "on")


def old_default_on(value):  # examples.enabled / whatif_service.direct_enabled (DP_EXAMPLES, DP_WHATIF_ROUTE)
    return value.strip().lower() not in ("0", "false", "no", "off")


FLAG_READS = {  # the call sites, each reading its flag the way the app does
    "DP_PUBLIC": (lambda: app.is_public(dict(os.environ)), old_default_off),
    "DP_ALLOW_LOCAL_MODELS": (lambda: registry.model_policy().allow_local, old_default_off),
    "DP_EXAMPLES": (examples.enabled, old_default_on),
    "DP_WHATIF_ROUTE": (whatif_service.direct_enabled, old_default_on),
}


@pytest.mark.parametrize("name", FLAG_READS)
def test_flags_read_as_before_and_refuse_anything_else(monkeypatch, name):
    for other in ("SPACE_ID", "SPACES_ZERO_GPU", *FLAG_READS):
        monkeypatch.delenv(other, raising=False)
    read, old = FLAG_READS[name]
    assert read() is settings.BY_NAME[name].default is old("")  # unset: the old default
    for value in ("1", "true", "yes", "on", "TRUE", " On ", "0", "false", "no", "off", "NO", "", "  "):
        monkeypatch.setenv(name, value)
        assert read() is old(value) is settings.env_flag(name), value
    monkeypatch.setenv(name, "ture")
    with pytest.raises(SettingsError, match=f"^{name}: expected 1/true/yes/on or 0/false/no/off, got 'ture'$"):
        read()
    with pytest.raises(SettingsError, match=f"^{name}: "):
        check_environment()


def test_public_mode_is_one_function_for_the_app_and_the_model_policy(monkeypatch):
    for name in ("DP_PUBLIC", "SPACE_ID", "DP_MODELS", "DP_MODEL", "DP_ALLOW_LOCAL_MODELS"):
        monkeypatch.delenv(name, raising=False)
    cases = [({}, False), ({"DP_PUBLIC": "yes"}, True), ({"DP_PUBLIC": "0"}, False), ({"SPACE_ID": "a/b"}, True),
             ({"SPACE_ID": "a/b", "DP_PUBLIC": "off"}, True), ({"SPACE_ID": ""}, False)]
    for env, public in cases:
        assert settings.public_mode(env) is app.is_public(env) is public, env
        with monkeypatch.context() as m:
            for key, value in env.items():
                m.setenv(key, value)
            assert registry.model_policy().public is settings.public_mode() is public, env


def test_one_gpu_model_list(monkeypatch):
    """app.py (a Space's DP_MODELS), deploy/make_space.py (the Space README) and engine.backends.registry (the
    default allow-list on a GPU) offer the same GPU models: engine.settings.GPU_HUB_MODELS."""
    from deploy import make_space

    assert app.GPU_HUB_MODELS is make_space.GPU_HUB_MODELS is settings.GPU_HUB_MODELS
    assert app.HUB_DEFAULT is settings.HUB_DEFAULT
    offered = app.offered_models(has_gpu=True, has_embedded=True)
    assert offered == ["embedded", app.HUB_DEFAULT, *settings.GPU_HUB_MODELS]
    for name in ("DP_PUBLIC", "SPACE_ID", "DP_MODELS", "DP_MODEL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert registry.model_policy().allowed == ("embedded", *settings.GPU_HUB_MODELS)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert registry.model_policy().allowed == ("embedded",)
    hub_ids = re.compile(r"[\"'](?:Qwen|HuggingFaceTB)/[\w.-]+[\"']")
    assert [p.name for p in SOURCES if p.name != "settings.py" and hub_ids.search(p.read_text("utf-8"))] == []


def test_text_list_and_choice_settings_read_as_before(monkeypatch, tmp_path):
    for name in ("DP_MODEL", "DP_QUANTIZATION", "DP_BROWSER_SECRET", "DP_DOWNLOAD_DIR", "DP_DTYPE",
                 "DECODING_PLAYGROUND_CACHE", "SPACES_ZERO_GPU"):
        monkeypatch.delenv(name, raising=False)
    args = app.parse_args([])
    assert (args.model, args.quantization) == ("embedded", "none")  # os.environ.get(name, default) before
    monkeypatch.setenv("DP_MODEL", " org/a ")
    monkeypatch.setenv("DP_QUANTIZATION", "int8")
    assert (app.parse_args([]).model, app.parse_args([]).quantization) == ("org/a", "int8")
    monkeypatch.setenv("DP_QUANTIZATION", "int4")  # argparse never checked a default against its choices
    with pytest.raises(SettingsError, match=r"^DP_QUANTIZATION: expected none \| int8 \| nf4 \| rtn-g64 \| gptq-g64 \| "
                                            r"awq-g64 \| rtn-g32 \| gptq-g32 \| awq-g32 \| gptq-g64-code \| "
                                            r"awq-g64-code, got 'int4'$"):
        check_environment()
    monkeypatch.delenv("DP_QUANTIZATION")
    assert settings.env_text("DP_BROWSER_SECRET") == "decoding-playground-presets-v1"
    assert local.cache_root() == Path.home() / ".cache" / "decoding-playground"
    monkeypatch.setenv("DECODING_PLAYGROUND_CACHE", str(tmp_path))
    assert local.cache_root() == tmp_path
    assert settings.env_list("DP_MODELS", {"DP_MODELS": "embedded, org/a ,,org/a"}) == ("embedded", "org/a")
    assert settings.env_list("DP_MODELS", {}) == ()
    assert local.resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert local.DTYPES == settings.BY_NAME["DP_DTYPE"].choices
    assert local.QUANTIZATIONS == settings.BY_NAME["DP_QUANTIZATION"].choices
    # The platform's ZeroGPU variable: set and not 0/false/no/off, as before; never refused.
    for value, zero in (("true", True), ("1", True), ("yes please", True), ("0", False), ("False", False), ("", False)):
        monkeypatch.setenv("SPACES_ZERO_GPU", value)
        assert settings.zero_gpu_space() is zero and examples.enabled() is not zero, value
        check_environment()


def test_numeric_defaults_in_the_table_are_the_code_s(monkeypatch):
    for name in INTEGER_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("DP_REQUEST_SECONDS", raising=False)
    by_name = settings.BY_NAME
    assert events.session_capacity() == by_name["DP_SESSIONS"].default
    assert events.SessionRuns().limit == by_name["DP_RUNS_PER_SESSION"].default
    assert playground_app.queue_size() == by_name["DP_QUEUE_SIZE"].default
    assert scheduler.DEFAULT_MAX_QUEUE == by_name["DP_MAX_QUEUE"].default
    assert control.request_seconds() == by_name["DP_REQUEST_SECONDS"].default
    assert events.max_batch() == scheduler.DEFAULT_MAX_BATCH_CPU
    assert by_name["DP_MAX_BATCH"].shown == "16 on CPU, 32 on GPU"
    for name, value in app.PUBLIC_LIMITS.items():  # the docs' default column names the public value
        assert f"({value} in public mode)" in by_name[name].default_text, name
