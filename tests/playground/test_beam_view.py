"""The beam tree builder and re-ranking on a hand-made 3-step trace (2 beams, 4 candidates a step).

    step 0 (from the prompt)       step 1                          step 2
    A  -0.10  kept  -> beam 0      a  (A) -0.20 = -0.30 kept  b0   x (a) -0.45 = -0.75 finished (eos)
    B  -0.50  kept  -> beam 1      ⏎ (B) -0.10 = -0.60 finished   y (b) -0.20 = -0.90 dropped
    C  -1.00  pruned               b  (A) -0.40 = -0.70 kept  b1   z (a) -0.80 = -1.10 pruned
    D  -2.00  pruned               c  (B) -1.00 = -1.50 pruned     w (b) -0.90 = -1.60 pruned

Hypotheses: "A a x" (sum -0.75, 3 tokens) and "B ⏎" (sum -0.60, 2 tokens). With length penalty 1
the longer one wins (-0.25 > -0.30); with 0 (raw sums) the shorter one does (-0.60 > -0.75).
"""

from __future__ import annotations

import pytest

from engine.strategies.beam import BeamTrace, lineage_tokens
from engine.trace import to_dict
from playground.charts import beam as charts
from tests.helpers.beam_view import trace  # noqa: F401


def test_lineage_follows_beam_slots(trace):
    assert lineage_tokens(trace, 2, 1) == [10, 21, 31]  # y extends b (slot 1 at step 1), which extends A
    assert lineage_tokens(trace, 1, 1) == [11, 2]


def test_tree_links_each_candidate_to_the_node_of_its_parent_beam(trace):
    nodes = charts.build_tree(trace, collapse_pruned=False)
    assert len(nodes) == 1 + 12
    assert nodes["0:0"].parent == "root" and nodes["0:3"].parent == "root"
    assert nodes["1:1"].parent == "0:1" and nodes["1:2"].parent == "0:0"
    assert nodes["2:1"].parent == "1:2"  # y's parent slot 1 was taken by b at step 1
    assert nodes["2:0"].status == "finished" and nodes["2:1"].status == "dropped"
    assert {k for k, n in nodes.items() if n.on_path} == {"root", "0:0", "1:0", "2:0"}


def test_collapsing_gathers_pruned_children_per_parent(trace):
    nodes = charts.build_tree(trace, collapse_pruned=True)
    collapsed = {k: n for k, n in nodes.items() if n.status == "collapsed"}
    assert {k: n.count for k, n in collapsed.items()} == {"0:proot": 2, "1:p0:1": 1, "2:p1:0": 1, "2:p1:2": 1}
    assert "C" in collapsed["0:proot"].hover and "D" in collapsed["0:proot"].hover
    assert not any(n.status == "pruned" for n in nodes.values())


def test_layout_puts_the_winning_path_on_one_row_and_leaves_below(trace):
    nodes = charts.build_tree(trace, collapse_pruned=True)
    # leaves in depth-first order, on-path child first, then by score: x, y, then the finished newline
    assert (nodes["2:0"].y, nodes["2:1"].y, nodes["1:1"].y) == (0, 1, 2)
    assert [nodes[k].y for k in ("root", "0:0", "1:0", "2:0")] == [0, 0, 0, 0]  # a parent sits on its first child
    assert nodes["1:2"].y == 1 and nodes["0:1"].y == 2
    assert nodes["0:proot"].y == pytest.approx(charts.COLLAPSED_OFFSET)
    assert charts.leaf_rows(nodes) == 3
    # highlighting the other hypothesis moves its path to the top row
    other = charts.build_tree(trace, collapse_pruned=True, highlight=1)
    assert [other[k].y for k in ("root", "0:1", "1:1")] == [0, 0, 0] and other["2:0"].y == 1


def test_lineages_that_died_out_are_dead_ends(trace):
    grown = charts.build_tree(trace, collapse_pruned=True)
    assert not any(n.dead_end for n in grown.values())  # every kept node leads to a finished or dropped one
    y = trace.steps[2].candidates[1]
    y.status, y.beam = "pruned", None  # now every child of b is pruned: b's lineage died out at step 2
    died = charts.build_tree(trace, collapse_pruned=True)
    assert died["1:2"].dead_end and not died["0:0"].dead_end and not died["1:0"].dead_end
    frontier = charts.build_tree(trace, collapse_pruned=True, upto=2)  # a search in progress at step 1
    assert not any(n.dead_end for n in frontier.values())


def test_highlight_and_upto(trace):
    second = charts.build_tree(trace, highlight=1)
    assert {k for k, n in second.items() if n.on_path} == {"root", "0:1", "1:1"}
    partial = charts.build_tree(trace, collapse_pruned=False, upto=1)
    assert sorted(partial) == ["0:0", "0:1", "0:2", "0:3", "root"]


def test_rerank_is_sum_over_length_to_the_penalty(trace):
    assert charts.rerank(trace.hypotheses, 1.0) == [(0, pytest.approx(-0.25)), (1, pytest.approx(-0.3))]
    assert charts.rerank(trace.hypotheses, 0.0) == [(1, pytest.approx(-0.6)), (0, pytest.approx(-0.75))]
    assert charts.rerank(trace.hypotheses, 2.0)[0] == (0, pytest.approx(-0.75 / 9))


def test_winner_note_and_table_follow_the_slider(trace):
    assert "Same winner" in charts.winner_note(trace, 1.0)
    note = charts.winner_note(trace, 0.0)
    assert "#2" in note and "shorter" in note
    rows = charts.hypotheses_rows(trace, 0.0)
    assert [r[1] for r in rows] == [2, 1]  # search ranks, re-ordered
    assert rows[0][:5] == [1, 2, "B", 2, -0.6] and rows[0][6] == -0.6
    assert len(rows[0]) == len(charts.HYPOTHESES_HEADERS)


def test_a_remote_search_counts_generated_tokens_and_scores_greedy_its_way(trace):
    """vLLM's method (engine.strategies.remote_beam) divides by the prompt's length too: with a 9-token prompt
    "A a x" (EOS last) has ``length`` 9 + 2 but generated 3 tokens, and greedy is scored over the
    same kind of length (the room saw the winner's "73 tokens" beside greedy's "64")."""
    for h in trace.hypotheses:
        h.length += 9 - (h.finish_reason == "eos")  # prompt + generated, an EOS last not counted
        h.score = h.sum_logprobs / h.length
    trace.hypotheses.reverse()  # best first under that score: "B" (-0.6 / 10) before "A a x" (-0.75 / 11)
    note = charts.winner_note(trace, 1.0)
    assert "(2 tokens, score -0.0600). Same winner" in note, note
    assert [row[3] for row in charts.hypotheses_rows(trace, 1.0)] == [2, 3]  # generated, as greedy's count
    same = charts.greedy_note([10, 20, 30], "A a x", [-0.1, -0.2, -0.45], trace, 1.0, length=11)
    assert "(3 tokens, sum log-prob -0.750, score -0.0682 " in same and "it is hypothesis #2" in same, same
    # "A b" (-0.5) over 9 + 2 = -0.0455 beats both hypotheses; over its own 2 tokens (-0.25) it lost to both
    better = charts.greedy_note([10, 21], "A b", [-0.1, -0.4], trace, 1.0, length=11)
    assert "(2 tokens, sum log-prob -0.500, score -0.0455 " in better and "0 of 2 hypotheses score higher" in better
    assert "2 of 2 hypotheses score higher" in charts.greedy_note([10, 21], "A b", [-0.1, -0.4], trace, 1.0)


def test_figure_colours_statuses_and_marks_the_winning_path(trace):
    fig = charts.tree_figure(trace)
    names = {v: k for k, v in charts.STATUS_NAMES.items()}
    by_name = {names.get(t.name, t.name): t for t in fig.data if t.name}  # legend names say what each marker is
    assert {"kept", "finished", "dropped", "collapsed", "root", "winning path"} <= set(by_name)
    assert by_name["finished"].marker.color == charts.STATUS_COLOURS["finished"]
    assert list(by_name["winning path"].x) == [0, 1, 2]
    hover = " ".join(by_name["finished"].hovertext)
    assert "log-prob -0.450" in hover and "cumulative -0.750" in hover and "normalised -0.250" in hover
    path_edges = [t for t in fig.data if t.mode == "lines" and t.line.color == charts.WINNER][0]
    assert [x for x in path_edges.x if x is not None] == [-1, 0, 0, 1, 1, 2]
    assert fig.layout.dragmode == "pan"


def test_tree_is_a_pure_function_of_the_json(trace):
    again = BeamTrace.from_dict(to_dict(trace))
    assert again == trace
    assert charts.build_tree(again) == charts.build_tree(trace)


def test_step_summary_counts_statuses(trace):
    text = charts.step_summary(trace)
    assert "3 steps" in text and "4 kept, 5 pruned, 2 finished, 1 dropped" in text
    assert "early stopping" in text


def test_view_rerank_handler_is_pure_and_highlights_the_new_winner(trace):
    from engine.trace import Timing, Trace
    from playground.views.beam import BeamSession, rerank_outputs

    run = Trace(model="hand-made", strategy="beam", config={"strategy": "beam"}, prompt="p", prompt_token_ids=[1],
                text="A a x", generated_token_ids=[10, 20, 30], stop_reason="eos", steps=[],
                timing=Timing(0.0, 0.0, 0.0), beam=trace)
    figure, rows, greedy, note = rerank_outputs(BeamSession(trace=run), 0.0, True)
    path = [t for t in figure.data if t.name == "winning path"][0]
    assert list(path.x) == [0, 1]  # hypothesis #2 ("B" then newline) wins without length normalisation
    assert rows[0][1] == 2 and "#2" in note and greedy == ""
    assert rerank_outputs(None, 1.0, True) == rerank_outputs(BeamSession(), 1.0, True)  # no run yet: no change
