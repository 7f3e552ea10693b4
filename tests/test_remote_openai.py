"""Issue #29: the OpenAI-compatible backend (engine.backends.openai.OpenAIApi): against llama-server's own
/v1 endpoint (the real server of tests/conftest.py, marker `remote`) and against vLLM's response
schema served by a small local HTTP server from tests/data/vllm/ (see its README)."""

from __future__ import annotations

import http.server
import json
import math
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from engine.backends import client, llamacpp, openai, remote, served
from engine import runner
from engine.runner import RunRequest
from engine.config import DecodingConfig
from tests.test_remote_llamacpp import PROMPT, llamacpp_greedy, server_test

VLLM = Path(__file__).parent / "data" / "vllm"
EOS = 151643


def fixture(name: str) -> Any:
    return json.loads((VLLM / name).read_text())


class VllmHandler(http.server.BaseHTTPRequestHandler):
    """Answers as vLLM would from the recordings; ``server.state`` holds the bodies received, an
    error to reply (``fail``: (status, file)), a delay, and whether /tokenize exists."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        self._reply(200, fixture("models.json") if self.path == "/v1/models" else None)

    def do_POST(self):  # noqa: N802
        state = self.server.state
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        state["requests"].append((self.path, body))
        time.sleep(state.get("delay", 0))
        if state.get("fail") and self.path == "/v1/completions":
            status, name = state["fail"]
            return self._reply(status, fixture(name))
        if self.path == "/tokenize" and state.get("tokenize", True):
            return self._reply(200, fixture("tokenize.json"))
        if self.path == "/detokenize":
            vocab = fixture("vocab.json")
            return self._reply(200, {"prompt": "".join(vocab[str(t)] for t in body["tokens"])})
        if self.path == "/v1/completions":
            if body.get("stream"):
                return self._stream("completions_stream.sse")
            if body.get("prompt_logprobs"):
                return self._reply(200, fixture("completions_prompt_logprobs.json"))
            if body["max_tokens"] == 1:
                return self._reply(200, fixture("completions_step.json")["by_prompt_length"][str(len(body["prompt"]))])
            return self._reply(200, fixture("completions_fast.json"))
        self._reply(404, None)

    def _reply(self, status: int, data: Any) -> None:
        text = json.dumps(data if data is not None else {"detail": "Not Found"}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(text)))
        self.end_headers()
        self.wfile.write(text)

    def _stream(self, name: str) -> None:
        """Server-Sent Events from a recording, then the connection closes (HTTP/1.0)."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write((VLLM / name).read_bytes())

    def log_message(self, *args):
        pass


@pytest.fixture
def vllm() -> Iterator[tuple[str, dict]]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), VllmHandler)
    server.state = {"requests": []}
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1", server.state
    server.shutdown()


def step_tops() -> list[dict[str, float]]:
    answers = fixture("completions_step.json")["by_prompt_length"]
    return [answers[k]["choices"][0]["logprobs"]["top_logprobs"][0] for k in ("5", "6", "7")]


# --- vLLM's schema ---------------------------------------------------------------------------------
def test_connecting_reads_the_model_and_its_context(vllm):
    url, _ = vllm
    model = openai.connect_openai(url, timeout_s=5)
    assert model.name == f"openai:{url}" and model.backend == "openai" and model.api.dialect == "vllm"
    assert model.api.model_id == "Qwen/Qwen2.5-0.5B-Instruct" and model.context == 32768
    assert model.vocab_size == openai.VOCAB_BOUND and model.eos_token_ids == ()  # vLLM reports neither
    given = openai.connect_openai(url, timeout_s=5, vocab_size=151936, eos_token_ids=[EOS])
    assert (given.vocab_size, given.eos_token_ids) == (151936, (EOS,))


def test_step_mode_parses_vllm_logprobs_and_records_the_tail_mass(vllm):
    url, state = vllm
    model = openai.connect_openai(url, timeout_s=5, vocab_size=151936, eos_token_ids=[EOS]).with_mode("step", 5)
    trace = runner.run(RunRequest(model, "The capital of France is", DecodingConfig(strategy="greedy", max_new_tokens=8)))
    assert trace.generated_token_ids == [12095, 13, EOS] and trace.stop_reason == "eos"
    assert trace.text == " Paris."
    tails = [1 - sum(math.exp(lp) for lp in top.values()) for top in step_tops()]
    assert trace.extra["remote"]["tail_mass"] == pytest.approx(tails, abs=1e-6)
    assert trace.extra["remote"]["backend"] == "openai" and trace.extra["remote"]["top_n"] == 5
    raw = trace.steps[0].stages[0]
    assert raw.name == "raw" and [t.token for t in raw.top[:2]] == [" Paris", " the"]
    assert raw.top[0].prob == pytest.approx(math.exp(-0.2107) / (1 - tails[0]), rel=1e-5)  # renormalised over top-5
    completions = [body for path, body in state["requests"] if path == "/v1/completions"]
    assert [len(b["prompt"]) for b in completions] == [5, 6, 7]
    assert all(b["max_tokens"] == 1 and b["logprobs"] == 5 and b["temperature"] == 0
               and b["return_tokens_as_token_ids"] and b["model"] == "Qwen/Qwen2.5-0.5B-Instruct" for b in completions)
    trace.to_json()  # strict JSON


def test_fast_mode_shows_the_server_s_tokens_and_top_n(vllm):
    url, state = vllm
    model = openai.connect_openai(url, timeout_s=5, vocab_size=151936, eos_token_ids=[EOS], mode="fast")
    config = DecodingConfig(strategy="sample", temperature=0.7, top_p=0.9, typical_p=0.5, max_new_tokens=3, top_n=5)
    trace = runner.run(RunRequest(model, "The capital of France is", config))
    assert trace.generated_token_ids == [12095, 13, EOS] and trace.stop_reason == "eos"
    assert [s.name for s in trace.steps[0].stages] == ["raw"]
    assert trace.steps[1].chosen_prob == pytest.approx(math.exp(-0.3466))
    assert [n["key"] for n in trace.extra["remote"]["unmapped"]] == ["typical_p"]
    [body] = [b for p, b in state["requests"] if p == "/v1/completions"]
    assert (body["temperature"], body["top_p"], body["top_k"], body["max_tokens"], body["logprobs"]) == \
        (0.7, 0.9, -1, 3, 5)


def test_prompt_logprobs_are_read_per_position(vllm):
    url, _ = vllm
    model = openai.connect_openai(url, timeout_s=5)
    rows = model.api.prompt_logprobs([785, 6722, 315, 9625, 374, 12095], 2)
    assert rows[0] is None and len(rows) == 6
    assert rows[1] == {6722: -7.1253, 374: -1.2040, 525: -2.0794}  # the prompt's own token, then the top 2
    assert rows[5][12095] == -0.2107


@pytest.mark.parametrize("status, name, message", [
    (400, "error_400.json", "This model's maximum context length is 32768 tokens."),
    (500, "error_500.json", "EngineCore encountered an issue.")])
def test_an_error_reply_is_one_line_naming_the_url(vllm, status, name, message):
    url, state = vllm
    model = openai.connect_openai(url, timeout_s=5)
    state["fail"] = (status, name)
    with pytest.raises(client.RemoteError) as caught:
        runner.run(RunRequest(model, "The capital of France is", DecodingConfig(strategy="greedy", max_new_tokens=2)))
    line = str(caught.value)
    assert line.startswith(f"OpenAI-compatible server {url}/completions: HTTP {status}: {message}")
    assert "\n" not in line and len(line) < 400


def test_a_slow_server_is_one_line_within_the_timeout(vllm):
    url, state = vllm
    model = openai.connect_openai(url, timeout_s=0.5)
    state["delay"] = 2
    start = time.perf_counter()
    with pytest.raises(client.RemoteError) as caught:
        model.api.next_top([785], 5)
    assert time.perf_counter() - start < 1.5
    assert str(caught.value) == f"OpenAI-compatible server {url}/completions: no answer within the 0.5 s timeout"


def test_a_server_without_tokenize_says_so(vllm):
    url, state = vllm
    state["tokenize"] = False
    model = openai.connect_openai(url, timeout_s=5)
    with pytest.raises(client.RemoteError, match=r"/tokenize: missing \(HTTP 404\); step mode needs the server's "
                                                 r"tokenizer"):
        model.encode("The capital of France is")


# --- llama-server's own OpenAI endpoint ------------------------------------------------------------
@server_test
def test_greedy_step_mode_through_llama_server_s_openai_endpoint_equals_its_greedy(llama_server):
    model = openai.connect_openai(llama_server + "/v1", timeout_s=60)
    native = llamacpp.connect(llama_server, timeout_s=60)
    assert model.api.dialect == "llamacpp" and model.vocab_size == native.vocab_size
    assert model.eos_token_ids == native.eos_token_ids and model.encode(PROMPT) == native.encode(PROMPT)
    config = DecodingConfig(strategy="greedy", max_new_tokens=16)
    theirs = llamacpp_greedy(native, native.encode(PROMPT), 16)
    step = runner.run(RunRequest(model, PROMPT, config))
    assert step.generated_token_ids == theirs
    assert runner.run(RunRequest(model.with_mode("fast"), PROMPT, config)).generated_token_ids == theirs
    top, _ = remote.top_logits(model, native.encode(PROMPT), 20)
    same, _ = remote.top_logits(native, native.encode(PROMPT), 20)
    assert (top - same).nan_to_num().abs().max() < 1e-5  # the same raw top-N through both APIs
    with pytest.raises(client.RemoteError, match="prompt_logprobs: not supported by llama-server's OpenAI endpoint"):
        model.api.prompt_logprobs(native.encode(PROMPT), 2)


def test_the_operator_spec_carries_vllm_s_vocabulary_and_eos(vllm):
    url, _ = vllm
    text = f"openai:{url}#vocab=151936&eos={EOS}+151645"
    spec = served.RemoteSpec.parse(text)
    assert (spec.vocab_size, spec.eos_token_ids, str(spec)) == (151936, (EOS, 151645), text)
    [listed] = served.allowed_remote_models({"DP_REMOTE_MODELS": text})  # the list's commas stay separators
    model = remote.connect_spec(listed, timeout_s=5)
    assert (model.vocab_size, model.eos_token_ids, model.backend) == (151936, (EOS, 151645), "openai")
    for bad in (f"openai:{url}#vocab=lots", f"openai:{url}#top=5", "llamacpp:http://h:8080#vocab=5"):
        with pytest.raises(ValueError, match=r"^model: option .* expected openai:\.\.\.#vocab=<n>&eos=<id>\+<id>"):
            served.RemoteSpec.parse(bad)
