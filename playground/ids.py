"""Every element id the page's JavaScript names, in one table. The views give their components these
ids (``elem_id=ids.STEP_CHART``); a file in playground/static/ names one as ``__ID_STEP_CHART__``,
which ``assets.static_text`` fills with its JSON string. tests/test_static_assets.py checks that
each id a script names is in the built page, so renaming a component cannot silently break a script.
"""

from __future__ import annotations

# Step through
STEP_PROMPT = "step-prompt"
STEP_GENERATE = "step-generate"
STEP_TEXT = "step-text"  # the generated tokens (arrow keys, the selected token's outline)
STEP_INDEX = "step-index"  # the step slider: the selected step
STEP_CHART = "step-chart"  # the stage chart the what-if draws into
STEP_WIDTH = "step-width"  # hidden: the page width the script writes
STEP_REDRAW = "step-redraw"  # hidden: pressed when the chart was laid out for another width
STEP_WHATIF_FALLBACK = "step-whatif-fallback"  # hidden: the what-if as a Gradio event

# The presenter view (an overlay on the Lessons tab)
PRESENTER = "presenter"
PRESENT_TEXT = "present-text"
PRESENT_CHART = "present-chart"
PRESENT_QR = "present-qr"
PRESENT_WIDTH = "present-width"
PRESENT_REDRAW = "present-redraw"
PRESENT_PREV = "present-prev"
PRESENT_NEXT = "present-next"
PRESENT_EXIT = "present-exit"
LESSONS_PRESENT = "lessons-present"  # the Lessons tab's presenter toggle (Exit unticks it)
LESSONS_RUN = "lessons-run"  # the Lessons tab's Run and check (the presenter's Run presses it)

# The other views' prompts and run buttons (Ctrl/Cmd+Enter, a lesson's "Open in its view")
CMP_PROMPT = "cmp-prompt"
CMP_RUN = "cmp-run"
BEAM_PROMPT = "beam-prompt"
BEAM_RUN = "beam-run"
BEAM_TREE = "beam-tree"  # the search tree: its box scrolls sideways to the winner's end (page.js)
SPEC_PROMPT = "spec-prompt"
SPEC_GENERATE = "spec-generate"
QUANT_PROMPT = "quant-prompt"
QUANT_MEASURE = "quant-measure"

# Every id above by its name (the ``__ID_<NAME>__`` placeholders).
IDS: dict[str, str] = {name: value for name, value in dict(globals()).items()
                       if name.isupper() and isinstance(value, str)}
