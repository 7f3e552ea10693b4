"""Inside the model's endpoints and charts (issue #54), on the tiny model: each endpoint's JSON is
strict and carries the sentence the view shows, the same numbers the chart draws; bad input is one
line naming the argument; the view's handlers run end to end and Stop's control stops them."""

import json
import re

import gradio as gr
import pytest

from engine.config import ConfigError
from engine.control import RunControl, RunStopped
from engine.reports import ranks
from engine.trace import dumps_strict, from_dict
from playground.charts import inside as charts
from playground.shared import UserError
from playground.views import inside

from tests.helpers.common import shared_over

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def shared(tiny_lm):
    with gr.Blocks():
        yield shared_over(tiny_lm)


@pytest.fixture(scope="module")
def trace(shared, tiny_lm):
    config = {"strategy": "sample", "seed": 1, "max_new_tokens": 12, "watermark_delta": 4.0}
    from playground.views.step import step_trace

    return step_trace(shared, PROMPT, config, control=RunControl())


def strict(data: dict) -> dict:
    return json.loads(dumps_strict(data))


def test_logit_lens_endpoint(shared, trace, tiny_lm):
    data = strict(inside.logit_lens_api(shared, trace, 4, top_k=3, control=RunControl()))
    assert len(data["layers"]) == tiny_lm.model.config.num_hidden_layers + 1
    assert data["last_matches_logits"] and data["raw_max_diff"] < 1e-5
    assert data["chosen_token_id"] == trace["generated_token_ids"][4] and data["sentence"].startswith("Step 4:")
    fig = charts.lens_figure(inside.lens.trace_lens(tiny_lm, inside.untrusted_trace(trace), 4, 3))
    heat = fig.data[0]
    assert [list(row) for row in heat.z] == [[t["prob"] for t in layer["top"]] for layer in data["layers"]]
    with pytest.raises(ConfigError, match=r"^step: expected a step number in \[0, 11\], got 99$"):
        inside.logit_lens_api(shared, trace, 99, control=RunControl())
    with pytest.raises(UserError, match="^trace: "):
        inside.logit_lens_api(shared, {"steps": "x"}, 0, control=RunControl())


def test_token_ranks_endpoint(shared, trace):
    data = strict(inside.token_ranks_api(shared, " the sea was calm", context=PROMPT, control=RunControl()))
    assert all(t["rank"] >= 1 for t in data["tokens"]) and sum(data["histogram"].values()) == len(data["tokens"])
    found = ranks.TokenRanks(**{k: v for k, v in data.items() if k in ("model", "context_tokens")},
                             histogram=data["histogram"])
    fig = charts.rank_histogram([("text", found)])
    assert list(fig.data[0].y) == [found.share(b) for b in ranks.BUCKET_NAMES]
    with pytest.raises(UserError, match=r"^text: 9,000 characters is over the 8,000-character limit$"):
        inside.token_ranks_api(shared, "x" * 9000, control=RunControl())
    with pytest.raises(ConfigError, match=r"^text: [0-9,]+ tokens is over the 512-token limit$"):
        inside.token_ranks_api(shared, "a b " * 600, control=RunControl())


def test_watermark_endpoints(shared, trace):
    marked = strict(inside.watermark_detect_api(shared, trace["text"], control=RunControl()))
    plain = strict(inside.watermark_detect_api(shared, "The cat sat on the mat and looked at the dog for a while.",
                                               control=RunControl()))
    assert marked["z"] > plain["z"] and "green" in marked["sentence"]
    assert len(marked["tokens"]) == len(marked["z_series"]) + 1  # lefthash: the first token is not scored
    with pytest.raises(ConfigError, match=r"^watermark_gamma: 1\.0 is out of range"):
        inside.watermark_detect_api(shared, "text", watermark_gamma=1.0, control=RunControl())
    with pytest.raises(ConfigError, match="^z_threshold: "):
        inside.watermark_detect_api(shared, "text", z_threshold=0.0, control=RunControl())
    report = strict(inside.watermark_robustness_api(shared, PROMPT, {"max_new_tokens": 8, "watermark_delta": 4.0},
                                                    edited_text="Once upon a time a dog.", control=RunControl()))
    assert report["rows"][0]["case"] == "as configured" and "sentence" in report
    rebuilt = from_dict(inside.wm.Robustness, {k: v for k, v in report.items() if k != "sentence"})
    assert [r[0] for r in charts.robustness_rows(rebuilt)] == [r["case"] for r in report["rows"]]
    assert rebuilt.sentence() == report["sentence"]  # the words are read from the rows the table shows


def test_calibration_and_hesitation_endpoints(shared, trace):
    data = strict(inside.calibration_report_api(shared, bins=5, control=RunControl()))
    assert len(data["at_one"]["bins"]) == 5 and data["tokens"] > 100 and "ECE" in data["sentence"]
    with pytest.raises(ConfigError, match=r"^bins: expected an integer in \[2, 50\], got 1$"):
        inside.calibration_report_api(shared, bins=1, control=RunControl())
    steps = strict(inside.hesitation_steps(trace, entropy_threshold=0.0, varentropy_threshold=0.0))
    assert steps["hesitations"] == list(range(len(trace["steps"])))
    assert [s["varentropy"] for s in steps["steps"]] == [s["raw_varentropy"] for s in trace["steps"]]


def test_a_served_model_gets_one_line(shared):
    from types import SimpleNamespace
    from engine.base.seam import served_capabilities

    served = SimpleNamespace(capabilities=served_capabilities(100))
    with pytest.raises(ConfigError, match="^model: logit lens: not available for a served model"):
        inside.lens.require_lens(served)


def test_the_view_handlers_run_and_stop(shared, tiny_lm):
    """Generate, then every section's handler, as the page calls them; a cancelled control stops a run."""
    with gr.Blocks():
        view = inside.build_tab(shared)
    handlers = view.handlers
    values = [c.value for c in view.panel.inputs]
    updates = list(handlers.on_generate(PROMPT, False, "embedded", "none", inside.COLOUR_BY[0], *values,
                                        control=RunControl()))
    run = updates[-1][handlers.out.state]
    assert run.ranks is not None and len(updates[-1][handlers.out.text]) == len(run.trace.steps)
    lens_updates = list(handlers.on_lens(run, 2, "embedded", "none", control=RunControl()))
    assert lens_updates[-1][handlers.sections.lens_note].startswith("Step 2:")
    rank_updates = list(handlers.on_ranks(run, "The salt road ran inland.", "embedded", "none", control=RunControl()))
    assert len(rank_updates[-1][handlers.sections.rank_chart].data) == 2  # the run's text and the person's
    detect = list(handlers.on_detect(run, "", 4.0, "embedded", "none", *values, control=RunControl()))
    assert "scored tokens" in detect[-1][handlers.sections.detect_note]
    cancelled = RunControl()
    cancelled.cancel()
    with pytest.raises(RunStopped):
        list(handlers.on_calibration(5, "embedded", "none", control=cancelled))
    with pytest.raises(UserError, match="^generate a run first$"):
        list(handlers.on_lens(None, 0, "embedded", "none", control=RunControl()))



def test_step_through_draws_varentropy_and_marks_hesitations(trace):
    """The Step view's run chart: the final varentropy beside entropy and surprisal, and a star on
    each hesitation step (raw H and V above their thresholds), which its dropdown lists."""
    from engine.trace import Trace
    from playground.charts import step as step_charts
    from playground.views.step import hesitation_choices

    run = Trace.from_dict(trace)
    for s in run.steps:  # every other step made to hesitate (the random model's own hesitate everywhere)
        s.raw_entropy, s.raw_varentropy = (4.0, 7.0) if s.index % 2 == 0 else (4.0, 1.0)
    fig = step_charts.run_chart(run.steps, selected=0)
    names = [t.name for t in fig.data]
    varentropy = fig.data[names.index("varentropy (nats²)")]
    assert list(varentropy.y) == [s.varentropy for s in run.steps]
    stars = next(t for t in fig.data if (t.name or "").startswith("hesitation"))
    assert list(stars.x) == step_charts.hesitation_steps(run.steps) == list(range(0, len(run.steps), 2))
    assert [i for _, i in hesitation_choices(run)] == list(stars.x)


def test_a_quantized_pick_is_calibrated_beside_fp32(shared):
    """The header's quantization other than none: fp32 and that variant, each line from its own report
    (the test's registry hands the tiny model for both, so both are named fp32)."""
    with gr.Blocks():
        view = inside.build_tab(shared)
    updates = list(view.handlers.on_calibration(5.0, "embedded", "int8", control=RunControl()))
    fig, note = updates[-1][view.handlers.sections.calibration_chart], updates[-1][view.handlers.sections.calibration_note]
    assert note.count("**fp32**:") == 2 and note.count("At T = 1") == 2
    curves = [t for t in fig.data if re.search(r", T = 1(\.00)? \(", t.name or "")]  # each variant's T = 1
    assert len(curves) == 2 and list(curves[0].y) == list(curves[1].y)  # the same model twice: the same bins


def test_a_clicked_or_picked_step_opens_its_stage_chart(shared):
    """Point 5: the step a click on the entropy chart writes into the hidden pick box (or a pick in the
    hesitation steps) draws that step's stage chart, laid out for the page width the script wrote, its
    panels the step's own stages; the lens's step follows; a step the run lacks changes nothing."""
    from playground.charts import step as step_charts

    with gr.Blocks():
        view = inside.build_tab(shared)
    h, out = view.handlers, view.handlers.out
    values = [c.value for c in view.panel.inputs]
    run = list(h.on_generate(PROMPT, False, "embedded", "none", inside.COLOUR_BY[0], *values,
                             control=RunControl()))[-1][out.state]
    at = len(run.trace.steps) // 2
    step = run.trace.steps[at]
    for width, phone in ((390.0, True), (1280.0, False)):
        drawn = inside.picked_step(out, run, float(at), width)
        fig = drawn[out.stage_chart]
        assert fig.layout.title.text.startswith(f"step {at}: chose ") and fig.layout.meta["phone"] is phone
        expected = step_charts.fitted_stage_chart(step, width, step_charts.source_of(run.trace, at))
        assert fig.to_plotly_json() == expected.to_plotly_json()
        assert drawn[out.lens_step] == at and drawn[out.stage_note].startswith(f"**Step {at}**")
    for bad in (None, len(run.trace.steps), -1, 1.5, True):
        assert set(inside.picked_step(out, run, bad, 1280.0)) == {out.stage_chart}  # gr.skip(): nothing drawn
    assert set(inside.picked_step(out, None, 0, 1280.0)) == {out.stage_chart}


def test_a_variant_whose_checkpoint_is_not_made_says_so_in_one_line(tiny_lm, monkeypatch):
    """Calibration beside fp32 with a 4-bit checkpoint not made yet: its one line (make quantize),
    before fp32's forward is spent on a diagram that cannot be drawn."""
    from engine.backends.local import ModelLoadError
    from engine.backends.quant_methods import missing_message

    with gr.Blocks():
        shared = shared_over(tiny_lm)
        view = inside.build_tab(shared)
    real_get = shared.registry.get

    def get(spec, progress=None, *, key="model"):
        if spec.quantization != "none":
            raise ModelLoadError(missing_message(spec.quantization))
        return real_get(spec, progress, key=key)

    monkeypatch.setattr(shared.registry, "get", get)
    measured = []
    monkeypatch.setattr(inside.calibration, "calibration_report", lambda lm, **kw: measured.append(lm))
    with pytest.raises(UserError) as err:
        list(view.handlers.on_calibration(5, "embedded", "gptq-g64", control=RunControl()))
    assert str(err.value) == missing_message("gptq-g64") and "\n" not in str(err.value) and measured == []


LONG = " ".join(["the salt road ran inland past the old mill"] * 12)  # > 64 tokens: the detector checks Stop


@pytest.mark.parametrize("endpoint", ["logit_lens", "token_ranks", "watermark_detect", "watermark_robustness",
                                      "calibration_report"])
def test_stop_stops_every_model_endpoint(shared, trace, endpoint):
    """Stop (a cancelled control, as the page's Stop and a closed API stream leave it) stops each
    endpoint that runs the model, before it answers."""
    calls = {
        "logit_lens": lambda c: inside.logit_lens_api(shared, trace, 4, control=c),
        "token_ranks": lambda c: inside.token_ranks_api(shared, LONG, control=c),
        "watermark_detect": lambda c: inside.watermark_detect_api(shared, LONG, control=c),
        "watermark_robustness": lambda c: inside.watermark_robustness_api(
            shared, PROMPT, {"max_new_tokens": 8, "watermark_delta": 4.0}, control=c),
        "calibration_report": lambda c: inside.calibration_report_api(shared, control=c),
    }
    control = RunControl()
    control.cancel()
    with pytest.raises(RunStopped):
        calls[endpoint](control)


BAD_INPUT = [  # (endpoint, its arguments, the argument the one line names, the value it says)
    ("logit_lens", dict(step=-1), "step", "-1"),
    ("logit_lens", dict(step=2, top_k=0), "top_k", "0"),
    ("token_ranks", dict(text="ok", context="x" * 9000), "context", "9,000"),
    ("watermark_detect", dict(text="x" * 9000), "text", "9,000"),
    ("watermark_detect", dict(text="some text", watermark_gamma=0.0), "watermark_gamma", "0.0"),
    ("watermark_detect", dict(text="some text", watermark_gamma=-0.5), "watermark_gamma", "-0.5"),
    ("watermark_detect", dict(text="some text", watermark_gamma=1.5), "watermark_gamma", "1.5"),
    ("watermark_detect", dict(text="some text", watermark_seeding="nohash"), "watermark_seeding", "nohash"),
    ("watermark_robustness", dict(prompt=PROMPT, config={"watermark_delta": 2.0, "watermark_gamma": 1.0}),
     "watermark_gamma", "1.0"),
    ("watermark_robustness", dict(prompt=PROMPT, config={"watermark_delta": 2.0}, edited_text="x" * 9000),
     "edited_text", "9,000"),
    ("calibration_report", dict(bins=51), "bins", "51"),
    ("hesitation_steps", dict(entropy_threshold=-1.0), "entropy_threshold", "-1"),
]


@pytest.mark.parametrize("endpoint, kwargs, key, value", BAD_INPUT,
                         ids=[f"{e}-{k}-{v[:8]}" for e, _, k, v in BAD_INPUT])
def test_bad_input_is_one_line_naming_the_argument_and_its_value(shared, trace, endpoint, kwargs, key, value):
    """A text too long, a step or top-k out of range, γ outside (0, 1): one line naming the argument
    and what it was given, from each endpoint, before any model runs."""
    if endpoint == "logit_lens":
        call = lambda: inside.logit_lens_api(shared, trace, control=RunControl(), **kwargs)  # noqa: E731
    elif endpoint == "hesitation_steps":
        call = lambda: inside.hesitation_steps(trace, **kwargs)  # noqa: E731
    else:
        call = lambda: getattr(inside, f"{endpoint}_api")(shared, control=RunControl(), **kwargs)  # noqa: E731
    with pytest.raises((ConfigError, UserError)) as err:
        call()
    message = str(err.value)
    assert message.startswith(f"{key}: ") and value in message and "\n" not in message, message
