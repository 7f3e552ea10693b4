"""Workshop mode: the what-if handlers (kept logits, first / middle / last step, two sessions at
once, hostile knobs), continuing with new knobs, the lessons and presenter helpers, and the
/explore_step and /lessons endpoints over gradio_client against a real server."""

import json
import math
import threading

import pytest

from engine import explore, runner
from engine.runner import RunRequest
from engine.config import ConfigError, DecodingConfig
from engine.control import RunControl
from engine.reports.lessons import builtin_lessons, parse_lesson
from engine.scheduler import scheduler_for
from engine.trace import StageTrace, from_dict
from playground import whatif_service
from playground.panels import whatif
from tests.helpers.api import api_client

CFG = DecodingConfig(strategy="sample", seed=5, max_new_tokens=10, temperature=0.9, top_k=30, top_p=0.95)


class StubShared:
    """What the what-if handlers use of Shared: the model and its scheduler."""

    max_prompt_tokens = 2048

    def __init__(self, lm):
        self._lm = lm

    def lm(self, model, quantization):
        return self._lm

    def scheduler_for(self, lm):
        return scheduler_for(lm)


@pytest.fixture(scope="module")
def trace(tiny_lm):
    return runner.run(RunRequest(tiny_lm, "Workshop what if", CFG))


def _step(trace, where):
    return {"first": 0, "middle": len(trace.steps) // 2, "last": len(trace.steps) - 1}[where]


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_whatif_with_own_knobs_redraws_the_runs_step(tiny_lm, trace, where):
    at = _step(trace, where)
    key = whatif_service.context_key("m", "none", trace, at)
    changed, kept = whatif_service.whatif_step(tiny_lm, trace, at, {}, None, key)
    assert explore.stages_match(changed.stages, trace.steps[at].stages)
    assert changed.chosen_token_id == trace.steps[at].chosen_token_id and changed.draw == trace.steps[at].draw
    assert kept.logits.shape == (1, tiny_lm.vocab_size)


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_whatif_knob_change_reuses_the_kept_logits(tiny_lm, trace, where, monkeypatch):
    at = _step(trace, where)
    key = whatif_service.context_key("m", "none", trace, at)
    _, kept = whatif_service.whatif_step(tiny_lm, trace, at, {}, None, key)
    monkeypatch.setattr(explore, "raw_logits", lambda *a, **k: pytest.fail("recomputed the kept logits"))
    hot, _ = whatif_service.whatif_step(tiny_lm, trace, at, {"temperature": 2.0, "top_k": 0, "top_p": 1.0}, kept, key)
    cold, _ = whatif_service.whatif_step(tiny_lm, trace, at, {"temperature": 0.3}, kept, key)
    # A flatter distribution keeps more tokens and has more entropy than a sharper one.
    assert hot.stages[-1].entropy > trace.steps[at].stages[-1].entropy > cold.stages[-1].entropy
    assert hot.stages[-1].kept > trace.steps[at].stages[-1].kept


def test_whatif_key_changes_with_the_step_and_the_model(trace):
    keys = {whatif_service.context_key(m, q, trace, s) for m, q, s in [("a", "none", 1), ("a", "none", 2), ("b", "none", 1),
                                                                ("a", "int8", 1)]}
    assert len(keys) == 4


def test_two_sessions_at_once_keep_their_own_logits(tiny_lm, trace):
    other = runner.run(RunRequest(tiny_lm, "Another session entirely", CFG.replace(seed=9)))
    results: dict = {}

    def session(name, tr, at):
        key = whatif_service.context_key("m", "none", tr, at)
        kept = None
        for t in (0.5, 1.0, 1.5):
            changed, kept = whatif_service.whatif_step(tiny_lm, tr, at, {"temperature": t}, kept, key)
        results[name] = (changed, kept, explore.explore_step(tiny_lm, tr, at, {"temperature": 1.5}))

    threads = [threading.Thread(target=session, args=("a", trace, 3)), threading.Thread(target=session, args=("b", other, 2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name in "ab":
        changed, kept, reference = results[name]
        assert explore.stages_match(changed.stages, reference)
    assert results["a"][1].key != results["b"][1].key


@pytest.mark.parametrize("knobs, key", [({"temperature": -1}, "temperature"), ({"top_p": math.nan}, "top_p"),
                                        ({"no_such_knob": 1}, "no_such_knob"), ({"stage_order": ["rm -rf"]}, "stage_order")])
def test_hostile_knobs_give_an_error_naming_the_knob(tiny_lm, trace, knobs, key):
    with pytest.raises(ConfigError) as err:
        whatif_service.whatif_step(tiny_lm, trace, 1, knobs, None, whatif_service.context_key("m", "none", trace, 1))
    assert str(err.value).startswith(f"{key}:")


def test_continue_with_new_knobs_keeps_the_prefix_and_uses_the_new_config(tiny_lm, trace):
    at = 4
    greedy = CFG.replace(strategy="greedy")
    events = list(whatif.continue_events(StubShared(tiny_lm), tiny_lm, trace, at, greedy, RunControl()))
    branch = events[-1].trace
    assert branch.branch_of == at and branch.config["strategy"] == "greedy"
    assert branch.generated_token_ids[:at] == trace.generated_token_ids[:at]
    # The oracle: a greedy run alone over prompt + the parent's first 4 tokens picks the same rest.
    reference = runner.run(RunRequest(tiny_lm, trace.prompt, greedy.replace(max_new_tokens=CFG.max_new_tokens),
                           prompt_ids=trace.prompt_token_ids + trace.generated_token_ids[:at]))
    assert branch.generated_token_ids[at:] == reference.generated_token_ids[:len(branch.steps) - at]


def test_explore_api_returns_trace_json_stages(tiny_lm, trace):
    data = json.loads(trace.to_json())
    stages = whatif.explore_api(StubShared(tiny_lm), data, 2, None, control=RunControl())
    assert stages == data["steps"][2]["stages"] or explore.stages_match(
        [from_dict(StageTrace, s) for s in stages], trace.steps[2].stages)
    json.dumps(stages, allow_nan=False)
    with pytest.raises(ConfigError, match="^step:"):
        whatif.explore_api(StubShared(tiny_lm), data, "2", None, control=RunControl())


def test_whatif_note_names_the_changed_knob(tiny_lm, trace):
    changed, _ = whatif_service.whatif_step(tiny_lm, trace, 1, {"temperature": 2.0}, None, "k")
    note = whatif_service.whatif_note(trace.steps[1], changed, {"temperature": 2.0, "seed": 5}, trace.config)
    assert "temperature = 2.0" in note and "seed" not in note


# --- lessons and presenter helpers ------------------------------------------------------------
def test_lesson_links_round_trip_and_bad_links_name_the_key():
    from playground.views import lessons as view

    text = (next(iter(sorted(__import__("pathlib").Path("presets/lessons").glob("*.json"))))).read_text()
    lesson = view.lesson_from_token(view.lesson_token(text))
    assert lesson == next(iter(builtin_lessons().values()))
    assert view.lesson_from_token("temperature").id == "temperature"
    for bad in ("no-such-lesson", "l1.!!!", "l1." + "A" * 50, 42):
        with pytest.raises(ValueError, match="^lesson:"):
            view.lesson_from_token(bad)


def test_a_shared_lessons_link_and_qr_carry_that_lesson():
    """A lesson opened from a link has no pasted text: its link and QR code are rebuilt from it
    (they used to name the built-in lesson the picker showed before, or fail)."""
    import types

    from playground.views import lessons as view

    data = next(iter(builtin_lessons().values())).to_file_dict() | {"id": "my-own", "title": "Mine"}
    shared = view.lesson_from_token(view.lesson_token(json.dumps(data)))
    tab = types.SimpleNamespace(link="link", status="status", presenter=types.SimpleNamespace(qr="qr"))
    tab.current = lambda session, choice: view.LessonsTab.current(tab, session, choice)
    out = view.LessonsTab.on_link(tab, "my-own", view.LessonSession(shared), "", "http://room.example/")
    token = out["link"].split("?lesson=", 1)[1]
    assert view.lesson_from_token(token) == shared
    assert "<svg" in out["qr"] or "<img" in out["qr"]
    for lesson in builtin_lessons().values():  # the file form reads back into the same lesson
        assert parse_lesson(lesson.to_file_dict()) == lesson


def test_pasted_lesson_with_a_bad_key_is_refused_by_name():
    from engine.reports.lessons import LessonError, parse_lesson_json

    with pytest.raises(LessonError, match="^steps:"):
        parse_lesson_json(json.dumps({"version": 1, "id": "x", "title": "t", "view": "step", "prompt": "p",
                                      "preset": {"version": 1, "name": "g", "strategy": "greedy"}, "steps": ["one"]}))


def test_list_lessons_is_strict_json_with_the_issue_fields():
    from playground.views.lessons import list_lessons

    items = list_lessons()
    assert len(items) >= 8
    json.dumps(items, allow_nan=False)
    for item in items:
        assert {"id", "title", "view", "preset", "prompt", "steps"} <= set(item) and 2 <= len(item["steps"]) <= 5


def test_presenter_chart_labels_are_projector_sized(trace):
    from playground.panels.presenter import presenter_chart, context_html

    fig = presenter_chart(trace, 2)
    assert fig.layout.yaxis.tickfont.size >= 18 and fig.layout.font.size >= 18
    hidden, shown = context_html(trace, 2, True), context_html(trace, 2, False)
    assert ">?</mark>" in hidden and "p = " not in hidden and "p = " in shown


# --- Step through's chart at the page's width --------------------------------------------------
@pytest.mark.parametrize("width, columns", [(None, 3), (1400, 3), (900, 3), (899, 2), (600, 2), (599, 1), (390, 1)])
def test_step_chart_columns_follow_the_page_width(trace, width, columns):
    from playground.charts import step as charts

    step = trace.steps[0]  # raw, temperature, top-k, top-p, final and the draw: 6 panels
    assert len(step.stages) + 1 == 6
    fig = charts.fitted_stage_chart(step, width)
    assert fig.layout.meta["columns"] == columns and fig.layout.meta["narrow"] == (width is not None and width < 900)
    lefts = {round(fig.layout[k].domain[0], 3) for k in fig.layout if k.startswith("xaxis")}
    assert len(lefts) == columns  # the subplots' left edges: one per column
    if columns == 1:  # a phone: the six rows 100 px apart, each panel ~260 px tall
        assert fig.layout.height == 6 * 360 + 120


def test_open_of_a_lesson_whose_view_has_no_handle_switches_tab_without_running():
    from playground.views import lessons

    tab = lessons.LessonsTab(*lessons.LessonsTab.__dataclass_fields__)
    lesson = builtin_lessons()["kv-cache"]
    opened = tab.on_open("tabs", {}, lesson.id, None, None)  # no Quantization page built
    assert opened["open_run"] == "" and "run it there" in opened["status"]
    assert opened["tabs"].selected == "tab-quantization"


@pytest.mark.parametrize("lesson_id, budget_key, button", [("kv-cache", "kv_tokens", "kv-measure"),
                                                           ("quantization", "tokens", "quant-measure")])
def test_open_of_a_quantization_tab_lesson_fills_its_section_and_runs_it(lesson_id, budget_key, button):
    from playground.views import lessons
    from playground.views.quantization import QuantPage

    tab = lessons.LessonsTab(*lessons.LessonsTab.__dataclass_fields__)
    page = QuantPage("prompt", "chat", "tokens", "kv_tokens")
    lesson = builtin_lessons()[lesson_id]
    opened = tab.on_open("tabs", {"quantization": page}, lesson.id, None, None)
    assert opened["open_run"] == button and opened["tabs"].selected == "tab-quantization"
    assert opened["prompt"] == lesson.prompt and opened["chat"] is lesson.chat
    assert opened[budget_key] == lesson.check["max_new_tokens"]
    other = {"tokens": "kv_tokens", "kv_tokens": "tokens"}[budget_key]
    assert other not in opened  # the other section's budget is left as the user set it


def test_a_pasted_quantization_lessons_budget_is_checked_at_parse_and_opens_in_range():
    """A pasted lesson's check budget out of range or not a number is refused when the lesson is
    parsed (one line naming check.max_new_tokens; it used to be clamped or ignored at Open); one in
    range opens the drift section with it."""
    from engine.reports.lessons import LessonError, parse_lesson
    from playground.views.quantization import DRIFT_TOKENS, QuantPage

    page = QuantPage("prompt", "chat", "tokens", "kv_tokens")
    data = builtin_lessons()["quantization"].to_file_dict()
    for bad in (10 ** 9, "lots", 0, True, 1.5):
        with pytest.raises(LessonError, match=r"^check.max_new_tokens: expected a whole number from 1 to 64, got "):
            parse_lesson(data | {"id": "q1", "check": {"kind": "quantization_order", "max_new_tokens": bad}})
    fits = parse_lesson(data | {"id": "q2", "check": {"kind": "quantization_order", "max_new_tokens": 64}})
    updates, button = page.lesson_updates(fits, None, None)
    assert updates["tokens"] == 64 <= DRIFT_TOKENS[1] and button == "quant-measure"


# --- the endpoints over gradio_client ---------------------------------------------------------
@pytest.mark.slow
def test_explore_step_endpoint_reproduces_the_traces_stages(live_app):

    client = api_client(live_app)
    data = client.predict("Write one word about rain.", {"max_new_tokens": 5, "seed": 2}, "balanced", True,
                          api_name="/step_trace")
    for step in (0, len(data["steps"]) - 1):
        stages = client.predict(data, step, {}, api_name="/explore_step")
        assert [s["name"] for s in stages] == [s["name"] for s in data["steps"][step]["stages"]]
        for got, want in zip(stages, data["steps"][step]["stages"]):
            assert got["kept"] == want["kept"]
            assert [t["token_id"] for t in got["top"]] == [t["token_id"] for t in want["top"]]
            assert all(abs(a["prob"] - b["prob"]) < 1e-4 for a, b in zip(got["top"], want["top"]))
    hot = client.predict(data, 0, {"temperature": 3.0, "top_p": 1.0, "top_k": 0}, api_name="/explore_step")
    assert hot[-1]["entropy"] > data["steps"][0]["stages"][-1]["entropy"]
    with pytest.raises(Exception, match="temperature"):
        client.predict(data, 0, {"temperature": -2}, api_name="/explore_step")


@pytest.mark.slow
def test_lessons_endpoint_lists_the_builtin_lessons(live_app):

    items = api_client(live_app).predict(api_name="/lessons")
    assert [i["id"] for i in items] == list(builtin_lessons())


def test_continue_goes_through_the_runner_and_its_guards(tiny_lm, trace, monkeypatch):
    """#28: "continue from here" is runner.branch with no forced token (the UI no longer writes its
    own continuation): the runner's argument checks apply, and a stop rule ends it as a run's would."""
    calls = []
    real = runner.branch

    def spy(*args, **kwargs):
        calls.append((args[2:4], kwargs.get("config")))
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "branch", spy)
    greedy = CFG.replace(strategy="greedy")
    last = list(whatif.continue_events(StubShared(tiny_lm), tiny_lm, trace, 2, greedy, RunControl()))[-1].trace
    assert calls == [((2, None), greedy)] and last.branch_of == 2 and last.stop_reason
    with pytest.raises(ValueError, match="^at_step: 99 is out of range"):
        list(whatif.continue_events(StubShared(tiny_lm), tiny_lm, trace, 99, greedy, RunControl()))
    # refused at the call, before any event: the runner's own checks (no copy of them in the view)
    with pytest.raises(ValueError, match="^at_step: 99 is out of range"):
        whatif.continue_events(StubShared(tiny_lm), tiny_lm, trace, 99, greedy, RunControl())
    with pytest.raises(ValueError, match="^strategy: only greedy and sampling continue from a step, got 'beam'"):
        whatif.continue_events(StubShared(tiny_lm), tiny_lm, trace, 2, CFG.replace(strategy="beam"), RunControl())
