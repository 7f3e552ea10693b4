"""A served model's step on its top-N (issue #38): ``RunState.advance(logits, support)`` (the logits
[1, V] with -inf outside the ids, or [1, N] at them, as step mode gives them) records and picks
on the N ids only (``chain.traced_rows``' supports, ``core.pick_rows``, ``sampling.sample_at``), and
gives the StepTrace the same row gets over the whole vocabulary: the same tokens, draws, kept counts,
top lists and removed tokens, every float within rounding (the order of a sum), for every stage family,
greedy and sampled, forced, with nothing left, and for a stage that breaks the support's promise."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from engine.chain import Chain, traced_rows
from engine.config import DecodingConfig
from engine.core import RunState
from engine.sampling import NoTokensLeft
from engine.stages.base import Stage

V = 49152
PROMPT = [1, 504, 3458, 282, 4649, 314]  # ids of a short prompt ("The capital of France is"-like)

CONFIGS = {
    "sampling": DecodingConfig(strategy="sample", seed=3, max_new_tokens=24),
    "greedy": DecodingConfig(strategy="greedy", max_new_tokens=24),
    "temperature-top-k-top-p": DecodingConfig(strategy="sample", seed=4, temperature=0.8, top_k=20, top_p=0.9,
                                              max_new_tokens=24),
    "min-p-typical": DecodingConfig(strategy="sample", seed=5, min_p=0.05, typical_p=0.9, max_new_tokens=24),
    "penalties": DecodingConfig(strategy="sample", seed=6, repetition_penalty=1.3, frequency_penalty=0.5,
                                presence_penalty=0.3, no_repeat_ngram_size=2, max_new_tokens=24),
    "dry-top-n-sigma-top-a": DecodingConfig(strategy="sample", seed=7, dry_multiplier=0.8, top_n_sigma=2.0,
                                            top_a=0.1, max_new_tokens=24),
    "epsilon-eta-top-h-smoothing": DecodingConfig(strategy="sample", seed=8, epsilon_cutoff=3e-4, eta_cutoff=3e-4,
                                                  top_h=0.9, smoothing_factor=0.3, max_new_tokens=24),
    "dynamic-temperature": DecodingConfig(strategy="sample", seed=9, dynatemp_range=0.5, max_new_tokens=24),
    "xtc": DecodingConfig(strategy="sample", seed=10, xtc_threshold=0.05, xtc_probability=0.5, max_new_tokens=24),
    "mirostat": DecodingConfig(strategy="sample", seed=11, mirostat=2, mirostat_tau=3.0, mirostat_eta=0.1,
                               max_new_tokens=24),
    "logit-bias-banned": DecodingConfig(strategy="sample", seed=12, logit_bias={"13": 4.0, "7": -2.0},
                                        banned_words=("the",), max_new_tokens=24),
}


def step_row(step: int, n: int = 100, ties: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A step as step mode builds it (``served.entries_logits``): a top-``n`` of log-probabilities, -inf
    elsewhere; and its support (the ids, ascending)."""
    g = torch.Generator().manual_seed(1000 + step)
    full = torch.randn(V, generator=g) * 3
    full[torch.tensor([13, 7, 262, 260])] += 6.0  # some low ids inside the top-N (the bias above reaches them)
    ids = torch.topk(full, n).indices
    logits = torch.full((1, V), -math.inf)
    logits[0, ids] = torch.log_softmax(full, -1)[ids]
    if ties:  # two ids tied at the top: the lower one wins a greedy step
        top = logits[0, ids].max()
        logits[0, ids[5]] = logits[0, ids[9]] = top + 1.0
    return logits, torch.sort(ids).values


def close(a, b, where: str, tol: float = 1e-6) -> None:
    """Two records' values: equal, floats within ``tol`` (NaN equals NaN)."""
    if isinstance(a, float) or isinstance(b, float):
        assert (math.isnan(a) and math.isnan(b)) or abs(a - b) <= tol, (where, a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), (where, a.keys(), b.keys())
        for k in a:
            close(a[k], b[k], f"{where}.{k}", tol)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), (where, len(a), len(b))
        for i, (x, y) in enumerate(zip(a, b)):
            close(x, y, f"{where}[{i}]", tol)
    else:
        assert a == b, (where, a, b)


def same_step(a, b, where: str) -> None:
    untimed = {"elapsed_ms": 0.0}
    close(dataclasses.asdict(a) | untimed, dataclasses.asdict(b) | untimed, where)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_run_on_its_support_is_the_run_over_the_vocabulary(tiny_lm, name):
    """24 steps of each stage family: stepped on the top-100's ids (given [1, V] or [1, 100]), every
    StepTrace (token, p, raw p, draw and interval, every stage's kept count, removed mass, entropy, TV
    distance, top list, removed tokens and state) is the one stepped over [1, V], the floats within
    1e-6; the two ways of giving the support give the same steps bit for bit."""
    config = CONFIGS[name]
    on, given, over = (RunState(tiny_lm, PROMPT, config) for _ in range(3))
    for step in range(config.max_new_tokens):
        logits, support = step_row(step)
        a, c, b = on.advance(logits, support), given.advance(logits[:, support], support), over.advance(logits)
        same_step(a, b, f"{name} step {step}")
        assert repr(dataclasses.replace(a, elapsed_ms=0.0)) == repr(dataclasses.replace(c, elapsed_ms=0.0))
        assert a.finish_reason == b.finish_reason
        if a.finish_reason is not None:
            break
    assert on.generated == over.generated == given.generated
    if on.generator is not None:
        assert torch.equal(on.generator.get_state(), over.generator.get_state())
        assert torch.equal(given.generator.get_state(), over.generator.get_state())


def test_the_records_are_made_on_the_support_and_read_back_over_the_vocabulary(tiny_lm):
    """``traced_rows`` with a support keeps the probabilities on it ([n]) and gives them over [V] on
    request (``raw_probs``, ``final_probs``, ``stage_probs``, ``prob``), equal to the [V] path's."""
    config = CONFIGS["temperature-top-k-top-p"]
    logits, support = step_row(0)
    ids = torch.tensor([PROMPT])
    chains = [Chain.from_config(config, len(PROMPT), tiny_lm.tokenizer, (2,)) for _ in range(2)]
    on, = traced_rows([chains[0]], [ids], logits, [10], tiny_lm.token_text, [support])
    over, = traced_rows([chains[1]], [ids], logits, [10], tiny_lm.token_text)
    assert torch.equal(on.support, support) and on.raw.shape == on.final.shape == (100,) and over.support is None
    plain = Chain.from_config(CONFIGS["sampling"], len(PROMPT), tiny_lm.tokenizer, (2,))
    given, = traced_rows([plain], [ids], [logits[:, support]], [10], tiny_lm.token_text, [support], V)
    assert given.logits.shape == (1, 100) and given.final_probs.shape == (V,) and given.vocab_size == V
    assert torch.equal(given.final_logits(), logits[:, support])  # no stage ran: never spread over [1, V]
    assert torch.allclose(on.raw_probs, over.raw_probs, atol=1e-7, rtol=0)
    assert torch.allclose(on.final_probs, over.final_probs, atol=1e-7, rtol=0)
    assert len(on.stage_probs) == len(over.stage_probs) == len(config.active_stages()) == 3
    for x, y in zip(on.stage_probs, over.stage_probs):
        assert torch.allclose(x, y, atol=1e-7, rtol=0)
    for token in (int(support[0]), int(support[-1]), 0 if 0 not in support.tolist() else 5):
        assert on.prob(on.final, token) == pytest.approx(over.prob(over.final, token), abs=1e-7)
    close([dataclasses.asdict(s) for s in on.stages], [dataclasses.asdict(s) for s in over.stages], "records")


class Unmask(Stage):
    """A stage that breaks the promise: token ``token`` (outside the support) gets logit 0."""

    name = "unmask"

    def __init__(self, token: int):
        super().__init__(token=token)
        self.token = token

    def apply(self, input_ids, logits):
        out = logits.clone()
        out[:, self.token] = 0.0
        return out, {}


class MaskAll(Stage):
    name = "mask_all"

    def apply(self, input_ids, logits):
        return torch.full_like(logits, -math.inf), {}


def test_a_stage_that_unmasks_a_token_outside_moves_the_row_to_the_vocabulary(tiny_lm):
    """A stage that makes a token outside the support finite: the row's records from that stage on are
    made over [V] (its earlier ones spread), the Traced has no support, and every record and p equals
    the [V] path's, the unmasked token included."""
    logits, support = step_row(1)
    outside = next(t for t in range(V) if t not in set(support.tolist()))
    config = CONFIGS["temperature-top-k-top-p"]
    ids = torch.tensor([PROMPT])

    def chain() -> Chain:
        built = Chain.from_config(config, len(PROMPT), tiny_lm.tokenizer, (2,))
        return Chain([built.stages[0], Unmask(outside), *built.stages[1:]])

    on, = traced_rows([chain()], [ids], logits, [10], tiny_lm.token_text, [support])
    over, = traced_rows([chain()], [ids], logits, [10], tiny_lm.token_text)
    given, = traced_rows([chain()], [ids], [logits[:, support]], [10], tiny_lm.token_text, [support], V)
    assert on.support is None and on.raw.shape == (V,) and given.support is None and given.raw.shape == (V,)
    close([dataclasses.asdict(s) for s in given.stages], [dataclasses.asdict(s) for s in on.stages], "given")
    close([dataclasses.asdict(s) for s in on.stages], [dataclasses.asdict(s) for s in over.stages], "records")
    assert torch.allclose(on.final, over.final, atol=1e-7, rtol=0) and float(on.final[outside]) > 0
    for x, y in zip(on.stage_probs, over.stage_probs):
        assert torch.allclose(x, y, atol=1e-7, rtol=0)


def test_a_row_with_nothing_left_forced_and_tied_steps_on_the_support(tiny_lm):
    """Nothing left (every logit masked): NoTokensLeft either way. A forced token inside or outside the
    support: its p, and the generator skips one step's draws either way. A tie at the top of a greedy
    step: the lower id, as argmax over V."""
    logits, support = step_row(2)
    for config in (CONFIGS["sampling"], CONFIGS["greedy"]):
        on, over = RunState(tiny_lm, PROMPT, config), RunState(tiny_lm, PROMPT, config)
        on.chain, over.chain = Chain([MaskAll()]), Chain([MaskAll()])
        with pytest.raises(NoTokensLeft):
            on.advance(logits, support)
        given = RunState(tiny_lm, PROMPT, config)
        given.chain = Chain([MaskAll()])
        with pytest.raises(NoTokensLeft):
            given.advance(logits[:, support], support)
        with pytest.raises(NoTokensLeft):
            over.advance(logits)
    outside = next(t for t in range(V) if t not in set(support.tolist()))
    for token in (int(support[3]), outside):
        config = CONFIGS["sampling"]
        on, over = RunState(tiny_lm, PROMPT, config, force=token), RunState(tiny_lm, PROMPT, config, force=token)
        given = RunState(tiny_lm, PROMPT, config, force=token)
        a, b, c = on.advance(logits, support), over.advance(logits), given.advance(logits[:, support], support)
        same_step(a, b, f"forced {token}")
        same_step(c, b, f"forced {token}, given on the support")
        assert a.chosen_token_id == token and a.forced and (a.chosen_prob == 0.0) == (token == outside)
        assert torch.equal(on.generator.get_state(), over.generator.get_state())
        logits2, support2 = step_row(3)
        same_step(on.advance(logits2, support2), over.advance(logits2), "after the forced step")
    tied, support = step_row(4, ties=True)
    on, over = RunState(tiny_lm, PROMPT, CONFIGS["greedy"]), RunState(tiny_lm, PROMPT, CONFIGS["greedy"])
    a, b = on.advance(tied, support), over.advance(tied)
    same_step(a, b, "tie")
    same_step(RunState(tiny_lm, PROMPT, CONFIGS["greedy"]).advance(tied[:, support], support), b, "tie, given")
    first = min(int(i) for i in support if tied[0, i] == tied.max())
    assert a.chosen_token_id == first


def test_a_row_given_on_its_support_needs_the_vocabulary_size(tiny_lm):
    """[1, n] values without V: a ValueError naming vocab_size, not records spread over n."""
    logits, support = step_row(5)
    plain = Chain.from_config(CONFIGS["sampling"], len(PROMPT), tiny_lm.tokenizer, (2,))
    with pytest.raises(ValueError, match="vocab_size: needed for a row given on its support"):
        traced_rows([plain], [torch.tensor([PROMPT])], [logits[:, support]], [10], tiny_lm.token_text, [support])
