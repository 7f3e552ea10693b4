"""Issue #39's oracles against the serving engines: greedy under a grammar through our stage gives
the tokens vLLM's ``structured_outputs`` gives (its answers recorded from a real vLLM 0.32 on CPU,
xgrammar its default backend: tests/data/vllm/record_structured.py) and the tokens llama-server's
own grammar sampler gives (``json_schema`` / ``grammar``, the real llama-server of the `remote`
tests), or the difference is explained token by token along the server's path: a token one grammar
allows and the other does not, or a near tie of the two models (the server's Q4_1 kernels against
our float32 copy of the same weights). Step mode over the server's top-N says a step where none of
them is allowed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jsonschema
import pytest
import torch

from engine.strategies import served_decode
from engine import explore, runner
from engine.backends import llamacpp, openai
from engine.cache import KVCache
from engine.config import DecodingConfig
from engine.presets import builtin_presets
from engine.runner import RunRequest
from engine.stages import STAGES, build_stage
from engine.stages.grammar import STEP_CAVEAT

from tests.helpers.remote_openai import vllm  # noqa: F401 (the fixture: a server answering with vLLM's schema)

RECORDED = Path(__file__).parents[1] / "data" / "vllm" / "structured_auto.json"
JSON_PROMPT = "Describe a fictional person."


def server_test(fn):
    """Needs the real llama-server (the build may still be running: long timeout)."""
    return pytest.mark.remote(pytest.mark.slow(pytest.mark.timeout(2400)(fn)))


def greedy(stem: str) -> DecodingConfig:
    return builtin_presets()[stem].config.replace(strategy="greedy")


def allowed_by_our_grammar(lm, config: DecodingConfig, prompt_ids: list[int], generated: list[int]) -> set[int]:
    stage = build_stage("grammar", config, len(prompt_ids), lm.tokenizer, lm.eos_token_ids)
    out, _ = stage.apply(torch.tensor([prompt_ids + generated]), torch.zeros(1, lm.vocab_size))
    return set(torch.isfinite(out[0]).nonzero().flatten().tolist())


# --- how a served model is asked to run it (StageSpec.served) -------------------------------------------
@pytest.mark.parametrize("stem, llama_field, vllm_key", [
    ("json-object", "json_schema", "json"), ("arithmetic", "grammar", "grammar"), ("yes-no-maybe", None, "regex")])
def test_each_server_gets_the_grammar_in_its_own_field(stem, llama_field, vllm_key):
    """The grammar's spec says how each server runs it: llama-server's /completion and its /v1 take
    ``json_schema`` (the schema as JSON) or ``grammar`` (the GBNF text) and no regular expression
    (listed unmapped, naming ``grammar``, never dropped silently); vLLM takes ``structured_outputs``;
    step mode's label carries the top-N caveat. The grammar is never sent as a llama.cpp sampler."""
    config = greedy(stem)
    value = json.loads(config.grammar) if stem == "json-object" else config.grammar
    request = llamacpp.llamacpp_request(config)
    assert "grammar" not in request.fields["samplers"] and request.fields["samplers"] == ["top_k"]
    v1_fields, v1_notes = openai._openai_fields(config, "llamacpp")
    vllm_fields, vllm_notes = openai._openai_fields(config, "vllm")
    assert vllm_fields["structured_outputs"] == {vllm_key: value} and vllm_notes["unmapped"] == []
    assert "json_schema" not in vllm_fields and "grammar" not in vllm_fields
    if llama_field is None:
        assert "json_schema" not in request.fields and "grammar" not in request.fields
        assert [n.key for n in request.unmapped] == ["grammar"] and "regular expression" in request.unmapped[0].reason
        assert [n["key"] for n in v1_notes["unmapped"]] == ["grammar"] and "structured_outputs" not in v1_fields
    else:
        assert request.fields[llama_field] == value and request.unmapped == ()
        assert v1_fields[llama_field] == value and "structured_outputs" not in v1_fields and v1_notes["unmapped"] == []
    assert STEP_CAVEAT in served_decode.step_approximations(config, 100)
    assert STAGES["grammar"].served.step_caveats == (STEP_CAVEAT,)


def test_without_a_grammar_no_server_gets_one():
    config = DecodingConfig(strategy="greedy")
    assert not {"json_schema", "grammar"} & set(llamacpp.llamacpp_request(config).fields)
    for dialect in ("vllm", "llamacpp"):
        fields, notes = openai._openai_fields(config, dialect)
        assert not {"json_schema", "grammar", "structured_outputs"} & set(fields) and notes["unmapped"] == []
    assert STEP_CAVEAT not in served_decode.step_approximations(config, 100)


def test_fast_mode_sends_vllm_its_structured_outputs(vllm):  # noqa: F811 (the fixture)
    """Fast mode on the replayed real vLLM: the one streamed request carries ``structured_outputs`` with the
    preset's schema, and nothing is listed as unmapped (vLLM's own grammar constrains). The replay answers only
    the requests tests/data/vllm/record.py recorded (no grammar among them): the request is read from what
    the server received, and the unrecorded answer is the one line naming it."""
    from engine.backends.client import RemoteError
    from tests.helpers.remote_openai import listed

    url, state = vllm
    model = listed(url).with_mode("fast")
    config = greedy("json-object")
    with pytest.raises(RemoteError, match="not recorded"):
        runner.run(RunRequest(model, "The capital of France is", config))
    [body] = [b for path, b in state["requests"] if path == "/v1/completions" and b.get("stream")]
    assert body["structured_outputs"] == {"json": json.loads(config.grammar)} and body["stream"] is True
    fields, notes = openai._openai_fields(config, model.api.dialect)
    assert fields["structured_outputs"] == body["structured_outputs"] and notes["unmapped"] == []


@pytest.mark.slow
@pytest.mark.parametrize("case", ["json-object", "yes-no-maybe", "iso-date", "arithmetic"])
def test_greedy_equals_vllms_structured_outputs(embedded, case):
    """The four grammar presets (a JSON schema, two regular expressions, a GBNF grammar): our greedy
    tokens equal vLLM's, EOS included, from the same prompt ids (the chat template)."""
    recorded = json.loads(RECORDED.read_text())
    answer = recorded["cases"][case]
    config = greedy(answer["preset"])
    assert embedded.encode(answer["prompt"], True) == answer["prompt_token_ids"]
    ours = runner.run(RunRequest(embedded, answer["prompt"], config, chat=True))
    assert ours.generated_token_ids == answer["token_ids"], (ours.text, answer["text"])
    assert answer["finish_reason"] == "stop" and ours.stop_reason == "eos"
    # vLLM's logprobs are after its mask (a masked token reads -9999): each of its top-5 at every step
    # is allowed by our grammar exactly where xgrammar allowed it, at our masked log-probability, but
    # for one difference, token by token: xgrammar refuses an escape (a token with a backslash) inside
    # a string with maxLength (the JSON preset's name), where JSON and LLGuidance allow it; at the
    # steps inside that string its normaliser lacks exactly those tokens' mass
    cache = KVCache(embedded.model)
    for step, top in zip(ours.steps, answer["top_logprobs"]):
        ids = ours.prompt_token_ids + ours.generated_token_ids[:step.index]
        stage = build_stage("grammar", config, len(ours.prompt_token_ids), embedded.tokenizer, embedded.eos_token_ids)
        masked, _ = stage.apply(torch.tensor([ids]), explore.raw_logits(embedded, ours, step.index, cache))
        logp = torch.log_softmax(masked[0].double(), -1)
        escapes = [t for t in torch.isfinite(masked[0]).nonzero().flatten().tolist() if "\\" in embedded.token_text(t)]
        refused = float(logp[escapes].exp().sum()) if case == "json-object" else 0.0
        for token, logprob in ((int(k), v) for k, v in top.items()):
            assert (token not in escapes and math.isfinite(float(logp[token]))) == (logprob > -9000), (step.index, token)
            if logprob > -9000:
                assert logprob == pytest.approx(float(logp[token]) - math.log1p(-refused), abs=3e-4), (step.index, token)


# --- llama-server ----------------------------------------------------------------------------------------
@server_test
def test_greedy_json_schema_equals_llama_servers(server_model, embedded):
    """llama-server's greedy under the JSON preset's schema (fast mode: its model, its own json_schema
    grammar), walked token by token: at each of its prefixes our model and our mask pick a token. Where
    the two differ, the step is explained by the server's own raw top-N there (its second request):

    - its model ranks our token above its own pick, so only its grammar can have refused ours (a
      grammar difference; here llama.cpp's json_schema grammar allows no whitespace between a string
      with maxLength and the next ',', where JSON, LLGuidance and xgrammar do);
    - its model ranks its pick above ours, and our model puts the two within 0.5 nats: a near tie of
      the two models (its Q4_1 kernels against our float32 copy of the same weights)."""
    config = greedy("json-object")
    fast = served_decode.run_fast(server_model, JSON_PROMPT, config, chat=True)
    assert fast.extra["remote"]["unmapped"] == []  # the schema went to the server
    json.loads(fast.text)  # llama.cpp's grammar kept it JSON
    theirs, ids = fast.generated_token_ids, fast.prompt_token_ids
    assert ids == embedded.encode(JSON_PROMPT, True)
    cache = KVCache(embedded.model)
    stage = build_stage("grammar", config, len(ids), embedded.tokenizer, embedded.eos_token_ids)
    verdicts = []
    for at, token in enumerate(theirs):
        with torch.inference_mode():
            logits = cache.sync(ids + theirs[:at]).float()
        masked, _ = stage.apply(torch.tensor([ids + theirs[:at]]), logits)
        mine = int(masked[0].argmax())
        if mine != token:
            verdicts.append(explain(embedded, fast.steps[at], at, mine, token, masked[0], logits[0]))
    print("\n".join(verdicts) or "the same tokens")
    assert len(verdicts) <= len(theirs) // 5, verdicts  # they agree on most steps


def explain(lm, step, at: int, mine: int, theirs: int, masked, logits) -> str:
    """Why our pick ``mine`` and llama.cpp's ``theirs`` differ at step ``at`` (see the test above);
    fails when neither explanation holds."""
    assert math.isfinite(float(masked[theirs])), f"step {at}: llama.cpp's grammar allowed {lm.token_text(theirs)!r}, ours not"
    raw = {t.token_id: t.prob for t in step.stages[0].top} if step.stages and step.stages[0].name == "raw" else {}
    assert theirs in raw or mine in raw, f"step {at}: neither token in the server's raw top-N"
    words = f"step {at}: llama.cpp {lm.token_text(theirs)!r}, ours {lm.token_text(mine)!r}"
    if raw.get(mine, 0.0) > raw.get(theirs, 0.0):
        return f"{words}: its model ranks ours higher ({raw[mine]:.1%}); its grammar refused it"
    logp = torch.log_softmax(logits.double(), -1)
    gap = float(logp[mine] - logp[theirs])
    assert 0 <= gap < 0.5, f"{words}: its model prefers its pick, ours by {gap:.3f} nats: more than a near tie"
    return f"{words}: a near tie of the two models ({gap:.3f} nats here)"


@server_test
def test_step_mode_says_a_step_where_no_top_n_token_is_allowed(server_model):
    """Over the server's top 5 at the JSON preset's first step the model wants prose: no token there
    may start an object, and the run ends at that step, said in the trace's labels."""
    config = builtin_presets()["json-object"].config
    trace = served_decode.run_step(server_model, JSON_PROMPT, config, chat=True, top_n=5)
    assert trace.stop_reason == "no_tokens_left" and trace.steps == []
    label = trace.extra["remote"]["approximations"]
    assert any("checked on the server's top-N only" in line for line in label)
    assert "step 0: the grammar allows none of the server's top 5 tokens" in label[-1]
    trace.to_json()


@server_test
def test_fast_mode_through_llama_servers_openai_endpoint_is_constrained(llama_server, server_model):
    """llama-server's /v1 takes its own ``json_schema`` / ``grammar`` (not vLLM's structured_outputs):
    fast mode there gives the same greedy tokens as its native /completion under the same schema, the
    text validates, and a regular expression is listed unmapped."""
    model = openai.connect_openai(llama_server + "/v1", timeout_s=60, mode="fast")
    assert model.api.dialect == "llamacpp"
    config = greedy("json-object")
    v1 = runner.run(RunRequest(model, JSON_PROMPT, config, chat=True))
    native = served_decode.run_fast(server_model, JSON_PROMPT, config, chat=True)
    assert v1.generated_token_ids == native.generated_token_ids and v1.extra["remote"]["unmapped"] == []
    jsonschema.validate(json.loads(v1.text), json.loads(config.grammar))
    regex = runner.run(RunRequest(model, "Should I take an umbrella today?", greedy("yes-no-maybe"), chat=True))
    assert [n["key"] for n in regex.extra["remote"]["unmapped"]] == ["grammar"]


@server_test
def test_fast_mode_sends_the_gbnf_and_names_the_regex_it_cannot(server_model):
    sums = served_decode.run_fast(server_model, "What is twelve plus thirty? Write it as a sum.", greedy("arithmetic"), chat=True)
    assert sums.extra["remote"]["unmapped"] == [] and sums.stop_reason == "eos"
    assert all(c.isdigit() or c in " +-*=" for c in sums.text) and sums.text.count("=") == 1, sums.text
    regex = served_decode.run_fast(server_model, "Should I take an umbrella today?", greedy("yes-no-maybe"), chat=True)
    assert [n["key"] for n in regex.extra["remote"]["unmapped"]] == ["grammar"]
