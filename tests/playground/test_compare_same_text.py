"""Compare's note on lanes that wrote the same text (issue #52), driven as a person drives the page
(the app's own Run handler, tests/helpers/continue_compare.Page): five greedy lanes, each on its own
served model (three llama.cpp servers and two OpenAI-compatible ones, fake, on loopback, all serving
the same weights), with the knobs each lane's preset left (temperature, top-p, top-k: a greedy pick
ignores them) and the same seed. The page said ten times "their knobs differ: they share a seed, so
each step drew the same u", once per pair; greedy draws nothing, and the reason is the same weights.
Now: one sentence for the five, giving that reason."""

from __future__ import annotations

import pytest

from playground.charts import compare as charts
from tests.helpers.fault_servers import FakeServer
from tests.helpers.compare_room import set_lanes
from tests.helpers.continue_compare import Page

pytestmark = pytest.mark.slow

TOKENS = 6
# what each lane's preset left in its knobs: a greedy pick ignores every one of them
LEFT_KNOBS = [{"temperature": 0.7}, {"temperature": 1.0, "top_p": 0.9}, {"temperature": 1.3, "top_k": 40},
              {"temperature": 0.8, "min_p": 0.05}, {"temperature": 1.0}]


@pytest.fixture(scope="module")
def served(registry, embedded):
    """(the app, the model box's value of each of five fake servers)."""
    from playground.app import build_app

    servers = [FakeServer(backend) for backend in ("llamacpp", "llamacpp", "llamacpp", "openai", "openai")]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DP_REMOTE_MODELS", ",".join(s.spec for s in servers))
        env.setenv("DP_EXAMPLES", "0")
        demo = build_app(registry)
    try:
        yield demo, servers
    finally:
        for server in servers:
            server.close()


def test_five_greedy_lanes_on_five_servers_get_one_true_sentence(served):
    demo, servers = served
    page = Page(demo)
    set_lanes(page, [{"strategy": "greedy", **knobs} for knobs in LEFT_KNOBS], TOKENS)
    for i, server in enumerate(servers):
        page.set(f"cmp-lane-{i}-model", server.spec)
    page.set("cmp-prompt", "Count:")
    page.set("cmp-chat", False)
    page.fire("on_run", "cmp-status")
    assert "done: 5 of 5 lanes ran" in page.shown("cmp-status"), page.shown("cmp-status")
    note = page.shown("cmp-divergence")
    assert note.startswith(f"All 5 lanes produced the same {TOKENS} tokens"), note
    said = [p for p in note.split("\n\n") if "wrote the same text" in p]
    assert said == [said[0]] and said[0].startswith("**Lane 1, Lane 2, Lane 3, Lane 4 and Lane 5 wrote the same text:**"), note
    sentence = said[0]
    assert "all pick greedily, so nothing is drawn" in sentence and "as the same weights do" in sentence, sentence
    assert "ignores (min_p, temperature, top_k, top_p)" in sentence, sentence  # the knobs that differ, named
    assert "drew the same u" not in note and "share a seed" not in note, note
    for server in servers:  # each lane's server, named as where its tokens came from
        assert f"step mode on {server.url}" in sentence, (server.url, sentence)


def test_two_greedy_lanes_on_one_model_with_the_same_knobs_are_the_same_run_again(served):
    """(nothing to explain: the page says nothing more than that they agree)"""
    demo, servers = served
    page = Page(demo)
    set_lanes(page, [{"strategy": "greedy"}, {"strategy": "greedy"}], TOKENS)
    for i in range(2):
        page.set(f"cmp-lane-{i}-model", servers[0].spec)
    page.set("cmp-prompt", "Count:")
    page.set("cmp-chat", False)
    page.fire("on_run", "cmp-status")
    assert "wrote the same text" not in page.shown("cmp-divergence"), page.shown("cmp-divergence")
    assert charts.same_text_note([], []) == ""
