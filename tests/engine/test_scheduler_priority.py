"""Issue #52: with the room's runs on the machine a presenter's lesson run waited behind them (537 s,
stopped at the 120 s limit). A run whose control says ``priority`` (a presenter's: the Lessons tab's
presenter view is on) jumps the scheduler's queue and takes the row the scheduler keeps for it: with
every room row busy and room runs waiting, it gets its row at the next tick, the room never takes
that row, and its tokens equal the same run alone. bench/presenter_priority.py times it beside 16 users."""

from __future__ import annotations

import threading
import time

import pytest

from engine.config import DecodingConfig
from engine.control import RunControl, RunStopped
from engine.scheduler import PRESENTER_ROWS, Scheduler
from engine.strategies import decode

ROOM, ROWS = 6, 3  # six room runs on three rows: one kept for a presenter, so two run and four wait


def room_run(scheduler: Scheduler, ids, seed: int, control: RunControl, steps: list) -> None:
    config = DecodingConfig(strategy="sample", seed=seed, max_new_tokens=1024, min_new_tokens=1024)
    try:
        for step in scheduler.stream(ids, config, control=control):
            steps.append(step)
    except RunStopped:
        pass


class TickLog(Scheduler):
    """Records, in the worker's thread, the tick during which each presenter's token was made
    (``_ticks`` counts the ticks done; the current tick's ``_step`` runs before it is counted). Read
    by the consumer after each token, the counter would also count the ticks made while the consumer
    waited for the interpreter lock: a presenter-only tick on the tiny model takes well under the
    lock's 5 ms switch interval, so several could pass."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.presenter_ticks: list[int] = []

    def _step(self, runs, logits) -> None:
        made = sum(1 for run in runs if run.control is not None and run.control.priority and run.parked is None)
        self.presenter_ticks += [self._ticks] * made
        super()._step(runs, logits)


def wait_until(predicate, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_priority_run_takes_the_kept_row_at_once_beside_a_full_room(tiny_lm):
    scheduler = TickLog(tiny_lm, max_batch=ROWS, max_queue=16, presenter_rows=PRESENTER_ROWS)
    ids = tiny_lm.encode("The room writes a long story about")
    controls, steps = [RunControl() for _ in range(ROOM)], [[] for _ in range(ROOM)]
    threads = [threading.Thread(target=room_run, args=(scheduler, ids, i, controls[i], steps[i]), daemon=True)
               for i in range(ROOM)]
    try:
        for t in threads:
            t.start()
        wait_until(lambda: scheduler.stats()["active"] == ROWS - PRESENTER_ROWS and scheduler.stats()["queued"] == 4)
        time.sleep(0.2)  # several ticks: the kept row stays free while room runs wait
        assert scheduler.stats()["active"] == ROWS - PRESENTER_ROWS and scheduler.stats()["queued"] == 4

        config = DecodingConfig(strategy="sample", seed=11, temperature=0.8, top_k=50, max_new_tokens=12)
        presenter_ids = tiny_lm.encode("The presenter's lesson:")
        before = scheduler.stats()["ticks"]
        got = list(scheduler.stream(presenter_ids, config, control=RunControl(priority=True)))
        ticks_at = scheduler.presenter_ticks
        assert len(ticks_at) == len(got)
        assert ticks_at[0] - before <= 2  # its first token within the tick it arrived in (or the next)
        assert ticks_at[-1] - before <= len(got) + 2  # then one token a tick: it never waited for a row
        assert scheduler.stats()["queued"] == 4  # the room's waiting runs are still waiting: none was passed over for it
        alone = list(decode.stream(tiny_lm, presenter_ids, config))
        assert [s.chosen_token_id for s in got] == [s.chosen_token_id for s in alone]
        assert len(got) == 12
    finally:
        for c in controls:
            c.cancel()
        for t in threads:
            t.join(30)
        scheduler.close()


def test_a_priority_run_waits_first_in_line_when_its_row_is_taken(tiny_lm):
    """Two presenters' runs on a scheduler with one kept row: the second waits, ahead of the room's
    waiting runs, and gets the row when the first ends."""
    scheduler = Scheduler(tiny_lm, max_batch=2, max_queue=16, presenter_rows=1)
    ids = tiny_lm.encode("The room writes")
    controls, steps = [RunControl() for _ in range(3)], [[] for _ in range(3)]
    threads = [threading.Thread(target=room_run, args=(scheduler, ids, i, controls[i], steps[i]), daemon=True)
               for i in range(3)]
    results: dict[str, list] = {"a": [], "b": []}

    def presenter(name: str, tokens: int) -> None:
        config = DecodingConfig(strategy="greedy", max_new_tokens=tokens, min_new_tokens=tokens)
        results[name] = list(scheduler.stream(tiny_lm.encode(f"Lesson {name}"), config,
                                              control=RunControl(priority=True)))
    try:
        for t in threads:
            t.start()
        wait_until(lambda: scheduler.stats()["active"] == 1 and scheduler.stats()["queued"] == 2)
        first = threading.Thread(target=presenter, args=("a", 40))
        first.start()
        wait_until(lambda: scheduler.stats()["active"] == 2)
        presenter("b", 5)  # waits for a's row, first in line, then runs
        first.join(30)
        assert len(results["a"]) == 40 and len(results["b"]) == 5
        assert scheduler.stats()["queued"] == 2  # the room's two waiting runs were not let in before b
    finally:
        for c in controls:
            c.cancel()
        for t in threads:
            t.join(30)
        scheduler.close()


def test_one_row_keeps_none_for_a_presenter(tiny_lm):
    """A scheduler of one row (a model that cannot batch) keeps none: the room's run is not starved."""
    scheduler = Scheduler(tiny_lm, max_batch=1, max_queue=4, presenter_rows=1)
    try:
        steps = list(scheduler.stream(tiny_lm.encode("Hi"), DecodingConfig(strategy="greedy", max_new_tokens=3)))
        assert len(steps) == 3
    finally:
        scheduler.close()


def test_a_full_queue_still_takes_a_priority_run(tiny_lm):
    """The room filled the queue (``SchedulerFull`` for the next room run): a presenter's run is still taken."""
    from engine.scheduler import SchedulerFull

    scheduler = Scheduler(tiny_lm, max_batch=2, max_queue=1, presenter_rows=1)
    ids = tiny_lm.encode("The room writes")
    controls, steps = [RunControl() for _ in range(3)], [[] for _ in range(3)]
    threads = [threading.Thread(target=room_run, args=(scheduler, ids, i, controls[i], steps[i]), daemon=True)
               for i in range(3)]
    try:
        for t in threads:
            t.start()
        wait_until(lambda: scheduler.stats()["active"] == 1 and scheduler.stats()["queued"] == 2)
        with pytest.raises(SchedulerFull):
            next(iter(scheduler.stream(ids, DecodingConfig(strategy="greedy", max_new_tokens=2))))
        got = list(scheduler.stream(ids, DecodingConfig(strategy="greedy", max_new_tokens=3),
                                    control=RunControl(priority=True)))
        assert len(got) == 3
    finally:
        for c in controls:
            c.cancel()
        for t in threads:
            t.join(30)
        scheduler.close()
