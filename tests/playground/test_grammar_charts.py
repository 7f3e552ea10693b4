"""Issue #39, what the room sees, on hand-made records: the grammar's panel draws the forbidden
tokens as removed (like top-k's), its note and the step's sentence name what the model wanted, how
many tokens the grammar allowed and the chosen token's p before and after the mask; the summary
says the run's cost; the distortion chart draws both exact distributions; the knob panel shows the
grammar as a text box. Every number in the words is the record's."""

from __future__ import annotations

import math

import pytest

from engine.config import KNOBS
from engine.reports.distortion import DistortionReport, StringOdds
from engine.reports.lessons import Outcome
from engine.stages import grammar_cost, grammar_facts
from engine.trace import StageTrace, StepTrace, Timing, TokenProb, Trace
from playground import knobs as knob_panel
from playground.charts import grammar as grammar_charts
from playground.charts import step as charts
from playground.charts.stage_notes import stage_heading, stage_note


def tp(i, text, p):
    return TokenProb(i, text, p)


def json_step(index=0, chosen=(10, "{", 0.91)) -> StepTrace:
    """Step 0 of a JSON run: the model wanted ' Sure' (62%) and ' Here' (30%); the grammar allows
    '{' and '{"' (8% of the raw mass between them), so it removed 92%."""
    raw = StageTrace("raw", 49152, 0.0, 1.3, 0.0, [tp(1, " Sure", 0.62), tp(2, " Here", 0.30), tp(10, "{", 0.0728),
                                                 tp(11, '{"', 0.0072)])
    grammar = StageTrace("grammar", 2, 0.92, 0.30, 0.92, [tp(10, "{", 0.91), tp(11, '{"', 0.09)],
                         removed=[tp(1, " Sure", 0.62), tp(2, " Here", 0.30)],
                         params={"grammar_kind": "json_schema", "allowed": 2, "complete": False, "ended": False,
                                 "off_grammar_at": None, "wanted_id": 1, "wanted_p": 0.62,
                                 "log_allowed_mass": math.log(0.08)})
    final = StageTrace("final", 2, 0.0, 0.30, 0.0, list(grammar.top))
    return StepTrace(index=index, chosen_token_id=chosen[0], chosen_token=chosen[1], chosen_prob=chosen[2],
                     raw_prob=0.0728, draw=None, draw_low=None, draw_high=None, entropy=0.30, raw_entropy=1.3,
                     stages=[raw, grammar, final])


def end_step(index=1) -> StepTrace:
    raw = StageTrace("raw", 49152, 0.0, 0.5, 0.0, [tp(5, ",", 0.95), tp(2, "<|im_end|>", 0.04)])
    grammar = StageTrace("grammar", 1, 0.96, 0.0, 0.96, [tp(2, "<|im_end|>", 1.0)], removed=[tp(5, ",", 0.95)],
                         params={"grammar_kind": "regex", "allowed": 1, "complete": True, "ended": True,
                                 "off_grammar_at": None, "wanted_id": 5, "wanted_p": 0.95,
                                 "log_allowed_mass": math.log(0.04)})
    return StepTrace(index=index, chosen_token_id=2, chosen_token="<|im_end|>", chosen_prob=1.0, raw_prob=0.04,
                     draw=None, draw_low=None, draw_high=None, entropy=0.0, raw_entropy=0.5,
                     stages=[raw, grammar, StageTrace("final", 1, 0.0, 0.0, 0.0, list(grammar.top))])


def test_the_grammar_panel_draws_the_forbidden_tokens_removed():
    fig = charts.stage_chart(json_step())
    removed = [t for t in fig.data if t.name == "removed"]
    assert len(removed) == 1 and list(removed[0].y) == ["✕ ␣Sure", "✕ ␣Here"] and list(removed[0].x) == [0.62, 0.30]
    assert removed[0].xaxis == "x2"  # on the grammar's panel, the second
    titles = [a.text for a in fig.layout.annotations]
    assert any(t.startswith("grammar (JSON<br>schema):") and "−92.0%" in t for t in titles), titles


def test_the_note_and_the_sentence_say_what_the_grammar_did():
    step = json_step()
    note = stage_note(step.stages[1])
    assert note == "grammar: the model wanted ' Sure' at 62%; the grammar allows only '{', '{\"'; 92.0% of the mass " \
                   "was on tokens it forbids"
    assert stage_heading(step.stages[1]) == "grammar (JSON schema): forbidden tokens masked"
    sentence = charts.grammar_sentence(step)
    assert sentence == ("The model wanted “␣Sure” (62.0%), which the grammar forbids; the grammar allowed 2 tokens and "
                        "removed 92.0% of the mass, so “{” went from p = 7.3% before the mask to 91.0% after it.")
    assert sentence in charts.explain_step(step)
    assert charts.grammar_sentence(end_step()) == "The grammar was complete: only the end of text “⟪im_end⟫” was allowed."
    assert stage_note(end_step().stages[1]) == "grammar: complete; only the end of text is allowed"


def test_a_mask_that_removed_all_but_a_trace_never_says_minus_zero():
    """At the JSON preset's first step on the embedded model the grammar removes nearly all the mass,
    and float32's sum of the removed probabilities can pass 1 by an ulp (the page said "-0.0%"): the
    sentence says it removed 100.0%, never a negative share kept."""
    step = json_step()
    step.stages[1].mass_removed = 1.0000001
    sentence = charts.explain_step(step)
    assert "removed 100.0% of the mass" in sentence and "-0" not in sentence and "−0" not in sentence, sentence


def test_facts_come_from_the_records():
    facts = grammar_facts(json_step())
    assert (facts.allowed, facts.wanted, facts.chosen_before, facts.chosen_after) == (2, (" Sure", 0.62), 0.0728, 0.91)
    assert facts.forbidden_mass == pytest.approx(0.92) and facts.log_allowed_mass == pytest.approx(math.log(0.08))
    no_grammar = json_step()
    no_grammar.stages = [no_grammar.stages[0], no_grammar.stages[2]]
    assert grammar_facts(no_grammar) is None and grammar_cost([no_grammar]) is None


def test_the_summary_says_the_runs_grammar_cost():
    steps = [json_step(0), end_step(1)]
    trace = Trace("m", "greedy", {}, "p", [1], "{", [10, 2], "eos", steps, Timing(1.0, 1.0, 1.0),
                  summary={"tokens": 2, "mean_logprob": -0.05, "mean_raw_logprob": -2.0, "perplexity": 7.0})
    cost = math.log(0.08) + math.log(0.04)
    assert grammar_cost(steps) == pytest.approx(cost)
    text = charts.summary_markdown(trace)
    assert f"grammar cost {cost:.2f} nats" in text and f"{math.exp(-cost):,.3g}×" in text
    plain = Trace("m", "greedy", {}, "p", [1], "x", [1], "eos", [json_step()], Timing(1.0, 1.0, 1.0))
    plain.steps[0].stages = [plain.steps[0].stages[0], plain.steps[0].stages[2]]
    assert "grammar" not in charts.summary_markdown(plain)


def test_the_distortion_chart_draws_both_distributions():
    from playground.views.lessons import report_chart

    report = DistortionReport("p", "regex", "(Yes|No|Maybe)", [StringOdds("Yes", 0.893, 0.134, 4),
                                                                StringOdds("No", 0.107, 0.581, 2),
                                                                StringOdds("Maybe", 0.0, 0.285, 9)],
                              allowed_mass=8.7e-7, total_variation=0.759, kl_masked_exact=2.9, prefixes=31)
    fig = grammar_charts.distortion_figure(report)
    exact, masked = fig.data
    assert list(exact.y) == ["Yes", "No", "Maybe"] and list(exact.x) == [0.893, 0.107, 0.0]
    assert list(masked.x) == [0.134, 0.581, 0.285] and list(masked.text) == ["13%", "58%", "28%"]
    assert "total variation 0.76" in fig.layout.title.text and "8.7e-07" in fig.layout.title.text
    assert report_chart(Outcome(True, "", {}, report)) is not None


def test_the_grammar_is_a_text_box_in_its_own_group():
    groups = {title: names for title, names, _ in knob_panel.knob_groups()}
    assert groups["Structured output (grammar)"] == ("grammar", "grammar_kind")
    text = '{"type": "object"}\n'
    assert knob_panel.component_value(KNOBS["grammar"], text) == text
    assert knob_panel.display_value(KNOBS["grammar"], text) == text
    assert KNOBS["grammar"].range_text() == "a text of at most 4,000 characters"
    _, errors = knob_panel.checked_values(["grammar"], ["x" * 4001])
    assert errors == ["grammar: 4,001 characters is over the 4,000-character limit"]
