"""Medusa chart builders are pure functions of hand-made rounds."""

from engine.strategies.medusa import HeadProposal, MedusaRound
from engine.strategies.speculative import DraftToken, ExtraToken
from engine.trace import TokenProb
from playground.charts import medusa as charts


def draft(i, token_id, text, accepted, resampled=None):
    return DraftToken(i, token_id, text, 1.0, 0.6, 1.0 if accepted else 0.0, None, accepted, [], [], resampled)


def hand_round() -> MedusaRound:
    """Three heads propose ' the', ' cat', ' sat'; the target accepts ' the', rejects ' cat' and
    puts ' dog' instead; ' sat' is never tested. Emitted: ' the', ' dog'."""
    proposals = [
        HeadProposal(1, 5, " the", [TokenProb(5, " the", 0.7), TokenProb(6, " a", 0.2)]),
        HeadProposal(2, 7, " cat", [TokenProb(7, " cat", 0.4), TokenProb(8, " dog", 0.3), TokenProb(9, " man", 0.1)]),
        HeadProposal(3, 10, " sat", [TokenProb(10, " sat", 0.5)]),
    ]
    dog = ExtraToken("resampled", 8, " dog", 0.8, 0.8, [])
    drafted = [draft(0, 5, " the", True), draft(1, 7, " cat", False, dog)]
    return MedusaRound(index=4, start=10, k=3, drafted=drafted, num_accepted=1, bonus=None, emitted_token_ids=[5, 8],
                       emitted_text=" the dog", draft_ms=1.0, verify_ms=5.0, elapsed_ms=50.0, proposals=proposals)


def test_fates_and_target_token():
    r = hand_round()
    assert charts.fates(r) == ["accepted", "rejected", "untested"]
    assert charts.target_token(r) == (8, " dog", "resampled")


def test_round_figure_draws_the_chain_and_the_candidates():
    fig = charts.round_figure(hand_round(), first_token=" on")
    by_name = {t.name: t for t in fig.data}
    assert list(by_name["top-1 accepted"].text) == ["␣the"] and list(by_name["top-1 accepted"].x) == [1]
    assert list(by_name["top-1 rejected"].x) == [2] and list(by_name["top-1 untested"].x) == [3]
    assert list(by_name["verified chain (each head's top-1)"].x) == [0, 1, 2, 3]
    others = [t for t in fig.data if t.legendgroup == "candidate"]
    assert [list(t.text) for t in others] == [["␣a"], ["␣dog", "␣man"]]  # heads 1 and 2 (head 3 has one candidate)
    target = by_name["target's resampled token"]
    assert list(target.text) == ["␣dog"] and list(target.x) == [1.5]  # after the one accepted token
    assert "1 of 2 head tokens accepted, 2 emitted" in fig.layout.title.text


def test_accept_figure_stacks_heads_and_target():
    rounds = [hand_round(), hand_round()]
    rounds[1].index, rounds[1].num_accepted, rounds[1].emitted_token_ids = 5, 3, [1, 2, 3, 4]
    fig = charts.accept_figure(rounds)
    target, heads = fig.data
    assert list(target.y) == [1, 1] and list(heads.y) == [1, 3] and list(heads.x) == [4, 5]
    assert fig.layout.shapes[0].y0 == 3.0  # (2 + 4) / 2 tokens per forward


def test_tree_figure_draws_the_verified_tree_and_its_accepted_path():
    """A hand tree: root -> the (accepted) -> dog (accepted); root -> a (rejected); the -> cat
    (rejected). Leaves one apart depth-first: dog 0, cat -1, a -2; the at -0.5, root at -1.25."""
    from engine.strategies.medusa import TreeNode

    r = hand_round()
    r.tree = [TreeNode(0, -1, 1, 0, 5, " the", 0.7, "accepted"), TreeNode(1, 0, 2, 1, 8, " dog", 0.21, "accepted"),
              TreeNode(2, -1, 1, 1, 6, " a", 0.2, "rejected"), TreeNode(3, 0, 2, 0, 7, " cat", 0.28, "rejected")]
    r.path, r.num_accepted, r.bonus = [0, 1], 2, ExtraToken("bonus", 10, " sat", 0.9, 0.9, [])
    r.drafted = [draft(0, 5, " the", True), draft(1, 8, " dog", True)]
    assert charts.tree_layout(r.tree) == [-0.5, 0.0, -2.0, -1.0, -1.25]
    by_name = {t.name: t for t in charts.round_figure(r, first_token=" on").data}
    assert list(by_name["accepted"].text) == ["␣the", "␣dog"] and list(by_name["accepted"].x) == [1, 2]
    assert list(by_name["rejected"].text) == ["␣a", "␣cat"]
    assert list(by_name["accepted path"].x) == [0, 1, None, 1, 2, None]
    assert list(by_name["target's bonus token"].x) == [2.5]


def test_a_round_with_an_empty_dynamic_tree_draws_the_root_and_the_target_token():
    """``medusa_tree_min_score`` can leave a round no candidates: the forward verifies the root
    alone and the target's bonus token follows it; every chart still draws (and says so)."""
    bonus = ExtraToken("bonus", 8, " dog", 0.8, 0.8, [])
    r = MedusaRound(index=2, start=4, k=0, drafted=[], num_accepted=0, bonus=bonus, emitted_token_ids=[8],
                    emitted_text=" dog", draft_ms=1.0, verify_ms=5.0, elapsed_ms=20.0, proposals=hand_round().proposals,
                    tree=[], path=[])
    fig = charts.tree_figure(r, first_token=" the")
    texts = [str(t) for trace in fig.data for t in (trace.text or [])]
    assert any("dog" in t for t in texts)  # the target's own token is drawn
    assert charts.accept_figure([r]).data[0].y[0] == 1
    charts.round_figure(r, first_token=" the")
