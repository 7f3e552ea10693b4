"""EAGLE chart builders are pure functions of hand-made rounds (the oracle: the counts written here)."""

import json
import math

from engine.strategies.eagle import EagleRound
from engine.strategies.medusa import TreeNode
from engine.strategies.speculative import DraftToken, ExtraToken
from playground.charts import eagle as charts


def draft(i, token_id, text, accepted, resampled=None):
    return DraftToken(i, token_id, text, 1.0, 0.6, 1.0 if accepted else 0.0, None, accepted, [], [], resampled)


def hand_round(index: int = 3) -> EagleRound:
    """The head drafts ' the' (0.6) and ' a' (0.3) at depth 1; under ' the': ' cat' (0.7 given
    ' the') and ' dog' (0.2); under ' a': ' man' (0.5). The target accepts ' the', refuses both of
    its children and puts ' sun' instead; ' man' is never tested. Emitted: ' the', ' sun'."""
    tree = [TreeNode(0, -1, 1, 0, 5, " the", 0.6, "accepted"), TreeNode(1, -1, 1, 1, 6, " a", 0.3, "rejected"),
            TreeNode(2, 0, 2, 0, 7, " cat", 0.42, "rejected"), TreeNode(3, 0, 2, 1, 8, " dog", 0.12, "rejected"),
            TreeNode(4, 1, 2, 0, 9, " man", 0.15, "untested")]
    sun = ExtraToken("resampled", 10, " sun", 1.0, 1.0, [])
    drafted = [draft(0, 5, " the", True), draft(1, 7, " cat", False, sun)]
    return EagleRound(index=index, start=4, k=5, drafted=drafted, num_accepted=1, bonus=None, emitted_token_ids=[5, 10],
                      emitted_text=" the sun", draft_ms=1.0, verify_ms=5.0, elapsed_ms=50.0, tree=tree, path=[0],
                      refused_at=2)


def numbers(fig) -> list[float]:
    """Every number the figure's traces plot."""
    return [v for t in fig.data for axis in ("x", "y") for v in (getattr(t, axis, None) or []) if isinstance(v, float)]


def test_confidence_is_the_path_score_over_the_parents():
    tree = hand_round().tree
    assert [round(charts.confidence(n, tree), 6) for n in tree] == [0.6, 0.3, 0.7, 0.2, 0.5]


def test_tree_figure_labels_every_node_with_its_token_and_confidence():
    fig = charts.tree_figure(hand_round(), first_token=" on")
    by_name = {t.name: t for t in fig.data}
    labels = [label for name in ("accepted", "rejected", "untested") for label in by_name[name].text]
    assert sorted(labels) == sorted(["␣the 0.60", "␣a 0.30", "␣cat 0.70", "␣dog 0.20", "␣man 0.50"])
    assert list(by_name["accepted"].x) == [1] and list(by_name["untested"].x) == [2]
    assert list(by_name["first token fed"].text) == ["␣on"]
    assert list(by_name["target refused at depth 2"].x) == [1.5]
    assert list(by_name["target's resampled token"].text) == ["␣sun"]
    path_edges = [x for x in by_name["accepted path"].x if x is not None]
    assert path_edges == [0, 1]  # root -> ' the'
    assert "1 of 5 draft nodes accepted, refused at depth 2" in fig.layout.title.text
    assert not any(math.isnan(v) for v in numbers(fig))
    json.loads(fig.to_json())


def test_calibration_bins_the_tested_nodes_by_confidence():
    bins = charts.calibration([hand_round(0), hand_round(1)], bins=5)
    # tested: ' the' 0.6 (accepted), ' a' 0.3, ' cat' 0.7, ' dog' 0.2 (refused); ' man' untested; twice
    assert [(b.low, b.nodes, b.accepted) for b in bins] == [(0.2, 4, 0), (0.6, 4, 2)]
    assert bins[1].accepted_share == 0.5 and math.isclose(bins[1].mean_confidence, 0.65)
    fig = charts.calibration_figure([hand_round()])
    points = fig.data[1]
    assert list(points.y) == [0.0, 0.5] and list(points.text) == ["0/2", "1/2"]
    assert not any(math.isnan(v) for v in numbers(fig))


def test_calibration_of_no_tested_node_is_empty_not_nan():
    empty = EagleRound(index=0, start=0, k=0, drafted=[], num_accepted=0, bonus=None, emitted_token_ids=[1],
                       emitted_text="x", draft_ms=0.0, verify_ms=1.0, elapsed_ms=1.0)
    assert charts.calibration([empty]) == []
    fig = charts.calibration_figure([empty])
    assert list(fig.data[1].x) == [] and not any(math.isnan(v) for v in numbers(fig))
    assert charts.tree_figure(empty).layout.title.text.startswith("Round 0: 0 of 0 draft nodes accepted")


def test_accept_figure_stacks_accepted_drafts_and_the_targets_token():
    fig = charts.accept_figure([hand_round(0), hand_round(1)])
    by_name = {t.name: t for t in fig.data}
    assert list(by_name["accepted draft tokens"].y) == [1, 1] and list(by_name["target's token"].y) == [1, 1]
    assert "2.00 tokens per target forward" in fig.layout.annotations[0].text
