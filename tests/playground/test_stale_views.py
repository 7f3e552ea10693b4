"""Issue #27, "after an error the previous run's charts and text stay on screen under the message":
in every view, a run that succeeded and then a run that fails (a hostile model name, a bad knob)
leave no chart, text or download of the earlier run: the failed event's error guard clears them and
says so. A Stop (the run's generator closed mid-run) leaves this run's partial output, never the
previous run's charts. Driven through the app's own registered events (tests/helpers/continue_compare.Page)."""

from __future__ import annotations


import gradio as gr
import pytest

from playground import stale
from tests.helpers.continue_compare import Page, run_coroutine

pytestmark = pytest.mark.slow

# view: (event name, its first output's elem_id, {elem_id: value} for a short successful run)
VIEWS = {
    "step": ("on_run", "step-text", {"step-knob-max_new_tokens": 4}),
    "compare": ("on_run", "cmp-status", {"cmp-lane-0-knob-max_new_tokens": 4, "cmp-lane-1-knob-max_new_tokens": 4}),
    "compare sweep": ("on_sweep", "cmp-sweep-status", {"cmp-sweep-seeds": 2, "cmp-lane-0-knob-max_new_tokens": 4}),
    "beam": ("on_run", "beam-tree", {"beam-knob-max_new_tokens": 4, "beam-knob-num_beams": 2}),
    "speculative": ("on_generate", "spec-counters", {"spec-knob-max_new_tokens": 6, "spec-compare": False}),
    "mcts": ("on_run", "mcts-status", {"mcts-knob-max_new_tokens": 2, "mcts-knob-mcts_simulations": 2}),
    "medusa": ("on_run", "medusa-status", {"medusa-knob-max_new_tokens": 4}),
    "quantization drift": ("on_measure", "quant-status", {"quant-tokens": 4, "quant-variants": ["none", "int8"]}),
    "kv cache": ("on_kv", "kv-status", {"kv-tokens": 4}),
    "kv cache kinds": ("on_run", "kinds-status", {"kinds-tokens": 4, "kinds-kinds": ["dynamic", "quantized-int8"]}),
    "lessons": ("on_run", "lessons-status", {}),
}


@pytest.fixture(scope="module")
def demo(registry, embedded):
    from playground.app import build_app

    return build_app(registry)


def outputs_of(page: Page, name: str, first: str) -> list:
    return list(page.event(name, first).outputs)


def shown_value(page: Page, block) -> object:
    return page.get(block)


def is_cleared(block, value) -> bool:
    expected = stale.empty_value(block)
    if expected is stale._LEAVE:
        return True
    if isinstance(block, gr.Dataframe) and value is not None:
        return not getattr(value, "data", value)
    return value == expected


def status_of(page: Page, name: str, first: str):
    dep = page.event(name, first)
    return next(b for b in dep.outputs if (b.elem_id or "").endswith("status") and b.elem_id in (
        first, "step-status", "beam-status", "spec-status"))


def set_known(page: Page, values: dict) -> dict:
    """Set the values whose elem_id exists in this app (knob ids differ between versions)."""
    known = {}
    for elem_id, value in values.items():
        try:
            page.set(elem_id, value)
            known[elem_id] = value
        except StopIteration:
            pass
    return known


@pytest.mark.parametrize("view", list(VIEWS))
def test_an_error_after_a_good_run_clears_that_runs_output(demo, view):
    name, first, good = VIEWS[view]
    page = Page(demo)
    set_known(page, good)
    page.fire(name, first)
    status = status_of(page, name, first)
    outputs = outputs_of(page, name, first)
    shown = {b._id: page.get(b) for b in outputs}
    filled = [b for b in outputs if stale.empty_value(b) is not stale._LEAVE and b is not status
              and not is_cleared(b, shown[b._id])]
    assert "dp-error" not in str(page.get(status)), page.get(status)
    assert filled, f"{view}: the good run showed nothing to clear"
    page.set("dp-model", "../../etc/passwd")  # refused by the model policy: an error before any work
    page.fire(name, first)
    assert "dp-error" in page.get(status) and stale.CLEARED_NOTE in page.get(status)
    # the presenter's overlay says the failure line too (#52: it stood blank over the status)
    left = [b.elem_id for b in outputs if b is not status and not is_cleared(b, page.get(b))
            and not (b.elem_id == "present-text" and page.get(b))]
    assert not left, f"{view}: still showing the previous run in {left}"
    page.set("dp-model", "embedded")


def test_a_bad_knob_clears_the_step_view_and_keeps_its_runs(demo):
    page = Page(demo)
    set_known(page, {"step-knob-max_new_tokens": 4})
    page.fire("on_run", "step-text")
    session = page.session()
    assert page.shown("step-chart") is not None and page.shown("step-explain")
    assert page.shown("step-whatif-key") == session.whatif_key != ""
    page.set("step-knob-top_k", -3)
    page.fire("on_run", "step-text")
    # no what-if key: a knob moved now draws no what-if of the previous run into the cleared chart
    assert page.shown("step-whatif-key") == ""
    assert "top_k" in page.shown("step-status") and stale.CLEARED_NOTE in page.shown("step-status")
    assert page.shown("step-chart") is None and page.shown("step-explain") == "" and page.shown("step-text") == []
    assert page.shown("step-over-run") is None and page.shown("step-download") is None
    assert page.session() is session  # the runs are kept: picking one draws it again
    page.set("step-runs", 0)
    page.fire("on_pick_run", "step-text")
    assert page.shown("step-chart") is not None and page.shown("step-whatif-key") == session.whatif_key


def test_a_bad_branch_token_leaves_the_run_in_view(demo):
    """A branch's own bad input is not a failed run: the run on screen is still the one in view."""
    page = Page(demo)
    set_known(page, {"step-knob-max_new_tokens": 4})
    page.fire("on_run", "step-text")
    page.set("step-alt", None)
    page.fire("on_branch", "step-text")
    assert "pick a token" in page.shown("step-status") and page.shown("step-chart") is not None


@pytest.mark.parametrize("view, chart, partial", [
    ("step", "step-chart", "step-text"), ("beam", "beam-hypotheses", "beam-tree"),
    ("speculative", "spec-pq", "spec-rounds")])
def test_stop_mid_run_leaves_no_chart_of_the_previous_run(demo, view, chart, partial):
    """A good run, then a second one stopped after its first updates (Stop closes the run's
    generator): the previous run's detail charts are gone, this run's partial output is shown."""
    name, first, good = VIEWS[view]
    page = Page(demo)
    set_known(page, good)
    page.fire(name, first)
    assert not is_cleared(page.block(chart), page.shown(chart)), f"{view}: the good run drew no {chart}"
    dep = page.event(name, first)
    args = [page.get(b) for b in dep.inputs]

    at = [b.elem_id for b in dep.outputs].index(partial)

    async def stopped() -> list:
        """The run's updates up to one after the first that draws this run's partial output."""
        rows, agen, drawn = [], dep.fn(*args), 0
        async for row in agen:
            rows.append(row)
            drawn += not (isinstance(row[at], dict) and row[at].get("__type__") == "update" and "value" not in row[at])
            if drawn >= 2:
                break
        await agen.aclose()
        return rows

    for row in run_coroutine(stopped):
        page.apply(dep, row)
    assert is_cleared(page.block(chart), page.shown(chart)), f"{view}: {chart} still shows the previous run"


@pytest.mark.parametrize("view", ["step", "beam", "speculative"])
def test_a_model_failure_mid_run_clears_the_previous_run(demo, view, monkeypatch):
    """A good run, then one whose model fails after two events: the message names the failure and
    no chart or text of the good run is left."""
    from engine import runner

    name, first, good = VIEWS[view]
    page = Page(demo)
    set_known(page, good)
    page.fire(name, first)
    outputs = outputs_of(page, name, first)
    status = status_of(page, name, first)
    real = runner.stream

    def failing(*args, **kwargs):
        for i, event in enumerate(real(*args, **kwargs)):
            if i == 2:
                raise RuntimeError("the model failed")
            yield event

    monkeypatch.setattr(runner, "stream", failing)
    page.fire(name, first)
    assert "RuntimeError: the model failed" in page.get(status) and stale.CLEARED_NOTE in page.get(status)
    # the presenter's overlay says the failure line too (#52: it stood blank over the status)
    left = [b.elem_id for b in outputs if b is not status and not is_cleared(b, page.get(b))
            and not (b.elem_id == "present-text" and page.get(b))]
    assert not left, f"{view}: still showing the previous run in {left}"


@pytest.mark.parametrize("view, stop, partial, status", [
    ("beam", "beam-stop", "beam-tree", "beam-status"), ("speculative", "spec-stop", "spec-rounds", "spec-status")])
def test_stop_pressed_mid_run_keeps_this_runs_output_and_says_stopped(demo, view, stop, partial, status, monkeypatch):
    """Stop pressed mid-run (the Stop button's own function, for this page's session): the run ends
    at its next step with its own last update; what it drew so far stays (it is not cleared as a
    failed run's is) and the status says it stopped, not 'generating' and not an error."""
    from playground import events

    name, first, good = VIEWS[view]
    page = Page(demo)
    set_known(page, {**good, f"{'beam' if view == 'beam' else 'spec'}-knob-max_new_tokens": 48})
    dep = page.event(name, first)
    args = [page.get(b) for b in dep.inputs]
    press = next(f for f in demo.fns.values() if (page.block(stop)._id, "click") in
                 [(getattr(t[0], "_id", t[0]), t[1]) for t in f.targets])
    monkeypatch.setattr(events, "_session", lambda: "page-1")
    at = [b.elem_id for b in dep.outputs].index(partial)

    async def pressed_mid_run() -> list:
        rows, drawn = [], 0
        async for row in dep.fn(*args):
            rows.append(row)
            drawn += not (isinstance(row[at], dict) and row[at].get("__type__") == "update" and "value" not in row[at])
            if drawn == 2:
                await press.fn()  # this page's session (events._session, patched above)
        return rows

    rows = run_coroutine(pressed_mid_run)
    for row in rows:
        page.apply(dep, row)
    said = page.shown(status)
    assert said.count("stopped: the run was cancelled") == 1 and stale.STOPPED_NOTE in said, said
    assert "dp-error" not in said and stale.CLEARED_NOTE not in said
    assert not is_cleared(page.block(partial), page.shown(partial)), f"{view}: Stop cleared this run's {partial}"
    assert len(rows) < 48  # it ended early, at the step after the press
