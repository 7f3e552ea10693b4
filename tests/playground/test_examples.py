"""First screens that already teach: the startup example of each view is the same run as pressing
its Generate with the fresh page's inputs, checked through the views' own handlers on the tiny
random Llama (the oracle: the view's Generate handler in the same process)."""

from __future__ import annotations

import gradio as gr
import pytest

from engine.control import RunControl
from engine.backends.registry import ModelRegistry
from playground import examples
from playground.knobs import STAGE_KNOBS, KnobPanel
from playground.shared import PanelView, Shared, model_pickers, user_presets_state
from playground.views import beam, speculative, step


class TinyRegistry(ModelRegistry):
    """Every model spec resolves to the tiny random Llama (fast, meaningless, deterministic)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def get(self, spec, progress=None, *, key="model"):
        return self.lm


class FakeTimer:
    """Stands in for the gr.Timer a view's example handler deactivates (only its identity matters)."""


@pytest.fixture
def built(tiny_lm):
    """Each view's knob panel, prompt and chat box as a fresh page shows them, over the tiny model."""
    with gr.Blocks():
        model, quant = model_pickers()
        shared = Shared(registry=TinyRegistry(tiny_lm), model=model, quantization=quant,
                        user_presets=user_presets_state())
        panels = {
            "step": KnobPanel(shared, step.RUN_KNOBS + STAGE_KNOBS, ["sample", "greedy"], preset=step.DEFAULT_PRESET),
            "beam": KnobPanel(shared, beam.BEAM_KNOBS, ["beam"], preset=beam.DEFAULT_PRESET, stage_order=False),
            "speculative": KnobPanel(shared, speculative.SPEC_KNOBS + speculative.RUN_KNOBS + STAGE_KNOBS,
                                     ["speculative"], preset=speculative.DEFAULT_PRESET),
        }
        prompts = {"step": step.DEFAULT_PROMPT, "beam": beam.DEFAULT_PROMPT, "speculative": speculative.DEFAULT_PROMPT}
        views = {name: PanelView(name, gr.Textbox(prompts[name]), panel, gr.Checkbox(name != "beam"))
                 for name, panel in panels.items()}
    return shared, views


def values(view: PanelView) -> list:
    return [c.value for c in view.panel.inputs]


def request_for(view: PanelView, **extra) -> examples.ExampleRequest:
    return examples.ExampleRequest(view.name, view.prompt.value, "default", examples.fresh_config(view.panel),
                                   chat=view.chat.value, **extra)


def last(updates) -> dict:
    out = {}
    for update in updates:
        out |= update
    return out


def computed(shared: Shared, request: examples.ExampleRequest) -> examples.ExampleCache:
    cache = examples.cache_for(shared.registry)
    cache.want(request)
    cache.start(shared, "embedded")
    assert cache.wait(120)
    return cache


def test_fresh_config_is_the_preset(built):
    from engine.presets import load_preset

    _, views = built
    for name, preset in (("step", "balanced"), ("beam", "beam-4"), ("speculative", "speculative-ngram")):
        assert examples.fresh_config(views[name].panel) == load_preset(preset).config


def test_cache_states_and_keys(built, monkeypatch):
    shared, views = built
    request = request_for(views["step"])
    cache = examples.cache_for(shared.registry)
    assert examples.cache_for(shared.registry) is cache  # one per registry
    assert cache.get(request, "embedded", "none") == ("none", None)  # never asked for
    monkeypatch.setenv("DP_EXAMPLES", "0")
    cache.want(request)
    assert cache.start(shared, "embedded") is None and cache.get(request, "embedded", "none")[0] == "none"
    monkeypatch.delenv("DP_EXAMPLES")
    computed(shared, request)
    state, example = cache.get(request, "embedded", "none")
    assert state == "ready" and example.trace.prompt == step.DEFAULT_PROMPT
    assert cache.get(request, "embedded", "int8")[0] == "none"  # keyed by quantization
    assert cache.get(request, "other-model", "none")[0] == "none"  # and by model
    other = request_for(views["step"]).__class__(**{**request.__dict__, "prompt": "Another prompt"})
    assert cache.get(other, "embedded", "none")[0] == "none"  # and by prompt


def test_matches_only_an_untouched_page(built):
    _, views = built
    view = views["step"]
    request = request_for(view)
    vals = values(view)
    assert examples.matches(request, view.prompt.value, True, view.panel, vals)
    assert not examples.matches(request, "edited", True, view.panel, vals)
    assert not examples.matches(request, view.prompt.value, False, view.panel, vals)
    changed = list(vals)
    changed[view.panel.inputs.index(view.panel.components["seed"])] = 7
    assert not examples.matches(request, view.prompt.value, True, view.panel, changed)
    assert not examples.matches(None, view.prompt.value, True, view.panel, vals)


def test_step_example_is_the_generate_run_with_the_most_uncertain_step_selected(built):
    shared, views = built
    view = views["step"]
    request = request_for(view)
    out = step.Outputs(*[f"step.{f}" for f in step.Outputs.__dataclass_fields__])
    handlers = step.Handlers(shared, view, out, None, request)
    generated = last(handlers.on_generate(view.prompt.value, True, "embedded", "none", "probability", None, "",
                                          *values(view), control=RunControl()))
    computed(shared, request)
    timer = FakeTimer()
    shown = handlers.on_example(timer, "embedded", "none", "probability", None, "", view.prompt.value, True,
                                *values(view))
    mine, theirs = shown[out.session].trace(), generated[out.session].trace()
    assert mine.generated_token_ids == theirs.generated_token_ids and len(mine.generated_token_ids) == 64
    assert [s.chosen_prob for s in mine.steps] == [s.chosen_prob for s in theirs.steps]
    entropies = [s.entropy for s in mine.steps]
    assert shown[out.step]["value"] == entropies.index(max(entropies))  # the most uncertain step
    assert shown[out.chart] is not None and shown[out.over_run] is not None
    assert shown[timer].active is False and len(shown[out.owner]) == 32
    assert mine is not examples.cache_for(shared.registry).get(request, "embedded", "none")[1].trace  # a copy
    # a page that already ran, or whose prompt was edited, is left alone
    assert set(handlers.on_example(timer, "embedded", "none", "probability", shown[out.session], shown[out.owner],
                                   view.prompt.value, True, *values(view))) == {timer}
    assert set(handlers.on_example(timer, "embedded", "none", "probability", None, "", "mine", True,
                                   *values(view))) == {timer}


def test_pending_example_says_what_to_do(built):
    shared, views = built
    view = views["step"]
    request = request_for(view)
    out = step.Outputs(*[f"step.{f}" for f in step.Outputs.__dataclass_fields__])
    cache = examples.cache_for(shared.registry)
    cache._pending.add(request.key("embedded", "none"))  # as while the startup thread runs
    shown = step.Handlers(shared, view, out, None, request).on_example(
        FakeTimer(), "embedded", "none", "probability", None, "", view.prompt.value, True, *values(view))
    assert list(shown) == [out.status] and "press Generate" in shown[out.status]


def test_beam_example_is_the_search_run(built):
    shared, views = built
    view = views["beam"]
    request = request_for(view, with_greedy=True)
    out = beam.Outputs(*[f"beam.{f}" for f in beam.Outputs.__dataclass_fields__])
    session = beam.BeamSession()
    req = beam.BeamRequest(shared.lm("embedded", "none"), view.prompt.value,
                           shared.encode_prompt(shared.lm("embedded", "none"), view.prompt.value, False),
                           view.panel.config(*values(view)), False, True)
    last(beam.stream_run(out, shared, session, req, RunControl()))
    computed(shared, request)
    timer = FakeTimer()
    shown = beam.on_example(shared, view, out, request, timer, "embedded", "none", True, None, view.prompt.value, False,
                            *values(view))
    example = shown[out.session]
    assert example.trace.generated_token_ids == session.trace.generated_token_ids
    assert [h.token_ids for h in example.beam().hypotheses] == [h.token_ids for h in session.beam().hypotheses]
    assert example.greedy.generated_token_ids == session.greedy.generated_token_ids
    assert len(shown[out.tree].data) > 0 and shown[timer].active is False


def test_speculative_example_is_the_generate_run_with_p_vs_q_filled(built):
    shared, views = built
    view = views["speculative"]
    request = request_for(view, compare_baseline=True)
    out = speculative.Outputs(*[f"spec.{f}" for f in speculative.Outputs.__dataclass_fields__])
    lm = shared.lm("embedded", "none")
    req = speculative.SpecRequest(lm, view.prompt.value, shared.encode_prompt(lm, view.prompt.value, True),
                                  view.panel.config(*values(view)), True, True)
    session = speculative.SpecSession()
    generated = last(speculative.stream_run(out, shared, session, req, RunControl()))
    computed(shared, request)
    timer = FakeTimer()
    shown = speculative.on_example(shared, view, out, request, timer, "embedded", "none", True, None,
                                   view.prompt.value, True, *values(view))
    example = shown[out.session]
    assert example.trace.generated_token_ids == session.trace.generated_token_ids
    assert example.selected == session.selected == speculative.default_position(session.rounds)
    r, pos = example.selected
    assert not example.rounds[r].drafted[pos].accepted  # the tiny model rejects: the first rejected draft
    assert shown[out.pq] is not None and shown[out.residual] is not None  # p vs q and where the token came from
    assert shown[out.explain] == generated[out.explain] and "Showing the first rejected draft" in shown[out.status]
    assert "speedup" in example.trace.summary  # the compare checkbox's default: a timed target-only run
    # compare unticked: not the example's run, so the page waits for its own
    assert set(speculative.on_example(shared, view, out, request, timer, "embedded", "none", False, None,
                                      view.prompt.value, True, *values(view))) == {timer}


def test_close_stops_the_startup_thread_within_a_step(built):
    """At exit the example thread is cancelled and joined (a daemon thread still inside torch when
    the interpreter finalizes aborts the process: "terminate called without an active exception")."""
    import time

    shared, views = built
    request = request_for(views["step"])
    long = examples.ExampleRequest(request.view, "A long one", request.preset,
                                   request.config.replace(max_new_tokens=1024, stop=(), min_new_tokens=1024),
                                   chat=False)
    cache = examples.ExampleCache()
    cache.want(long)
    thread = cache.start(shared, "embedded")
    assert thread is not None and cache.get(long, "embedded", "none")[0] == "pending"
    start = time.perf_counter()
    cache.close()
    assert not thread.is_alive() and time.perf_counter() - start < 10
    assert cache.get(long, "embedded", "none")[0] == "none"  # stopped: the view says "press Generate"
