"""A client that drops its result stream stops its run (issue #27): raw HTTP against the live app,
``POST /gradio_api/call/<api>`` then the ``GET`` result stream, closed after its first bytes. The
run's forwards stop within about a second (the run checks its client every WATCH_S) instead of
running on to its end (~25 s of CPU); a client that stays connected gets its whole result."""

from __future__ import annotations

import http.client
import json
import time
from urllib.parse import urlparse

import pytest

from tests.conftest import wait_until_idle

pytestmark = pytest.mark.slow

STORY = "Once upon a time, in a small village by the sea,"


@pytest.fixture
def forwards(embedded):
    count = [0]
    handle = embedded.model.register_forward_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    yield count
    handle.remove()


def _post(url: str, api: str, data: list) -> str:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", f"/gradio_api/call/{api}", json.dumps({"data": data}), {"Content-Type": "application/json"})
    response = conn.getresponse()
    body = json.loads(response.read())
    conn.close()
    return body["event_id"]


def _open_stream(url: str, api: str, event_id: str) -> http.client.HTTPConnection:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    conn.request("GET", f"/gradio_api/call/{api}/{event_id}")
    return conn


def _wait_for(forwards, n: int) -> None:
    deadline = time.time() + 120
    while forwards[0] < n and time.time() < deadline:
        time.sleep(0.02)
    assert forwards[0] >= n, "the run never started"


@pytest.mark.parametrize("api,data", [
    ("step_trace", [STORY, {"max_new_tokens": 300}, "greedy", False, "embedded", "none"]),
    ("compare", None),
])
def test_closing_the_result_stream_stops_the_run(live_app, forwards, api, data):
    if data is None:  # two greedy lanes of 300 tokens
        lanes = [{"preset": "greedy"}, {"preset": "greedy", "config": {"repetition_penalty": 1.3}}]
        data = [STORY, lanes, 0, 300, False, "embedded", "none"]
    wait_until_idle(forwards)
    start = forwards[0]
    conn = _open_stream(live_app, api, _post(live_app, api, data))
    _wait_for(forwards, start + 4)
    conn.sock.shutdown(2)
    conn.close()  # the client goes away mid-run
    at_drop = forwards[0]
    time.sleep(3)
    after = forwards[0]
    time.sleep(2)
    assert forwards[0] == after, "the run went on after its client had gone"
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
