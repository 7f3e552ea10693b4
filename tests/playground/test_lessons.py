"""Lessons are data: every shipped lesson parses, lists as strict JSON, and its claim holds on the
embedded model (each lesson's check runs the lesson exactly as the UI does)."""

import json

import pytest

from engine.reports.lessons import (CHECKS, LessonError, builtin_lessons, evaluate, parse_lesson, run_lesson, selected_step)
from engine.runner import RUNS
from tests.helpers.lessons import CHECKPOINT_LESSONS  # noqa: F401

GOOD = {
    "version": 1, "id": "mine", "title": "My lesson", "view": "step", "prompt": "Hello", "chat": False,
    "preset": {"version": 1, "name": "Greedy", "strategy": "greedy"}, "steps": ["one", "two"],
}


def test_at_least_eight_lessons_cover_the_lecture():
    lessons = builtin_lessons()
    assert len(lessons) >= 8
    assert {"greedy-vs-sampling", "temperature", "truncation", "penalties", "beam-search", "speculative",
            "kv-cache", "quantization", "contrastive-search"} <= set(lessons)
    for lesson in lessons.values():
        assert 2 <= len(lesson.steps) <= 5 and lesson.check is not None and lesson.check["kind"] in CHECKS


def test_listing_is_strict_json_with_the_documented_keys():
    for lesson in builtin_lessons().values():
        data = json.loads(json.dumps(lesson.to_dict(), allow_nan=False))
        assert {"id", "title", "view", "preset", "prompt", "steps"} <= set(data)
        assert data["preset"]["version"] == 1 and "strategy" in data["preset"]
        assert ("lanes" in data) == (data["view"] == "compare")


@pytest.mark.parametrize("change, key", [
    ({"view": "kitchen"}, "view"), ({"id": "Bad Id"}, "id"), ({"steps": ["only one"]}, "steps"),
    ({"steps": "not a list"}, "steps"), ({"prompt": ""}, "prompt"), ({"prompt": 5}, "prompt"),
    ({"prompt": "\ud800"}, "prompt"), ({"chat": "yes"}, "chat"), ({"check": {"kind": "eval"}}, "check"),
    ({"preset": {"version": 1, "name": "x", "temperature": -1}}, "preset"), ({"lanes": []}, "lanes"),
    ({"extra": 1}, "extra"), ({"version": 2}, "version"), ({"select_step": "random"}, "select_step"),
    ({"title": "<a href=//evil.example>x</a>" * 40}, "title"),
])
def test_bad_lessons_name_the_key(change, key):
    with pytest.raises(LessonError) as err:
        parse_lesson(GOOD | change)
    assert str(err.value).startswith(f"{key}")


def test_compare_lessons_need_lanes():
    with pytest.raises(LessonError, match="^lanes"):
        parse_lesson(GOOD | {"view": "compare"})
    lesson = parse_lesson({k: v for k, v in GOOD.items() if k != "preset"} | {
        "view": "compare", "lanes": [GOOD["preset"], GOOD["preset"] | {"name": "B", "strategy": "sample"}]})
    assert [p.name for p in lesson.runs] == ["Greedy", "B"]


@pytest.mark.slow
@pytest.mark.parametrize("lesson_id", [pytest.param(i, marks=pytest.mark.quantized) if i in CHECKPOINT_LESSONS else i
                                       for i in builtin_lessons()])
def test_each_lessons_claim_holds_on_the_embedded_model(embedded, registry, lesson_id, request):
    lesson = builtin_lessons()[lesson_id]
    if lesson_id in CHECKPOINT_LESSONS:
        request.getfixturevalue("quant_checkpoints")  # made (or waited for) by deploy/quantize.sh
    traces = run_lesson(embedded, lesson, registry, runs=RUNS)
    assert all(t.steps for t in traces)
    assert 0 <= selected_step(traces[0], lesson.select_step) < len(traces[0].steps)
    outcome = evaluate(embedded, lesson, traces, registry, runs=RUNS)
    assert outcome.ok, outcome.summary
    json.dumps(outcome.figures, allow_nan=False)


# --- "Open in its view" on Step through: the open-then-run path, through the views' own handlers --------
STEP_LESSON = GOOD | {"prompt": "The sea is", "preset": {"version": 1, "name": "Sampled", "strategy": "sample",
                                                          "seed": 11, "temperature": 1.5, "max_new_tokens": 8}}


@pytest.fixture
def step_view(tiny_lm):
    """Step through's handlers over the tiny random Llama, the view's real knob panel and handle;
    field names stand in for the output components (handlers return ``{component: value}``)."""
    import gradio as gr

    from playground.knobs import STAGE_KNOBS, KnobPanel
    from playground.views import step

    from tests.helpers.common import shared_over

    with gr.Blocks():
        shared = shared_over(tiny_lm)
        panel = KnobPanel(shared, step.RUN_KNOBS + STAGE_KNOBS, ["sample", "greedy"], preset=step.DEFAULT_PRESET)
        view = step.StepView("step", gr.Textbox(step.DEFAULT_PROMPT), panel, gr.Checkbox(True),
                             select_once=gr.State(None), width=gr.Number(None))
    out = step.Outputs(*step.Outputs.__dataclass_fields__)
    return step, view, out, step.Handlers(shared, view, out, None)


def open_and_run(step_view, select_step):
    """Open the lesson in Step through (the Lessons tab's own on_open), then press Generate with the
    view's inputs as the open left them: every update of that run."""
    from engine.control import RunControl
    from playground.views import lessons

    step, view, out, handlers = step_view
    lesson = parse_lesson(STEP_LESSON | {"select_step": select_step})
    tab = lessons.LessonsTab(*lessons.LessonsTab.__dataclass_fields__)
    opened = tab.on_open("tabs", {"step": view}, lesson.id, lessons.LessonSession(lesson), None)
    assert opened["open_run"] == "step-generate" and opened[view.prompt] == "The sea is"
    values = [opened.get(c, c.value) for c in view.panel.inputs]
    return opened, list(handlers.on_run(opened[view.select_once], 390, "step", opened[view.prompt], opened[view.chat],
                                        "embedded", "none", "probability", None, "", *values, control=RunControl()))


def test_open_then_run_selects_the_lessons_step_number(step_view):
    step, view, out, _ = step_view
    opened, updates = open_and_run(step_view, 5)
    assert opened[view.select_once] == 5
    assert updates[0] == {view.select_once: None}  # cleared first: it applies to this run only
    final = updates[-1]
    trace = final[out.session].trace()
    assert len(trace.steps) == 8 and trace.config["temperature"] == 1.5  # the lesson's preset ran
    assert final[out.step]["value"] == 5 and "the lesson&#x27;s step 5" in final[out.status]
    assert final[out.chart].layout.title.text.startswith("step 5:")
    assert final[out.chart].layout.meta["columns"] <= 2  # laid out for the 390 px page it was given


def test_open_then_run_selects_the_min_entropy_step_then_generate_is_the_default_again(step_view):
    from engine.control import RunControl

    step, view, out, handlers = step_view
    opened, updates = open_and_run(step_view, "min_entropy")
    trace = updates[-1][out.session].trace()
    raw = [s.raw_entropy for s in trace.steps]
    final = [s.entropy for s in trace.steps]
    assert raw.index(min(raw)) != final.index(max(final))  # else this test could not tell them apart
    assert updates[-1][out.step]["value"] == raw.index(min(raw))
    # The user presses Generate: select_once holds None now, so the view's own default is back.
    values = [opened.get(c, c.value) for c in view.panel.inputs]
    session = updates[-1][out.session]
    again = list(handlers.on_run(None, None, "step", "The sea is", False, "embedded", "none", "probability", session,
                                 session.owner, *values, control=RunControl()))
    assert again[-1][out.session].trace().generated_token_ids == trace.generated_token_ids  # same seed
    assert again[-1][out.step]["value"] == final.index(max(final))  # the most uncertain step


def test_a_failed_open_run_clears_the_selection_and_leaves_the_prompt(step_view):
    from engine.control import RunControl
    from playground.shared import UserError

    step, view, out, handlers = step_view
    values = [c.value for c in view.panel.inputs]
    values[view.panel.inputs.index(view.panel.components["temperature"])] = -3  # out of range
    run = handlers.on_run(2, None, "step", "The sea is", False, "embedded", "none", "probability", None, "", *values,
                          control=RunControl())
    assert next(run) == {view.select_once: None}
    with pytest.raises(UserError, match="temperature"):
        next(run)  # events.streamed shows it as the view's error; the prompt box is not an output
