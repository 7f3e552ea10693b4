"""engine/numbers.py (issue #35's "rounding hides small numbers"): each of the issue's examples by
hand, then the rule over many values against its definition: a written number read back is within
its own rounding of the value, two significant digits survive for small values, and 0 / 100 are
written only for exactly 0 / 1."""

import math
import random

import pytest

from engine.numbers import UNKNOWN, decimal, interval, percent


@pytest.mark.parametrize("p, text", [
    (0.279, "27.9%"), (0.4, "40.0%"), (0.0053, "0.53%"), (6.6e-06, "0.00066%"), (6.6e-10, "6.6e-08%"),
    (0.0, "0%"), (1.0, "100%"), (0.99996, "99.996%"), (0.0999, "10.0%"), (0.01, "1.0%"), (0.75, "75.0%"),
])
def test_percent_by_hand(p, text):
    assert percent(p) == text


def test_the_issue_s_examples_no_longer_hide_their_numbers():
    # "p = 0.0%" for a chosen token, "from 76% to 0%", "6.6e-06" beside "0.0%"
    assert percent(3e-5) == "0.0030%"
    assert percent(6.6e-06) == "0.00066%"
    # "slice [0.905, 0.905)"
    assert interval(0.90512, 0.90513) == "[0.9051200, 0.9051300)"  # the width 0.9999e-05 in float: two digits of it
    assert interval(0.3, 0.512) == "[0.300, 0.512)"


@pytest.mark.parametrize("value", [None, math.nan, math.inf, -math.inf, True])
def test_unknown_values_read_unknown(value):
    assert percent(value) == UNKNOWN and decimal(value) == UNKNOWN
    assert interval(value, 0.5) == f"[{UNKNOWN})"


@pytest.mark.parametrize("x, text", [(0.5, "0.500"), (0.0004, "0.00040"), (0.9999, "0.9999"), (0.99999, "0.99999"),
                                     (0.0, "0.000"), (1.0, "1.000"), (0.1234, "0.123")])
def test_decimal_by_hand(x, text):
    assert decimal(x) == text


def _read_percent(text: str) -> float:
    return float(text.rstrip("%").replace("−", "-")) / 100


def test_percent_against_its_definition_over_many_values():
    rng = random.Random(35)
    values = [10 ** rng.uniform(-12, 0) for _ in range(3000)] + [1 - 10 ** rng.uniform(-9, -1) for _ in range(1000)]
    for p in values:
        text = percent(p)
        back = _read_percent(text)
        assert text not in ("0%", "0.0%", "100%", "100.0%"), (p, text)  # 0 and 100 only for exactly 0 and 1
        if p * 100 < 1:  # two significant digits: within half a unit of the second digit
            assert abs(back - p) <= 0.051 * p, (p, text)
        else:  # at least one decimal place of a percent
            assert abs(back - p) <= 0.0005 + 1e-12, (p, text)
        assert 0 < back < 1 or p >= 1, (p, text)


def test_interval_keeps_every_slice_s_ends_apart():
    rng = random.Random(7)
    for _ in range(3000):
        low = rng.random()
        high = min(1.0, low + 10 ** rng.uniform(-9, 0))
        if high <= low:
            continue
        text = interval(low, high)
        a, b = (float(x) for x in text.strip("[)").split(", "))
        assert a < b, (low, high, text)
        assert abs(a - low) <= (high - low) / 2 and abs(b - high) <= (high - low) / 2, (low, high, text)
