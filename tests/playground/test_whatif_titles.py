"""Issue #27, what-if: after a knob change the chart's title and the explanation under it describe
the what-if result under the new knobs (what they would pick with the run's own draw u), not the
run's old pick, on both transports: the /dp/whatif route (drawn by the page's script) and the
Gradio-event fallback (``on_knob``, driven through the app's registered function). First, a middle
and the last step; two sessions at once; hostile values."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from engine import explore, runner
from engine.runner import RunRequest
from engine.config import DecodingConfig
from engine.chain import Chain
from playground.charts import step as charts
from playground.views import step as step_view
from playground import whatif_service as whatif
from tests.helpers.continue_compare import Page, generate

pytestmark = pytest.mark.slow

CFG = DecodingConfig(strategy="sample", seed=3, max_new_tokens=6, temperature=0.9, top_k=40, top_p=0.95)


@pytest.fixture(scope="module")
def demo(registry, embedded):
    from playground.app import build_app

    return build_app(registry)


@pytest.fixture(scope="module")
def route(demo):
    return whatif.service_of(demo)


@pytest.fixture(scope="module")
def trace(embedded):
    return runner.run(RunRequest(embedded, "Name a colour of the sea.", CFG, chat=True))


def values(route, **knobs):
    """The panel's control values with ``knobs`` set (by knob name, or elem_id for the strategy)."""
    return [knobs.get((c.elem_id or "").split("knob-")[-1], c.value) for c in route.panel.inputs]


def ask(route, session, step, **knobs) -> dict:
    body = {"key": session.whatif_key, "step": step, "model": "embedded", "quantization": "none", "width": 1400,
            "values": values(route, **knobs)}
    return json.loads(whatif.dumps(route.answer(json.dumps(body).encode())))


def oracle_pick(lm, trace, at, knobs) -> tuple[int, float]:
    """The token the knobs would pick at step ``at`` with the run's draw u, the plain way: the full
    final distribution, tokens sorted by probability (ties: lower id), walked until the mass passes u;
    greedy knobs: the most probable token."""
    config = explore.explore_config(trace, knobs)
    ids = torch.tensor([explore.step_context(trace, at)])
    chain = Chain.from_config(config, len(trace.prompt_token_ids), lm.tokenizer, lm.eos_token_ids)
    probs = chain.traced(ids, explore.raw_logits(lm, trace, at), config.top_n, lm.token_text).final_probs.double()
    order = sorted(range(probs.shape[0]), key=lambda i: (-float(probs[i]), i))
    if config.is_greedy:
        return order[0], float(probs[order[0]])
    mass = 0.0
    for i in order:
        mass += float(probs[i])
        if mass > trace.steps[at].draw:
            return i, float(probs[i])
    raise AssertionError("u past the total mass")


def token_text(lm, token_id: int) -> str:
    return charts.readable(lm.token_text(token_id))


@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("knobs", [{"temperature": 2.5, "top_k": 0}, {"step-strategy": "greedy"}, {"temperature": 0.2}])
def test_route_title_and_explanation_describe_the_new_knobs(route, embedded, trace, where, knobs):
    at = {"first": 0, "middle": len(trace.steps) // 2, "last": len(trace.steps) - 1}[where]
    session = step_view.StepSession(runs=[trace], owner="o" * 32)
    reply = ask(route, session, at, **knobs)
    config = route.panel.values(*values(route, **knobs))
    token, p = oracle_pick(embedded, trace, at, config)
    title = reply["figure"]["layout"]["title"]["text"]
    run = trace.steps[at]
    assert title.startswith(f"step {at}: what if, ")
    verb = "greedy would choose" if config["strategy"] == "greedy" else f"the run's u = {run.draw:.3f} would choose"
    assert f"{verb} {token_text(embedded, token)} (p = {whatif.pct(p)})" in title, title
    assert f"the run chose {charts.readable(run.chosen_token)} (p = {whatif.pct(run.chosen_prob)})" in title
    explain = reply["explain"]
    assert explain.startswith(f"**What if** ({whatif.knob_diff(config, trace.config)}): ")
    assert f"“{token_text(embedded, token)}”" in explain and "would" in explain
    assert "so it was chosen" not in explain  # the run's own sentence, for its own knobs
    for stage in reply["figure"]["layout"]["annotations"][:1]:
        assert stage["text"].startswith("raw model")


def test_the_runs_own_knobs_choose_the_runs_token(route, embedded, trace):
    session = step_view.StepSession(runs=[trace], owner="o" * 32)
    own = {k: v for k, v in DecodingConfig.from_dict(trace.config).to_dict().items()
           if k in ("temperature", "top_k", "top_p", "min_p")}
    config = route.panel.values(*values(route, **own))
    assert whatif.knob_diff(config, trace.config) == whatif.OWN_KNOBS
    for at in range(len(trace.steps)):
        reply = ask(route, session, at, **own)
        run = trace.steps[at]
        assert reply["figure"]["layout"]["title"]["text"].startswith(
            f"step {at}: chose {charts.readable(run.chosen_token)} (p = {whatif.pct(run.chosen_prob)})")
        assert reply["explain"] == charts.explain_step(run)
        # The what-if pick under those knobs is the run's own token (its draw u replayed).
        hotter = ask(route, session, at, **(own | {"temperature": own["temperature"] + 1e-6}))
        assert f"would choose {charts.readable(run.chosen_token)} (p = " in hotter["figure"]["layout"]["title"]["text"]
        assert "The run chose it too." in hotter["explain"]


def test_fallback_event_sends_the_same_title_and_explanation(demo, route, embedded):
    """The Gradio-event path (the route cannot answer: DP_WHATIF_ROUTE=0, ZeroGPU): on_knob as the
    app registered it, after a run generated through the page's own Generate."""
    page = Page(demo)
    session = generate(page, "Name a colour of the sea.", tokens=6)
    trace = session.trace()
    for at in (0, len(trace.steps) // 2, len(trace.steps) - 1):
        page.set("step-index", at)
        page.set("step-knob-temperature", 2.0)
        page.set("step-knob-top_k", 0)
        page.fire("on_knob", "step-whatif-figure")
        figure = json.loads(page.shown("step-whatif-figure"))
        config = route.panel.values(*[page.get(c) for c in route.panel.inputs])
        token, p = oracle_pick(embedded, trace, at, config)
        assert figure["layout"]["meta"]["step"] == at
        assert f"would choose {token_text(embedded, token)} (p = {whatif.pct(p)})" in figure["layout"]["title"]["text"]
        explain = page.shown("step-explain")
        assert explain.startswith("**What if** (") and "temperature = 2.0" in explain
        assert f"“{token_text(embedded, token)}”" in explain
        assert route.answer(json.dumps({"key": session.whatif_key, "step": at, "model": "embedded",
                                        "quantization": "none", "width": None,
                                        "values": [page.get(c) for c in route.panel.inputs]}).encode())[
            "explain"] == explain  # both transports say the same
    # Selecting the step again shows the run's own explanation.
    page.fire("redraw", "step-text")
    assert not page.shown("step-explain").startswith("**What if**")


def test_two_sessions_get_their_own_titles(route, embedded, trace):
    other = runner.run(RunRequest(embedded, "Write the word MARKER twice.", CFG.replace(seed=11), chat=True))
    sessions = {"a": (step_view.StepSession(runs=[trace], owner="a" * 32), trace, 1.5),
                "b": (step_view.StepSession(runs=[other], owner="b" * 32), other, 3.0)}
    replies: dict = {}

    def worker(name):
        session, _, t = sessions[name]
        replies[name] = [ask(route, session, s, temperature=t, top_k=0) for s in (0, 2, 4)]

    threads = [threading.Thread(target=worker, args=(n,)) for n in sessions]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for name, (_, tr, t) in sessions.items():
        for reply, s in zip(replies[name], (0, 2, 4)):
            config = route.panel.values(*values(route, temperature=t, top_k=0))
            token, p = oracle_pick(embedded, tr, s, config)
            assert f"would choose {token_text(embedded, token)} (p = {whatif.pct(p)})" in reply["figure"]["layout"]["title"]["text"]
            assert f"temperature = {t}" in reply["explain"]


def test_hostile_values_change_no_explanation(route, trace):
    session = step_view.StepSession(runs=[trace], owner="o" * 32)
    for knobs in ({"temperature": -2}, {"top_k": "many"}, {"min_p": 7}):
        reply = ask(route, session, 1, **knobs)
        assert reply["figure"] is None and "explain" not in reply and "dp-error" in reply["note"]
    last = len(trace.steps) - 1
    reply = ask(route, session, 10**9, temperature=1.3)
    assert reply["figure"]["layout"]["title"]["text"].startswith(f"step {last}: what if")
    assert "<script" not in reply["explain"]


def test_what_if_pick_edges():
    from engine.core import draw_at

    probs = torch.tensor([0.125, 0.375, 0.0, 0.375, 0.125])  # sorted: 1, 3 (tie: lower id first), 0, 4
    us = (0.0, 0.374, 0.375, 0.749, 0.75, 0.9, 0.9999999)
    assert [draw_at(probs, u).token_id for u in us] == [1, 1, 3, 3, 0, 4, 4]
    pick = draw_at(probs, 0.5)
    assert (pick.token_id, pick.low, pick.high, pick.draw) == (3, 0.375, 0.75, 0.5)
    assert draw_at(probs, 1.0).token_id == 4  # u at the total by rounding: the last token with mass


def test_fallback_event_writes_the_kept_logits_under_the_sessions_lock(demo, route, monkeypatch):
    """#28: on_knob (the Gradio-event what-if) reads and writes ``state.kept`` holding the same lock
    as the route and its prepare (it wrote it without: a prepare and a knob change could race)."""
    page = Page(demo)
    session = generate(page, "Name a colour of the sea.", tokens=3)
    held = []
    real = whatif.whatif_step

    def watched(lm, trace, at, knobs, kept, key):
        held.append(route.kept_lock(session).locked())
        return real(lm, trace, at, knobs, kept, key)

    monkeypatch.setattr(whatif, "whatif_step", watched)
    page.set("step-index", 1)
    page.set("step-knob-temperature", 1.7)
    page.fire("on_knob", "step-whatif-figure")
    assert held == [True] and session.kept is not None
    assert json.loads(page.shown("step-whatif-figure"))["layout"]["meta"]["step"] == 1
