"""Issue #27, Compare: driven as a person drives the page, through the app's own registered events
(tests/helpers/continue_compare.Page carries each component's value from one event to the next).

- a greedy lane (T = 0) picks the argmax, so its picked-from distribution is one-hot: 0 nats;
- every lane's stage panels show its distributions (raw, each stage, final) at the first, a
  middle and the last step, also at T = 5 where the chosen token is far outside the stored top-N;
- a run that errors (a bad knob) or is stopped mid-run leaves no output of the previous run.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from engine.trace import StageTrace, StepTrace, Timing, TokenProb, Trace
from playground.charts import compare as charts
from tests.helpers.continue_compare import Page, run_coroutine
from tests.helpers.compare_room import inspect_step, set_lanes  # noqa: F401

PROMPT = "Write one sentence about the moon."
# The temperature lesson's lanes (presets/lessons/02-temperature.json): T = 0, 1 and 5.
LESSON_LANES = ({"strategy": "sample", "temperature": 0.0}, {"strategy": "sample", "temperature": 1.0, "seed": 7},
                {"strategy": "sample", "temperature": 5.0, "seed": 7})


@pytest.fixture(scope="module")
def demo(registry, embedded):
    from playground.app import build_app

    return build_app(registry)


def run_compare(page: Page, prompt: str = PROMPT, chat: bool = False) -> list[dict]:
    page.set("cmp-prompt", prompt)
    page.set("cmp-chat", chat)
    return page.fire("on_run", "cmp-status")


def session(page: Page):
    dep = page.event("on_run", "cmp-status")
    return page.get(dep.outputs[-1])


# --- 2. the greedy lane's picked-from entropy -----------------------------------------------------

def hand_trace(config: dict, entropies: list[float]) -> Trace:
    """Steps whose final distribution has the given entropy, the raw model's twice that."""
    steps = []
    for i, h in enumerate(entropies):
        stage = StageTrace("raw", 2, 0.0, 2 * h, 0.0, [])
        steps.append(StepTrace(i, 10 + i, f" t{i}", 0.5, 0.5, None, None, None, h, 2 * h, [stage, stage]))
    return Trace("m", config["strategy"], config, "p", [1], "", [10 + i for i in range(len(entropies))],
                 "max_new_tokens", steps, Timing(1.0, 1.0, 1.0))


def test_a_greedy_lane_picks_from_a_one_hot_distribution_of_zero_nats():
    greedy = hand_trace({"strategy": "sample", "temperature": 0.0}, [math.log(4), math.log(2)])
    also_greedy = hand_trace({"strategy": "greedy"}, [math.log(3)])
    hot = hand_trace({"strategy": "sample", "temperature": 5.0, "seed": 7}, [math.log(4), math.log(2)])
    lanes = [greedy, also_greedy, hot]
    flags = [charts.picks_greedily(t) for t in lanes]
    assert flags == [True, True, False]
    fig = charts.entropy_chart(["Lane 1", "Lane 2", "Lane 3"], [t.steps for t in lanes], None, False, flags)
    assert list(fig.data[0].y) == [0.0, 0.0] and list(fig.data[1].y) == [0.0]  # argmax: one-hot, 0 nats
    assert list(fig.data[2].y) == pytest.approx([math.log(4), math.log(2)])  # a draw from the final distribution
    raw = charts.entropy_chart(["Lane 1", "Lane 3"], [greedy.steps, hot.steps], None, True, [True, False])
    assert list(raw.data[0].y) == pytest.approx([2 * math.log(4), 2 * math.log(2)])  # the raw model's, any pick


@pytest.mark.slow
def test_the_greedy_lanes_entropy_is_zero_and_a_sampling_lanes_is_its_final_distributions(demo, embedded):
    page = Page(demo)
    set_lanes(page, LESSON_LANES, 4)
    run_compare(page, chat=True)
    assert "done: 3 of 3 lanes ran" in page.shown("cmp-status"), page.shown("cmp-status")
    figure = page.shown("cmp-entropy")
    greedy, hot = figure.data[0], figure.data[2]
    traces = session(page).traces
    assert traces[0].steps[0].entropy > 0.5  # what the chart showed before: the final (= raw) distribution's
    assert list(greedy.y) == [0.0] * len(traces[0].steps)
    # Lane 3's first token was drawn from softmax(logits / 5) of the prompt: its entropy by hand.
    ids = torch.tensor([embedded.encode(PROMPT, True)])
    with torch.no_grad():
        logits = embedded.model(ids).logits[0, -1].float()
    p = torch.softmax(logits / 5.0, dim=-1)
    by_hand = float(-(p * torch.log(p.clamp_min(1e-45))).sum())
    assert hot.y[0] == pytest.approx(by_hand, rel=1e-3)
    page.set("cmp-entropy-kind", "raw model")
    dep = next(f for f in demo.fns.values() if f.outputs and page.block("cmp-entropy") in f.outputs
               and page.block("cmp-entropy-kind") in f.inputs and "on_run" not in getattr(f.fn, "__name__", ""))
    out = dep.fn(*[page.get(b) for b in dep.inputs])
    raw = next(v for k, v in out.items() if getattr(k, "elem_id", None) == "cmp-entropy")
    assert list(raw.data[0].y) == pytest.approx([s.raw_entropy for s in traces[0].steps])


# --- 1. every lane's panels show its distributions ---------------------------------------------------

def inspect_step_chart(page: Page, lane: str, step: int):
    inspect_step(page, lane, step)
    return page.shown("cmp-inspect-chart")


def panel_bars(fig) -> dict[str, list]:
    """Each panel's bar values, by its x axis ("x", "x2"...), legend-only swatches left out."""
    panels: dict[str, list] = {}
    for bar in fig.data:
        if bar.type == "bar" and bar.showlegend is not True:
            panels.setdefault(bar.xaxis or "x", []).extend(bar.x)
    return panels


@pytest.mark.slow
def test_every_lane_shows_each_stages_distribution_at_the_first_middle_and_last_step(demo):
    """The temperature lesson's lanes, T = 0, 1 and 5: at T = 5 the chosen token is far outside the
    stored top-10 of the flattened distribution and its bars are ~0.1% high."""
    page = Page(demo)
    set_lanes(page, LESSON_LANES, 24)
    run_compare(page, chat=True)
    assert "done: 3 of 3 lanes ran" in page.shown("cmp-status"), page.shown("cmp-status")
    for i, trace in enumerate(session(page).traces):
        last = len(trace.steps) - 1
        for at in (0, last // 2, last):
            step = trace.steps[at]
            fig = inspect_step_chart(page, f"Lane {i + 1}", at)
            where = f"Lane {i + 1} step {at}"
            assert fig is not None and f"step {at}: chose" in fig.layout.title.text, where
            texts = [t for bar in fig.data if bar.type == "bar" for t in (bar.text or ())]
            assert charts.NOT_RECORDED not in texts, where
            panels = panel_bars(fig)
            assert len(panels) >= len(step.stages), where  # raw, each stage, final (and the draw)
            for k, stage in enumerate(step.stages):
                axis = "x" if k == 0 else f"x{k + 1}"
                shown = [x for x in panels[axis] if x is not None]
                assert [t.prob for t in stage.top] == shown[:len(stage.top)], (where, stage.name)
                if all(t.token_id != step.chosen_token_id for t in stage.top):  # drawn after the top-N
                    assert shown[len(stage.top)] > 0, (where, stage.name)
                span = fig.layout[axis.replace("x", "xaxis")].range
                tallest = max(shown)
                assert span is None or tallest >= charts.SLIVER * span[1], (where, stage.name, tallest, span)
                ticks = fig.layout[axis.replace("x", "xaxis")].tickformat  # d3's "%" formats as Python's
                assert float(format(tallest, ticks).rstrip("%")) > 0, (where, stage.name, ticks)  # not "0%, 0%"
            if i == 2:  # T = 5: the temperature stage is the final distribution, chosen token at its p
                temperature = panels["x2"]
                assert temperature[-1] == pytest.approx(step.chosen_prob) and step.chosen_prob < 0.01, where


def test_a_middle_stage_the_trace_cannot_know_stays_unrecorded_and_the_others_read_it():
    """[raw, top-k, temperature, final]: the chosen token's p after top-k is not stored (top-k
    changed it and temperature changed it again); after temperature it is final's; raw's is raw_prob."""
    def stage(name, tv, top):
        return StageTrace(name, 100, 0.0, 1.0, tv, top)

    top = [TokenProb(1, "a", 0.5), TokenProb(2, "b", 0.3)]
    stages = [stage("raw", 0.0, top), stage("top_k", 0.2, top), stage("temperature", 0.1, top),
              stage("final", 0.1, top)]
    step = StepTrace(0, 9, " z", 0.002, 0.0001, 0.9, 0.89, 0.892, 1.0, 1.0, stages)
    assert [charts.chosen_prob_at(step, i) for i in range(4)] == [0.0001, None, 0.002, 0.002]
    quiet = [stage("raw", 0.0, top), stage("repetition_penalty", 0.0, top), stage("top_k", 0.2, top),
             stage("final", 0.0, top)]
    assert [charts.chosen_prob_at(StepTrace(0, 9, " z", 0.002, 0.0001, None, None, None, 1.0, 1.0, quiet), i)
            for i in range(4)] == [0.0001, 0.0001, 0.002, 0.002]
    fig = charts.inspect_chart(step)
    texts = [t for bar in fig.data if bar.type == "bar" for t in (bar.text or ())]
    assert texts.count(charts.NOT_RECORDED) == 1  # top-k's panel only: the engine stores its top-N alone


# --- 4. an error or a Stop leaves no output of the previous run ------------------------------------

FIRST_RUN = "cmp-divergence", "cmp-metrics", "cmp-entropy", "cmp-inspect-explain", "cmp-inspect-chart"


def good_run(page: Page) -> dict:
    """Two lanes of 3 tokens, run to the end, and their second step opened in the inspector:
    every output of the run, by elem_id."""
    set_lanes(page, [{"strategy": "greedy"}, {"strategy": "sample", "temperature": 0.8, "seed": 1}], 3)
    run_compare(page, "The sky is")
    assert "done: 2 of 2" in page.shown("cmp-status"), page.shown("cmp-status")
    inspect_step(page, "Lane 2", 1)
    shown = {e: page.shown(e) for e in (*FIRST_RUN, "cmp-lane-0-text", "cmp-lane-1-text", "cmp-lane-0-status")}
    assert all(v not in (None, "", []) for v in shown.values()), shown
    return shown


def left_over(page: Page, first: dict) -> list[str]:
    """The outputs still showing what the first run showed."""
    return [e for e, v in first.items() if page.shown(e) is v or (not hasattr(v, "data") and page.shown(e) == v)]


@pytest.mark.slow
def test_a_bad_knob_after_a_run_leaves_none_of_its_output(demo):
    page = Page(demo)
    first = good_run(page)
    page.set("cmp-lane-1-knob-temperature", 9)  # out of range: the run fails before any work
    run_compare(page, "The sky is")
    assert "Lane 2: temperature: 9" in page.shown("cmp-status")
    assert not left_over(page, first), left_over(page, first)
    assert all(page.shown(e) in (None, "", []) for e in FIRST_RUN)


@pytest.mark.slow
def test_a_run_stopped_mid_run_leaves_none_of_the_previous_runs_output(demo):
    page = Page(demo)
    first = good_run(page)
    # Long enough that the run's second update is never its last (3 tokens could finish first on a slow machine)
    set_lanes(page, [{"strategy": "greedy"}, {"strategy": "sample", "temperature": 0.8, "seed": 1}], 128)
    page.set("cmp-prompt", "Once upon a time")
    dep = page.event("on_run", "cmp-status")
    args = [page.get(b) for b in dep.inputs]

    async def stopped() -> list:
        """The run's first two updates, then Stop (Gradio cancels the task: the generator closes)."""
        rows, agen = [], dep.fn(*args)
        async for row in agen:
            rows.append(row)
            if len(rows) == 2:
                break
        await agen.aclose()
        return rows

    rows = run_coroutine(stopped)
    assert len(rows) == 2
    for row in rows:
        page.apply(dep, row)
    stop = next(f for f in demo.fns.values() if (page.block("cmp-stop")._id, "click") in
                [(getattr(t[0], "_id", t[0]), t[1]) for t in f.targets])
    wants = len(inspect.signature(stop.fn).parameters)  # a gr.Request where it takes one (none here)
    said = stop.fn(*[None] * wants)
    if inspect.iscoroutine(said):
        said = run_coroutine(lambda: said)
    page.values[stop.outputs[0]._id] = said
    assert "stopped" in page.shown("cmp-status")
    assert not left_over(page, first), left_over(page, first)
    assert all(page.shown(e) in (None, "", []) for e in FIRST_RUN)
