"""Each stage equals transformers' processor on random logits, never modifies its input, and our
own stages (frequency/presence penalties, constraints) match hand-computed values."""

import pytest
import torch
from transformers.generation import logits_process as tlp

from engine.config import ConfigError, DecodingConfig
from engine.chain import Chain
from engine.stages import (Constraints, Epsilon, FrequencyPenalty, MinP, NoRepeatNGram, PresencePenalty, RepetitionPenalty, Temperature, TopK, TopP, TypicalP)

V = 50


@pytest.fixture
def batch():
    g = torch.Generator().manual_seed(7)
    input_ids = torch.randint(0, V, (3, 12), generator=g)
    logits = torch.randn(3, V, generator=g) * 3
    return input_ids, logits


ORACLES = [
    (Temperature(0.7), tlp.TemperatureLogitsWarper(0.7)),
    (Temperature(1.9), tlp.TemperatureLogitsWarper(1.9)),
    (TopK(5), tlp.TopKLogitsWarper(5)),
    (TopP(0.8), tlp.TopPLogitsWarper(0.8)),
    (MinP(0.1), tlp.MinPLogitsWarper(0.1)),
    (TypicalP(0.7), tlp.TypicalLogitsWarper(0.7)),
    (Epsilon(0.02), tlp.EpsilonLogitsWarper(0.02)),
    (RepetitionPenalty(1.3), tlp.RepetitionPenaltyLogitsProcessor(1.3)),
    (RepetitionPenalty(0.7), tlp.RepetitionPenaltyLogitsProcessor(0.7)),
    (NoRepeatNGram(2), tlp.NoRepeatNGramLogitsProcessor(2)),
]


@pytest.mark.parametrize("stage,oracle", ORACLES, ids=[repr(s) for s, _ in ORACLES])
def test_stage_equals_transformers_processor(stage, oracle, batch):
    input_ids, logits = batch
    expected = oracle(input_ids, logits.clone())
    assert torch.equal(stage(input_ids, logits), expected)


@pytest.mark.parametrize("stage", [s for s, _ in ORACLES] + [FrequencyPenalty(0.5, 4), PresencePenalty(0.5, 4),
                                                             Constraints([1, 2, 3], [[4], [5, 6]])], ids=repr)
def test_stage_never_modifies_input(stage, batch):
    input_ids, logits = batch
    ids_before, logits_before = input_ids.clone(), logits.clone()
    out = stage(input_ids, logits)
    assert torch.equal(input_ids, ids_before) and torch.equal(logits, logits_before)
    assert out.data_ptr() != logits.data_ptr()


def test_frequency_and_presence_penalties_by_hand():
    # prompt [0, 1], generated [1, 1, 3]: counts over generated only -> token1: 2, token3: 1
    input_ids = torch.tensor([[0, 1, 1, 1, 3]])
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    freq = FrequencyPenalty(0.5, prompt_length=2)(input_ids, logits)
    assert freq.tolist() == [[1.0, 2.0 - 1.0, 3.0, 4.0 - 0.5]]
    pres = PresencePenalty(0.25, prompt_length=2)(input_ids, logits)
    assert pres.tolist() == [[1.0, 1.75, 3.0, 3.75]]


def test_constraints_mask_allowed_and_banned_sequences():
    logits = torch.zeros(1, 6)
    out = Constraints(allowed_ids=[1, 2, 5])(torch.tensor([[0]]), logits)
    assert torch.isinf(out[0, [0, 3, 4]]).all() and (out[0, [1, 2, 5]] == 0).all()
    banned = Constraints(banned_sequences=[[3], [4, 5]])
    after_4 = banned(torch.tensor([[0, 4]]), logits)
    assert torch.isinf(after_4[0, [3, 5]]).all() and after_4[0, 4] == 0
    after_0 = banned(torch.tensor([[4, 0]]), logits)
    assert torch.isinf(after_0[0, 3]) and after_0[0, 5] == 0  # 5 only banned right after 4


def test_chain_follows_stage_order_and_matches_transformers_list(batch):
    input_ids, logits = batch
    cfg = DecodingConfig(temperature=0.7, top_k=20, top_p=0.9, repetition_penalty=1.2)
    chain = Chain.from_config(cfg)
    assert chain.names == ["repetition_penalty", "temperature", "top_k", "top_p"]
    oracle = tlp.LogitsProcessorList([tlp.RepetitionPenaltyLogitsProcessor(1.2), tlp.TemperatureLogitsWarper(0.7),
                                      tlp.TopKLogitsWarper(20), tlp.TopPLogitsWarper(0.9)])
    assert torch.equal(chain(input_ids, logits), oracle(input_ids, logits.clone()))
    reordered = Chain.from_config(cfg.replace(stage_order=["top_p", "temperature"]))
    assert reordered.names == ["top_p", "temperature", "repetition_penalty", "top_k"]
    oracle2 = tlp.LogitsProcessorList([tlp.TopPLogitsWarper(0.9), tlp.TemperatureLogitsWarper(0.7),
                                       tlp.RepetitionPenaltyLogitsProcessor(1.2), tlp.TopKLogitsWarper(20)])
    assert torch.equal(reordered(input_ids, logits), oracle2(input_ids, logits.clone()))


def test_greedy_chain_skips_sampling_stages():
    cfg = DecodingConfig(strategy="greedy", temperature=0.5, top_k=3, repetition_penalty=1.5)
    assert Chain.from_config(cfg).names == ["repetition_penalty"]


def test_traced_records_kept_mass_and_removed_tokens():
    # 4-token distribution p = [0.5, 0.3, 0.15, 0.05]; top-k 2 keeps 2 tokens, removes 20% of the mass
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    chain = Chain([TopK(2)])
    final, stages = chain.traced(torch.tensor([[0]]), logits, 4, str)
    assert [s.name for s in stages] == ["raw", "top_k", "final"]
    raw, topk, fin = stages
    assert raw.kept == 4 and topk.kept == 2
    assert topk.mass_removed == pytest.approx(0.2)
    assert [t.token_id for t in topk.removed] == [2, 3]
    assert [round(t.prob, 4) for t in topk.top[:2]] == [0.625, 0.375]
    assert fin.top == topk.top and fin.kept == 2
    assert topk.tv_distance == pytest.approx(0.2)
    assert raw.entropy == pytest.approx(float(-(probs * probs.log()).sum()))


@pytest.mark.parametrize("cls,value,key", [(Temperature, 0.0, "temperature"), (TopK, 0, "top_k"), (TopP, 1.5, "top_p"),
                                           (MinP, -0.1, "min_p"), (TypicalP, 0.0, "typical_p"), (Epsilon, 1.0, "epsilon_cutoff"),
                                           (RepetitionPenalty, -1.0, "repetition_penalty"), (NoRepeatNGram, 0, "no_repeat_ngram_size"),
                                           (FrequencyPenalty, 3.0, "frequency_penalty"), (PresencePenalty, -2.5, "presence_penalty")])
def test_stage_constructor_validates(cls, value, key):
    with pytest.raises(ConfigError, match=key):
        cls(value)


# --- top-p without the full sort: bit for bit transformers' warper ------------------------------
class _CountingOracle:
    """transformers' TopPLogitsWarper, counting the rows it is handed (the slow path)."""

    def __init__(self, top_p):
        self.warper, self.rows = tlp.TopPLogitsWarper(top_p), 0

    def __call__(self, input_ids, logits):
        self.rows += logits.shape[0]
        return self.warper(input_ids, logits)


def test_top_p_fast_path_equals_transformers_bit_for_bit():
    from engine.stages import top_p_fast

    g = torch.Generator().manual_seed(11)
    vocab, fast_rows, rows = 49152, 0, 0
    for trial in range(120):
        scale = (0.3, 1.0, 3.0, 6.0, 12.0)[trial % 5]  # flat ... peaked rows
        logits = torch.randn(4, vocab, generator=g) * scale
        if trial % 4 == 0:  # an earlier stage's -inf (top-k, constraints)
            logits[:, torch.randint(0, vocab, (30000,), generator=g)] = -float("inf")
        top_p = (0.3, 0.5, 0.8, 0.9, 0.95, 0.99)[trial % 6]
        oracle = _CountingOracle(top_p)
        assert torch.equal(top_p_fast(None, logits, top_p, oracle), tlp.TopPLogitsWarper(top_p)(None, logits.clone()))
        fast_rows, rows = fast_rows + 4 - oracle.rows, rows + 4
    assert 0.3 * rows < fast_rows < rows  # both paths taken, the fast one often


def test_top_p_fast_path_hands_ambiguous_rows_to_transformers():
    from engine.stages import top_p_fast

    vocab = 4096
    base = torch.full((vocab,), -20.0)
    base[:3] = torch.tensor([4.0, 2.0, 2.0])  # a tie right where top_p puts the boundary
    probs = torch.softmax(base.double(), -1)
    tie_p = float(probs[0] + probs[1] / 2)  # keeps the first 2.0 but not the second: the sort's choice
    peaked = base.clone()
    peaked[2] = 1.0
    nan_row, inf_row = peaked.clone(), peaked.clone()
    nan_row[5], inf_row[5] = float("nan"), float("inf")
    logits = torch.stack([base, peaked, nan_row, inf_row, torch.full((vocab,), -float("inf"))])
    oracle = _CountingOracle(tie_p)
    got = top_p_fast(None, logits, tie_p, oracle)
    want = tlp.TopPLogitsWarper(tie_p)(None, logits.clone())
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    assert oracle.rows == 4  # the tie, NaN, +inf and all -inf rows; the peaked row went the fast way
    near_one = _CountingOracle(0.9995)
    top_p_fast(None, logits[:2], 0.9995, near_one)
    assert near_one.rows == 2  # top_p near 1: float32 rounding decides, so transformers does


def test_top_p_stage_takes_the_fast_path_on_real_logits(tiny_lm):
    """TopP on [B, V] of a model's logits equals transformers' warper, bit for bit."""
    ids = torch.tensor([[1, 5, 9, 13, 2, 7]])
    with torch.inference_mode():
        logits = tiny_lm.model(input_ids=ids).logits[0].float()  # [S, V]: six rows
    for top_p in (0.5, 0.9, 0.95):
        assert torch.equal(TopP(top_p)(ids, logits), tlp.TopPLogitsWarper(top_p)(ids, logits.clone()))
