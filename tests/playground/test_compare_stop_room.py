"""Issue #35, Compare's lane statuses and Stop, driven as a person drives the page: the app's own
registered Run and Stop events (tests/helpers/continue_compare.Page carries each component's value),
the embedded model, every update the page would get read back.

- every update draws each lane's status from that lane's own state: "running… k / M tokens" with
  k the tokens its text shows in the same update, "N tokens, stop: …" only once that lane ended
  (before: only the lane just updated said running; another one claimed it had finished);
- Stop at the first update, in the middle of the run and after one lane finished: the run's last
  word comes within STOP_BOUND_S of the press (Gradio's cancel, which would cut it off, waits for
  the run to end: events.settled), every unfinished lane says "stopped after k of M tokens" with k its text's tokens, a
  finished lane keeps its "done" line, the model makes no more forwards after a step, and no lane's
  thread outlives the run by more than a step;
- two pages at once: one page's Stop stops its own lanes only.
"""

from __future__ import annotations

import threading
import time

import pytest

from playground import events
from tests.helpers.compare_room import set_lanes
from tests.helpers.continue_compare import Page, run_coroutine
from tests.helpers.compare_stop_room import (DONE, RUNNING, STOPPED, assert_each_status_is_its_own, drive,  # noqa: F401
                                             drive_two_pages, lanes_shown)

pytestmark = pytest.mark.slow

PROMPT = "Write a long story about the sea."
STOP_BOUND_S = 1.5  # the press to the run's last update (the room's bound for a Stop)


@pytest.fixture(scope="module")
def demo(registry, embedded):
    from playground.app import build_app
    from playground.examples import cache_for

    app = build_app(registry)
    assert cache_for(registry).wait(300), "the startup examples did not finish"  # their runs use the model too
    return app


@pytest.fixture
def pages(monkeypatch):
    """Each page's session id, as Gradio's request would carry it: per thread (run_coroutine runs
    each page's events on a thread of its own)."""
    local = threading.local()
    monkeypatch.setattr(events, "_session", lambda: getattr(local, "session", None))
    return local


def long_lanes(page: Page, budgets: list[int]) -> None:
    """A greedy lane and a sampling lane per budget, none ending before its budget (min_new_tokens)."""
    lanes = [{"strategy": "greedy"} if i % 2 == 0 else {"strategy": "sample", "temperature": 0.8, "seed": 3}
             for i in range(len(budgets))]
    set_lanes(page, lanes, budgets[0])
    for i, budget in enumerate(budgets):
        page.set(f"cmp-lane-{i}-knob-max_new_tokens", budget)
        page.set(f"cmp-lane-{i}-more", f'{{"min_new_tokens": {budget}}}')
    page.set("cmp-prompt", PROMPT)
    page.set("cmp-chat", False)


def test_every_update_draws_each_lanes_status_from_its_own_state(demo, pages):
    page = Page(demo)
    budgets = [3, 12, 24]  # one lane ends early, one in the middle, one last
    long_lanes(page, budgets)
    seen, _, _ = drive(page, "page-A", pages)
    assert "done: 3 of 3 lanes ran" in page.shown("cmp-status"), page.shown("cmp-status")
    assert_each_status_is_its_own(seen, budgets)
    last = [shown for _, shown in (lanes[2] for lanes in seen)]
    assert last[0] == 0 and any(0 < k < 24 for k in last) and last[-1] == 24  # first, middle and last steps seen
    # while lane 3 still ran, lane 1 had finished: both drawn right in one update (the bug: lane 1
    # "running…", or a lane not just updated "N tokens, stop: stopped before the end")
    assert any(DONE.search(lanes[0][0]) and RUNNING.search(lanes[2][0]) for lanes in seen), seen


def forwards_of(model):
    count = [0]
    return count, model.register_forward_hook(lambda *_: count.__setitem__(0, count[0] + 1))


@pytest.mark.parametrize("when", ["first", "middle", "last"])
def test_stop_says_stopped_in_every_unfinished_lane_at_once(demo, pages, embedded, when):
    """``first``: Stop at the run's first update (no token yet); ``middle``: once a lane shows 6
    tokens; ``last``: once the short lane has finished, the long one running."""
    page = Page(demo)
    budgets = [4, 128] if when == "last" else [128, 128]
    long_lanes(page, budgets)
    stop_when = {"first": lambda lanes: True,
                 "middle": lambda lanes: max(k for _, k in lanes) >= 6,
                 "last": lambda lanes: DONE.search(lanes[0][0]) is not None}[when]
    forwards, hook = forwards_of(embedded.model)
    try:
        seen, pressed, ended = drive(page, "page-A", pages, stop_when)
        at_end = forwards[0]
        time.sleep(1.5)
        after = forwards[0]
    finally:
        hook.remove()
    assert pressed is not None, seen
    print(f"{when}: the run's last word {ended - pressed:.3f} s after Stop; forwards after it {after - at_end}")
    assert ended - pressed < STOP_BOUND_S, ended - pressed
    assert after - at_end <= 2, (at_end, after)  # each lane's thread stops within a step (one shared forward)
    assert not [t for t in threading.enumerate() if t.name.startswith("dp-lane-")], "a lane's thread lives on"
    final = seen[-1]
    assert_each_status_is_its_own(seen, budgets)
    for i, (status, shown) in enumerate(final):
        if when == "last" and i == 0:
            assert DONE.search(status) and shown == 4, status  # finished before the press: keeps its line
            continue
        m = STOPPED.search(status)
        assert m and int(m[2]) == shown and int(m[3]) == 128, (i, status, shown)
        assert shown < 128
    early = 1 if when == "last" else 2
    assert (f"stopped: the run was cancelled ({early} of 2 lanes stopped early; each keeps the tokens it had made)"
            in page.shown("cmp-status")), page.shown("cmp-status")
    if when != "first":  # the tokens made stay inspectable: the results of a finished run are drawn
        assert page.shown("cmp-metrics") and page.shown("cmp-entropy") is not None


def test_two_pages_at_once_a_stop_stops_only_its_own_page(demo, pages):
    a, b = Page(demo), Page(demo)
    long_lanes(a, [128, 128])
    long_lanes(b, [10, 14])
    out = drive_two_pages(a, b, pages, 4)
    seen_a, pressed, ended = out["page-A"]
    assert ended - pressed < STOP_BOUND_S and all(STOPPED.search(s) for s, _ in seen_a[-1]), seen_a[-1]
    assert "done: 2 of 2 lanes ran" in b.shown("cmp-status"), b.shown("cmp-status")
    assert_each_status_is_its_own(out["page-B"][0], [10, 14])
    assert [shown for _, shown in out["page-B"][0][-1]] == [10, 14]


def test_closing_a_run_mid_way_leaves_no_lane_thread_running(demo, pages):
    """Gradio cancelling the task (a closed tab) closes the run's generator: the lanes stop too."""
    page = Page(demo)
    long_lanes(page, [128, 128])
    dep = page.event("on_run", "cmp-status")
    args = [page.get(b) for b in dep.inputs]

    async def closed():
        pages.session = "page-C"
        agen = dep.fn(*args)
        async for row in agen:
            page.apply(dep, row)
            if max(k for _, k in lanes_shown(page, 2)) >= 2:
                break
        await agen.aclose()

    run_coroutine(closed)
    deadline = time.time() + 3
    while [t for t in threading.enumerate() if t.name.startswith("dp-lane-")] and time.time() < deadline:
        time.sleep(0.05)
    assert not [t for t in threading.enumerate() if t.name.startswith("dp-lane-")]

