"""The beam view's re-rank (issue #52): its updates are keyed by component from named fields
(``Reranked``), not a hand-counted ``[gr.update()] * 4`` list whose order had to match the outputs'."""

from __future__ import annotations

import gradio as gr

from engine.trace import Timing, Trace
from playground.views import beam as view
from tests.helpers.beam_view import trace  # noqa: F401 (the hand-made search fixture)


class Box:
    """A stand-in component: only its identity matters to an update dict."""

    def __init__(self, name: str):
        self.name = name


def outputs() -> view.Outputs:
    return view.Outputs(*(Box(name) for name in view.Outputs.__dataclass_fields__))


def test_reranked_fields_are_outputs_and_updates_are_keyed_by_them(trace):  # noqa: F811
    out = outputs()
    run = Trace(model="hand-made", strategy="beam", config={"strategy": "beam"}, prompt="p", prompt_token_ids=[1],
                text="A a x", generated_token_ids=[10, 20, 30], stop_reason="eos", steps=[],
                timing=Timing(0.0, 0.0, 0.0), beam=trace)
    session = view.BeamSession(trace=run)
    reranked = view.rerank_outputs(session, 0.0, True)
    updates = view.rerank_updates(out, session, 0.0, True)
    assert [box.name for box in view.rerank_targets(out)] == list(view.Reranked._fields)
    assert updates == {out.tree: reranked.tree, out.hypotheses: reranked.hypotheses, out.greedy: reranked.greedy,
                       out.winner: reranked.winner}
    assert updates[out.hypotheses][0][1] == 2  # hypothesis #2 wins without length normalisation, in the table's cell
    assert view.rerank_updates(out, None, 1.0, True) == {out.tree: gr.skip()}  # nothing to re-rank: nothing changes
