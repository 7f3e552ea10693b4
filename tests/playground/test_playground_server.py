"""The playground against a real server on 127.0.0.1 (gradio_client): a cancelled job stops its
run within a step, only the named endpoints are public, /branch works, and 100 sessions keep the
server's memory under budget."""

from __future__ import annotations

import os
import time

import pytest

from tests.helpers.common import forwards_after_stop
from tests.helpers.api import api_client

pytestmark = pytest.mark.slow

# Memory budget for 100 sessions (each a /step_trace and a /branch): the server may grow by at most
# this much over its warmed-up size (docs/deployment.md, "Public mode and limits").
RSS_BUDGET_MB = 300
NAMED_ENDPOINTS = {"/step_trace", "/branch", "/compare", "/compare_sweep", "/beam_trace", "/speculative_trace",
                   "/quantization_report", "/kv_cache_report", "/preset_validate", "/preset_interop", "/share_link",
                   "/explore_step", "/lessons", "/mcts_trace", "/medusa_trace", "/eagle_trace",
                   "/kv_cache_kinds_report", "/kv_calculator", "/quantization_methods_report", "/quantization_inside_layer",
                   "/serving_stats", "/serving_demo", "/logit_lens", "/token_ranks", "/watermark_detect", "/watermark_robustness",
                   "/calibration_report", "/hesitation_steps"}


def test_cancelled_job_stops_its_run_within_a_step(live_app, live_forwards):

    client = api_client(live_app)
    # greedy on a story opening: no early EOS, so only the cancel can end the run before 200 tokens
    job = client.submit("Once upon a time, in a small village by the sea,", {"max_new_tokens": 200}, "greedy", False,
                        "embedded", "none", api_name="/step_trace")
    at_cancel, after, last = forwards_after_stop(live_forwards, job.cancel)
    assert after - at_cancel <= 2  # the forward in flight (and at most one more) finishes; no more follow
    assert last == after  # and nothing runs on in the background


def test_only_named_endpoints_are_public(live_app):

    info = api_client(live_app).view_api(return_format="dict", print_info=False)
    assert set(info["named_endpoints"]) == NAMED_ENDPOINTS  # no Stop button, no UI-only event
    assert not info["unnamed_endpoints"]


def test_branch_endpoint_continues_a_trace_with_another_token(live_app):

    client = api_client(live_app)
    parent = client.predict("The sky is", {"max_new_tokens": 5, "seed": 3}, "balanced", False, "embedded", "none",
                            api_name="/step_trace")
    at = len(parent["steps"]) - 1
    token = next(t["token_id"] for t in parent["steps"][at]["stages"][0]["top"]
                 if t["token_id"] != parent["generated_token_ids"][at])
    branch = client.predict(parent, at, token, "embedded", "none", api_name="/branch")
    assert branch["branch_of"] == at and branch["generated_token_ids"][:at] == parent["generated_token_ids"][:at]
    assert branch["generated_token_ids"][at] == token and branch["steps"][at]["forced"]
    with pytest.raises(Exception, match="at_step"):
        client.predict(parent, 99, token, "embedded", "none", api_name="/branch")


def _rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/status") as fh:
        line = next(line for line in fh if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def test_100_sessions_stay_under_the_memory_budget(live_app, registry):
    from playground.examples import cache_for

    # The app's startup examples (every view's first screen: drafters, heads, a quantized copy) load what
    # they need in the background; a file run first in its process would count them as the sessions' growth.
    assert cache_for(registry).wait(600), "the startup examples did not finish"

    def session(i: int) -> None:
        client = api_client(live_app)  # a busy 2-core CI box is slow
        trace = client.predict(f"Session {i} says", {"max_new_tokens": 2, "seed": i}, "balanced", False, "embedded",
                               "none", api_name="/step_trace")
        client.predict(trace, 0, 13, "embedded", "none", api_name="/branch")

    from concurrent.futures import ThreadPoolExecutor

    for i in range(5):  # warm up: allocator pools, Gradio's caches
        session(i)
    start = _rss_mb()
    with ThreadPoolExecutor(4) as pool:  # four users at a time, as a room would be (their runs share the batch)
        list(pool.map(session, range(100)))
    grown = _rss_mb() - start
    assert grown < RSS_BUDGET_MB, f"the server grew by {grown:.0f} MB over 100 sessions"


def test_one_client_gets_at_most_its_runs_at_once(live_app):
    """A fourth request from the same session while three run is refused with the limit's name;
    another session is served meanwhile (DP_RUNS_PER_SESSION, default 3)."""

    client = api_client(live_app)
    long = {"max_new_tokens": 256, "seed": 1, "strategy": "greedy", "min_new_tokens": 256}
    jobs = [client.submit("Count slowly:", long, "", False, "embedded", "none", api_name="/step_trace")
            for _ in range(3)]
    time.sleep(3)  # the three are running (concurrency is the scheduler's batch size)
    with pytest.raises(Exception, match=r"runs: this page already has 3 runs in progress \(DP_RUNS_PER_SESSION\)"):
        client.predict("One more", {"max_new_tokens": 2}, "", False, "embedded", "none", api_name="/step_trace")
    other = api_client(live_app)
    trace = other.predict("Another user", {"max_new_tokens": 2, "strategy": "greedy"}, "", False, "embedded", "none",
                          api_name="/step_trace")
    assert len(trace["steps"]) == 2
    for job in jobs:
        job.cancel()


def test_gradio_s_monitoring_is_off_and_its_per_event_summary_is_not_made(live_app, monkeypatch):
    """Gradio's /monitoring is on unless turned off, and its summary route serves every user's event
    counts and timings to anyone. The app turns it off; its queue's per-event summary (a pandas
    groupby over the last events, which only /monitoring reads) is made once per ANALYTICS_EVERY
    events, not after every event, unless the operator set Gradio's own variable."""
    import gradio as gr
    import httpx

    from playground import app

    assert httpx.get(f"{live_app}/monitoring/summary", timeout=30).status_code == 403
    for name in ("GRADIO_ANALYTICS_CACHE_FREQUENCY", "GRADIO_ANALYTICS_MAX_EVENTS"):
        monkeypatch.delenv(name, raising=False)
    app.quiet_queue_analytics()
    queue = gr.Blocks().queue()._queue
    assert (queue.ANAYLTICS_CACHE_FREQUENCY, queue.ANALYTICS_MAX_EVENTS) == (app.ANALYTICS_EVERY, app.ANALYTICS_KEPT)
    monkeypatch.setenv("GRADIO_ANALYTICS_CACHE_FREQUENCY", "7")
    app.quiet_queue_analytics()
    assert gr.Blocks().queue()._queue.ANAYLTICS_CACHE_FREQUENCY == 7  # the operator's own setting wins
