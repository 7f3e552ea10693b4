"""Every element id the page's JavaScript names, in one table. The views give their components these
ids (``elem_id=ids.STEP_CHART``); a file in playground/static/ names one as ``__ID_STEP_CHART__``,
which ``assets.static_text`` fills with its JSON string. tests/browser/test_static_assets.py checks that
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
LESSONS_CHART = "lessons-chart"  # what the lesson shows (laid out for the page width)
LESSONS_WIDTH = "lessons-width"  # hidden: the page width the script writes
LESSONS_REDRAW = "lessons-redraw"  # hidden: pressed when the chart was laid out for another width
LESSONS_OPEN = "lessons-open"  # the Lessons tab's Open in its view (held while a link's lesson loads)
PRESENT_RUN = "present-run"  # the presenter's Run the lesson (held too)

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
KV_MEASURE = "kv-measure"  # the KV cache section's run button (a lesson's Open presses it)
KV_SECTION = "kv-section"  # the KV cache section's heading (Open scrolls it into view: page_js.RUN_LANDINGS)
METHODS_MEASURE = "methods-measure"  # the 4-bit methods section's run button (the GPTQ vs AWQ lesson's Open)
METHODS_SECTION = "methods-intro"  # that section's heading (Open scrolls it into view too)

# Inside the model: the entropy chart a click on a step opens that step's stage chart from
INSIDE_OVER_RUN = "inside-over-run"
INSIDE_PICK = "inside-pick-step"  # hidden: the clicked step (its change draws the stage chart)
INSIDE_WIDTH = "inside-width"  # hidden: the page width the script writes

# Every id above by its name (the ``__ID_<NAME>__`` placeholders).
IDS: dict[str, str] = {name: value for name, value in dict(globals()).items()
                       if name.isupper() and isinstance(value, str)}
