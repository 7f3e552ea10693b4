"""Shared by the tests: what tests/playground/test_lessons_room.py and the tests beside it use."""

from __future__ import annotations

import pytest

__all__ = ['TAUGHT', 'run', 'shown_chart', 'tab']


# What each built-in lesson's chart must show (a panel title or the figure's text), the stage it teaches.
TAUGHT = {
    "greedy-vs-sampling": "where the draw",  # a sampled lane: the draw's panel
    "temperature": "temperature",
    "truncation": "top-p",  # the lane its check is about (engine.reports.lessons.taught_run): top-p adapts
    "penalties": "penalty",
    "beam-search": "beam",
    "speculative": "accepted drafts",
    "kv-cache": "cache",
    "quantization": "KL",
    "contrastive-search": "contrastive search",
    "grammar": "masked decoding",  # the distortion: masked decoding beside the model conditioned on the grammar
    "gptq-vs-awq": "perplexity",
    "logit-lens": "raw model",  # its Lessons-tab figure is the step chart (the lens itself opens in Inside the model)
    "watermark": "watermark",
    "eagle-vs-medusa": "accepted drafts",  # a drafter's rounds: the tokens each target forward kept
}


@pytest.fixture(scope="module")
def tab(tiny_lm):
    """The Lessons tab over the tiny random Llama: real Shared and presenter components; the tab's
    other outputs are their field names (handlers return ``{component: value}``)."""
    import gradio as gr

    from playground.views import lessons
    from playground.panels.presenter import PresenterPanel

    from tests.helpers.common import shared_over

    with gr.Blocks():
        shared = shared_over(tiny_lm)
        presenter = PresenterPanel.build()
    fields = {name: name for name in lessons.LessonsTab.__dataclass_fields__}
    return lessons.LessonsTab(**(fields | {"shared": shared, "presenter": presenter}))


def run(tab, choice, session=None, control=None):
    from engine.control import RunControl

    return list(tab.on_run(choice, session, "embedded", "none", control=control or RunControl()))


def shown_chart(updates):
    charts = [u["chart"] for u in updates if u.get("chart") is not None]
    return charts[-1] if charts else None
