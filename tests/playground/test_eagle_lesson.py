"""The lesson "EAGLE vs Medusa: why predicting features beats predicting tokens": its check is
validated against its runs, and through the Lessons tab's own handlers (tiny random Llama, random
heads) its chart shows the drafters' rounds and its sentence gives the traces' own numbers. On the
embedded model with the shipped heads its claim runs in tests/playground/test_lessons.py."""

from __future__ import annotations

import pytest

from engine.reports.lessons import LessonError, builtin_lessons, parse_lesson
from engine.strategies import eagle, medusa
from tests.helpers.eagle import random_head
from tests.helpers.lessons_room import TAUGHT, run, shown_chart, tab  # noqa: F401
from tests.helpers.medusa import random_heads

LESSON = "eagle-vs-medusa"


def lesson_data() -> dict:
    return builtin_lessons()[LESSON].to_file_dict()


@pytest.mark.parametrize("change", [
    lambda lanes: lanes[::-1],  # eagle first
    lambda lanes: [lanes[0], lanes[1] | {"temperature": 0.7}],  # a sampled EAGLE run
    lambda lanes: [lanes[0] | {"strategy": "greedy"}, lanes[1]],  # no Medusa run
])
def test_the_check_needs_greedy_medusa_then_greedy_eagle(change):
    data = lesson_data()
    with pytest.raises(LessonError) as caught:
        parse_lesson(data | {"lanes": change(data["lanes"])})
    assert str(caught.value).startswith("check.kind: features_beat_tokens") and "\n" not in str(caught.value)


def test_the_lessons_run_draws_the_rounds_and_states_the_traces_numbers(tab, tiny_lm, monkeypatch):
    heads, head = random_heads(64, 3, 3.0), random_head(tiny_lm, 512)
    monkeypatch.setattr(medusa, "load_heads", lambda lm, path=None: heads)
    monkeypatch.setattr(eagle, "load_head", lambda lm, path=None: head)
    updates = run(tab, LESSON)
    fig = shown_chart(updates)
    assert fig is not None and TAUGHT[LESSON] in " ".join(str(t.name) for t in fig.data)
    session = next(u["session"] for u in updates if "session" in u)
    medusa_trace, eagle_trace = session.traces
    assert (medusa_trace.strategy, eagle_trace.strategy) == ("medusa", "eagle")
    assert session.shown == 1  # the chart is EAGLE's rounds
    assert [b for t in fig.data if t.name == "accepted drafts" for b in t.y] == [r.num_accepted for r in eagle_trace.rounds]
    outcome = updates[-1]["outcome"]
    assert "done" in updates[-1]["status"]
    assert f"EAGLE kept {eagle_trace.summary['tokens_per_target_forward']:.2f} tokens per target forward" in outcome
    assert f"Medusa {medusa_trace.summary['tokens_per_target_forward']:.2f}" in outcome
    assert medusa_trace.generated_token_ids == eagle_trace.generated_token_ids  # both the target's greedy text
