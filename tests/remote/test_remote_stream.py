"""Issue #29: fast mode is one streamed request (Server-Sent Events): an Event per token as the
server samples it, then the Trace. Against the real llama-server of tests/conftest.py (native
/completion and its /v1, marker `remote`), a real vLLM's streams replayed from tests/data/vllm/ (keep-alive
comments and an error chunk included), and tiny local servers that fail in the ways a server can."""

from __future__ import annotations

import http.server
import json
import math
import socket
import threading
import time
from typing import Iterator

import pytest

from engine.strategies import served_decode
from engine.backends import client, llamacpp, openai, served
from engine import runner
from engine.runner import RunRequest
from engine.config import DecodingConfig
from engine.numbers import percent
from engine.trace import Event
from tests.helpers.common import free_port
from tests.helpers.remote_llamacpp import PROMPT, llamacpp_greedy, server_test
from tests.data.vllm.record import CAPITAL, FAST
from tests.helpers.remote_openai import chunks, listed, recorded, vllm  # noqa: F401 (the fixture)
from tests.helpers.remote_stream import busy  # noqa: F401

GREEDY = DecodingConfig(strategy="greedy", max_new_tokens=24)


def timed(events: Iterator[Event]) -> list[tuple[float, Event]]:
    """Each event with the time.perf_counter() it arrived at."""
    return [(time.perf_counter(), event) for event in events]


def fast_events(model: served.RemoteModel, config: DecodingConfig, prompt: str = PROMPT) -> Iterator[Event]:
    fast = model.with_mode("fast")
    return served_decode.stream(fast, prompt, fast.encode(prompt), config)


# --- against the real server -----------------------------------------------------------------------
@server_test
def test_streamed_greedy_equals_llamacpp_greedy_natively_and_through_v1(server_model, llama_server):
    ids = server_model.encode(PROMPT)
    theirs = llamacpp_greedy(server_model, ids, 24)  # one plain, non-streamed request
    native = served_decode.run_fast(server_model, PROMPT, GREEDY)
    assert native.generated_token_ids == theirs
    assert native.extra["remote"]["streamed"] is True and native.extra["remote"]["mode"] == "fast"
    assert all([s.name for s in step.stages] == ["raw", "final"] for step in native.steps)
    assert native.steps[-1].finish_reason == "max_new_tokens" == native.stop_reason
    through_openai = openai.connect_openai(llama_server + "/v1", timeout_s=60, mode="fast")
    through_v1 = runner.run(RunRequest(through_openai, PROMPT, GREEDY))
    assert through_v1.generated_token_ids == theirs and through_v1.extra["remote"]["streamed"] is True
    native.to_json(), through_v1.to_json()  # strict JSON


@server_test
@pytest.mark.parametrize("api", ["native", "v1"])
def test_an_event_per_token_arrives_as_the_server_samples_it(server_model, llama_server, api):
    model = server_model if api == "native" else openai.connect_openai(llama_server + "/v1", timeout_s=60)
    start = time.perf_counter()
    arrived = timed(fast_events(model, GREEDY))
    *tokens, (_, last) = arrived
    trace = last.trace
    assert trace is not None and all(e.trace is None and len(e.steps) == 1 for _, e in tokens)
    assert [e.steps[0].chosen_token_id for _, e in tokens] == trace.generated_token_ids and len(tokens) == 24
    elapsed = [e.steps[0].elapsed_ms for _, e in tokens]
    assert elapsed == sorted(elapsed) and elapsed[0] > 0
    # Unstreamed, all 24 events would come at once after the whole text; streamed, they spread
    # over the generation: the first came well before the last (a third of the run at least).
    spread, run = tokens[-1][0] - tokens[0][0], tokens[-1][0] - start
    print(f"{api}: first token after {tokens[0][0] - start:.3f} s, last after {run:.3f} s")
    assert spread > run / 3


@server_test
def test_stopping_after_two_events_ends_the_server_s_request(server_model, llama_server):
    counting = "1, 2, 3, 4, 5, 6, 7, 8,"  # greedy counts on, no EOS: 1024 tokens take seconds to generate
    events = fast_events(server_model, GREEDY.replace(max_new_tokens=1024), counting)
    first = [next(events), next(events)]
    assert [len(e.steps) for e in first] == [1, 1]
    start = time.perf_counter()
    events.close()  # what a Stop in the UI does to the stream
    assert time.perf_counter() - start < 1.0
    deadline = time.perf_counter() + 3  # the server notices at its next token's write
    while busy(llama_server) and time.perf_counter() < deadline:
        time.sleep(0.1)
    assert not busy(llama_server), "the closed stream's request still runs on the server"
    after = served_decode.run_fast(server_model, PROMPT, GREEDY.replace(max_new_tokens=6))
    assert after.generated_token_ids == llamacpp_greedy(server_model, server_model.encode(PROMPT), 6)


@server_test
def test_a_stop_string_ends_the_stream_with_the_token_that_completed_it(server_model):
    prompt = "The capital of France is"
    ids = server_model.encode(prompt)
    config = DecodingConfig(strategy="greedy", max_new_tokens=24, stop=["."])
    answer = server_model.client.post("/completion", {"prompt": ids, "n_predict": 24, "samplers": ["top_k"],
                                                      "top_k": 1, "stop": ["."], "return_tokens": True})
    trace = served_decode.run_fast(server_model, prompt, config)
    assert trace.generated_token_ids == answer["tokens"] and trace.stop_reason == "stop_string"
    assert trace.text == answer["content"]
    # a whole answer's probabilities leave the stop string's token out: its step has the final stage only
    assert [s.name for s in trace.steps[-1].stages] == ["final"] and math.isnan(trace.steps[-1].raw_prob)
    assert any("completed a stop string" in a for a in trace.extra["remote"]["approximations"])


# --- vLLM's streams ------------------------------------------------------------------------------------
def test_vllm_s_stream_gives_an_event_per_token_then_the_trace(vllm):  # noqa: F811 (the fixture)
    url, state = vllm
    model = listed(url).with_mode("fast")
    events = list(runner.stream(RunRequest(model, CAPITAL, FAST, chat=True)))
    trace = events[-1].trace
    streamed = [c["choices"][0] for c in chunks("fast")]
    assert [e.steps[0].chosen_token_id for e in events[:-1]] == trace.generated_token_ids == \
        [c["token_ids"][0] for c in streamed]
    assert trace.stop_reason == "max_new_tokens" and trace.text == "".join(c["text"] for c in streamed)
    assert trace.extra["remote"]["streamed"] is True
    assert trace.steps[1].chosen_prob == pytest.approx(math.exp(streamed[1]["logprobs"]["token_logprobs"][0]))
    first = streamed[0]["logprobs"]["top_logprobs"][0]
    assert [t.token_id for t in trace.steps[0].stages[0].top[:2]] == \
        [int(k.split(":")[1]) for k, _ in sorted(first.items(), key=lambda kv: -kv[1])[:2]]
    [body] = [b for p, b in state["requests"] if p == "/v1/completions" and b.get("stream")]
    assert body["stream"] is True and body["logprobs"] == 5


def test_keep_alive_comments_in_vllm_s_stream_are_read_past(vllm):  # noqa: F811
    """vLLM (--sse-keep-alive-interval) sends ``: keep-alive`` comment lines while a stream is idle (here a
    1,500-token prefill): the run reads past them and shows the tokens that follow."""
    url, _ = vllm
    [stream] = [e for e in recorded("keep_alive") if "sse" in e]
    assert stream["sse"].startswith(": keep-alive\n\n") and stream["sse"].count(": keep-alive") >= 2
    [tokenized] = recorded("keep_alive", "/tokenize")
    prompt = tokenized["body"]["prompt"]
    trace = runner.run(RunRequest(listed(url).with_mode("fast"), prompt, DecodingConfig(strategy="greedy", max_new_tokens=3)))
    assert trace.generated_token_ids == [c["choices"][0]["token_ids"][0] for c in chunks("keep_alive")]
    assert len(trace.steps) == 3 and trace.stop_reason == "max_new_tokens"


def test_an_error_chunk_in_vllm_s_stream_is_one_line(vllm):  # noqa: F811
    """vLLM refuses a streamed request inside the stream (HTTP 200, an ``error`` chunk, then [DONE])."""
    url, state = vllm
    model = listed(url).with_mode("fast")
    state["stream_error"] = True
    with pytest.raises(client.RemoteError) as caught:
        runner.run(RunRequest(model, CAPITAL, FAST, chat=True))
    assert str(caught.value) == (f"OpenAI-compatible server {url}/completions: the stream says: Requested sample "
                                 "logprobs of 500, which is greater than max allowed: 100 (parameter=logprobs, "
                                 "value=500)")


# --- servers that fail -----------------------------------------------------------------------------
def offline_fast(url: str, timeout_s: float) -> served.RemoteModel:
    """A fast-mode RemoteModel at ``url`` that asks nothing when made (no /v1/models, no /props)."""
    api = llamacpp.LlamaCppApi(client.JsonClient(url, timeout_s))
    return served.RemoteModel(f"llamacpp:{url}", api, served.RemoteTokenizer(api), 100, (0,), mode="fast")


def fail_fast(url: str, timeout_s: float = 0.5) -> tuple[str, float]:
    """The RemoteError line of a fast-mode run at ``url``, and how long it took."""
    start = time.perf_counter()
    with pytest.raises(client.RemoteError) as caught:
        list(served_decode.stream(offline_fast(url, timeout_s), "hi", [1, 2], GREEDY))
    return str(caught.value), time.perf_counter() - start


def test_a_closed_port_is_one_line():
    url = f"http://127.0.0.1:{free_port()}"
    line, took = fail_fast(url)
    assert line.startswith(f"llama.cpp server {url}/completion: cannot connect") and "\n" not in line
    assert took < 1.5


def test_a_server_that_never_answers_is_one_line_within_the_timeout():
    with socket.socket() as listener:  # accepts connections (the kernel's backlog), never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        line, took = fail_fast(url)
    assert line == f"llama.cpp server {url}/completion: no answer within the 0.5 s timeout"
    assert took < 1.5


class SseHandler(http.server.BaseHTTPRequestHandler):
    """Answers every POST with ``server.events`` as a stream, then waits ``server.stall`` seconds
    before closing (a server that stops mid-stream)."""

    def do_POST(self):  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(self.server.events.encode())
        self.wfile.flush()
        time.sleep(self.server.stall)

    def log_message(self, *args):
        pass


@pytest.fixture
def sse() -> Iterator[http.server.ThreadingHTTPServer]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), SseHandler)
    server.daemon_threads = True
    server.stall = 0.0
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


TOKEN = ('data: {"completion_probabilities": [{"id": 5, "prob": 1.0, "top_probs": [{"id": 5, "token": " x", '
         '"prob": 1.0}]}], "tokens": [5]}\n\n')


@pytest.mark.parametrize("events, says", [
    (TOKEN + 'data: {"completion_probabilities": [{"id": 6, "prob": NaN}]}\n\n',
     "the answer is not JSON (non-finite number NaN in the answer)"),
    ("data: not json\n\n", "the answer is not JSON (Expecting value: line 1 column 1 (char 0))"),
    ('data: {"error": {"code": 500, "message": "the model\\nbroke"}}\n\n', "the stream says: the model broke"),
    (TOKEN, "the stream ended before its last chunk (stop: true)"),
    ('data: {"completion_probabilities": [{"id": 5}], "tokens": [5]}\n\n',
     "a streamed chunk without completion_probabilities (id, prob) per token")])
def test_a_malformed_stream_is_one_line(sse, events, says):
    sse.events = events
    url = f"http://127.0.0.1:{sse.server_address[1]}"
    line, _ = fail_fast(url, 5)
    assert line == f"llama.cpp server {url}/completion: {says}"


def test_a_stream_that_stalls_is_one_line_within_the_timeout(sse):
    sse.events, sse.stall = TOKEN, 3
    url = f"http://127.0.0.1:{sse.server_address[1]}"
    events = served_decode.stream(offline_fast(url, 0.5), "hi", [1, 2], GREEDY)
    assert next(events).steps[0].chosen_token_id == 5  # the first token is shown before the stall
    start = time.perf_counter()
    with pytest.raises(client.RemoteError) as caught:
        next(events)
    assert time.perf_counter() - start < 1.5
    assert str(caught.value) == f"llama.cpp server {url}/completion: no answer within the 0.5 s timeout"


@pytest.fixture(scope="module")
def speculating_server(llama_server_binary) -> Iterator[str]:
    """A second real llama-server doing its own speculative decoding: the embedded GGUF drafts for itself."""
    from engine.backends.local import gguf_path
    from tests.helpers.common import serve_llama

    with serve_llama(llama_server_binary, "-md", str(gguf_path()), "--spec-type", "draft-simple",
                     log_name="llama-server-speculative.log") as url:
        yield url


REPEATING = "Monday, Tuesday, Wednesday, Thursday, Friday. Monday, Tuesday, Wednesday, Thursday, Friday. Monday,"


@server_test
def test_llama_server_s_own_speculation_is_reported_and_loses_nothing(speculating_server, server_model):
    from playground.charts.remote import remote_markdown

    speculating = llamacpp.connect(speculating_server, timeout_s=60)
    events = list(fast_events(speculating, GREEDY, REPEATING))
    trace = events[-1].trace
    assert len(events) == len(trace.steps) + 1  # every token streamed as it came, the drafts included
    spec = trace.extra["remote"]["server_speculative"]  # the server's timings.draft_n / draft_n_accepted
    bare = [e.steps[0] for e in events[:-1] if not e.steps[0].stages]  # accepted drafts: streamed without p
    assert bare and any(f"{len(bare)} tokens came from the server's own speculation without probabilities" in a
                        for a in trace.extra["remote"]["approximations"])
    assert all([st.name for st in step.stages] == ["raw", "final"] and step.chosen_prob == pytest.approx(1.0)
               for step in trace.steps)  # the trace has both lists for every token (greedy: p = 1)
    assert spec["drafted"] > 0 and 0 < spec["accepted"] <= spec["drafted"]
    assert spec["acceptance_rate"] == pytest.approx(spec["accepted"] / spec["drafted"])
    # greedy speculative decoding is lossless: llama.cpp's own greedy on the plain server, token for token
    assert trace.generated_token_ids == llamacpp_greedy(server_model, server_model.encode(REPEATING), 24)
    line = remote_markdown(trace)
    assert (f"**llama-server's own speculative decoding:** drafted {spec['drafted']}, accepted {spec['accepted']} "
            f"({percent(spec['acceptance_rate'])})") in line, line
    plain = served_decode.run_fast(server_model, REPEATING, GREEDY)
    assert "server_speculative" not in plain.extra["remote"] and "speculative" not in remote_markdown(plain)


@server_test
def test_a_token_outside_the_raw_top_n_has_no_raw_p_and_the_summary_says_so(server_model):
    config = DecodingConfig(strategy="sample", temperature=1.5, top_n=2, max_new_tokens=24, seed=11)
    trace = served_decode.run_fast(server_model, "Name a colour of the sea.", config)
    outside = [s for s in trace.steps if math.isnan(s.raw_prob)]
    inside = [s for s in trace.steps if not math.isnan(s.raw_prob)]
    assert inside and all(s.raw_prob > 0 for s in inside)
    assert outside  # at T = 1.5 with nothing cut, most picks fall outside the raw top 2: unknown, not 0
    assert any(f"{len(outside)} of the {len(trace.steps)} tokens lie outside the raw top 2" in a
               for a in trace.extra["remote"]["approximations"])
    assert json.loads(trace.to_json())["summary"]["perplexity"] is None  # strict JSON: unknown is null, not NaN
    from playground.charts.step import summary_markdown

    line = summary_markdown(trace)  # the page says so too
    assert "(raw model unknown)" in line and "perplexity unknown" in line and "nan" not in line, line
    json.loads(trace.to_json(), parse_constant=lambda name: pytest.fail(f"{name} in the trace JSON"))
