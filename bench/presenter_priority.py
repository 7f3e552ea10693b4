"""A presenter's lesson beside the room (issue #52: with the room's runs on the machine, the presenter's
"top-k vs top-p vs min-p" lesson took 537 s and stopped at the 120 s limit).

The lesson's runs (three sampled lanes of 24 tokens) go through the app's kind of scheduler (one per
model, default rows, PRESENTER_ROWS kept, the presenter's rows their own batch and the room's forwarded
every ``--share``-th tick beside them: engine/scheduler.py) as the Lessons tab sends them: one after
the other, each with a ``RunControl`` whose ``priority`` says the presenter view is on. Timed alone, then with ``--users`` simulated users
streaming long sampling runs through the same scheduler (their rows full, more waiting), then the
same with ``priority`` off (the room's order: the presenter queues; bounded by ``--limit`` seconds,
as the app's request limit bounds it). Printed: each time, and the ratio with the room to alone
(issue #52's goal: at most 2), with the load average and the CPU's model name.

    python -m bench.presenter_priority [--users 16] [--lesson truncation] [--limit 120] [--share 4]
"""

from __future__ import annotations

import argparse
import os
import threading
import time

from engine import runner
from engine.backends.local import ModelSpec, load_model
from engine.config import DecodingConfig
from engine.control import RunControl, RunStopped
from engine.reports.lessons import builtin_lessons
from engine.scheduler import PRESENTER_ROWS, Scheduler, default_presenter_share

ROOM_TOKENS = 1024  # each user's run: long enough to outlast the measurement; a new one starts when it ends


def lesson_time(lm, scheduler: Scheduler, lesson, priority: bool, limit_s: float) -> float | None:
    """Seconds the lesson's runs took (None: past ``limit_s``)."""
    start = time.perf_counter()
    control = RunControl(deadline_s=limit_s, priority=priority)
    try:
        for p in lesson.runs:
            runner.run(runner.RunRequest(lm, lesson.prompt, p.config, chat=lesson.chat, control=control,
                                         scheduler=scheduler))
    except RunStopped:
        return None
    return time.perf_counter() - start


def room(lm, scheduler: Scheduler, users: int, stop: threading.Event) -> list[threading.Thread]:
    """``users`` threads, each streaming sampling runs until ``stop``."""
    def user(i: int) -> None:
        ids = lm.encode(f"User {i} writes a long story about the sea. Once upon a time,")
        seed = i
        while not stop.is_set():
            control = RunControl()
            config = DecodingConfig(strategy="sample", seed=seed, max_new_tokens=ROOM_TOKENS, min_new_tokens=ROOM_TOKENS)
            try:
                for _ in scheduler.stream(ids, config, control=control):
                    if stop.is_set():
                        control.cancel()
            except RunStopped:
                pass
            seed += users
    threads = [threading.Thread(target=user, args=(i,), daemon=True) for i in range(users)]
    for t in threads:
        t.start()
    return threads


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (what ``lscpu`` shows; "unknown" elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            return next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "unknown")
    except OSError:
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--lesson", default="truncation")
    parser.add_argument("--limit", type=float, default=120.0, help="seconds a lesson may take (the app's limit)")
    parser.add_argument("--share", type=int, default=None,
                        help="ticks per forward of the room's rows beside a presenter's (default: DP_PRESENTER_SHARE, 4)")
    args = parser.parse_args()
    if not 1 <= args.users <= 64:
        raise SystemExit(f"--users: expected 1..64, got {args.users}")
    try:
        share = default_presenter_share() if args.share is None else args.share
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if share < 1:
        raise SystemExit(f"--share: expected an integer >= 1, got {share}")
    lessons = builtin_lessons()
    if args.lesson not in lessons:
        raise SystemExit(f"--lesson: expected one of {', '.join(lessons)}, got {args.lesson!r}")
    lesson = lessons[args.lesson]
    lm = load_model(ModelSpec())
    scheduler = Scheduler(lm, presenter_rows=PRESENTER_ROWS, presenter_share=share)  # as the app's (Schedulers)
    lesson_time(lm, scheduler, lesson, True, args.limit)  # warm-up: first-call costs out of the timing
    alone = lesson_time(lm, scheduler, lesson, True, args.limit)
    stop = threading.Event()
    threads = room(lm, scheduler, args.users, stop)
    try:
        while scheduler.stats()["active"] + scheduler.stats()["queued"] < args.users:
            time.sleep(0.05)
        time.sleep(1.0)  # the room's rows are decoding
        busy = scheduler.stats()
        with_room = lesson_time(lm, scheduler, lesson, True, args.limit)
        without_priority = lesson_time(lm, scheduler, lesson, False, args.limit)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        scheduler.close()
    load = os.getloadavg()[0]
    print(f"lesson {lesson.id!r} ({len(lesson.runs)} runs), scheduler {busy['max_batch']} rows, room forwarded every "
          f"{share} ticks beside the presenter; room: {args.users} users ({busy['active']} rows decoding, "
          f"{busy['queued']} waiting); load average {load:.1f}; CPU {cpu_model()}, {os.cpu_count()} cores")
    print(f"  alone:                       {alone:.2f} s")
    print(f"  beside the room, priority:   {with_room:.2f} s" if with_room is not None else
          f"  beside the room, priority:   > {args.limit:g} s (stopped)")
    print(f"  beside the room, no priority: {without_priority:.2f} s" if without_priority is not None else
          f"  beside the room, no priority: > {args.limit:g} s (stopped at the limit)")
    if alone and with_room is not None:
        print(f"ratio with the room / alone (priority): {with_room / alone:.2f}  (goal <= 2)")


if __name__ == "__main__":
    main()
