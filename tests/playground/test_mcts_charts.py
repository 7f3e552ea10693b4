"""MCTS chart builders are pure functions of a hand-made search tree."""

from engine.strategies.mcts import NOT_COMMITTED, MctsNode, MctsPosition
from playground.charts import mcts as charts


def hand_tree() -> MctsPosition:
    """Root with children A (6 visits, committed) and B (2 visits); A has children C (4) and D (1),
    plus an unvisited E; A's own rollout counted once (6 = 1 + 4 + 1)."""
    nodes = [
        MctsNode(0, None, None, "", 0, 1.0, 0.0, visits=8, q=-0.9, children=[1, 2]),
        MctsNode(1, 0, 11, " A", 1, 0.55, -0.6, visits=6, q=-0.5, values=[-0.7], children=[3, 4, 5], committed=True),
        MctsNode(2, 0, 12, " B", 1, 0.45, -0.8, visits=2, q=-1.9, values=[-1.8, -2.0]),
        MctsNode(3, 1, 13, " C", 2, 0.9, -0.1, visits=4, q=-0.4, values=[-0.4] * 4),
        MctsNode(4, 1, 14, " D", 2, 0.05, -3.0, visits=1, q=-1.2, values=[-1.2]),
        MctsNode(5, 1, 15, " E", 2, 0.01, -4.6),
    ]
    return MctsPosition(0, 11, " A", 8, 9, 1.0, nodes)


def test_layout_puts_leaves_on_rows_and_parents_between():
    laid = {p.node.id: p for p in charts.layout(hand_tree())}
    # depth-first, committed first then by visits: C, D, E under A (rows 0, 1, 2), then B (row 3)
    assert [laid[i].y for i in (3, 4, 5, 2)] == [0, 1, 2, 3]
    assert laid[1].y == 1.0 and laid[0].y == (1.0 + 3) / 2
    assert [laid[i].x for i in range(6)] == [0, 1, 1, 2, 2, 2]
    assert 5 not in {p.node.id for p in charts.layout(hand_tree(), show_unvisited=False)}


def test_tree_figure_sizes_colours_and_highlights():
    fig = charts.tree_figure(hand_tree())
    names = [t.name for t in fig.data]
    assert names[1].startswith("committed: ") and "expanded, not visited" in names
    visited = next(t for t in fig.data if t.name == "visited (size: visits)")
    assert list(visited.text) == ["␣A", "␣B", "␣C", "␣D"]
    assert list(visited.marker.color) == [-0.5, -1.9, -0.4, -1.2]  # Q as colour
    sizes = list(visited.marker.size)
    assert sizes[0] == charts.MAX_MARKER and sizes[0] > sizes[2] > sizes[1] > sizes[3]  # visits 6 > 4 > 2 > 1
    assert list(visited.marker.line.width) == [3, 1, 1, 1]  # the committed child outlined
    committed = fig.data[1]
    assert list(committed.x) == [0, 1, None] and list(committed.y) == [2.0, 1.0, None]
    assert visited.marker.showscale and fig.layout.showlegend is not False


def test_visit_table_and_quality_figure():
    table = charts.visit_table(hand_tree())
    assert [(r["token"], r["visits"], r["committed"]) for r in table] == [("␣A", 6, True), ("␣B", 2, False)]
    fig = charts.quality_figure([("greedy", -12.0, 8), ("beam", -9.5, 8), ("mcts", -8.0, 8)])
    bar = fig.data[0]
    assert list(bar.y) == [-12.0, -9.5, -8.0]
    assert list(bar.marker.color) == ["#4c78a8", "#4c78a8", charts.ACCENT]  # the best run highlighted
    assert "mean -1.000" in bar.hovertext[2]


def test_an_interrupted_search_is_drawn_without_a_committed_path():
    """A stopped run's unfinished search: the same tree, nothing committed, the title says so."""
    position = hand_tree()
    for node in position.nodes:
        node.committed = False
    position.chosen_token_id, position.chosen_token, position.simulations = NOT_COMMITTED, "", 8
    fig = charts.tree_figure(position)
    assert not any((t.name or "").startswith("committed") for t in fig.data)
    assert fig.layout.title.text == "Token 0: 8 simulations, 9 forwards, stopped before committing"
    visited = next(t for t in fig.data if t.name == "visited (size: visits)")
    assert list(visited.marker.line.width) == [1, 1, 1, 1]
    assert charts.tree_figure(hand_tree()).layout.title.text.endswith("→ ␣A")
