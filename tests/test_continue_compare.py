"""Issue #27, "Continue from here" on a branch: the comparison under the text is with the run the
shown run was actually branched (or continued) from, with their true shared prefix, not with the
first run of the list. Driven as a person drives the page: the app's own registered handlers
(Generate, Branch from here, Continue from here), through the error guard, with each page's state
carried from one event to the next by ``Page`` (what the browser holds for it)."""

from __future__ import annotations

import asyncio
import re
import threading
from typing import Any

import pytest

from playground.views import step as step_view

pytestmark = pytest.mark.slow


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


@pytest.fixture(scope="module")
def demo(registry, embedded):
    from playground.app import build_app

    return build_app(registry)


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


def continue_from(page: Page, at: Any, **knobs: Any) -> None:
    page.set("step-index", at)
    for name, value in knobs.items():
        page.set(f"step-knob-{name}", value)
    page.fire("on_continue", "step-text")
    assert "done" in page.shown("step-status"), page.shown("step-status")


def claimed_prefix(compare: str) -> int:
    found = re.search(r"\*\*Shared prefix\*\* \((\d+) tokens?\)", compare)
    assert found, compare
    return int(found.group(1))


def common(a, b) -> int:
    return step_view.shared_prefix(a, b)


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_continue_on_a_branch_compares_with_that_branch(demo, where):
    page = Page(demo)
    session = generate(page, "Name a colour of the sea.")
    original = session.trace()
    last = len(original.steps) - 1
    k = {"first": 0, "middle": last // 2, "last": last}[where]
    branch(page, k)
    session = page.session()
    first_branch = session.trace()
    assert session.parent_of(session.current) is original
    assert f"Compared with #0 original**, the run this one was branched from at step {k}" in page.shown("step-compare")
    assert claimed_prefix(page.shown("step-compare")) == k == common(first_branch, original)
    # Continue from a later step of the branch (its last one when it branched at the last step).
    m = min(k + 2, len(first_branch.steps) - 1)
    continue_from(page, m, temperature=1.7)
    session = page.session()
    continued = session.trace()
    assert continued.branch_of == m and session.parent_of(session.current) is first_branch
    compare = page.shown("step-compare")
    assert f"Compared with #1 branch at step {k}" in compare and "original" not in compare.split("\n")[0]
    n = common(continued, first_branch)
    assert n >= m and claimed_prefix(compare) == n
    assert continued.generated_token_ids[:n] == first_branch.generated_token_ids[:n]
    # Its first n tokens include the branch's own token at k, which the original never had.
    assert common(continued, original) == k < n or k == n == m
    # Picking the runs again shows each one against its own parent.
    page.set("step-runs", 1)
    page.fire("on_pick_run", "step-text")
    assert "Compared with #0 original" in page.shown("step-compare")
    page.set("step-runs", 0)
    page.fire("on_pick_run", "step-text")
    assert page.shown("step-compare") == ""


def test_two_pages_compare_their_own_runs(demo):
    a, b = Page(demo), Page(demo)
    generate(a, "Name a colour of the sea.")
    generate(b, "Write the word MARKER twice.", seed=9)
    results = {}

    def work(name, page):
        branch(page, 2)
        continue_from(page, 4, temperature=0.5)
        results[name] = page.session()

    threads = [threading.Thread(target=work, args=(n, p)) for n, p in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name, page in (("a", a), ("b", b)):
        session = results[name]
        assert len(session.runs) == 3 and session.parent_of(2) is session.runs[1]
        assert session.parent_of(1) is session.runs[0]
        assert claimed_prefix(page.shown("step-compare")) == common(session.runs[2], session.runs[1])
    assert results["a"].runs[0].prompt != results["b"].runs[0].prompt


def test_hostile_steps_are_clamped_and_a_missing_token_is_named(demo):
    page = Page(demo)
    session = generate(page, "Name a colour of the sea.", tokens=5)
    last = len(session.trace().steps) - 1
    continue_from(page, 10**9)  # clamped to the last step
    session = page.session()
    assert session.trace().branch_of == last and session.parent_of(session.current) is session.runs[0]
    assert claimed_prefix(page.shown("step-compare")) >= last
    page.set("step-alt", None)
    page.fire("on_branch", "step-text")
    assert "pick a token" in page.shown("step-status")
