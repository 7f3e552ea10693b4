"""Issue #27, the Quantization & KV cache view in front of a room:

- the KV cache kinds heading renders as a plain heading over a normal paragraph (no literal "\\n",
  no paragraph swallowed into the heading);
- the KV kinds table and the KV report say "measured X vs formula Y (+Z%)" from their own numbers,
  and "=" only where the numbers are equal, with what the measurement holds that the formula does not;
- /kv_calculator names the bad argument by its API name in one short line, whatever it is given
  (a 100,000-character string, a list, a dict, deep nesting);
- a new run of each report clears the previous report's charts and tables at its first update, so
  a Stop leaves no chart of the previous report on screen.
"""

from __future__ import annotations

import re

import pytest

from engine.reports import drift
from playground.charts import memory
from playground.charts import quantization as charts
from playground.views import quantization as view
from tests.helpers.api import api_client

PROMPT = "Once upon a time, in a small village by the sea,"
COMPARED = re.compile(r"^measured ([\d,]+) (=|vs) formula ([\d,]+)(?: \(([+-][\d.]+)%\))?")
CACHE = re.compile(r"whole cache ([\d,]+) bytes (=|vs) formula (?:([\d,]+) )?for the positions held"
                   r"(?: \(([+-][\d.]+)%\))?")


def number(text: str) -> int:
    return int(text.replace(",", ""))


def check_words_agree_with_numbers(cell: str, measured: float, formula: float, cache: int, cache_formula: int) -> None:
    """``cell`` says "=" exactly when the shown numbers agree, and its percentages are theirs."""
    head = COMPARED.match(cell)
    assert head, cell
    shown_measured, sign, shown_formula, change = head.groups()
    assert number(shown_measured) == round(measured) and number(shown_formula) == round(formula), cell
    if round(measured) == round(formula):
        assert sign == "=" and change is None, cell
    else:
        assert sign == "vs" and float(change) == pytest.approx((measured - formula) / formula * 100, abs=0.051), cell
    tail = CACHE.search(cell)
    assert tail and number(tail.group(1)) == cache, cell
    if cache == cache_formula:
        assert tail.group(2) == "=", cell
    else:
        assert tail.group(2) == "vs" and number(tail.group(3)) == cache_formula, cell
        assert float(tail.group(4)) == pytest.approx((cache - cache_formula) / cache_formula * 100, abs=0.051), cell


@pytest.mark.parametrize("kinds, residual", [
    (["dynamic", "quantized-int8", "quantized-int4", "sliding-4"], 2),  # a short residual: most positions quantized
    (["quantized-int8", "quantized-int4"], 64),  # the residual outlasts the run: nothing quantized yet
    (["quantized-int8", "sliding-64"], 5),  # a window wider than the run holds every position
])
def test_kinds_table_says_measured_vs_formula_from_its_own_numbers(tiny_lm, kinds, residual):
    report = drift.kv_drift_report(tiny_lm, PROMPT, False, 12, kinds, residual)
    rows = memory.kind_rows(report)
    assert "=" not in " ".join(memory.KIND_HEADERS)  # no header claims an equality for every row
    for k, row in zip(report.kinds, rows):
        assert row[1] == f"{k.bytes_per_token:,.0f}" and row[2] == f"{k.formula_bytes_per_token:,.0f}"
        check_words_agree_with_numbers(row[3], k.bytes_per_token, k.formula_bytes_per_token, k.cache_bytes,
                                       k.formula_bytes)
        full = k.stored_positions - k.quantized_positions
        if k.kind.startswith("quantized-") and full:
            assert round(k.bytes_per_token) != round(k.formula_bytes_per_token)
            assert f"the last {full} of {k.cache_positions} positions are in the full-precision residual" in row[3] or (
                f"all {k.cache_positions} positions are in the full-precision residual" in row[3])
        if k.kind.startswith("sliding-") and k.stored_positions < k.cache_positions:
            assert f"the window holds {k.stored_positions} of the {k.cache_positions} positions" in row[3]


def test_the_int8_numbers_of_the_issue_read_as_measured_vs_formula():
    """The embedded model's int8 row from the issue: 17,207 measured per position, 14,400 by the
    long-term formula: the row says so, with the difference and where it comes from."""
    k = drift.KVKindDrift(
        kind="quantized-int8", residual_length=8, positions=[], mean_kl=0.0, max_kl=0.0, mean_tv=0.0,
        top1_agreement=1.0, generated_token_ids=[], text="", first_divergence=None, tokens_per_s=1.0,
        memory_bytes=[], memory_positions=[], cache_positions=100, stored_positions=100, quantized_positions=91,
        cache_bytes=91 * 14_400 + 9 * 46_080, formula_bytes=91 * 14_400 + 9 * 46_080, bytes_per_token=17_251.2,
        formula_bytes_per_token=14_400.0, formula="…")
    cell = memory.measured_vs_formula(k)
    assert cell.startswith("measured 17,251 vs formula 14,400 (+19.8%): the last 9 of 100 positions are in the "
                           "full-precision residual; whole cache 1,725,120 bytes = formula for the positions held")
    check_words_agree_with_numbers(cell, k.bytes_per_token, k.formula_bytes_per_token, k.cache_bytes, k.formula_bytes)


@pytest.mark.parametrize("measured, formula, expected", [
    (512.0, 512, "bytes per token: measured 512 = formula 512"),
    (600.0, 512, "bytes per token: measured 600 vs formula 512 (+17.2%)"),
    (384.0, 512, "bytes per token: measured 384 vs formula 512 (-25.0%)"),
])
def test_kv_report_summary_says_what_its_numbers_say(measured, formula, expected):
    report = drift.KVReport(
        model="m", quantization="none", device="cpu", dtype="float32", prompt="p", chat=False, prompt_tokens=5,
        generated_token_ids=[1, 2], uncached_token_ids=[1, 2], tokens_equal=True, text="ab", cached_tokens_per_s=2.0,
        uncached_tokens_per_s=1.0, speedup=2.0, steps=[], cache_positions=6, cache_bytes=int(measured * 6),
        bytes_per_token=measured, formula_bytes_per_token=formula, layers=2, kv_heads=2, head_dim=16,
        bytes_per_element=4, formula="2 × 2 layers × 2 kv heads × 16 head dim × 4 bytes = 512 bytes")
    page = charts.kv_summary_html(report)
    assert expected + "</b>" in page
    assert "≠" not in page and ("= formula" in page) == (measured == formula)


def test_the_kv_reports_own_measurement_equals_its_formula(tiny_lm):
    report = drift.kv_cache_report(tiny_lm, PROMPT, False, 8)
    assert report.bytes_per_token == report.formula_bytes_per_token  # a DynamicCache holds exactly K and V
    assert f"measured {report.formula_bytes_per_token:,} = formula {report.formula_bytes_per_token:,}" in (
        charts.kv_summary_html(report))


# --- /kv_calculator: one short line naming the argument -------------------------------------------
BIG = "x" * 100_000
DEEP: list = [1]
for _ in range(60):
    DEEP = [DEEP]
BAD_ARGUMENTS = [  # (argument, value, custom architecture?)
    ("architecture_name", BIG, False), ("architecture_name", ["Llama-2-7B"], False),
    ("architecture_name", {"a": 1}, False), ("architecture_name", DEEP, False), ("architecture_name", None, False),
    ("context", BIG, False), ("context", [4096], False), ("context", {"a": 1}, False), ("context", 0, False),
    ("context", 10**400, False), ("batch", [1], False), ("batch", float("nan"), False),
    ("kv_dtype", BIG, False), ("kv_dtype", ["fp16"], False), ("kv_dtype", {"fp16": 2}, False),
    ("weights_dtype", ["fp16"], False), ("weights_dtype", BIG, False),
    ("layers", {"a": 1}, True), ("layers", BIG, True), ("heads", [32], True), ("kv_heads", 3, True),
    ("head_dim", DEEP, True), ("parameters_b", BIG, True), ("parameters_b", [7.0], True),
    ("parameters_b", 1e-30, True),
]


def calculator_arguments(argument: str, value, custom: bool) -> dict:
    values = {"architecture_name": "custom" if custom else "Llama-2-7B", "context": 4096, "batch": 1,
              "kv_dtype": "fp16", "weights_dtype": "fp16", "layers": 32, "heads": 32, "kv_heads": 8, "head_dim": 128,
              "parameters_b": 7.0}
    return values | {argument: value}


@pytest.mark.parametrize("argument, value, custom", BAD_ARGUMENTS,
                         ids=[f"{a}={str(v)[:12]}" for a, v, _ in BAD_ARGUMENTS])
def test_calculator_names_each_bad_argument_in_one_short_line(argument, value, custom):
    with pytest.raises(ValueError) as caught:
        view.kv_calculator(**calculator_arguments(argument, value, custom))
    message = str(caught.value)
    assert message.startswith(f"{argument}: "), message[:300]
    assert "\n" not in message and len(message) <= 300, message[:300]
    assert "unhashable" not in message and "not iterable" not in message


def test_the_calculator_view_shows_a_cut_message_for_a_huge_value():
    out = view.CalcOutputs("formula", "table", "chart")
    shown = view.calculator_updates(out, BIG, 4096, 1, "fp16", "fp16")
    assert set(shown) == {"formula"} and "architecture_name: expected one of" in shown["formula"]
    assert "(100,000 characters)" in shown["formula"] and len(shown["formula"]) < 600


@pytest.mark.slow
def test_calculator_endpoint_errors_name_their_argument_through_a_real_server(live_app):

    client = api_client(live_app)
    good = client.predict("Llama-2-7B", 4096, 1, "fp16", "fp16", api_name="/kv_calculator")
    assert good["estimate"]["kv_bytes_per_token"] == 524_288
    for argument, value in (("architecture_name", BIG), ("architecture_name", ["Llama-2-7B"]),
                            ("kv_dtype", {"a": 1}), ("context", BIG)):
        arguments = calculator_arguments(argument, value, False)
        with pytest.raises(Exception) as caught:
            client.predict(*list(arguments.values())[:5], api_name="/kv_calculator")
        message = str(caught.value)
        assert message.startswith(f"{argument}: ") and len(message) <= 300 and "\n" not in message, message[:300]


# --- the page: heading, and a new run clears the previous report --------------------------------
@pytest.fixture(scope="module")
def demo(registry, embedded):
    from playground.app import build_app

    return build_app(registry)


@pytest.mark.slow
def test_kinds_heading_renders_as_a_heading_over_a_paragraph(demo):
    import gradio as gr
    from markdown_it import MarkdownIt

    text = next(b.value for b in demo.blocks.values()
                if isinstance(b, gr.Markdown) and str(b.value).startswith("### KV cache kinds"))
    rendered = MarkdownIt().render(text)
    assert rendered.startswith("<h3>KV cache kinds</h3>\n<p>The header's model decodes the prompt with each kind")
    assert "\\n" not in text and "<strong>" not in rendered and rendered.count("<h3>") == 1


QUANT_VIEWS = {  # view: (event, first output, {elem_id: value} for a short run, charts and tables to clear)
    "quantization drift": ("on_measure", "quant-status", {"quant-tokens": 3, "quant-variants": ["none"]},
                           ["quant-table", "quant-kl", "quant-texts", "quant-download"]),
    "kv cache": ("on_kv", "kv-status", {"kv-tokens": 3}, ["kv-summary", "kv-chart"]),
    "kv cache kinds": ("on_run", "kinds-status", {"kinds-tokens": 3, "kinds-kinds": ["dynamic"]},
                       ["kinds-table", "kinds-memory", "kinds-per-token", "kinds-drift", "kinds-download"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(QUANT_VIEWS))
def test_a_new_report_clears_the_previous_one_at_its_first_update(demo, name):
    """A good report, then a second run stopped after its first update (Stop closes the run's
    generator): none of the first report's charts, tables or downloads is left on screen."""
    from playground import stale
    from tests.helpers.continue_compare import Page, run_coroutine

    event, first, values, shown = QUANT_VIEWS[name]
    page = Page(demo)
    for elem_id, value in values.items():
        page.set(elem_id, value)
    page.fire(event, first)
    assert all(page.shown(e) not in (None, "", []) for e in shown), {e: page.shown(e) for e in shown}
    dep = page.event(event, first)
    args = [page.get(b) for b in dep.inputs]

    async def first_update() -> list:
        agen = dep.fn(*args)
        row = await agen.__anext__()
        await agen.aclose()
        return row

    for block, value in zip(dep.outputs, run_coroutine(first_update)):
        if isinstance(value, dict) and value.get("__type__") == "update":
            if "value" not in value:
                continue
            value = value["value"]
        page.values[block._id] = value
    for elem_id in shown:
        block = page.block(elem_id)
        value = page.shown(elem_id)
        empty = stale.empty_value(block)
        assert value == empty or (empty is None and not getattr(value, "data", value)), (elem_id, value)


@pytest.mark.slow
def test_stop_says_stopped_in_each_running_section_and_cancels_every_run(demo):
    """The tab's one Stop button: the KV section, which was running, says "stopped" (it kept its
    "in progress" line before); the drift section's finished report keeps its "done"; Stop cancels
    the drift, KV cache and KV kinds runs."""
    from playground.shared import status_html
    from tests.helpers.continue_compare import Page

    page = Page(demo)
    page.set("quant-status", status_html("done: 1 variant(s) over 3 reference tokens"))
    page.set("kv-status", status_html("greedy with and without the cache, 48 tokens each…"))
    page.set("kinds-status", "")
    page.fire("stopped_statuses", "quant-status")
    assert page.shown("kv-status") == status_html("stopped")
    assert page.shown("quant-status") == status_html("done: 1 variant(s) over 3 reference tokens")
    assert page.shown("kinds-status") == ""
    runs = {page.event(name, first)._id for name, first in
            (("on_measure", "quant-status"), ("on_kv", "kv-status"), ("on_run", "kinds-status"))}
    # the press cancels the tab's runs itself (events.stop_runs); Gradio's cancel of queued ones follows
    cancel = next(f for f in demo.fns.values() if f.is_cancel_function and runs <= set(f.cancels))
    assert cancel.fn is None
