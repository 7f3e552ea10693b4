"""Server memory over many sessions: the whole app served in this process on 127.0.0.1, and N
gradio_client sessions (four at a time, as a room would be) each running a 2-token /step_trace and
a /branch of it. Prints the server's RSS after a warm-up and after every ``--every`` sessions, and
the growth per session: the figure docs/deployment.md's "Public mode and limits" section records.

    python -m bench.sessions [--sessions 200] [--every 50] [--parallel 4]

Sessions keep no KV cache and at most a few traces that expire, so the growth should flatten: the
last interval's growth per session is the number that must stay near zero.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rss_mb() -> float:
    """This process's resident set size in MiB (Linux /proc)."""
    with open(f"/proc/{os.getpid()}/status") as fh:
        line = next(line for line in fh if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--parallel", type=int, default=4)
    args = parser.parse_args(argv)

    from gradio_client import Client

    from engine.backends.registry import ModelRegistry
    from engine.threads import set_threads
    from playground.app import build_app, launch_kwargs

    set_threads(1)
    demo = build_app(ModelRegistry(), default_model="embedded")
    demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=free_port(), quiet=True,
                **launch_kwargs())
    url = demo.local_url.rstrip("/")

    def session(i: int) -> None:
        client = Client(url, verbose=False, httpx_kwargs={"timeout": 120})
        trace = client.predict(f"Session {i} says", {"max_new_tokens": 2, "seed": i}, "balanced", False, "embedded",
                               "none", api_name="/step_trace")
        client.predict(trace, 0, 13, "embedded", "none", api_name="/branch")

    for i in range(5):  # warm up: the model, allocator pools, Gradio's caches
        session(i)
    base = previous = rss_mb()
    print(f"after warm-up: RSS {base:.0f} MiB")
    start, done = time.monotonic(), 0
    with ThreadPoolExecutor(args.parallel) as pool:
        while done < args.sessions:
            n = min(args.every, args.sessions - done)
            list(pool.map(session, range(done + 5, done + 5 + n)))
            done += n
            now = rss_mb()
            print(f"{done:4d} sessions: RSS {now:.0f} MiB (+{now - base:.0f} since warm-up; "
                  f"{(now - previous) * 1024 / n:.0f} KiB per session over the last {n}) "
                  f"[{time.monotonic() - start:.0f} s]")
            previous = now
    demo.close()


if __name__ == "__main__":
    main()
