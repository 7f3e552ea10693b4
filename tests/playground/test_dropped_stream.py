"""A client that drops its result stream stops its run (issue #27): raw HTTP against the live app,
``POST /gradio_api/call/<api>`` then the ``GET`` result stream, closed after its first bytes. The
run's forwards stop within about a second (the run checks its client every WATCH_S) instead of
running on to its end (~25 s of CPU); a client that stays connected gets its whole result."""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlparse

import pytest

from tests.helpers.common import forwards_after_stop
from tests.helpers.validation_api import post_job

pytestmark = pytest.mark.slow

STORY = "Once upon a time, in a small village by the sea,"


def _post(url: str, api: str, data: list) -> str:
    return post_job(url, f"/{api}", json.dumps({"data": data})).json()["event_id"]


def _open_stream(url: str, api: str, event_id: str) -> http.client.HTTPConnection:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    conn.request("GET", f"/gradio_api/call/{api}/{event_id}")
    return conn


@pytest.mark.parametrize("api,data", [
    ("step_trace", [STORY, {"max_new_tokens": 300}, "greedy", False, "embedded", "none"]),
    ("compare", None),
])
def test_closing_the_result_stream_stops_the_run(live_app, live_forwards, api, data):
    if data is None:  # two greedy lanes of 300 tokens
        lanes = [{"preset": "greedy"}, {"preset": "greedy", "config": {"repetition_penalty": 1.3}}]
        data = [STORY, lanes, 0, 300, False, "embedded", "none"]
    conn = _open_stream(live_app, api, _post(live_app, api, data))

    def drop() -> None:  # the client goes away mid-run
        conn.sock.shutdown(2)
        conn.close()

    at_drop, after, last = forwards_after_stop(live_forwards, drop, settle_s=2.5)
    assert last == after, "the run went on after its client had gone"
    assert after - at_drop < 60, (at_drop, after)  # a couple of seconds' worth at most, never the 300 tokens


def test_a_client_that_stays_gets_its_whole_result(live_app):
    conn = _open_stream(live_app, "step_trace", _post(live_app, "step_trace", [STORY, {"max_new_tokens": 12}, "greedy",
                                                                               False, "embedded", "none"]))
    text = conn.getresponse().read().decode()
    conn.close()
    events = [block for block in text.split("\n\n") if block.strip()]
    assert events[-1].startswith("event: complete"), text[-500:]
    trace = json.loads(events[-1].split("data: ", 1)[1])[0]
    assert len(trace["generated_token_ids"]) == 12
    assert all(e.startswith(("event: heartbeat", "event: complete")) for e in events), text[:500]
