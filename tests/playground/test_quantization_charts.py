"""Quantization charts: teacher-forced vs free-running said in words, no stale load times, 14 px."""

from engine.reports.drift import DriftReport, VariantDrift
from playground.charts import quantization as charts


def variant(q: str, divergence, agreement: float, was_loaded: bool) -> VariantDrift:
    return VariantDrift(quantization=q, memory_bytes=1024 * 1024, load_s=2.0, was_loaded=was_loaded, positions=[],
                        mean_kl=0.0, max_kl=0.0, mean_tv=0.0, top1_agreement=agreement, tokens_per_s=10.0,
                        text=" a\n b", generated_token_ids=[1, 2, 3], tokens=[" a", "\n", " b"], first_divergence=divergence)


def report(variants) -> DriftReport:
    return DriftReport("m", "p", False, "cpu", 3, [9], [1, 2, 3], [" a", "\n", " b"], " a\n b", ["none", "int8"], variants)


def test_int8_row_says_teacher_forced_and_free_running():
    """100% top-1 agreement next to a divergence is not a contradiction once both are labelled."""
    r = report([variant("none", None, 1.0, True), variant("int8", 1, 1.0, False)])
    assert "teacher-forced" in charts.DRIFT_HEADERS[6] and "free-running" in charts.DRIFT_HEADERS[8]
    assert charts.DRIFT_HEADERS[7] == "held-out perplexity"  # issue #40; "—" where not measured
    rows = charts.drift_rows(r)
    assert rows[0][2] == "in memory (first load 2.0)" and rows[1][2] == "2.0"
    assert rows[1][6:] == ["100%", "—", "at step 1"]
    page = charts.texts_html(r)
    assert "own text leaves fp32 at step 1 (free-running); top-1 agreement 100% is teacher-forced" in page
    assert "↵<br>" in page  # a newline token is visible
    assert "teacher-forced" in charts.DRIFT_NOTE and "free-running" in charts.DRIFT_NOTE


def test_figures_use_14px_text_and_legends_below():
    fig = charts.kl_figure(report([variant("none", None, 1.0, True)]))
    assert fig.layout.font.size >= 14 and fig.layout.legend.y < 0 and "teacher-forced" in fig.layout.title.text
