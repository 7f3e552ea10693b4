"""stage_note: one readable line per stage, from the trace alone (hand-made StageTraces and the
records a real chain writes)."""

from __future__ import annotations

import re

import pytest
import torch

from engine.config import DecodingConfig
from engine.chain import Chain
from engine.trace import StageTrace, StepTrace, TokenProb
from playground.charts import stage_notes
from playground.charts import step as step_charts
from playground.charts.stage_notes import stage_note


def st(name, params=None, kept=5, mass_removed=0.0, top=(), removed=(), entropy=1.0, tv=0.0) -> StageTrace:
    return StageTrace(name, kept, mass_removed, entropy, tv, list(top), list(removed), dict(params or {}))


THE, A, AN = TokenProb(1, " the", 0.5), TokenProb(2, " a", 0.3), TokenProb(3, " an", 0.15)


def test_dry_note():
    params = {"penalized": [{"token_id": 1, "token": " the", "length": 3, "penalty": 1.9, "phrase": " at"}]}
    assert stage_note(st("dry", params)) == "DRY: ' the' would extend the repeated phrase ' at' (length 3): −1.9 logits"
    assert stage_note(st("dry", {"penalized": []})) == "DRY: no token would extend a repeated phrase"


def test_xtc_notes():
    fired = {"xtc_threshold": 0.1, "xtc_probability": 0.5, "u": 0.21, "fired": True, "kept_id": 3}
    note = stage_note(st("xtc", fired, top=[AN], removed=[THE, A], mass_removed=0.8))
    assert note == "XTC fired (u=0.21 < 0.5): removed ' the', ' a'; kept ' an'"
    idle = fired | {"u": 0.73, "fired": False}
    assert stage_note(st("xtc", idle)) == "XTC did not fire (u=0.73 ≥ 0.5)"
    alone = fired | {"kept_id": None}
    assert stage_note(st("xtc", alone)) == "XTC fired (u=0.21 < 0.5) but fewer than two tokens reach 0.1: nothing removed"


def test_mirostat_and_dynamic_temperature_notes():
    assert stage_note(st("mirostat", {"mu": 7.2, "kept": 14, "mu_after": 7.05})) == \
        "mirostat: μ = 7.2 → kept 14 tokens; after the pick μ = 7.05"
    note = stage_note(st("dynamic_temperature", {"T": 1.3113, "normalized_entropy": 0.8113}, entropy=0.6))
    assert note == "dynamic temperature: T = 1.31 from normalised entropy 0.81 (entropy now 0.60 nats)"


def test_existing_stage_notes():
    assert stage_note(st("top_k", {"top_k": 2}, kept=2, mass_removed=0.2, removed=[AN])) == \
        "top-k 2: removed 20.0% of the mass (' an'); 2 tokens left"
    assert stage_note(st("top_p", {"top_p": 0.9}, kept=5)) == "top-p 0.9: removed nothing; 5 tokens left"
    assert stage_note(st("temperature", {"temperature": 0.7}, entropy=0.5)) == \
        "temperature 0.7: logits ÷ 0.7, sharper (entropy 0.50 nats)"
    assert stage_note(st("repetition_penalty", {"repetition_penalty": 1.3}, tv=0.125)) == \
        "repetition penalty 1.3: moved 12.5% of the mass"
    assert stage_note(st("raw", top=[TokenProb(1, "a\nb", 0.5)])) == \
        "raw: the model's distribution, entropy 1.00 nats; most likely 'a\\nb' 50.0%"


def test_every_stage_of_a_real_chain_gets_a_note():
    knobs = {"dry_multiplier": 1.0, "dry_sequence_breakers": [], "xtc_probability": 1.0, "xtc_threshold": 0.2,
             "top_n_sigma": 2.0, "dynatemp_range": 0.5, "smoothing_factor": 0.2, "mirostat": 2, "top_a": 0.1,
             "eta_cutoff": 0.01, "min_new_tokens": 5, "logit_bias": {"1": 1.0}, "top_k": 4, "repetition_penalty": 1.2}
    chain = Chain.from_config(DecodingConfig.from_dict(knobs), 2, eos_token_ids=[4])
    traced = chain.traced(torch.tensor([[0, 1, 2, 0, 1]]), torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0]]), 5, str)
    notes = [stage_note(s) for s in traced.stages]
    assert len(notes) == len(chain.stages) + 2 and all(n and "\n" not in n for n in notes)
    assert notes[0].startswith("raw:") and notes[-1].startswith("final:")
    by_name = dict(zip(["raw", *chain.names, "final"], notes))
    assert by_name["dry"] == "DRY: '2' would extend the repeated phrase '01' (length 2): −1 logits"
    assert by_name["min_new_tokens"].startswith("min new tokens 5: EOS masked")  # 3 new tokens < 5
    assert by_name["mirostat"].startswith("mirostat: μ = 10.0 → kept")


# Every stage's params as the engine records them (knobs plus what the stage writes per call).
RECORDED_PARAMS = {
    "raw": {}, "final": {},
    "repetition_penalty": {"repetition_penalty": 1.3}, "frequency_penalty": {"frequency_penalty": 0.5},
    "presence_penalty": {"presence_penalty": 0.5},
    "dry": {"dry_multiplier": 0.8, "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": -1,
            "penalized": [{"token": " the", "phrase": "a b", "length": 3, "penalty": 1.4}]},
    "logit_bias": {"logit_bias": {"cat": -5.0, "dog": 2.0}},
    "constraints": {"allowed_words": [], "banned_words": ["cat"]},
    "no_repeat_ngram": {"no_repeat_ngram_size": 3}, "min_new_tokens": {"min_new_tokens": 5},
    "temperature": {"temperature": 0.7},
    "dynamic_temperature": {"temperature": 0.7, "dynatemp_range": 0.5, "dynatemp_exponent": 1.0, "T": 0.91,
                            "normalized_entropy": 0.4},
    "smoothing": {"smoothing_factor": 0.3, "smoothing_curve": 1.0},
    "top_n_sigma": {"top_n_sigma": 1.0, "sigma": 2.1, "cutoff": 11.5},
    "top_k": {"top_k": 50}, "top_p": {"top_p": 0.9}, "min_p": {"min_p": 0.05}, "typical_p": {"typical_p": 0.9},
    "epsilon": {"epsilon_cutoff": 0.0003}, "eta": {"eta_cutoff": 0.0003}, "top_h": {"top_h": 0.4},
    "top_a": {"top_a": 0.2},
    "xtc": {"xtc_threshold": 0.1, "xtc_probability": 1, "u": None, "fired": True, "kept_id": 634},
    "mirostat": {"mirostat": 2, "mirostat_tau": 5.0, "mirostat_eta": 0.1, "mu": 10.0, "kept": 12, "mu_after": None},
    "contrast": {"cd_alpha": 0.1, "amateur": "tiny"},
    "watermark": {"watermark_delta": 2.0, "watermark_gamma": 0.25, "watermark_seeding": "lefthash",
                  "watermark_key": 15485863, "watermark_context": 1, "raised": 12288},
    "grammar": {"grammar_kind": "json_schema", "allowed": 120, "complete": False, "ended": False,
                "off_grammar_at": None, "wanted_id": 634, "wanted_p": 0.4, "log_allowed_mass": -0.5},
}


def test_recorded_params_cover_every_stage_name():
    from engine.config import STAGE_NAMES
    assert set(STAGE_NAMES) <= set(RECORDED_PARAMS)


@pytest.mark.parametrize("name", sorted(RECORDED_PARAMS))
def test_every_panel_title_is_in_words_without_python_reprs(name):
    """The issue's "xtc 0.1, 1, None, True, 634": a title names the stage and says what its knobs do."""
    stage = StageTrace(name, 12, 0.2, 1.0, 0.2, [TokenProb(634, " an", 0.5)], params=RECORDED_PARAMS[name])
    heading = stage_notes.stage_heading(stage)
    title = step_charts.stage_title(stage)
    for text in (heading, title, step_charts.explain_step(_step_with(stage))):
        assert not re.search(r"\b(None|True|False)\b|[\[\]{}]|\d, \d", text), (name, text)
    assert "_" not in heading, heading  # words, not the parameter's name
    if RECORDED_PARAMS[name] and name not in ("constraints", "grammar"):  # text knobs: their kind is named
        assert re.search(r"\d", heading), heading  # the knob's value is in the title
    assert len(heading.split()) >= (1 if name in ("raw", "final") else 3), heading


def test_new_samplers_titles_read_as_sentences():
    def heading(name):
        return stage_notes.stage_heading(StageTrace(name, 12, 0.2, 1.0, 0.2, [], params=RECORDED_PARAMS[name]))
    assert heading("xtc") == "XTC: drop top tokens above p=0.10 with probability 1.0"
    assert heading("mirostat") == "Mirostat v2: target surprise 5.0, mu 10.0"
    assert heading("top_n_sigma") == "top-nσ: keep logits within 1σ of the top"
    assert heading("dry").startswith("DRY: repeats over 2 tokens")
    assert heading("dynamic_temperature").startswith("dynamic temperature 0.7 ± 0.5")


def _step_with(stage):
    raw = StageTrace("raw", 100, 0.0, 2.0, 0.0, [TokenProb(634, " an", 0.4)])
    final = StageTrace("final", 12, 0.0, 1.0, 0.0, [TokenProb(634, " an", 0.5)])
    return StepTrace(index=0, chosen_token_id=634, chosen_token=" an", chosen_prob=0.5, raw_prob=0.4, draw=None,
                     draw_low=None, draw_high=None, entropy=1.0, raw_entropy=2.0, stages=[raw, stage, final])
