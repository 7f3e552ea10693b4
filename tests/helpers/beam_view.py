"""Shared by the tests: what tests/playground/test_beam_view.py and the tests beside it use."""

from __future__ import annotations

import pytest
from engine.strategies.beam import BeamCandidate, BeamHypothesis, BeamStep, BeamTrace

__all__ = ['trace']


def cand(parent, token_id, token, logprob, score, step, status, beam=None, reason=None) -> BeamCandidate:
    return BeamCandidate(parent=parent, token_id=token_id, token=token, logprob=logprob, raw_logprob=logprob,
                         score=score, normalized_score=score / (step + 1), status=status, beam=beam,
                         finish_reason=reason)


@pytest.fixture
def trace() -> BeamTrace:
    steps = [
        BeamStep(0, [cand(0, 10, "A", -0.1, -0.1, 0, "kept", 0), cand(0, 11, "B", -0.5, -0.5, 0, "kept", 1),
                     cand(0, 12, "C", -1.0, -1.0, 0, "pruned"), cand(0, 13, "D", -2.0, -2.0, 0, "pruned")],
                 [1.0, 1.0]),
        BeamStep(1, [cand(0, 20, "a", -0.2, -0.3, 1, "kept", 0),
                     cand(1, 2, "\n", -0.1, -0.6, 1, "finished", None, "eos"),
                     cand(0, 21, "b", -0.4, -0.7, 1, "kept", 1), cand(1, 22, "c", -1.0, -1.5, 1, "pruned")],
                 [1.0, 1.0]),
        BeamStep(2, [cand(0, 30, "x", -0.45, -0.75, 2, "finished", None, "eos"),
                     cand(1, 31, "y", -0.2, -0.9, 2, "dropped", 1),
                     cand(0, 32, "z", -0.8, -1.1, 2, "pruned"), cand(1, 33, "w", -0.9, -1.6, 2, "pruned")],
                 [1.0, 1.0]),
    ]
    hyps = [
        BeamHypothesis([10, 20, 30], "A a x", -0.75, 3, -0.25, "eos", [0, 0, 0], returned=True),
        BeamHypothesis([11, 2], "B", -0.6, 2, -0.3, "eos", [1, 1]),
    ]
    return BeamTrace(num_beams=2, num_beam_groups=1, length_penalty=1.0, early_stopping=True, candidates_per_step=4,
                     steps=steps, hypotheses=hyps, winner=0, ended_by="early_stopping")
