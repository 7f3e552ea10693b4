"""The what-if route (POST /dp/whatif): the page's knob change answered without Gradio's event
path. Handler level on the embedded model (first / middle / last step, against engine.explore's
stages drawn by the view's own chart builder; kept logits reused; prepare; two sessions at once;
hostile bodies and values), then over HTTP against the real server (status codes, strict JSON)."""

import gc
import json
import threading

import httpx
import pytest

from engine import explore, runner
from engine.runner import RunRequest
from engine.config import DecodingConfig
from playground.charts import step as charts
from playground.views import step as step_view
from playground import whatif_service as whatif

pytestmark = pytest.mark.slow

CFG = DecodingConfig(strategy="sample", seed=3, max_new_tokens=6, temperature=0.9, top_k=40, top_p=0.95)


@pytest.fixture(scope="module")
def route(registry, embedded):
    """The WhatIfService of a freshly built app (its own knob panel) over the test registry."""
    from playground.app import build_app

    demo = build_app(registry)
    yield whatif.service_of(demo)


@pytest.fixture(scope="module")
def trace(embedded):
    return runner.run(RunRequest(embedded, "Name a colour of the sea.", CFG, chat=True))


def values(route, **knobs):
    """The panel's default control values with ``knobs`` set (by knob name), in inputs order."""
    out = []
    for component in route.panel.inputs:
        name = (component.elem_id or "").split("knob-")[-1]
        out.append(knobs[name] if name in knobs else component.value)
    return out


def ask(route, session, step, width=1400, model="embedded", **knobs) -> dict:
    body = {"key": session.whatif_key, "step": step, "model": model, "quantization": "none", "width": width,
            "values": values(route, **knobs)}
    return json.loads(whatif.dumps(route.answer(json.dumps(body).encode())))


def expected_figure(lm, trace, at, knobs, width=1400, chart=charts.fitted_stage_chart) -> dict:
    """The oracle: engine.explore's stages for the step under the knobs (with the token the knobs
    would pick: engine.strategies.decode.whatif_step, from a fresh forward), drawn and titled by the view's builder."""
    from engine.strategies import decode

    changed = decode.whatif_step(lm, trace, at, knobs, explore.raw_logits(lm, trace, at))
    assert explore.stages_match(changed.stages, explore.explore_step(lm, trace, at, knobs))
    return json.loads(whatif.whatif_figure(chart, trace, at, changed, knobs, width).to_json())


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_route_draws_the_step_under_new_knobs_like_explore_step(route, embedded, trace, where):
    at = {"first": 0, "middle": len(trace.steps) // 2, "last": len(trace.steps) - 1}[where]
    session = step_view.StepSession(runs=[trace], owner="o" * 32)
    reply = ask(route, session, at, temperature=2.5, top_k=0)
    config = route.panel.values(*values(route, temperature=2.5, top_k=0))
    assert reply["figure"] == expected_figure(embedded, trace, at, config)
    assert "temperature = 2.5" in reply["note"] and "top_k = 0" in reply["note"]
    assert session.kept.key == whatif.context_key("embedded", "none", trace, at)


def test_later_changes_reuse_the_kept_logits_and_prepare_keeps_them_first(route, trace, monkeypatch):
    session = step_view.StepSession(runs=[trace], owner="o" * 32)
    prepared = route.answer(json.dumps({"prepare": True, "key": session.whatif_key, "step": 2, "model": "embedded",
                                        "quantization": "none"}).encode())
    assert prepared == {"prepared": True}
    assert session.kept.key == whatif.context_key("embedded", "none", trace, 2)
    monkeypatch.setattr(explore, "raw_logits", lambda *a, **k: pytest.fail("recomputed the kept logits"))
    for t in (0.3, 1.7, 4.0):
        assert f"temperature = {t}" in ask(route, session, 2, temperature=t)["note"]


def test_two_sessions_at_once_get_their_own_runs(route, embedded, trace):
    other = runner.run(RunRequest(embedded, "Write the word MARKER twice.", CFG, chat=True))
    sessions = {"a": step_view.StepSession(runs=[trace], owner="a" * 32),
                "b": step_view.StepSession(runs=[other], owner="b" * 32)}
    assert sessions["a"].whatif_key != sessions["b"].whatif_key
    replies: dict = {}

    def worker(name):
        replies[name] = [ask(route, sessions[name], s, temperature=t) for s, t in ((1, 1.5), (3, 0.5), (0, 2.0))]

    threads = [threading.Thread(target=worker, args=(n,)) for n in sessions]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    config = lambda t: route.panel.values(*values(route, temperature=t))  # noqa: E731
    for name, tr in (("a", trace), ("b", other)):
        for reply, (s, t) in zip(replies[name], ((1, 1.5), (3, 0.5), (0, 2.0))):
            assert reply["figure"] == expected_figure(embedded, tr, s, config(t))


def test_an_expired_session_key_draws_nothing(route, trace):
    session = step_view.StepSession(runs=[trace], owner="o" * 32)
    key = session.whatif_key
    del session
    gc.collect()
    body = {"key": key, "step": 1, "model": "embedded", "quantization": "none", "values": values(route)}
    reply = route.answer(json.dumps(body).encode())
    assert reply["figure"] is None and "expired" in reply["note"]
    for bad in (None, 7, "short", "x" * 500, ["k"]):
        assert route.answer(json.dumps(body | {"key": bad}).encode())["figure"] is None


@pytest.mark.parametrize("knobs, named", [({"temperature": -2}, "temperature"), ({"top_p": 7}, "top_p"),
                                          ({"top_k": "many"}, "top_k"), ({"logit_bias": "{nope"}, "logit_bias")])
def test_bad_knob_values_give_a_note_naming_the_knob(route, trace, knobs, named):
    session = step_view.StepSession(runs=[trace], owner="o" * 32)
    reply = ask(route, session, 1, **knobs)
    assert reply["figure"] is None and named in reply["note"] and "dp-error" in reply["note"]


def test_models_are_never_loaded_by_the_route(route, registry, trace, monkeypatch):
    session = step_view.StepSession(runs=[trace], owner="o" * 32)
    peek = registry.peek  # another test may have loaded the int8 model: as if it had not
    monkeypatch.setattr(registry, "peek", lambda spec: None if spec.quantization == "int8" else peek(spec))
    before = registry.loaded()
    for model in ("/etc", "../../etc/passwd", "gpt2", "x" * 600):
        reply = ask(route, session, 1, model=model)
        assert reply["figure"] is None and "model" in reply["note"], model
    assert ask(route, session, 1, model="embedded")["figure"] is not None
    body = {"key": session.whatif_key, "step": 1, "model": "embedded", "quantization": "int8", "values": values(route)}
    assert route.answer(json.dumps(body).encode()) == {"fallback": True}  # allowed, not loaded: Gradio's path loads it
    assert registry.loaded() == before


def test_hostile_steps_are_clamped_and_bodies_refused(route, trace):
    session = step_view.StepSession(runs=[trace], owner="o" * 32)
    last = len(trace.steps) - 1
    assert ask(route, session, 10**9)["figure"]["layout"]["meta"]["step"] == last
    assert ask(route, session, -5)["figure"]["layout"]["meta"]["step"] == 0
    assert ask(route, session, "2")["figure"]["layout"]["meta"]["step"] == 0
    for body in (b"", b"[]", b"{", b'{"values": NaN}', b"\xff\xfe", json.dumps({"key": session.whatif_key}).encode(),
                 json.dumps({"key": session.whatif_key, "values": [1, 2]}).encode()):
        with pytest.raises(whatif.RouteError):
            route.answer(body)


def test_the_direct_path_can_be_turned_off(route, trace, monkeypatch):
    monkeypatch.setattr(route, "direct", False)
    session = step_view.StepSession(runs=[trace], owner="o" * 32)
    body = {"key": session.whatif_key, "step": 1, "model": "embedded", "quantization": "none", "values": values(route)}
    assert route.answer(json.dumps(body).encode()) == {"fallback": True}
    assert route.answer(json.dumps(body | {"prepare": True}).encode()) == {"prepared": False}
    monkeypatch.setenv("DP_WHATIF_ROUTE", "0")
    assert not whatif.direct_enabled()


def test_route_over_http_is_strict_json_with_clear_statuses(live_app, embedded, trace):
    def strict(text):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))

    session = step_view.StepSession(runs=[trace], owner="o" * 32)  # the server runs in this process
    route = whatif.services()[0]
    body = {"key": session.whatif_key, "step": 2, "model": "embedded", "quantization": "none", "width": None,
            "values": values(route, temperature=1.3)}
    with httpx.Client(base_url=live_app, timeout=60) as client:
        ok = client.post(whatif.ROUTE, json=body)
        assert ok.status_code == 200 and ok.headers["content-type"].startswith("application/json")
        reply = strict(ok.text)
        assert reply["figure"]["layout"]["meta"]["step"] == 2 and "temperature = 1.3" in reply["note"]
        for content, status in ((b"{", 400), (b"[1]", 400), (b'{"values": Infinity}', 400), (b"x" * 70_000, 413)):
            res = client.post(whatif.ROUTE, content=content)
            assert res.status_code == status and "error" in strict(res.text)
        assert client.get(whatif.ROUTE).status_code == 405


def test_a_failure_inside_the_route_is_a_note_not_a_500(live_app, monkeypatch):
    def broken(self, body):
        raise RuntimeError("boom")

    monkeypatch.setattr(whatif.WhatIfService, "answer", broken)
    res = httpx.post(live_app + whatif.ROUTE, json={"key": "k"}, timeout=60)
    assert res.status_code == 200
    reply = res.json()
    assert reply["figure"] is None and "what if failed: RuntimeError" in reply["note"]


# --- the presenter view's temperature slider -------------------------------------------------------
def presenter_ask(route, session, step, knobs, width=1280) -> dict:
    body = {"view": "presenter", "key": session.whatif_key, "step": step, "model": "embedded", "quantization": "none",
            "width": width, "knobs": knobs}
    return json.loads(whatif.dumps(route.answer(json.dumps(body).encode())))


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_presenter_slider_draws_the_lessons_step_at_that_temperature(route, embedded, trace, where):
    from engine.reports.lessons import builtin_lessons
    from playground.views.lessons import LessonSession
    from playground.panels.presenter import step_chart

    at = {"first": 0, "middle": len(trace.steps) // 2, "last": len(trace.steps) - 1}[where]
    session = LessonSession(next(iter(builtin_lessons().values())), [trace])
    reply = presenter_ask(route, session, at, {"temperature": 2.2})
    assert reply["figure"] == expected_figure(embedded, trace, at, {"temperature": 2.2}, 1280, step_chart)
    assert reply["figure"]["layout"]["font"]["size"] >= 18  # projector-sized


def test_presenter_slider_on_a_greedy_run_shows_sampling_and_refuses_other_knobs(route, embedded):
    from engine.reports.lessons import builtin_lessons
    from playground.views.lessons import LessonSession

    greedy = runner.run(RunRequest(embedded, "Name a colour of the sea.", CFG.replace(strategy="greedy"), chat=True))
    session = LessonSession(next(iter(builtin_lessons().values())), [greedy])
    reply = presenter_ask(route, session, 1, {"temperature": 3.0})
    stages = explore.explore_step(embedded, greedy, 1, {"temperature": 3.0, "strategy": "sample"})
    assert "temperature" in [s.name for s in stages]
    assert reply["figure"] is not None and "strategy = sample" in reply["note"]
    for knobs in ({"top_k": 3}, {"temperature": 1, "seed": 2}, ["temperature"], None):
        with pytest.raises(whatif.RouteError, match="knobs"):
            presenter_ask(route, session, 1, knobs)
    for bad in (-1, "hot", 1e9):
        assert "temperature" in presenter_ask(route, session, 1, {"temperature": bad})["note"]
    assert presenter_ask(route, LessonSession(session.lesson), 0, {"temperature": 1.0}) == {"figure": None, "note": None}


def test_a_session_unpickled_from_a_zerogpu_worker_is_found_by_its_key(route, trace):
    import pickle  # what ZeroGPU's worker does to a handler's result; the app itself never unpickles

    from engine.reports.lessons import builtin_lessons
    from playground.views.lessons import LessonSession

    for made in (step_view.StepSession(runs=[trace], owner="o" * 32),
                 LessonSession(next(iter(builtin_lessons().values())), [trace])):
        key = made.whatif_key
        copy = pickle.loads(pickle.dumps(made))
        del made
        gc.collect()
        assert copy.whatif_key == key and whatif.session_of(key) is copy


def test_a_new_stage_order_redraws_in_that_order_and_the_note_says_so(route, embedded, trace):
    session = step_view.StepSession(runs=[trace], owner="o" * 32)
    order = route.panel.stage_order.value.split(", ")
    i, j = order.index("temperature"), order.index("top_p")
    order[i], order[j] = order[j], order[i]
    reply = ask(route, session, 1, **{"step-stage-order": ", ".join(order)})
    assert "stage_order = reordered" in reply["note"]
    stages = explore.explore_step(embedded, trace, 1, {"stage_order": order})
    names = [s.name for s in stages]
    assert names.index("top_p") < names.index("temperature")
    assert reply["figure"] == expected_figure(embedded, trace, 1, route.panel.values(*values(
        route, **{"step-stage-order": ", ".join(order)})))
