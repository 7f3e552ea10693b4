"""What one Gradio event costs the app's server, with Gradio's queue analytics as Gradio ships them
and as the app sets them (``playground.app.quiet_queue_analytics``): after every event Gradio's queue
summarises its last ``GRADIO_ANALYTICS_MAX_EVENTS`` events (default 10,000) in a pandas table for its
/monitoring page, every ``GRADIO_ANALYTICS_CACHE_FREQUENCY`` events (default 1). The app turns
/monitoring off and makes that summary once per 1,000,000 events.

Two apps (``python app.py``, startup examples off) run at once on 127.0.0.1: one with Gradio's
defaults set in its environment (an operator's setting wins over the app's), one as the app sets
them. Four gradio_client sessions per app call ``/lessons`` (no model) in rounds that alternate
between the apps; the printout is each app's CPU milliseconds per event (its process, from /proc)
per round and in all, and their ratio.

    python -m bench.gradio_events [--events 2000] [--rounds 8]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.room import app_process  # noqa: E402
from bench.step_verify import cpu_s  # noqa: E402

SESSIONS = 4
GRADIO_DEFAULTS = {"GRADIO_ANALYTICS_CACHE_FREQUENCY": "1", "GRADIO_ANALYTICS_MAX_EVENTS": "10000"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=2000, help="events per app, in all (at most 20,000)")
    parser.add_argument("--rounds", type=int, default=8, help="rounds per app, alternating between the apps")
    args = parser.parse_args(argv)
    if not 1 <= args.rounds <= args.events <= 20_000:
        parser.error(f"--events / --rounds: expected 1 <= rounds <= events <= 20000, got {args.events} / {args.rounds}")

    import psutil
    from gradio_client import Client

    if set(GRADIO_DEFAULTS) & set(os.environ):
        parser.error(f"unset {', '.join(sorted(set(GRADIO_DEFAULTS) & set(os.environ)))}: the second app runs as "
                     "the app sets them")
    apps = {}
    for name, environ in (("Gradio's defaults", GRADIO_DEFAULTS), ("the app's setting", {})):
        process, url = app_process("", f"/tmp/bench-gradio-events-{len(apps)}.log", environ)
        # a plain-http URL has nothing to verify: no CA bundle loaded per request (bench.concurrency)
        clients = [Client(url, verbose=False, ssl_verify=False) for _ in range(SESSIONS)]
        apps[name] = (process, clients, [])
    per_round = args.events // args.rounds
    try:
        for _ in range(args.rounds):
            for name, (process, clients, rounds) in apps.items():
                before, start = cpu_s([psutil.Process(process.pid)]), time.monotonic()
                with ThreadPoolExecutor(SESSIONS) as pool:
                    list(pool.map(lambda i: [clients[i].predict(api_name="/lessons")
                                             for _ in range(per_round // SESSIONS)], range(SESSIONS)))
                calls = per_round // SESSIONS * SESSIONS
                cpu = cpu_s([psutil.Process(process.pid)]) - before
                rounds.append((cpu * 1000 / calls, calls / (time.monotonic() - start)))
    finally:
        for process, _, _ in apps.values():
            process.terminate()
    print(f"bench.gradio_events: /lessons, {SESSIONS} sessions per app, {args.rounds} alternating rounds of "
          f"{per_round // SESSIONS * SESSIONS} events; load average {os.getloadavg()[0]:.1f}")
    means = {}
    for name, (_, _, rounds) in apps.items():
        means[name] = sum(ms for ms, _ in rounds) / len(rounds)
        print(f"{name:>18}: server CPU ms per event by round " + " ".join(f"{ms:.1f}" for ms, _ in rounds)
              + f"; mean {means[name]:.1f}; events/s {sum(r for _, r in rounds) / len(rounds):.0f}")
    ours, gradio = means["the app's setting"], means["Gradio's defaults"]
    print(f"ratio (the app's setting / Gradio's defaults): {ours / gradio:.2f}x")


if __name__ == "__main__":
    main()
