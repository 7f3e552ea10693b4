"""Compare: 2–6 lanes side by side, each a strategy and its knobs, on one prompt and one seed.

A lane's settings are its strategy and ``key = value`` lines (the CLI's ``--set`` syntax); picking
a preset fills both. Seed and max_new_tokens are shared by all lanes. "Run all" runs the lanes one
after another through the runner, streaming each lane's text; then the metrics table
(engine.metrics), the per-step entropy chart and the first divergent step appear. Clicking a token
opens its step chart. "Seed sweep" runs one lane over several seeds.

Modules: ``lanes`` (lane settings and results as data), ``run`` (lanes through the runner),
``layout`` (the page), ``handlers`` (its events), ``api`` (``/compare``, ``/compare_sweep``).
Per-user state: ``CompareSession`` (the lanes' traces) in gr.State.
"""

from __future__ import annotations

from ...shared import Shared
from . import api, handlers, layout


def build_tab(shared: Shared) -> layout.Page:
    page = layout.build_page()
    handlers.wire(shared, page)
    api.wire_api(shared)
    return page
