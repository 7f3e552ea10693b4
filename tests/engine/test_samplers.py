"""Samplers at parity with llama.cpp and text-generation-webui: DRY, XTC, top-nσ, dynamic
temperature, smoothing, mirostat v1/v2, eta, top-a, top-H, logit bias, min new tokens.

Each stage is checked on a 4-5 token distribution against its reference definition, with the
arithmetic in a comment; wrapped transformers processors are checked for equality on random
logits; stateful stages (mirostat's μ, XTC's coin) are checked for seeded reproducibility and for
exact resumption when a run is branched."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation import logits_process as tlp

from engine.strategies import decode
from engine.config import DEFAULT_STAGE_ORDER, ConfigError, DecodingConfig
from engine.chain import Chain
from engine.stages import (Dry, DynamicTemperature, Eta, LogitBias, MinNewTokens, Mirostat, Smoothing, TopA, TopH, TopNSigma, Xtc, word_token_variants)

NEG = float("-inf")


def chain_of(knobs: dict, prompt_length: int = 0, **kwargs) -> Chain:
    """The public path: knobs -> DecodingConfig -> Chain."""
    return Chain.from_config(DecodingConfig.from_dict(knobs), prompt_length, **kwargs)


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs]).log()


def kept(out: torch.Tensor) -> list[int]:
    return torch.isfinite(out[0]).nonzero().flatten().tolist()


# --- DRY -----------------------------------------------------------------------------------------
def test_dry_by_hand():
    logits = torch.zeros(1, 5)
    # context 3 0 1 2 0 1: the suffix "0 1" occurred before, followed by 2 -> match length n = 2
    # (3 != 2 stops it); penalty = multiplier * base^(n - allowed) = 0.8 * 2^0 = 0.8 on token 2
    chain = chain_of({"dry_multiplier": 0.8, "dry_base": 2.0, "dry_sequence_breakers": []})
    out = chain(torch.tensor([[3, 0, 1, 2, 0, 1]]), logits)
    assert out[0].tolist() == pytest.approx([0.0, 0.0, -0.8, 0.0, 0.0])
    # context 0 1 2 3 0 1 2: suffix "0 1 2" repeats, followed by 3: n = 3 -> 0.8 * 2^1 = 1.6 on token 3
    out = chain(torch.tensor([[0, 1, 2, 3, 0, 1, 2]]), logits)
    assert out[0].tolist() == pytest.approx([0.0, 0.0, 0.0, -1.6, 0.0])
    assert chain.stages[0].params["penalized"][0] | {"penalty": 1.6} == \
        {"token_id": 3, "token": "3", "length": 3, "penalty": 1.6, "phrase": "012"}
    # token 1 breaks sequences: the match "1 2" stops at 1 -> n = 1 < allowed 2, no penalty
    breaker = Dry(0.8, 2.0, 2, -1, breaker_ids=[1])
    assert breaker(torch.tensor([[0, 1, 2, 3, 0, 1, 2]]), logits).tolist() == [[0.0] * 5]
    # only the last 3 tokens are scanned: "0 1 2" has no earlier 2, no penalty
    last3 = Dry(0.8, 2.0, 2, 3)
    assert last3(torch.tensor([[0, 1, 2, 3, 0, 1, 2]]), logits).tolist() == [[0.0] * 5]


def _dry_brute_force(context: list[int], allowed: int, multiplier: float, base: float, vocab: int) -> list[float]:
    """Independent statement of the rule: for each earlier position j, the token at j would extend
    the repeat of the longest common suffix of context[:j] and context (at most 50 tokens)."""
    out = [0.0] * vocab
    best: dict[int, int] = {}
    for j in range(1, len(context)):
        n = 0
        while n < min(j, 50) and context[j - 1 - n] == context[len(context) - 1 - n] and j - 1 - n != len(context) - 1 - n:
            n += 1
        if n:
            best[context[j]] = max(best.get(context[j], 0), n)
    for token, n in best.items():
        if n >= allowed:
            out[token] -= multiplier * base ** (n - allowed)
    return out


def test_dry_equals_brute_force_on_random_contexts():
    g = torch.Generator().manual_seed(3)
    stage = Dry(0.7, 1.75, 2)
    for _ in range(50):
        context = torch.randint(0, 4, (1, 30), generator=g)
        expected = _dry_brute_force(context[0].tolist(), 2, 0.7, 1.75, 4)
        assert stage(context, torch.zeros(1, 4))[0].tolist() == pytest.approx(expected)


def test_dry_breakers_from_strings_need_the_tokenizer(tiny_lm):
    with pytest.raises(ConfigError, match="dry_sequence_breakers"):
        chain_of({"dry_multiplier": 1.0})  # the default breakers are strings
    chain = chain_of({"dry_multiplier": 1.0}, tokenizer=tiny_lm.tokenizer)
    newline = tiny_lm.tokenizer.encode("a\n", add_special_tokens=False)[-1]
    assert newline in chain.stages[0].breakers and len(chain.stages[0].breakers) == 4


# --- XTC -----------------------------------------------------------------------------------------
def test_xtc_removes_top_choices_but_the_least_likely():
    # p = .4 .3 .2 .1, threshold .25: top choices .4 and .3; .4 goes, .3 stays;
    # renormalised over .3 + .2 + .1 = .6 -> 0 .5 .333 .167
    chain = chain_of({"xtc_threshold": 0.25, "xtc_probability": 1.0})
    out = chain(torch.tensor([[0]]), logits_of([0.4, 0.3, 0.2, 0.1]))
    assert torch.softmax(out, -1)[0].tolist() == pytest.approx([0.0, 0.5, 0.2 / 0.6, 0.1 / 0.6])
    assert chain.stages[0].params | {} == {"xtc_threshold": 0.25, "xtc_probability": 1.0, "u": None, "fired": True,
                                            "kept_id": 1}
    # threshold .35: only .4 reaches it, so nothing is removed
    out = chain_of({"xtc_threshold": 0.35, "xtc_probability": 1.0})(torch.tensor([[0]]), logits_of([0.4, 0.3, 0.2, 0.1]))
    assert kept(out) == [0, 1, 2, 3]
    assert chain_of({"xtc_threshold": 0.6, "xtc_probability": 1.0}).names == []  # > 0.5 disables
    assert chain_of({"xtc_probability": 0.0}).names == []


def test_xtc_coin_comes_from_the_run_generator():
    logits = logits_of([0.4, 0.3, 0.2, 0.1])
    expected = torch.rand((), generator=torch.Generator().manual_seed(11))  # the first draw of seed 11
    chain = chain_of({"xtc_threshold": 0.25, "xtc_probability": 0.5}, generator=torch.Generator().manual_seed(11))
    out = chain(torch.tensor([[0]]), logits)
    params = chain.stages[0].params
    assert params["u"] == float(expected) and params["fired"] == (float(expected) < 0.5)
    assert kept(out) == ([1, 2, 3] if params["fired"] else [0, 1, 2, 3])
    with pytest.raises(ConfigError, match="xtc_probability"):
        chain_of({"xtc_probability": 0.5})(torch.tensor([[0]]), logits)  # 0 < p < 1 needs the generator


def test_xtc_fires_with_its_probability():
    # 4000 coins at probability 0.3: fired count ~ Binomial(4000, .3), mean 1200, sd 29; 5 sd bound
    chain = chain_of({"xtc_threshold": 0.25, "xtc_probability": 0.3}, generator=torch.Generator().manual_seed(5))
    fired = 0
    for _ in range(4000):
        chain(torch.tensor([[0]]), logits_of([0.4, 0.3, 0.2, 0.1]))
        fired += chain.stages[0].params["fired"]
    assert abs(fired - 1200) < 5 * math.sqrt(4000 * 0.3 * 0.7)


# --- top-nσ, dynamic temperature, smoothing, top-a -----------------------------------------------
def test_top_n_sigma_by_hand():
    # logits 4 2 0 -2 (and one masked): mean 1, squared deviations 9 1 1 9 -> σ = sqrt(20 / 4) = 2.236
    # n = 1: keep logits >= 4 - 2.236 = 1.764 -> tokens 0, 1; n = 0.5: cut 2.882 -> token 0
    logits = torch.tensor([[4.0, 2.0, 0.0, -2.0, NEG]])
    stage = TopNSigma(1.0)
    assert kept(stage(None, logits)) == [0, 1]
    assert stage.params["sigma"] == pytest.approx(math.sqrt(5))
    assert kept(TopNSigma(0.5)(None, logits)) == [0]
    assert kept(TopNSigma(1.0)(None, logits / 0.3)) == [0, 1]  # temperature does not change the kept set


def test_dynamic_temperature_by_hand():
    # p = .75 .25: H = -(.75 ln .75 + .25 ln .25) = 0.5623, H / ln 2 = 0.8113
    # T in [1 - .5, 1 + .5]: T = 0.5 + 1.0 * 0.8113 = 1.3113; logits divided by it
    logits = logits_of([0.75, 0.25])
    chain = chain_of({"temperature": 1.0, "dynatemp_range": 0.5})
    assert chain.names == ["dynamic_temperature"]
    out = chain(None, logits)
    h = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25)) / math.log(2)
    assert chain.stages[0].params["T"] == pytest.approx(0.5 + h, abs=1e-6)
    assert out[0].tolist() == pytest.approx((logits[0] / (0.5 + h)).tolist(), abs=1e-6)
    # uniform over the 3 surviving tokens: H / Hmax = 1 -> T = T + range; exponent 2 changes nothing
    stage = DynamicTemperature(0.8, 0.3, 2.0)
    stage(None, torch.tensor([[1.0, 1.0, 1.0, NEG]]))
    assert stage.params["T"] == pytest.approx(1.1)
    # it replaces plain temperature: both knobs set, one stage
    assert chain_of({"temperature": 0.7, "dynatemp_range": 0.2}).names == ["dynamic_temperature"]


def test_smoothing_by_hand():
    # d = logit - max = 0 -1 -3; curve 1: max - f d^2 = 3 - .5 * (0, 1, 9) = 3, 2.5, -1.5
    logits = torch.tensor([[3.0, 2.0, 0.0, NEG]])
    assert Smoothing(0.5)(None, logits).tolist() == [[3.0, 2.5, -1.5, NEG]]
    # curve 2: k = .5, s = .5: -.25 d^2 + .25 d^3 + 3 = 3, 2.5, -2.25 - 6.75 + 3 = -6
    assert Smoothing(0.5, 2.0)(None, logits).tolist() == [[3.0, 2.5, -6.0, NEG]]


def test_top_a_by_hand():
    # p_max = .5, a = .5: drop p < .5 * .5^2 = .125 -> only .05 goes
    out = chain_of({"top_a": 0.5})(None, logits_of([0.5, 0.3, 0.15, 0.05]))
    assert kept(out) == [0, 1, 2]


# --- mirostat ------------------------------------------------------------------------------------
def test_mirostat_v2_truncates_by_surprise_and_updates_mu():
    # tau 1.1 -> mu = 2.2 bits: keep p >= 2^-2.2 = .218 -> .5 and .25 (-log2 .15 = 2.74 > 2.2)
    # renormalised: 2/3, 1/3. Picking token 1: surprise -log2(1/3) = 1.585, error 1.585 - 1.1 = .485,
    # mu = 2.2 - .1 * .485 = 2.1515
    chain = chain_of({"mirostat": 2, "mirostat_tau": 1.1})
    out = chain(torch.tensor([[0]]), logits_of([0.5, 0.25, 0.15, 0.1]))
    assert torch.softmax(out, -1)[0].tolist() == pytest.approx([2 / 3, 1 / 3, 0, 0])
    assert chain.stateful
    chain.observe(torch.tensor([[0]]), 1)
    params = chain.stages[0].params
    assert params["mu"] == pytest.approx(2.2) and params["kept"] == 2
    assert params["mu_after"] == pytest.approx(2.2 - 0.1 * (math.log2(3) - 1.1))
    chain(torch.tensor([[0, 1]]), logits_of([0.5, 0.25, 0.15, 0.1]))
    assert chain.stages[0].params["mu"] == pytest.approx(params["mu_after"])  # μ carries over


def test_mirostat_v1_keeps_k_from_the_zipf_estimate():
    # p_i ∝ 1/i^2 over N = 5: log(p_i / p_i+1) = 2 log((i+1)/i), so ŝ = 2 exactly and ε̂ = 1;
    # tau 1 -> mu 2: k = (ε̂ 2^mu / (1 - N^-ε̂))^(1/ŝ) = (4 / 0.8)^0.5 = 2.236 -> top 2 kept
    weights = [1 / i ** 2 for i in range(1, 6)]
    probs = [w / sum(weights) for w in weights]
    stage = Mirostat(1, 1.0, 0.1)
    assert kept(stage(torch.tensor([[0]]), logits_of(probs))) == [0, 1]
    # mu 4 (tau 2): k = (16 / .8)^.5 = 4.47 -> 4
    assert kept(Mirostat(1, 2.0)(torch.tensor([[0]]), logits_of(probs))) == [0, 1, 2, 3]


# --- wrapped transformers processors -------------------------------------------------------------
@pytest.fixture
def batch():
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, 50, (3, 12), generator=g), torch.randn(3, 200, generator=g) * 3


@pytest.mark.parametrize("stage,oracle", [
    (Eta(0.02), tlp.EtaLogitsWarper(0.02)),
    (Eta(0.0005), tlp.EtaLogitsWarper(0.0005)),
    (TopH(0.4), tlp.TopHLogitsWarper(0.4)),
    (MinNewTokens(5, prompt_length=10, eos_token_ids=[2, 7]), tlp.MinNewTokensLengthLogitsProcessor(10, 5, [2, 7])),
    (MinNewTokens(1, prompt_length=10, eos_token_ids=[2]), tlp.MinNewTokensLengthLogitsProcessor(10, 1, [2])),
    (LogitBias({(3,): 2.5, (4, 5): -7.0}), tlp.SequenceBiasLogitsProcessor({(3,): 2.5, (4, 5): -7.0})),
], ids=lambda value: type(value).__name__ if isinstance(value, tlp.LogitsProcessor) else repr(value))
def test_wrapped_stage_equals_transformers(stage, oracle, batch):
    input_ids, logits = batch
    assert torch.equal(stage(input_ids, logits), oracle(input_ids, logits.clone()))


def test_min_new_tokens_by_hand():
    # prompt of 2 tokens, EOS = 2: after 1 new token EOS is masked, after 2 it is not
    chain = chain_of({"min_new_tokens": 2}, prompt_length=2, eos_token_ids=[2])
    logits = torch.zeros(1, 4)
    assert chain(torch.tensor([[0, 1, 3]]), logits).tolist() == [[0.0, 0.0, NEG, 0.0]]
    assert chain(torch.tensor([[0, 1, 3, 3]]), logits).tolist() == [[0.0] * 4]


def test_logit_bias_ids_and_words(tiny_lm):
    chain = chain_of({"logit_bias": {"1": 2.5, 3: -100}})
    assert chain(torch.tensor([[0]]), torch.zeros(1, 5)).tolist() == [[0.0, 2.5, 0.0, -100.0, 0.0]]
    with pytest.raises(ConfigError, match="logit_bias: word 'hello' needs"):
        chain_of({"logit_bias": {"hello": 1}})
    with pytest.raises(ConfigError, match="logit_bias: token id 7 is outside"):
        chain_of({"logit_bias": {"7": 1}})(torch.tensor([[0]]), torch.zeros(1, 5))
    tok = tiny_lm.tokenizer
    words = chain_of({"logit_bias": {"hello": -3, "world": 4}}, tokenizer=tok)
    expected = {tuple(ids): -3.0 for ids in word_token_variants(tok, "hello")}
    expected |= {tuple(ids): 4.0 for ids in word_token_variants(tok, "world")}
    ids, logits = torch.tensor([[5, 6]]), torch.randn(1, tiny_lm.vocab_size)
    assert torch.equal(words(ids, logits), tlp.SequenceBiasLogitsProcessor(expected)(ids, logits))


# --- purity, order, validation -------------------------------------------------------------------
PURE = [Dry(0.8, 1.75, 2), Xtc(0.05, 1.0), TopNSigma(1.0), DynamicTemperature(1.0, 0.5), Smoothing(0.3, 2.0),
        Mirostat(1, 3.0), Mirostat(2, 3.0), TopA(0.2), Eta(0.01), TopH(0.5), MinNewTokens(30, 2, [2]),
        LogitBias({(4,): 1.0})]


@pytest.mark.parametrize("stage", PURE, ids=repr)
def test_new_stage_never_modifies_input(stage, batch):
    input_ids, logits = batch
    input_ids, logits = input_ids[:1], logits[:1]
    ids_before, logits_before = input_ids.clone(), logits.clone()
    out = stage(input_ids, logits)
    assert torch.equal(input_ids, ids_before) and torch.equal(logits, logits_before)
    assert out.data_ptr() != logits.data_ptr() and out.shape == logits.shape


def test_default_order_keeps_transformers_order_and_slots_new_stages_like_llama_cpp():
    old = ["constraints", "repetition_penalty", "frequency_penalty", "presence_penalty", "no_repeat_ngram",
           "temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon"]
    assert [s for s in DEFAULT_STAGE_ORDER if s in old] == old
    pos = DEFAULT_STAGE_ORDER.index
    assert pos("presence_penalty") < pos("dry") < pos("top_n_sigma") < pos("top_k") < pos("min_p") < pos("xtc")
    assert DEFAULT_STAGE_ORDER[-1] == "mirostat"


def test_greedy_drops_the_sampling_only_new_stages_but_keeps_processors():
    cfg = DecodingConfig.from_dict({"strategy": "greedy", "xtc_probability": 0.5, "mirostat": 2, "top_a": 0.1,
                                    "dry_multiplier": 1.0, "min_new_tokens": 3, "logit_bias": {"5": 1}})
    assert cfg.active_stages() == ("logit_bias", "dry", "min_new_tokens")


@pytest.mark.parametrize("knobs,message", [
    ({"dry_multiplier": -1}, "dry_multiplier: -1.0 is out of range; allowed [0, 10]"),
    ({"dry_allowed_length": 0}, "dry_allowed_length: 0 is out of range; allowed [1, 20]"),
    ({"dry_penalty_last_n": -2}, "dry_penalty_last_n: -2 is out of range; allowed [-1, 131072]"),
    ({"xtc_probability": 1.5}, "xtc_probability: 1.5 is out of range; allowed [0, 1]"),
    ({"mirostat": 3}, "mirostat: 3 is out of range; allowed [0, 2]"),
    ({"dynatemp_exponent": 0}, "dynatemp_exponent: 0.0 is out of range; allowed (0, 10]"),
    ({"smoothing_curve": 0.5}, "smoothing_curve: 0.5 is out of range; allowed [1, 10]"),
    ({"top_h": 2}, "top_h: 2.0 is out of range; allowed [0, 1]"),
    ({"logit_bias": {"5": 101}}, "logit_bias: bias for '5' is 101; allowed [-100, 100]"),
    ({"logit_bias": ["5"]}, "logit_bias: expected an object"),
    ({"logit_bias": {"": 1}}, "logit_bias: key ''"),
    ({"dry_sequence_breakers": "\n"}, "dry_sequence_breakers: expected a list"),
])
def test_validation_names_key_and_range(knobs, message):
    with pytest.raises(ConfigError) as err:
        DecodingConfig.from_dict(knobs)
    assert str(err.value).startswith(message)


def test_config_round_trips_new_knobs():
    knobs = {"dry_multiplier": 0.8, "dry_sequence_breakers": ["\n"], "xtc_probability": 0.5, "mirostat": 2,
             "logit_bias": {"12": -5.0, "hello": 2.0}, "min_new_tokens": 4}
    cfg = DecodingConfig.from_dict(knobs)
    assert DecodingConfig.from_dict(cfg.to_dict()) == cfg
    assert {k: v for k, v in cfg.to_dict(sparse=True).items() if k in knobs} == knobs


# --- state across steps: seeded runs and branches ------------------------------------------------
STATEFUL = {"strategy": "sample", "seed": 4, "max_new_tokens": 14, "xtc_threshold": 0.05, "xtc_probability": 0.5,
            "mirostat": 2, "mirostat_tau": 3.0, "temperature": 1.5}


def _params(step, name):
    return next(s.params for s in step.stages if s.name == name)


def test_seeded_xtc_mirostat_run_is_reproducible(tiny_lm):
    cfg = DecodingConfig.from_dict(STATEFUL)
    prompt = tiny_lm.encode("Once upon a time", False)
    first = list(decode.stream(tiny_lm, prompt, cfg))
    second = list(decode.stream(tiny_lm, prompt, cfg))
    assert [s.chosen_token_id for s in first] == [s.chosen_token_id for s in second]
    assert [_params(s, "mirostat") for s in first] == [_params(s, "mirostat") for s in second]
    assert [_params(s, "xtc")["u"] for s in first] == [_params(s, "xtc")["u"] for s in second]
    mus = [_params(s, "mirostat") for s in first]
    assert mus[0]["mu"] == 6.0 and all(a["mu_after"] == b["mu"] for a, b in zip(mus, mus[1:]))
    assert any(_params(s, "xtc")["fired"] for s in first) and not all(_params(s, "xtc")["fired"] for s in first)
    other = list(decode.stream(tiny_lm, prompt, cfg.replace(seed=5)))
    assert [_params(s, "xtc")["u"] for s in other] != [_params(s, "xtc")["u"] for s in first]


@pytest.mark.parametrize("at", [1, 6, 13])
def test_branch_resumes_mu_and_draws_exactly(tiny_lm, at):
    cfg = DecodingConfig.from_dict(STATEFUL)
    prompt = tiny_lm.encode("Once upon a time", False)
    parent = list(decode.stream(tiny_lm, prompt, cfg))
    tokens = [s.chosen_token_id for s in parent]
    # forcing the parent's own token at `at` must continue exactly as the parent did
    branch = list(decode.stream(tiny_lm, prompt, cfg, prefix=tokens[:at], force=tokens[at]))
    assert [s.chosen_token_id for s in branch] == tokens[at:]
    for mine, theirs in zip(branch, parent[at:]):
        assert _params(mine, "mirostat")["kept"] == _params(theirs, "mirostat")["kept"]
        # μ agrees to float32 rounding: the replay reads the prefix logits from one batched forward,
        # the parent from one forward per token (the kernels round differently in the last bits)
        assert _params(mine, "mirostat")["mu"] == pytest.approx(_params(theirs, "mirostat")["mu"], rel=1e-6)
        assert _params(mine, "xtc")["u"] == _params(theirs, "xtc")["u"]
    assert [s.draw for s in branch[1:]] == pytest.approx([s.draw for s in parent[at + 1:]], abs=1e-6)


# --- presets -------------------------------------------------------------------------------------
NEW_PRESETS = {"dry-vs-repetition-penalty": "dry", "xtc-creative": "xtc", "min-p-plus-smoothing": "smoothing",
               "mirostat-2": "mirostat", "llama-cpp-defaults": "top_k", "textgen-webui-creative": "xtc"}


@pytest.mark.parametrize("stem", NEW_PRESETS)
def test_new_preset_runs_and_shows_its_stage(tiny_lm, stem):
    from engine import runner
    from engine.runner import RunRequest
    from engine.presets import builtin_presets

    config = builtin_presets()[stem].config.replace(max_new_tokens=3)
    trace = runner.run(RunRequest(tiny_lm, "The cat sat on the", config))
    assert 1 <= len(trace.steps) <= 3
    assert NEW_PRESETS[stem] in [s.name for s in trace.steps[0].stages]


def test_llama_cpp_defaults_reproduce_its_chain_and_export():
    from engine.interop import to_llama_cpp
    from engine.presets import builtin_presets

    preset = builtin_presets()["llama-cpp-defaults"]
    assert preset.config.active_stages() == ("top_k", "top_p", "min_p", "temperature")  # temperature last
    assert to_llama_cpp(preset).text.startswith('--samplers "top_k;top_p;min_p;temperature" --top-k 40 --top-p 0.95 '
                                                "--min-p 0.05 --temp 0.8")
    creative = builtin_presets()["textgen-webui-creative"].config
    assert (creative.min_p, creative.xtc_probability, creative.xtc_threshold, creative.temperature) == (0.02, 0.5, 0.1, 1.0)
