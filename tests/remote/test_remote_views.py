"""Issue #29 in the views: a served model the operator lists (DP_REMOTE_MODELS) is picked in the
model box and runs in Step through (step mode: the chart over its top-N, the tail mass and the
approximations said), Beam and Compare; every view that needs the model itself says so in one line.
Driven as a person drives the page (tests/playground/test_continue_compare.py's ``Page``: the app's registered
handlers, through the error guard), against the real llama-server of tests/conftest.py (marker
`remote`), except the policy checks, which need no server."""

from __future__ import annotations

import html
import math
import re
import threading

import pytest

from engine.strategies import served_decode
from engine.backends.local import ModelLoadError
from engine.backends.registry import ModelPolicy
from engine.backends.served import ModelPick
from engine.numbers import percent
from tests.helpers.continue_compare import Page, branch
from tests.helpers.remote_llamacpp import server_test
from tests.helpers.remote_views import DEAD, compare_session, generate, pick, remote_page, served, shown  # noqa: F401


UNLISTED = "llamacpp:http://127.0.0.1:1"


def text_of(updates: list[dict]) -> str:
    """Every string an event's updates showed, as text, joined (where a one-line message lands
    differs by view)."""
    return "\n".join(html.unescape(v) for u in updates for v in u.values() if isinstance(v, str))


# --- no server needed ------------------------------------------------------------------------------
@pytest.mark.parametrize("public", [False, True])
def test_the_policy_takes_only_the_operator_s_servers(public):
    listed, vllm = "llamacpp:http://127.0.0.1:8080", "openai:http://127.0.0.1:8000/v1#vocab=49152&eos=2"
    policy = ModelPolicy(("embedded", listed, vllm), public=public, allow_local=not public)
    assert policy.check(listed) == listed and policy.check(vllm) == vllm
    hint = "" if public else r" \(the operator lists servers in DP_REMOTE_MODELS\)"
    for typed in (UNLISTED, "openai:http://10.0.0.1:8000/v1", listed + "/", "openai:http://127.0.0.1:8000/v1",
                  vllm + "&top=20", "openai:http://127.0.0.1:8000/v1#vocab=49152"):
        with pytest.raises(ModelLoadError, match=rf"^model: '{re.escape(typed)}' is not a remote model offered here{hint}$"):
            policy.check(typed)
    for server in (listed, vllm):
        with pytest.raises(ModelLoadError, match="^draft_model: a remote model cannot be a drafter or amateur"):
            policy.check("model:" + server, "draft_model")


def test_model_policy_lists_dp_remote_models(monkeypatch):
    from engine.backends.registry import model_policy

    monkeypatch.setenv("DP_REMOTE_MODELS", "llamacpp:http://127.0.0.1:8080/, openai:http://127.0.0.1:8000/v1")
    allowed = model_policy().allowed
    assert "llamacpp:http://127.0.0.1:8080" in allowed and "openai:http://127.0.0.1:8000/v1" in allowed


@server_test
def test_the_model_box_offers_the_listed_servers_and_picks_one(served):
    demo, listed = served
    page = Page(demo)
    assert {listed, DEAD} <= {c[0] for c in page.block("dp-model").choices}
    pick(page, listed)
    assert page.shown("dp-model") == listed
    assert "a served model, step mode" in page.shown("dp-model-status")


@server_test
@pytest.mark.parametrize("typed", [UNLISTED, "openai:http://127.0.0.1:1/v1"])
def test_a_url_not_listed_is_refused_in_one_line_and_the_model_stays(served, typed):
    demo, listed = served
    page = Page(demo)
    pick(page, listed)
    pick(page, typed)
    status = shown(page, "dp-model-status")
    assert f"model: {typed!r} is not a remote model offered here" in status and "\n" not in status
    assert page.shown("dp-model") == listed  # the previous pick is back in the box
    page.set("dp-model", typed)  # a raw call with the typed value is refused by the run too
    page.fire("on_run", "step-text")
    assert "is not a remote model offered here" in shown(page, "step-status")


@server_test
def test_an_unreachable_listed_server_is_one_line_and_the_previous_model_stays(served):
    demo, _ = served
    page = Page(demo)
    pick(page, DEAD)
    status = shown(page, "dp-model-status")
    assert re.search(rf"llama\.cpp server {re.escape(DEAD[len('llamacpp:'):])}/v1/models: cannot connect .*timeout",
                     status) and "\n" not in status, status
    assert status.endswith("still using embedded</div>") and page.shown("dp-model") == "embedded"


@server_test
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_step_through_on_a_remote_model_generates_branches_and_continues(served, where):
    page = remote_page(served)
    generate(page, "Name a colour of the sea.")
    original = page.session().trace()
    remote = original.extra["remote"]
    assert remote["mode"] == "step" and len(remote["tail_mass"]) == len(original.steps)
    summary = page.shown("step-summary")
    assert "**Remote model** llamacpp:" in summary and "**Approximations:**" in summary
    assert remote["approximations"][0].split(";")[0] in summary
    verified = remote["verified"]  # step mode verifies the server's greedy continuation by default (#38)
    assert verified["steps"] == len(original.steps) and verified["requests"] < len(original.steps)
    assert (f"{verified['accepted']} of {verified['steps']} tokens were the server's own greedy continuation "
            f"({percent(verified['acceptance'])} accepted)") in summary, summary
    page.set("step-index", 2)
    page.fire("redraw", "step-text")
    tail = remote["tail_mass"][2]
    assert f"Outside the server's top 100 lay {percent(tail)} of the raw probability here (the tail)" in \
        page.shown("step-explain")
    chart = page.shown("step-chart")
    assert f"server's top 100; tail {percent(tail)} not drawn" in (chart if isinstance(chart, str) else chart.to_json())
    assert [s.name for s in original.steps[2].stages][0] == "raw" and original.steps[2].stages[-1].name == "final"
    last = len(original.steps) - 1
    k = {"first": 0, "middle": last // 2, "last": last}[where]
    token = branch(page, k)
    branched = page.session().trace()
    assert branched.branch_of == k and branched.generated_token_ids[:k + 1] == original.generated_token_ids[:k] + [token]
    assert f"branched from at step {k}" in page.shown("step-compare")
    m = min(k + 1, len(branched.steps) - 1)
    page.set("step-index", m)
    page.set("step-knob-temperature", 0.5)
    page.fire("on_continue", "step-text")
    assert "done" in page.shown("step-status"), page.shown("step-status")
    continued = page.session().trace()
    assert continued.branch_of == m and continued.generated_token_ids[:m] == branched.generated_token_ids[:m]
    assert continued.extra["remote"]["mode"] == "step"


def mode_radio_shown(page: Page) -> bool:
    """Whether the step | fast radio is visible after the model box's change event (as the page runs it)."""
    dep = next(f for f in page.demo.fns.values() if [getattr(b, "elem_id", None) for b in f.outputs] == ["step-remote-mode"])
    update = dep.fn(*[page.get(b) for b in dep.inputs])
    return bool(update.get("visible"))


@server_test
def test_the_mode_radio_is_there_only_for_a_served_model(served):
    demo, listed = served
    page = Page(demo)
    assert page.block("step-remote-mode").visible is False and not mode_radio_shown(page)
    pick(page, listed)
    assert mode_radio_shown(page)
    pick(page, "embedded")
    assert not mode_radio_shown(page)


@server_test
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_fast_mode_the_server_samples_and_a_branch_continues_in_step_mode(served, where):
    page = remote_page(served)
    generate(page, "Name a colour of the sea.", tokens=8, strategy="greedy")
    stepped = page.session().trace()
    page.set("step-remote-mode", "fast")
    generate(page, "Name a colour of the sea.", tokens=8, strategy="greedy")
    fast = page.session().trace()
    assert fast.extra["remote"]["mode"] == "fast" and stepped.extra["remote"]["mode"] == "step"
    assert fast.generated_token_ids == stepped.generated_token_ids  # greedy: both modes agree
    assert all([s.name for s in step.stages] == ["raw", "final"] for step in fast.steps)  # the server's top-N, no stages
    summary = shown(page, "step-summary")
    assert "fast mode" in summary and "the server sampled" in summary, summary
    last = len(fast.steps) - 1
    k = {"first": 0, "middle": last // 2, "last": last}[where]
    token = branch(page, k)  # from the server's text, our chain goes on (the kept tokens are the prompt)
    branched = page.session().trace()
    assert branched.branch_of == k and branched.generated_token_ids[:k + 1] == fast.generated_token_ids[:k] + [token]
    assert branched.extra["remote"]["mode"] == "step"


@server_test
def test_a_sampled_fast_run_with_unknown_raw_ps_finishes_and_downloads_strict_json(served):
    import json

    page = remote_page(served)
    page.set("step-remote-mode", "fast")
    page.set("step-knob-temperature", 1.5)  # nothing cut: most picks fall outside the raw top 2
    page.set("step-knob-top_n", 2)
    generate(page, "Name a colour of the sea.", tokens=12)
    trace = page.session().trace()
    assert any(math.isnan(s.raw_prob) for s in trace.steps)  # unknown, not 0
    assert "perplexity unknown" in shown(page, "step-summary")
    with open(page.shown("step-download")) as f:  # the download button's file: strict JSON, null for unknown
        saved = json.load(f, parse_constant=lambda name: pytest.fail(f"{name} in the download"))
    assert saved["summary"]["perplexity"] is None and saved["generated_token_ids"] == trace.generated_token_ids


@server_test
@pytest.mark.parametrize("mode", ["bogus", None, 3, "fast" * 30, "fast\ud800", "<b>fast</b>"])
def test_a_bad_mode_is_one_line_and_the_prompt_stays(served, mode):
    page = remote_page(served)
    page.set("step-prompt", "Keep this prompt.")
    page.set("step-remote-mode", mode)
    answer = text_of(page.fire("on_run", "step-text"))
    assert "remote_mode: expected step or fast, got" in answer and "Traceback" not in answer, answer
    assert page.shown("step-prompt") == "Keep this prompt."
    assert "<b>" not in page.shown("step-status")  # markup in the value is shown as text


@server_test
def test_the_step_trace_api_takes_the_mode(served):
    from tests.helpers.continue_compare import run_coroutine

    demo, listed = served
    endpoint = next(f.fn for f in demo.fns.values() if f.api_name == "step_trace")

    def call(model: str, mode: str) -> dict:
        return run_coroutine(lambda: endpoint("Name a colour of the sea.", {"max_new_tokens": 4}, "greedy", False,
                                              model, "none", mode))

    assert call(listed, "fast")["extra"]["remote"]["mode"] == "fast"
    assert call(listed, "step")["extra"]["remote"]["mode"] == "step"
    assert call(f"fast:{listed}", "step")["extra"]["remote"]["mode"] == "fast"  # Compare's pick, one encoding (#36)
    with pytest.raises(Exception, match=r"remote_mode: fast needs a served model; model 'embedded' runs here \(use step\)"):
        call("embedded", "fast")


@server_test
def test_two_pages_step_through_the_server_at_once(served):
    pages = [remote_page(served), remote_page(served)]
    prompts = ["Name a colour of the sea.", "Write the word MARKER twice."]
    errors: list[BaseException] = []

    def work(page: Page, prompt: str) -> None:
        try:
            generate(page, prompt, tokens=6, strategy="greedy")
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=pair) for pair in zip(pages, prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert [p.session().trace().prompt for p in pages] == prompts


def stage_tops(stages) -> list[list[tuple[int, float]]]:
    """Each stage's top list as (token id, p), from StageTrace objects or their JSON."""
    rows = []
    for stage in stages:
        top = stage["top"] if isinstance(stage, dict) else stage.top
        rows.append([(t["token_id"], t["prob"]) if isinstance(t, dict) else (t.token_id, t.prob) for t in top])
    return rows


def assert_same_stages(got, expected) -> None:
    got, expected = stage_tops(got), stage_tops(expected)
    assert [[t for t, _ in row] for row in got] == [[t for t, _ in row] for row in expected]
    assert all(p == pytest.approx(q, abs=1e-6) for a, b in zip(got, expected) for (_, p), (_, q) in zip(a, b))


@server_test
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_the_what_if_on_a_remote_step_is_step_mode_over_the_server_s_top_n(served, server_model, where):
    from engine.config import DecodingConfig
    from engine.trace import Trace
    from tests.helpers.continue_compare import run_coroutine

    demo, listed = served
    page = remote_page(served)
    generate(page, "Name a colour of the sea.", tokens=6)
    trace = page.session().trace()
    k = {"first": 0, "middle": len(trace.steps) // 2, "last": len(trace.steps) - 1}[where]
    endpoint = next(f.fn for f in demo.fns.values() if f.api_name == "explore_step")

    def explore(knobs: dict) -> list[dict]:
        return run_coroutine(lambda: endpoint(trace.to_dict(), k, knobs, listed, "none"))

    assert_same_stages(explore({}), trace.steps[k].stages)  # its own knobs: its own stages back
    hot = explore({"temperature": 1.6, "top_k": 20})
    # the oracle: step mode itself under those knobs, continuing after the run's first k tokens
    config = DecodingConfig.from_dict(dict(trace.config) | {"temperature": 1.6, "top_k": 20})
    expected = next(served_decode.stream_step(server_model, trace.prompt_token_ids, config,
                                       prefix=trace.generated_token_ids[:k]))
    assert_same_stages(hot, expected.stages)
    page.set("step-index", k)  # and as a person moves the knob (the fallback event: the route's same service call)
    page.set("step-knob-temperature", 1.6)
    answer = page.fire("on_knob", "step-whatif-figure")
    note = shown(page, "step-whatif-note")
    assert page.shown("step-whatif-figure") and "temperature = 1.6" in note, text_of(answer)
    tail = trace.extra["remote"]["tail_mass"][k]
    assert f"Over the server's top 100 at this step, as the run was (the tail, {percent(tail)}, left out)." in note, note
    assert Trace.from_json(trace.to_json()).generated_token_ids == trace.generated_token_ids


REFUSED = [  # (view event, its first output, the knobs to set, the line)
    ("on_run", "mcts-status", {"mcts-prompt": "Hello"}, "mcts: not available for a served model"),
    ("on_run", "medusa-status", {"medusa-prompt": "Hello"}, "medusa: not available for a served model"),
    ("on_measure", "quant-status", {"quant-prompt": "Hello"}, "quantization: not available for a served model"),
    ("on_kv", "kv-status", {"quant-prompt": "Hello"}, "KV cache: not available for a served model"),
    ("on_run", "kinds-status", {"quant-prompt": "Hello"}, "KV cache: not available for a served model"),
]


@server_test
@pytest.mark.parametrize("event,first,values,line", REFUSED, ids=[r[1] for r in REFUSED])
def test_a_view_that_needs_the_model_itself_says_so_in_one_line(served, event, first, values, line):
    page = remote_page(served)
    for elem_id, value in values.items():
        page.set(elem_id, value)
    answer = text_of(page.fire(event, first))
    assert line in answer and "AttributeError" not in answer, answer


SPEC_PROMPT = "Monday, Tuesday, Wednesday, Thursday, Friday. Monday, Tuesday,"  # drafts pass, one is rejected


def spec_generate(page: Page, drafter: str = "ngram", tokens: int = 12, temperature: float = 0.0,
                  compare: bool = True) -> list[dict]:
    page.set("spec-prompt", SPEC_PROMPT)
    page.set("spec-chat", False)
    page.set("spec-compare", compare)
    for knob, value in (("drafter", drafter), ("max_new_tokens", tokens), ("temperature", temperature),
                        ("num_draft_tokens", 4), ("seed", 5)):
        page.set(f"spec-knob-{knob}", value)
    return page.fire("on_generate", "spec-counters")


def spec_session(page: Page):
    from playground.views.speculative import SpecSession

    return next(v for v in page.values.values() if isinstance(v, SpecSession))


def pick_position(page: Page, value: str) -> dict:
    """Pick ``value`` ("round:position") in the position dropdown, as a person does."""
    page.set("spec-position", value)
    dep = next(f for f in page.demo.fns.values()
               if f.inputs and getattr(f.inputs[-1], "elem_id", None) == "spec-position")
    return page.apply(dep, dep.fn(*[page.get(b) for b in dep.inputs]))


@server_test
def test_speculative_runs_on_a_remote_target_round_by_round(served):
    page = remote_page(served)
    spec_generate(page)
    status = shown(page, "spec-status")
    assert status.count("done:") == 1 and "stopped by max_new_tokens" in status, status
    session = spec_session(page)
    trace = session.trace
    assert trace.model == served[1] and trace.extra["remote"]["mode"] == "step"
    summary = trace.summary  # greedy: the server's target alone gives the same tokens; the prompt repeats: drafts pass
    assert summary["accepted"] > 0 and summary["baseline_same_tokens"], summary
    shown_summary = shown(page, "spec-summary")
    assert "**Remote model** llamacpp:" in shown_summary and "scores the drafts by one request per position" in shown_summary
    rounds = session.rounds
    assert len(rounds) >= 3
    for index in (rounds[0].index, rounds[len(rounds) // 2].index, rounds[-1].index):  # first, middle, last round
        pick_position(page, f"{index}:0")
        explain = shown(page, "spec-explain")
        assert explain and "Traceback" not in explain, explain
        assert page.shown("spec-position") == f"{index}:0" and page.shown("spec-pq") is not None
    counters = shown(page, "spec-counters")  # the counters show the run's rate and the speed-up vs the server alone
    assert f">{percent(summary['acceptance_rate'])}<" in counters and f">{summary['speedup']:.2f}×<" in counters, counters


@server_test
def test_a_listed_server_drafts_for_the_remote_target(served, monkeypatch):
    page = remote_page(served)
    listed = served[1]
    monkeypatch.setenv("DP_REMOTE_MODELS", f"{listed},{DEAD}")
    from engine.backends import llamacpp, remote

    connects = []
    real_connect = llamacpp.connect
    monkeypatch.setattr(remote, "connect", lambda url, *a, **k: connects.append(url) or real_connect(url, *a, **k))
    for _ in range(2):  # the drafter is the app's connection to that server (the target's here): none made again
        spec_generate(page, drafter=f"model:{listed}", tokens=8, temperature=0.8, compare=False)
        assert "done:" in shown(page, "spec-status"), shown(page, "spec-status")
        drafted = [d for r in spec_session(page).rounds for d in r.drafted]
        assert drafted and all(d.accepted for d in drafted)  # the same model drafts: p = q, every draft passes
    assert connects == []


@server_test
@pytest.mark.parametrize("drafter,line", [
    ("self-int8", "drafter: 'self-int8' does not run with a remote target; use ngram or model:"),
    (f"model:{UNLISTED}", f"drafter: 'model:{UNLISTED}' does not run with a remote target"),
    ("model:../../etc/passwd", "drafter: 'model:../../etc/passwd' does not run with a remote target"),
    ("model:\ud800<b>x</b>", "drafter: "),
    ("n" * 5000, "drafter: "),
])
def test_a_drafter_the_remote_target_cannot_use_is_one_line_and_the_prompt_stays(served, drafter, line):
    page = remote_page(served)
    answer = text_of(spec_generate(page, drafter=drafter, tokens=4))
    assert line in answer and "Traceback" not in answer, answer
    assert page.shown("spec-prompt") == SPEC_PROMPT
    assert "<b>" not in page.shown("spec-status")  # markup in the value is shown as text


@server_test
def test_a_local_target_refuses_a_server_as_its_drafter(served):
    page = Page(served[0])  # the embedded model is the target
    answer = text_of(spec_generate(page, drafter=f"model:{served[1]}", tokens=4))
    assert "a remote model cannot be a drafter or amateur of a model loaded here" in answer, answer


@server_test
def test_two_pages_run_speculative_on_the_server_at_once(served):
    pages = [remote_page(served), remote_page(served)]
    errors: list[BaseException] = []

    def work(page: Page, tokens: int) -> None:
        try:
            spec_generate(page, tokens=tokens, compare=False)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(p, n)) for p, n in zip(pages, (6, 10))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert [len(spec_session(p).trace.generated_token_ids) for p in pages] == [6, 10]


@server_test
def test_the_beam_view_says_a_remote_search_s_approximations(served):
    page = remote_page(served)
    page.set("beam-prompt", "The capital of France is Paris. The capital of Italy is")
    page.set("beam-knob-max_new_tokens", 3)
    page.fire("on_run", "beam-tree")
    summary = shown(page, "beam-summary")
    assert "**Remote model** llamacpp:" in summary and "a lone EOS) can win" in summary, summary


@server_test
def test_compare_runs_a_lane_on_the_server_beside_our_engine_with_the_same_knobs(served):
    demo, listed = served
    page = Page(demo)  # the header keeps the embedded model; lane 2 picks the server
    page.set("cmp-prompt", "The capital of France is Paris. The capital of Italy is")
    for i in (0, 1):
        page.set(f"cmp-lane-{i}-strategy", "greedy")
        for knob, value in (("max_new_tokens", 6), ("temperature", 0.8), ("top_p", 0.9)):
            page.set(f"cmp-lane-{i}-knob-{knob}", value)
        page.set(f"cmp-lane-{i}-more", "")
    page.set("cmp-lane-1-model", listed)
    page.fire("on_run", "cmp-status")
    assert "done: 2 of 2 lanes ran" in shown(page, "cmp-status"), shown(page, "cmp-status")
    ours, served_lane = compare_session(page).traces
    assert ours.model != served_lane.model == listed and "remote" not in ours.extra
    assert served_lane.extra["remote"]["mode"] == "step" and ours.config == served_lane.config
    assert f"· on {listed}" in shown(page, "cmp-lane-1-status") and " on " not in shown(page, "cmp-lane-0-status")
    assert shown(page, "cmp-divergence")  # where (or whether) our engine and llama.cpp part ways
    assert ours.generated_token_ids[0] == served_lane.generated_token_ids[0]  # same GGUF: the same first pick


@server_test
def test_compare_puts_our_stages_beside_llama_cpp_s_own_sampler_on_one_server(served):
    demo, listed = served
    page = Page(demo)
    choices = [c[1] for c in page.block("cmp-lane-0-source").choices]
    assert listed in choices and not [c for c in choices if c.startswith("fast:")]  # a mode is the radio's
    page.set("cmp-prompt", "The capital of France is Paris. The capital of Italy is")
    for i in (0, 1):
        page.set(f"cmp-lane-{i}-strategy", "greedy")
        page.set(f"cmp-lane-{i}-knob-max_new_tokens", 6)
        page.set(f"cmp-lane-{i}-more", "")
    # as a person does: each lane's model box picks the server, lane 2's radio says fast
    for i, mode in ((0, "step"), (1, "fast")):
        page.set(f"cmp-lane-{i}-source", listed)
        page.set(f"cmp-lane-{i}-mode", mode)
        picked = page.fire("on_lane_pick", f"cmp-lane-{i}-model")
        assert picked == [{f"cmp-lane-{i}-model": ModelPick(listed, mode).value}]
    assert page.shown("cmp-lane-1-model") == f"fast:{listed}"
    page.set("cmp-lane-1-source", "")  # what a link would leave; the pick's change event shows the pick again
    assert page.fire("shown_pick", "cmp-lane-1-source") == [{"cmp-lane-1-source": listed, "cmp-lane-1-mode": "fast"}]
    page.fire("on_run", "cmp-status")
    assert "done: 2 of 2 lanes ran" in shown(page, "cmp-status"), shown(page, "cmp-status")
    stepped, fast = compare_session(page).traces
    assert stepped.extra["remote"]["mode"] == "step" and fast.extra["remote"]["mode"] == "fast"
    assert stepped.generated_token_ids == fast.generated_token_ids  # greedy: our argmax over its top-N is its own
    assert f"· on {listed} (fast mode: its own sampler)" in shown(page, "cmp-lane-1-status")
    assert "fast mode" not in shown(page, "cmp-lane-0-status")


@server_test
@pytest.mark.parametrize("pick", ["fast:embedded", "fast:", f"fast:{UNLISTED}", "fast:fast:x"])
def test_a_fast_pick_that_is_not_a_listed_server_is_one_line_naming_the_lane(served, pick):
    from tests.helpers.continue_compare import run_coroutine

    demo, _ = served
    endpoint = next(f.fn for f in demo.fns.values() if f.api_name == "compare")
    lanes = [{"preset": "greedy"}, {"preset": "greedy", "model": pick}]
    with pytest.raises(Exception, match=r"Lane 2: (model|fast)") as caught:
        run_coroutine(lambda: endpoint("Hello", lanes, 0, 4))
    assert "\n" not in str(caught.value) and "Traceback" not in str(caught.value)


@server_test
def test_a_compare_lane_whose_strategy_needs_the_model_says_so_and_the_other_runs(served):
    page = remote_page(served)  # the header's model is the server: both lanes run on it
    page.set("cmp-lane-0-strategy", "greedy")
    page.set("cmp-lane-0-knob-max_new_tokens", 4)
    page.set("cmp-lane-1-strategy", "contrastive_search")
    page.set("cmp-lane-1-knob-top_k", 4)
    page.set("cmp-lane-1-knob-max_new_tokens", 4)
    page.set("cmp-lane-1-more", "{\"penalty_alpha\": 0.6}")
    page.fire("on_run", "cmp-status")
    assert "done: 1 of 2 lanes ran; 1 failed" in shown(page, "cmp-status"), shown(page, "cmp-status")
    assert ("Lane 2: contrastive_search: not available for a served model (needs the model's hidden states)"
            in shown(page, "cmp-lane-1-status"))


@server_test
def test_an_unreachable_server_in_one_lane_is_one_line_naming_the_lane(served):
    page = Page(served[0])
    page.set("cmp-lane-1-model", DEAD)
    answer = text_of(page.fire("on_run", "cmp-status"))
    assert re.search(r"Lane 2: llama\.cpp server http://127\.0\.0\.1:\d+/v1/models: cannot connect", answer), answer


@server_test
def test_beam_search_runs_on_a_remote_model(served):
    page = remote_page(served)
    page.set("beam-prompt", "The capital of France is Paris. The capital of Italy is")
    page.set("beam-knob-max_new_tokens", 4)
    answer = text_of(page.fire("on_run", "beam-tree"))
    assert "not available" not in answer and "failed" not in answer, answer
    assert "done" in shown(page, "beam-status"), shown(page, "beam-status")


CHECKED_ON_THE_SERVER = ("greedy-vs-sampling", "temperature", "truncation", "penalties", "speculative")


@server_test
@pytest.mark.parametrize("lesson", [*CHECKED_ON_THE_SERVER, "kv-cache", "quantization", "beam-search",
                                    "contrastive-search"])
def test_a_lesson_runs_on_the_server_and_checks_its_claim_where_an_api_can(served, lesson):
    from engine.reports.lessons import NEEDS_MODEL, builtin_lessons

    page = remote_page(served)
    page.set("lessons-pick", lesson)
    answer = text_of(page.fire("on_run", "lessons-status"))
    status = shown(page, "lessons-status")
    assert "AttributeError" not in answer and "Traceback" not in answer, answer
    kind = (builtin_lessons()[lesson].check or {}).get("kind")
    if lesson in CHECKED_ON_THE_SERVER:  # the claim is checked on the server's runs: its outcome is shown
        outcome = shown(page, "lessons-outcome")
        assert status.endswith("done</div>") and outcome, status
        # the claims hold on the server's runs too, except the repetition penalty's: in step mode it sees
        # log-probabilities, not logits (an approximation the trace names), and greedy repeats as much
        assert ("✓" in outcome) == (lesson != "penalties"), outcome
        assert "not available" not in status
    elif kind in NEEDS_MODEL:
        assert f"done; lesson check: not available for a served model ({NEEDS_MODEL[kind]})" in status, status
    else:  # a run whose strategy needs the model: its one line
        assert "contrastive_search: not available for a served model" in status, status


@server_test
def test_the_compare_api_takes_a_model_per_lane(served):
    from tests.helpers.continue_compare import run_coroutine

    demo, listed = served
    endpoint = next(f.fn for f in demo.fns.values() if f.api_name == "compare")
    lanes = [{"preset": "greedy"}, {"preset": "greedy", "model": listed}]

    async def call() -> dict:
        return await endpoint("The capital of France is Paris. The capital of Italy is", lanes, 0, 4)

    answer = run_coroutine(call)
    ours, served_lane = (lane["trace"] for lane in answer["lanes"])
    assert ours["model"] != served_lane["model"] == listed and served_lane["extra"]["remote"]["mode"] == "step"
    with pytest.raises(Exception, match=r"Lane 2: model: 'llamacpp:http://127\.0\.0\.1:1' is not a remote model"):
        lanes[1]["model"] = UNLISTED
        run_coroutine(call)


def test_a_served_models_mode_is_one_field_of_the_model_pick():
    """#36: the remote mode is one encoding (engine.backends.served.ModelPick), read in one place:
    Compare's lane picks, a lesson's ``models`` (old files' ``fast:<role>``), and Step through's
    model box with its mode radio all name the same value; ``fast:`` links keep opening."""
    from engine.reports import lessons
    from playground.shared import UserError, shown_pick, with_mode
    from playground.views.compare.handlers import on_lane_pick
    from playground.views.compare.layout import lane_model_choices

    assert ModelPick.parse(f"fast:{UNLISTED}") == ModelPick(UNLISTED, "fast")
    assert ModelPick.parse(UNLISTED) == ModelPick(UNLISTED, "step") and ModelPick.parse("embedded").mode == "step"
    for value in (UNLISTED, f"fast:{UNLISTED}", "embedded", ""):
        assert ModelPick.parse(value).value == value
    with pytest.raises(ValueError, match=r"^mode: expected step or fast, got 'slow'$"):
        ModelPick(UNLISTED, "slow")
    # A Compare lane's model box lists models only; its mode radio (Step through's, the same helper)
    # makes the same value as Step through's model box and radio
    picks = {value for _, value in lane_model_choices(["embedded", UNLISTED])}
    assert picks == {"", "embedded", UNLISTED}
    assert with_mode(UNLISTED, "fast") == on_lane_pick(UNLISTED, "fast") == f"fast:{UNLISTED}"
    assert with_mode(UNLISTED, "step") == on_lane_pick(UNLISTED, "step") == UNLISTED
    assert on_lane_pick("", "fast") == "" and on_lane_pick("embedded", "fast") == "embedded"
    assert with_mode(f"fast:{UNLISTED}", "step") == f"fast:{UNLISTED}"  # an API call's own pick stays
    assert with_mode("embedded", "fast") == "embedded"  # the page hides the radio for a model loaded here
    with pytest.raises(UserError, match=r"^remote_mode: fast needs a served model; model 'embedded' runs here"):
        with_mode("embedded", "fast", api=True)
    with pytest.raises(UserError, match=r"^remote_mode: expected step or fast, got 'fast\\ud800'$"):
        with_mode(UNLISTED, "fast\ud800")
    # hostile modes (a raw call past the radio's choices): one line naming remote_mode, bounded, never a pick
    for mode in (None, 5, "<b>fast</b>", "fast\ud800", "x" * 5000, ["fast"]):
        with pytest.raises(UserError, match=r"^remote_mode: expected step or fast, got ") as info:
            on_lane_pick(UNLISTED, mode)
        assert "\n" not in str(info.value) and len(str(info.value)) < 120, str(info.value)
    # a pick set by a link, a lesson or a moved lane shows in the box and the radio (shown for a server only)
    for value, box, mode, radio in ((f"fast:{UNLISTED}", UNLISTED, "fast", True), (UNLISTED, UNLISTED, "step", True),
                                    ("embedded", "embedded", "step", False), ("", "", "step", False)):
        shown, update = shown_pick(value)
        assert (shown, update["value"], update["visible"]) == (box, mode, radio), value
    # a served lesson's file still says fast:<role>: its runs' sources are the same picks
    lesson = lessons.served_lessons()["three-engines"]
    vllm = "openai:http://127.0.0.1:2/v1#vocab=49152&eos=2"
    sources = lessons.run_sources(lesson, "embedded", {"DP_REMOTE_MODELS": f"{vllm},{UNLISTED}"})
    assert [ModelPick.parse(s) for s in sources] == [ModelPick("embedded"), ModelPick(vllm), ModelPick(UNLISTED),
                                                     ModelPick("embedded"), ModelPick(vllm, "fast"),
                                                     ModelPick(UNLISTED, "fast")]
