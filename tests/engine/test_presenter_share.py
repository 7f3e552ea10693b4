"""Issue #52, "the presenter waits behind the room": a presenter's run (``RunControl.priority``) is a row of
its own small batch, forwarded every tick, while the room's full batch is forwarded only every
``presenter_share``-th tick (engine/scheduler.py, "A presenter's rows"). Counted in ticks, never in
seconds: beside a full room the presenter's run takes one tick per token and the room's rows are forwarded
on a quarter of those ticks (so the presenter's tokens pay far fewer room forwards than they have ticks),
the room still moves, and every run's tokens equal its serial rerun (``decode.stream``)."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from engine.config import DecodingConfig
from engine.control import RunControl, RunStopped
from engine.scheduler import Scheduler, default_presenter_share
from engine.settings import SettingsError
from engine.strategies import decode
from tests.helpers.scheduler import assert_same_steps

ROWS, ROOM, SHARE = 4, 3, 4  # one row kept for the presenter, the room fills the other three
ROOM_TOKENS, PRESENTER_TOKENS = 64, 33


def room_job(tiny_lm, i: int) -> tuple[list[int], DecodingConfig]:
    config = DecodingConfig(strategy="sample", seed=100 + i, temperature=0.9, max_new_tokens=ROOM_TOKENS,
                            min_new_tokens=ROOM_TOKENS)
    return tiny_lm.encode(f"Room user {i} writes a long story about the sea."), config


def run_together(scheduler: Scheduler, jobs: list[tuple[list[int], DecodingConfig, RunControl | None]]) -> list[list]:
    """Stream every job in its own thread, all sent before the worker starts (``gathered``: they join
    in its first tick, so the counts below do not depend on the threads' timing)."""
    results: list[list] = [[] for _ in jobs]
    failures: list[BaseException] = []

    def consume(i: int) -> None:
        ids, config, control = jobs[i]
        try:
            results[i].extend(scheduler.stream(ids, config, control=control))
        except BaseException as exc:  # noqa: BLE001 (reported by the assertion below)
            failures.append(exc)

    threads = [threading.Thread(target=consume, args=(i,), daemon=True) for i in range(len(jobs))]
    with scheduler.gathered(len(jobs)):
        for t in threads:
            t.start()
    for t in threads:
        t.join(120)
    assert failures == []
    return results


def test_a_presenter_run_beside_a_full_room_pays_a_room_forward_every_fourth_tick(tiny_lm):
    scheduler = Scheduler(tiny_lm, max_batch=ROWS, max_queue=8, presenter_rows=1, presenter_share=SHARE)
    room = [room_job(tiny_lm, i) for i in range(ROOM)]
    config = DecodingConfig(strategy="sample", seed=7, temperature=0.8, top_k=50, max_new_tokens=PRESENTER_TOKENS,
                            min_new_tokens=PRESENTER_TOKENS)
    ids = tiny_lm.encode("The presenter's lesson: top-k vs top-p")
    try:
        *got_room, got = run_together(scheduler, [(i, c, None) for i, c in room] + [(ids, config, RunControl(priority=True))])
        stats = scheduler.stats()
    finally:
        scheduler.close()
    # its first token came with its prefill, then one tick a token, its own row's forward each time;
    # the room's rows were forwarded on one tick in four of those: they moved, and the presenter's
    # 33 tokens paid 8 of the room's forwards, not 32
    assert stats["presenter_ticks"] == PRESENTER_TOKENS - 1
    assert stats["room_beside_presenter"] == (PRESENTER_TOKENS - 1) // SHARE
    assert 1 <= stats["room_beside_presenter"] < stats["presenter_ticks"]
    assert_same_steps(got, list(decode.stream(tiny_lm, ids, config)), "presenter")
    for i, (ids_i, config_i) in enumerate(room):  # the room's runs skipped ticks, and finished unchanged
        assert len(got_room[i]) == ROOM_TOKENS
        assert_same_steps(got_room[i], list(decode.stream(tiny_lm, ids_i, config_i)), f"room {i}")


def test_share_one_forwards_the_room_every_tick_and_keeps_the_tokens(tiny_lm):
    """``presenter_share`` 1: the room's rows go every tick beside the presenter's (the other end of the knob)."""
    scheduler = Scheduler(tiny_lm, max_batch=2, max_queue=4, presenter_rows=1, presenter_share=1)
    ids, _ = room_job(tiny_lm, 0)
    config = DecodingConfig(strategy="greedy", max_new_tokens=30, min_new_tokens=30)
    lesson = tiny_lm.encode("Lesson")
    presenter = DecodingConfig(strategy="greedy", max_new_tokens=9, min_new_tokens=9)
    try:
        room, got = run_together(scheduler, [(ids, config, None), (lesson, presenter, RunControl(priority=True))])
        stats = scheduler.stats()
    finally:
        scheduler.close()
    assert stats["presenter_ticks"] == 8 and stats["room_beside_presenter"] == 8
    assert_same_steps(got, list(decode.stream(tiny_lm, lesson, presenter)))
    assert_same_steps(room, list(decode.stream(tiny_lm, ids, config)))


def test_presenter_share_from_the_environment_is_checked(monkeypatch, tiny_lm):
    monkeypatch.setenv("DP_PRESENTER_SHARE", "3")
    assert default_presenter_share() == 3 and Scheduler(tiny_lm).presenter_share == 3
    monkeypatch.setenv("DP_PRESENTER_SHARE", "0")
    with pytest.raises(SettingsError, match=r"DP_PRESENTER_SHARE: expected an integer >= 1, got 0"):
        Scheduler(tiny_lm)
    monkeypatch.setenv("DP_PRESENTER_SHARE", "often")
    with pytest.raises(SettingsError, match=r"DP_PRESENTER_SHARE: expected an integer >= 1, got 'often'"):
        default_presenter_share()
    with pytest.raises(ValueError, match="presenter_share must be >= 1, got 0"):
        Scheduler(tiny_lm, presenter_share=0)


def test_a_presenters_long_prompt_is_fed_before_the_rooms(tiny_lm):
    """Chunked prefill (``prefill_chunk`` 4): a room's 400-token prompt is being fed, 4 tokens a tick,
    when a presenter's 40-token prompt arrives; the presenter's is fed first, so its run ends before the
    room's long prompt has its first token. Both runs' tokens equal their serial reruns."""
    scheduler = Scheduler(tiny_lm, max_batch=4, max_queue=4, prefill_chunk=4, presenter_rows=1)
    events: list[str] = []
    short, _ = room_job(tiny_lm, 0)
    decoding = DecodingConfig(strategy="greedy", max_new_tokens=400, min_new_tokens=400)
    long_ids = (tiny_lm.encode(" waves and wind") * 200)[:400]
    lesson_ids = (tiny_lm.encode(" the lesson") * 20)[:40]
    three = DecodingConfig(strategy="greedy", max_new_tokens=3)
    twelve = DecodingConfig(strategy="sample", seed=5, max_new_tokens=12, min_new_tokens=12)
    control = RunControl()
    got: dict[str, list] = {"room": [], "presenter": []}

    def consume(name: str, ids, config, run_control) -> None:
        for step in scheduler.stream(ids, config, control=run_control):
            got[name].append(step)
            events.append(name)

    def decode_until_cancelled() -> None:
        with contextlib.suppress(RunStopped):
            list(scheduler.stream(short, decoding, control=control))

    decoder = threading.Thread(target=decode_until_cancelled, daemon=True)
    room = threading.Thread(target=consume, args=("room", long_ids, three, None), daemon=True)
    try:
        decoder.start()  # a row decoding: a long prompt is fed a chunk a tick, between its forwards
        while scheduler.stats()["active"] < 1:
            time.sleep(0.005)
        room.start()
        while scheduler.stats()["active"] < 2:  # the long prompt is being fed
            time.sleep(0.005)
        consume("presenter", lesson_ids, twelve, RunControl(priority=True))
        room.join(120)
    finally:
        control.cancel()
        decoder.join(60)
        scheduler.close()
    assert events.index("room") > len(got["presenter"]) - 1 and events[:12] == ["presenter"] * 12
    assert_same_steps(got["presenter"], list(decode.stream(tiny_lm, lesson_ids, twelve)))
    assert_same_steps(got["room"], list(decode.stream(tiny_lm, long_ids, three)))
