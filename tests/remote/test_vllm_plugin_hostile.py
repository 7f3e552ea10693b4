"""Issue #50: hostile ``vllm_xargs`` against the real vLLM with our draws processor loaded
(tests/conftest.py's ``vllm_server``, started as deploy/vllm_serve.py starts it). A request once took the
engine core down (``"dp_top": Infinity``: int() raised OverflowError inside ``update_state``, every other
user's stream ended and the server refused connections). Here any JSON, and JSON text Python's json does
not write strictly (Infinity, NaN, 1e999, a 400-digit integer), goes into every field while normal streams
run at once: each hostile request gets an answer below 500, one the processor refuses is vLLM's own greedy
answer, the server answers a normal request as before after each case, and every concurrent stream ends
with its expected text. The oracles: vLLM's own greedy answers taken before the hostile requests, and
dp_args.draw_args for which arguments the processor takes."""

from __future__ import annotations

import base64
import json
import threading
import urllib.error
import urllib.request
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from deploy.vllm_plugin.dp_args import STATE_BYTES, draw_args
from deploy.vllm_serve import SERVED_NAME
from engine.backends.client import JsonClient

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]

PROMPT = "The capital of France is Paris. The capital of Italy is"
STREAMED = "Monday, Tuesday, Wednesday, Thursday, Friday. Monday, Tuesday, Wednesday, Thursday, Friday. Monday,"
STATE = base64.b64encode(torch.Generator().manual_seed(1).get_state().numpy().tobytes()).decode()
RAW = "\x00raw:"  # a string value starting so goes into the body as the raw JSON text after it
# JSON text Python's json.dumps writes (Infinity, NaN) or that parses to inf (1e999), and other oddities
RAW_VALUES = ["Infinity", "-Infinity", "NaN", "1e999", "-1e999", "1" + "0" * 400, "-0.0", "5e-324", "true", "null",
              '"100"', '"\\ud800"', "[]", "{}", '[["top_k", Infinity]]', "[1e999]"]
REPORTED = [{"dp_state": STATE, "dp_top": RAW + "Infinity"}, {"dp_state": STATE, "dp_top": RAW + "1e999"},
            {"dp_state": STATE, "dp_chain": '[["top_k", Infinity]]'}]


def send(url: str, xargs: Any, max_tokens: int = 4) -> tuple[int, Any, Any]:
    """A greedy /v1/completions of PROMPT with ``xargs`` as ``vllm_xargs`` (a string value starting with
    RAW written as raw JSON text); (status, its JSON or text, ``vllm_xargs`` as a JSON parser reads the body)."""
    raws: list[str] = []

    def mark(value: Any) -> Any:
        if isinstance(value, str) and value.startswith(RAW):
            raws.append(value[len(RAW):])
            return f"{RAW}{len(raws) - 1}"
        return value

    fields = {key: mark(value) for key, value in xargs.items()} if isinstance(xargs, dict) else xargs
    text = json.dumps({"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                       "return_token_ids": True, "vllm_xargs": fields})  # allow_nan: Infinity, NaN as they are
    for i, raw in enumerate(raws):
        text = text.replace(json.dumps(f"{RAW}{i}"), raw)
    request = urllib.request.Request(url + "/v1/completions", text.encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, json.load(answer), json.loads(text)["vllm_xargs"]
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")[:300], json.loads(text)["vllm_xargs"]


class Streams(threading.Thread):
    """Normal streamed greedy requests, one after another, until ``stop``: their texts and finish reasons,
    or the error that ended one."""

    def __init__(self, client: JsonClient, body: dict[str, Any]):
        super().__init__(daemon=True)
        self.client, self.body, self.stop = client, body, threading.Event()
        self.texts: list[str] = []
        self.reasons: list[str | None] = []
        self.errors: list[str] = []

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                events = list(self.client.stream_post("/completions", self.body))
            except Exception as exc:  # the server died or refused: recorded, the test fails on it
                self.errors.append(f"{type(exc).__name__}: {exc}")
                return
            choices = [e["choices"][0] for e in events if e.get("choices")]
            self.texts.append("".join(c.get("text") or "" for c in choices))
            self.reasons.append(choices[-1].get("finish_reason") if choices else None)


@pytest.fixture(scope="module")
def live(vllm_server):
    """The live server's URL and its greedy tokens of PROMPT (4 and 6 tokens), taken before any hostile
    request; normal requests stream from a background thread until this module's tests end, and each
    must end with vLLM's own greedy text, taken before as well."""
    greedy = {n: send(vllm_server, None, n)[1]["choices"][0]["token_ids"] for n in (4, 6)}
    client = JsonClient(vllm_server + "/v1", 120, "vLLM")
    body = {"model": SERVED_NAME, "prompt": STREAMED, "max_tokens": 12, "temperature": 0, "stream": True}
    expected = client.post("/completions", {**body, "stream": False})["choices"][0]["text"]
    streams = Streams(client, body)
    streams.start()
    yield vllm_server, greedy
    streams.stop.set()
    streams.join(300)
    assert not streams.is_alive() and streams.errors == [], streams.errors
    assert streams.texts and streams.texts == [expected] * len(streams.texts), streams.texts
    assert streams.reasons == ["length"] * len(streams.texts)  # each ran to its 12 tokens
    print(f"{len(streams.texts)} normal streams of {expected!r} ended alongside the hostile requests")


def check(live: tuple[str, dict[int, list[int]]], xargs: Any) -> None:
    """``xargs`` sent: an answer below 500, vLLM's own greedy tokens where it answers and the processor
    refuses them; then a normal request still gets its greedy tokens."""
    url, greedy = live
    status, answer, parsed = send(url, xargs)
    assert status < 500, (xargs, status, answer)
    if status == 200 and draw_args(parsed) is None:
        assert answer["choices"][0]["token_ids"] == greedy[4], xargs
    status, answer, _ = send(url, None, 6)
    assert status == 200 and answer["choices"][0]["token_ids"] == greedy[6], (xargs, status, answer)


@pytest.mark.parametrize("xargs", REPORTED, ids=["top-infinity", "top-1e999", "chain-top-k-infinity"])
def test_the_reported_requests_get_vllm_s_own_answer_and_the_server_keeps_serving(live, xargs):
    check(live, xargs)


raw = st.sampled_from(RAW_VALUES).map(lambda text: RAW + text)
scalars = (st.none() | st.booleans() | st.integers() | st.sampled_from([10**30, -(2**63), 2**64]) | st.floats()
           | st.text(max_size=12))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
names = st.sampled_from(["temperature", "top_k", "top_p", "min_p", "typical_p"]) | st.text(max_size=8)
pairs = st.tuples(names, scalars | st.floats(0, 2) | st.integers(0, 200)).map(list)
chains = (st.lists(pairs, max_size=4).map(json.dumps)
          | st.sampled_from(['[["top_k", Infinity]]', '[["top_p", NaN]]', '[["temperature", 1e999]]', "[[", ""]))
states = (st.just(STATE) | st.integers(0, len(STATE) - 1).map(lambda i: STATE[:i] + "*" + STATE[i + 1:])
          | st.binary(min_size=STATE_BYTES, max_size=STATE_BYTES).map(lambda b: base64.b64encode(b).decode()))
fields = {"dp_state": states | json_values | raw, "dp_top": json_values | st.integers(-2, 1002) | raw,
          "dp_chain": chains | json_values | raw}
ours = st.fixed_dictionaries({"dp_state": fields["dp_state"]}, optional={k: fields[k] for k in ("dp_top", "dp_chain")})
hostile = ours | st.fixed_dictionaries({}, optional=fields) | json_values


@settings(max_examples=35, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(hostile)
@example(REPORTED[0])
@example({"dp_state": STATE, "dp_top": 100, "dp_chain": '[["temperature", 0.8], ["top_k", 50]]'})  # a valid one
def test_any_json_in_any_field_leaves_the_server_serving_everyone(live, xargs):
    check(live, xargs)
