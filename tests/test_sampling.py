"""The sampler equals torch.multinomial draw for draw, and its reported u is an honest uniform
whose inverse CDF (tokens sorted by probability) is the chosen token."""

import pytest
import torch
from scipy import stats

from engine import sampling


def test_sample_matches_torch_multinomial_with_same_seed():
    g = torch.Generator().manual_seed(0)
    for seed in range(50):
        logits = torch.randn(1, 1000, generator=g) * 2
        probs = torch.softmax(logits, dim=-1)
        expected = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(seed)).item()
        assert sampling.sample(logits, torch.Generator().manual_seed(seed)).token_id == expected


def test_draw_lies_in_chosen_tokens_interval_of_sorted_cdf():
    probs = torch.tensor([[0.1, 0.6, 0.3]])  # sorted order: token 1 [0, .6), token 2 [.6, .9), token 0 [.9, 1)
    intervals = {1: (0.0, 0.6), 2: (0.6, 0.9), 0: (0.9, 1.0)}
    gen = torch.Generator().manual_seed(1)
    for _ in range(200):
        pick = sampling.sample(probs.log(), gen)
        low, high = intervals[pick.token_id]
        assert pick.low == pytest.approx(low) and pick.high == pytest.approx(high)
        assert low <= pick.draw < high + 1e-9


def test_draw_is_uniform_ks_test():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    gen = torch.Generator().manual_seed(123)
    draws = [sampling.sample(logits, gen).draw for _ in range(4000)]
    assert stats.kstest(draws, "uniform").pvalue > 0.01


def test_greedy_picks_argmax_lowest_id_on_ties():
    pick = sampling.greedy(torch.tensor([[0.0, 3.0, 3.0, 1.0]]))
    assert pick.token_id == 1 and pick.draw is None
    assert pick.prob == pytest.approx(torch.softmax(torch.tensor([0.0, 3.0, 3.0, 1.0]), 0)[1].item())


def test_skip_draws_reproduces_generator_state():
    a = torch.Generator().manual_seed(5)
    for _ in range(3):
        sampling.exponential_noise(torch.Size([1, 64]), a, torch.device("cpu"))
    b = torch.Generator().manual_seed(5)
    sampling.skip_draws(b, 3, 64, torch.device("cpu"))
    assert torch.equal(a.get_state(), b.get_state())
