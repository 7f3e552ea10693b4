"""Issue #39: the grammar stage (structured outputs). Its mask is checked against the language by
hand (every token whose text continues a string of a finite language, the end of text exactly at a
whole string), its outputs against independent parsers (``jsonschema``, Python's ``re``, a GBNF's
Python twin) at every seed of a sweep, its state against a fresh run with the same prefix (what-if,
branch), and every bad grammar against the one-line rule."""

from __future__ import annotations

import json
import math
import re
import shlex

import jsonschema
import pytest
import torch
import yaml

from engine import explore, runner
from engine.config import ConfigError, DecodingConfig
from engine.interop import to_llama_cpp, to_textgen_webui
from engine.presets import Preset, builtin_presets
from engine.runner import RunRequest
from engine.stages import build_stage, grammar_cost, grammar_facts
from engine.stages import grammar as grammar_stage
from engine.stages.grammar import Grammar, compile_grammar, yaml_quoted
from engine.strategies import decode

EOS = 2  # SmolLM2's <|im_end|> (the tiny Llama shares its tokenizer)
ANSWERS = ("yes", "no", "maybe")
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0,
                                                                                "maximum": 120},
                         "mood": {"enum": ["happy", "sad", "calm"]}},
          "required": ["name", "age", "mood"], "additionalProperties": False}
SUM = 'root ::= num " " op " " num " = " num\nop ::= "+" | "-" | "*"\nnum ::= [0-9]{1,4}'
SUM_TWIN = re.compile(r"[0-9]{1,4} [+*-] [0-9]{1,4} = [0-9]{1,4}")  # the GBNF above, as a Python regex
DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"


@pytest.fixture(scope="module")
def texts(tiny_lm):
    """Every token id's text (the tokenizer's own decoding of it alone)."""
    return [tiny_lm.tokenizer.decode([i]) for i in range(len(tiny_lm.tokenizer))]


def stage_for(lm, kind: str, text: str, prompt_length: int = 0) -> Grammar:
    config = DecodingConfig(strategy="greedy", grammar=text, grammar_kind=kind)
    return build_stage("grammar", config, prompt_length, lm.tokenizer, lm.eos_token_ids)


def allowed_after(stage: Grammar, prefix: list[int], vocab: int) -> set[int]:
    out, _ = stage.apply(torch.tensor([prefix], dtype=torch.long), torch.zeros(1, vocab))
    return set(torch.isfinite(out[0]).nonzero().flatten().tolist())


# --- the mask, by hand -------------------------------------------------------------------------------------
def test_mask_equals_the_languages_prefixes_by_hand(tiny_lm, texts):
    """After a prefix of a finite language, the allowed tokens are exactly those whose text keeps it a
    prefix of some string (special tokens never), and the end of text exactly when it is a whole string."""
    stage = stage_for(tiny_lm, "regex", "|".join(ANSWERS))
    specials = set(tiny_lm.tokenizer.all_special_ids)
    for prefix_text in ("", "y", "ye", "yes", "m", "may", "n", "no"):
        prefix = tiny_lm.tokenizer.encode(prefix_text, add_special_tokens=False)
        expected = {i for i, t in enumerate(texts) if i not in specials and t and "\ufffd" not in t
                    and any(a.startswith(prefix_text + t) for a in ANSWERS)}
        if prefix_text in ANSWERS:
            expected.add(EOS)
        assert allowed_after(stage, prefix, tiny_lm.vocab_size) == expected, prefix_text
    done = tiny_lm.tokenizer.encode("maybe", add_special_tokens=False)
    assert allowed_after(stage, done, tiny_lm.vocab_size) == {EOS}  # complete, nothing can follow: the run ends


def test_the_stage_is_pure_and_records_what_it_did(tiny_lm):
    """A 3-way distribution by hand: the mask keeps the allowed tokens' logits as they were, never
    touches its input, and records the allowed count, the model's favourite it forbade and
    ln(allowed mass)."""
    stage = stage_for(tiny_lm, "regex", "(yes|no)")
    yes, no, sure = (tiny_lm.tokenizer.encode(w, add_special_tokens=False)[0] for w in ("yes", "no", "Sure"))
    logits = torch.full((1, tiny_lm.vocab_size), -30.0)
    logits[0, [yes, no, sure]] = torch.tensor([0.0, -1.0, 2.0])
    before = logits.clone()
    out, found = stage.apply(torch.zeros(1, 0, dtype=torch.long), logits)
    assert torch.equal(logits, before) and out is not logits
    assert torch.equal(out[0, [yes, no]], logits[0, [yes, no]]) and out[0, sure] == float("-inf")
    p = torch.softmax(logits[0].double(), -1)
    assert found["wanted_id"] == sure and found["wanted_p"] == pytest.approx(float(p[sure]))
    assert found["log_allowed_mass"] == pytest.approx(float(torch.log(p[torch.isfinite(out[0])].sum())))
    assert found["allowed"] == int(torch.isfinite(out[0]).sum()) and not found["complete"] and not found["ended"]


def test_rows_of_a_batch_each_follow_their_own_prefix(tiny_lm):
    """Beam rows: one stage, two prefixes, each masked as it would be alone."""
    stage = stage_for(tiny_lm, "regex", "|".join(ANSWERS), prompt_length=1)
    ye, ma = (tiny_lm.tokenizer.encode(w, add_special_tokens=False) for w in ("ye", "ma"))
    assert len(ye) == len(ma) == 1
    ids = torch.tensor([[7] + ye, [7] + ma])
    out, _ = stage.apply(ids, torch.zeros(2, tiny_lm.vocab_size))
    for row, prefix in ((0, ye), (1, ma)):
        alone = allowed_after(stage_for(tiny_lm, "regex", "|".join(ANSWERS), 1), [7] + prefix, tiny_lm.vocab_size)
        assert set(torch.isfinite(out[row]).nonzero().flatten().tolist()) == alone


def test_a_byte_level_stage_checks_a_servers_top_n_by_hand():
    """A served model's tokenizer has no vocabulary LLGuidance reads: the stage checks each
    candidate (finite logit) by its text, byte by byte; a token that is part of a character counts
    as forbidden; a step where none is allowed is said (GrammarDeadEnd), not a crash."""
    class Pieces:  # a 10-token vocabulary's texts, as a server's /detokenize answers them
        words = ["{", "Sure", "\"", "a", "}", "\ufffd", " ", "x", "<eos>", "\":"]

        def decode(self, ids, skip_special_tokens=False):
            return "".join(self.words[i] for i in ids)

    config = DecodingConfig(strategy="greedy", grammar='{"type": "object"}', grammar_kind="json_schema")
    stage = build_stage("grammar", config, 0, Pieces(), (8,))
    logits = torch.tensor([[0.0, 3.0, 0.0, 0.0, 0.0, 1.0, 0.0, float("-inf"), 0.0, 0.0]])
    out, found = stage.apply(torch.zeros(1, 0, dtype=torch.long), logits)
    assert torch.isfinite(out[0]).tolist() == [True] + [False] * 9  # only '{' starts an object; ' Sure' wanted
    assert found["wanted_id"] == 1 and found["allowed"] == 1
    after, _ = stage.apply(torch.tensor([[0]]), torch.zeros(1, 10))  # '{': a key, or the end of the object
    assert torch.isfinite(after[0]).nonzero().flatten().tolist() == [2, 4, 6, 9]
    done, _ = stage.apply(torch.tensor([[0, 4]]), logits)  # "{}": complete, only the end (logit 0 given it)
    assert torch.isfinite(done[0]).nonzero().flatten().tolist() == [8]
    with pytest.raises(grammar_stage.GrammarDeadEnd, match="step 1: the grammar allows none of the server's top 2"):
        stage.apply(torch.tensor([[0]]), torch.tensor([[0.0, 0.0] + [float("-inf")] * 8]))


# --- whole runs ------------------------------------------------------------------------------------------
def run(lm, prompt: str, **knobs):
    return runner.run(RunRequest(lm, prompt, DecodingConfig.from_dict(knobs), chat=True))


@pytest.mark.slow
def test_every_output_validates_at_every_seed(embedded):
    """A sweep of seeds under a JSON schema, a date regex and a GBNF sum: every run ends because the
    grammar is complete (EOS), and every output parses by an independent parser: jsonschema, Python's
    re, and the GBNF's Python twin. Greedy too."""
    cases = [("Describe a fictional person.", "json_schema", json.dumps(SCHEMA), 64,
              lambda text: jsonschema.validate(json.loads(text), SCHEMA)),
             ("When did the Berlin wall fall?", "regex", DATE, 16, lambda text: re.fullmatch(DATE, text).group()),
             ("What is 12 plus 30?", "gbnf", SUM, 24, lambda text: SUM_TWIN.fullmatch(text).group())]
    for prompt, kind, text, budget, check in cases:
        for seed in range(-1, 5):  # -1: greedy
            knobs = {"strategy": "greedy"} if seed < 0 else {"strategy": "sample", "seed": seed}
            trace = run(embedded, prompt, grammar=text, grammar_kind=kind, max_new_tokens=budget, **knobs)
            assert trace.stop_reason == "eos", (kind, seed, trace.text)
            check(trace.text)
            facts = [grammar_facts(s) for s in trace.steps]
            assert all(f is not None and f.off_grammar_at is None for f in facts)
            assert facts[-1].complete and trace.steps[-1].chosen_token_id == EOS


def test_a_finite_language_ends_the_run_and_costs_what_it_removed(tiny_lm):
    """The tiny random model under (yes|no|maybe): every seed ends on one of the three answers; the
    grammar's cost is the sum of ln(allowed mass) Z: the mask renormalises, so every allowed token's
    p after it is its raw p / Z, and ln Z = ln(raw p) - ln(p after) of the chosen token, step by step."""
    for seed in range(6):
        trace = run(tiny_lm, "Answer:", strategy="sample", seed=seed, grammar="|".join(ANSWERS), grammar_kind="regex",
                    max_new_tokens=8)
        assert trace.stop_reason == "eos" and trace.text in ANSWERS
        by_hand = sum(math.log(s.raw_prob) - math.log(s.chosen_prob) for s in trace.steps)
        assert grammar_cost(trace.steps) == pytest.approx(by_hand, rel=1e-4, abs=1e-4)
        json.loads(trace.to_json())  # strict JSON: the records hold no NaN or infinity


def test_beam_search_keeps_every_hypothesis_in_the_language(tiny_lm):
    trace = run(tiny_lm, "Answer:", strategy="beam", num_beams=3, num_return_sequences=3, grammar="|".join(ANSWERS),
                grammar_kind="regex", max_new_tokens=8)
    texts = [tiny_lm.decode([t for t in h.token_ids if t != EOS]) for h in trace.beam.hypotheses]
    assert texts and all(t in ANSWERS for t in texts), texts


# --- the state is the prefix: what-if, branch and resume at any step ------------------------------------
JSON_RUN = {"strategy": "sample", "seed": 7, "max_new_tokens": 40, "temperature": 1.3, "top_k": 40,
            "grammar": json.dumps(SCHEMA), "grammar_kind": "json_schema"}


@pytest.fixture(scope="module")
def json_trace(tiny_lm):
    return runner.run(RunRequest(tiny_lm, "Describe a person.", DecodingConfig.from_dict(JSON_RUN)))


def grammar_params(step):
    return next(s.params for s in step.stages if s.name == "grammar")


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_whatif_with_the_runs_knobs_reproduces_the_step(tiny_lm, json_trace, where):
    at = {"first": 0, "middle": len(json_trace.steps) // 2, "last": len(json_trace.steps) - 1}[where]
    stages = explore.explore_step(tiny_lm, json_trace, at)
    assert explore.stages_match(stages, json_trace.steps[at].stages)
    mine = next(s.params for s in stages if s.name == "grammar")
    assert mine["allowed"] == grammar_params(json_trace.steps[at])["allowed"]
    logits = explore.raw_logits(tiny_lm, json_trace, at)
    again = decode.whatif_step(tiny_lm, json_trace, at, {}, logits)
    assert again.chosen_token_id == json_trace.steps[at].chosen_token_id


def test_whatif_under_new_knobs_equals_a_fresh_run_with_that_prefix(tiny_lm, json_trace):
    """At a middle step, T 0.7 and no top-k: the what-if's stages equal the first step of a fresh run
    with those knobs that starts after the same prefix (its grammar synced from scratch)."""
    at = len(json_trace.steps) // 2
    knobs = {"temperature": 0.7, "top_k": 0}
    stages = explore.explore_step(tiny_lm, json_trace, at, knobs)
    fresh = next(decode.stream(tiny_lm, json_trace.prompt_token_ids, DecodingConfig.from_dict(JSON_RUN | knobs),
                               prefix=json_trace.generated_token_ids[:at]))
    assert explore.stages_match(stages, fresh.stages)
    assert [s.name for s in stages] == ["raw", "grammar", "temperature", "final"]


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_branching_with_the_runs_own_token_repeats_the_run(tiny_lm, json_trace, where):
    """The run's matcher went step by step; a branch's matcher is synced to the prefix in one go:
    forcing the run's own token at step k continues exactly as the run did (tokens, masks, draws)."""
    at = {"first": 0, "middle": len(json_trace.steps) // 2, "last": len(json_trace.steps) - 1}[where]
    tokens = json_trace.generated_token_ids
    config = DecodingConfig.from_dict(JSON_RUN)
    branch = list(decode.stream(tiny_lm, json_trace.prompt_token_ids, config, prefix=tokens[:at], force=tokens[at]))
    assert [s.chosen_token_id for s in branch] == tokens[at:]
    for mine, theirs in zip(branch, json_trace.steps[at:]):
        assert explore.stages_match(mine.stages, theirs.stages)
        # the same mask and flags; the floats to float32 rounding (the branch's prefill reads the prefix
        # in one forward, the run one token per forward: the kernels round differently in the last bits)
        floats = {k for k, v in grammar_params(theirs).items() if isinstance(v, float)}
        assert {k: v for k, v in grammar_params(mine).items() if k not in floats} == \
            {k: v for k, v in grammar_params(theirs).items() if k not in floats}
        assert [grammar_params(mine)[k] for k in sorted(floats)] == \
            pytest.approx([grammar_params(theirs)[k] for k in sorted(floats)], rel=1e-5)
    assert [s.draw for s in branch[1:]] == pytest.approx([s.draw for s in json_trace.steps[at + 1:]], abs=1e-6)


def test_a_branch_forced_off_the_grammar_is_said_and_unmasked(tiny_lm, json_trace):
    """Forcing a token the grammar forbids (prose where JSON must start): the steps after it are off
    the grammar from that step, nothing is masked, and the note says so."""
    from playground.charts.stage_notes import stage_note

    sure = tiny_lm.tokenizer.encode(" Sure", add_special_tokens=False)[0]
    config = DecodingConfig.from_dict(JSON_RUN | {"max_new_tokens": 3})
    steps = list(decode.stream(tiny_lm, json_trace.prompt_token_ids, config, force=sure))
    assert steps[0].chosen_token_id == sure
    after = steps[1]
    grammar = next(s for s in after.stages if s.name == "grammar")
    assert grammar.params["off_grammar_at"] == 0 and grammar.mass_removed == 0.0
    assert "off the grammar since step 0" in stage_note(grammar)
    assert grammar_facts(after).off_grammar_at == 0


# --- bad grammars: one line naming the field ------------------------------------------------------------
@pytest.mark.parametrize("kind, text, words", [
    ("json_schema", "{not json", "not valid JSON"),
    ("json_schema", "[1, 2]", "a JSON object"),
    ("json_schema", '{"type": "bogus"}', "does not compile"),
    ("json_schema", '{"type": "number", "minimum": NaN}', "not valid JSON"),
    ("regex", "(unclosed", "does not compile"),
    ("regex", r"[^\s\S]", "matches nothing"),
    ("regex", "", "empty"),
    ("regex", "a{0}", "matches only the empty text"),
    ("gbnf", "root ::= undefined-rule", "does not parse"),
    ("gbnf", 'root ::= "a', "does not parse"),
    ("gbnf", "<b>root</b> ::= x", "does not parse"),
])
def test_a_bad_grammar_is_one_line_naming_it(tiny_lm, kind, text, words):
    with pytest.raises(ConfigError) as err:
        stage_for(tiny_lm, kind, text)
    message = str(err.value)
    assert message.startswith("grammar: ") and words in message, message
    assert "\n" not in message and len(message) < 400


@pytest.mark.parametrize("value, words", [
    ("x" * (grammar_stage.MAX_GRAMMAR_CHARS + 1), "4,001 characters is over the 4,000-character limit"),
    ("(yes|\ud800)", "lone surrogate"), (["(yes|no)"], "expected a text"), (5, "expected a text"),
    ("   \n ", "only whitespace"),
])
def test_the_knob_refuses_what_no_grammar_is(value, words):
    with pytest.raises(ConfigError) as err:
        DecodingConfig.from_dict({"grammar": value, "grammar_kind": "regex"})
    assert str(err.value).startswith("grammar: ") and words in str(err.value)
    with pytest.raises(ConfigError, match="^grammar_kind: "):
        DecodingConfig.from_dict({"grammar": "(a|b)", "grammar_kind": "lark"})


@pytest.mark.timeout(300)
@pytest.mark.parametrize("text", [
    "(a|aa)*" * 50 + "b",  # ambiguous: exponential for a backtracking matcher
    "[a-z]{1000}[0-9]{1000}" * 2,  # a huge automaton
    "(.*a){40}",
])
def test_a_hostile_grammar_is_bounded(tiny_lm, text):
    """Hostile regular expressions: each either compiles and masks 12 steps within LLGuidance's fuel
    limits, or stops with one line naming the grammar; nothing hangs (the timeout is a guard)."""
    config = DecodingConfig(strategy="greedy", grammar=text, grammar_kind="regex", max_new_tokens=12)
    try:
        trace = runner.run(RunRequest(tiny_lm, "x", config))
    except ConfigError as exc:
        assert str(exc).startswith("grammar: ") and "\n" not in str(exc)
        return
    assert trace.steps and all(grammar_facts(s).off_grammar_at is None for s in trace.steps)


DEEP_SCHEMA = '{"type":"object","properties":{"a":' * 100 + '{"type":"integer"}' + "}}" * 100  # 3,918 characters


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind, text, outcome", [
    ("gbnf", 'root ::= root "a" | "a"', re.compile(r"a+")),  # left recursion: a backtracking parser never returns
    ("gbnf", 'root ::= "(" root ")" | "x"', re.compile(r"\(*x?\)*")),  # nesting without bound
    ("json_schema", json.dumps({"type": "object", "properties": {"child": {"$ref": "#"}}, "required": ["child"]}),
     re.compile(r"\{.*", re.S)),  # an object that must hold itself: never complete
    ("json_schema", json.dumps({"$ref": "#"}), "matches nothing: no token can start it"),  # itself, no base case
    ("json_schema", DEEP_SCHEMA, "does not compile"),  # nested 100 deep: past LLGuidance's recursion limit
    ("json_schema", "[" * 1900 + "]" * 1900, "not valid JSON"),  # past Python's own JSON recursion limit
])
def test_a_recursive_or_deep_grammar_is_bounded(tiny_lm, kind, text, outcome):
    """Recursive and deeply nested grammars: each runs its 24 steps with every text in its language
    (checked by a Python twin; an endless one stops at max_new_tokens), or stops with one line
    naming the grammar; nothing hangs or crashes (the timeout is a guard)."""
    config = DecodingConfig(strategy="greedy", grammar=text, grammar_kind=kind, max_new_tokens=24)
    if isinstance(outcome, str):
        with pytest.raises(ConfigError) as err:
            runner.run(RunRequest(tiny_lm, "x", config))
        assert str(err.value).startswith("grammar: ") and outcome in str(err.value) and "\n" not in str(err.value)
        return
    trace = runner.run(RunRequest(tiny_lm, "x", config))
    assert outcome.fullmatch(trace.text), trace.text
    assert trace.stop_reason in ("eos", "max_new_tokens") and len(trace.steps) <= 24
    assert all(grammar_facts(s).off_grammar_at is None for s in trace.steps)
    if kind == "gbnf" and trace.stop_reason == "eos":
        assert trace.text.count("(") == trace.text.count(")")  # closed as deep as it opened


def test_a_compile_past_its_time_limit_is_one_line(tiny_lm, monkeypatch):
    monkeypatch.setattr(grammar_stage, "COMPILE_SECONDS", 1e-9)
    monkeypatch.setattr(grammar_stage, "_compile", lambda *args: __import__("time").sleep(0.2))
    with pytest.raises(ConfigError, match=r"^grammar: this regular expression did not compile within 1e-09 s"):
        stage_for(tiny_lm, "regex", "(only|here)")


def test_compiled_grammars_are_cached_per_tokenizer_with_a_bound(tiny_lm):
    first = compile_grammar("regex", "(cache|me)", tiny_lm.tokenizer)
    assert compile_grammar("regex", "(cache|me)", tiny_lm.tokenizer) is first
    for i in range(grammar_stage.MAX_COMPILED + 3):
        compile_grammar("regex", f"(word{i}|other)", tiny_lm.tokenizer)
    assert len(grammar_stage._compiled) <= grammar_stage.MAX_COMPILED
    assert compile_grammar("regex", "(cache|me)", tiny_lm.tokenizer) is not first  # evicted, compiled again
    assert len(grammar_stage._tokenizers) <= grammar_stage.MAX_TOKENIZERS


# --- other tools -------------------------------------------------------------------------------------------
def test_exports_carry_the_grammar_or_say_why_not():
    presets = builtin_presets()
    json_llama = shlex.split(to_llama_cpp(presets["json-object"]).text)
    schema = json.loads(json_llama[json_llama.index("--json-schema") + 1])
    assert schema == json.loads(presets["json-object"].config.grammar)
    assert [n.key for n in to_textgen_webui(presets["json-object"]).unmapped if "grammar" in n.key] == ["grammar"]
    gbnf = presets["arithmetic"].config.grammar
    llama = shlex.split(to_llama_cpp(presets["arithmetic"]).text)
    assert llama[llama.index("--grammar") + 1] == gbnf
    webui = to_textgen_webui(presets["arithmetic"])
    assert yaml.safe_load(webui.text)["grammar_string"] == gbnf and webui.caveats
    regex = presets["yes-no-maybe"]
    assert [n.key for n in to_llama_cpp(regex).unmapped if "grammar" in n.key] == ["grammar"]
    assert "--grammar" not in to_llama_cpp(regex).text and "grammar_string" not in to_textgen_webui(regex).text


@pytest.mark.parametrize("text", ['root ::= "a" # "b"\n', "x\u2028y\u0085z\ufeff\\\"\t\r\n", "emoji 😀 and ünïcode",
                                  "key: value\n- item\n\"quoted\" 'single' & *alias !tag %"])
def test_a_grammar_string_survives_yaml_exactly(text):
    assert yaml.safe_load(f"grammar_string: {yaml_quoted(text)}") == {"grammar_string": text}
    preset = Preset.create("Mine", "A grammar.", DecodingConfig(grammar="root ::= \"x\"\n" + text.replace("\r", ""),
                                                                 grammar_kind="gbnf"))
    data = yaml.safe_load(to_textgen_webui(preset).text)
    assert data["grammar_string"] == preset.config.grammar and set(data) <= {"grammar_string", "do_sample", "top_k"}


def test_resuming_from_a_steps_records_continues_the_run(tiny_lm, json_trace):
    """"Continue from here" under the run's own knobs resumes from the step's records: the grammar
    carries nothing there (its state is the prefix), and the run goes on exactly."""
    at = len(json_trace.steps) // 2
    tokens = json_trace.generated_token_ids
    resumed = list(decode.stream(tiny_lm, json_trace.prompt_token_ids, DecodingConfig.from_dict(JSON_RUN),
                                 prefix=tokens[:at], resume=json_trace.steps[at].stages))
    assert [s.chosen_token_id for s in resumed] == tokens[at:]
    assert [grammar_params(s)["allowed"] for s in resumed] == [grammar_params(s)["allowed"] for s in json_trace.steps[at:]]


def test_grammar_rows_in_the_batched_scheduler_equal_solo_runs(tiny_lm):
    """Four grammar runs (two kinds, greedy and seeded) stepped together in one batch: each equals
    the same run alone."""
    from engine.scheduler import Scheduler
    from tests.helpers.scheduler import assert_same_steps, run_concurrently

    ids = tiny_lm.encode("Describe a person.")
    jobs = [(ids, DecodingConfig.from_dict(JSON_RUN | {"max_new_tokens": 12, "seed": s})) for s in (1, 2)] + \
        [(ids, DecodingConfig(strategy=k, seed=3, grammar=DATE, grammar_kind="regex", max_new_tokens=12))
         for k in ("greedy", "sample")]
    batched, _ = run_concurrently(Scheduler(tiny_lm, max_batch=4), jobs)
    for i, ((prompt, config), steps) in enumerate(zip(jobs, batched)):
        assert_same_steps(steps, list(decode.stream(tiny_lm, prompt, config)), f"run {i}")


def test_a_share_link_and_the_cli_carry_the_grammar():
    from engine.__main__ import build_parser, config_from_args
    from engine.sharelink import ShareState, decode as decode_link, encode

    preset = builtin_presets()["json-object"]
    state = decode_link(encode(ShareState("step", "Describe a person.", preset, seed=0, chat=True)))
    assert state.preset.config.grammar == preset.config.grammar
    assert state.preset.config.grammar_kind == "json_schema"
    args = build_parser().parse_args(["--prompt", "x", "--set", "grammar=(Yes|No)", "--set", "grammar_kind=regex"])
    config = config_from_args(args)
    assert (config.grammar, config.grammar_kind, config.active_stages()) == ("(Yes|No)", "regex", ("grammar",))
