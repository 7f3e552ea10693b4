"""Issue #38: step mode verifying the server's greedy continuation (engine.backends.remote.
stream_verified) equals one-request-per-token step mode token for token and trace for trace.

Marker `remote`: the real llama-server (tests/conftest.py's llama_server), directly and through a
loopback proxy that edits its continuations (a token the server did not pick at the first, a middle
or the last position, with the positions after it garbled so that reading them would change the
run; fewer tokens than asked). Marker `vllm`: the real vLLM. The rest needs no server.
"""

from __future__ import annotations

import base64
import dataclasses
import http.server
import json
import math
import threading
import time
import urllib.request
from dataclasses import replace
from typing import Any, Callable, Iterator

import pytest
import torch

from engine.strategies import served_decode
from engine import runner
from engine.backends import llamacpp
from engine.config import DecodingConfig
from engine.control import RunControl, RunStopped
from engine.runner import RunRequest
from engine.settings import SettingsError
from playground.charts.remote import remote_markdown

PROMPT = "The history of the printing press begins"
GREEDY = DecodingConfig(strategy="greedy", max_new_tokens=20)
SAMPLED = DecodingConfig(strategy="sample", temperature=0.8, top_k=50, top_p=0.9, seed=11, max_new_tokens=20)
PENALISED = DecodingConfig(strategy="sample", temperature=1.0, repetition_penalty=1.3, presence_penalty=0.4, seed=5,
                           max_new_tokens=20)
MIROSTAT = DecodingConfig(strategy="sample", mirostat=2, mirostat_tau=3.0, seed=3, max_new_tokens=20)


def server_test(fn):
    return pytest.mark.remote(pytest.mark.slow(pytest.mark.timeout(2400)(fn)))


def close(a: Any, b: Any, where: str, tol: float) -> None:
    """``a`` == ``b``, floats within ``tol`` (NaN equals NaN), recursively; ``where`` names a difference."""
    if isinstance(a, float) and isinstance(b, float):
        assert (math.isnan(a) and math.isnan(b)) or abs(a - b) <= tol or a == b, f"{where}: {a} != {b}"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            close(a[k], b[k], f"{where}.{k}", tol)
    elif isinstance(a, list):
        assert len(a) == len(b), f"{where}: {len(a)} != {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b)):
            close(x, y, f"{where}[{i}]", tol)
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def same_run(verified, plain, tol: float = 1e-5) -> None:
    """The verified run's trace is the one-request-per-token run's: tokens, stop, and every step's
    record (draws, stages' kept counts, masses, entropies and top-N) within ``tol``; only the
    steps' times and the label's verification record differ."""
    assert verified.generated_token_ids == plain.generated_token_ids
    assert verified.stop_reason == plain.stop_reason and verified.text == plain.text
    for i, (a, b) in enumerate(zip(verified.steps, plain.steps)):
        untimed = {"elapsed_ms": 0.0}
        close(dataclasses.asdict(a) | untimed, dataclasses.asdict(b) | untimed, f"step {i}", tol)
    label = dict(verified.extra["remote"])
    verification = label.pop("verified")
    close(label, plain.extra["remote"], "extra.remote", tol)
    assert "verified" not in plain.extra["remote"]
    # the label covers the run's new steps (a branch's trace also holds its parent's steps before it)
    assert verification["steps"] == len(verified.extra["remote"]["tail_mass"]) == len(verification["server_token"])
    assert verification["accepted"] == sum(verification["server_token"])
    assert verification["drafted"] >= verification["steps"] and verification["requests"] <= verification["steps"]
    strict(verified)


def strict(trace) -> dict:
    """The trace's JSON, refusing NaN / Infinity."""
    def refuse(name):
        raise AssertionError(f"non-strict JSON constant {name}")
    return json.loads(trace.to_json(), parse_constant=refuse)


def run(model, config, k: int, prompt: str = PROMPT):
    return runner.run(RunRequest(replace(model, verify=k), prompt, config))


# --- no server needed ------------------------------------------------------------------------------
def test_the_count_asked_grows_while_kept_and_shrinks_to_what_a_disagreement_gave():
    v = served_decode.Verified(8)
    assert v.next_count() == 4  # the first request asks up to 4
    v.asked, v.gave = [4], [4]
    assert v.next_count() == 8  # kept whole: twice as many, at most 8
    v.asked, v.gave = [4, 8], [4, 2]
    assert v.next_count() == 4  # a disagreement at its 2nd position: twice the 2 steps it gave
    v.asked, v.gave = [4, 8, 4], [4, 2, 1]
    assert v.next_count() == 2
    assert served_decode.Verified(1).next_count() == 1
    v = served_decode.Verified(3)
    v.asked, v.gave = [3], [3]
    assert v.next_count() == 3


def test_greedy_with_no_stage_asks_the_whole_count_first_and_any_other_run_asks_four_then_at_most_eight():
    """Greedy with no stage picks the raw argmax, the server's own greedy token: its first request asks
    every token the setting allows. A run that may part from it (a stage, a draw) asks FIRST_ASK first and
    at most PARTING_MOST per request (a disagreement drops the rest of what was read)."""
    v = served_decode.verify_plan(GREEDY, 32)
    assert (v.tokens, v.first, v.next_count()) == (32, 32, 32) and v.label()["first"] == 32
    v.asked, v.gave = [32], [5]
    assert v.next_count() == 10  # a disagreement: twice the 5 steps that request gave
    assert served_decode.verify_plan(GREEDY, 2).next_count() == 2
    for config in (SAMPLED, PENALISED, MIROSTAT, replace(GREEDY, repetition_penalty=1.3)):
        v = served_decode.verify_plan(config, 32)
        assert (v.tokens, v.first) == (served_decode.PARTING_MOST, served_decode.FIRST_ASK) == (8, 4), config
        assert v.next_count() == 4
        v.asked, v.gave = [4, 8], [4, 8]
        assert v.next_count() == 8  # kept whole, yet at most 8
    v = served_decode.verify_plan(SAMPLED, 3)
    assert (v.tokens, v.first, v.next_count()) == (3, 3, 3)


def test_the_step_through_sentence_is_made_of_the_label_s_numbers():
    from playground.charts.remote import verified_sentence

    v = served_decode.Verified(8, requests=3, drafted=14, server=[True] * 7 + [False] + [True] * 2)
    line = verified_sentence(v.label())
    assert line == (" **Verified continuations:** 9 of 10 tokens were the server's own greedy continuation "
                    "(90.0% accepted) and 1 ours where our chain picked another; 3 requests instead of 10, the same "
                    "tokens as one request per token (4 drafted tokens dropped).")
    assert verified_sentence(served_decode.Verified(8).label()) == "" and verified_sentence(None) == ""
    ours = served_decode.Verified(8, 8, served_decode.OUR_DRAWS, requests=2, drafted=12, server=[True] * 12).label()
    assert verified_sentence(ours) == (
        " **Verified continuations:** 12 of 12 tokens were the server's drafts of our own draws, made with our chain "
        "and our seeded generator (100% accepted) and 0 ours where our chain picked another; 2 requests instead of 12, "
        "the same tokens as one request per token (0 drafted tokens dropped).")


def test_an_empty_record_is_strict_json():
    label = served_decode.Verified(8).label()
    assert label["acceptance"] is None and label["steps"] == 0
    json.dumps(label, allow_nan=False)


def test_the_setting_picks_the_count_and_a_bad_value_is_one_line(monkeypatch):
    from engine.backends.served import RemoteModel

    model = RemoteModel("x", None, None, 10, ())
    monkeypatch.delenv("DP_STEP_VERIFY_TOKENS", raising=False)
    assert served_decode.verify_tokens(model) == served_decode.VERIFY_TOKENS
    monkeypatch.setenv("DP_STEP_VERIFY_TOKENS", "0")
    assert served_decode.verify_tokens(model) == 0
    assert served_decode.verify_tokens(replace(model, verify=3)) == 3  # the model's own count comes first
    monkeypatch.setenv("DP_STEP_VERIFY_TOKENS", "65")
    with pytest.raises(SettingsError, match="^DP_STEP_VERIFY_TOKENS: expected an integer from 0 to 64, got 65$"):
        served_decode.verify_tokens(model)
    monkeypatch.setenv("DP_STEP_VERIFY_TOKENS", "many")
    with pytest.raises(SettingsError, match="^DP_STEP_VERIFY_TOKENS: expected an integer >= 0, got 'many'$"):
        served_decode.verify_tokens(model)
    with pytest.raises(ValueError, match=r"^verify: expected 0\.\.64 continuation tokens per request, got 99$"):
        replace(model, verify=99)


# --- the real llama-server -------------------------------------------------------------------------
@server_test
@pytest.mark.parametrize("config", [GREEDY, SAMPLED, PENALISED, MIROSTAT], ids=["greedy", "top-k-top-p", "penalties",
                                                                           "mirostat"])
def test_verified_step_mode_is_one_request_per_token_step_mode(server_model, config):
    for prompt in (PROMPT, "Once upon a time, a lighthouse keeper"):
        plain = run(server_model, config, 0, prompt)
        verified = run(server_model, config, 8, prompt)
        same_run(verified, plain)
        v = verified.extra["remote"]["verified"]
        print(config.strategy, v["requests"], "requests,", v["accepted"], "of", v["steps"], "accepted")
        assert v["requests"] < len(plain.steps) or not config.is_greedy  # fewer requests (greedy: most kept)
        if config.is_greedy:
            assert v["accepted"] == v["steps"]  # a greedy chain always agrees with the greedy server
        assert f"{v['accepted']} of {v['steps']} tokens were the server's own" in remote_markdown(verified)


@server_test
def test_a_branch_continues_verified_as_one_request_per_token(server_model):
    for config in (SAMPLED, MIROSTAT):  # a stateless chain skips draws; mirostat replays its prefix
        parent = run(server_model, config, 0)
        other = next(t.token_id for t in parent.steps[3].stages[0].top if t.token_id != parent.generated_token_ids[3])
        kids = [runner.collect(runner.branch(replace(server_model, verify=k), parent, 3, other)) for k in (0, 8)]
        same_run(kids[1], kids[0])


class Proxy(http.server.BaseHTTPRequestHandler):
    """Forwards to the real llama-server; a continuation (n_predict > 1, streamed) is read whole from
    it, its tokens' entries go through the test's ``edit`` as one answer, and the edited entries go
    out as a stream again (one event each, then the server's last event). Records each
    continuation request's n_predict."""

    def do_GET(self):
        self._forward(None)

    def do_POST(self):
        self._forward(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))

    def _forward(self, body: Any) -> None:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.server.upstream + self.path, data, method=self.command,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as answer:
            raw = answer.read()
        if body is not None and self.path == "/completion" and body.get("n_predict", 1) > 1:
            assert body.get("stream"), "a continuation is streamed"
            events = [json.loads(line[len(b"data: "):]) for line in raw.splitlines() if line.startswith(b"data: ")]
            entries = [e["completion_probabilities"][0] for e in events if e.get("completion_probabilities")]
            self.server.asked.append(body["n_predict"])
            edited = self.server.edit(len(self.server.asked) - 1, {"completion_probabilities": entries,
                                                                  "tokens": [e["id"] for e in entries]})
            out = [{"completion_probabilities": [e], "tokens": [e["id"]], "stop": False}
                   for e in edited["completion_probabilities"]] + [events[-1]]
            return self._send([b"data: " + json.dumps(e).encode() + b"\n\n" for e in out], "text/event-stream")
        self._send([raw], "application/json")

    def _send(self, pieces: list[bytes], kind: str) -> None:
        """``pieces`` one by one, ``server.pause_s`` after the first (a server still making the rest)."""
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(sum(map(len, pieces))))
        self.end_headers()
        try:
            for i, piece in enumerate(pieces):
                self.wfile.write(piece)
                self.wfile.flush()
                if i == 0 and len(pieces) > 1:
                    time.sleep(self.server.pause_s)
        except (BrokenPipeError, ConnectionResetError):  # the client closed the stream at a disagreement
            pass

    def log_message(self, *args):
        pass


@pytest.fixture
def proxied(llama_server) -> Iterator[Callable[[Callable[[int, dict], dict]], Any]]:
    """``connect(edit)``: the real llama-server behind a proxy applying ``edit(request index, answer)``
    to each continuation answer, connected (verify 8); the proxy's ``asked`` list."""
    servers = []

    def connect(edit, pause_s: float = 0.0):
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
        server.upstream, server.edit, server.asked, server.pause_s = llama_server, edit, [], pause_s
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        model = llamacpp.connect(f"http://127.0.0.1:{server.server_address[1]}", timeout_s=120)
        return replace(model, verify=8), server.asked

    yield connect
    for server in servers:
        server.shutdown()


def lie_at(position: int, request: int = 0) -> Callable[[int, dict], dict]:
    """An edit: request ``request``'s continuation names another token (its position's second best)
    at ``position``, and every position after it carries the first position's top-N (reading them
    would change the run)."""
    def edit(index: int, answer: dict) -> dict:
        probs = answer["completion_probabilities"]
        if index == request and position < len(probs):
            entry = probs[position]
            entry["id"] = entry["top_logprobs"][1]["id"]
            for later in probs[position + 1:]:
                later["top_logprobs"] = probs[0]["top_logprobs"]
        return answer
    return edit


@server_test
@pytest.mark.parametrize("position", [0, 3, 7], ids=["first", "middle", "last"])
def test_a_disagreement_takes_ours_and_drops_the_positions_after_it(proxied, position):
    model, asked = proxied(lie_at(position))
    plain = run(model, GREEDY, 0)  # through the proxy too (one token per request: never edited)
    verified = runner.run(RunRequest(model, PROMPT, GREEDY))
    same_run(verified, plain)
    v = verified.extra["remote"]["verified"]
    assert asked[0] == v["first"] == 8  # greedy with no stage asks the whole setting at once: position 7 is its last
    assert v["server_token"][:position + 1] == [True] * position + [False]  # ours at the lie
    assert all(v["server_token"][position + 1:])  # the next request went on from our token
    assert v["asked"][1] == min(8, 2 * (position + 1))  # the next count: twice what the first request gave


@server_test
def test_the_first_token_shows_while_the_server_still_makes_the_rest(proxied):
    """A step-mode continuation is read as it streams: a server that sends its first token and then
    takes 2 s over the rest shows that token at once, as fast mode does (the whole run takes the 2 s)."""
    model, asked = proxied(lambda index, answer: answer, pause_s=2.0)
    start = time.perf_counter()
    events = runner.stream(RunRequest(model, PROMPT, GREEDY))
    first = next(e for e in events if e.steps)
    shown = time.perf_counter() - start
    trace = next(e.trace for e in events if e.trace is not None)
    took = time.perf_counter() - start
    assert first.steps[0].chosen_token_id == trace.generated_token_ids[0] and asked[0] == 8
    print(f"first token {shown:.2f} s, the run {took:.2f} s")
    assert shown < 1.5 and took >= 2.0


@server_test
def test_a_server_that_returns_fewer_tokens_than_asked(proxied):
    def fewer(index: int, answer: dict) -> dict:
        answer["completion_probabilities"] = answer["completion_probabilities"][:1 + index % 2]
        answer["tokens"] = answer.get("tokens", [])[:1 + index % 2]
        return answer

    model, asked = proxied(fewer)
    for config in (GREEDY, SAMPLED):
        plain = run(model, config, 0)
        verified = runner.run(RunRequest(model, PROMPT, config))
        same_run(verified, plain)
        v = verified.extra["remote"]["verified"]
        assert v["drafted"] <= 2 * v["requests"] and v["requests"] >= len(plain.steps) // 2


@server_test
def test_a_server_that_returns_more_tokens_than_asked_is_one_line(proxied):
    def more(index: int, answer: dict) -> dict:
        answer["completion_probabilities"] = answer["completion_probabilities"] * 3
        return answer

    model, _ = proxied(more)
    with pytest.raises(llamacpp.RemoteError, match=r"completion_probabilities.*"):
        runner.run(RunRequest(model, PROMPT, GREEDY))


@server_test
def test_stop_mid_run_ends_within_a_step_with_the_same_steps(server_model):
    plain = run(server_model, SAMPLED, 0)
    control = RunControl()
    steps = []
    with pytest.raises(RunStopped):
        for event in runner.stream(RunRequest(replace(server_model, verify=8), PROMPT, SAMPLED, control=control)):
            steps += event.steps
            if len(steps) == 5:  # in the middle of a continuation (the first asks 4, the next up to 8)
                control.cancel()
    assert [s.chosen_token_id for s in steps] == plain.generated_token_ids[:5]
    assert [s.draw for s in steps] == [s.draw for s in plain.steps[:5]]


# --- the real vLLM ---------------------------------------------------------------------------------
@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("config", [GREEDY, SAMPLED, PENALISED], ids=["greedy", "top-k-top-p", "penalties"])
def test_verified_step_mode_on_vllm_is_one_request_per_token_step_mode(vllm_model, config):
    plain = run(vllm_model, config, 0)
    verified = run(vllm_model, config, 8)
    same_run(verified, plain, tol=1e-4)  # vLLM's decode and prefill kernels round differently
    v = verified.extra["remote"]["verified"]
    print(config.strategy, v["requests"], "requests,", v["accepted"], "of", v["steps"], "accepted")
    if config.is_greedy:
        assert v["accepted"] == v["steps"] and v["requests"] < len(plain.steps)
    elif set(config.active_stages()) <= set(served_decode.SERVER_DRAW_STAGES):  # the server drafted our draws
        assert v["accepted"] == v["steps"] and v["requests"] < len(plain.steps)


# --- the server drafting our draws (deploy/vllm_plugin/dp_draws.py, the spec's draws=1) -------------------
STATE = base64.b64encode(torch.Generator().manual_seed(1).get_state().numpy().tobytes()).decode()  # a valid one
PLAIN_SAMPLING = DecodingConfig(strategy="sample", seed=21, max_new_tokens=24)
MIN_P = DecodingConfig(strategy="sample", temperature=1.3, min_p=0.05, seed=22, max_new_tokens=24)
TYPICAL = DecodingConfig(strategy="sample", top_p=0.95, typical_p=0.9, temperature=0.9, seed=23, max_new_tokens=24,
                         stage_order=("typical_p", "temperature", "top_p"))


def recorded(model):
    """``model`` with the bodies of its streamed /completions requests kept (``model.api.client.bodies``)."""
    from engine.backends.client import JsonClient

    class Recording(JsonClient):
        def stream_post(self, path, body):
            bodies.append(body)
            return super().stream_post(path, body)

    bodies: list[dict] = []
    client = Recording(model.client.url, model.client.timeout_s, model.client.server)
    return replace(model, api=replace(model.api, client=client)), bodies


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("config", [PLAIN_SAMPLING, SAMPLED, MIN_P, TYPICAL],
                         ids=["no-stage", "top-k-top-p", "min-p", "typical-first"])
def test_a_server_with_our_processor_drafts_our_draws_and_the_run_is_unchanged(vllm_model, config):
    """With draws=1 (as ``make vllm`` lists it) a sampled run's continuation is our chain's draws: every
    position is the server's token, a request gives the whole count, and the tokens and trace are one-
    request-per-token step mode's; each request carries the run's generator state where it stands."""
    assert vllm_model.api.server_draws
    model, bodies = recorded(vllm_model)
    plain = run(vllm_model, config, 0)
    verified = run(model, config, 8)
    same_run(verified, plain, tol=1e-4)
    v = verified.extra["remote"]["verified"]
    assert v["accepted"] == v["steps"] == len(plain.steps) and v["requests"] == math.ceil(v["steps"] / 8) == len(bodies)
    assert v["asked"] == [min(8, v["steps"] - 8 * i) for i in range(v["requests"])]  # the whole count each time
    assert v["drafts"] == served_decode.OUR_DRAWS
    states = [body["vllm_xargs"]["dp_state"] for body in bodies]
    assert len(set(states)) == len(states)  # each request starts where the run's generator stands
    assert json.loads(bodies[0]["vllm_xargs"]["dp_chain"]) == [[n, getattr(config, n)] for n in config.active_stages()]
    assert all(body["temperature"] == 0 and body["vllm_xargs"]["dp_top"] == vllm_model.top_n for body in bodies)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_users_at_once_each_get_their_own_draws_from_the_server(vllm_model):
    """Four users sampling at once (vLLM batches their rows, adds and removes them as their requests
    start and end: the processor keeps each row's generator with its request): each run is its own
    one-request-per-token run, every position drafted right."""
    configs = [SAMPLED.replace(seed=40 + i, max_new_tokens=16 + 4 * i) for i in range(4)]
    prompts = [PROMPT, "Once upon a time", "The recipe calls for", "In the year 2050"]
    out: dict[int, Any] = {}

    def user(i: int) -> None:
        out[i] = run(vllm_model, configs[i], 8, prompts[i])

    threads = [threading.Thread(target=user, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        same_run(out[i], run(vllm_model, configs[i], 0, prompts[i]), tol=1e-4)
        v = out[i].extra["remote"]["verified"]
        assert v["drafts"] == served_decode.OUR_DRAWS and v["accepted"] == v["steps"] == configs[i].max_new_tokens


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_no_draws_are_sent_for_a_stage_it_does_not_run_a_greedy_run_or_a_server_listed_without_them(vllm_model):
    model, bodies = recorded(vllm_model)
    for config in (PENALISED, GREEDY):
        same_run(run(model, config, 8), run(vllm_model, config, 0), tol=1e-4)
    assert bodies and not any("vllm_xargs" in body for body in bodies)
    unlisted, bodies = recorded(replace(vllm_model, api=replace(vllm_model.api, server_draws=False)))
    v = run(unlisted, SAMPLED, 8).extra["remote"]["verified"]
    assert bodies and not any("vllm_xargs" in body for body in bodies)
    assert v["first"] == served_decode.FIRST_ASK and v["accepted"] < v["steps"]  # the server's argmax: ours only by chance
    assert v["drafts"] == "greedy"


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("xargs", [{"dp_state": "not base64!"}, {"dp_state": "AAAA"},
                                   {"dp_state": STATE, "dp_chain": "[[\"no_such_stage\", 1]]"},
                                   {"dp_state": STATE, "dp_chain": "[[\"top_k\", -3]]"},
                                   {"dp_state": STATE, "dp_top": 0}, {"dp_state": STATE, "dp_chain": "{"}],
                         ids=["not-base64", "short-state", "unknown-stage", "bad-value", "top-0", "bad-json"])
def test_malformed_draw_arguments_leave_the_server_s_own_greedy_answer(vllm_server, xargs):
    """The processor reads ``vllm_xargs`` from whoever can reach the server: arguments it cannot use
    leave the request as vLLM would answer it (its greedy tokens), and the server keeps serving."""
    from deploy.vllm_serve import SERVED_NAME

    def complete(extra: dict) -> list[int]:
        body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "return_token_ids": True,
                **extra}
        request = urllib.request.Request(vllm_server + "/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as answer:
            return json.load(answer)["choices"][0]["token_ids"]

    assert complete({"vllm_xargs": xargs}) == complete({})
