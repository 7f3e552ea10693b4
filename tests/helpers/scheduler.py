"""Shared by the tests: what tests/engine/test_scheduler.py and the tests beside it use."""

from __future__ import annotations

import threading
import pytest

__all__ = ['assert_same_steps', 'run_concurrently']


TOL = 1e-4


TIE = 1e-6  # top-list neighbours this close are a tie: a batched forward's rounding may order them either way


def tie_order(top) -> list[int]:
    """Token ids in top-list order, each run of tied neighbours (within TIE) sorted by id. Float
    rounding differs between a padded batch and a solo forward (~1e-8 here), which only ever
    swaps tokens whose probabilities are that close; any other order difference still fails."""
    groups: list[list] = []
    for t in top:
        if groups and abs(groups[-1][-1].prob - t.prob) <= TIE:
            groups[-1].append(t)
        else:
            groups.append([t])
    return [t.token_id for group in groups for t in sorted(group, key=lambda t: t.token_id)]


def assert_same_steps(batched, solo, label=""):
    """StepTrace for StepTrace: tokens, reasons and stage top lists equal; probabilities close."""
    assert [s.chosen_token_id for s in batched] == [s.chosen_token_id for s in solo], label
    assert [s.finish_reason for s in batched] == [s.finish_reason for s in solo], label
    for a, b in zip(batched, solo):
        assert (a.index, a.forced, a.chosen_token) == (b.index, b.forced, b.chosen_token), label
        for x, y in [(a.chosen_prob, b.chosen_prob), (a.raw_prob, b.raw_prob), (a.entropy, b.entropy),
                     (a.raw_entropy, b.raw_entropy)]:
            assert x == pytest.approx(y, abs=TOL), label
        assert (a.draw is None) == (b.draw is None), label
        if a.draw is not None:
            assert a.draw == pytest.approx(b.draw, abs=TOL), label
        assert [s.name for s in a.stages] == [s.name for s in b.stages], label
        for sa, sb in zip(a.stages, b.stages):
            assert tie_order(sa.top) == tie_order(sb.top), (label, sa.name)
            assert [t.prob for t in sa.top] == pytest.approx([t.prob for t in sb.top], abs=TOL), (label, sa.name)
            assert sa.kept == sb.kept and sa.mass_removed == pytest.approx(sb.mass_removed, abs=TOL), (label, sa.name)


def run_concurrently(scheduler, jobs, late=None):
    """Consume every job (prompt_ids, config) in its own thread. ``late``: one more job started only
    after job 0 has streamed 3 steps (it joins mid-flight). Returns the step lists and the active
    row count seen when the late job started."""
    results: dict[int, list] = {}
    errors: list[BaseException] = []
    third_step = threading.Event()
    seen_active = []

    def consume(i, ids, config):
        try:
            steps = []
            for step in scheduler.stream(ids, config):
                steps.append(step)
                if i == 0 and len(steps) == 3:
                    third_step.set()
            results[i] = steps
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)
        finally:
            third_step.set()

    threads = [threading.Thread(target=consume, args=(i, *job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    if late is not None:
        assert third_step.wait(60)
        seen_active.append(scheduler.stats()["active"])
        threads.append(threading.Thread(target=consume, args=(len(jobs), *late)))
        threads[-1].start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    return [results[i] for i in range(len(threads))], seen_active
