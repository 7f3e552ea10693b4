"""Issue #52: a lesson's check computed once per deployment (engine/reports/lesson_results.py). The
second press of Run and check shows the kept result at once, without one forward of the model; "Run
it live" runs it again (the same seeded texts and outcome); a failed check is never kept; a lesson
whose runs differ is another key; a presenter's press marks its runs for the scheduler's reserved row."""

from __future__ import annotations

import pytest

from engine.control import RunControl
from engine.reports.lesson_results import LessonResults, result_key
from engine.reports.lessons import Outcome, builtin_lessons

LESSON = "temperature"


def test_only_checked_results_are_kept_least_recent_first_dropped():
    results = LessonResults(kept=2)
    lesson = builtin_lessons()[LESSON]
    assert results.put("a", [], Outcome(False, "not shown", {})) is None and results.get("a") is None
    kept = results.put("a", [], Outcome(True, "shown", {}))
    assert results.get("a") is kept and kept.outcome.summary == "shown"
    results.put("b", [], Outcome(True, "b", {}))
    results.get("a")  # "a" used last: "b" goes first
    results.put("c", [], Outcome(True, "c", {}))
    assert results.get("b") is None and results.get("a") is kept and results.get("c") is not None
    other = builtin_lessons()["greedy-vs-sampling"]
    assert result_key(lesson, "embedded", "none") == result_key(lesson, "embedded", "none")
    assert len({result_key(lesson, "embedded", "none"), result_key(lesson, "embedded", "int8"),
                result_key(other, "embedded", "none")}) == 3
    with pytest.raises(ValueError, match="^kept: must be >= 1, got 0$"):
        LessonResults(kept=0)


@pytest.fixture
def tab(embedded):
    import gradio as gr

    from playground.panels.presenter import PresenterPanel
    from playground.views import lessons
    from tests.helpers.common import shared_over

    with gr.Blocks():
        shared = shared_over(embedded)
        presenter = PresenterPanel.build()
    fields = {name: name for name in lessons.LessonsTab.__dataclass_fields__}
    return lessons.LessonsTab(**(fields | {"shared": shared, "presenter": presenter, "results": LessonResults()}))


def press(tab, embedded, live=False, present=False, lesson=LESSON):
    """One press: the updates, the forwards of the model it cost, and its control."""
    count = [0]
    handle = embedded.model.register_forward_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    control = RunControl()
    try:
        updates = list(tab.on_run(lesson, None, "embedded", "none", None, present, control=control, live=live))
    finally:
        handle.remove()
    return updates, count[0], control


@pytest.mark.slow
def test_the_second_press_shows_the_kept_result_and_run_it_live_runs_again(tab, embedded):
    first, forwards, control = press(tab, embedded, present=True)
    assert forwards > 0 and control.priority  # a presenter's runs are marked for the reserved row
    outcome = first[-1]["outcome"]
    assert outcome.startswith('<div class="dp-status" id="lesson-outcome-text">✓')

    again, forwards, control = press(tab, embedded)
    assert forwards == 0 and not control.priority  # nothing ran
    assert "this deployment&#x27;s checked result, computed at " in again[-1]["status"]
    assert again[-1]["outcome"] == outcome and again[-1]["texts"] == first[1]["texts"]
    assert again[-1]["session"].traces[0] is first[1]["session"].traces[0]

    live, forwards, _ = press(tab, embedded, live=True)
    assert forwards > 0  # Run it live: the runs and the check again, the same seeded texts and outcome
    assert live[-1]["outcome"] == outcome and live[1]["texts"] == first[1]["texts"]
    assert live[1]["session"].traces[0] is not first[1]["session"].traces[0]


def last_chart(updates: list[dict]):
    """The chart a press leaves on the page: the last one its updates set."""
    return [u["chart"] for u in updates if "chart" in u][-1]


@pytest.mark.slow
def test_a_kept_result_shows_the_checks_own_chart_as_the_live_run_ends_with(tab, embedded):
    """The grammar lesson's check draws its distortion chart after the runs' stage chart; a kept
    result shown at once drew the runs' chart instead (found on a phone after a projector's press)."""
    first, forwards, _ = press(tab, embedded, lesson="grammar")
    assert forwards > 0
    again, forwards, _ = press(tab, embedded, lesson="grammar")
    assert forwards == 0 and "this deployment&#x27;s checked result" in again[-1]["status"]
    live_chart, kept_chart = last_chart(first), last_chart(again)
    assert [t.name.split(",")[0].split(" (")[0] for t in live_chart.data] == ["the model", "masked decoding"]
    assert kept_chart.to_json() == live_chart.to_json()
