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


# --- the race on a truncated row's nonzero entries (sampling.exponentials_at, issue #38) -----------------
V = 49152


def same_pick(a: sampling.Pick, b: sampling.Pick) -> bool:
    """Every field bit for bit (repr: a float's shortest exact form; NaN equals NaN)."""
    return repr(a) == repr(b)


def step_row(seed: int, n: int = 100) -> torch.Tensor:
    """A served model's step as our chain sees it: the softmax of a top-``n`` (every other logit -inf)."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(V, generator=g) * 3
    ids = torch.topk(full, n).indices
    logits = torch.full((V,), float("-inf"))
    logits[ids] = torch.log_softmax(full, -1)[ids]
    return torch.softmax(logits, -1)


def test_the_compact_exponentials_are_exponential_s_bit_for_bit_here():
    """On this torch the fast path is live, and at any positions it gives exponential_'s numbers and leaves
    the generator where V exponentials leave it (then the next step's draws are the same too)."""
    assert sampling.compact_draws_work()
    for seed in (0, 7, 2**40 + 3):
        ours, theirs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        ids = torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:300].sort().values
        for _ in range(3):
            noise, u = sampling.exponentials_at(ours, V, ids)
            expected = sampling.exponential_noise(torch.Size([1, V]), theirs, torch.device("cpu"))[0]
            assert torch.equal(noise, expected[ids]) and u.shape == (V,) and u.dtype == torch.float64
            assert torch.equal(ours.get_state(), theirs.get_state())


@pytest.mark.parametrize("kind", ["step", "top-k", "one-token", "ties", "nan"])
def test_a_truncated_row_races_on_its_nonzero_entries_with_the_same_pick_as_over_v(monkeypatch, kind):
    """A row with few nonzero probabilities (a served model's top-100, a top-k, one token left, tied
    entries, a NaN) gets the same Pick bit for bit (token, p, u, interval) as the race over V, for many
    seeds, and the generator ends in the same state; the token is torch.multinomial's."""
    for seed in range(40):
        probs = step_row(seed)
        if kind == "top-k":
            probs = torch.where(probs >= torch.topk(probs, 5).values[-1], probs, 0.0)
            probs /= probs.sum()
        elif kind == "one-token":
            probs = torch.zeros(V)
            probs[V - 1 - seed] = 1.0
        elif kind == "ties":
            probs = torch.zeros(V)
            probs[torch.tensor([3, 40, 41, 900, 49000])] = torch.tensor([0.25, 0.25, 0.1, 0.25, 0.15])
        elif kind == "nan":
            probs[int(probs.nonzero()[seed % 10])] = float("nan")
        fast_gen, slow_gen = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        fast = sampling.sample_rows(probs[None], [fast_gen])[0]
        with monkeypatch.context() as m:
            m.setattr(sampling, "COMPACT_MOST", 0)
            slow = sampling.sample_rows(probs[None], [slow_gen])[0]
        assert same_pick(fast, slow), (seed, fast, slow)
        assert torch.equal(fast_gen.get_state(), slow_gen.get_state())
        if kind != "nan":
            assert fast.token_id == torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(seed)).item()


def test_rows_of_a_batch_race_alone_whichever_way_each_races():
    """A batch mixing truncated rows (raced on their nonzero entries) and full rows (raced over V) gives
    every row the Pick it gets alone."""
    full = torch.softmax(torch.randn(2, V, generator=torch.Generator().manual_seed(3)), -1)
    probs = torch.stack([step_row(1), full[0], step_row(2, 900), full[1]])
    batch = sampling.sample_rows(probs, [torch.Generator().manual_seed(50 + r) for r in range(4)])
    for r in range(4):
        assert same_pick(batch[r], sampling.sample_probs(probs[r], torch.Generator().manual_seed(50 + r)))


def test_a_uniform_of_exactly_zero_outside_the_row_races_as_over_v(monkeypatch):
    """Over V, a zero-probability token whose exponential is 0 (a uniform of exactly 0: once in 2^53)
    makes 0 / 0 = NaN, which argmax takes; the compact race then races over V from the same uniforms,
    so the two never part."""
    probs = step_row(4)
    zero_at = int((probs == 0).nonzero()[5])
    real = sampling._uniforms

    def with_a_zero(generator, count):
        u = real(generator, count)
        u[zero_at] = 0.0
        return u

    monkeypatch.setattr(sampling, "_uniforms", with_a_zero)
    chosen = sampling.sample_rows(probs[None], [torch.Generator().manual_seed(9)])[0]
    u = with_a_zero(torch.Generator().manual_seed(9), V)
    expected = int(torch.argmax(probs / sampling._exponentials(u.tolist())))
    assert chosen.token_id == expected == zero_at


def test_skip_draws_takes_the_uniforms_and_the_next_draw_is_the_same():
    a, b = torch.Generator().manual_seed(8), torch.Generator().manual_seed(8)
    for _ in range(2):
        sampling.exponential_noise(torch.Size([1, V]), a, torch.device("cpu"))
    sampling.skip_draws(b, 2, V, torch.device("cpu"))
    assert torch.equal(a.get_state(), b.get_state())
    probs = step_row(5)
    assert same_pick(sampling.sample_probs(probs, a), sampling.sample_probs(probs, b))
