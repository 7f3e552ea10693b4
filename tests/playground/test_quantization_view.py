"""Quantization & KV cache view: chart builders on hand-made reports, and the API through gradio_client."""

import pytest

from engine.reports.drift import DriftReport, KVReport, KVStep, PositionDrift, VariantDrift
from playground.charts import quantization as charts
from tests.helpers.api import api_client

MB = 1024 * 1024


def _positions(kls):
    return [PositionDrift(index=i, token_id=10 + i, token=f"t{i}", kl=kl, tv=kl / 2, top1_agrees=kl < 0.5,
                          top1_token_id=10 + i, top1_token=f"t{i}", ref_prob=0.9, variant_prob=0.8)
            for i, kl in enumerate(kls)]


def _variant(q, kls, tokens, divergence, memory_mb, was_loaded=False):
    agree = sum(k < 0.5 for k in kls) / len(kls)
    return VariantDrift(quantization=q, memory_bytes=int(memory_mb * MB), load_s=2.25, was_loaded=was_loaded,
                        positions=_positions(kls), mean_kl=sum(kls) / len(kls), max_kl=max(kls),
                        mean_tv=sum(kls) / 2 / len(kls), top1_agreement=agree, tokens_per_s=12.5, text="".join(tokens),
                        generated_token_ids=list(range(len(tokens))), tokens=tokens, first_divergence=divergence)


def _report(errors=None):
    ref = [" Paris", ".", " It", " is"]
    return DriftReport(
        model="m", prompt="The capital of France is", chat=False, device="cpu", max_new_tokens=4,
        prompt_token_ids=[1, 2, 3], reference_token_ids=[10, 11, 12, 13], reference_tokens=ref,
        reference_text="".join(ref), requested=["none", "int8", "nf4"],
        variants=[_variant("none", [0.0, 0.0, 0.0, 0.0], ref, None, 512.0, was_loaded=True),
                  _variant("int8", [0.01, 0.02, 0.6, 0.1], [" Paris", ".", " The", " <b>"], 2, 200.0)],
        errors=dict(errors or {}),
    )


def test_drift_rows_show_memory_load_speed_kl_agreement_and_divergence():
    rows = charts.drift_rows(_report({"nf4": "no bitsandbytes"}))
    assert len(charts.DRIFT_HEADERS) == len(rows[0]) == 9
    assert rows[0] == ["fp32 (none)", "512.0", "in memory (first load 2.2)", "12.50", "0", "0", "100%", "—", "reference"]
    assert rows[1] == ["int8", "200.0", "2.2", "12.50", "0.1825", "0.6", "75.0%", "—", "at step 2"]  # engine.numbers.percent
    # held-out perplexity (issue #40), when the report measured it
    report = _report()
    report.variants[1].heldout_perplexity = 123.456
    assert charts.drift_rows(report)[1][7] == "123.5"
    assert rows[2][0] == "nf4" and rows[2][-1] == "failed: no bitsandbytes"


def test_kl_figure_has_one_line_per_variant_and_marks_the_divergence():
    fig = charts.kl_figure(_report())
    lines = [t for t in fig.data if t.mode == "lines+markers"]
    assert [t.name for t in lines] == ["fp32 (none)", "int8"]
    assert list(lines[1].y) == [0.01, 0.02, 0.6, 0.1] and list(lines[1].x) == [0, 1, 2, 3]
    (marker,) = [t for t in fig.data if t.mode == "markers"]  # only int8 diverges
    assert list(marker.x) == [2] and list(marker.y) == [0.6]
    assert list(lines[1].customdata)[0] == "0: ␣Paris"


def test_texts_side_by_side_mark_the_divergence_and_escape_tokens():
    page = charts.texts_html(_report())
    assert page.count('class="q-text"') == 2
    assert 'data-variant="int8"' in page and "own text leaves fp32 at step 2 (free-running)" in page
    int8 = page.split('data-variant="int8"')[1]
    assert int8.count("q-diverge") == 1 and int8.count('class="q-after"') == 2  # " The" and " <b>" shaded
    assert int8.index("q-diverge") < int8.index(" The")
    assert "&lt;b&gt;" in page and " <b>" not in page
    assert "q-diverge" not in page.split('data-variant="int8"')[0]  # the reference has no mark
    assert "No variant measured" in charts.texts_html(DriftReport("m", "p", False, "cpu", 1, [], [], [], "", ["none"]))


def test_drift_status_counts_pending_variants():
    report = _report()
    assert "measuring nf4" in charts.drift_status(report) and "2 of 3 measured" in charts.drift_status(report)
    report.errors["nf4"] = "x"
    assert charts.drift_status(report) == "done: 3 variant(s) over 4 reference tokens"


def _kv(tokens_equal=True):
    steps = [KVStep(0, 5, 40.0, 30.0), KVStep(1, 6, 10.0, 31.0), KVStep(2, 7, 11.0, 33.0)]
    return KVReport(
        model="m", quantization="none", device="cpu", dtype="float32", prompt="p", chat=False, prompt_tokens=5,
        generated_token_ids=[1, 2, 3], uncached_token_ids=[1, 2, 3] if tokens_equal else [1, 2, 4],
        tokens_equal=tokens_equal,
        text="abc", cached_tokens_per_s=49.2, uncached_tokens_per_s=31.9, speedup=1.54, steps=steps, cache_positions=7,
        cache_bytes=7 * 512, bytes_per_token=512.0, formula_bytes_per_token=512, layers=2, kv_heads=2, head_dim=16,
        bytes_per_element=4, formula="2 × 2 layers × 2 kv heads × 16 head dim × 4 bytes = 512 bytes",
    )


def test_kv_figure_has_cached_and_uncached_lines_over_positions():
    fig = charts.kv_figure(_kv())
    assert [t.name for t in fig.data] == ["no cache (recompute)", "KV cache"]
    assert list(fig.data[0].y) == [30.0, 31.0, 33.0] and list(fig.data[1].y) == [40.0, 10.0, 11.0]
    assert list(fig.data[1].x) == [5, 6, 7]


def test_kv_summary_shows_speed_size_and_formula():
    page = charts.kv_summary_html(_kv())
    assert "49.2 tokens/s" in page and "31.9 tokens/s" in page and "1.54×" in page
    assert "bytes per token: measured 512 = formula 512</b>" in page
    assert "2 × 2 layers × 2 kv heads × 16 head dim × 4 bytes = 512 bytes" in page
    assert "0.00 MB for 7 positions" in page and "⚠" not in page
    assert "different tokens from step 2 on" in charts.kv_summary_html(_kv(tokens_equal=False))


@pytest.mark.slow
def test_kv_cache_report_api(live_app):

    client = api_client(live_app)
    data = client.predict("The sky is", False, 4, "embedded", "none", api_name="/kv_cache_report")
    assert data["tokens_equal"] and data["generated_token_ids"] == data["uncached_token_ids"]
    assert len(data["steps"]) == len(data["generated_token_ids"]) <= 4
    # SmolLM2-135M: 30 layers, 3 kv heads, head_dim 64, float32 -> 2 * 30 * 3 * 64 * 4 = 46,080 bytes per token
    assert data["formula_bytes_per_token"] == 46080 == data["bytes_per_token"]
    with pytest.raises(Exception, match="prompt: empty"):
        client.predict("  ", False, 4, "embedded", "none", api_name="/kv_cache_report")
