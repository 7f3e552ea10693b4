"""Compare lanes with real controls, driven through the view's handlers: hostile values typed into
the first, a middle and the last lane give the Step view's messages; greedy greys the knobs it
ignores; the header reads as words; presets, add / remove and a lesson fill the lanes; two
sessions running at once keep their own lanes (tiny random Llama; each lane's tokens equal the
same config run alone)."""

from __future__ import annotations

import json
import threading

import gradio as gr
import pytest

from engine.config import DecodingConfig
from engine.control import RunControl
from engine.reports.lessons import builtin_lessons
from engine.backends.registry import ModelRegistry
from playground.knobs import IGNORED_BY_GREEDY_SHORT, checked_values
from playground.shared import Shared, UserError
from playground.user_presets import lane_configs
from playground.views.compare import handlers
from playground.views.compare.lanes import (
    LANE_FIELDS, LANE_KNOBS, MAX_LANES, CompareSession, LaneSpec, default_spec, lane_config, spec_from_config,
    spec_from_preset,
)
from tests.helpers.compare_lanes import fake_page  # noqa: F401

FIRST, MIDDLE, LAST = 0, 2, MAX_LANES - 1


def flat(specs: list[LaneSpec]) -> list:
    """Every lane's control values, as the page sends them (hidden lanes hold the default)."""
    padded = specs + [default_spec([])] * (MAX_LANES - len(specs))
    return [v for s in padded for v in s.values()]


def with_knob(spec: LaneSpec, **typed) -> LaneSpec:
    knobs = tuple(typed.get(n, v) for n, v in zip(LANE_KNOBS, spec.knobs))
    return LaneSpec(spec.preset, spec.strategy, knobs, typed.get("more", spec.more))


def six_lanes() -> list[LaneSpec]:
    return [spec_from_preset(p) for p in ("greedy", "balanced", "min-p", "creative", "contrastive-search", "greedy")]


# --- validation: the Step view's messages, lane by lane -----------------------------------------

@pytest.mark.parametrize("lane", [FIRST, MIDDLE, LAST])
@pytest.mark.parametrize("typed", [{"temperature": 9}, {"top_k": "abc"}, {"top_p": None}, {"max_new_tokens": 0},
                                   {"seed": -1}, {"min_p": "0.1; drop table"}])
def test_hostile_values_get_the_step_views_message_naming_lane_and_value(lane, typed):
    specs = six_lanes()
    specs[lane] = with_knob(specs[lane], **typed)
    (name, value), = typed.items()
    _, (step_message,) = checked_values([name], [value])  # what the Step view says for this value
    run = handlers.run_all(Shared(ModelRegistry(), None, None, None), fake_page(), "hi", False, "embedded", "none",
                           MAX_LANES, "", flat(specs), RunControl())
    with pytest.raises(UserError) as caught:
        next(run)  # validation comes first: no model is loaded for a bad click
    assert str(caught.value) == f"Lane {lane + 1}: {step_message}"
    assert "\n" not in str(caught.value)


def test_every_bad_knob_of_a_lane_is_named_at_once_as_in_the_step_view():
    spec = with_knob(spec_from_preset("balanced"), temperature=-1, top_k=2.5)
    with pytest.raises(UserError, match=r"^Lane 2: 2 invalid knobs: temperature: -1.0 is out of range; allowed 0 or "
                                        r"\[0.01, 5\] · top_k: expected an integer in \[0, 100000\], got 2.5$"):
        lane_config(spec, "Lane 2")


@pytest.mark.parametrize("more, message", [
    ('{"repetition_penalty": 99}', "Lane 1: repetition_penalty: 99.0 is out of range"),
    ('{"repetition_penalty": NaN}', "Lane 1: more knobs: not valid JSON (NaN is not allowed"),
    ("[1, 2]", "Lane 1: more knobs: expected a JSON object of knobs, got a JSON list"),
    ('{"temprature": 1}', "Lane 1: temprature: unknown key"),
    ('{"temperature": 1}', "Lane 1: more knobs: temperature has its own control in the lane"),
    ('{"stage_order": ["nope"]}', "Lane 1: stage_order"),
])
def test_more_knobs_json_is_strict(more, message):
    with pytest.raises(UserError) as caught:
        lane_config(with_knob(spec_from_preset("balanced"), more=more), "Lane 1")
    assert str(caught.value).startswith(message)


def test_more_knobs_round_trip_every_other_knob_of_a_config():
    cfg = DecodingConfig(strategy="sample", temperature=0.7, top_p=0.9, stop=("\n",), repetition_penalty=1.3,
                         stage_order=("top_p", "temperature"), seed=5, max_new_tokens=9)
    spec = spec_from_config(cfg)
    assert spec.knob("temperature") == 0.7 and spec.knob("seed") == 5 and spec.knob("max_new_tokens") == 9
    assert set(json.loads(spec.more)) == {"stop", "repetition_penalty", "stage_order"}  # the others have controls
    assert lane_config(spec, "Lane 1") == cfg


# --- greyed knobs, header in words, presets ---------------------------------------------------

def test_greedy_greys_exactly_the_sampling_knobs_and_the_header_reads_as_words():
    page = fake_page()
    lane = page.lanes[MIDDLE]
    greedy = handlers.lane_updates(lane, MIDDLE, spec_from_preset("greedy"))
    greyed = {n for n in LANE_KNOBS if greedy[lane.knobs[n]]["interactive"] is False}
    assert greyed == {"temperature", "top_k", "top_p", "min_p"}  # seed and the budget still matter
    assert greedy[lane.knobs["top_p"]]["info"] == IGNORED_BY_GREEDY_SHORT
    assert greedy[lane.header] == '<div class="cmp-lane-header"><b>Lane 3</b> · greedy · 32 tokens</div>'
    spec = with_knob(spec_from_preset("balanced"), seed=1)
    sample = handlers.lane_updates(lane, MIDDLE, spec)
    assert all(sample[c]["interactive"] for c in lane.knobs.values())
    assert sample[lane.header].endswith("</b> · sample · T 0.8 · top-p 0.9 · seed 1 · 32 tokens</div>")
    bad = handlers.lane_updates(lane, MIDDLE, with_knob(spec, top_p=3))
    assert "⚠ settings: top_p: 3.0 is out of range; allowed (0, 1]" in bad[lane.header]


def test_a_picked_preset_fills_the_controls_and_keeps_the_lanes_seed_and_budget():
    page = fake_page()
    lane = page.lanes[LAST]
    current = with_knob(spec_from_preset("greedy"), seed=7, max_new_tokens=9)
    values = ("balanced", *current.values()[1:])
    out = handlers.fill_lane(lane, LAST, values, None)
    assert out[lane.strategy] == "sample" and out[lane.preset] == "balanced"
    assert [out[lane.knobs[n]]["value"] for n in LANE_KNOBS] == [0.8, 0, 0.9, 0.0, 7, 9]
    assert handlers.fill_lane(lane, LAST, ("(no such preset)", *values[1:]), None) == {}


def test_add_copies_the_last_lanes_seed_and_budget_and_remove_moves_results_with_lanes():
    page = fake_page()
    specs = [with_knob(spec_from_preset(p), seed=4, max_new_tokens=6) for p in ("greedy", "balanced")]
    out = handlers.reshape(page, "add", 0, 2, None, "", flat(specs))
    assert out[page.count] == 3 and out[page.lanes[2].column] == gr.update(visible=True)
    assert out[page.lanes[2].preset] == "contrastive-search"
    assert out[page.lanes[2].knobs["seed"]]["value"] == 4 and out[page.lanes[2].knobs["max_new_tokens"]]["value"] == 6
    session = CompareSession([None] * 3, ["", "e2", "e3"], 6)
    specs3 = specs + [spec_from_preset("min-p")]
    out = handlers.reshape(page, "remove", 1, 3, session, "", flat(specs3))  # the middle lane goes
    assert out[page.count] == 2 and out[page.lanes[1].preset] == "min-p"
    assert "Lane 2: e3" in out[page.lanes[1].status] and out[page.lanes[2].column] == gr.update(visible=False)
    out = handlers.reshape(page, "remove", 0, 2, out[page.session], "", flat(specs3[::2]))
    assert "lanes: at least 2" in out[page.status]


# --- lessons fill the lanes -------------------------------------------------------------------

def test_a_compare_lesson_fills_every_lane_with_its_configuration_and_prompt():
    lesson = builtin_lessons()["temperature"]
    page = fake_page()
    out = handlers.open_lesson(page, lesson.prompt, lesson.chat, lane_configs(lesson, None))
    assert out[page.prompt] == "Write one sentence about the moon." and out[page.chat] is True
    assert out[page.count] == 3
    assert [out[page.lanes[i].column]["visible"] for i in range(MAX_LANES)] == [True] * 3 + [False] * 3
    last = page.lanes[2]
    assert out[last.strategy] == "sample"
    assert [out[last.knobs[n]]["value"] for n in ("temperature", "seed", "max_new_tokens")] == [5.0, 7, 24]
    assert "sample · T 5 · seed 7 · 24 tokens" in out[last.header]
    assert "sample at T 0 (a greedy pick) · 24 tokens" in out[page.lanes[0].header]
    for i, preset in enumerate(lesson.runs):  # the lanes run exactly the lesson's configurations
        assert lane_config(LaneSpec.from_values([out[c] if not isinstance(out[c], dict) else out[c]["value"]
                                                 for c in page.lanes[i].controls]), "x") == preset.config


# --- two sessions at once ---------------------------------------------------------------------

def test_two_sessions_running_at_once_keep_their_own_lanes(tiny_lm):
    shared = Shared(registry=ModelRegistry(), model=None, quantization=None, user_presets=None)
    shared.lm = lambda *_: tiny_lm
    page = fake_page()
    a = [with_knob(spec_from_preset("greedy"), max_new_tokens=3), with_knob(spec_from_preset("balanced"), seed=1,
                                                                            max_new_tokens=4)]
    b = [with_knob(spec_from_preset(p), seed=2, max_new_tokens=n) for p, n in (("min-p", 2), ("greedy", 5),
                                                                               ("creative", 3))]
    finals: dict[str, dict] = {}
    sessions: dict[str, CompareSession] = {}

    def run(key: str, prompt: str, specs: list[LaneSpec]) -> None:
        for finals[key] in handlers.run_all(shared, page, prompt, False, "tiny", "none", len(specs), "", flat(specs),
                                            RunControl()):
            sessions.setdefault(key, finals[key].get(page.session))  # the run's gr.State value

    threads = [threading.Thread(target=run, args=args) for args in (("a", "The sea", a), ("b", "Once upon", b))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert sessions["a"] is not sessions["b"] and len(sessions["a"].traces) == 2 and len(sessions["b"].traces) == 3
    assert "done: 2 of 2 lanes ran" in finals["a"][page.status] and "done: 3 of 3" in finals["b"][page.status]
    assert page.lanes[2].status not in finals["a"]  # session a has two lanes: the third is not its
    for key, prompt, specs in (("a", "The sea", a), ("b", "Once upon", b)):
        for spec, trace in zip(specs, sessions[key].traces):
            cfg = lane_config(spec, "x")
            alone = shared.run(tiny_lm, prompt, cfg, chat=False, prompt_ids=tiny_lm.encode(prompt, False),
                               control=RunControl())
            assert trace.prompt == prompt and trace.generated_token_ids == alone.generated_token_ids
            assert len(trace.steps) == cfg.max_new_tokens or trace.stop_reason != "max_new_tokens"


def test_flat_values_round_trip_lane_fields():
    spec = with_knob(spec_from_preset("anti-repetition"), seed=3)
    assert len(spec.values()) == len(LANE_FIELDS) and LaneSpec.from_values(spec.values()) == spec
    assert handlers.specs_from(flat([spec, spec]), 2) == [spec, spec]


@pytest.mark.parametrize("lesson_id", [k for k, v in builtin_lessons().items() if v.view == "compare"])
def test_every_compare_lesson_fills_lanes_that_run_its_exact_configurations(lesson_id):
    lesson = builtin_lessons()[lesson_id]
    page = fake_page()
    out = handlers.open_lesson(page, lesson.prompt, lesson.chat, lane_configs(lesson, None))
    assert out[page.count] == len(lesson.runs) and out[page.prompt] == lesson.prompt
    values = [v["value"] if isinstance(v, dict) else v for v in (out[c] for c in page.lane_values[:len(
        lesson.runs) * len(LANE_FIELDS)])]
    specs = handlers.specs_from(values, len(lesson.runs))
    assert [lane_config(s, "x") for s in specs] == [p.config for p in lesson.runs]
    assert all("⚠" not in out[page.lanes[i].header] for i in range(len(lesson.runs)))


def test_a_stop_marks_every_lane_stopped_even_where_the_last_redraw_must_ask_a_server(monkeypatch):
    """A served lane's partial trace decodes its tokens on its server, under the run's control. After
    a Stop that control is cancelled, so the last redraw's request was refused and the lane stayed
    "running… 31 / 256 tokens" for ever beside two stopped lanes (the browser, a llama-server fast
    lane). The last redraw runs under a short control of its own; where even that fails, the lane
    keeps the tokens it last drew and says that count."""
    from engine.control import RunStopped, active_control, under
    from engine.trace import Event
    from playground.views.compare import run as compare_run
    from playground.views.compare.lanes import RUNNING, STOPPED

    class Step:
        def __init__(self, i):
            self.i = i

    made = {0: threading.Event(), 1: threading.Event()}
    down = {"server": False}

    def stream(lm, prompt, config, *, chat, prompt_ids, control):
        for i in range(10_000):
            control.check()
            yield Event(steps=[Step(i)])
            if i == 5:
                made[lm].set()
            threading.Event().wait(0.002)

    def partial(lm, prompt, prompt_ids, config, steps, chat):
        if lm == 1:  # the served lane: its text is asked of its server, under the active control
            control = active_control()
            if control is not None:
                control.check()
            if down["server"]:
                raise RunStopped("time_limit", "stopped: the server did not answer")
        return type("Partial", (), {"steps": steps})()

    monkeypatch.setattr(compare_run.runner, "partial_trace", partial)
    shared = type("FakeShared", (), {"stream": staticmethod(stream)})()
    models = [compare_run.LaneModel(0, [1]), compare_run.LaneModel(1, [1])]
    configs = [DecodingConfig(strategy="greedy", max_new_tokens=256)] * 2
    for server_down in (False, True):
        down["server"] = False
        control, session = RunControl(), CompareSession([None, None], ["", ""], 256, [256, 256])
        redraws = under(control, compare_run.run_lanes(shared, models, "p", configs, False, session, control))
        next(redraws)
        assert all(e.wait(10) for e in made.values())
        threading.Event().wait(0.1)  # the lanes make more tokens than the redraw drew: the last one has work
        down["server"] = server_down
        control.cancel()
        with pytest.raises(RunStopped):
            for _ in redraws:
                pass
        assert session.phases == [STOPPED, STOPPED] and RUNNING not in session.phases, session.phases
        for trace, count in zip(session.traces, session.progress):
            assert trace is not None and len(trace.steps) == count > 0, (len(trace.steps), count)  # status = text


def test_lanes_that_all_end_on_the_stop_in_one_wait_make_a_stopped_run_not_a_done_one(monkeypatch):
    """``follow`` checks the control between waits; when every lane ended on the Stop within one wait
    it ended without a check, and the page said "done: 2 of 2 lanes ran" beside two lanes saying
    "stopped after 15 of 128 tokens". That window, made certain: the run raises RunStopped and every
    lane says stopped."""
    from engine.control import RunStopped
    from engine.trace import Event
    from playground.views.compare import run as compare_run
    from playground.views.compare.lanes import STOPPED

    control = RunControl()
    at_five = threading.Barrier(2)

    def stream(lm, prompt, config, *, chat, prompt_ids, control):
        for i in range(6):
            if i == 5:
                at_five.wait(10)
                control.cancel()  # the Stop reaches both lanes at their sixth token
            control.check()
            yield Event(steps=[i])

    def one_wait(runs, ended, control, every_s=0.5):  # both ends seen in one wait, no check after it
        for _ in runs:
            ended.get(timeout=10)
        yield

    monkeypatch.setattr(compare_run, "follow", one_wait)
    monkeypatch.setattr(compare_run.runner, "partial_trace",
                        lambda lm, prompt, ids, config, steps, chat: type("Partial", (), {"steps": steps})())
    shared = type("FakeShared", (), {"stream": staticmethod(stream)})()
    session = CompareSession([None, None], ["", ""], 128, [128, 128])
    models = [compare_run.LaneModel(0, [1]), compare_run.LaneModel(1, [1])]
    configs = [DecodingConfig(strategy="greedy", max_new_tokens=128)] * 2
    with pytest.raises(RunStopped):
        for _ in compare_run.run_lanes(shared, models, "p", configs, False, session, control):
            pass
    assert session.phases == [STOPPED, STOPPED] and session.stopped == "cancelled", (session.phases, session.stopped)
    assert session.progress == [5, 5]
