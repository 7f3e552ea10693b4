"""Issue #50, a hostile tester's listed servers: numbers a llama-server or an OpenAI-compatible server
may send that no model makes (log-probabilities past ``exp``'s range, positive, flat below any 1/V),
a vLLM /metrics page built to be held 900 times or read past its limit, histogram buckets that make
latencies negative, and a stream of keep-alive comments that never ends. Each as the tester found it,
through the real code path (a RemoteModel connected to a fake server on loopback, run by
engine.runner; /metrics through MetricsWatch): one line naming the field and the value, or a
correct reading, never a traceback; memory and bytes read within the documented bounds."""

from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Iterator

import pytest

from engine import runner
from engine.backends import remote
from engine.backends.client import RemoteError, strict_loads
from engine.backends.served import RemoteSpec
from engine.config import DecodingConfig
from engine.runner import RunRequest
from tests.fault_servers import TOP_IDS, FakeServer, Fault

CONFIG = DecodingConfig(strategy="greedy", max_new_tokens=8, top_n=5)
SERVER_NAME = {"llamacpp": "llama.cpp server", "openai": "OpenAI-compatible server"}
ALL_MODES = ("step", "step-per-token", "fast")  # step mode's streamed continuation, its one-token answers, fast


@pytest.fixture(params=("llamacpp", "openai"))
def server(request) -> Iterator[FakeServer]:
    fake = FakeServer(request.param)
    yield fake
    fake.close()


def model_on(server: FakeServer, mode: str, timeout_s: float = 10.0):
    """A RemoteModel over the fake server (``mode`` as tests/test_fault_servers.py's ``model_on``)."""
    model = remote.connect_spec(RemoteSpec.parse(server.spec), timeout_s, "step" if mode == "step-per-token" else mode)
    return dataclasses.replace(model, verify=0) if mode == "step-per-token" else model


def run(model, control=None):
    return runner.run(RunRequest(model, "hi", CONFIG, control=control))


def one_line(call) -> str:
    """The one RemoteError line ``call()`` raises (anything else, a traceback's kind, fails the test)."""
    with pytest.raises(RemoteError) as caught:
        call()
    line = str(caught.value)
    assert "\n" not in line and len(line) < 400 and "Traceback" not in line, line
    return line


# --- 1. numbers past exp's range ------------------------------------------------------------------------
def probability_slot(backend: str, mode: str) -> bool:
    """Whether a value fault's "logprob" slot holds a probability there: llama-server's fast-mode stream
    sends its top-N after the sampler as probabilities (``post_sampling_probs``)."""
    return (backend, mode) == ("llamacpp", "fast")


def test_the_testers_flat_answer_below_exp_s_range_at_connect_is_one_line(server):
    """As found: every top log-probability -710 (all equal, below -709.78, where exp(-lp) overflows):
    connecting (which asks one top-N to see it is not flat) raised ``OverflowError: math range error``
    building its own error line. Now the top-N is refused where it is read, naming the field."""
    server.fault = Fault("value", "flat", "-710")
    line = one_line(lambda: model_on(server, "step"))
    path = "/completion" if server.backend == "llamacpp" else "/v1/completions"
    field = "completion_probabilities[0].top_logprobs" if server.backend == "llamacpp" else \
        "choices[0].logprobs.top_logprobs[0]"
    assert line == (f"{SERVER_NAME[server.backend]} {server.root}{path}: {field}: its most likely token has "
                    "log-probability -710, below log 2^-24 = -16.64: no distribution over a vocabulary is that flat")


@pytest.mark.parametrize("mode", ALL_MODES)
def test_a_flat_answer_below_exp_s_range_mid_run_is_one_line(server, mode):
    """The same answer from a server that answered well at connect, in every mode (llama-server's fast
    stream sends probabilities: 1e-309 each, whose logarithm is -711.5)."""
    model = model_on(server, mode)
    server.fault = Fault("value", "flat", "1e-309" if probability_slot(server.backend, mode) else "-710")
    line = one_line(lambda: run(model))
    assert line.startswith(f"{SERVER_NAME[server.backend]} {server.url}"), line
    assert re.search(r": (stream\[0\]\.)?(completion_probabilities|choices)\S*: its most likely token has "
                     r"log-probability -71[01]\.?\d*, below log 2\^-24", line), line


# (slot, raw JSON text, what the line says where the slot holds a log-probability, and where a probability)
HOSTILE_NUMBERS = [
    ("logprob", "-1e308", r"expected a log-probability of at least -10000 .*got -1e\+308",
     r"expected a probability in \[0, 1\], got -1e\+308"),
    ("logprob", "0.5", r"expected a log-probability \(a finite number <= 0\), got 0\.5", None),
    ("logprob", "3.5", r"expected a log-probability \(a finite number <= 0\), got 3\.5",
     r"expected a probability in \[0, 1\], got 3\.5"),
    ("logprob", "1e309", "the answer is not JSON", "the answer is not JSON"),
    ("logprob", "-1e309", "the answer is not JSON", "the answer is not JSON"),
    ("flat", "-1e308", r"expected a log-probability of at least -10000 .*got -1e\+308",
     r"expected a probability in \[0, 1\], got -1e\+308"),
]


def hostile_cases() -> list:
    """(backend, mode, slot, raw, what the line says) for every case where the number is wrong there."""
    cases = []
    for backend in SERVER_NAME:
        for mode in ALL_MODES:
            for at, raw, as_logprob, as_prob in HOSTILE_NUMBERS:
                says = as_prob if probability_slot(backend, mode) else as_logprob
                if says is not None:  # (a probability of 0.5 is a good one)
                    cases.append(pytest.param(backend, mode, at, raw, says, id=f"{backend}-{mode}-{at}={raw}"))
    return cases


@pytest.mark.parametrize("backend, mode, at, raw, says", hostile_cases())
def test_a_number_out_of_range_is_one_line_naming_the_field_and_the_value(backend, mode, at, raw, says):
    server = FakeServer(backend)
    try:
        model = model_on(server, mode)
        server.fault = Fault("value", at, raw)
        line = one_line(lambda: run(model))
    finally:
        server.close()
    assert line.startswith(f"{SERVER_NAME[backend]} {server.url}") and re.search(says, line), line
    if "not JSON" not in says:  # a value JSON can read: the line names its field
        assert re.search(r": (stream\[0\]\.)?(completion_probabilities|choices)\S*: ", line), line


def test_a_null_for_the_chosen_token_s_log_probability_is_one_line_on_an_openai_server():
    """-inf where the API has none: an OpenAI-compatible server's ``token_logprobs`` (llama-server's
    null is its probability 0 only in its own top-N)."""
    server = FakeServer("openai")
    try:
        for mode in ALL_MODES:
            model = model_on(server, mode)
            server.fault = Fault("value", "prob", "null")
            line = one_line(lambda: run(model))
            server.fault = None
            assert re.search(r"choices\[0\]\.logprobs\.token_logprobs\[0\]: expected a log-probability \(a finite "
                             r"number <= 0\), got None", line), (mode, line)
    finally:
        server.close()


@pytest.mark.parametrize("mode", ALL_MODES)
def test_one_log_probability_below_exp_s_range_is_a_probability_0(server, mode):
    """-710 for one token (1e-309 where the slot is a probability) is a good number: its probability is
    0 to a float (1e-309: a subnormal one). Step mode's greedy then picks the next token of the top-N (the fake's first is the
    one made 0); fast mode keeps the server's token, its top-N showing 0 for it; the trace is strict."""
    model = model_on(server, mode)
    slot_is_prob = probability_slot(server.backend, mode)
    # llama-server's fast mode also asks the raw top-N in a whole request: the fault is its stream's only
    server.fault = Fault("value", "logprob", "1e-309" if slot_is_prob else "-710", only="stream" if slot_is_prob else "")
    trace = run(model)
    text = trace.to_json()
    assert "Infinity" not in text and "NaN" not in text
    strict_loads(text)
    if mode == "fast":  # the faulted answer is one token and the stream's end
        assert trace.generated_token_ids == [TOP_IDS[0]]
        shown = {t.token_id: t.prob for t in trace.steps[0].stages[-1].top}
        assert shown[TOP_IDS[0]] < 1e-300 and shown[TOP_IDS[1]] == pytest.approx(0.25)
    else:
        assert trace.generated_token_ids == [TOP_IDS[1]] * 8
        assert all(step.chosen_prob > 0 for step in trace.steps)
