"""Issue #34 through the real app: gradio_client against a live app on 127.0.0.1 in public mode,
``DP_REMOTE_MODELS`` listing fake servers (tests/helpers/fault_servers.py) that fail as the issue lists.
For each fault, both backends, step and fast mode: the API answers ONE line within the time limit,
the process's memory stays within a stated bound, a local user's 8-token request made at the same
time takes at most twice its time without the fault (both measured here, in the same test, as
medians of interleaved rounds; "without the fault": the same users' requests to the same server
answering well; the fake servers run in processes of their own, as real ones do), no connection
reaches a listener the operator did not list, and the JSON the app emits is strict. The
local items of the issue follow (kinds [1, 2], forged /branch ids, a 10 MB dropdown value, a link
over 65,536 characters, SIGTERM and the private folder)."""

from __future__ import annotations

import http.client
import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from engine.backends.client import strict_loads
from tests.helpers.common import free_port, launch_local
from tests.helpers.fault_servers import CountingListener, FakeServerProcess, Fault, PeakRss, generated
from tests.helpers.api import api_client

pytestmark = pytest.mark.slow

LIMIT_S = 10  # DP_REQUEST_SECONDS of the app under test
MEMORY_BOUND_MB = 200  # peak growth of the app's process while a fault is served (docs/deployment.md, limits)
KEPT_BOUND_MB = 64  # growth still there once the faulted requests have answered (the app kept +6.4 GB)
GREEDY8 = {"strategy": "greedy", "max_new_tokens": 8, "top_n": 5}
CONNECT_PATHS = ("/v1/models", "/models", "/props", "/tokenize", "/detokenize", "/apply-template")  # connect's requests
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class LiveApp:
    url: str
    servers: dict[str, FakeServerProcess]  # by backend: listed, connected while good (each its own process)
    redirecting: dict[str, FakeServerProcess]  # by backend: listed, redirect from the first request
    slow_connect: dict[str, FakeServerProcess]  # by backend: listed, one byte a second from the first request
    unlisted: CountingListener
    clients: list  # gradio_client Clients, one session each


@pytest.fixture(scope="module")
def app(registry, embedded) -> Iterator[LiveApp]:

    from playground.app import build_app

    unlisted = CountingListener()
    servers = {b: FakeServerProcess(b, redirect_to=unlisted.url) for b in ("llamacpp", "openai")}
    redirecting = {b: FakeServerProcess(b, Fault("redirect", paths=("/v1/models", "/models", "/props")), unlisted.url)
                   for b in ("llamacpp", "openai")}
    slow_connect = {b: FakeServerProcess(b, Fault("slow", paths=CONNECT_PATHS)) for b in ("llamacpp", "openai")}
    listed = [s.spec for s in [*servers.values(), *redirecting.values(), *slow_connect.values()]]
    with pytest.MonkeyPatch.context() as env:
        for name, value in {"DP_PUBLIC": "1", "DP_MODELS": "embedded", "DP_REMOTE_MODELS": ",".join(listed),
                            "DP_REQUEST_SECONDS": str(LIMIT_S), "DP_EXAMPLES": "0"}.items():
            env.setenv(name, value)
        demo = build_app(registry)
        launch_local(demo)
        url = demo.local_url.rstrip("/")
        clients = [api_client(url) for _ in range(18)]
        step_trace(clients[0], "embedded")  # the local model loaded before anything is timed
        warm_up(clients)
        try:
            yield LiveApp(url, servers, redirecting, slow_connect, unlisted, clients)
        finally:
            demo.close()
            for server in [*servers.values(), *redirecting.values(), *slow_connect.values()]:
                server.close()
            unlisted.close()


def warm_up(clients: list) -> None:
    """One 1-token local run per client, all at once, before anything is timed: a session's first
    event makes Gradio set up its state (a copy of the page's configuration, ~1.5 MB, measured by
    bench.sessions), seconds for 16 new sessions at once on a loaded CPU, which would otherwise fall
    inside the first timed request of each user."""
    one = {**GREEDY8, "max_new_tokens": 1}
    threads = [threading.Thread(target=step_trace, args=(client, "embedded", "step", one), daemon=True)
               for client in clients]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)


def step_trace(client: Any, model: str, mode: str = "step", config: dict = GREEDY8) -> dict:
    return client.predict("hi", config, "", False, model, "none", mode, api_name="/step_trace")


def outcome(client: Any, model: str, mode: str) -> tuple[Any, float]:
    """(the trace, or the one line the API answered, as a str), and the seconds it took."""
    from gradio_client.exceptions import AppError

    start = time.perf_counter()
    try:
        result: Any = step_trace(client, model, mode)
    except AppError as exc:
        result = str(exc)
    return result, time.perf_counter() - start


def local_seconds(client: Any, times: int = 3) -> float:
    """The local user's 8-token greedy request alone: the median of ``times``."""
    return median([local_once(client) for _ in range(times)])


def local_once(client: Any) -> float:
    start = time.perf_counter()
    assert len(step_trace(client, "embedded")["generated_token_ids"]) == 8
    return time.perf_counter() - start


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


# Without / with the fault, interleaved (the machine's own load falls on both alike): "without the
# fault" is the same users sending the same requests to the same server while it answers well.
ROUNDS = 3


def faulted_alongside(app: LiveApp, server: FakeServerProcess | list, mode: str | tuple, users: int,
                      wait_for: int = 0, more: Any = None) -> tuple[list, float, PeakRss]:
    """``users`` users send their request to ``server`` at once (a list: user i to server i mod
    its length; a tuple of modes likewise) and the local user its 8-token request beside them
    (once ``wait_for`` of them are held in a run request at the server; then ``more()``, more of
    the local user's while they still are); returns their outcomes, the local user's seconds, and
    the memory measured over it all."""
    results: list = [None] * users
    targets = server if isinstance(server, list) else [server]
    modes = (mode,) if isinstance(mode, str) else mode
    runs = sum(s.runs for s in targets) if wait_for else 0

    def user(i: int) -> None:
        results[i] = outcome(app.clients[1 + i], targets[i % len(targets)].spec, modes[i % len(modes)])

    threads = [threading.Thread(target=user, args=(i,), daemon=True) for i in range(users)]
    with PeakRss() as memory:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while wait_for and sum(s.runs for s in targets) - runs < wait_for and time.monotonic() < deadline:
            time.sleep(0.05)
        local = local_once(app.clients[0])
        if more is not None:
            more()
        for thread in threads:
            thread.join(LIMIT_S + 30)
    assert not any(thread.is_alive() for thread in threads), "a faulted request never answered"
    return results, local, memory


def assert_one_line(result: Any, took: float, starts: str) -> None:
    assert isinstance(result, str), f"expected one error line, got a trace: {str(result)[:200]}"
    assert "\n" not in result and len(result) <= 300 and result.startswith(starts), result
    assert "Traceback" not in result and "SECRET" not in result
    assert took < LIMIT_S + 4, f"{took:.1f} s: past the {LIMIT_S} s time limit"


def served(app: LiveApp, backend: str) -> str:
    return app.servers[backend].spec


def names(app: LiveApp, backend: str) -> str:
    """How a line names the listed server of ``backend``."""
    return named(app.servers[backend])


def named(server: FakeServerProcess) -> str:
    return ("llama.cpp server " if server.backend == "llamacpp" else "OpenAI-compatible server ") + server.url


# --- the faults, a local user alongside --------------------------------------------------------------
HEAVY = [  # (fault, modes it applies to, what each faulted request answers)
    (Fault("huge_line"), ("step", "fast"), "one line"),
    (Fault("huge_body"), ("step",), "one line"),
    (Fault("declared_body"), ("step",), "one line"),
    (Fault("forever"), ("fast",), "8 tokens"),
    (Fault("comments"), ("fast",), "one line"),
    # faults answered at once: the local user timed beside them too, in one mode each (the other mode's
    # answers: test_a_wrong_value_is_one_line_through_the_api, test_no_connection_reaches_an_unlisted_host)
    (Fault("value", "id", "1" + "0" * 30), ("fast",), "one line"),
    (Fault("redirect"), ("step",), "one line"),
]


@pytest.mark.parametrize("backend", ["llamacpp", "openai"])
@pytest.mark.parametrize("fault, modes, answers", HEAVY, ids=[f.kind for f, _, _ in HEAVY])
def test_a_heavy_fault_is_one_line_and_a_local_user_is_served_as_fast(app, backend, fault, modes, answers):
    server = app.servers[backend]
    for mode in modes:
        good, beside = [], []  # the local user's seconds beside 4 users on the good server / on the faulty one
        for _ in range(ROUNDS):
            good.append(faulted_alongside(app, server, mode, users=4)[1])
            server.fault = fault
            try:
                results, local, memory = faulted_alongside(app, server, mode, users=4)
            finally:
                server.fault = None
            beside.append(local)
            print(f"{backend} {fault.kind} {mode}: local {local:.2f} s (without the fault {good[-1]:.2f} s), "
                  f"RSS +{memory.growth:.0f} MB peak, +{memory.after - memory.before:.0f} MB after")
            for result, took in results:
                if answers == "8 tokens":  # the stream is cut at max_new_tokens
                    assert result["generated_token_ids"] == [10] * 8 and took < LIMIT_S
                else:
                    assert_one_line(result, took, names(app, backend))
            assert memory.growth < MEMORY_BOUND_MB and memory.after - memory.before < KEPT_BOUND_MB
        # each round's pair ran back to back, so the other xdist worker's load (a page load, a browser's
        # chart) that slows one round slows both of its runs: the median of the rounds' ratios
        ratios = [b / g for b, g in zip(beside, good)]
        assert median(ratios) <= 2, (f"the local user took {median(ratios):.2f}x as long beside the fault as without "
                                     f"it in the same round (median of {', '.join(f'{r:.2f}' for r in ratios)}; "
                                     f"seconds beside {beside}, without {good})")
    assert app.unlisted.connections == 0  # a redirect's Location is never connected to


VALUES = [("id", "-1"), ("id", "1" + "0" * 30), ("id", "true"), ("id", "321.7"), ("logprob", "1e999"),
          ("logprob", '"nan"'), ("prob", "5e21"), ("top", '"x"'), ("list", "7"),
          # issue #50: past exp's range (every log-probability -710 gave "generation failed: OverflowError"),
          # below any server's floor, positive
          ("flat", "-710"), ("logprob", "-1e308"), ("logprob", "3.5")]


@pytest.mark.parametrize("backend", ["llamacpp", "openai"])
@pytest.mark.parametrize("mode", ["step", "fast"])
def test_a_wrong_value_is_one_line_through_the_api(app, backend, mode, caplog):
    """Each wrong value is one line naming the server; the app's log keeps that line, without a
    traceback (the fault is the server's, not ours: playground.events.error_message)."""
    server = app.servers[backend]
    caplog.set_level(logging.INFO, logger="playground.events")
    lines = []
    for at, raw in VALUES:
        if at == "prob" and (backend, mode) == ("llamacpp", "step"):
            continue  # that answer has log-probabilities only
        server.fault = Fault("value", at, raw)
        try:
            result, took = outcome(app.clients[1], served(app, backend), mode)
        finally:
            server.fault = None
        assert_one_line(result, took, names(app, backend))
        lines.append(result)
    logged = [r for r in caplog.records if r.name == "playground.events"]
    assert not [r for r in logged if r.exc_info or r.levelno >= logging.ERROR], "a server's fault logged as ours"
    messages = [r.getMessage() for r in logged]
    for line in lines:  # the API's line is the toast's text: its '<' written '&lt;' (playground.events.toast_text)
        assert any(m.endswith(line.replace("&lt;", "<")) for m in messages), f"not in the log: {line}"


@pytest.mark.parametrize("backend", ["llamacpp", "openai"])
def test_sixteen_users_on_a_slow_server_hold_no_local_slot(app, backend):
    """16 users on a server that answers one byte per second (8 in step mode, 8 in fast mode): each
    gets the time-limit line at the limit (not per byte), a 17th is refused at once
    (DP_SERVED_CONCURRENCY), the local user is served meanwhile as fast as alone (a slot held by a
    stuck run would cost it the time limit), and afterwards every served slot is free again."""
    server = app.servers[backend]
    baseline = local_seconds(app.clients[0])  # alone: stuck users cost no CPU, a held slot would cost seconds
    server.fault = Fault("slow")
    refused: list = []

    runs = server.runs

    def seventeenth() -> None:  # once the 16 are held in their run requests
        deadline = time.monotonic() + 30
        while server.runs - runs < 16 and time.monotonic() < deadline:
            time.sleep(0.05)
        refused.append(outcome(app.clients[17], served(app, backend), "step"))

    try:
        late = threading.Thread(target=seventeenth, daemon=True)
        late.start()
        beside: list[float] = []
        results, local, memory = faulted_alongside(app, server, ("step", "fast"), users=16, wait_for=16,
                                                   more=lambda: beside.extend(local_once(app.clients[0])
                                                                              for _ in range(ROUNDS - 1)))
        late.join(LIMIT_S + 30)
    finally:
        server.fault = None
    local = median([local, *beside])
    print(f"{backend}: local {local:.2f} s beside 16 stuck users ({baseline:.2f} s alone; medians); "
          f"17th: {refused[0][0]!r} after {refused[0][1]:.2f} s; the 16 answered after "
          f"{', '.join(f'{took:.1f}' for _, took in sorted(results, key=lambda r: r[1]))} s")
    for result, took in results:
        assert result == f"stopped: the run went past the {LIMIT_S} s time limit (DP_REQUEST_SECONDS); ask for fewer " \
                         "tokens", result
        assert LIMIT_S - 0.5 < took < LIMIT_S + 4
    assert refused[0][0] == "served models: 16 runs already use them (DP_SERVED_CONCURRENCY); try again in a moment"
    assert refused[0][1] < 3
    assert local <= 2 * baseline, f"the local user took {local:.2f} s, {local / baseline:.1f}x its {baseline:.2f} s"
    assert memory.growth < MEMORY_BOUND_MB
    assert_every_served_slot_free(app, backend)


@pytest.mark.parametrize("backend", ["llamacpp", "openai"])
def test_keep_alive_comments_forever_end_at_the_time_limit(app, backend):
    """Issue #50: a server that answers every stream with ``: ping`` comments only, forever (one
    each 50 ms), ran 89 s under a 60 s limit once. Each run, step and fast mode, gets the time-limit
    line at the limit (the request's own timeout, 30 s, is longer)."""
    server = app.servers[backend]
    server.fault = Fault("pings")
    try:
        results, _, _ = faulted_alongside(app, server, ("step", "fast"), users=2)
    finally:
        server.fault = None
    for result, took in results:
        assert result == f"stopped: the run went past the {LIMIT_S} s time limit (DP_REQUEST_SECONDS); ask for fewer " \
                         "tokens", result
        assert LIMIT_S - 0.5 < took < LIMIT_S + 4, took


def assert_every_served_slot_free(app: LiveApp, backend: str) -> None:
    """16 users (DP_SERVED_CONCURRENCY) at once on the server answering well: none is refused, so no
    slot is still held by a run that ended (at its time limit, cancelled, failed)."""
    results, _, _ = faulted_alongside(app, app.servers[backend], ("step", "fast"), users=16)
    for i, (result, _) in enumerate(results):
        assert isinstance(result, dict), f"user {i + 1} of 16: {result}"
        assert result["generated_token_ids"] == ([10] * 8 if i % 2 == 0 else generated(8))


def test_a_connect_to_a_slow_server_ends_at_the_time_limit(app):
    """The issue's connect answered after 139 s under a 60 s limit. Servers listed but answering one
    byte a second from their first request, both backends, 4 users each (step and fast): each run
    connects in its own thread under its own limit and gets the time-limit line at the limit,
    holding no local slot meanwhile; a failed connection is not kept (the next run tries again)."""
    baseline = local_seconds(app.clients[0])
    slow = [app.slow_connect["llamacpp"], app.slow_connect["openai"]]
    beside: list[float] = []
    results, local, memory = faulted_alongside(app, slow, ("step", "step", "fast", "fast"), users=8,
                                               more=lambda: beside.extend(local_once(app.clients[0])
                                                                          for _ in range(ROUNDS - 1)))
    local = median([local, *beside])
    answered = ", ".join(f"{took:.1f}" for _, took in sorted(results, key=lambda r: r[1]))
    print(f"local {local:.2f} s beside 8 connects to slow servers ({baseline:.2f} s alone); RSS +{memory.growth:.0f} "
          f"MB peak; the 8 answered after {answered} s")
    for result, took in results:
        assert result == f"stopped: the run went past the {LIMIT_S} s time limit (DP_REQUEST_SECONDS); ask for fewer " \
                         "tokens", result
        assert LIMIT_S - 0.5 < took < LIMIT_S + 4, took
    assert local <= 2 * baseline and memory.growth < MEMORY_BOUND_MB
    app.slow_connect["openai"].fault = None  # it answers well now: the next run connects afresh and runs
    try:
        assert step_trace(app.clients[1], app.slow_connect["openai"].spec)["generated_token_ids"] == [10] * 8
    finally:
        app.slow_connect["openai"].fault = Fault("slow", paths=CONNECT_PATHS)


@pytest.mark.parametrize("mode", ["step", "fast"])
def test_a_cancelled_job_closes_the_server_s_connection(app, mode):
    server = app.servers["llamacpp"]
    server.fault = Fault("slow")
    try:
        job = app.clients[1].submit("hi", GREEDY8, "", False, served(app, "llamacpp"), "none", mode,
                                    api_name="/step_trace")
        # the run's start, a precondition: on two loaded cores (the other worker's browsers) a job has taken over
        # 10 s to reach the server; the assertions below time the cancel, not this
        started = time.monotonic()
        while server.open == 0 and time.monotonic() < started + 60:
            time.sleep(0.05)
        assert server.open == 1, f"the run never reached the server in {time.monotonic() - started:.0f} s"
        cancelled = time.monotonic()
        job.cancel()
        while server.open and time.monotonic() < cancelled + LIMIT_S:
            time.sleep(0.05)
        took = time.monotonic() - cancelled
    finally:
        server.fault = None
    assert server.open == 0 and took < 3.5, f"the connection stayed open {took:.1f} s after the cancel"
    if mode == "fast":  # both cancelled runs gave their slots back
        assert_every_served_slot_free(app, "llamacpp")


def test_no_connection_reaches_an_unlisted_host(app):
    for backend in ("llamacpp", "openai"):
        for mode in ("step", "fast"):
            result, took = outcome(app.clients[1], app.redirecting[backend].spec, mode)  # connect redirects
            assert_one_line(result, took, named(app.redirecting[backend]))
            assert "HTTP 302, a redirect: not followed" in result
            app.servers[backend].fault = Fault("redirect")  # connected; its runs redirect
            try:
                result, took = outcome(app.clients[1], served(app, backend), mode)
            finally:
                app.servers[backend].fault = None
            assert_one_line(result, took, names(app, backend))
    time.sleep(0.3)
    assert app.unlisted.connections == 0


# --- strict JSON out ---------------------------------------------------------------------------------
def call_raw(url: str, api_name: str, data: list, body_text: str | None = None) -> str:
    """A /gradio_api/call/<api_name> request (its body as given, or ``data`` as JSON); the result
    stream's text, as the server wrote it."""
    with httpx.Client(timeout=120) as http:
        content = body_text if body_text is not None else json.dumps({"data": data})
        event = http.post(f"{url}/gradio_api/call/{api_name}", content=content,
                          headers={"Content-Type": "application/json"}).json()["event_id"]
        return http.get(f"{url}/gradio_api/call/{api_name}/{event}").text


def data_of(stream: str) -> Any:
    """The last ``data:`` of a result stream, parsed strictly (NaN or Infinity would fail here)."""
    lines = [line[5:].strip() for line in stream.splitlines() if line.startswith("data:")]
    return strict_loads(lines[-1])


def test_every_served_run_s_json_is_strict(app):
    for backend in ("llamacpp", "openai"):
        for mode in ("step", "fast"):
            stream = call_raw(app.url, "step_trace", ["hi", GREEDY8, "", False, served(app, backend), "none", mode])
            trace = data_of(stream)[0]
            assert trace["generated_token_ids"] == ([10] * 8 if mode == "step" else generated(8))
    # a stream cut at max_new_tokens (both backends); llama-server's null log-probability (a probability
    # 0: -inf inside the run, never -Infinity out)
    cases = [("llamacpp", Fault("forever"), "fast", [10] * 8), ("openai", Fault("forever"), "fast", [10] * 8),
             ("llamacpp", Fault("value", "logprob", "null"), "step", [11] * 8)]
    for backend, fault, mode, expected in cases:
        app.servers[backend].fault = fault
        try:
            stream = call_raw(app.url, "step_trace", ["hi", GREEDY8, "", False, served(app, backend), "none", mode])
        finally:
            app.servers[backend].fault = None
        assert "Infinity" not in stream and "NaN" not in stream
        assert data_of(stream)[0]["generated_token_ids"] == expected, (backend, fault.kind)


def test_branch_never_echoes_a_parent_s_nan(app):
    parent = step_trace(app.clients[1], "embedded")
    parent["steps"][0]["chosen_prob"] = math.nan  # what a forged or broken parent may carry
    parent["steps"][0]["stages"][0]["entropy"] = math.inf
    body = json.dumps({"data": [parent, 2, parent["generated_token_ids"][2], "embedded", "none"]})  # NaN, Infinity
    assert "NaN" in body and "Infinity" in body
    branch = data_of(call_raw(app.url, "branch", [], body_text=body))[0]
    assert branch["steps"][0]["chosen_prob"] is None and branch["steps"][0]["stages"][0]["entropy"] is None


@pytest.mark.parametrize("forged", [-7, 1_000_000])
def test_branch_refuses_a_parent_s_forged_chosen_token_id(app, forged):
    from gradio_client.exceptions import AppError

    parent = step_trace(app.clients[1], "embedded")
    parent["steps"][1]["chosen_token_id"] = forged
    with pytest.raises(AppError) as caught:
        app.clients[1].predict(parent, 3, parent["generated_token_ids"][3], "embedded", "none", api_name="/branch")
    assert str(caught.value) == (f"parent: steps[1].chosen_token_id: expected generated_token_ids[1], an integer in "
                                 f"[0, 49152), got {forged}")


def test_kv_cache_kinds_report_refuses_kinds_that_are_not_names(app):
    from gradio_client.exceptions import AppError

    with pytest.raises(AppError) as caught:
        app.clients[1].predict("hi", False, 4, [1, 2], 32, "embedded", "none", api_name="/kv_cache_kinds_report")
    assert str(caught.value) == "kinds: expected a list or null (each item text), got [1, 2]"


# --- echoes, links, signals ------------------------------------------------------------------------------
def choice_event(url: str) -> tuple[int, list, int, str]:
    """A page event with a dropdown that takes only its choices: (fn_index, its inputs' default
    values, the dropdown's position among them, its label)."""
    with httpx.Client(timeout=60) as http:
        config = http.get(f"{url}/config").json()
    components = {c["id"]: c for c in config["components"]}
    for index, dep in enumerate(config["dependencies"]):
        for pos, cid in enumerate(dep["inputs"]):
            props = components[cid].get("props", {})
            if components[cid]["type"] == "dropdown" and not props.get("allow_custom_value"):
                values = [components[c].get("props", {}).get("value") for c in dep["inputs"]]
                return dep.get("id", index), values, pos, str(props.get("label"))
    raise AssertionError("no dropdown without custom values is an event input")


def test_a_10_mb_dropdown_value_is_refused_in_one_line_not_echoed(app, capfd):
    fn_index, values, pos, label = choice_event(app.url)
    values[pos] = "x" * (10 << 20)
    session = "dp-echo-test"
    capfd.readouterr()
    with httpx.Client(timeout=120) as http:
        joined = http.post(f"{app.url}/gradio_api/queue/join", json={"data": values, "fn_index": fn_index,
                                                                     "session_hash": session, "event_data": None})
        assert joined.status_code == 200, joined.text[:300]
        reply = http.get(f"{app.url}/gradio_api/queue/data", params={"session_hash": session}).text
    logged = capfd.readouterr()
    assert len(reply) < 10_000 and "x" * 2000 not in reply, f"{len(reply):,} characters came back"
    assert f"{label}: a value of 10,485,760 characters is over the 1,000-character limit" in reply
    assert len(logged.out) + len(logged.err) < 10_000


@pytest.mark.parametrize("param", ["share", "lesson"])
def test_a_link_over_65536_characters_says_it_is_too_long(app, param):
    def get(path: str) -> tuple[int, str]:  # http.client: httpx itself refuses an address this long
        connection = http.client.HTTPConnection(app.url.removeprefix("http://"), timeout=60)
        try:
            connection.request("GET", path)
            answer = connection.getresponse()
            return answer.status, answer.read().decode()
        finally:
            connection.close()

    status, text = get(f"/?{param}={'A' * 70_000}")
    assert status == 414 and "This link is too long" in text
    assert "It has 70," in text and "<a href='/'>Open the playground without it</a>" in text
    assert get(f"/?{param}={'A' * 7_000}")[0] == 200  # under the web limit: the page says what is wrong itself


def test_a_too_long_link_that_arrives_in_pieces_still_gets_the_page(app):
    """A browser's request often arrives in more than one piece: uvicorn's parser answered a head of
    over 16 KiB that came in two with a bare 400 (the phone run of the browser test below failed so);
    the app lets it hold the head, so the 414 page answers however it arrives (one, two, 40 pieces)."""
    head = f"GET /?lesson={'A' * 70_000} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode()
    host, port = app.url.removeprefix("http://").split(":")
    for pieces in (1, 2, 40):
        size = -(-len(head) // pieces)
        with socket.create_connection((host, int(port)), timeout=60) as sock:
            for start in range(0, len(head), size):
                sock.sendall(head[start:start + size])
                time.sleep(0.05)
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 414 "), (pieces, answer[:80])
        assert b"This link is too long" in answer and b"It has 70,0" in answer, pieces


@pytest.mark.browser
@pytest.mark.parametrize("width, height", [(390, 844), (1280, 720)], ids=["phone", "projector"])
def test_a_too_long_lesson_link_shows_so_in_the_browser(app, browser, width, height):
    """On a phone and on a projector: the page says so in words that fit the screen (no sideways
    scroll, the heading inside the width), and its link opens the app without the link."""
    phone = width < 600
    context = browser.new_context(viewport={"width": width, "height": height}, is_mobile=phone,
                                  has_touch=phone, device_scale_factor=2 if phone else 1)
    try:
        page = context.new_page()
        page.set_default_timeout(60_000)
        page.goto(f"{app.url}/?lesson={'A' * 70_000}")
        heading = page.get_by_role("heading", name="This link is too long")
        assert heading.is_visible()
        box = heading.bounding_box()
        assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= width, box
        assert page.evaluate("document.documentElement.scrollWidth") <= width
        font = page.evaluate("parseFloat(getComputedStyle(document.querySelector('p')).fontSize)")
        assert font * width / page.evaluate("window.innerWidth") >= 12  # readable: not a desktop page shrunk
        page.get_by_role("link", name="Open the playground without it").click()
        page.wait_for_selector("#dp-tabs", timeout=120_000)  # the app itself, without the link
    finally:
        context.close()


def test_sigterm_removes_the_private_download_folder(tmp_path):
    env = {**os.environ, "DP_DOWNLOAD_DIR": str(tmp_path), "DP_EXAMPLES": "0",
           "GRADIO_SERVER_PORT": str(free_port()), "GRADIO_SERVER_NAME": "127.0.0.1"}
    process = subprocess.Popen([sys.executable, "app.py", "--no-preload"], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while not list(tmp_path.glob("decoding-playground-*")) and time.monotonic() < deadline \
                and process.poll() is None:
            time.sleep(0.2)
        folders = list(tmp_path.glob("decoding-playground-*"))
        assert folders, "the app made no private folder"
        port = env["GRADIO_SERVER_PORT"]
        while time.monotonic() < deadline and process.poll() is None:  # the server is up: the signal lands in launch
            try:
                if httpx.get(f"http://127.0.0.1:{port}/config", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        process.send_signal(signal.SIGTERM)
        process.wait(60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)
    assert process.returncode == -signal.SIGTERM, process.stdout.read()[-2000:]
    assert not any(folder.exists() for folder in folders)

