"""The compare view: lane settings and chart builders on hand-made data, the /compare API through
gradio_client, and a browser session (add a lane, set a knob with its control, run, read the lanes'
texts and the metrics table). The lane controls' handlers: tests/playground/test_compare_lanes.py."""

from __future__ import annotations

import math

import plotly.graph_objects as go
import pytest

from engine.strategies.contrastive import ContrastCandidate, ContrastStep, SearchCandidate, SearchStep
from engine.reports.metrics import lane_metrics
from engine.trace import StageTrace, StepTrace, Timing, TokenProb, Trace
from playground.charts import compare as charts
from playground.shared import UserError
from playground.views.compare import api as compare_api
from playground.views.compare import lanes as view
from tests.helpers.api import api_client


def step(index: int, token: str, prob: float, entropy: float = math.log(2)) -> StepTrace:
    stage = StageTrace("raw", 2, 0.0, entropy, 0.0, [])
    return StepTrace(index, 100 + index, token, prob, prob, None, None, None, entropy, 2 * entropy, [stage, stage])


def trace(tokens: list[str], ids: list[int], strategy: str = "greedy") -> Trace:
    steps = [step(i, t, 0.5) for i, t in enumerate(tokens)]
    for s, token_id in zip(steps, ids):
        s.chosen_token_id = token_id
    return Trace("m", strategy, {}, "p", [1], "".join(tokens), ids, "max_new_tokens", steps, Timing(50.0, 20.0, 150.0))


# --- lane settings -------------------------------------------------------------------------------


def test_presets_fill_lanes_and_new_lanes_pick_an_unused_preset():
    spec = view.spec_from_preset("contrastive-search")
    assert spec.strategy == "contrastive_search" and spec.knob("top_k") == 4 and spec.more == ""
    assert view.spec_from_preset("no-such-preset") is None
    used = [view.spec_from_preset("greedy"), view.spec_from_preset("balanced")]
    assert view.default_spec(used).preset == "contrastive-search"


def test_lane_operations_keep_two_to_six_lanes():
    lanes = ["a", "b"]
    assert view.add_lane(lanes, "c") == ["a", "b", "c"]
    assert view.duplicate_lane(["a", "b", "c"], 0) == ["a", "a", "b", "c"]
    assert view.remove_lane(["a", "b", "c"], 1) == ["a", "c"]
    with pytest.raises(UserError, match="lanes: at least 2"):
        view.remove_lane(lanes, 0)
    with pytest.raises(UserError, match="lanes: at most 6"):
        view.add_lane(list("abcdef"), "g")
    with pytest.raises(UserError, match="lanes: at most 6"):
        view.duplicate_lane(list("abcdef"), 2)


def test_api_lanes_get_the_shared_seed_and_budget():
    cfg = compare_api.api_lane_config({"preset": "balanced", "config": {"top_k": 7}}, 11, 5, "Lane 1")
    assert (cfg.strategy, cfg.top_k, cfg.seed, cfg.max_new_tokens, cfg.temperature) == ("sample", 7, 11, 5, 0.8)
    with pytest.raises(UserError, match="Lane 2: expected an object"):
        compare_api.api_lane_config({"presett": "greedy"}, 0, 5, "Lane 2")
    assert view.sweep_seeds(3, 4) == [3, 4, 5, 6]
    with pytest.raises(UserError, match=r"seeds: expected an integer in \[2, 16\], got 1"):
        view.sweep_seeds(0, 1)


# --- chart builders ------------------------------------------------------------------------------


def test_metrics_rows_and_divergence_text():
    a, b = trace([" the", " cat"], [1, 2]), trace([" the", " dog", "!"], [1, 3, 4], "sample")
    rows = charts.metrics_rows([lane_metrics(a, "Lane 1"), lane_metrics(b, "Lane 2")], ["greedy", "sample"])
    assert len(rows[0]) == len(charts.METRIC_HEADERS)
    assert rows[0][:5] == ["Lane 1", "greedy", 2, round(math.log(0.5), 3), 2.0]  # p = 1/2 each -> perplexity 2
    assert rows[1][2] == 3 and rows[1][-1] == "max_new_tokens"
    text = charts.divergence_markdown(["Lane 1", "Lane 2"], [a, b], 1)
    assert "diverge at step 1" in text and "`␣cat`" in text and "`␣dog`" in text
    assert charts.divergence_markdown(["Lane 1", "Lane 2"], [a, a], None).startswith("All 2 lanes produced the same")


def test_entropy_chart_overlays_lanes_in_nats_and_marks_divergence():
    a, b = trace([" x", " y"], [1, 2]), trace([" x", " z"], [1, 3])
    fig = charts.entropy_chart(["Lane 1", "Lane 2"], [a.steps, b.steps], divergence=1)
    assert isinstance(fig, go.Figure) and [t.name for t in fig.data] == ["Lane 1", "Lane 2"]
    assert list(fig.data[0].y) == pytest.approx([math.log(2)] * 2)  # entropy ln 2 nats (a coin flip)
    assert fig.layout.shapes[0].x0 == 1
    raw = charts.entropy_chart(["Lane 1"], [a.steps], raw=True)
    assert list(raw.data[0].y) == pytest.approx([2 * math.log(2)] * 2)  # raw entropy 2 ln 2 nats


def test_highlights_mark_the_divergence_and_clicks_map_back_to_steps():
    steps = trace([" a", " b", " c"], [1, 2, 3]).steps
    items = charts.lane_highlights(steps, divergence=1)
    assert [t for t, _ in items] == [" a", charts.DIVERGE_MARK, " b", " c"]
    assert items[1][1] is None and items[0][1] == 0.0  # p = 0.5 -> score 2p - 1 = 0
    assert [charts.clicked_step(i, 1) for i in range(4)] == [0, 1, 1, 2]
    assert charts.clicked_step(2, None) == 2


def test_record_tables_show_scores_and_mark_the_choice():
    search = SearchStep(0, 0.6, 7, [SearchCandidate(5, " a", 0.5, 0.9, -0.34),
                                    SearchCandidate(7, " b", 0.3, 0.1, 0.06)])
    text = charts.record_markdown(search)
    assert "α = 0.6" in text and "| `␣b` ← | 0.3000 | 0.1000 | 0.0600 |" in text
    contrast = ContrastStep(0, 0.1, 3, 0.05, 9, [ContrastCandidate(9, "|x", -1.0, -3.0, 2.0, True),
                                                  ContrastCandidate(4, "y", -4.0, -0.5, None, False)])
    text = charts.record_markdown(contrast)
    assert "3 plausible tokens" in text and "| `¦x` ← | -1.000 | -3.000 | 2.000 |" in text and "implausible" in text


def served(ids: list[int], mode: str, url: str = "http://127.0.0.1:8080", **knobs) -> Trace:
    """A greedy lane on a served model: each step's raw top-2 are its pick (p 0.41) and 7 (p 0.40)."""
    t = trace([f" t{i}" for i in ids], ids)
    t.config = {"max_new_tokens": 8, **knobs}
    t.model = f"llamacpp:{url}"
    for s in t.steps:
        s.stages = [StageTrace("raw", 100, 0.0, 1.0, 0.0, [TokenProb(s.chosen_token_id, s.chosen_token, 0.41),
                                                          TokenProb(7, " t7", 0.40)])]
    t.extra["remote"] = {"url": url, "mode": mode}
    return t


def test_a_step_and_a_fast_lane_that_part_ways_on_one_server_say_where_and_why():
    step, fast = served([1, 2, 3, 4], "step"), served([1, 2, 7, 5], "fast")
    note = charts.served_modes_note(["Lane 1", "Lane 2", "Lane 3"], [trace([" x"], [9]), fast, step])
    assert note.startswith("**Lane 3 (step mode) and Lane 2 (fast mode) part ways at step 2**"), note
    assert "step mode took `␣t3`, fast mode `␣t7` (the server's p in step mode: 41% vs 40%, a near-tie)" in note
    assert "`-np 1`" in note and "\n" not in note  # one line
    assert charts.parting_step(step, fast) == 2
    assert charts.served_modes_note(["a", "b"], [step, served([1, 2, 3, 4], "fast")]) == ""  # the same tokens
    assert charts.served_modes_note(["a", "b"], [step, served([1, 2], "fast")]) == ""  # one ended (stopped) first
    assert charts.served_modes_note(["a", "b"], [step, served([1, 2, 7], "fast", "http://127.0.0.1:9")]) == ""
    assert charts.served_modes_note(["a", "b"], [step, served([1, 2, 7], "fast", top_k=5)]) == ""  # other knobs
    assert charts.served_modes_note(["a", "b"], [step, served([1, 2, 7], "step")]) == ""  # both step mode
    assert charts.parting_step(step, served([1, 2, 7], "fast", seed=4)) == 2  # greedy ignores the seed
    hot = served([1, 2, 7], "fast", temperature=0.8)
    hot.strategy = "sample"
    assert charts.parting_step(served([1, 2, 3], "step", temperature=0.8), hot) is None  # a draw: no claim
    assert "&lt;b&gt;" in charts.served_modes_note(["<b>", "b"], [step, fast])


def test_lane_status_and_sweep_text():
    t = trace([" a"], [1])
    assert "running… 1 / 8 tokens" in charts.lane_status("Lane 1", t, 8, "running")
    assert "running… 3 / 8 tokens" in charts.lane_status("Lane 1", None, 8, "running", made=3)  # a beam's steps
    assert "1 tokens, stop: max_new_tokens reached, 20.0 tok/s" in charts.lane_status("Lane 1", t, 8)
    assert "1 tokens, stop: max_new_tokens reached" in charts.lane_status("Lane 1", t, 8, "done")
    assert "Lane 1: stopped after 1 of 8 tokens</div>" in charts.lane_status("Lane 1", t, 8, "stopped")
    assert "Lane 1: stopped at the time limit after 0 of 8 tokens" in charts.lane_status(
        "Lane 1", None, 8, "stopped", why="at the time limit")
    assert "Lane 1: waiting" in charts.lane_status("Lane 1", None, 8, "waiting")
    assert "&lt;b&gt;" in charts.lane_status("<b>", None, 8)
    from engine.reports.metrics import sweep_spread

    spread = sweep_spread([[1, 2], [1, 3]])
    assert "**2** distinct outputs" in charts.sweep_markdown("Lane 2", [4, 5], spread)
    assert charts.sweep_rows([4], [t], [math.log(0.5)]) == [[4, 1, round(math.log(0.5), 3), " a"]]


# --- the app -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_compare_api_runs_three_lanes_on_one_prompt_and_seed(live_app):

    client = api_client(live_app)
    lanes = [{"preset": "greedy"}, {"preset": "balanced"}, {"preset": "contrastive-search", "config": {"top_k": 3}}]
    data = client.predict("The sky is", lanes, 7, 5, False, "embedded", "none", api_name="/compare")
    traces = [lane["trace"] for lane in data["lanes"]]
    assert [t["strategy"] for t in traces] == ["greedy", "sample", "contrastive_search"]
    assert {t["config"]["seed"] for t in traces} == {7} and data["seed"] == 7
    assert {t["prompt"] for t in traces} == {"The sky is"}
    assert len({tuple(t["prompt_token_ids"]) for t in traces}) == 1
    assert all(1 <= len(t["steps"]) <= 5 for t in traces)
    assert [m["name"] for m in data["metrics"]] == ["Lane 1", "Lane 2", "Lane 3"]
    ids = [t["generated_token_ids"] for t in traces]
    at = data["divergence"]
    assert at is None or len({tuple(x[:at]) for x in ids}) == 1  # identical before the divergence step
    with pytest.raises(Exception, match="lanes: expected a list of 2 to 6"):
        client.predict("The sky is", lanes[:1], 7, 5, False, "embedded", "none", api_name="/compare")


@pytest.mark.slow
def test_seed_sweep_api_counts_distinct_outputs(live_app):

    client = api_client(live_app)
    data = client.predict("The sky is", {"preset": "greedy"}, 3, 0, 4, False, "embedded", "none",
                          api_name="/compare_sweep")
    assert data["seeds"] == [0, 1, 2] and len(set(data["texts"])) == 1  # greedy ignores the seed
    assert data["spread"]["distinct_outputs"] == 1 and data["spread"]["mean_token_overlap"] == 1.0


@pytest.mark.slow
@pytest.mark.browser
def test_add_lane_set_a_knob_run_and_read_both_texts(page, live_app, artifacts):
    page.goto(live_app)
    page.get_by_role("tab", name="Compare").click()
    page.fill("#cmp-prompt textarea", "The sky is")
    page.click("#cmp-add")
    page.wait_for_selector("#cmp-lane-2", state="visible")
    for i in range(3):
        box = page.locator(f"#cmp-lane-{i}-knob-max_new_tokens input")
        box.fill("6")
        box.press("Enter")
    temperature = page.locator("#cmp-lane-1-knob-temperature input")  # lane 2: balanced (sample)
    temperature.fill("0.5")
    temperature.press("Enter")
    page.wait_for_selector("#cmp-lane-1-header:has-text('sample · T 0.5 · top-p 0.9 · seed 0 · 6 tokens')")
    assert page.locator("#cmp-lane-0-knob-temperature input").is_disabled()  # greedy ignores it
    assert page.locator("#cmp-lane-2-knob-top_k input").is_enabled()  # the added lane: contrastive search's k
    assert "ignored by greedy" not in page.locator("#cmp-lane-2").inner_text()
    assert page.locator("#cmp-lane-0-preset input").input_value() == "greedy"  # the budget is not a knob of it
    assert page.locator("#cmp-lane-1-preset input").input_value() == "(custom)"  # the temperature is
    assert "=" not in page.locator("#cmp-lane-0-header").inner_text()
    page.click("#cmp-run")
    page.wait_for_selector("#cmp-status:has-text('done:')", timeout=300_000)
    texts = []
    for i in range(3):
        assert page.locator(f"#cmp-lane-{i}-text .token").count() >= 1
        assert "tokens, stop:" in page.locator(f"#cmp-lane-{i}-status").inner_text()
        texts.append(page.locator(f"#cmp-lane-{i}-text").inner_text())
    assert all(t.strip() for t in texts[:2])
    assert page.locator("#cmp-metrics [role=row]").count() == 4  # the header and one row per lane
    table = page.locator("#cmp-metrics").inner_text()
    assert all(name in table for name in ("Lane 1", "Lane 2", "Lane 3", "greedy", "contrastive search"))
    page.locator("#cmp-lane-1-text .token").first.click()
    page.wait_for_selector("#cmp-inspect-chart .js-plotly-plot")
    page.screenshot(path=str(artifacts / "compare.png"), full_page=True)
