"""Shared by the tests: what tests/playground/test_compare_stop_room.py and the tests beside it use."""

from __future__ import annotations

import re
import threading
import time
from playground import events
from playground.charts import compare as charts
from tests.helpers.continue_compare import Page, run_coroutine

__all__ = ['DONE', 'STOPPED', 'assert_each_status_is_its_own', 'drive', 'drive_two_pages']


RUNNING = re.compile(r"Lane (\d): running… (\d+) / (\d+) tokens")


DONE = re.compile(r"Lane (\d): (\d+) tokens, stop: ")


STOPPED = re.compile(r"Lane (\d): stopped after (\d+) of (\d+) tokens")


def click_stop(page: Page) -> str:
    """The Stop button's own handler (it cancels this page's runs and says "stopped")."""
    stop = next(f for f in page.demo.fns.values() if (page.block("cmp-stop")._id, "click") in
                [(getattr(t[0], "_id", t[0]), t[1]) for t in f.targets])
    return stop.fn


def lanes_shown(page: Page, count: int) -> list[tuple[str, int]]:
    """Each lane's status text and how many tokens its text shows (the divergence mark is no token)."""
    return [(page.shown(f"cmp-lane-{i}-status"),
             sum(1 for item in page.shown(f"cmp-lane-{i}-text") or [] if item[0] != charts.DIVERGE_MARK))
            for i in range(count)]


def drive(page: Page, session: str, local, stop_when=None) -> tuple[list[list[tuple[str, int]]], float | None, float]:
    """Run all lanes as the page does; ``stop_when(shown)``: press Stop after the first update it
    accepts. Returns (every update's lanes as shown, when Stop was pressed, when the last update came)."""
    dep = page.event("on_run", "cmp-status")
    count = page.get(dep.inputs[4])
    args = [page.get(b) for b in dep.inputs]
    stop_fn = click_stop(page)

    async def run():
        local.session = session
        seen, pressed = [], None
        async for row in dep.fn(*args):
            page.apply(dep, row)
            seen.append(lanes_shown(page, count))
            if pressed is None and stop_when is not None and stop_when(seen[-1]):
                pressed = time.perf_counter()
                said = await stop_fn()
                # the run says stopped itself; the press's own reply must not land after it and hide it
                assert events.is_skip(said), said
        return seen, pressed, time.perf_counter()

    return run_coroutine(run)


def assert_each_status_is_its_own(seen: list[list[tuple[str, int]]], budgets: list[int]) -> None:
    """In every update, every lane's status agrees with its own text; a lane says it finished only
    at its budget, and never runs again after."""
    finished = set()
    for n, lanes in enumerate(seen):
        for i, (status, shown) in enumerate(lanes):
            where = (n, i, status, shown)
            if m := RUNNING.search(status):
                assert int(m[1]) == i + 1 and int(m[2]) == shown and int(m[3]) == budgets[i], where
                assert i not in finished, where
            elif m := DONE.search(status):
                assert int(m[1]) == i + 1 and int(m[2]) == shown == budgets[i], where
                finished.add(i)
            else:
                assert STOPPED.search(status) and n == len(seen) - 1, where  # only the stopped run's last word


def drive_two_pages(a: Page, b: Page, local, stop_after: int) -> dict:
    """Both pages' Run at once, each in its own thread and session ("page-A", "page-B"); page A presses
    Stop once a lane shows ``stop_after`` tokens. Returns each page's ``drive`` result by session."""
    out: dict = {}

    def work(name: str, page: Page, stop_when) -> None:
        out[name] = drive(page, name, local, stop_when)

    threads = [threading.Thread(target=work, args=("page-A", a, lambda lanes: max(k for _, k in lanes) >= stop_after)),
               threading.Thread(target=work, args=("page-B", b, None))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out
