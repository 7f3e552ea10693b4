"""Lessons are data: every shipped lesson parses, lists as strict JSON, and its claim holds on the
embedded model (each lesson's check runs the lesson exactly as the UI does)."""

import json

import pytest

from engine.lessons import CHECKS, LessonError, builtin_lessons, evaluate, parse_lesson, run_lesson, selected_step

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
@pytest.mark.parametrize("lesson_id", list(builtin_lessons()))
def test_each_lessons_claim_holds_on_the_embedded_model(embedded, registry, lesson_id):
    lesson = builtin_lessons()[lesson_id]
    traces = run_lesson(embedded, lesson, registry)
    assert all(t.steps for t in traces)
    assert 0 <= selected_step(traces[0], lesson.select_step) < len(traces[0].steps)
    outcome = evaluate(embedded, lesson, traces, registry)
    assert outcome.ok, outcome.summary
    json.dumps(outcome.figures, allow_nan=False)
