"""Issue #35, the presenter points, through the handlers a page runs (the app's registered events,
tests/helpers/continue_compare.Page, and its what-if route) on the embedded model:

- the what-if subtitle said "one probability axis for all stages" while the panels ran 0-10% and
  0-0.2%: it is now read from the figure's own axes (checked here against the axes of the figure it
  titles, at the first, a middle and the last step, on both sides of the shared / own-scale choice);
- the temperature slider stopped at 3 and showed 3 for a T = 5 run: its range is the temperature
  knob's (engine.config.KNOBS) and it shows the run's own value;
- the truncation lesson's presenter opened on its last step, on the top-k lane: it opens on the run's
  first token (Next walks to the last and stops there; the label names the lesson's step) of the
  lane the lesson's check is about (top-p), for two pages at once.
"""

from __future__ import annotations

import html
import json
import math
import re
import threading

import gradio as gr
import pytest

from engine import runner
from engine.runner import RunRequest
from engine.config import KNOBS, DecodingConfig
from engine.reports.lessons import builtin_lessons, parse_lesson, selected_step, taught_run
from playground import whatif_service as whatif
from playground.charts import step as charts
from playground.views.lessons import LessonSession
from playground.panels.presenter import PresenterPanel, run_temperature
from tests.helpers.continue_compare import Page

pytestmark = pytest.mark.slow

PROMPT = "Name a colour of the sea."


@pytest.fixture(scope="module")
def demo(registry, embedded):
    from playground.app import build_app

    return build_app(registry)


@pytest.fixture(scope="module")
def route(demo):
    return whatif.service_of(demo)


# --- the what-if subtitle says what the axes are -----------------------------------------------------
def presenter_ask(route, session, step: int, temperature, width=1280) -> dict:
    body = {"view": "presenter", "key": session.whatif_key, "step": step, "model": "embedded", "quantization": "none",
            "width": width, "knobs": {"temperature": temperature}}
    return json.loads(whatif.dumps(route.answer(json.dumps(body).encode())))


def stage_axes(figure: dict, panels: int) -> list[dict]:
    """The x axes of the figure's first ``panels`` panels (the stage panels), as its JSON holds them."""
    return [figure["layout"].get(f"xaxis{i + 1 if i else ''}", {}) for i in range(panels)]


def assert_subtitle_reads_the_axes(figure: dict, panels: int) -> bool:
    """The subtitle against the figure's own stage axes: one shared range (named by a what-if's
    title), or not one. Returns whether the axes were shared."""
    title = figure["layout"]["title"]["text"]
    subtitle = re.search(r"<sup>(.*)</sup>", title).group(1)
    ranges = [axis.get("range") for axis in stage_axes(figure, panels)]
    shared = all(r is not None for r in ranges) and all(r == ranges[0] for r in ranges)
    if shared:
        low, high = ranges[0]
        named = f", 0 to {whatif.pct(high)}" if ": what if," in title else ""
        assert low == 0 and f"one probability axis for all stages{named}" in subtitle, subtitle
        for bar in figure["data"]:  # every stage bar fits that one axis
            if bar.get("type") == "bar" and bar.get("xaxis", "x") in [f"x{i + 1 if i else ''}" for i in range(panels)]:
                assert all(x is None or x <= high + 1e-9 for x in bar.get("x") or []), bar.get("name")
    else:
        assert "one probability axis" not in subtitle and "each panel on its own scale" in subtitle, subtitle
    return shared


@pytest.fixture(scope="module")
def hot_lesson_run(embedded):
    lesson = builtin_lessons()["temperature"]
    hot = next(p for p in lesson.runs if p.config.temperature == 5.0)
    trace = runner.run(RunRequest(embedded, lesson.prompt, hot.config.replace(max_new_tokens=6), chat=lesson.chat))
    return LessonSession(lesson, [trace])


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_the_presenters_what_if_subtitle_is_read_from_its_axes(route, hot_lesson_run, where):
    trace = hot_lesson_run.traces[0]
    at = {"first": 0, "middle": len(trace.steps) // 2, "last": len(trace.steps) - 1}[where]
    kinds = set()
    for temperature in (0.05, 0.3, 1.0, 2.0, 4.0, 5.0):  # 5.0: the run's own chart and title
        figure = presenter_ask(route, hot_lesson_run, at, temperature)["figure"]
        own = "chose" if temperature == 5.0 else "what if"
        assert figure["layout"]["title"]["text"].startswith(f"step {at}: {own}")
        panels = len([a for a in figure["layout"]["annotations"] if "kept" in a.get("text", "")])
        assert panels >= 2
        kinds.add(assert_subtitle_reads_the_axes(figure, panels))
    assert kinds == {True, False}  # both layouts drawn, each titled for what it is


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_the_step_views_what_if_subtitle_names_its_one_axis(route, embedded, where):
    from playground.views import step as step_view

    config = DecodingConfig(strategy="sample", seed=3, max_new_tokens=6, top_k=40)
    trace = runner.run(RunRequest(embedded, PROMPT, config, chat=True))
    at = {"first": 0, "middle": len(trace.steps) // 2, "last": len(trace.steps) - 1}[where]
    session = step_view.StepSession(runs=[trace], owner="o" * 32)
    names = [(c.elem_id or "").split("knob-")[-1] for c in route.panel.inputs]
    values = [5.0 if n == "temperature" else c.value for n, c in zip(names, route.panel.inputs)]
    body = {"key": session.whatif_key, "step": at, "model": "embedded", "quantization": "none", "width": 1400,
            "values": values}
    figure = json.loads(whatif.dumps(route.answer(json.dumps(body).encode())))["figure"]
    assert assert_subtitle_reads_the_axes(figure, len(trace.steps[at].stages))  # the Step view shares its axis


# --- the temperature slider's range and value ----------------------------------------------------------
def test_the_slider_takes_the_temperature_knobs_range_and_step():
    knob = KNOBS["temperature"]
    with gr.Blocks():
        panel = PresenterPanel.build()
    slider = panel.temperature
    assert (slider.minimum, slider.maximum, slider.step) == (knob.low, knob.high, knob.step)
    assert knob.high >= 5.0  # the temperature lesson's hottest lane is on the slider


@pytest.mark.parametrize("config, shown", [
    ({"strategy": "sample", "temperature": 5.0}, 5.0), ({"strategy": "sample", "temperature": 0.3}, 0.3),
    ({"strategy": "sample", "temperature": 0.0}, 0.0), ({"strategy": "greedy"}, KNOBS["temperature"].neutral),
    ({"strategy": "sample", "temperature": math.nan}, 1.0), ({"strategy": "sample", "temperature": "hot"}, 1.0),
    ({"strategy": "sample", "temperature": True}, 1.0), ({"strategy": "sample", "temperature": 1e9}, 5.0),
    ({"strategy": "sample", "temperature": -3}, 0.0), ({"strategy": "sample", "temperature": [2]}, 1.0)])
def test_the_slider_shows_the_runs_own_temperature(tiny_lm, config, shown):
    """A trace's config as the run wrote it, or edited by hand (a trace JSON is input too)."""
    trace = runner.run(RunRequest(tiny_lm, "one two", DecodingConfig(strategy="sample", seed=1, max_new_tokens=3)))
    trace.config = dict(config)
    assert run_temperature(trace) == shown
    with gr.Blocks():
        panel = PresenterPanel.build()
    for at in (0, 1, 2):  # every step of the run shows the run's value
        assert panel.show(trace, at, False)[panel.temperature] == shown


def test_a_t5_lessons_presenter_shows_5_and_its_slider_reaches_5_and_0(demo, route):
    """A pasted lesson running at T = 5 through the tab's own Run and check: the presenter's slider
    shows 5; the route takes the slider's ends and refuses past them, naming temperature."""
    data = builtin_lessons()["greedy-vs-sampling"].to_file_dict()
    lane = {"version": 1, "name": "T = 5", "strategy": "sample", "temperature": 5.0, "seed": 2, "max_new_tokens": 4}
    lesson = parse_lesson({k: v for k, v in data.items() if k not in ("lanes", "check")} | {
        "id": "t-five", "view": "step", "preset": lane})
    page = Page(demo)
    page.set("lessons-json", json.dumps(lesson.to_file_dict()))
    press(page, "lessons-load")  # the presenter pastes it
    assert "lesson loaded" in page.shown("lessons-status")
    page.fire("on_run", "lessons-status")
    assert "done" in page.shown("lessons-status"), page.shown("lessons-status")
    assert page.shown("present-temperature") == 5.0
    session = page.get(page.event("on_run", "lessons-status").outputs[4])
    knob = KNOBS["temperature"]
    for t in (knob.low, knob.high):
        assert presenter_ask(route, session, 1, t)["figure"] is not None
    for t in (knob.high + 0.05, -0.05):
        reply = presenter_ask(route, session, 1, t)
        assert reply["figure"] is None and "temperature" in reply["note"], reply


# --- the presenter opens on the first token of the lane the lesson is about ----------------------------
def clicks(page: Page, elem_id: str):
    """The registered function a click on ``elem_id`` runs (Previous / Next share their handler's name)."""
    block = page.block(elem_id)
    return next(f for f in page.demo.fns.values() if (block._id, "click") in [tuple(t) for t in f.targets])


def press(page: Page, elem_id: str) -> dict:
    dep = clicks(page, elem_id)
    return page.apply(dep, dep.fn(*[page.get(b) for b in dep.inputs]))


def label(page: Page) -> str:
    return re.search(r'class="dp-present-label"[^>]*>(.*?)</p>', page.shown("present-text")).group(1)


def run_lesson(page: Page, lesson_id: str) -> LessonSession:
    page.set("lessons-pick", lesson_id)
    page.fire("on_run", "lessons-status")
    assert "done" in page.shown("lessons-status"), page.shown("lessons-status")
    return page.get(page.event("on_run", "lessons-status").outputs[4])


def test_the_truncation_presenter_opens_on_the_first_token_of_the_top_p_lane(demo):
    page = Page(demo)
    session = run_lesson(page, "truncation")
    lesson = session.lesson
    assert session.shown == taught_run(lesson) == lesson.check["lanes"]["top_p"]
    assert lesson.runs[session.shown].name == "top-p 0.9"
    trace = session.shown_trace()
    lesson_step = selected_step(trace, lesson.select_step)
    last = len(trace.steps) - 1
    assert page.shown("present-text").count("dp-present-token") == 1
    assert label(page).startswith(f"Step 0 of {last}") and f"the lesson's step is {lesson_step}" in label(page)
    chart = page.shown("present-chart")
    assert chart.layout.title.text.startswith("step 0:")
    titles = " ".join(a.text for a in chart.layout.annotations)
    assert "top-p" in titles and "top-k" not in titles and "min-p" not in titles
    # The Lessons tab's chart: the same lane, at the lesson's step (the peaked one: top-p keeps few tokens).
    shown = page.shown("lessons-chart")
    assert shown.layout.title.text.startswith(f"step {lesson_step}:")
    top_p = next(s for s in trace.steps[lesson_step].stages if s.name == "top_p")
    assert f"kept {top_p.kept} token" in " ".join(a.text for a in shown.layout.annotations)

    press(page, "present-prev")  # nothing before the first token
    assert label(page).startswith(f"Step 0 of {last}")
    press(page, "present-next")
    assert label(page).startswith(f"Step 1 of {last}")
    assert page.shown("present-chart").layout.title.text.startswith("step 1:")
    for _ in range(last // 2 - 1):
        press(page, "present-next")
    assert label(page).startswith(f"Step {last // 2} of {last}")  # a middle step
    for _ in range(last):
        press(page, "present-next")
    assert label(page).startswith(f"Step {last} of {last}")  # the last one; Next stays there
    assert page.shown("present-chart").layout.title.text.startswith(f"step {last}:")
    if lesson_step == last:
        assert label(page).endswith("the lesson's step")


def test_two_pages_present_their_own_lessons_at_once(demo):
    pages = {"truncation": Page(demo), "temperature": Page(demo)}
    sessions: dict = {}
    errors: list = []

    def person(lesson_id: str) -> None:
        try:
            sessions[lesson_id] = run_lesson(pages[lesson_id], lesson_id)
            press(pages[lesson_id], "present-next")
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=person, args=(name,)) for name in pages]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    for lesson_id, page in pages.items():
        session = sessions[lesson_id]
        trace = session.shown_trace()
        assert label(page).startswith(f"Step 1 of {len(trace.steps) - 1}")
        token = html.escape(charts.readable(trace.steps[1].chosen_token))
        assert f'<mark class="dp-present-token">{token}</mark>' in page.shown("present-text")
    assert sessions["temperature"].lesson.runs[sessions["temperature"].shown].name == "T = 5"
    assert pages["temperature"].shown("present-temperature") == 5.0
    assert pages["truncation"].shown("present-temperature") == 1.0  # the top-p lane's own (neutral) temperature
