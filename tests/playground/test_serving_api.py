"""Issue #41 through the API, as a script or a notebook drives it: gradio_client against the real app
on 127.0.0.1. A demonstration's answer is strict JSON whose claim holds (the prefix fed once, the
same tokens as each prompt alone); its private scheduler leaves the room's record alone; two
callers at once get one demonstration and one line; bad arguments get one line naming them."""

from __future__ import annotations

import json
import threading

import pytest
from tests.helpers.common import wait_for_a_quiet_room
from tests.helpers.api import api_client

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(live_app, registry):

    from playground.examples import cache_for

    assert cache_for(registry).wait(600), "the startup examples did not finish"
    wait_for_a_quiet_room(live_app)  # the room's record below is counted before and after a demonstration
    return api_client(live_app)


def room_runs(client) -> int:
    stats = client.predict("embedded", "none", 3600, False, api_name="/serving_stats")
    return stats["runs"] if stats["available"] else 0


def test_a_demonstration_through_the_api(client, embedded):
    from engine.reports.serving_demos import LESSON, QUESTIONS

    before = room_runs(client)
    d = client.predict("prefix", "embedded", "none", api_name="/serving_demo")
    json.dumps(d, allow_nan=False)  # strict JSON all the way down
    prompts = [embedded.encode(LESSON + QUESTIONS[i % 8] + f" (user {i})") for i in range(d["users"])]
    assert d["prompt_tokens"] == [len(p) for p in prompts]
    assert d["shared"]["prefill_tokens"] == d["shared_tokens"] + sum(len(p) - d["shared_tokens"] for p in prompts)
    assert d["unshared"]["prefill_tokens"] == sum(len(p) for p in prompts)
    assert d["tokens"]["shared"] == d["tokens"]["unshared"] and d["same_tokens"] == d["users"] == 8
    assert room_runs(client) == before  # the demonstration's runs are its own scheduler's, not the room's


def test_two_callers_at_once_get_one_demonstration(live_app, client):

    other = api_client(live_app)
    outcomes: list = [None, None]

    def call(i: int, who) -> None:
        try:
            outcomes[i] = who.predict("prefix", "embedded", "none", api_name="/serving_demo")
        except Exception as exc:  # noqa: BLE001 (inspected below)
            outcomes[i] = exc

    threads = [threading.Thread(target=call, args=(i, who)) for i, who in enumerate((client, other))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    refused = [o for o in outcomes if isinstance(o, Exception)]
    done = [o for o in outcomes if isinstance(o, dict)]
    assert len(done) == 1 and len(refused) == 1, outcomes  # the demonstration takes seconds; both arrive in ms
    text = str(refused[0])  # the second press while the first runs: one line, not a second demonstration
    assert "another demonstration is running on this server" in text and len(text) < 300
    assert done[0]["same_tokens"] == 8


@pytest.mark.parametrize("args, api_name, named", [
    (("embedded", "none", 0, False), "/serving_stats", "window_s: "),
    (("embedded", "none", 1e9, False), "/serving_stats", "window_s: "),
    (("<script>x</script>", "embedded", "none"), "/serving_demo", "name: expected one of"),
])
def test_bad_arguments_are_one_line(client, args, api_name, named):
    with pytest.raises(Exception) as raised:
        client.predict(*args, api_name=api_name)
    text = str(raised.value)
    assert named in text and "<script>" not in text and len(text) < 300
