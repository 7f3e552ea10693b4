"""Shared by the tests: what tests/playground/test_step_charts.py and the tests beside it use."""

from __future__ import annotations


__all__ = ['contrast']


def _luminance(hex_colour: str) -> float:
    channels = [int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    linear = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]


def contrast(hex_colour: str) -> float:
    """WCAG contrast ratio against white (#ffffff has luminance 1)."""
    return 1.05 / (_luminance(hex_colour) + 0.05)
