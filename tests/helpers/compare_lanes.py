"""Shared by the tests: what tests/playground/test_compare_lanes.py and the tests beside it use."""

from __future__ import annotations

from playground.views.compare.lanes import (
    LANE_KNOBS, MAX_LANES,
)
from playground.views.compare.layout import InspectPanel, LaneWidgets, Page, SweepPanel

__all__ = ['fake_page']


def fake_page() -> Page:
    """The page's handles as plain strings: handlers key their updates by them."""
    lanes = [LaneWidgets(f"l{i}.column", f"l{i}.header", f"l{i}.preset", f"l{i}.strategy",
                         {n: f"l{i}.{n}" for n in LANE_KNOBS}, f"l{i}.more", f"l{i}.dup", f"l{i}.rm",
                         f"l{i}.status", f"l{i}.text") for i in range(MAX_LANES)]
    inspect = InspectPanel("in.lane", "in.step", "in.explain", "in.chart")
    sweep = SweepPanel("sw.lane", "sw.seeds", "sw.run", "sw.status", "sw.summary", "sw.table")
    return Page("prompt", "chat", "run", "add", "stop", "status", lanes, "divergence", "metrics", "kind", "entropy",
                inspect, sweep, "count", "session")
