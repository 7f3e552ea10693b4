"""Issue #36: a strategy is its module: its ``stream(ctx)`` and ONE ``StrategySpec``. The recipe in
docs/architecture.md ("Add a strategy") is this test's toy: registered, it reaches the config (its
knob, its range, its cross-check), the runner, the trace's round trip (its typed records), the
exports (what the other tools say of it), the strategy pickers, and what a served model is told."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterator

import pytest
import torch

from engine import runner
from engine.base.seam import served_capabilities
from engine.config import CONFIG_KEYS, KNOBS, STRATEGIES, ConfigError, DecodingConfig, Knob
from engine.core import RunContext, StopCheck, assemble, checked, check_prompt, step_trace
from engine.chain import Chain
from engine.interop import to_llama_cpp, to_textgen_webui
from engine.presets import Preset
from engine.runner import RunRequest
from engine.sampling import Pick
from engine.base import strategy_spec
from engine.base.strategy_spec import Exported, StrategySpec, register, unregister
from engine.trace import Event, Trace


# --- the recipe's toy: always the rank-th most probable raw token -----------------------------------------
@dataclass
class RankPick:
    """What the toy records per step: the rank it took and the token there."""

    rank: int
    token: int


def rank_stream(ctx: RunContext) -> Iterator[Event]:
    lm, config = ctx.lm, ctx.config
    check_prompt(ctx.ids)
    ids = torch.tensor([ctx.ids], dtype=torch.long, device=lm.device)  # [1, S]
    stop, steps, records = StopCheck(lm, config), [], []
    while True:
        logits = lm.model(ids).logits[:, -1, :].float()  # [1, V]: the uncached recompute (a toy)
        traced = Chain([]).traced(ids, logits, config.top_n, lm.token_text)
        token = int(torch.argsort(traced.final_probs, descending=True)[config.toy_rank - 1])
        step = step_trace(lm, traced, Pick(token, float(traced.final_probs[token])), len(steps), 0.0)
        generated = [s.chosen_token_id for s in steps] + [token]
        step = dataclasses.replace(step, finish_reason=stop.reason(generated))
        steps.append(step)
        records.append(RankPick(config.toy_rank, token))
        yield Event(steps=[step], record=records[-1])
        if step.finish_reason is not None:
            break
        ids = torch.cat([ids, torch.tensor([[token]], device=lm.device)], dim=1)
    trace = assemble(lm, ctx.prompt, ctx.ids, config, steps, ctx.chat)
    trace.extra["toy_rank"] = records
    yield Event(trace=trace)


def check_rank(config: DecodingConfig) -> None:
    if config.toy_rank > config.top_n:
        raise ConfigError("toy_rank", f"{config.toy_rank} is past top_n={config.top_n}: the trace would not show it")


TOY = StrategySpec(
    "toy_rank", lambda ctx: checked(rank_stream(ctx), ctx.control),
    knobs=(Knob("toy_rank", "int", 2, 1, 5, doc="Toy: take the rank-th most probable token.", step=1),),
    in_use=("toy_rank",), check=check_rank, records={"toy_rank": list[RankPick]}, exported_as="greedy",
    exports={tool: Exported("{tool} cannot take the rank-th token; exported as greedy decoding", "a toy setting")
             for tool in ("webui", "llama")},
    doc="Always the rank-th most probable token (the docs' example strategy).")


@pytest.fixture
def toy():
    register(TOY)
    try:
        yield TOY
    finally:
        unregister(TOY.name)


# --- it reaches every reader ---------------------------------------------------------------------------
def test_the_toy_reaches_the_config(toy):
    assert "toy_rank" in STRATEGIES and "toy_rank" in KNOBS and KNOBS["toy_rank"].strategy == "toy_rank"
    from engine import config as engine_config
    assert "toy_rank" in engine_config.CONFIG_KEYS and "toy_rank" not in CONFIG_KEYS  # a snapshot from before
    config = DecodingConfig.from_dict({"strategy": "toy_rank", "toy_rank": 3})
    assert config.toy_rank == 3 and config.to_dict(sparse=True) == {"strategy": "toy_rank", "toy_rank": 3}
    with pytest.raises(ConfigError, match=r"^toy_rank: 9 is out of range; allowed \[1, 5\]$"):
        DecodingConfig(strategy="toy_rank", toy_rank=9)
    with pytest.raises(ConfigError, match=r"^toy_rank: 4 is past top_n=3"):
        DecodingConfig(strategy="toy_rank", toy_rank=4, top_n=3)
    DecodingConfig(strategy="greedy", toy_rank=4, top_n=3)  # its cross-check runs under its own strategy only


def test_the_toy_runs_through_the_runner_as_its_definition_says(toy, tiny_lm):
    config = DecodingConfig(strategy="toy_rank", toy_rank=2, max_new_tokens=5)
    events = list(runner.stream(RunRequest(tiny_lm, "Once upon", config)))
    trace = events[-1].trace
    assert [e.record.token for e in events[:-1]] == trace.generated_token_ids and len(trace.steps) == 5
    ids = tiny_lm.encode("Once upon")
    with torch.no_grad():
        for token in trace.generated_token_ids:  # the oracle: the model's second most probable token, recomputed
            logits = tiny_lm.model(torch.tensor([ids])).logits[0, -1]
            assert token == int(torch.topk(logits, 2).indices[1])
            ids.append(token)


def test_the_toy_s_records_round_trip(toy, tiny_lm):
    trace = runner.run(RunRequest(tiny_lm, "Once upon", DecodingConfig(strategy="toy_rank", max_new_tokens=3)))
    again = Trace.from_json(trace.to_json())
    assert all(isinstance(r, RankPick) for r in again.extra["toy_rank"])
    assert again.extra["toy_rank"] == trace.extra["toy_rank"] and again.to_json() == trace.to_json()


def test_the_toy_reaches_the_exports(toy):
    preset = Preset("toy", "the docs' toy", DecodingConfig(strategy="toy_rank", toy_rank=3))
    for export in (to_llama_cpp(preset), to_textgen_webui(preset)):
        notes = {n.key: n.reason for n in export.unmapped}
        assert notes["strategy"] == f"{export.target} cannot take the rank-th token; exported as greedy decoding"
        assert notes["toy_rank"] == "a toy setting"
    assert "top-k 1" in to_llama_cpp(preset).text or "--top-k 1" in to_llama_cpp(preset).text


def test_the_toy_reaches_the_pickers_and_a_served_model_is_told_why_not(toy):
    from playground.views.compare.layout import strategy_choices

    assert "toy_rank" in strategy_choices()
    assert TOY.unavailable(served_capabilities(100)) == \
        "toy_rank: not available for a served model (has no implementation over a served model's API yet)"
    assert STRATEGIES["contrastive_search"].unavailable(served_capabilities(100)) == \
        "contrastive_search: not available for a served model (needs the model's hidden states)"
    assert STRATEGIES["greedy"].unavailable(served_capabilities(100)) is None


def test_a_spec_refuses_what_is_not_its_own():
    with pytest.raises(ValueError, match="needs 'gpu'"):
        StrategySpec("bad", rank_stream, needs=("gpu",))
    with pytest.raises(ValueError, match="in_use names 'x'"):
        StrategySpec("bad", rank_stream, in_use=("x",))
    with pytest.raises(ValueError, match="knob 'num_beams' belongs to strategy 'beam'"):
        register(StrategySpec("bad", rank_stream, knobs=(dataclasses.replace(KNOBS["num_beams"], strategy=None),)))
    assert "bad" not in strategy_spec.STRATEGIES
