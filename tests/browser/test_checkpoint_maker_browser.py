"""Issue #52, as found: on a fresh machine the "GPTQ vs AWQ" lesson said "✗ not shown on this run: … the
gptq-g64-code checkpoint is not made yet; run `make quantize`". Now, on a fresh checkpoint cache, Run and
check starts the maker, the page says "step k of n, about N min left", and once the checkpoints are
there the lesson checks its claim and draws its chart.

Making the five checkpoints for real takes about 8 CPU-minutes (docs/quantization.md), too long for the
suite: the maker here is a stand-in that puts the checkpoints this machine already made (the
``quant_checkpoints`` fixture: deploy/quantize.sh) into the fresh cache one at a time, each renamed into
place whole as deploy/quantize.py does. tests/playground/test_checkpoint_maker.py runs the real script on a fresh
cache (one variant) and checks the progress, a failure and the resume."""

import re
import sys

import pytest

from engine.backends import quant_methods
from engine.backends.local import embedded_model_dir
from engine.reports.lesson_results import RESULTS
from engine.reports.lessons import GPTQ_VS_AWQ
from playground import checkpoint_maker

pytestmark = [pytest.mark.slow, pytest.mark.browser, pytest.mark.quantized]

STAND_IN = """
import os, sys, time
from pathlib import Path
made, out = Path(sys.argv[1]), Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
for name in os.environ["QUANTIZE_VARIANTS"].split():
    print(f"quantize: making {name} ...", file=sys.stderr, flush=True)
    time.sleep(2)
    tmp = out / f".{name}-stand-in"
    tmp.mkdir()
    for f in (made / name).iterdir():
        (tmp / f.name).symlink_to(f)
    os.replace(tmp, out / name)
"""


@pytest.fixture
def fresh_cache(quant_checkpoints, tmp_path, monkeypatch):
    """An empty checkpoint cache (the converted model linked in: no second conversion) and the stand-in maker."""
    model = embedded_model_dir()
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / model.name).symlink_to(model)
    monkeypatch.setenv("DECODING_PLAYGROUND_CACHE", str(cache))
    out = quant_methods.checkpoints_dir(model)
    assert out.parent == cache and quant_methods.made_variants(model) == []
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    monkeypatch.setattr(checkpoint_maker, "_makers", {})
    RESULTS.clear()  # an earlier test's kept result of the lesson would be shown without the checkpoints
    monkeypatch.setattr(checkpoint_maker, "COMMAND", lambda variants: (
        [sys.executable, str(script), str(quant_checkpoints), str(out)], {"QUANTIZE_VARIANTS": " ".join(variants)}))
    return model


def test_gptq_lesson_on_a_fresh_cache_makes_its_checkpoints_then_shows_its_chart(fresh_cache, page, live_app, artifacts):
    page.goto(f"{live_app}/?lesson=gptq-vs-awq")
    page.locator("#lessons-steps").get_by_text("GPTQ vs AWQ").wait_for()
    page.click("#lessons-run")
    status = page.locator("#lessons-status")
    status.get_by_text(re.compile(r"making the checkpoints .*: step [1-5] of 5, about \d+ min left")).wait_for(
        timeout=300_000)
    page.screenshot(path=str(artifacts / "lesson-checkpoints-progress.png"))
    page.locator("#lesson-outcome-text").wait_for(timeout=600_000)
    outcome = page.locator("#lesson-outcome-text").inner_text()
    assert outcome.startswith("✓ Held-out perplexity, 4-bit group 64"), outcome
    assert "not made yet" not in outcome
    page.wait_for_selector("#lessons-chart .js-plotly-plot")
    assert quant_methods.made_variants(fresh_cache) == [v for v in quant_methods.WEIGHT_METHODS if v in GPTQ_VS_AWQ]
    assert page.locator("#lessons-status .dp-error").count() == 0
