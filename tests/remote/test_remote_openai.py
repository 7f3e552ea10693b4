"""Issue #29 / #37: the OpenAI-compatible backend (engine.backends.openai.OpenAIApi): against llama-server's own
/v1 endpoint (the real server of tests/conftest.py, marker `remote`) and against a real vLLM's answers
replayed by a small local HTTP server from tests/data/vllm/ (recorded from vLLM 0.32.0 by
tests/data/vllm/record.py: see its README). The live vLLM tests are tests/remote/test_vllm_live.py."""

from __future__ import annotations

import math
import time
from typing import Iterator

import pytest

from engine import runner
from engine.backends import client, llamacpp, openai, remote, served
from engine.config import DecodingConfig
from engine.runner import RunRequest
from tests.data.vllm.record import CAPITAL, FAST, GREEDY, HOT, PERIOD, SCORED_LENGTH, STEP_TOP, STORY
from tests.helpers.remote_llamacpp import PROMPT, llamacpp_greedy, server_test
from tests.helpers.remote_openai import EOS, VOCAB, chunks, fixture, listed, recorded, replay, vllm  # noqa: F401

NAME = "SmolLM2-135M-Instruct"


@pytest.fixture
def broken_vllm(monkeypatch) -> Iterator[tuple[str, dict]]:
    """The same, replaying the real vLLM over the folder in the old layout (tied embedding under one name)."""
    monkeypatch.setenv("DP_STEP_VERIFY_TOKENS", "0")
    yield from replay("broken.json")


def top_of(answer: dict) -> dict[int, float]:
    """A recorded one-token answer's top list: {token id: log-probability}."""
    [top] = answer["choices"][0]["logprobs"]["top_logprobs"]
    return {int(k.split(":")[1]): v for k, v in top.items()}


def step_tops() -> list[dict[int, float]]:
    """The top-5 of each recorded step-mode answer, in order."""
    return [top_of(e["answer"]) for e in recorded("step")]


# --- vLLM's answers ----------------------------------------------------------------------------------
def test_connecting_reads_the_model_and_its_context(vllm):
    url, _ = vllm
    model = openai.connect_openai(url, timeout_s=5)
    assert model.name == f"openai:{url}" and model.backend == "openai" and model.api.dialect == "vllm"
    assert model.api.model_id == NAME and model.context == 2048
    assert model.vocab_size == openai.VOCAB_BOUND and model.eos_token_ids == ()  # vLLM reports neither
    given = listed(url)
    assert (given.vocab_size, given.eos_token_ids, given.api.stop_token_ids) == (VOCAB, (EOS,), (EOS,))


def test_step_mode_parses_vllm_logprobs_and_records_the_tail_mass(vllm):
    url, state = vllm
    model = listed(url).with_mode("step", STEP_TOP)
    trace = runner.run(RunRequest(model, CAPITAL, GREEDY, chat=True))
    tops = step_tops()
    assert trace.generated_token_ids == [max(top, key=top.get) for top in tops]  # greedy: each top-1
    assert trace.generated_token_ids[-1] == EOS and trace.stop_reason == "eos" and len(tops) < GREEDY.max_new_tokens
    assert trace.text == "The capital of France is Paris."
    tails = [1 - sum(math.exp(lp) for lp in top.values()) for top in tops]
    assert trace.extra["remote"]["tail_mass"] == pytest.approx(tails, abs=1e-6)
    assert trace.extra["remote"]["backend"] == "openai" and trace.extra["remote"]["top_n"] == STEP_TOP
    raw = trace.steps[0].stages[0]
    assert raw.name == "raw" and [t.token for t in raw.top[:2]] == ["The", "A"]
    assert raw.top[0].prob == pytest.approx(math.exp(tops[0][504]) / (1 - tails[0]), rel=1e-5)  # renormalised
    completions = [body for path, body in state["requests"] if path == "/v1/completions"][1:]  # after connect's
    start = len(model.encode(CAPITAL, chat=True))
    assert [len(b["prompt"]) for b in completions] == list(range(start, start + len(tops)))
    assert all(b["max_tokens"] == 1 and b["logprobs"] == STEP_TOP and b["temperature"] == 0
               and b["return_tokens_as_token_ids"] and b["model"] == NAME for b in completions)
    trace.to_json()  # strict JSON


def test_fast_mode_shows_the_server_s_tokens_and_top_n(vllm):
    url, state = vllm
    model = listed(url).with_mode("fast")
    trace = runner.run(RunRequest(model, CAPITAL, FAST, chat=True))
    streamed = [c["choices"][0] for c in chunks("fast")]
    assert trace.generated_token_ids == [c["token_ids"][0] for c in streamed]
    assert streamed[-1]["finish_reason"] == "length" and trace.stop_reason == "max_new_tokens"
    assert [s.name for s in trace.steps[0].stages] == ["raw"]
    assert trace.steps[1].chosen_prob == pytest.approx(math.exp(streamed[1]["logprobs"]["token_logprobs"][0]))
    assert [n["key"] for n in trace.extra["remote"]["unmapped"]] == ["typical_p"]
    [body] = [b for p, b in state["requests"] if p == "/v1/completions" and b.get("stream")]
    assert (body["temperature"], body["top_p"], body["top_k"], body["max_tokens"], body["logprobs"]) == \
        (0.7, 0.9, -1, FAST.max_new_tokens, 5)
    assert body["stop_token_ids"] == [EOS]  # the operator's EOS ids: fast mode stops where step mode does


def test_prompt_logprobs_are_read_per_position(vllm):
    url, _ = vllm
    model = openai.connect_openai(url, timeout_s=5)
    [exchange] = recorded("prompt_logprobs")
    ids = exchange["body"]["prompt"]
    rows = model.api.prompt_logprobs(ids, SCORED_LENGTH)
    assert rows[0] is None and len(rows) == len(ids)
    answer = exchange["answer"]["choices"][0]["prompt_logprobs"]
    for i in range(1, len(ids)):  # the prompt's own token, then the top 2 (3 entries when it is not among them)
        assert ids[i] in rows[i] and len(rows[i]) in (2, 3)
        assert rows[i] == {int(k): v["logprob"] for k, v in answer[i].items()}
    assert rows[1][ids[1]] < min(v for k, v in rows[1].items() if k != ids[1])  # rank 133: outside the top 2, exact
    start = len(model.encode(CAPITAL, chat=True))  # after the chat prompt: the step answer's top, one request apart
    first = step_tops()[0]
    assert all(abs(rows[start][t] - first[t]) < 1e-4 for t in rows[start])


@pytest.mark.parametrize("status, name, message", [
    (400, "error_400.json", "Requested sample logprobs of 101, which is greater than max allowed: 100 "
                            "(parameter=logprobs, value=101)"),
    (404, "error_404.json", f"The model `no-such-model` does not exist. Valid aliases: {NAME}.")])
def test_an_error_reply_is_one_line_naming_the_url(vllm, status, name, message):
    url, state = vllm
    model = openai.connect_openai(url, timeout_s=5)
    state["fail"] = (status, name)
    with pytest.raises(client.RemoteError) as caught:
        runner.run(RunRequest(model, "The capital of France is", GREEDY.replace(max_new_tokens=2)))
    line = str(caught.value)
    assert line == f"OpenAI-compatible server {url}/completions: HTTP {status}: {message}"
    assert fixture(name)["body"]["error"]["message"] == message and "\n" not in line


def test_a_slow_server_is_one_line_within_the_timeout(vllm):
    url, state = vllm
    model = openai.connect_openai(url, timeout_s=0.5)
    state["delay"] = 2
    start = time.perf_counter()
    with pytest.raises(client.RemoteError) as caught:
        model.api.next_top([785], 5)
    assert time.perf_counter() - start < 1.5
    assert str(caught.value) == f"OpenAI-compatible server {url}/completions: no answer within the 0.5 s timeout"


def test_a_server_without_tokenize_says_so_at_connect(vllm):
    url, state = vllm
    state["tokenize"] = False
    with pytest.raises(client.RemoteError, match=r"/tokenize: missing \(HTTP 404\); step mode needs the server's "
                                                 r"tokenizer"):
        openai.connect_openai(url, timeout_s=5)


# --- a served model that is no model (issue #37) ------------------------------------------------------
def test_a_model_whose_weights_did_not_load_is_named_at_connect(broken_vllm):
    url, _ = broken_vllm
    [probe] = recorded("broken", name="broken.json")
    flat = top_of(probe["answer"]).values()  # vLLM's own answer: every one of its top 100 at log 1/V
    assert len(flat) == 100 and all(lp == pytest.approx(-math.log(VOCAB), abs=1e-4) for lp in flat)
    with pytest.raises(client.RemoteError) as caught:
        listed(url)
    assert str(caught.value) == (f"OpenAI-compatible server {url}: the served model answers a uniform distribution "
                                 f"(its top 100 log-probabilities are all -10.8027 = log 1/{VOCAB}): its weights did "
                                 "not load")


@pytest.mark.parametrize("vocab, eos, says", [
    (1000, (EOS,), "{root}/tokenize: tokens[1]: expected a token id in [0, 1000), got 3575 (the vocabulary of 1000 "
                   "does not fit the tokenizer: give the model's own size, #vocab=)"),
    (VOCAB, (50000,), "{url}: EOS 50000 does not fit the tokenizer (it reads '', which tokenises as []; vocabulary "
                      f"{VOCAB}): give the model's own EOS ids (#eos=)")])
def test_a_vocabulary_or_eos_that_does_not_fit_is_one_line_at_connect(vllm, vocab, eos, says):
    url, _ = vllm
    with pytest.raises(client.RemoteError) as caught:
        openai.connect_openai(url, timeout_s=5, vocab_size=vocab, eos_token_ids=eos)
    assert str(caught.value) == "OpenAI-compatible server " + says.format(url=url, root=url.removesuffix("/v1"))


def test_a_top_list_of_n_plus_one_entries_is_read_right(vllm):
    """vLLM's top list puts the sampled token first and adds it as an N+1st entry when it lies outside
    the top N: the step's top-N are the N best, best first, and the token's own p is known."""
    url, _ = vllm
    trace = runner.run(RunRequest(listed(url).with_mode("fast"), STORY, HOT))
    streamed = [c["choices"][0]["logprobs"] for c in chunks("n_plus_one")]
    outside = 0
    for step, logprobs in zip(trace.steps, streamed, strict=True):
        sent = {int(k.split(":")[1]): v for k, v in logprobs["top_logprobs"][0].items()}
        best = sorted(sent.items(), key=lambda kv: -kv[1])[:HOT.top_n]
        [raw] = step.stages
        assert [(t.token_id, t.prob) for t in raw.top] == [(t, pytest.approx(math.exp(lp))) for t, lp in best]
        assert step.raw_prob == pytest.approx(math.exp(logprobs["token_logprobs"][0]))
        outside += len(sent) == HOT.top_n + 1 and step.chosen_token_id not in [t.token_id for t in raw.top]
    assert outside >= 3  # at T = 2 most picks lie outside the raw top 2 (the recording: 8 of 8)


def test_an_int_stop_reason_is_an_eos_stop(vllm):
    """An operator's EOS ids go to vLLM as stop_token_ids; a stop on one of them comes back as an int
    stop_reason (a stop string's is the string): an EOS stop, as step mode stops there."""
    url, state = vllm
    trace = runner.run(RunRequest(listed(url, EOS, PERIOD).with_mode("fast"), CAPITAL, GREEDY, chat=True))
    last = chunks("eos_stop_token")[-1]["choices"][0]
    assert (last["finish_reason"], last["stop_reason"], last["token_ids"]) == ("stop", PERIOD, [PERIOD])
    assert trace.stop_reason == "eos" and trace.generated_token_ids[-1] == PERIOD
    assert trace.text == "The capital of France is Paris"  # an EOS is not text
    [body] = [b for p, b in state["requests"] if b.get("stream")]
    assert body["stop_token_ids"] == [EOS, PERIOD]


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
    text = f"openai:{url}#vocab={VOCAB}&eos={EOS}+{PERIOD}"
    spec = served.RemoteSpec.parse(text)
    assert (spec.vocab_size, spec.eos_token_ids, spec.top_n, str(spec)) == (VOCAB, (EOS, PERIOD), None, text)
    [listed_spec] = served.allowed_remote_models({"DP_REMOTE_MODELS": text})  # the list's commas stay separators
    model = remote.connect_spec(listed_spec, timeout_s=5)
    assert (model.vocab_size, model.eos_token_ids, model.backend, model.top_n) == (VOCAB, (EOS, PERIOD), "openai", 100)
    topped = served.RemoteSpec.parse(text + "&top=20")
    assert topped.top_n == 20 and str(topped) == text + "&top=20"
    assert not model.api.server_draws  # draws=1 only where the operator says its vLLM has our processor
    drawn = served.RemoteSpec.parse(text + "&draws=1")
    assert drawn.draws and str(drawn) == text + "&draws=1" and str(served.RemoteSpec.parse(text + "&draws=0")) == text
    assert remote.connect_spec(drawn, timeout_s=5).api.server_draws
    assert str(served.RemoteSpec.parse(f"openai:{url}#draws=1&top=20&eos={EOS}+{PERIOD}&vocab={VOCAB}")) == \
        text + "&top=20&draws=1"  # any order in, the one order out (the list compares that text)
    texts = served.RemoteSpec.parse(f"openai:{url}#tokenizer=embedded&draws=1&eos={EOS}+{PERIOD}&vocab={VOCAB}")
    assert texts.tokenizer == "embedded" and str(texts) == text + "&draws=1&tokenizer=embedded"
    assert served.RemoteSpec.parse(text).tokenizer == ""  # token texts from the server unless the operator says
    for bad in (f"openai:{url}#vocab=lots", f"openai:{url}#top=5+6", f"openai:{url}#top=0", f"openai:{url}#top=5000",
                f"openai:{url}#best=5", "llamacpp:http://h:8080#vocab=5", f"openai:{url}#draws=2",
                f"openai:{url}#draws=01", f"openai:{url}#draws=", "llamacpp:http://h:8080#draws=1",
                f"openai:{url}#tokenizer=gpt2", f"openai:{url}#tokenizer=", f"openai:{url}#tokenizer=/etc/passwd",
                f"openai:{url}#tokenizer=Embedded", "llamacpp:http://h:8080#tokenizer=embedded"):
        with pytest.raises(ValueError, match=r"^model: option .* expected openai:\.\.\.#vocab=<n>&eos=<id>\+<id>"
                                             r"\[&top=<1\.\.1000>\]"):
            served.RemoteSpec.parse(bad)


def test_a_tokenizer_the_app_cannot_load_is_one_line_at_connect(monkeypatch):
    """tokenizer=embedded where the embedded model's tokenizer does not load (not installed): connecting
    says so in one line, before any request."""
    from engine.backends import local

    def missing():
        raise local.ModelLoadError("The embedded model is not installed here: run make setup\n(more lines)")

    monkeypatch.setattr(local, "embedded_tokenizer", missing)
    text = "openai:http://127.0.0.1:9/v1#vocab=49152&eos=2&tokenizer=embedded"
    with pytest.raises(client.RemoteError) as caught:
        remote.connect_spec(served.RemoteSpec.parse(text), timeout_s=1)
    assert str(caught.value) == (f"{text}: tokenizer=embedded: the embedded model's tokenizer did not load (The "
                                 "embedded model is not installed here: run make setup)")


@pytest.mark.parametrize("key, value, says", [
    ("token_id:\u00b2", -1.0, r"\[\'token_id:²\'\]: expected token_id:<id>, got 'token_id:²'"),  # isdigit, not int()
    ("token_id:\u0663", -1.0, r"expected token_id:<id>, got 'token_id:٣'"),  # a digit, not an ASCII one
    ("token_id:-1", -1.0, r"expected token_id:<id>"),
    ("token_id:", -1.0, r"expected token_id:<id>"),
    ("token_id:12345678901", -1.0, r"expected token_id:<id>"),
    ("token_id:49152", -1.0, r"expected a token id in \[0, 49152\), got 49152"),
    ("token:1", -1.0, r"expected token_id:<id>"),
    ("token_id:7", True, r"\[\'token_id:7\'\]: expected a log-probability .*got True"),
    ("token_id:7", 0.5, r"expected a log-probability .*got 0\.5"),
    ("token_id:7", "-1", r"expected a log-probability"),
    ("token_id:7", None, r"expected a log-probability"),
    ("token_id:7", -math.inf, r"expected a log-probability .*got -inf"),
], ids=["superscript", "arabic-digit", "negative", "empty", "eleven-digits", "outside", "prefix", "bool", "positive",
        "string", "null", "minus-infinity"])
def test_a_hostile_top_n_entry_is_one_line_naming_it(key, value, says):
    """vLLM's top-N (``{"token_id:<id>": logprob}``, N per token: read without naming each entry) still
    refuses each bad entry in a line that names it."""
    from engine.backends.schema import Schema
    s = Schema("vLLM http://x/v1/completions", 49152)
    with pytest.raises(client.RemoteError, match=says) as caught:
        openai._top({"token_id:3": -0.5, key: value}, s, "top_logprobs[0]", 101)
    assert str(caught.value).startswith("vLLM http://x/v1/completions: top_logprobs[0][")


def test_a_good_top_n_is_read_as_before():
    """Good entries: ids and log-probabilities as sent, an int 0 and a rounding slack above 0 read as 0."""
    from engine.backends.schema import Schema
    s = Schema("vLLM http://x/v1/completions", 49152)
    assert openai._top({"token_id:3": -0.5, "token_id:49151": -2.25}, s, "t", 101) == [(3, -0.5, None),
                                                                                       (49151, -2.25, None)]
    assert openai._top({"token_id:0": 0}, s, "t", 101) == [(0, 0.0, None)]
    assert openai._top({"token_id:9": 5e-5}, s, "t", 101) == [(9, 0.0, None)]
