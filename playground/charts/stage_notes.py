"""One line per stage and step saying what the stage did, in words, from the trace alone.

``stage_note(stage)`` reads a ``StageTrace`` (its params, kept count, removed mass and tokens) and
returns a sentence for the step chart, e.g. "XTC fired (u=0.21 < 0.5): removed 'the', 'a'; kept 'an'".
Each stage's words are in its spec (``StageSpec.note`` / ``heading`` / ``label``, engine/stages/);
this module adds the rows that are not stages (raw, final, contrastive decoding's contrast).
Pure: no model, no tokenizer, no plotting.
"""

from __future__ import annotations

from typing import Callable

from engine import stages
from engine.numbers import percent
from engine.stages import STAGES, quoted, title_number, token_names
from engine.trace import StageTrace

__all__ = ["quoted", "stage_heading", "stage_label", "stage_note", "token_names"]


CONTRAST = "contrast (expert − amateur)"


def stage_label(stage: StageTrace) -> str:
    """The stage's short name and main knob, e.g. "top-k 50" (for sentences)."""
    return CONTRAST if stage.name == "contrast" else stages.stage_label(stage)


def _raw(stage: StageTrace) -> str:
    top = f"; most likely {quoted(stage.top[0].token)} {percent(stage.top[0].prob)}" if stage.top else ""
    return f"raw: the model's distribution, entropy {stage.entropy:.2f} nats{top}"


def _final(stage: StageTrace) -> str:
    return f"final: {stage.kept} tokens can be drawn, entropy {stage.entropy:.2f} nats"


def _contrast(stage: StageTrace) -> str:
    return f"{CONTRAST}: moved {percent(stage.tv_distance)} of the mass"


def _contrast_heading(stage: StageTrace) -> str:
    return f"{CONTRAST}, plausible: p ≥ {title_number(stage.params.get('cd_alpha'))} × top"


# Rows of a step that are not stages, (note, title) each: the model's distribution, the one drawn
# from, and contrastive decoding's contrast (engine/strategies/contrastive.py records it as a stage row).
NOT_STAGES: dict[str, tuple[Callable[[StageTrace], str], Callable[[StageTrace], str]]] = {
    "raw": (_raw, lambda s: "raw model"),
    "final": (_final, lambda s: "final"),
    "contrast": (_contrast, _contrast_heading),
}


def stage_note(stage: StageTrace) -> str:
    """What ``stage`` did at this step, in one line."""
    if stage.name in NOT_STAGES:
        return NOT_STAGES[stage.name][0](stage)
    spec = STAGES.get(stage.name)
    return (spec.note if spec is not None and spec.note is not None else stages.reshape_note)(stage)


def stage_heading(stage: StageTrace) -> str:
    """The stage and its knobs in words, for a panel title, e.g. "XTC: drop top tokens above
    p=0.10 with probability 1.0" (an unknown stage: its name, spaced)."""
    if stage.name in NOT_STAGES:
        return NOT_STAGES[stage.name][1](stage)
    spec = STAGES.get(stage.name)
    if spec is not None and spec.heading is not None:
        return spec.heading(stage)
    return stage.name.replace("_", " ")
