"""The speculative view's chart of the target's own token (issue #52): in a greedy round nothing
is drawn, so its title names the target's argmax and why it was taken; the title read "resampled
The" (nothing was resampled). A sampled round keeps "resampled … from the residual"."""

from __future__ import annotations

from engine.strategies.speculative import DraftToken, ExtraToken, SpecRound
from playground.charts import speculative as charts
from tests.helpers.speculative_view import hand_rounds, tp


def greedy_round() -> SpecRound:
    """Draft " sat" differs from the target's argmax " lay", which is taken (no draw)."""
    top = [tp(13, " lay", 0.6), tp(12, " sat", 0.3)]
    own = ExtraToken("resampled", 13, " lay", 0.6, 0.6, top)
    return SpecRound(0, 0, 1, [DraftToken(0, 12, " sat", 0.7, 0.3, 0.0, None, False, top, top, own)],
                     0, None, [13], " lay", 1.0, 1.0, 2.0)


def test_a_greedy_round_s_own_token_is_not_called_resampled():
    title = charts.residual_figure(greedy_round(), 0).layout.title.text.replace("<br>", " ")
    assert "resampled" not in title, title
    assert title == "the target's own token ␣lay: its argmax of p (the draft differed from it)", title
    bonus = ExtraToken("bonus", 17, " mat", 0.9, 0.9, [tp(17, " mat", 0.9)])
    assert charts.extra_origin(bonus) == "the target's own token ␣mat: its argmax of p (every draft was accepted)"


def test_a_sampled_round_still_says_resampled_from_the_residual():
    title = charts.residual_figure(hand_rounds()[0], 2).layout.title.text.replace("<br>", " ")
    assert title == "resampled ␣lay from the residual normalise(max(0, p − q))", title
