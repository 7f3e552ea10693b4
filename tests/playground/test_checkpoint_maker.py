"""The 4-bit checkpoints made on first need (issue #52, playground/checkpoint_maker.py): on a fresh cache
the maker starts, says "step k of n, about N min left" from the variants still missing, a failed run
says its last log line, and a second start makes only what is still missing (resumable). A stand-in
maker (a script writing each variant's config.json, as deploy/quantize.py renames each into place)
keeps these fast; ``test_real_maker_on_a_fresh_cache`` runs deploy/quantize.sh itself on a fresh cache
with a one-variant plan (rtn-g64: seconds) and the llm-compressor venv already installed."""

import json
import os
import sys
import time
from pathlib import Path

import pytest

from engine.backends import quant_methods
from playground import checkpoint_maker
from playground.checkpoint_maker import INSTALL_S, METHOD_S, STARTUP_S, Maker

STAND_IN = """
import os, sys, time
from pathlib import Path
out, fail_after = Path(sys.argv[1]), int(os.environ.get("STAND_IN_FAIL_AFTER", "99"))
record = Path(sys.argv[2])
record.write_text(record.read_text() + os.environ["QUANTIZE_VARIANTS"] + "\\n" if record.exists() else
                  os.environ["QUANTIZE_VARIANTS"] + "\\n")
for i, name in enumerate(os.environ["QUANTIZE_VARIANTS"].split()):
    if i == fail_after:
        print(f"quantize: {name}: out of memory", file=sys.stderr)
        sys.exit(1)
    print(f"quantize: making {name} ...", file=sys.stderr, flush=True)
    time.sleep(0.3)
    (out / name).mkdir(parents=True)
    (out / name / "config.json").write_text("{}")
"""


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """A fresh cache folder, a stand-in model folder and the stand-in maker's script."""
    monkeypatch.setenv("DECODING_PLAYGROUND_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("QUANTIZE_VENV", raising=False)
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    return tmp_path / "model", script, tmp_path / "asked.txt"


def stand_in(script: Path, out: Path, record: Path):
    return lambda variants: ([sys.executable, str(script), str(out), str(record)],
                             {"QUANTIZE_VARIANTS": " ".join(variants)})


def wait(maker: Maker, limit_s: float = 60.0):
    deadline = time.monotonic() + limit_s
    while (p := maker.progress()).made < p.total and not p.error and time.monotonic() < deadline:
        time.sleep(0.1)
    maker.process.wait(30)
    return maker.progress()


def test_a_fresh_cache_makes_the_missing_checkpoints_with_progress_and_resumes(fresh, monkeypatch):
    model, script, record = fresh
    variants = ["rtn-g64", "gptq-g64", "awq-g64"]
    out = quant_methods.checkpoints_dir(model)
    maker = Maker(model, variants, stand_in(script, out, record))
    before = maker.progress()  # nothing made, no venv: the install counts
    expected_s = INSTALL_S + STARTUP_S + METHOD_S["rtn"] + METHOD_S["gptq"] + METHOD_S["awq"]
    assert (before.made, before.total, before.left_s) == (0, 3, expected_s)
    assert before.sentence().endswith(f"step 1 of 3, about {round(expected_s / 60)} min left")

    monkeypatch.setenv("STAND_IN_FAIL_AFTER", "1")  # the first run makes one, then fails
    maker.start()
    failed = wait(maker)
    assert (failed.made, failed.total) == (1, 3)
    assert failed.error.startswith("quantize: gptq-g64: out of memory (log: ")
    assert failed.sentence().startswith("making the checkpoints failed: quantize: gptq-g64: out of memory")

    monkeypatch.delenv("STAND_IN_FAIL_AFTER")
    maker.start()  # resumes: asks only for what is still missing
    done = wait(maker)
    assert (done.made, done.total, done.left_s, done.error) == (3, 3, 0.0, "")
    assert record.read_text().splitlines() == ["rtn-g64 gptq-g64 awq-g64", "gptq-g64 awq-g64"]
    assert quant_methods.made_variants(model) == variants


def test_ensure_is_none_once_made_and_one_maker_per_cache(fresh, monkeypatch):
    model, script, record = fresh
    monkeypatch.setattr(checkpoint_maker, "embedded_model_dir", lambda: model)
    monkeypatch.setattr(checkpoint_maker, "_makers", {})
    monkeypatch.setattr(checkpoint_maker, "COMMAND", stand_in(script, quant_methods.checkpoints_dir(model), record))
    first = checkpoint_maker.ensure(["rtn-g64", "gptq-g64"])
    assert first is not None and checkpoint_maker.ensure(["rtn-g64", "gptq-g64"]) is first  # a second page follows it
    assert wait(first).done
    assert checkpoint_maker.ensure(["rtn-g64", "gptq-g64"]) is None
    assert record.read_text().splitlines() == ["rtn-g64 gptq-g64"]  # started once


@pytest.mark.slow
@pytest.mark.quantized
def test_real_maker_on_a_fresh_cache(quant_checkpoints, tmp_path, monkeypatch):
    """deploy/quantize.sh itself, started by the maker on an empty cache (the converted model linked in,
    the installed llm-compressor venv reused through QUANTIZE_VENV), for one variant: it is made whole."""
    from engine.backends.local import embedded_model_dir

    model = embedded_model_dir()
    venv = quant_checkpoints.parent / "llmcompressor-0.14"
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / model.name).symlink_to(model)
    monkeypatch.setenv("DECODING_PLAYGROUND_CACHE", str(cache))
    monkeypatch.setenv("QUANTIZE_VENV", str(venv))
    maker = Maker(model, ["rtn-g64"])
    assert maker.progress().left_s < INSTALL_S  # the venv is there: no install counted
    maker.start()
    done = wait(maker, 600)
    assert done.done and done.error == "", maker.last_line()
    assert maker.process.returncode == 0
    made = quant_methods.checkpoint_path(model, "rtn-g64")
    assert made.parent.parent == cache
    assert json.loads((made / "quantize.json").read_text())["method"] == "rtn"
    quant_methods.read_layout(json.loads((made / "config.json").read_text()), "rtn-g64")
    assert not any(p.name.startswith(".") for p in made.parent.iterdir())  # no temporary folder left
    assert os.environ["QUANTIZE_VENV"] == str(venv) and not (cache / "llmcompressor-0.14").exists()  # not reinstalled
