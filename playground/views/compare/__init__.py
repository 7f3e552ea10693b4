"""Compare: 2–6 lanes side by side, each a strategy and its knobs, on one prompt and one seed.

A lane's settings are a preset picker, its strategy, a number box each for temperature, top-k,
top-p, min-p, seed and max_new_tokens (greyed where greedy ignores them, as in the Step view), and
a JSON object of any other knob; its header says them in words. Picking a preset fills the lane
but keeps its seed and budget; a new lane copies the last lane's. "Run all" runs the lanes at once
through the runner, streaming each lane's text; then the metrics table
(engine.reports.metrics), the per-step entropy chart and the first divergent step appear. Clicking a token
opens its step chart. "Seed sweep" runs one lane over several seeds.

Modules: ``lanes`` (lane settings and results as data), ``run`` (lanes through the runner),
``layout`` (the page), ``handlers`` (its events), ``api`` (``/compare``, ``/compare_sweep``).
Per-user state: ``CompareSession`` (the lanes' traces) in gr.State.
"""

from __future__ import annotations

from ...shared import Shared
from . import api, handlers, layout


def lesson_target(page: layout.Page) -> handlers.CompareLessons:
    """The page as a lesson's target (the Lessons tab's "Open in its view")."""
    return handlers.CompareLessons(page)


def build_tab(shared: Shared) -> layout.Page:
    page = layout.build_page(shared.policy.allowed)
    handlers.wire(shared, page)
    api.wire_api(shared)
    return page
