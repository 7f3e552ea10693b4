"""Issue #27, "Continue from here" on a branch: the comparison under the text is with the run the
shown run was actually branched (or continued) from, with their true shared prefix, not with the
first run of the list. Driven as a person drives the page: the app's own registered handlers
(Generate, Branch from here, Continue from here), through the error guard, with each page's state
carried from one event to the next by ``Page`` (what the browser holds for it)."""

from __future__ import annotations

import re
import threading
from typing import Any

import pytest

from playground.views import step as step_view
from tests.helpers.continue_compare import Page, branch, generate  # noqa: F401

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo(registry, embedded):
    from playground.app import build_app

    return build_app(registry)


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
