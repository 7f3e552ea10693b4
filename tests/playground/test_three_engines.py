"""Issue #37, "three engines, one model": the served lesson (presets/lessons/served/) that runs the same
prompt and knobs on our engine, on vLLM and on llama.cpp. Offered only when the operator lists both
servers; its lanes open in Compare on those servers. Its check against the real servers is in
tests/remote/test_vllm_live.py (it needs both)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from engine.reports import lessons
from engine.reports.lessons import LessonError, parse_lesson
from playground.views import lessons as lessons_view
from playground.views.compare import handlers
from playground.user_presets import lane_configs
from tests.helpers.compare_lanes import fake_page

VLLM = "openai:http://127.0.0.1:8000/v1#vocab=49152&eos=2"
LLAMA = "llamacpp:http://127.0.0.1:8080"
BOTH = {"DP_REMOTE_MODELS": f"{VLLM},{LLAMA}"}


def three() -> lessons.Lesson:
    return lessons.served_lessons()["three-engines"]


@pytest.mark.parametrize("listed, offered", [("", False), (VLLM, False), (LLAMA, False), (f"{LLAMA},{VLLM}", True)])
def test_the_lesson_is_offered_only_when_both_servers_are_listed(listed, offered, monkeypatch):
    environ = {"DP_REMOTE_MODELS": listed}
    assert ("three-engines" in lessons.available_lessons(environ)) is offered
    assert list(lessons.available_lessons(environ))[:len(lessons.builtin_lessons())] == list(lessons.builtin_lessons())
    monkeypatch.setenv("DP_REMOTE_MODELS", listed)  # the page's list (and /lessons) reads the operator's environment
    assert ("three-engines" in [item["id"] for item in lessons_view.list_lessons()]) is offered
    if not offered:
        with pytest.raises(LessonError, match=r"^models: this lesson needs a (vllm|llamacpp) server the operator lists"):
            lessons.run_sources(three(), "embedded", environ)


def test_each_run_goes_to_its_engine():
    assert lessons.run_sources(three(), "embedded", BOTH) == ["embedded", VLLM, LLAMA, "embedded", "fast:" + VLLM,
                                                             "fast:" + LLAMA]
    lesson = three()
    assert [p.config.strategy for p in lesson.runs[:3]] == ["greedy"] * 3
    assert len({json.dumps(p.config.to_dict(sparse=True), sort_keys=True) for p in lesson.runs[3:]}) == 1  # same knobs
    again = parse_lesson(json.loads(json.dumps(lesson.to_file_dict())))
    assert again == lesson and again.to_dict()["models"] == list(lesson.models)


def test_opening_it_fills_the_compare_lanes_with_the_listed_servers():
    page = fake_page()
    page.lanes = [dataclasses.replace(lane, model=f"l{i}.model") for i, lane in enumerate(page.lanes)]
    lesson = three()
    out = handlers.open_lesson(page, lesson.prompt, lesson.chat, lane_configs(lesson, None),
                               lessons.run_sources(lesson, "", BOTH))
    assert [out[f"l{i}.model"] for i in range(6)] == ["", VLLM, LLAMA, "", "fast:" + VLLM, "fast:" + LLAMA]
    assert out[page.count] == 6 and out[page.prompt] == lesson.prompt


@pytest.mark.parametrize("change, says", [
    ({"models": ["", "vllm"]}, r"^models: expected one of '' \| 'vllm' \| 'llamacpp' \| 'fast:vllm' \| "
                               r"'fast:llamacpp' per run \(6\)"),
    ({"models": ["", "vllm", "llamacpp", "", "fast:vllm", "openai:http://10.0.0.1/v1"]}, r"^models: expected one of"),
    ({"models": ["", "llamacpp", "vllm", "", "fast:vllm", "fast:llamacpp"]},
     r"^check.kind: engines_agree compares greedy runs on '', 'vllm', 'llamacpp' first"),
    ({"models": None}, r"^check.kind: engines_agree compares greedy runs")])
def test_a_lesson_s_models_are_checked_in_one_line(change, says):
    data = three().to_file_dict() | change
    if change.get("models") is None:
        del data["models"]
    with pytest.raises(LessonError, match=says):
        parse_lesson(data)
