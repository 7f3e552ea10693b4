"""Issue #52, "the presenter waits behind the room", as found: a presenter's lesson run (top-k vs top-p
vs min-p) beside a room's runs took 537 s and stopped at the 120 s limit with nothing shown. Here, in a
real browser at 1280x720, the presenter view runs that lesson while 16 simulated users (real
gradio_client sessions, each running sampling runs one after another through the same app's
/step_trace) fill every local run slot and the scheduler's rows: the lesson finishes with its chart
drawn on its first step and its check passed, and the room's runs went on and completed beside it.
The lesson is the built-in one under its own id, so this deployment has no kept result of it
(``engine/reports/lesson_results.py``) and it really runs."""

from __future__ import annotations

import json
import threading
import time

import pytest

from engine.reports.lessons import LESSONS_DIR
from playground.views.lessons import lesson_token
from tests.helpers.api import api_client
from tests.helpers.presenter_browser import wait_for_step

pytestmark = [pytest.mark.slow, pytest.mark.browser, pytest.mark.timeout(1800)]

USERS = 16  # the room: every local run slot (DP_CONCURRENCY = DP_MAX_BATCH = 16) busy
ROOM_TOKENS = 12  # each room run's length: many end and start again while the lesson runs
ROOM_LIMIT_S = 1200  # the room stops by itself after this, whatever happens to the test
PROMPT = "Tell me about the sea."


def room_lesson() -> dict:
    """The truncation lesson's JSON under another id (so nothing of it is kept yet)."""
    data = next(d for p in sorted(LESSONS_DIR.glob("*.json")) if (d := json.loads(p.read_text("utf-8")))["id"] == "truncation")
    return data | {"id": "truncation-beside-the-room", "title": "Truncation beside the room"}


@pytest.fixture
def room(live_app, registry):
    """USERS API users, each running ROOM_TOKENS-token sampling runs until the test ends; yields each
    user's finished runs (their token counts) and the failures."""
    from playground.examples import cache_for

    assert cache_for(registry).wait(600), "the startup examples did not finish"
    stop = threading.Event()
    finished: list[list[int]] = [[] for _ in range(USERS)]
    failures: list[str] = []
    deadline = time.monotonic() + ROOM_LIMIT_S

    def user(i: int) -> None:
        try:
            client = api_client(live_app)
            config = {"strategy": "sample", "seed": i, "max_new_tokens": ROOM_TOKENS, "min_new_tokens": ROOM_TOKENS}
            while not stop.is_set() and time.monotonic() < deadline:
                trace = client.predict(PROMPT, config, "", False, api_name="/step_trace")
                finished[i].append(len(trace["generated_token_ids"]))
        except Exception as exc:  # noqa: BLE001 (reported by the test)
            failures.append(f"user {i}: {exc}")

    users = [threading.Thread(target=user, args=(i,), daemon=True) for i in range(USERS)]
    for thread in users:
        thread.start()
    try:
        yield finished, failures
    finally:
        stop.set()
        for thread in users:
            thread.join(300)


def test_a_presenters_lesson_beside_16_users_finishes_checked_and_the_room_goes_on(projector_page, live_app, room):
    finished, failures = room
    deadline = time.monotonic() + 600
    while not all(finished) and not failures and time.monotonic() < deadline:  # every user's runs go through
        time.sleep(0.5)
    assert failures == [] and all(finished), (failures, [len(f) for f in finished])

    page = projector_page
    page.goto(f"{live_app}/?lesson={lesson_token(json.dumps(room_lesson()))}&present=1")
    page.wait_for_selector("#presenter:visible")
    before = sum(len(f) for f in finished)
    page.click("#present-run")  # the overlay covers the Lessons tab's own Run button
    page.wait_for_selector("#lessons-status:has-text('done'), #lessons-status .dp-error, #present-text .dp-present-failed",
                           timeout=600_000)
    status = page.locator("#lessons-status").inner_text()
    assert "done" in status and page.locator("#present-text .dp-present-failed").count() == 0, status
    outcome = page.locator("#lesson-outcome-text")
    outcome.wait_for(timeout=60_000)
    assert outcome.inner_text().startswith("✓"), outcome.inner_text()  # the lesson's check passed
    page.wait_for_selector("#present-chart .gtitle")
    wait_for_step(page, 0)  # its chart drawn, on the run's first token
    during = sum(len(f) for f in finished) - before

    assert failures == [], failures
    assert during > 0, "no room run finished while the lesson ran"  # the room was not stopped for the presenter
    assert all(n == ROOM_TOKENS for runs in finished for n in runs)  # and its runs came back whole
    print(f"room: {during} runs of {ROOM_TOKENS} tokens finished while the presenter's lesson ran")
