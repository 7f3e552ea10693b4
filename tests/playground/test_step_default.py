"""After a Step-through run, the step shown first is the most uncertain one (highest entropy)."""

from types import SimpleNamespace

from playground.views.step import most_uncertain


def test_most_uncertain_step_is_the_highest_entropy_first_of_ties():
    steps = [SimpleNamespace(entropy=e) for e in (0.1, 2.5, 0.7, 2.5)]
    assert most_uncertain(steps) == 1  # 2.5 nats at steps 1 and 3: the first
    assert most_uncertain([]) == 0
