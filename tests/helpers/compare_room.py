"""Shared by the tests: what tests/playground/test_compare_room.py and the tests beside it use."""

from __future__ import annotations

from tests.helpers.continue_compare import Page

__all__ = ['inspect_step', 'set_lanes']


def set_lanes(page: Page, lanes, tokens: int) -> None:
    """Type each lane's settings into its controls (and show that many lanes)."""
    page.values[page.event("on_run", "cmp-status").inputs[4]._id] = len(lanes)  # page.count, the lanes shown
    for i, lane in enumerate(lanes):
        page.set(f"cmp-lane-{i}-strategy", lane["strategy"])
        page.set(f"cmp-lane-{i}-more", "")
        for name, value in {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 0,
                            "max_new_tokens": tokens, **{k: v for k, v in lane.items() if k != "strategy"}}.items():
            page.set(f"cmp-lane-{i}-knob-{name}", value)


def inspect_step(page: Page, lane: str, step: int) -> None:
    """Pick a lane and release the step slider on ``step`` (the inspector's registered event)."""
    slider = page.block("cmp-inspect-step")
    dep = next(f for f in page.demo.fns.values() if (slider._id, "release") in
               [(getattr(t[0], "_id", t[0]), t[1]) for t in f.targets])
    page.set("cmp-inspect-lane", lane)
    page.set("cmp-inspect-step", step)
    for block, value in dep.fn(*[page.get(b) for b in dep.inputs]).items():
        page.values[block._id] = value["value"] if isinstance(value, dict) and "__type__" in value else value
