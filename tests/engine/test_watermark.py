"""The green-list watermark (issue #54) against its oracle, transformers' WatermarkLogitsProcessor and
WatermarkDetector: the same green lists, the same biased logits and the same z-scores on the same
ids, on the embedded model's vocabulary (49,152), for both seeding schemes and several context
widths; then the detector's own numbers by hand and what washes the watermark out."""

import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.generation import WatermarkDetector
from transformers.generation.logits_process import WatermarkLogitsProcessor

from engine import runner
from engine.config import ConfigError, DecodingConfig
from engine.reports import watermark as wm
from engine.stages import Watermark, green_ids

V = 49152  # the embedded model's vocabulary
KEY = 15485863
SCHEMES = [("lefthash", 1), ("lefthash", 3), ("selfhash", 1), ("selfhash", 4)]


def processor(gamma: float, scheme: str, width: int, delta: float = 2.0, key: int = KEY) -> WatermarkLogitsProcessor:
    return WatermarkLogitsProcessor(vocab_size=V, device="cpu", greenlist_ratio=gamma, bias=delta, hashing_key=key,
                                    seeding_scheme=scheme, context_width=width)


@pytest.mark.parametrize("scheme,width", SCHEMES)
@pytest.mark.parametrize("gamma", [0.25, 0.5])
def test_green_lists_and_biased_logits_equal_transformers(scheme, width, gamma):
    reference = processor(gamma, scheme, width)
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        context = torch.randint(0, V, (7,), generator=g)
        assert torch.equal(green_ids(context, V, gamma, scheme, KEY, width), reference._get_greenlist_ids(context))
    input_ids = torch.randint(0, V, (2, 9), generator=g)
    logits = torch.randn(2, V, generator=g) * 3
    before = logits.clone()
    ours = Watermark(2.0, gamma, scheme, KEY, width)(input_ids, logits)
    assert torch.equal(ours, reference(input_ids, logits.clone()))
    assert torch.equal(logits, before) and ours.data_ptr() != logits.data_ptr()  # pure: a new tensor
    raised = (ours - logits != 0).sum(-1)
    if scheme == "lefthash":
        assert raised.tolist() == [int(V * gamma)] * 2
    else:  # only the 40 likeliest candidates can be raised, each green under its own seed
        assert 0 < int(raised.max()) <= 40


def test_a_prefix_shorter_than_the_context_is_left_alone():
    logits = torch.randn(1, V)
    assert torch.equal(Watermark(2.0, 0.25, "lefthash", KEY, 3)(torch.tensor([[5, 6]]), logits), logits)


def watermarked_ids(lm, scheme: str, width: int, delta: float = 4.0, tokens: int = 40, seed: int = 0) -> list[int]:
    config = DecodingConfig(strategy="sample", seed=seed, max_new_tokens=tokens, watermark_delta=delta,
                            watermark_seeding=scheme, watermark_context=width)
    return runner.run(runner.RunRequest(lm, "Once upon a time", config)).generated_token_ids


@pytest.mark.parametrize("scheme,width", SCHEMES)
@pytest.mark.parametrize("ignore_repeated", [False, True])
def test_detector_equals_transformers(tiny_lm, scheme, width, ignore_repeated):
    """Our detector and transformers' on a watermarked run of the tiny model and on plain random ids:
    the same counts and z (the BOS id of the config never starts these ids, so none is dropped)."""
    config = {"greenlist_ratio": 0.25, "bias": 4.0, "hashing_key": KEY, "seeding_scheme": scheme, "context_width": width}
    reference = WatermarkDetector(LlamaConfig(vocab_size=V, bos_token_id=V - 1), "cpu", config,
                                  ignore_repeated_ngrams=ignore_repeated)
    random_ids = torch.randint(0, V - 1, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    for ids in (watermarked_ids(tiny_lm, scheme, width), random_ids, random_ids[:5] * 6):
        expected = reference(torch.tensor([ids]), z_threshold=4.0, return_dict=True)
        found = wm.detect(ids, V, wm.WatermarkKey(0.25, scheme, KEY, width), 4.0, ignore_repeated)
        assert found.scored == int(expected.num_tokens_scored[0])
        assert found.green == int(expected.num_green_tokens[0])
        assert found.z == pytest.approx(float(expected.z_score[0]), rel=1e-12)
        assert found.p_value == pytest.approx(float(expected.p_value[0]), rel=1e-9, abs=1e-300)
        assert found.detected == bool(expected.prediction[0])
        assert len(found.tokens) == len(ids) and sum(t.scored for t in found.tokens) == found.scored


def test_a_watermarked_run_is_detected_and_a_plain_one_is_not(tiny_lm):
    key = wm.WatermarkKey(0.25, "lefthash", KEY, 1)
    marked = wm.detect(watermarked_ids(tiny_lm, "lefthash", 1, delta=6.0, tokens=60), V, key)
    plain = wm.detect(watermarked_ids(tiny_lm, "lefthash", 1, delta=0.0, tokens=60), V, key)
    assert marked.detected and marked.z > 4 and marked.first_detected_at is not None
    assert not plain.detected and plain.z < 4
    assert marked.z_series[-1] == pytest.approx(marked.z)
    assert "green" in marked.sentence() and "\n" not in marked.sentence()


def test_z_p_and_tokens_needed_by_hand():
    # 30 of 40 green at γ 0.25: z = (30 − 10) / √(40 · 0.25 · 0.75) = 20 / √7.5
    assert wm.z_score(30, 40, 0.25) == pytest.approx(20 / math.sqrt(7.5))
    # at a green share of 0.5 (γ 0.25), z = 0.25 √T / √0.1875 > 4 needs T > 16 · 0.1875 / 0.0625 = 48
    assert wm.tokens_needed(0.5, 0.25, 4.0) == 49
    assert wm.z_score(int(0.5 * 49), 49, 0.25) < 4 < wm.z_score(25, 49, 0.25)
    assert wm.tokens_needed(0.25, 0.25, 4.0) is None and wm.tokens_needed(0.1, 0.25, 4.0) is None


def test_bad_input_is_one_line_naming_the_argument():
    with pytest.raises(ConfigError, match=r"^watermark_gamma: 1\.5 is out of range; allowed \(0, 0\.99\]$"):
        wm.WatermarkKey(gamma=1.5)
    with pytest.raises(ConfigError, match="^watermark_gamma: "):
        DecodingConfig(watermark_gamma=0.0)
    with pytest.raises(ConfigError, match="^watermark_seeding: "):
        wm.WatermarkKey(seeding="minhash")
    with pytest.raises(ConfigError, match="^z_threshold: "):
        wm.detect([1, 2, 3], V, threshold=float("nan"))
    with pytest.raises(ConfigError, match="^ids: "):
        wm.detect([1, V], V)
    with pytest.raises(ConfigError, match="^text: 5,000 tokens is over"):
        wm.detect([1] * 5000, V)


def test_spike_entropy_by_hand():
    """S = Σ p / (1 + ζp), ζ = (1 − γ)(e^δ − 1) / (1 + (e^δ − 1)γ): 1 / (1 + ζ) for a one-hot row, and
    for a uniform row over n tokens n · (1/n) / (1 + ζ/n)."""
    gamma, delta = 0.25, 2.0
    zeta = 0.75 * (math.e ** 2 - 1) / (1 + (math.e ** 2 - 1) * 0.25)
    rows = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    assert wm.spike_entropy(rows, gamma, delta).tolist() == pytest.approx([1 / (1 + zeta), 1 / (1 + zeta / 4)])
    alpha = math.e ** 2
    assert wm.green_bound(1.0, gamma, delta) == pytest.approx(gamma * alpha / (1 + (alpha - 1) * gamma))


def test_what_washes_it_out_is_measured(tiny_lm):
    """Every case is detected with the run's own key; replacing half the tokens lowers z, and the
    report says so in one sentence from its own rows."""
    config = DecodingConfig(strategy="sample", seed=2, max_new_tokens=48, watermark_delta=6.0)
    prompt_ids = tiny_lm.encode("Once upon a time")

    def run(cfg):
        return runner.run(runner.RunRequest(tiny_lm, "Once upon a time", cfg, prompt_ids=prompt_ids))

    report = wm.robustness(tiny_lm, prompt_ids, config, run, edited_text="Once there was a cat who sat.")
    cases = [r.case for r in report.rows]
    assert cases[:2] == ["as configured", "no watermark (δ 0)"]
    assert {"top-k 5 before the watermark", "top-k 5 after the watermark", "the hand-edited text"} <= set(cases)
    rows = {r.case: r for r in report.rows}
    assert rows["as configured"].z > rows["no watermark (δ 0)"].z
    assert rows["50% of tokens replaced"].z < rows["as configured"].z
    assert report.spike is not None and 0 < report.spike.median_spike <= 1
    assert "\n" not in report.sentence()
    with pytest.raises(ConfigError, match="^watermark_delta: "):
        wm.robustness(tiny_lm, prompt_ids, config.replace(watermark_delta=0.0), run)
