"""After a failed run (bad input, a stopped or timed-out run, a model failure) a view must not leave
the previous run's charts and text under the error message, where they read as this run's result.
``cleared`` is the ``on_error`` of a run event: the message in the status, and every chart, text
and download among the event's outputs emptied (a stopped or timed-out run keeps what it has shown
itself: ``events.streamed``). Inputs and state (prompts, knobs, sliders,
dropdowns, gr.State, hidden keys) are left alone, so the page can run again as it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import gradio as gr

from .shared import error_html, status_html

CLEARED_NOTE = "The charts and text of the previous run were cleared, so they are not taken for the result of this one."
STOPPED_NOTE = "the output shows what this run made before it stopped."
_LEAVE = object()


def empty_value(component: Any) -> Any:
    """What a cleared output shows: no figure, no text, no rows, no file; ``_LEAVE`` for inputs
    and state (a Textbox only when it is an output: not interactive)."""
    if isinstance(component, (gr.Plot, gr.DownloadButton, gr.File, gr.JSON, gr.Dataframe)):
        return None
    if isinstance(component, gr.HighlightedText):
        return []
    if isinstance(component, (gr.Markdown, gr.HTML, gr.Code)):
        return ""
    if isinstance(component, gr.Textbox) and component.interactive is False:
        return ""
    return _LEAVE


def cleared(status: Any, outputs: Iterable[Any], keep: Iterable[Any] = (),
            also: dict | None = None) -> "Cleared":
    """An ``on_error`` for a run event with ``outputs``: ``{status: the message}`` plus every
    chart, text and download output (but ``keep``) emptied, with a line saying why; ``also``:
    more values to set (e.g. a hidden key the page's script reads, emptied)."""
    kept = {id(c) for c in keep} | {id(status)}
    empties = {c: v for c in outputs if id(c) not in kept and (v := empty_value(c)) is not _LEAVE} | (also or {})
    return Cleared(status, empties)


@dataclass(frozen=True)
class Cleared:
    """``cleared``'s ``on_error``: called with the message (and ``stopped``); ``status`` is read by
    events.streamed, so a stopped run keeps the outputs it has set itself."""

    status: Any
    empties: dict

    def __call__(self, message: str, stopped: bool = False) -> dict:
        if stopped:  # Stop or the time limit: not an error, and this run's own output stays (events.streamed)
            return self.empties | {self.status: status_html(f"{message}; {STOPPED_NOTE}")}
        return self.empties | {self.status: error_html(message) + status_html(CLEARED_NOTE)}
