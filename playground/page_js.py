"""The page's few lines of JavaScript (``launch(head=...)``): Ctrl/Cmd+Enter in a prompt runs its
view, the sortable stage list, arrow keys through Step through's tokens, a slider's number box
that refuses an out-of-range value with the typed value named (instead of clamping silently), and
the page width for the presenter's and Step through's charts (laid out on the server for the width
they are shown at), the selected token of Step through outlined, and the run a lesson's "Open in its
view" presses (``OPEN_RUN_JS``), and the page's owner secret every Step-through event carries
(``owner_js``). The code is in playground/static/ (page.js, open_run.js, page.css).
"""

import json

from . import ids
from .assets import static_text

# prompt box id -> the button it runs
PROMPT_BUTTONS = {ids.STEP_PROMPT: ids.STEP_GENERATE, ids.CMP_PROMPT: ids.CMP_RUN, ids.BEAM_PROMPT: ids.BEAM_RUN,
                  ids.SPEC_PROMPT: ids.SPEC_GENERATE, ids.QUANT_PROMPT: ids.QUANT_MEASURE}
# view name (a lesson's "view") -> the button that runs it
RUN_BUTTONS = {"step": ids.STEP_GENERATE, "compare": ids.CMP_RUN, "beam": ids.BEAM_RUN,
               "speculative": ids.SPEC_GENERATE, "quantization": ids.QUANT_MEASURE}
PRESENT_NARROW_PX = 900  # the presenter's and Step through's charts go two panels a row on pages narrower than this
PHONE_PX = 600  # Step through's chart goes one panel a row below this (app.CSS stacks the columns there too)

# A run button -> the element whose top is scrolled into view once "Open in its view" pressed it:
# where that run's result appears, when it is not the top of its tab.
RUN_LANDINGS = {ids.KV_MEASURE: ids.KV_SECTION, ids.METHODS_MEASURE: ids.METHODS_SECTION}
# After "Open in its view" filled the view (its tab switching in): press the view's run button once
# it is shown, so the lesson runs through the view's own handler (its errors, Stop, streaming), and
# scroll to where its result appears (RUN_LANDINGS).
OPEN_RUN_JS = static_text("open_run.js", LANDINGS=json.dumps(RUN_LANDINGS))

# The page's keys, sortable stage list, width boxes, selected token, out-of-range refusals and a
# lesson link's wait for its lesson.
LESSON_PARAM = "lesson"  # a lesson link's query parameter (views/lessons.py reads it on page load)
HEAD = "<script>" + static_text("page.js", PROMPTS=json.dumps(PROMPT_BUTTONS), NARROW=str(PRESENT_NARROW_PX),
                                PHONE=str(PHONE_PX), LESSON_PARAM=json.dumps(LESSON_PARAM)) + "</script>"
CSS = static_text("page.css")


def owner_js(at: int) -> str:
    """An event's js: the page's owner secret (made by page.js at load) put into its inputs at
    ``at`` as the event is sent (views/step.py: every event that reads or writes the page's runs)."""
    return static_text("page_owner.js", AT=str(int(at)))


# --- the what-if (playground/whatif_service.py: its route, ROUTE, answers these) ----------------
ROUTE = "/dp/whatif"
# Draws a what-if figure (an object) into a chart, set up as Gradio's Plot sets up its own
# (responsive, autosize, a titled chart's top margin at least 100 px); only while its step is still
# the one shown (``step()``: the step now selected there).
_DRAW_INTO = static_text("whatif_draw_into.js")
_DRAW = static_text("whatif_draw_step.js", DRAW_INTO=_DRAW_INTO)
# POSTs ``body`` (an object) as JSON to the route, under the app's root (a Space serves it there).
_POST = static_text("whatif_post.js", ROUTE=json.dumps(ROUTE))
# The fallback path's figure arrives as JSON text in a hidden box.
DRAW_JS = static_text("whatif_draw_figure.js", DRAW_STEP=_DRAW)
# A knob's input event, in the page: post the values to the route, draw the figure, return the note
# and the explanation under the chart (the outputs; unchanged when there is nothing new). Nothing
# to draw without a key (no run yet). ``seq``: only the latest answer counts when changes overlap.
# ``fallback``: the route cannot answer; the hidden button runs the same service call as a Gradio
# event (views/step.py's Handlers.on_knob), whose figure DRAW_JS draws.
WHATIF_JS = static_text("whatif_knob.js", POST=_POST, DRAW_STEP=_DRAW)

# The presenter's temperature slider: the shown step (the context's data-step) redrawn at that
# temperature, projector-sized, through the route; nothing while the guess hides the token.
PRESENTER_JS = static_text("whatif_presenter.js", POST=_POST, DRAW_INTO=_DRAW_INTO)

# A step's chart was drawn (a run ended, a token or a run was picked): ask the route to keep that
# step's raw logits, so the first knob change needs no forward. Fire and forget.
PREPARE_JS = static_text("whatif_prepare.js", POST=_POST)

# The presenter's chart was drawn: keep the shown step's raw logits for its temperature slider.
PRESENTER_PREPARE_JS = static_text("whatif_presenter_prepare.js", POST=_POST)

# A lesson link's lesson is in the Lessons tab (its page-load event answered): page.js's hold ends.
LESSON_READY_JS = static_text("lessons_link_ready.js")
