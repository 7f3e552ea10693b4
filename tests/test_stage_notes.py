"""stage_note: one readable line per stage, from the trace alone (hand-made StageTraces and the
records a real chain writes)."""

from __future__ import annotations

import torch

from engine.config import DecodingConfig
from engine.processors import Chain
from engine.trace import StageTrace, TokenProb
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
