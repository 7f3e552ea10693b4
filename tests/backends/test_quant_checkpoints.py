"""The 4-bit checkpoints made here (issue #40) on the embedded model: every variant loads and is
really 4-bit, our dequantization equals compressed-tensors' own, GPTQ and AWQ against round to
nearest on held-out text, the calibration set's effect, one layer inside, the variants through
the drafters, the drift report, the CLI and the API, and a quantization killed halfway.

Marked `quantized`: they run last and wait for deploy/quantize.sh (started in the background by
`make test`; the `quant_checkpoints` fixture makes them, or waits for the run going on)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.helpers.common import ROOT, make_tiny_llama
from engine.reports import drift, quant_report
from engine.backends import quant_methods
from engine import runner
from engine.runner import RUNS
from engine.runner import RunRequest
from engine.config import DecodingConfig
from engine.reports.lessons import builtin_lessons, evaluate, run_lesson
from engine.backends.local import ModelSpec, embedded_model_dir
from engine.settings import cache_root
from engine.backends.quant_methods import WEIGHT_METHODS
from engine.trace import to_dict
from tests.helpers.api import api_client

pytestmark = [pytest.mark.quantized, pytest.mark.slow]
LC_PYTHON = cache_root() / "llmcompressor-0.14" / "bin" / "python"


@pytest.fixture(scope="module")
def comparison(quant_checkpoints, registry):
    return quant_report.compare_methods(registry, "embedded", [*quant_report.COMPARED, "gptq-g64-code", "awq-g64-code"])


def test_every_variant_loads_and_is_four_bit(quant_checkpoints, registry, embedded):
    fp32_file = (embedded_model_dir() / "model.safetensors").stat().st_size
    for name, method in WEIGHT_METHODS.items():
        lm = registry.get(ModelSpec(quantization=name))
        assert lm.quantization == name and lm.name == embedded.name
        # on disk: 4-bit Linear weights plus one float32 scale per group; the embedding (tied LM head) stays float32
        linears = [m for n, m in lm.model.named_modules() if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head")]
        weights = sum(m.weight.numel() for m in linears)
        assert len(linears) == 210  # 30 layers × q, k, v, o, gate, up, down
        # 4 bits a weight, a float32 scale a group, an int64 [2] weight_shape a Linear
        assert lm.packed_bytes == weights // 2 + 4 * weights // method.group_size + 16 * len(linears)
        assert lm.disk_bytes < fp32_file * 0.45
        assert lm.memory_bytes == embedded.memory_bytes  # dequantized at load: the float model's memory
        q = lm.model.get_submodule("model.layers.7.mlp.down_proj").weight  # [576, 1536]
        groups = q.view(q.shape[0], -1, method.group_size)
        levels = groups / groups.abs().amax(-1, keepdim=True).clamp_min(1e-30)
        assert max(len(torch.unique(g)) for g in levels[:32].flatten(0, 1)) <= 16  # 16 levels per group at most
        assert len(runner.run(RunRequest(lm, "The capital of France is", DecodingConfig(strategy="greedy", max_new_tokens=3))).steps) == 3


def test_our_dequantization_equals_compressed_tensors_own(quant_checkpoints, tmp_path):
    """compressed-tensors (in llm-compressor's venv, through transformers there) decompresses the GPTQ
    checkpoint; every weight equals what our loader makes from the same files, bit for bit."""
    path = quant_methods.checkpoint_path(embedded_model_dir(), "gptq-g64")
    out = tmp_path / "decompressed.safetensors"
    script = ("import sys, torch; from transformers import AutoModelForCausalLM, CompressedTensorsConfig;"
              "from safetensors.torch import save_file;"
              "m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32,"
              " quantization_config=CompressedTensorsConfig(run_compressed=False));"
              "save_file({k: v.contiguous() for k, v in m.state_dict().items() if 'layers.' in k}, sys.argv[2])")
    done = subprocess.run([str(LC_PYTHON), "-c", script, str(path), str(out)], capture_output=True, text=True,
                          timeout=1200, env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    from safetensors.torch import load_file

    theirs = load_file(str(out))  # it keeps weight_scale / weight_shape beside each decompressed weight
    ours, _ = quant_methods.dense_state_dict(path)
    weights = sorted(k for k in theirs if k.endswith(".weight"))
    assert len(weights) == 30 * (7 + 2) and weights == sorted(k for k in ours if "layers." in k)
    assert all(torch.equal(theirs[k], ours[k]) for k in weights)


def test_gptq_and_awq_against_round_to_nearest_on_held_out_text(comparison, embedded):
    held_out_ids = embedded.encode(quant_report.HELDOUT.read_text(encoding="utf-8"))
    rows = {r.variant: r for r in comparison.rows}
    assert not comparison.errors, comparison.errors
    # the held-out asset is shorter than the cap: every one of its tokens is read
    assert comparison.heldout_tokens == min(quant_report.HELDOUT_TOKENS, len(held_out_ids)) > 900
    fp32 = rows["none"]
    assert fp32.mean_kl == 0 and fp32.top1_agreement == 1
    for group in (64, 32):
        rtn, gptq, awq = (rows[f"{m}-g{group}"] for m in ("rtn", "gptq", "awq"))
        assert awq.perplexity < rtn.perplexity and awq.mean_kl < rtn.mean_kl, (group, awq, rtn)
        assert gptq.perplexity < rtn.perplexity and gptq.mean_kl < rtn.mean_kl, (group, gptq, rtn)
        assert fp32.perplexity < min(gptq.perplexity, awq.perplexity)
    # smaller groups: more scales (5 bits a weight instead of 4.5), less error
    assert rows["rtn-g32"].mean_kl < rows["rtn-g64"].mean_kl
    assert rows["rtn-g64"].bits_per_weight == pytest.approx(4.5, abs=0.01)
    assert rows["rtn-g32"].bits_per_weight == pytest.approx(5.0, abs=0.01)
    assert rows["nf4"].bits_per_weight == 4.5 and rows["int8"].mean_kl < rows["rtn-g64"].mean_kl
    json.dumps(to_dict(comparison), allow_nan=False)


def test_the_calibration_set_moves_the_drift(comparison):
    """Calibrated on code instead of prose, GPTQ drifts further from fp32 on held-out prose (it fits
    its calibration inputs); AWQ, which only takes each channel's mean |activation| from them, moves
    less than GPTQ."""
    rows = {r.variant: r for r in comparison.rows}
    moved = {m: rows[f"{m}-g64-code"].mean_kl - rows[f"{m}-g64"].mean_kl for m in ("gptq", "awq")}
    assert moved["gptq"] > 0 and abs(moved["awq"]) < moved["gptq"], moved


def test_inside_one_layer(quant_checkpoints, registry):
    """q_proj of layer 15: GPTQ's output error (what it minimises) is below RTN's; AWQ's scales
    follow the activations' magnitudes."""
    inside = quant_report.inside_layer(registry, "embedded", 15, "q_proj", 64)
    out, weight = inside.mean_output_error, inside.mean_weight_error
    assert out["gptq-g64"] < out["rtn-g64"] and out["awq-g64"] < out["rtn-g64"]
    assert len(inside.weight_error["rtn-g64"]) == 576 and len(inside.awq_scales) == 576
    assert inside.scale_activation_correlation > 0.5  # measured 0.73 (docs/quantization.md, bench.quant_methods --inside)
    assert all(v > 0 for v in weight.values())
    with pytest.raises(ValueError, match="^layer: expected a whole number in \\[0, 29\\], got 30"):
        quant_report.inside_layer(registry, "embedded", 30)
    with pytest.raises(ValueError, match="^module: expected q_proj | gate_proj"):
        quant_report.inside_layer(registry, "embedded", 1, "<b>v_proj</b>")


def test_a_checkpoint_drafts_for_its_own_model(quant_checkpoints, registry, embedded):
    """Greedy speculative decoding with the AWQ copy as drafter gives the target's own greedy text."""
    prompt = "List three fruits."
    target = runner.run(RunRequest(embedded, prompt, DecodingConfig(strategy="greedy", max_new_tokens=12), chat=True))
    spec = runner.run(RunRequest(embedded, prompt, DecodingConfig(strategy="speculative", drafter="self-awq-g64", temperature=0.0,
                                                       max_new_tokens=12), chat=True, registry=registry))
    assert spec.generated_token_ids == target.generated_token_ids
    assert spec.summary["acceptance_rate"] > 0.3


def test_the_drift_report_takes_the_checkpoints(quant_checkpoints, registry):
    report = drift.quantization_report(registry, "embedded", "Name the planets.", True, 6, ("none", "gptq-g64"))
    assert [v.quantization for v in report.variants] == ["none", "gptq-g64"] and not report.errors
    fp32, gptq = report.variants
    assert gptq.disk_bytes > 0 and gptq.packed_bytes > 0 and fp32.disk_bytes == 0
    assert gptq.heldout_perplexity > fp32.heldout_perplexity > 1


def test_the_cli_runs_a_checkpoint(quant_checkpoints, registry):
    done = subprocess.run([sys.executable, "-m", "engine", "--preset", "greedy", "--prompt", "The sea is",
                           "--set", "max_new_tokens=4", "--quantization", "awq-g32", "--json"], capture_output=True,
                          text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-500:]
    here = runner.run(RunRequest(registry.get(ModelSpec(quantization="awq-g32")), "The sea is",
                      DecodingConfig(strategy="greedy", max_new_tokens=4)))
    assert json.loads(done.stdout)["generated_token_ids"] == here.generated_token_ids


def test_the_gptq_vs_awq_lessons_check_holds(quant_checkpoints, registry, embedded):
    lesson = builtin_lessons()["gptq-vs-awq"]
    outcome = evaluate(embedded, lesson, run_lesson(embedded, lesson, registry, runs=RUNS), registry, runs=RUNS)
    assert outcome.ok, outcome.summary
    assert "GPTQ" in outcome.summary and "AWQ" in outcome.summary and "code instead of prose" in outcome.summary
    json.dumps(outcome.figures, allow_nan=False)


# --- a quantization killed halfway ------------------------------------------------------------------
def test_a_quantization_killed_halfway_leaves_the_cache_usable(quant_checkpoints, tmp_path):
    """deploy/quantize.py on a tiny random Llama (embedded tokenizer), killed (SIGKILL) while it makes
    its second checkpoint: the first is whole and loads, the second is absent (never half-written);
    the next run keeps the first, clears a dead run's temporary folder and makes the second."""
    from transformers import AutoTokenizer

    model_dir = tmp_path / "tiny"
    model = make_tiny_llama(seed=3)
    model.save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(embedded_model_dir()).save_pretrained(model_dir)
    out = tmp_path / "w4"
    command = [str(LC_PYTHON), str(ROOT / "deploy" / "quantize.py"), "--model", str(model_dir), "--out", str(out),
               "--calibration", f"prose={quant_methods.CALIBRATION_SETS['prose']}", "--max-tokens", "32",
               "rtn-g32", "awq-g32"]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 900
    while not (out / "rtn-g32" / "config.json").is_file():
        assert first.poll() is None and time.time() < deadline, "the first run ended before its first checkpoint"
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)  # now making awq-g32
    first.wait(30)
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == ["rtn-g32"]
    _, loaded, packed = quant_methods.load_checkpoint(out / "rtn-g32", torch.float32)
    assert packed > 0 and loaded(input_ids=torch.tensor([[1, 2, 3]])).logits.shape[-1] == model.config.vocab_size
    stale = out / ".awq-g32-dead0001"  # what a run killed while writing leaves: a temporary folder, never awq-g32
    stale.mkdir(exist_ok=True)
    (stale / "model.safetensors").write_bytes(b"half")
    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-1000:]
    assert "rtn-g32 is already made" in again.stderr
    assert (out / "awq-g32" / "config.json").is_file() and not list(out.glob(".*"))
    quant_methods.load_checkpoint(out / "awq-g32", torch.float32)


# --- the GPTQ vs AWQ lesson and the view, in a real browser --------------------------------------------
@pytest.mark.browser
def test_the_gptq_vs_awq_lesson_runs_in_the_browser(quant_checkpoints, browser, live_app, registry, artifacts):
    """At 1280×720: Run and check shows the check's sentence (✓) with the engine's own numbers and the
    comparison chart; on a phone (390×844): Open in its view runs the view's comparison, whose table
    and sentence carry the same numbers."""
    from tests.helpers.common import browser_page
    from playground.charts.quant_methods import comparison_sentence

    expected = quant_report.compare_methods(registry, "embedded", ["rtn-g64", "gptq-g64", "awq-g64"])
    pages = browser_page(browser, 1280, 720, timeout_ms=900_000)
    page = next(pages)
    try:
        page.goto(f"{live_app}/?lesson=gptq-vs-awq")
        page.locator("#lessons-steps h3", has_text="GPTQ vs AWQ").wait_for()
        page.click("#lessons-run")
        page.wait_for_selector("#lessons-status:has-text('done'), #lessons-status .dp-error")
        outcome = page.locator("#lesson-outcome-text").inner_text()
        assert outcome.startswith("✓"), outcome
        for variant in ("rtn-g64", "gptq-g64", "awq-g64"):
            assert f"{expected.row(variant).perplexity:.1f}" in outcome, (variant, outcome)
        page.wait_for_function("() => { const p = document.querySelector('#lessons-chart .js-plotly-plot');"
                               " return p && JSON.stringify(p.layout.annotations || []).includes('perplexity'); }")
        page.screenshot(path=str(artifacts / "lesson-gptq-vs-awq.png"))
    finally:
        pages.close()
    pages = browser_page(browser, 390, 844, timeout_ms=900_000)
    phone = next(pages)
    try:
        phone.goto(f"{live_app}/?lesson=gptq-vs-awq")
        phone.locator("#lessons-steps h3", has_text="GPTQ vs AWQ").wait_for()
        phone.click("#lessons-open")
        phone.wait_for_selector("#methods-status:has-text('done'), #methods-status .dp-error")
        sentence = phone.locator("#methods-sentence").inner_text()
        assert "RTN" in sentence and "GPTQ" in sentence and "AWQ" in sentence and "failed" not in sentence
        table = phone.locator("#methods-table").inner_text()
        for variant in ("rtn-g64", "gptq-g64", "awq-g64", "nf4", "int8"):
            assert variant in table
        assert f"{expected.row('awq-g64').perplexity:.1f}" in table
        assert phone.evaluate("() => document.documentElement.scrollWidth") <= 390 + 1
        phone.screenshot(path=str(artifacts / "quant-methods-phone.png"), full_page=False)
    finally:
        pages.close()
    assert comparison_sentence(expected).startswith("fp32 perplexity")


# --- the API: a gradio_client against the real app -----------------------------------------------------
@pytest.mark.browser  # shares the live app with the browser tests
def test_the_api_compares_methods_and_lanes_take_a_variant_each(quant_checkpoints, live_app, registry, comparison):

    client = api_client(live_app)
    data = client.predict(["rtn-g32", "awq-g32"], "embedded", api_name="/quantization_methods_report")
    assert [r["variant"] for r in data["rows"]] == ["none", "rtn-g32", "awq-g32"] and not data["errors"]
    here = [comparison.row(v) for v in ("none", "rtn-g32", "awq-g32")]  # the same measure, made in this process
    assert [r["perplexity"] for r in data["rows"]] == pytest.approx([r.perplexity for r in here], rel=1e-6)
    lanes = [{"preset": "greedy", "quantization": "gptq-g64"}, {"preset": "greedy", "quantization": "awq-g64"},
             {"preset": "greedy"}]
    answer = client.predict("The sky is", lanes, 0, 6, False, "embedded", "none", api_name="/compare")
    ids = [lane["trace"]["generated_token_ids"] for lane in answer["lanes"]]
    for lane_ids, variant in zip(ids, ("gptq-g64", "awq-g64", "none")):
        alone = runner.run(RunRequest(registry.get(ModelSpec(quantization=variant)), "The sky is",
                           DecodingConfig(strategy="greedy", max_new_tokens=6)))
        assert lane_ids == alone.generated_token_ids, variant
    with pytest.raises(Exception, match="Lane 1: quantization: expected one of none"):
        client.predict("The sky is", [{"quantization": "<b>gptq</b>"}, {}], 0, 6, False, "embedded", "none",
                       api_name="/compare")
    inside = client.predict(2, "gate_proj", 32, "embedded", api_name="/quantization_inside_layer")
    assert inside["methods"] == ["rtn-g32", "gptq-g32", "awq-g32"] and len(inside["awq_scales"]) == 576
