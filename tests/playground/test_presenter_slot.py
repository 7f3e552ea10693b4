"""Issue #52: a presenter's run must not wait for a room's run to end before it even reaches the
scheduler. The room can hold every local run slot (``DP_CONCURRENCY``); a presenter's run
(``RunControl.priority``) then takes the slot kept for it (``PRESENTER_ROWS``, as the scheduler keeps
a row), while a room's run still waits for a local one."""

from __future__ import annotations

import pytest

from engine.control import RunControl, RunStopped
from engine.scheduler import PRESENTER_ROWS
from playground.events import ModelEvents, ModelSlots, RunSlots


def test_a_presenters_run_takes_the_kept_slot_when_the_room_holds_every_local_one():
    pool = ModelSlots(local=2, served=1)
    room = [RunSlots(pool, RunControl()) for _ in range(2)]
    for slots in room:
        slots.claim(served=False)
    assert pool.in_use("local") == 2

    late = RunSlots(pool, RunControl(deadline_s=0.3))  # a room's run: waits for a local slot, up to its limit
    with pytest.raises(RunStopped):
        late.claim(served=False)

    presenter = RunSlots(pool, RunControl(deadline_s=5, priority=True))
    presenter.claim(served=False)  # at once: the kept slot
    presenter.claim(served=False)  # its next run on the same model holds the same slot
    assert pool.in_use("presenter") == PRESENTER_ROWS == 1 and pool.in_use("local") == 2
    second = RunSlots(pool, RunControl(deadline_s=0.3, priority=True))  # the kept slot is taken: it waits too
    with pytest.raises(RunStopped):
        second.claim(served=False)

    presenter.release()
    room[0].release()
    assert pool.in_use("presenter") == 0 and pool.in_use("local") == 1
    presenter = RunSlots(pool, RunControl(priority=True))
    presenter.claim(served=False)  # a free local slot first: the kept one stays free for the next presenter
    assert pool.in_use("local") == 2 and pool.in_use("presenter") == 0


def test_gradios_limit_and_threads_count_the_presenters_slot():
    events = ModelEvents(concurrency_limit=3, served_limit=2)
    assert events._queue["concurrency_limit"] == 3 + 2 + PRESENTER_ROWS
    assert events.threads == 3 + 2 + PRESENTER_ROWS + 40
