"""Shared by the tests: what tests/engine/test_inside.py and the tests beside it use."""

from __future__ import annotations

import math
import torch

__all__ = ['hand_calibration']


def hand_calibration(logits: torch.Tensor, targets: torch.Tensor, temperature: float, bins: int) -> tuple[float, float]:
    """(ECE, NLL) with a loop over positions: softmax, max, argmax, the bin by floor(c · B)."""
    n, table = len(targets), [[0, 0.0, 0.0] for _ in range(bins)]
    nll = 0.0
    for t in range(n):
        p = torch.softmax(logits[t].double() / temperature, -1)
        c, top = float(p.max()), int(p.argmax())
        b = min(int(c * bins), bins - 1)
        table[b][0] += 1
        table[b][1] += c
        table[b][2] += float(top == int(targets[t]))
        nll -= math.log(float(p[targets[t]]))
    ece = sum(k / n * abs(right / k - conf / k) for k, conf, right in table if k)
    return ece, nll / n
