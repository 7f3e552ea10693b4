"""Issue #35, Compare with lanes on a served model (the real llama-server of tests/conftest.py, one
slot), driven through the app's own registered Run and Stop events as a person drives the page:

- Stop with an embedded lane, a step-mode lane and a fast-mode lane of 256 tokens, at the first
  update, mid-run and after the fast lane finished: the run's last word within STOP_BOUND_S of the
  press, every unfinished lane "stopped after k of 256 tokens", the server's slot free again within
  SERVER_FREE_S (the fast lane's stream is closed, the step lane sends no more requests), no lane
  thread left; two pages at once, one stopping;
- greedy in step mode and in fast mode on a one-slot server give the same tokens, and the page
  says nothing; where they part, the page names the step (tests/browser/test_compare_view.py, hand-made);
- the Beam view's winner and greedy on the server count generated tokens only.
"""

from __future__ import annotations

import re
import threading
import time

import pytest

from engine.reports.metrics import first_divergence
from playground import events
from playground.charts.step import readable
from tests.helpers.compare_stop_room import DONE, STOPPED, assert_each_status_is_its_own, drive, drive_two_pages
from tests.helpers.continue_compare import Page
from tests.helpers.remote_llamacpp import server_test
from tests.helpers.remote_stream import busy

STOP_BOUND_S = 1.5  # the press to the run's last update (the handler test of local lanes: 0.001-0.31 s)
SERVER_FREE_S = 3.0  # the press to the server's slot idle again (test_remote_stream: the stream's own close)
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8,"
TRIES = 8  # the four-slot server parts greedy step and fast lanes on this prompt in most tries, not all  # greedy counts on: no EOS for hundreds of tokens


@pytest.fixture(scope="module")
def four_slots(llama_server_binary):
    """A second real llama-server in llama-server's own default configuration (-np -1: "auto", 4
    slots in one unified KV cache), the room's; yields its URL."""
    from tests.helpers.common import serve_llama

    with serve_llama(llama_server_binary, "-np", "-1", log_name="llama-server-4-slots.log") as url:
        yield url


@pytest.fixture(scope="module")
def served(llama_server, four_slots, registry, embedded):
    """(the app with DP_REMOTE_MODELS listing both real servers, the one-slot server's model-box
    value, its URL, the four-slot server's model-box value)."""
    from playground.app import build_app
    from playground.examples import cache_for

    listed, four = f"llamacpp:{llama_server}", f"llamacpp:{four_slots}"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DP_REMOTE_MODELS", f"{listed},{four}")
        demo = build_app(registry)
    assert cache_for(registry).wait(300), "the startup examples did not finish"
    return demo, listed, llama_server, four


@pytest.fixture
def pages(monkeypatch):
    local = threading.local()
    monkeypatch.setattr(events, "_session", lambda: getattr(local, "session", None))
    return local


def served_lanes(page: Page, picks: list[str], tokens: int, prompt: str = COUNTING, floor: bool = True) -> None:
    """Greedy lanes of ``tokens`` tokens, each on its model pick ("" = the header's, the embedded model);
    ``floor``: min_new_tokens = ``tokens`` where our chain runs (fast mode: the server has no such knob)."""
    page.values[page.event("on_run", "cmp-status").inputs[4]._id] = len(picks)
    for i, pick in enumerate(picks):
        page.set(f"cmp-lane-{i}-strategy", "greedy")
        page.set(f"cmp-lane-{i}-model", pick)
        page.set(f"cmp-lane-{i}-more", f'{{"min_new_tokens": {tokens}}}' if floor and not pick.startswith("fast:") else "")
        for name, value in {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 0,
                            "max_new_tokens": tokens}.items():
            page.set(f"cmp-lane-{i}-knob-{name}", value)
    page.set("cmp-prompt", prompt)
    page.set("cmp-chat", False)


def wait_idle(url: str, within_s: float) -> float:
    """Seconds until the server's slot is idle (fails after ``within_s``)."""
    start = time.perf_counter()
    while busy(url):
        assert time.perf_counter() - start < within_s, f"the server still works {within_s} s after Stop"
        time.sleep(0.05)
    return time.perf_counter() - start


def lane_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("dp-lane-")]


@server_test
@pytest.mark.parametrize("when", ["first", "middle", "last"])
def test_stop_ends_embedded_step_and_fast_lanes_at_once_and_frees_the_server(served, pages, when):
    demo, listed, url, _ = served
    page = Page(demo)
    served_lanes(page, ["", listed, f"fast:{listed}"], 256)
    stop_when = {"first": lambda lanes: True,
                 "middle": lambda lanes: max(k for _, k in lanes) >= 8,
                 "last": lambda lanes: DONE.search(lanes[2][0]) is not None}[when]
    seen, pressed, ended = drive(page, f"page-{when}", pages, stop_when)
    assert pressed is not None, seen[-1]
    idle = wait_idle(url, SERVER_FREE_S)
    print(f"{when}: the run's last word {ended - pressed:.3f} s after Stop, the server idle {idle:.2f} s after it")
    assert ended - pressed < STOP_BOUND_S, ended - pressed
    deadline = time.time() + SERVER_FREE_S
    while lane_threads() and time.time() < deadline:
        time.sleep(0.05)
    assert not lane_threads(), "a lane's thread lives on"
    budgets = [256, 256, 256]
    assert_each_status_is_its_own(seen, budgets)
    for i, (status, shown) in enumerate(seen[-1]):
        if when == "last" and i == 2:
            assert DONE.search(status) and shown == 256, status  # the fast lane had finished: it keeps its line
            continue
        m = STOPPED.search(status)
        assert m and int(m[2]) == shown < 256, (i, status, shown)
    on = [page.shown(f"cmp-lane-{i}-status") for i in (1, 2)]
    assert f"· on {listed}</div>" in on[0] and f"· on {listed} (fast mode: its own sampler)" in on[1], on


@server_test
def test_two_pages_on_the_server_at_once_a_stop_stops_only_its_own(served, pages):
    demo, listed, url, _ = served
    a, b = Page(demo), Page(demo)
    served_lanes(a, [listed, f"fast:{listed}"], 256)
    served_lanes(b, [listed, ""], 12, "The capital of France is Paris. The capital of Italy is")
    out = drive_two_pages(a, b, pages, 6)
    seen_a, pressed, ended = out["page-A"]
    assert ended - pressed < STOP_BOUND_S, ended - pressed
    assert all(STOPPED.search(s) for s, _ in seen_a[-1]) or DONE.search(seen_a[-1][1][0]), seen_a[-1]
    assert "done: 2 of 2 lanes ran" in b.shown("cmp-status"), b.shown("cmp-status")
    assert_each_status_is_its_own(out["page-B"][0], [12, 12])
    wait_idle(url, SERVER_FREE_S)


def compare_session(page: Page):
    from playground.views.compare.lanes import CompareSession

    return next(v for v in page.values.values() if isinstance(v, CompareSession))


@server_test
def test_greedy_step_and_fast_lanes_on_a_one_slot_server_agree_and_the_page_says_nothing(served, pages):
    """The tests' server has one slot (conftest: -np 1, as `make remote` starts it): the two modes'
    greedy tokens are the same (the room's 4-slot server gave "Thorin" vs "Thorold" at step 9)."""
    demo, listed, _, _ = served
    page = Page(demo)
    prompt = "Once upon a time, in a small village by the sea, there lived a dwarf named"
    served_lanes(page, [listed, f"fast:{listed}"], 32, prompt, floor=False)
    drive(page, "page-agree", pages)
    assert "done: 2 of 2 lanes ran" in page.shown("cmp-status"), page.shown("cmp-status")
    stepped, fast = compare_session(page).traces
    assert stepped.generated_token_ids == fast.generated_token_ids
    assert "part ways" not in page.shown("cmp-divergence"), page.shown("cmp-divergence")
    assert page.shown("cmp-divergence").startswith("All 2 lanes produced the same 32 tokens")


@server_test
def test_on_a_four_slot_server_the_page_names_the_step_where_step_and_fast_part(served, pages):
    """The room's server (4 slots, one KV cache): greedy step and fast lanes run at once part ways
    on this prompt (measured while fixing #35: at step 2 or 19 in 3 of 3 tries; 7 of 15 pairs over
    5 prompts; 0 of 20 with -np 1), and the divergence line says where, both picks and why; a try
    where they agree says nothing."""
    demo, _, _, four = served
    page = Page(demo)
    prompt = "Once upon a time, in a small village by the sea, there lived a dwarf named"
    for attempt in range(TRIES):
        served_lanes(page, [four, f"fast:{four}", f"fast:{four}"], 24, prompt, floor=False)
        # a third lane keeps another slot busy all along, as a room's other users do (its knobs differ:
        # the page makes no claim about it)
        page.set("cmp-lane-2-strategy", "sample")
        page.set("cmp-lane-2-knob-max_new_tokens", 64)
        drive(page, f"page-four-{attempt}", pages)
        assert "done: 3 of 3 lanes ran" in page.shown("cmp-status"), page.shown("cmp-status")
        stepped, fast, _ = compare_session(page).traces
        at = first_divergence([stepped.generated_token_ids, fast.generated_token_ids])
        note = page.shown("cmp-divergence")
        if at is None:
            assert "part ways" not in note, note
            continue
        print(f"try {attempt}: parted at step {at}: {note}")
        assert f"**Lane 1 (step mode) and Lane 2 (fast mode) part ways at step {at}**" in note, note
        assert note.count("part ways") == 1, note  # the sampling lane is no greedy pair
        assert (f"step mode took `{readable(stepped.steps[at].chosen_token)}`, fast mode "
                f"`{readable(fast.steps[at].chosen_token)}`") in note, note
        assert "`-np 1`" in note
        return
    pytest.fail(f"greedy step and fast lanes never parted on the four-slot server in {TRIES} tries")


@server_test
def test_the_beam_view_on_the_server_counts_generated_tokens_like_greedy(served):
    """One beam is greedy: the winner and greedy both say their generated tokens (the prompt's are
    not counted), greedy "is hypothesis #1", and greedy's score is the hypothesis' over the same
    length, prompt included (up to the tail mass step mode renormalises away)."""
    demo, listed, _, _ = served
    page = Page(demo)
    page.set("dp-model", listed)
    page.fire("on_model", "dp-model")
    page.set("beam-prompt", "The capital of France is Paris. The capital of Italy is")
    page.set("beam-knob-num_beams", 1)
    page.set("beam-knob-num_return_sequences", 1)
    page.set("beam-knob-max_new_tokens", 10)
    page.fire("on_run", "beam-tree")
    assert "done" in page.shown("beam-status"), page.shown("beam-status")
    winner, greedy = page.shown("beam-winner"), page.shown("beam-greedy")
    tokens = int(re.search(r"\((\d+) tokens, score", winner)[1])
    assert tokens == int(re.search(r"\*\*Greedy\*\* \((\d+) tokens", greedy)[1]) <= 10, (winner, greedy)
    assert "it is hypothesis #1" in greedy, greedy
    hypothesis = float(re.search(r"score (-?[\d.]+)\)", winner)[1])
    scored = float(re.search(r"score (-?[\d.]+) at length penalty", greedy)[1])
    assert scored == pytest.approx(hypothesis, rel=0.05), (winner, greedy)  # over its 10 alone: ~2x apart
    assert [row[3] for row in page.shown("beam-hypotheses")] == [tokens]

