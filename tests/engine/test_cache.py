"""engine.cache.KVCache's rows: left-padded rows of different lengths (the scheduler's batch) in the
same cache and forward as a solo run. Oracle: each row's own solo KVCache, fed the same tokens;
logits within 1e-5 (a batched matmul may round differently from a batch of one)."""

from __future__ import annotations

import torch

from engine.cache import KVCache

TOL = 1e-5
SHORT, LONG = [5, 6, 7], [8, 9, 10, 11, 12, 13]


def solo(model, tokens: list[int], then: list[int]) -> list[torch.Tensor]:
    """A solo cache's logits [V] after the prompt, then after each of ``then``."""
    cache = KVCache(model)
    out = [cache.step(tokens)[0]]
    out += [cache.step([t])[0] for t in then]
    return out


def padded(model) -> KVCache:
    """SHORT and LONG prefilled together, SHORT left-padded to LONG's length."""
    cache = KVCache(model)
    ids = torch.tensor([[SHORT[0]] * 3 + SHORT, LONG])  # [2, 6]
    cache.forward(ids, mask=torch.tensor([[0, 0, 0, 1, 1, 1], [1] * 6]))
    return cache


def test_left_padded_rows_step_as_each_row_alone(tiny_lm):
    model = tiny_lm.model
    cache = padded(model)
    assert cache.rows == 2 and cache.mask.tolist() == [[0, 0, 0, 1, 1, 1], [1] * 6]
    steps = [cache.forward(torch.tensor([[20 + i], [30 + i]])).logits[:, -1].float() for i in range(2)]
    short, long = solo(model, SHORT, [20, 21]), solo(model, LONG, [30, 31])
    for i in range(2):
        assert torch.allclose(steps[i][0], short[i + 1], atol=TOL)
        assert torch.allclose(steps[i][1], long[i + 1], atol=TOL)
    assert cache.mask.shape == (2, 8)


def test_keep_rows_trims_the_shared_padding_and_copies_repeats(tiny_lm):
    model = tiny_lm.model
    cache = padded(model)
    cache.keep_rows([0, 0])  # SHORT twice: its three pad columns are shared, so they go
    assert cache.rows == 2 and cache.length == 3 and cache.mask is None
    logits = cache.forward(torch.tensor([[20], [20]])).logits[:, -1].float()
    assert torch.allclose(logits[0], solo(model, SHORT, [20])[1], atol=TOL) and torch.equal(logits[0], logits[1])


def test_append_rows_pads_the_shorter_side(tiny_lm):
    model = tiny_lm.model
    cache, other = KVCache(model), KVCache(model)
    cache.step(SHORT)
    other.step(LONG)
    cache.append_rows(other)
    assert cache.rows == 2 and cache.mask.tolist() == [[0, 0, 0, 1, 1, 1], [1] * 6]
    logits = cache.forward(torch.tensor([[20], [30]])).logits[:, -1].float()
    assert torch.allclose(logits[0], solo(model, SHORT, [20])[1], atol=TOL)
    assert torch.allclose(logits[1], solo(model, LONG, [30])[1], atol=TOL)
    cache.rewind(1)  # the mask follows the crop
    assert cache.mask.shape == (2, 6) and cache.length == 6
