"""The page's few lines of JavaScript (``launch(head=...)``): Ctrl/Cmd+Enter in a prompt runs its
view, the sortable stage list, arrow keys through Step through's tokens, a slider's number box
that refuses an out-of-range value with the typed value named (instead of clamping silently), and
the page width for the presenter's and Step through's charts (laid out on the server for the width
they are shown at), the selected token of Step through outlined, and the run a lesson's "Open in its
view" presses (``OPEN_RUN_JS``). The code is in playground/static/ (page.js, open_run.js, page.css).
"""

import json

from .assets import static_text

# prompt box id -> the button it runs
PROMPT_BUTTONS = {"step-prompt": "step-generate", "cmp-prompt": "cmp-run", "beam-prompt": "beam-run",
                  "spec-prompt": "spec-generate", "quant-prompt": "quant-measure"}
# view name (a lesson's "view") -> the button that runs it
RUN_BUTTONS = {"step": "step-generate", "compare": "cmp-run", "beam": "beam-run", "speculative": "spec-generate",
               "quantization": "quant-measure"}
PRESENT_NARROW_PX = 900  # the presenter's and Step through's charts go two panels a row on pages narrower than this
PHONE_PX = 600  # Step through's chart goes one panel a row below this (app.CSS stacks the columns there too)

# After "Open in its view" filled the view (its tab switching in): press the view's run button once
# it is shown, so the lesson runs through the view's own handler (its errors, Stop, streaming).
OPEN_RUN_JS = static_text("open_run.js")

# The page's keys, sortable stage list, width boxes, selected token and out-of-range refusals.
HEAD = "<script>" + static_text("page.js", PROMPTS=json.dumps(PROMPT_BUTTONS), NARROW=str(PRESENT_NARROW_PX),
                                PHONE=str(PHONE_PX)) + "</script>"
CSS = static_text("page.css")
