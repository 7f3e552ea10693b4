"""Issue #27, MCTS: a stopped run (Stop, or past the request's time limit) shows what it found,
never empty outputs; and the default preset fits well inside the time limit.

The view's handler on the tiny model with a control that stops after a given number of
simulations (the engine checks it once per simulation): at the first, a middle and the last
position. Then the default preset's forward count against a budget derived from the time limit.
"""

from __future__ import annotations

import pytest

from engine import runner
from engine.runner import RunRequest
from engine.config import DecodingConfig
from engine.control import RunControl
from engine.presets import builtin_presets
from playground.shared import Shared
from playground.views import search
from tests.helpers.mcts import StopAfter
from tests.helpers.search_view import mcts_out, shared  # noqa: F401 (shared is a fixture)

PROMPT = "The capital of France is"
CONFIG = DecodingConfig(strategy="mcts", temperature=0.0, max_new_tokens=4, mcts_simulations=5, mcts_expand_k=3,
                        mcts_rollout_tokens=2)


def request(lm, config: DecodingConfig = CONFIG) -> search.RunRequest:
    return search.RunRequest(lm, PROMPT, lm.encode(PROMPT, False), config, False)


@pytest.fixture(scope="module")
def full_tokens(tiny_lm) -> list[int]:
    tokens = runner.run(RunRequest(tiny_lm, PROMPT, CONFIG)).generated_token_ids
    assert len(tokens) == CONFIG.max_new_tokens, "the tiny model ends too early for these tests"
    return tokens


@pytest.mark.parametrize("tokens, sims", [(0, 2), (2, 0), (3, 4)])  # the first, a middle, the last position
@pytest.mark.parametrize("reason", ["cancelled", "time_limit"])
def test_a_stopped_run_shows_the_tokens_and_trees_so_far(tiny_lm, shared, monkeypatch, full_tokens, tokens, sims,
                                                         reason):
    monkeypatch.setattr(search, "STREAM_EVERY_S", 0.0)  # every event redraws, as a slow run does
    out = mcts_out()
    control = StopAfter(tokens * CONFIG.mcts_simulations + sims, reason)
    updates = list(search.stream_mcts(out, shared, request(tiny_lm), control))
    last = updates[-1]
    session: search.MctsSession = last[out.session]
    assert session.trace.generated_token_ids == full_tokens[:tokens]
    assert last[out.text] == session.trace.text == tiny_lm.decode(full_tokens[:tokens])
    status = last[out.status]
    if reason == "time_limit":
        assert f"time limit reached after {tokens} of 4 tokens (the 120 s limit" in status
    else:
        assert f"stopped after {tokens} of 4 tokens" in status
    if sims:
        assert f"token {tokens}&#x27;s search had run {sims} simulations" in status
    # the picker lists every committed token and the interrupted search, which is drawn
    choices = last[out.position]["choices"]
    assert [c[1] for c in choices] == list(range(tokens + 1))
    assert choices[-1][0] == f"{tokens}: (stopped after {sims} simulations)"
    assert last[out.tree].layout.title.text.endswith("stopped before committing")
    assert last[out.download] is not None  # the partial trace can be downloaded
    assert last[out.quality_table] == [] and last[out.quality] is None  # no side-by-side after a stop
    # what Stop leaves on the page: the last update before the end already held the text so far
    if tokens:
        streamed = [u for u in updates[:-1] if out.text in u][-1]
        assert streamed[out.text] == tiny_lm.decode(full_tokens[:tokens])
        assert [c[1] for c in streamed[out.position]["choices"]] == list(range(tokens))


def test_a_finished_run_still_compares_three_strategies(tiny_lm, shared):
    out = mcts_out()
    last = list(search.stream_mcts(out, shared, request(tiny_lm), RunControl(deadline_s=120.0)))[-1]
    assert last[out.status].startswith('<div class="dp-status">done: 4 tokens')
    assert [row[0] for row in last[out.quality_table]] == ["mcts", "greedy", f"beam ({search.COMPARE_BEAMS})"]


def greedy_checks(shared: Shared, lm) -> int:
    """How many times the side-by-side's greedy run checks its control."""
    control = StopAfter(10**9)
    shared.run(lm, PROMPT, CONFIG.replace(strategy="greedy"), chat=False, prompt_ids=lm.encode(PROMPT, False),
               control=control)
    return 10**9 - control.left


@pytest.mark.parametrize("during", ["greedy", "beam"])
def test_a_limit_during_the_side_by_side_keeps_the_finished_mcts_run(tiny_lm, shared, full_tokens, during):
    out = mcts_out()
    extra_checks = 0 if during == "greedy" else greedy_checks(shared, tiny_lm)
    control = StopAfter(CONFIG.max_new_tokens * CONFIG.mcts_simulations + extra_checks, "time_limit")
    last = list(search.stream_mcts(out, shared, request(tiny_lm), control))[-1]
    session: search.MctsSession = last[out.session]
    assert session.trace.generated_token_ids == full_tokens and "stopped" not in session.trace.summary
    assert last[out.text] == tiny_lm.decode(full_tokens)
    assert "MCTS done (4 tokens, 20 simulations); time limit reached during the greedy and beam runs" in last[out.status]
    rows = [row[0] for row in last[out.quality_table]]
    assert rows[0] == "mcts" and f"beam ({search.COMPARE_BEAMS})" not in rows  # only the runs that finished
    assert rows == (["mcts"] if during == "greedy" else ["mcts", "greedy"])


def test_the_api_returns_the_partial_trace_at_the_time_limit(tiny_lm, shared, monkeypatch):
    monkeypatch.setattr(shared, "lm", lambda model, quantization: tiny_lm)
    data = search.mcts_trace(shared, PROMPT, {"max_new_tokens": 4, "mcts_simulations": 5},
                             control=StopAfter(7, "time_limit"))
    assert data["summary"]["stopped"] == "time_limit" and len(data["generated_token_ids"]) == 1
    assert data["extra"]["mcts_interrupted"]["simulations"] == 2


# --- the default preset's budget ----------------------------------------------------------------
# The request time limit is 120 s. On the development machine (2 CPU cores, bench.mcts) one forward
# of the embedded model costs ~50 ms idle and up to ~110 ms while other jobs load it (the run
# reached token 9 of the old default's 24 x ~125 forwards in 120 s). 400 forwards for the whole view
# (MCTS, then greedy and beam for the side-by-side) is ~20 s idle and ~40 s loaded.
FORWARD_BUDGET = 400


def most_forwards(config: DecodingConfig) -> int:
    """The most forwards an MCTS run of ``config`` can take: a prefill; per position with r tokens
    still to make, each simulation feeds its path in one forward and steps its rollout after the
    first token (a leaf sits at depth >= 1, so the rollout has at most min(rollout, r - 1) tokens,
    and with r = 1 every leaf is terminal: no forward); one step after every commit but the last."""
    n, rollout = config.max_new_tokens, config.mcts_rollout_tokens
    search = sum(config.mcts_simulations * (0 if r == 1 else max(1, min(rollout, r - 1))) for r in range(1, n + 1))
    return 1 + search + n - 1


def count_forwards(lm, run) -> int:
    count = [0]
    handle = lm.model.register_forward_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    try:
        run()
    finally:
        handle.remove()
    return count[0]


def test_the_default_preset_fits_the_forward_budget(tiny_lm, shared):
    config = builtin_presets()["mcts"].config
    side_by_side = 2 * (1 + config.max_new_tokens)  # greedy, then beam (its beams in one forward per step)
    assert most_forwards(config) + side_by_side <= FORWARD_BUDGET
    ids = tiny_lm.encode(PROMPT, False)
    counted = count_forwards(tiny_lm, lambda: runner.run(RunRequest(tiny_lm, PROMPT, config, prompt_ids=ids)))
    trace = runner.run(RunRequest(tiny_lm, PROMPT, config, prompt_ids=ids))
    assert len(trace.steps) == config.max_new_tokens  # the tiny model made every token: the bound is exercised
    assert counted == 1 + trace.summary["search_forwards"] + len(trace.steps) - 1 <= most_forwards(config)
    out = mcts_out()
    view = count_forwards(tiny_lm, lambda: list(search.stream_mcts(out, shared, request(tiny_lm, config), RunControl())))
    assert view <= most_forwards(config) + side_by_side


def test_the_forward_bound_is_reached_when_no_leaf_ends_early(tiny_lm):
    """Checks ``most_forwards`` by hand on a small config: 3 tokens, 2 simulations, rollout 2:
    r = 3: 2 x 2, r = 2: 2 x 1, r = 1: 0; + prefill + 2 steps = 9."""
    config = DecodingConfig(strategy="mcts", temperature=0.0, max_new_tokens=3, mcts_simulations=2,
                            mcts_expand_k=2, mcts_rollout_tokens=2)
    assert most_forwards(config) == 9
    ids = tiny_lm.encode(PROMPT, False)
    assert count_forwards(tiny_lm, lambda: runner.run(RunRequest(tiny_lm, PROMPT, config, prompt_ids=ids))) == 9
