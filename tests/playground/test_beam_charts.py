"""Beam charts: legend names for every marker, 14 px text, the ended wording, readable headers."""

from __future__ import annotations

from engine.strategies.beam import BeamHypothesis, BeamTrace
from playground.charts import beam as charts


def hyp(reason: str) -> BeamHypothesis:
    return BeamHypothesis(token_ids=[1, 2], text="a b", sum_logprobs=-1.0, length=2, score=-0.5, finish_reason=reason, path=[0, 0])


def search(reasons: list[str], ended_by: str = "no_continuation") -> BeamTrace:
    return BeamTrace(num_beams=2, num_beam_groups=1, length_penalty=1.0, early_stopping=False, candidates_per_step=4,
                     hypotheses=[hyp(r) for r in reasons], ended_by=ended_by)


def test_ended_wording_says_which_limit():
    assert charts.ended_text(search(["max_new_tokens", "max_new_tokens"])) == "ended: every beam reached max_new_tokens"
    assert charts.ended_text(search(["eos", "max_new_tokens"])) == "ended: max_new_tokens reached"
    assert charts.ended_text(search(["eos", "eos"])) == "ended: every beam finished"
    assert charts.ended_text(search(["eos"], "early_stopping")) == "ended by early stopping"


def test_every_marker_status_has_a_legend_name_and_colours_are_visible():
    from tests.helpers.step_charts import contrast

    assert set(charts.STATUS_NAMES) == set(charts.STATUS_COLOURS)
    assert "diamond" in charts.STATUS_NAMES["finished"] and "dot" in charts.STATUS_NAMES["kept"]
    for colour in [*charts.STATUS_COLOURS.values(), charts.WINNER]:
        assert contrast(colour) >= 3.0, colour  # graphics: WCAG AA 3:1


def test_headers_are_short_and_explained():
    assert len(charts.HYPOTHESES_HEADERS) == len(charts.HYPOTHESES_WIDTHS) == 7
    assert max(len(h) for h in charts.HYPOTHESES_HEADERS) <= 9  # no one-letter-per-line wrapping
    assert "found: the search's own rank" in charts.HYPOTHESES_NOTE and "nats" in charts.HYPOTHESES_NOTE
    assert "scroll" not in charts.TREE_TITLE  # gr.Plot cannot turn plotly's scrollZoom on


WORDS = [" the", " best", " way", " to", " learn", " language", " is", " practice", ",", " and", " every", " day",
         " speaking", " with", " native", " speakers", ".", " reading", " books", " immersion"]


def long_search(steps: int, beams: int = 4, per_step: int = 8, seed: int = 0) -> BeamTrace:
    """A beam search of ``steps`` steps as the engine records it: ``per_step`` candidates a step,
    the best ``beams`` kept (their parents shuffled, so lineages die out), the rest pruned; the
    beams finish at the last step."""
    import random

    from engine.strategies.beam import BeamCandidate, BeamStep
    rng = random.Random(seed)
    trace = BeamTrace(num_beams=beams, num_beam_groups=1, length_penalty=1.0, early_stopping=False,
                      candidates_per_step=per_step)
    paths: list[list[int]] = [[] for _ in range(beams)]
    scores = [0.0] * beams
    for t in range(steps):
        parents = sorted(rng.choice(range(beams)) if t else 0 for _ in range(per_step))
        cands = []
        for i, parent in enumerate(parents):
            lp = -rng.uniform(0.1, 3.0)
            cands.append(BeamCandidate(parent=parent, token_id=rng.randrange(1000), token=rng.choice(WORDS), logprob=lp,
                                       raw_logprob=lp, score=scores[parent] + lp, normalized_score=(scores[parent] + lp) / (t + 1),
                                       status="pruned"))
        best = sorted(range(per_step), key=lambda i: -cands[i].score)[:beams]
        new_paths = []
        for slot, i in enumerate(best):
            cands[i].status, cands[i].beam = ("finished" if t == steps - 1 else "kept"), slot
            new_paths.append(paths[cands[i].parent] + [i])
        paths, scores = new_paths, [cands[i].score for i in best]
        trace.steps.append(BeamStep(index=t, candidates=cands, entropy=[1.0] * beams))
    trace.hypotheses = [BeamHypothesis(token_ids=list(range(steps)), text="x", sum_logprobs=s, length=steps,
                                       score=s / steps, finish_reason="max_new_tokens", path=p)
                        for s, p in zip(scores, paths)]
    trace.winner = 0
    return trace


def _label_boxes(fig) -> list[tuple[float, float, float, float]]:
    """The pixel boxes of the figure's visible token labels, computed from the figure alone (its
    fixed width, height, margins and axis ranges; a label is 'top center' above its marker)."""
    lay = fig.layout
    plot_w = (lay.width or charts.FIT_WIDTH) - lay.margin.l - lay.margin.r  # autosized: at least FIT_WIDTH
    plot_h = lay.height - lay.margin.t - lay.margin.b
    (x0, x1), (y0, y1) = lay.xaxis.range, lay.yaxis.range
    boxes = []
    for trace in fig.data:
        for x, y, text in zip(trace.x, trace.y, trace.text or ()):
            if not text:
                continue
            assert trace.textposition == "top center" and trace.textfont.size >= 14
            px = (x - x0) / (x1 - x0) * plot_w
            py = (y - y1) / (y0 - y1) * plot_h
            half = len(text) * charts.CHAR_PX / 2
            boxes.append((px - half, py - charts.LABEL_LIFT - charts.LABEL_PX, px + half, py - charts.LABEL_LIFT))
    return boxes


def test_long_trees_scroll_wide_and_no_two_labels_overlap():
    """24 and 64 steps (the issue: labels ran together into an unreadable strip): the figure grows
    STEP_PX a step (the page scrolls it sideways), labels are short, and no two visible labels'
    boxes overlap; every node of the winning path keeps its label, the others show where there is room."""
    for steps in (24, 64):
        trace = long_search(steps)
        fig = charts.tree_figure(trace)
        assert fig.layout.autosize is False and fig.layout.width >= steps * charts.STEP_PX
        boxes = _label_boxes(fig)
        assert all(box[2] - box[0] < charts.STEP_PX for box in boxes)  # a label is narrower than a step
        assert all(fig.layout.width - 20 >= box[2] and box[0] >= 0 for box in boxes)
        for i, a in enumerate(boxes):
            for b in boxes[i + 1:]:
                assert not (a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]), (steps, a, b)
        nodes = charts.build_tree(trace)
        shown = charts.visible_labels(nodes)
        path = [k for k, n in nodes.items() if n.on_path and n.status != "root"]
        assert len(path) == steps and all(k in shown for k in path)
        assert len(boxes) >= steps * 2  # more than the path: the room is used


def test_a_short_tree_fills_its_box_and_keeps_all_its_labels():
    """4 steps fit a phone's 370 px: no fixed width (a desktop spreads it wider), every label shown."""
    trace = long_search(4)
    fig = charts.tree_figure(trace)
    labelled = [n for n in charts.build_tree(trace).values() if n.status in ("kept", "finished")]
    assert len(_label_boxes(fig)) == len(labelled)
    assert fig.layout.width is None and fig.layout.autosize is True and fig.layout.legend.orientation == "h"


def test_a_wide_trees_legend_is_one_column_at_the_left():
    fig = charts.tree_figure(long_search(24))
    assert fig.layout.legend.orientation == "v" and fig.layout.legend.x == 0
