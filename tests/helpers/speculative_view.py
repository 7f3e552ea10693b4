"""Shared by the tests: what tests/browser/test_speculative_view.py and the tests beside it use."""

from __future__ import annotations

from engine.strategies.speculative import DraftToken, ExtraToken, SpecRound
from engine.trace import TokenProb

__all__ = ['hand_rounds', 'tp']


def tp(token_id: int, token: str, prob: float) -> TokenProb:
    return TokenProb(token_id, token, prob)


def hand_rounds() -> list[SpecRound]:
    """Round 0 drafts The / cat / sat; 'sat' is rejected (p=0.10, q=0.60, u=0.90) and the target
    resamples 'lay'. Round 1 drafts on / the, both pass, and the target adds the bonus 'mat'."""
    the = DraftToken(0, 10, "The", q=0.5, p=0.6, accept_prob=1.0, u=0.3, accepted=True,
                     q_top=[tp(10, "The", 0.5)], p_top=[tp(10, "The", 0.6)])
    cat = DraftToken(1, 11, " cat", q=0.5, p=0.4, accept_prob=0.8, u=0.7, accepted=True,
                     q_top=[tp(11, " cat", 0.5)], p_top=[tp(11, " cat", 0.4)])
    lay = ExtraToken("resampled", 13, " lay", prob=0.5, p=0.3, top=[tp(13, " lay", 0.5), tp(14, " <b>", 0.25)], draw=0.2)
    sat = DraftToken(2, 12, " sat", q=0.6, p=0.1, accept_prob=0.1 / 0.6, u=0.9, accepted=False,
                     q_top=[tp(12, " sat", 0.6), tp(13, " lay", 0.1)],
                     p_top=[tp(13, " lay", 0.3), tp(12, " sat", 0.1), tp(14, " <b>", 0.05)], resampled=lay)
    on = DraftToken(0, 15, " on", q=0.9, p=0.95, accept_prob=1.0, u=0.5, accepted=True,
                    q_top=[tp(15, " on", 0.9)], p_top=[tp(15, " on", 0.95)])
    the2 = DraftToken(1, 16, " the", q=0.8, p=0.7, accept_prob=0.875, u=0.1, accepted=True,
                      q_top=[tp(16, " the", 0.8)], p_top=[tp(16, " the", 0.7)])
    mat = ExtraToken("bonus", 17, " mat", prob=0.55, p=0.55, top=[tp(17, " mat", 0.55), tp(18, " rug", 0.2)], draw=0.4)
    return [
        SpecRound(0, 0, 3, [the, cat, sat], 2, None, [10, 11, 13], "The cat lay", 5.0, 20.0, 30.0),
        SpecRound(1, 3, 2, [on, the2], 2, mat, [15, 16, 17], " on the mat", 4.0, 18.0, 55.0, "max_new_tokens"),
    ]
