"""engine.threads: the one place torch's CPU thread count is set (the process's count and the
scheduler's per-step count), each change restored where it is scoped."""

from __future__ import annotations

import pytest
import torch

from engine.threads import FEW_ROWS, set_threads, step_threads, threads


def test_set_threads_sets_the_count_and_zero_leaves_it():
    before = torch.get_num_threads()
    try:
        assert set_threads(1) == 1 == torch.get_num_threads()
        assert set_threads(0) == 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="^threads: must be 0 .* got -1"):
        set_threads(-1)


def test_threads_is_restored_after_the_block_even_on_error():
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError), threads(before + 1):
        assert torch.get_num_threads() == before + 1
        raise RuntimeError("inside")
    assert torch.get_num_threads() == before


@pytest.mark.parametrize(("device", "rows", "one"), [("cpu", 1, True), ("cpu", FEW_ROWS, True),
                                                     ("cpu", FEW_ROWS + 1, False), ("cuda", 1, False)])
def test_step_threads_uses_one_thread_for_few_cpu_rows(device, rows, one):
    before = torch.get_num_threads()
    with threads(2):
        with step_threads(torch.device(device), rows):
            assert torch.get_num_threads() == (1 if one else 2)
        assert torch.get_num_threads() == 2
    assert torch.get_num_threads() == before
