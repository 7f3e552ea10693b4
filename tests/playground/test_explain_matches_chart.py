"""Issue #35, major 3: every sentence beside a step's stage chart is generated from the chart's own
numbers, for every mode and backend: a model loaded here (greedy, sampled through a chain, a
branch's forced pick), a served model in step mode and fast mode, over llama.cpp's own API and
its OpenAI-compatible one, at the first, a middle and the last step, and where the pick lies
outside the known top-N (its raw p unknown).

Both sides are parsed: the chart's figure (as the page gets it: titles, subtitles, the u label,
every bar's value written by engine.numbers.percent, the draw panel's slices) and the sentence
(every percentage, the u, the slice, each quoted token, each "most probable" claim). The oracle
is the chart: each number the sentence writes must be one the chart shows, each token it names a
bar the chart draws, and "No stage changed" only where the raw and final panels are equal. The
fast-mode step of the issue (the server sampled "␣h" at 40% while "␣cloak" led at 50%) is
rebuilt by hand, then the real llama-server's traces (marker ``remote``) are checked the same way.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import pytest

from engine.numbers import interval_places, percent
from engine.trace import StageTrace, StepTrace, TokenProb
from playground.charts import compare as compare_charts
from playground.charts import step as charts
from playground.charts.explain import Source
from tests.helpers.continue_compare import Page
from tests.helpers.remote_llamacpp import server_test
from tests.helpers.remote_openai import vllm  # noqa: F401 (a fixture: vLLM's recorded answers on loopback)

PERCENT = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?(?:e-\d+)?%)")
QUOTED = re.compile(r"“([^”]*)”")
U = re.compile(r"u = (\d[\d.e-]*)")
SLICE = re.compile(r"slice \[(\S+), (\S+)\)")
MOST_PROBABLE = re.compile(r"most probable token “([^”]*)” \((\S+%)\)")
GREEDY = re.compile(r"Greedy took the most probable token “([^”]*)” \(p = (\S+%)")


# --- the chart's side -----------------------------------------------------------------------------
def figure(fig: Any) -> dict:
    """A figure as the page receives it (plain JSON)."""
    return fig if isinstance(fig, dict) else json.loads(fig.to_json())


def texts(fig: dict) -> list[str]:
    """The chart's written texts: its title, the panel titles and the u label."""
    layout = fig["layout"]
    return [layout["title"]["text"], *(a["text"] for a in layout.get("annotations", []))]


def panels(fig: dict) -> dict[str, list[dict]]:
    """Bar traces (not the legend's swatches) by x axis: "x" is the first panel, "x2" the next."""
    out: dict[str, list[dict]] = {}
    for bar in fig["data"]:
        if bar.get("type") == "bar" and any(x is not None for x in bar.get("x") or []):
            out.setdefault(bar.get("xaxis", "x"), []).append(bar)
    return out


def bar_points(bar: dict) -> list[tuple[str, float | None, str]]:
    """(label, value, the value as its hover writes it) of each drawn bar (the gap row left out)."""
    custom = bar.get("customdata") or [[None]] * len(bar["x"])
    return [(y, x, c[-1]) for y, x, c in zip(bar["y"], bar["x"], custom) if x is not None]


def chart_numbers(fig: dict) -> set[str]:
    """Every percentage the chart shows: in its texts, and each bar's value (its hover's text,
    checked to be ``percent`` of the bar's value where the value is known)."""
    numbers = {n for t in texts(fig) for n in PERCENT.findall(t)}
    for bars in panels(fig).values():
        for bar in bars:
            for _, x, written in bar_points(bar):
                if written != "unknown":
                    assert written == percent(x), (written, x)
                    numbers.add(written)
    return numbers


def labels(fig: dict) -> list[str]:
    return [y for bars in panels(fig).values() for bar in bars for y in bar["y"] if y]


def stage_panels(fig: dict, step: StepTrace) -> list[list[tuple[str, float | None, str]]]:
    """Each stage panel's bars (its top-N and chosen token, not the removed ones), in order."""
    by_axis = panels(fig)
    axes = ["x"] + [f"x{i + 1}" for i in range(1, len(step.stages))]
    return [[p for bar in by_axis.get(axis, []) if bar.get("name") != "removed" for p in bar_points(bar)]
            for axis in axes]


# --- the check ------------------------------------------------------------------------------------
def assert_sentence_matches_chart(explain: str, fig: Any, step: StepTrace, source: Source) -> None:
    """The explanation ``explain`` writes only the numbers and tokens chart ``fig`` shows for ``step``."""
    fig = figure(fig)
    shown = chart_numbers(fig)
    written = PERCENT.findall(explain)
    assert written, explain  # every explanation names at least the chosen token's p
    assert set(written) <= shown, (set(written) - shown, explain, sorted(shown))
    drawn = labels(fig)
    for token in QUOTED.findall(explain):
        cut = charts.short_label(token).rstrip("…")
        assert any(label.startswith(cut) for label in drawn), (token, drawn)
    finals = stage_panels(fig, step)
    final, raw = finals[-1], finals[0]
    for token, p in MOST_PROBABLE.findall(explain):  # the final panel's (fast: the server's) first bar
        assert (charts.short_label(token), p) == final[0][0::2], (token, p, final[:2])
    for token, p in GREEDY.findall(explain):
        assert final[0][0].startswith(charts.short_label(token).rstrip("…")) and p == final[0][2], (token, p, final[:2])
    if "No stage changed the raw distribution" in explain:
        assert [(y, w) for y, _, w in raw] == [(y, w) for y, _, w in final], (raw, final)
    _assert_draw_matches(explain, fig, step)
    _assert_mode_words(explain, fig, step, source)


def _assert_draw_matches(explain: str, fig: dict, step: StepTrace) -> None:
    """The u the sentence names is the chart's u label; its slice is the chosen token's bar in the
    draw panel (the engine's draw_low/high against the chart's cumulative sums)."""
    us = U.findall(explain)
    if step.draw is None:
        assert not us and "slice" not in explain, explain
        return
    assert us and all(f"u = {u}" in texts(fig)[-1] for u in us), (us, texts(fig)[-1])
    (low, high), = SLICE.findall(explain)
    draw = panels(fig)[f"x{len(step.stages) + 1}"][0]
    chosen = next(i for i, y in enumerate(draw["y"]) if draw["marker"]["color"][i] == charts.ACCENT)
    start, width = draw["base"][chosen], draw["x"][chosen]
    places = interval_places(float(low), float(high))
    assert abs(float(low) - start) <= 10 ** -places and abs(float(high) - (start + width)) <= 10 ** -places, \
        (low, high, start, start + width)


def _assert_mode_words(explain: str, fig: dict, step: StepTrace, source: Source) -> None:
    """Fast mode says the server picked (sampled or took), never our greedy or our draw, and no
    panel claims a kept count beyond the top-N it knows."""
    subtitles = " ".join(texts(fig)[1:])
    if not source.fast:
        assert "The server" not in explain
        return
    assert "Greedy took" not in explain and "No stage changed" not in explain, explain
    assert ("The server sampled" if source.sampled else "The server t") in explain or "The server picked" in explain, explain
    assert not re.search(r"kept \d{1,3},\d{3} tokens", subtitles), subtitles  # "kept 49,152" when 10 are known
    if step.stages and step.stages[0].name == "raw":
        assert f"server's top {source.top_n}" in texts(fig)[1], texts(fig)[1]


def check_trace(trace: Any, at: int, explain: str, fig: Any) -> None:
    assert_sentence_matches_chart(explain, fig, trace.steps[at], charts.source_of(trace, at))


def check_every_chart(trace: Any, at: int) -> None:
    """The same step's sentence against each chart it sits beside: Step through's (wide, phone),
    Compare's inspector and the Lessons tab's (legible), the presenter's."""
    from playground.charts.presenter import step_chart

    step, source = trace.steps[at], charts.source_of(trace, at)
    explain = charts.explain_step(step, source=source)
    for fig in (charts.fitted_stage_chart(step, None, source), charts.fitted_stage_chart(step, 390, source),
                compare_charts.inspect_chart(step, source=source), step_chart(step, 1280, source)):
        assert_sentence_matches_chart(explain, fig, step, source)


def steps_to_check(trace: Any) -> list[int]:
    last = len(trace.steps) - 1
    return sorted({0, last // 2, last})


# --- the issue's step, by hand ----------------------------------------------------------------------
def tp(token_id: int, token: str, p: float) -> TokenProb:
    return TokenProb(token_id, token, p)


def issue_step() -> StepTrace:
    """Fast mode, balanced preset, token 3 of the issue: raw ␣cloak 33% > ␣h 27.9%; after the
    server's sampler ␣cloak 50% > ␣h 40%; the server sampled ␣h (p 40%)."""
    raw = StageTrace("raw", 10, 0.0, 2.0, 0.0, [tp(1, " cloak", 0.33), tp(2, " h", 0.279), tp(3, " hood", 0.1),
                                                tp(4, " coat", 0.05), tp(5, " robe", 0.04), tp(6, " c", 0.03),
                                                tp(7, " m", 0.02), tp(8, " b", 0.01), tp(9, " s", 0.008),
                                                tp(10, " t", 0.006)])
    final = StageTrace("final", 3, 0.0, 1.0, 0.0, [tp(1, " cloak", 0.5), tp(2, " h", 0.4), tp(3, " hood", 0.1)])
    return StepTrace(3, 2, " h", 0.4, 0.279, None, None, None, 1.0, 2.0, [raw, final])


def test_the_issue_s_fast_step_says_the_server_sampled_h_against_cloak():
    step, source = issue_step(), Source("fast", 10, None, True)
    explain = charts.explain_step(step, source=source)
    assert explain == ("The server's sampler sharpened the most probable token “␣cloak” from 33.0% to 50.0%; it kept "
                       "3 tokens. The server sampled “␣h” (p = 40.0% after its sampler; raw model 27.9%), not its most "
                       "probable token “␣cloak” (50.0%). It draws with its own generator, so no u is known.")
    fig = charts.fitted_stage_chart(step, None, source)
    assert_sentence_matches_chart(explain, fig, step, source)
    raw_title = figure(fig)["layout"]["annotations"][0]["text"]
    assert "server's top 10" in raw_title and "kept" not in raw_title and "tail 12.7% not drawn" in raw_title


def test_a_fast_step_outside_the_raw_top_n_says_its_raw_p_is_unknown():
    step = issue_step()
    step.stages[0].top = step.stages[0].top[:1]  # ␣h below the raw top-1: NaN, unknown
    step.raw_prob = math.nan
    source = Source("fast", 1, None, True)
    explain = charts.explain_step(step, source=source)
    assert "raw model unknown, outside its top 1" in explain and "nan" not in explain.lower()
    fig = figure(charts.fitted_stage_chart(step, None, source))
    assert_sentence_matches_chart(explain, fig, step, source)
    raw = panels(fig)["x"][0]
    assert raw["text"][-1] == charts.UNKNOWN_P and raw["customdata"][-1] == ["unknown"]  # not a 0% bar's p


def test_a_fast_step_with_only_the_raw_top_n_an_openai_server_s():
    step = issue_step()
    step.stages = step.stages[:1]
    step.chosen_prob = step.raw_prob
    for sampled in (True, False):
        source = Source("fast", 10, None, sampled)
        explain = charts.explain_step(step, source=source)
        assert explain.startswith("Only the raw model's top 10 are known here"), explain
        check = "sampled" if sampled else "picked"
        assert f"The server {check} “␣h” (p = 27.9% raw model), not its most probable token “␣cloak” (33.0%)" in explain
        assert_sentence_matches_chart(explain, charts.fitted_stage_chart(step, None, source), step, source)


# --- a model loaded here, through Step through's handlers ------------------------------------------
@pytest.fixture(scope="module")
def demo(registry, embedded):
    from playground.app import build_app

    return build_app(registry)


def run_and_check(page: Page, prompt: str, **knobs: Any) -> Any:
    """Generate with ``knobs`` (their step-knob- ids, or "strategy"), then select the first, a
    middle and the last step as a click does and check the page's sentence against its chart."""
    page.set("step-prompt", prompt)
    for name, value in {"max_new_tokens": 6, "seed": 5, **knobs}.items():
        page.set("step-strategy" if name == "strategy" else f"step-knob-{name}", value)
    page.fire("on_run", "step-text")
    assert "done" in page.shown("step-status"), page.shown("step-status")
    trace = page.session().trace()
    for at in steps_to_check(trace):
        page.set("step-index", at)
        page.fire("redraw", "step-text")
        check_trace(trace, at, page.shown("step-explain"), page.shown("step-chart"))
        check_every_chart(trace, at)
    return trace


@pytest.mark.parametrize("knobs", [
    {"strategy": "greedy"},
    {"strategy": "sample", "temperature": 0.8, "top_k": 20, "top_p": 0.9},
    {"strategy": "sample", "temperature": 5.0, "top_k": 0, "top_p": 1.0},  # a flat pick: often outside the top-N
    {"strategy": "sample", "temperature": 0.7, "min_p": 0.05, "repetition_penalty": 1.3},
])
def test_a_local_run_s_sentences_match_its_charts(demo, knobs):
    trace = run_and_check(Page(demo), "The capital of France is", **knobs)
    assert trace.extra.get("remote") is None


def test_a_branch_s_forced_pick_matches_its_chart(demo):
    from tests.helpers.continue_compare import branch

    page = Page(demo)
    run_and_check(page, "Once upon a time", strategy="sample", temperature=0.9, top_k=30)
    branch(page, 2)
    trace = page.session().trace()
    assert trace.steps[2].forced
    for at in (2, *steps_to_check(trace)):
        page.set("step-index", at)
        page.fire("redraw", "step-text")
        check_trace(trace, at, page.shown("step-explain"), page.shown("step-chart"))


def test_the_check_catches_the_issue_s_sentence():
    """The sentence the issue saw beside that chart fails the check (the checker is not blind)."""
    step, source = issue_step(), Source("fast", 10, None, True)
    fig = charts.fitted_stage_chart(step, None, source)
    seen = ("No stage changed the raw distribution. Greedy took the most probable token “␣h” (p = 40.0%; raw model "
            "27.9%).")
    with pytest.raises(AssertionError):
        assert_sentence_matches_chart(seen, fig, step, Source())  # "No stage changed" against unequal panels
    with pytest.raises(AssertionError):
        assert_sentence_matches_chart(seen.split(". ", 1)[1], fig, step, Source())  # ␣h is not the first bar
    with pytest.raises(AssertionError):
        assert_sentence_matches_chart(charts.explain_step(step, source=source).replace("50.0%", "50%"), fig, step, source)


# --- a served model ------------------------------------------------------------------------------
def test_vllm_s_answers_in_step_and_fast_mode_explain_what_their_charts_show(vllm):  # noqa: F811 (the fixture)
    """vLLM's response schema (tests/data/vllm's recordings on loopback): fast mode's steps hold
    only the raw top-N its logprobs give; step mode's our chain over its top-5."""
    from engine import runner
    from engine.runner import RunRequest
    from tests.data.vllm.record import CAPITAL, FAST, GREEDY, STEP_TOP
    from tests.helpers.remote_openai import listed

    url, _ = vllm
    model = listed(url)  # the recordings' exchanges, in their order (step mode first: it learns the pieces)
    for trace in (runner.run(RunRequest(model.with_mode("step", STEP_TOP), CAPITAL, GREEDY, chat=True)),
                  runner.run(RunRequest(model.with_mode("fast"), CAPITAL, FAST, chat=True))):
        for at in range(len(trace.steps)):
            check_every_chart(trace, at)
        assert charts.source_of(trace, 0).mode == trace.extra["remote"]["mode"]


@pytest.fixture(scope="module")
def served_both(llama_server, registry, embedded):
    """(the app, its two listed servers: llama-server's own API and its OpenAI-compatible /v1)."""
    from playground.app import build_app

    listed = [f"llamacpp:{llama_server}", f"openai:{llama_server}/v1"]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DP_REMOTE_MODELS", ",".join(listed))
        demo = build_app(registry)
    return demo, listed


def served_page(served_both, backend: int, mode: str) -> Page:
    from tests.helpers.remote_views import pick

    demo, listed = served_both
    page = Page(demo)
    pick(page, listed[backend])
    page.set("step-remote-mode", mode)
    return page


BALANCED = {"strategy": "sample", "temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}


@server_test
@pytest.mark.parametrize("mode", ["step", "fast"])
@pytest.mark.parametrize("backend", [0, 1], ids=["llamacpp", "openai"])
@pytest.mark.parametrize("knobs", [{"strategy": "greedy"}, BALANCED], ids=["greedy", "sampled"])
def test_a_served_run_s_sentences_match_its_charts(served_both, backend, mode, knobs):
    page = served_page(served_both, backend, mode)
    trace = run_and_check(page, "Name a colour of the sea.", max_new_tokens=8, **knobs)
    assert trace.extra["remote"]["mode"] == mode
    assert charts.source_of(trace, 0).sampled == (knobs["strategy"] != "greedy")


@server_test
@pytest.mark.parametrize("backend", [0, 1], ids=["llamacpp", "openai"])
def test_a_fast_pick_outside_the_known_top_n_matches_its_chart(served_both, backend):
    """Temperature 1.5 with the server's top 2: most picks fall outside the raw top-N (llama.cpp:
    their raw p unknown, said so; every step checked, not only three)."""
    page = served_page(served_both, backend, "fast")
    trace = run_and_check(page, "Name a colour of the sea.", strategy="sample", temperature=1.5, top_n=2,
                          max_new_tokens=12)
    outside = [s for s in trace.steps if all(t.token_id != s.chosen_token_id for t in s.stages[0].top)]
    assert outside, [s.chosen_token for s in trace.steps]
    for at in range(len(trace.steps)):
        check_every_chart(trace, at)
    if backend == 0:
        assert any(math.isnan(s.raw_prob) for s in outside)
        unknown = next(i for i, s in enumerate(trace.steps) if math.isnan(s.raw_prob))
        assert "raw model unknown, outside its top 2" in charts.explain_step(trace.steps[unknown],
                                                                           source=charts.source_of(trace, unknown))


@server_test
def test_compare_s_inspector_explains_a_fast_lane_from_its_chart(served_both):
    from tests.helpers.compare_room import inspect_step
    from tests.helpers.remote_views import compare_session

    demo, listed = served_both
    page = Page(demo)
    page.set("cmp-prompt", "Name a colour of the sea.")
    for i, model in enumerate((listed[0], f"fast:{listed[0]}")):
        page.set(f"cmp-lane-{i}-strategy", "sample")
        for knob, value in (("max_new_tokens", 6), ("temperature", 0.9), ("top_p", 0.95), ("seed", 4)):
            page.set(f"cmp-lane-{i}-knob-{knob}", value)
        page.set(f"cmp-lane-{i}-more", "")
        page.set(f"cmp-lane-{i}-model", model)
    page.fire("on_run", "cmp-status")
    assert "done: 2 of 2 lanes ran" in page.shown("cmp-status"), page.shown("cmp-status")
    for i, trace in enumerate(compare_session(page).traces):
        for at in steps_to_check(trace):
            inspect_step(page, f"Lane {i + 1}", at)
            check_trace(trace, at, page.shown("cmp-inspect-explain"), page.shown("cmp-inspect-chart"))
