"""Inside the model (issue #54), each part against its oracle: the logit lens's last layer is the
step's raw distribution; a token's rank is an uncached recompute's; the calibration error is
recomputed by hand; entropy and varentropy are their direct formulas."""

import math
from types import SimpleNamespace

import pytest
import torch

from engine import runner
from engine.base.seam import served_capabilities
from engine.chain import Chain, entropy_varentropy_rows
from engine.config import ConfigError, DecodingConfig
from engine.reports import calibration as cal
from engine.reports import lens, ranks, uncertainty
from engine.trace import StageTrace, StepTrace, Trace
from tests.helpers.inside import hand_calibration  # noqa: F401

PROMPT = "The capital of France is"


def greedy(lm, tokens: int = 6) -> Trace:
    return runner.run(runner.RunRequest(lm, PROMPT, DecodingConfig(strategy="greedy", max_new_tokens=tokens)))


def served_model() -> SimpleNamespace:
    return SimpleNamespace(capabilities=served_capabilities(100), name="llamacpp:x")


# --- 1. the logit lens -----------------------------------------------------------------------------
def check_lens_against_its_oracles(lm, trace: Trace, step: int) -> lens.LogitLens:
    found = lens.trace_lens(lm, trace, step, top_k=5)
    layers = lm.model.config.num_hidden_layers
    assert [x.layer for x in found.layers] == list(range(layers + 1))
    # the last read-out is the model's logits, bit for bit, and the trace's raw stage
    assert found.last_matches_logits
    assert found.raw_max_diff is not None and found.raw_max_diff < 1e-5
    raw = trace.steps[step].stages[0]
    assert [t.token_id for t in found.layers[-1].top] == [t.token_id for t in raw.top[:5]]
    assert found.layers[-1].chosen_rank == 1 and found.chosen_token_id == trace.generated_token_ids[step]
    # an earlier layer by hand: the final norm and the head on that layer's hidden state
    prefix = trace.prompt_token_ids + trace.generated_token_ids[:step]
    with torch.inference_mode():
        out = lm.model(input_ids=torch.tensor([prefix]), output_hidden_states=True, use_cache=False)
        norm, head = lens.final_norm(lm.model), lm.model.get_output_embeddings()
        probs = torch.softmax(head(norm(out.hidden_states[1][0, -1])).float(), -1)
        # transformers' hidden_states[-1] is already normed: the head alone gives the logits; the norm once more
        # does not (the lens reads the last layer before the norm, and its read-out is the logits exactly)
        last = out.hidden_states[-1][:, -1:]
        assert torch.allclose(head(last)[0, 0], out.logits[0, -1], atol=1e-4)
        assert (head(norm(last))[0, 0] - out.logits[0, -1]).abs().max() > 1e-4
    chosen = found.chosen_token_id
    assert found.layers[1].chosen_prob == pytest.approx(float(probs[chosen]), abs=1e-6)
    assert found.layers[1].chosen_rank == int((probs > probs[chosen]).sum()) + 1
    assert [t.token_id for t in found.layers[1].top] == torch.topk(probs, 5).indices.tolist()
    entropy = -(probs * probs.clamp(min=1e-45).log()).sum()
    assert found.layers[1].entropy == pytest.approx(float(entropy), abs=1e-4)
    assert "\n" not in found.sentence() and f"layer {layers}" in found.sentence() or found.first_in_top is None
    return found


def test_the_lens_last_layer_is_the_raw_distribution_on_a_tiny_model(tiny_lm):
    check_lens_against_its_oracles(tiny_lm, greedy(tiny_lm), step=3)


@pytest.mark.slow
def test_the_lens_last_layer_is_the_raw_distribution_on_the_embedded_model(embedded):
    trace = greedy(embedded, 3)
    found = check_lens_against_its_oracles(embedded, trace, step=0)
    assert found.layers[-1].top[0].token == " Paris" and found.first_top1 is not None


def test_the_lens_refuses_bad_input_in_one_line(tiny_lm):
    trace = greedy(tiny_lm, 3)
    with pytest.raises(ConfigError, match=r"^step: expected a step number in \[0, 2\], got 3$"):
        lens.trace_lens(tiny_lm, trace, 3)
    with pytest.raises(ConfigError, match="^top_k: "):
        lens.trace_lens(tiny_lm, trace, 0, top_k=0)
    with pytest.raises(ConfigError, match="^model: logit lens: not available for a served model"):
        lens.logit_lens(served_model(), [1, 2], [3], 0)


def test_first_entry_and_staying_in_the_top():
    assert lens._first_from([900, 4, 30, 2, 1], 10) == 3
    assert lens._first_from([900, 4, 30, 2, 11], 10) is None
    assert lens._first_from([1, 1], 1) == 0


# --- 3. every token's rank -------------------------------------------------------------------------
def uncached_ranks(lm, context: list[int], ids: list[int]) -> list[tuple[int | None, float | None]]:
    """The oracle: a forward of each prefix on its own, the last position's logits."""
    out = []
    with torch.inference_mode():
        for i, token in enumerate(ids):
            prefix = context + ids[:i]
            if not prefix:
                out.append((None, None))
                continue
            logits = lm.model(input_ids=torch.tensor([prefix]), use_cache=False).logits[0, -1].float()
            out.append((int((logits > logits[token]).sum()) + 1, float(torch.softmax(logits, -1)[token])))
    return out


@pytest.mark.parametrize("with_context", [True, False])
def test_ranks_equal_an_uncached_recompute(tiny_lm, with_context):
    context = tiny_lm.encode(PROMPT) if with_context else []
    ids = tiny_lm.encode(" Paris, and the river that runs through it is the Seine.")
    found = ranks.rank_ids(tiny_lm, context, ids)
    expected = uncached_ranks(tiny_lm, context, ids)
    assert [t.rank for t in found.tokens] == [r for r, _ in expected]
    for token, (_, p) in zip(found.tokens, expected):
        assert token.prob == pytest.approx(p, rel=1e-4, abs=1e-7) if p is not None else token.prob is None
        assert token.bucket == ranks.bucket(token.rank)
    assert sum(found.histogram.values()) == len(ids) - (0 if with_context else 1)
    assert list(found.histogram) == list(ranks.BUCKET_NAMES)
    assert "\n" not in found.sentence()


def test_rank_buckets_and_limits():
    assert [ranks.bucket(r) for r in (1, 10, 11, 100, 101, 1000, 1001, None)] == [
        "top-10", "top-10", "top-100", "top-100", "top-1000", "top-1000", "beyond", "no context"]
    with pytest.raises(ConfigError, match=r"^text: 513 tokens is over the 512-token limit$"):
        ranks.check_ids("text", [1] * 513)
    with pytest.raises(ConfigError, match="^text: empty"):
        ranks.check_ids("text", [])
    with pytest.raises(ConfigError, match="^model: token ranks: not available for a served model"):
        ranks.rank_ids(served_model(), [], [1, 2])


def test_ranking_stops_when_cancelled(tiny_lm):
    from engine.control import RunControl, RunStopped
    control = RunControl()
    control.cancel()
    with pytest.raises(RunStopped):
        ranks.rank_ids(tiny_lm, [1], [2, 3], control=control)


# --- 4. calibration ------------------------------------------------------------------------------
def test_ece_by_hand_on_four_positions():
    """Confidences 0.95 (right), 0.85 (wrong), 0.30 (right), 0.32 (wrong) in 10 bins: bins 9, 8, 3, 3;
    ECE = ¼|1 − 0.95| + ¼|0 − 0.85| + ½|0.5 − 0.31| = 0.0125 + 0.2125 + 0.095 = 0.32."""
    bins, ece = cal.reliability(torch.tensor([0.95, 0.85, 0.30, 0.32]), torch.tensor([True, False, True, False]), 10)
    assert ece == pytest.approx(0.32)
    assert [b.count for b in bins] == [0, 0, 0, 2, 0, 0, 0, 0, 1, 1]
    assert bins[3].confidence == pytest.approx(0.31) and bins[3].accuracy == 0.5 and bins[0].confidence is None
    assert cal.reliability(torch.tensor([1.0]), torch.tensor([True]), 4)[0][3].count == 1  # 1.0 is in the last bin


def test_calibration_recomputed_by_hand_on_a_tiny_model(tiny_lm):
    ids = tiny_lm.encode("Salt was once worth its weight in gold, and roads were built to carry it inland.")
    report = cal.calibration_report(tiny_lm, ids, bins=5, temperatures=(0.5, 2.0))
    logits, targets = cal.teacher_forced(tiny_lm, ids)
    for calibration in [report.at_one, report.at_best, *report.sweep]:
        ece, nll = hand_calibration(logits, targets, calibration.temperature, 5)
        assert calibration.ece == pytest.approx(ece, abs=1e-6) and calibration.nll == pytest.approx(nll, rel=1e-5)
        assert sum(b.count for b in calibration.bins) == report.tokens == len(ids) - 1
    # the best temperature beats a grid of its neighbours (the NLL is convex in 1/T)
    best = report.best_temperature
    assert cal.T_LOW <= best <= cal.T_HIGH
    for t in (best * 0.9, best * 1.1, 1.0, 0.5, 2.0):
        if cal.T_LOW <= t <= cal.T_HIGH:  # (the random model's best is near the top of the range)
            assert report.at_best.nll <= hand_calibration(logits, targets, t, 5)[1] + 1e-6
    assert report.at_best.accuracy == report.at_one.accuracy  # temperature never changes the top token
    assert "\n" not in report.sentence()


def test_the_best_temperature_undoes_a_known_sharpening():
    """Tokens drawn from softmax(z), the model saying 3z: the NLL's minimum is at T ≈ 3."""
    g = torch.Generator().manual_seed(5)
    z = torch.randn(4000, 20, generator=g)
    targets = torch.multinomial(torch.softmax(z, -1), 1, generator=g)[:, 0]
    best = cal.best_temperature(3 * z, targets)
    assert best == pytest.approx(3.0, rel=0.1)
    over = cal.calibration_at(3 * z, targets, 1.0)
    assert over.mean_confidence > over.accuracy and cal.calibration_at(3 * z, targets, best).ece < over.ece / 3


@pytest.mark.slow
def test_calibration_of_the_embedded_model_on_the_held_out_text(embedded):
    report = cal.calibration_report(embedded)
    assert report.tokens > 500 and 0 <= report.at_best.ece <= report.at_one.ece + 0.02
    assert report.at_best.nll <= report.at_one.nll


def test_calibration_refuses_bad_input(tiny_lm):
    with pytest.raises(ConfigError, match=r"^bins: expected an integer in \[2, 50\], got 1$"):
        cal.calibration_report(tiny_lm, [1, 2, 3], bins=1)
    with pytest.raises(ConfigError, match="^model: calibration: not available for a served model"):
        cal.calibration_report(served_model(), [1, 2, 3])


# --- 5. entropy and varentropy -------------------------------------------------------------------
def test_entropy_and_varentropy_of_four_tokens_by_hand():
    """p = ½, ¼, ⅛, ⅛: surprisal ln2 · (1, 2, 3, 3), H = 1.75 ln2, V = ln²2 · (½·0.75² + ¼·0.25² + 2·⅛·1.25²)
    = 0.6875 ln²2."""
    p = torch.tensor([[0.5, 0.25, 0.125, 0.125]])
    h, v = entropy_varentropy_rows(p)
    ln2 = math.log(2)
    assert float(h[0]) == pytest.approx(1.75 * ln2, rel=1e-6) and float(v[0]) == pytest.approx(0.6875 * ln2 ** 2, rel=1e-5)
    assert uncertainty.entropy_varentropy(p[0]) == pytest.approx((1.75 * ln2, 0.6875 * ln2 ** 2))
    one_hot = torch.tensor([[0.0, 1.0, 0.0, 0.0]])
    assert entropy_varentropy_rows(one_hot)[1].tolist() == [0.0]


def test_every_stage_records_its_varentropy_as_the_direct_formula():
    logits = torch.randn(1, 300, generator=torch.Generator().manual_seed(4)) * 3
    config = DecodingConfig(strategy="sample", top_k=20, temperature=0.7)
    chain = Chain.from_config(config)
    traced = chain.traced(torch.tensor([[1, 2]]), logits, 5, str)
    distributions = [traced.raw, *traced.between, traced.final]
    for record, probs in zip(traced.stages, distributions):
        h, v = uncertainty.entropy_varentropy(probs)
        assert record.entropy == pytest.approx(h, abs=1e-5) and record.varentropy == pytest.approx(v, rel=1e-4)


def test_a_run_carries_varentropy_per_step_in_strict_json(tiny_lm):
    trace = greedy(tiny_lm, 4)
    for step in trace.steps:
        assert step.raw_varentropy == step.stages[0].varentropy and step.varentropy == step.stages[-1].varentropy
        assert step.raw_varentropy is not None and step.raw_varentropy >= 0
    again = Trace.from_json(trace.to_json())
    assert [s.raw_varentropy for s in again.steps] == [s.raw_varentropy for s in trace.steps]


def step(index: int, h: float, v: float | None) -> StepTrace:
    return StepTrace(index, index, f"t{index}", 0.5, 0.5, None, None, None, h, h,
                     [StageTrace("raw", 10, 0.0, h, 0.0, [], varentropy=v)])


def test_hesitation_steps_are_high_entropy_and_high_varentropy():
    steps = [step(0, 0.5, 1.0), step(1, 3.5, 7.0), step(2, 3.5, 2.0), step(3, 1.0, 8.0), step(4, 4.0, 6.0)]
    series = uncertainty.uncertainty_series(steps)
    assert series.hesitations == [1, 4]
    assert [s.quadrant for s in series.steps] == ["confident", "hesitating", "evenly unsure",
                                                  "a few strong candidates", "hesitating"]
    assert "2 of 5 steps hesitate" in series.sentence()
    older = uncertainty.uncertainty_series([step(0, 3.5, None)])
    assert not older.recorded and older.hesitations == [] and "no varentropy" in older.sentence()
    with pytest.raises(ConfigError, match="^entropy_threshold: "):
        uncertainty.uncertainty_series(steps, entropy_threshold=-1)
