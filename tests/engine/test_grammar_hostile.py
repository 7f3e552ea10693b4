"""Issue #50 (grammar points), each as the tester found it: a 52-character ambiguous GBNF grammar
slowed every user of the model (refused at its compile now; past that refusal and LLGuidance's fuel,
the per-step CPU budget stops it while the other rows go on, token for token as alone), LLGuidance's
wrapper text in our messages, a JSON schema repeating a key, Lark syntax passed off as GBNF, a
4,000-emoji grammar no preset could hold, and an empty alternative in root."""

from __future__ import annotations

import json
import random
import threading

import pytest

from engine import runner
from engine.config import ConfigError, DecodingConfig
from engine.interop import to_llama_cpp
from engine.presets import Preset, PresetError, parse_preset_json
from engine.runner import RunRequest
from engine.scheduler import Scheduler
from engine.sharelink import ShareState, decode as decode_link, encode
from engine.stages import grammar as grammar_stage
from engine.stages.grammar import GrammarBudget, compile_grammar
from engine.strategies import decode
from tests.helpers.scheduler import assert_same_steps

HOSTILE = 'root ::= x\nx ::= x x x x | x x x | x x | [a-z] | [a-z][a-z] | ""\n'  # the tester's 52 characters (+ root)
LLGUIDANCE_DEFAULTS = dict(max_items_in_row=2_000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
                           step_max_items=50_000, max_lexer_states=250_000, max_grammar_size=500_000)
SCHEMA = json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}},
                     "required": ["name"], "additionalProperties": False})
MESSAGE_CHARS = 280


def one_line_naming_grammar(message: str) -> bool:
    return message.startswith("grammar: ") and "\n" not in message and len(message) <= MESSAGE_CHARS


def consume_together(scheduler: Scheduler, jobs: list[tuple[list[int], DecodingConfig]]) -> list[tuple[list, object]]:
    """Every job's (steps, exception or None), its runs joined in one tick and consumed in threads."""
    out: list = [None] * len(jobs)

    def consume(i: int, ids: list[int], config: DecodingConfig) -> None:
        steps: list = []
        try:
            for step in scheduler.stream(ids, config):
                steps.append(step)
            out[i] = (steps, None)
        except Exception as exc:  # noqa: BLE001 (the caller checks it)
            out[i] = (steps, exc)

    threads = [threading.Thread(target=consume, args=(i, *job)) for i, job in enumerate(jobs)]
    with scheduler.gathered(len(jobs)):
        for thread in threads:
            thread.start()
    for thread in threads:
        thread.join(300)
    assert all(item is not None for item in out), "a run did not end"
    return out


# --- MAJOR: the ambiguous grammar -------------------------------------------------------------------------
def test_the_testers_grammar_is_refused_at_its_compile_in_one_line(tiny_lm):
    """x ::= x x with x able to match the empty text derives x from x: infinitely ambiguous. Refused
    before LLGuidance compiles it, so before any mask; a run of it ends there in one line."""
    config = DecodingConfig(strategy="greedy", grammar=HOSTILE, grammar_kind="gbnf", max_new_tokens=8)
    with pytest.raises(ConfigError) as err:
        runner.run(RunRequest(tiny_lm, "x", config))
    assert one_line_naming_grammar(str(err.value)) and "rule x derives itself" in str(err.value), str(err.value)
    cycle = 'root ::= a\na ::= b "x"?\nb ::= a | "y"'  # a -> b -> a: the same, through two rules
    with pytest.raises(ConfigError, match=r"a -> b -> a"):
        compile_grammar("gbnf", cycle, tiny_lm.tokenizer)


@pytest.mark.parametrize("text", ['root ::= root "a" | "a"', 'root ::= "(" root ")" | "x"',
                                  'root ::= x*\nx ::= [a-z]*', 'root ::= expr\nexpr ::= expr "+" expr | [0-9]+',
                                  'ws ::= | " "\nroot ::= "a" ws "b"'])
def test_recursive_and_optional_rules_are_not_taken_for_it(tiny_lm, text):
    """Left recursion, nesting, a repeated optional part, an ambiguous but cycle-free expression
    rule and llama.cpp's own empty alternative (json.gbnf's ws) all still compile."""
    assert compile_grammar("gbnf", text, tiny_lm.tokenizer).text == text


def test_llguidances_fuel_now_trips_on_an_ambiguous_grammar_within_a_few_tokens(tiny_lm):
    """x ::= x x | [a-z] has no cycle (so it compiles) but its parse grows at every
    token; with LLGuidance's item fuel tightened it stops with one line naming the grammar (its
    default fuel counts no completion scans: it took over a second per mask first)."""
    config = DecodingConfig(strategy="greedy", grammar="root ::= x\nx ::= x x | [a-z]", grammar_kind="gbnf",
                            max_new_tokens=200)
    with pytest.raises(ConfigError) as err:
        runner.run(RunRequest(tiny_lm, "x", config))
    message = str(err.value)
    assert one_line_naming_grammar(message) and "resource limits" in message and "Too many items" in message, message


@pytest.fixture
def without_earlier_guards(monkeypatch):
    """The tester's grammar as it ran before issue #50: no refusal at its compile, LLGuidance's
    default fuel. Only the CPU budget is left to stop it."""
    monkeypatch.setattr(grammar_stage, "check_syntax", lambda kind, text: None)
    monkeypatch.setattr(grammar_stage, "LIMITS", LLGUIDANCE_DEFAULTS)
    grammar_stage._compiled.clear()
    yield
    grammar_stage._compiled.clear()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_eight_hostile_runs_stop_by_the_budget_and_the_others_run_as_alone(tiny_lm, without_earlier_guards):
    """Eight runs of the tester's grammar beside a plain greedy run and a JSON-schema run, in one
    batch: each hostile run ends with GrammarBudget (one line naming the grammar, its CPU over the
    per-step budget, or the run's), the two others complete with exactly the steps they have alone."""
    hostile = DecodingConfig(strategy="greedy", grammar=HOSTILE, grammar_kind="gbnf", max_new_tokens=200)
    plain = DecodingConfig(strategy="greedy", max_new_tokens=16)
    schema = DecodingConfig(strategy="sample", seed=3, grammar=SCHEMA, grammar_kind="json_schema", max_new_tokens=24)
    jobs = [(tiny_lm.encode(f"Write words {i}:"), hostile) for i in range(8)]
    jobs += [(tiny_lm.encode("A normal user asks something."), plain), (tiny_lm.encode("A person:"), schema)]
    results = consume_together(Scheduler(tiny_lm, max_batch=len(jobs)), jobs)
    for steps, exc in results[:8]:
        assert isinstance(exc, GrammarBudget), exc
        assert one_line_naming_grammar(str(exc)), str(exc)
        limit = grammar_stage.STEP_BUDGET_S if exc.scope == "step" else grammar_stage.RUN_BUDGET_S
        assert exc.seconds > limit and exc.step == len(steps), (exc.seconds, exc.step, len(steps))
    for (ids, config), (steps, exc) in zip(jobs[8:], results[8:]):
        assert exc is None, exc
        assert_same_steps(steps, list(decode.stream(tiny_lm, ids, config)), config.strategy)


def test_the_budget_stops_a_solo_run_at_its_step_or_over_its_run(tiny_lm, monkeypatch):
    """The budget applies to a run alone too (decode.stream): per step, then over the run."""
    config = DecodingConfig(strategy="greedy", grammar="[a-z ]{1,200}", grammar_kind="regex", max_new_tokens=20)
    monkeypatch.setattr(grammar_stage, "STEP_BUDGET_S", 0.0)
    with pytest.raises(GrammarBudget) as err:
        runner.run(RunRequest(tiny_lm, "x", config))
    assert err.value.scope == "step" and err.value.step == 0 and one_line_naming_grammar(str(err.value))
    monkeypatch.setattr(grammar_stage, "STEP_BUDGET_S", 10.0)
    monkeypatch.setattr(grammar_stage, "RUN_BUDGET_S", 1e-9)
    steps = []
    with pytest.raises(GrammarBudget) as err:
        for step in decode.stream(tiny_lm, tiny_lm.encode("x"), config):
            steps.append(step)
    assert err.value.scope == "run" and err.value.step == len(steps) == 0 and "budget per run" in str(err.value)


@pytest.mark.timeout(300)
def test_a_row_whose_mask_is_late_skips_ticks_and_steps_as_alone(tiny_lm, monkeypatch):
    """A mask that takes long in wall time (a sleep: no CPU, so no budget) parks its row: the other
    row goes on without it, and both runs equal their solo runs step for step."""
    slow_find = grammar_stage._find
    waits: list[bool] = []

    def late_find(cursor, generated, with_mask):
        threading.Event().wait(0.03)
        return slow_find(cursor, generated, with_mask)

    real_ready = grammar_stage.Grammar.ready

    def counted_ready(self):
        answer = real_ready(self)
        waits.append(answer)
        return answer

    jobs = [(tiny_lm.encode("A person:"), DecodingConfig(strategy="greedy", grammar=SCHEMA, grammar_kind="json_schema",
                                                         max_new_tokens=12)),
            (tiny_lm.encode("Something else entirely."), DecodingConfig(strategy="sample", seed=5, max_new_tokens=24))]
    solo = [list(decode.stream(tiny_lm, ids, config)) for ids, config in jobs]
    monkeypatch.setattr(grammar_stage, "_find", late_find)
    monkeypatch.setattr(grammar_stage.Grammar, "ready", counted_ready)
    results = consume_together(Scheduler(tiny_lm, max_batch=2), jobs)
    assert False in waits  # the grammar row was parked at least once
    for (steps, exc), alone, label in zip(results, solo, ("grammar", "plain")):
        assert exc is None, exc
        assert_same_steps(steps, alone, label)


# --- MINOR: messages in our own words -------------------------------------------------------------------
@pytest.mark.parametrize("kind, text, words", [
    ("regex", "[z-a]" + "b" * 200, "invalid character class range"),  # its pattern echoed twice before
    ("regex", "(" * 3 + "a" * 300, "unclosed group"),
    ("json_schema", json.dumps({"type": "string", "pattern": "(unclosed" + "x" * 200}),
     "a pattern in it: unclosed group"),
    ("json_schema", json.dumps({"type": "bogus", "description": "d" * 250}), "Invalid type: bogus"),
    ("gbnf", "root ::= [z-a] " + '"b"' * 60, "invalid character class range"),
])
def test_a_compile_error_says_what_is_wrong_without_llguidances_wrapper(tiny_lm, kind, text, words):
    with pytest.raises(ConfigError) as err:
        compile_grammar(kind, text, tiny_lm.tokenizer)
    message = str(err.value)
    assert one_line_naming_grammar(message) and words in message, message
    assert "%llguidance" not in message and "start:" not in message and " | " not in message, message


def test_a_schema_repeating_a_key_is_refused_naming_the_key(tiny_lm):
    text = '{"type": "object", "properties": {"age": {"type": "integer"}, "age": {"type": "string"}}}'
    with pytest.raises(ConfigError) as err:
        compile_grammar("json_schema", text, tiny_lm.tokenizer)
    assert one_line_naming_grammar(str(err.value)) and 'the key "age" twice' in str(err.value), str(err.value)


@pytest.mark.parametrize("text, words", [
    ('%llguidance {}\nstart: "yes" | "no"', "'%llguidance' on line 1"),
    ('start: "yes" | "no"', "'start:' on line 1"),
    ('root ::= "yes" | "no"\n%ignore " "', "'%ignore' on line 2"),
])
def test_lark_as_gbnf_is_refused_at_validation(text, words):
    """Lark syntax and %llguidance directives under grammar_kind gbnf (what made LLGuidance read the
    text as Lark): "not GBNF" when the config is built, so no preset carries them to llama.cpp,
    which answers 400."""
    with pytest.raises(ConfigError) as err:
        DecodingConfig(grammar=text, grammar_kind="gbnf")
    assert one_line_naming_grammar(str(err.value)) and "not GBNF" in str(err.value) and words in str(err.value)
    with pytest.raises(PresetError, match="not GBNF"):
        parse_preset_json(json.dumps({"version": 1, "name": "Lark", "description": "", "strategy": "greedy",
                                      "grammar": text, "grammar_kind": "gbnf"}))
    assert DecodingConfig(grammar=text, grammar_kind="regex").grammar == text  # a regex may say "start:"


def test_any_other_lark_rule_is_not_gbnf_at_its_compile(tiny_lm):
    with pytest.raises(ConfigError) as err:
        compile_grammar("gbnf", 'root ::= item\nitem: "a"', tiny_lm.tokenizer)
    assert one_line_naming_grammar(str(err.value)) and "not GBNF: 'item:' on line 2" in str(err.value)


def test_an_empty_alternative_in_root_is_refused_and_elsewhere_means_the_empty_text(tiny_lm):
    """``root ::= "a" |`` let the whole output be empty without a word: refused, naming it. An
    explicit "" is taken, and an empty alternative in another rule is llama.cpp's empty text."""
    for text in ('root ::= "a" | ', 'root ::= | "a"', "root ::= "):
        config = DecodingConfig(strategy="greedy", grammar=text, grammar_kind="gbnf", max_new_tokens=8)
        with pytest.raises(ConfigError) as err:
            runner.run(RunRequest(tiny_lm, "x", config))
        assert one_line_naming_grammar(str(err.value)) and "rule root has an empty alternative" in str(err.value)
    config = DecodingConfig(strategy="greedy", grammar='root ::= "a" ws "b"\nws ::= | " "', grammar_kind="gbnf",
                            max_new_tokens=8)
    assert runner.run(RunRequest(tiny_lm, "x", config)).text in ("ab", "a b")
    assert compile_grammar("gbnf", 'root ::= "a" | ""', tiny_lm.tokenizer).text


# --- MINOR: a grammar fits a preset and a share link ------------------------------------------------------
def emoji_regex(count: int, seed: int = 0) -> str:
    """An alternation of ``count`` emoji drawn at random (4 bytes each as UTF-8; compresses badly)."""
    rng = random.Random(seed)
    return "".join(chr(rng.randrange(0x1F300, 0x1FAFF)) for _ in range(count))


def test_the_largest_emoji_grammar_fits_a_preset_and_a_share_link():
    """The limit is in UTF-8 bytes too: the tester's 4,000 emoji (16,000 bytes) are refused in one
    line; the most emoji accepted make a preset that validates and a link that round-trips."""
    most = grammar_stage.MAX_GRAMMAR_BYTES // 4
    with pytest.raises(ConfigError) as err:
        DecodingConfig(grammar=emoji_regex(4_000), grammar_kind="regex")
    assert one_line_naming_grammar(str(err.value)) and "16,000 bytes as UTF-8 is over the 4,000-byte limit" in \
        str(err.value)
    with pytest.raises(ConfigError, match="4,004 bytes"):
        DecodingConfig(grammar=emoji_regex(most + 1), grammar_kind="regex")
    text = emoji_regex(most)
    preset = Preset.create("Emoji", "The most emoji a grammar holds.",
                           DecodingConfig(grammar=text, grammar_kind="regex"))
    assert parse_preset_json(preset.to_json()).config.grammar == text
    state = decode_link(encode(ShareState("step", "Pick one.", preset, seed=0)))
    assert state.preset.config.grammar == text


def test_a_grammar_of_control_characters_is_refused_so_its_json_stays_small():
    """JSON escapes a control character as 6 bytes: 4,000 of them would not fit a preset either."""
    with pytest.raises(ConfigError) as err:
        DecodingConfig(grammar="a\x01" * 10, grammar_kind="regex")
    assert one_line_naming_grammar(str(err.value)) and "(U+0001) at character 1" in str(err.value)
    worst = '"\\\t\n' * (grammar_stage.MAX_GRAMMAR_BYTES // 4)  # the characters JSON doubles
    preset = Preset.create("Escapes", "", DecodingConfig(grammar=worst, grammar_kind="regex"))
    assert parse_preset_json(preset.to_json()).config.grammar == worst


def test_no_gbnf_export_carries_lark():
    """The exports read a validated config: a GBNF preset that validates is GBNF."""
    preset = Preset.create("Arithmetic", "", DecodingConfig(grammar='root ::= [0-9]+ "+" [0-9]+', grammar_kind="gbnf"))
    assert "%llguidance" not in to_llama_cpp(preset).text and "--grammar" in to_llama_cpp(preset).text
