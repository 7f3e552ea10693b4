"""playground.charts.memory on hand-made reports: tables and figures a reader can check by hand."""

from engine.reports.drift import KVDriftReport, KVKindDrift, PositionDrift
from engine.reports.kv_arith import MemoryEstimate
from playground.charts import memory


def position(i: int, kl: float) -> PositionDrift:
    return PositionDrift(index=i, token_id=10 + i, token=f"t{i}", kl=kl, tv=kl / 2, top1_agrees=kl < 0.1,
                         top1_token_id=10 + i, top1_token=f"t{i}", ref_prob=0.5, variant_prob=0.5)


def kind(name: str, kls: list[float], memory_bytes: list[int], bytes_per_token: float, formula: float,
         first_divergence=None, cache_bytes=1000, formula_bytes=1000) -> KVKindDrift:
    return KVKindDrift(
        kind=name, residual_length=2, positions=[position(i, kl) for i, kl in enumerate(kls)],
        mean_kl=sum(kls) / len(kls), max_kl=max(kls), mean_tv=sum(kls) / len(kls) / 2,
        top1_agreement=sum(kl < 0.1 for kl in kls) / len(kls), generated_token_ids=[10, 11, 12], text="abc",
        first_divergence=first_divergence, tokens_per_s=4.0, memory_bytes=memory_bytes, memory_positions=[5, 6, 7],
        cache_positions=7, stored_positions=7, quantized_positions=5, cache_bytes=cache_bytes,
        formula_bytes=formula_bytes, bytes_per_token=bytes_per_token, formula_bytes_per_token=formula,
        formula=f"{formula:.0f} bytes")


def report() -> KVDriftReport:
    return KVDriftReport(
        model="m", prompt="p", chat=False, device="cpu", dtype="float32", max_new_tokens=3, prompt_token_ids=[1, 2, 3, 4, 5],
        reference_token_ids=[10, 11, 12], reference_tokens=["t0", "t1", "t2"], reference_text="abc",
        requested=["dynamic", "quantized-int8", "quantized-int4", "sliding-4"],
        kinds=[kind("dynamic", [0.0, 0.0, 0.0], [2048, 2560, 3072], 512, 512),
               kind("quantized-int8", [0.01, 0.02, 0.03], [768, 1280, 768], 260.5, 192, cache_bytes=1824,
                    formula_bytes=1824)],
        errors={"quantized-int4": "kv_cache: quantized-int4 is not available for this model"},
    )


def test_kind_rows_show_measured_against_formula_and_failures():
    rows = memory.kind_rows(report())
    assert len(rows[0]) == len(memory.KIND_HEADERS)
    assert rows[0] == ["dynamic", "512", "512", "measured 512 = formula 512; whole cache 1,000 bytes = formula for the "
                       "positions held", "4.00", "0", "0", "100%", "reference"]
    assert rows[1][:3] == ["quantized-int8", "260", "192"]  # 260.5 shows as 260 (round half to even)
    assert rows[1][3] == ("measured 260 vs formula 192 (+35.7%): the last 2 of 7 positions are in the full-precision "
                          "residual; whole cache 1,824 bytes = formula for the positions held")
    assert rows[1][5] == "0.02" and rows[1][8] == "never"
    assert rows[2][0] == "quantized-int4" and rows[2][-1].startswith("failed: kv_cache:")


def test_a_mismatch_with_the_formula_is_shown():
    r = report()
    r.kinds[1].formula_bytes = 1800
    assert memory.kind_rows(r)[1][3].endswith("whole cache 1,824 bytes vs formula 1,800 for the positions held (+1.3%)")


def test_memory_figure_has_one_line_per_kind_in_kb():
    fig = memory.memory_figure(report())
    assert [t.name for t in fig.data] == ["dynamic", "quantized-int8"]
    assert list(fig.data[0].y) == [2.0, 2.5, 3.0]  # 2048 / 1024, 2560 / 1024, 3072 / 1024
    assert list(fig.data[1].x) == [5, 6, 7] and fig.data[1].line.color == memory.COLOURS["quantized-int8"]


def test_bytes_per_token_figure_pairs_measured_and_formula():
    measured, formula = memory.bytes_per_token_figure(report()).data
    assert list(measured.x) == ["dynamic", "quantized-int8"] and list(measured.y) == [512, 260.5]
    assert list(formula.y) == [512, 192]


def test_drift_figure_skips_the_yardstick_and_marks_divergence():
    r = report()
    r.kinds[1].first_divergence = 1
    fig = memory.kind_drift_figure(r)
    assert [t.name for t in fig.data] == ["quantized-int8", "quantized-int8 diverges"]
    assert list(fig.data[0].y) == [0.01, 0.02, 0.03]
    assert list(fig.data[1].x) == [1] and list(fig.data[1].y) == [0.02]


def test_calculator_rows_and_bars():
    rows = [MemoryEstimate("Llama-3-8B as MHA", "mha", 32, 524_288, 4.29, 16.06, 20.35),
            MemoryEstimate("Llama-3-8B", "gqa", 8, 131_072, 1.07, 16.06, 17.13),
            MemoryEstimate("Llama-3-8B as MQA", "mqa", 1, 16_384, 0.13, 16.06, 16.19)]
    table = memory.calculator_rows(rows)
    assert table[1] == ["Llama-3-8B", "GQA", "8", "131,072", "1.07", "16.06", "17.13"]
    weights, cache = memory.calculator_figure(rows).data
    assert list(weights.y) == [16.06] * 3 and list(cache.y) == [4.29, 1.07, 0.13]
    assert list(cache.x) == ["MHA (32 KV heads)", "GQA (8 KV heads)", "MQA (1 KV head)"]
    assert list(cache.marker.color) == [memory.ATTENTION_COLOURS[a] for a in ("mha", "gqa", "mqa")]


def test_sliding_kinds_get_their_own_colour():
    assert memory.colour("sliding-4") == memory.SLIDING_COLOUR and memory.colour("odd") == "#555"
