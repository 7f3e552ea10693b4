"""Shared by the tests: what tests/playground/test_continue_compare.py and the tests beside it use."""

from __future__ import annotations

import asyncio
import threading
from typing import Any
from playground.views import step as step_view

__all__ = ['Page', 'branch', 'generate', 'run_coroutine']


def run_coroutine(make: Any) -> Any:
    """``asyncio.run(make())`` on a thread of its own: a Playwright sync session earlier in the same
    pytest process leaves an event loop running on the main thread, where ``asyncio.run`` refuses."""
    box: dict = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(make())
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name="test-event-loop")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


class Page:
    """One browser page of ``demo``: every component's value (its default until an event changed
    it); ``fire`` runs a registered event's function with the page's values as inputs and applies
    each update it yields, as the browser would. Updates come back as ``{elem_id or component: value}``."""

    def __init__(self, demo: Any):
        self.demo = demo
        self.values: dict[int, Any] = {}

    def block(self, elem_id: str) -> Any:
        return next(b for b in self.demo.blocks.values() if getattr(b, "elem_id", None) == elem_id)

    def get(self, block: Any) -> Any:
        return self.values.get(block._id, getattr(block, "value", None))

    def set(self, elem_id: str, value: Any) -> None:
        self.values[self.block(elem_id)._id] = value

    def event(self, name: str, first_output: str) -> Any:
        """The registered function ``name`` whose first output is ``first_output`` (an elem_id)."""
        return next(f for f in self.demo.fns.values() if getattr(f.fn, "__name__", None) == name
                    and f.outputs and getattr(f.outputs[0], "elem_id", None) == first_output)

    def fire(self, name: str, first_output: str) -> list[dict]:
        dep = self.event(name, first_output)
        args = [self.get(b) for b in dep.inputs]

        async def collect() -> list:
            result = dep.fn(*args)
            if hasattr(result, "__aiter__"):
                return [row async for row in result]
            return [await result if asyncio.iscoroutine(result) else result]

        return [self.apply(dep, row) for row in run_coroutine(collect)]

    def apply(self, dep: Any, row: Any) -> dict:
        """Show one update of ``dep`` (a dict or a row in its outputs' order) as the page would;
        returns what changed, by elem_id."""
        # (as Gradio does: the text a function with one output returns is that output's value, not a row)
        alone = len(dep.outputs) == 1 and isinstance(row, str)
        update = row if isinstance(row, dict) else dict(zip(dep.outputs, [row] if alone else row))
        named = {}
        for block, value in update.items():
            if isinstance(value, dict) and value.get("__type__") == "update":
                if "value" not in value:
                    continue  # gr.skip() or a property-only update
                value = value["value"]
            self.values[block._id] = value
            named[getattr(block, "elem_id", None) or block] = value
        return named

    def shown(self, elem_id: str) -> Any:
        return self.get(self.block(elem_id))

    def session(self) -> step_view.StepSession:
        return self.get(next(b for b in self.event("on_run", "step-text").inputs
                             if type(b).__name__ == "State" and isinstance(self.get(b), step_view.StepSession)))


def generate(page: Page, prompt: str, tokens: int = 8, seed: int = 3) -> step_view.StepSession:
    page.set("step-prompt", prompt)
    page.set("step-knob-max_new_tokens", tokens)
    page.set("step-knob-seed", seed)
    page.fire("on_run", "step-text")
    assert "done" in page.shown("step-status"), page.shown("step-status")
    return page.session()


def branch(page: Page, at: int) -> int:
    """Branch from step ``at`` with the raw model's most probable token other than the one chosen."""
    trace = page.session().trace()
    step = trace.steps[at]
    token = next(t.token_id for t in step.stages[0].top if t.token_id != step.chosen_token_id)
    page.set("step-index", at)
    page.set("step-alt", token)
    page.fire("on_branch", "step-text")
    assert "done" in page.shown("step-status"), page.shown("step-status")
    return token
