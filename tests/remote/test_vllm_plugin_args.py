"""Issue #50: the draws processor (deploy/vllm_plugin/dp_draws.py, loaded into vLLM's engine core) reads
``vllm_xargs`` that anyone who reaches the server writes. Its parser (dp_args.draw_args) answers a checked
record or None for any JSON value, never an exception; the processor's ``update_state`` and ``apply``
never raise, whatever the batch; and a valid record picks exactly our engine's token. No vLLM here:
dp_draws loads against a stand-in of vLLM's logits-processor interface (its three names, as vLLM 0.32
declares them); the live tests are tests/remote/test_vllm_plugin_hostile.py's."""

from __future__ import annotations

import base64
import enum
import importlib.util
import json
import math
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Sequence

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from deploy.vllm_plugin import dp_args
from deploy.vllm_plugin.dp_args import MAX_STAGES, MAX_TOP, STAGE_BOUNDS, STATE_BYTES, DrawArgs, draw_args
from engine.strategies import served_decode
from engine.base.seam import served_capabilities
from engine.chain import Chain
from engine.config import ConfigError, DecodingConfig
from engine.sampling import sample_rows
from engine.stages import STAGES

PLUGIN = Path(__file__).resolve().parents[2] / "deploy" / "vllm_plugin"
STATE = base64.b64encode(torch.Generator().manual_seed(1).get_state().numpy().tobytes()).decode()
REPORTED = [{"dp_state": STATE, "dp_top": math.inf},  # the request's "dp_top": Infinity
            {"dp_state": STATE, "dp_top": json.loads("1e999")},  # a float past the largest: inf as well
            {"dp_state": STATE, "dp_chain": '[["top_k", Infinity]]'}]


def is_valid(args: DrawArgs) -> bool:
    """Every bound dp_args promises holds for ``args``."""
    state = args.generator.get_state()
    return (isinstance(args, DrawArgs) and state.dtype == torch.uint8 and state.numel() == STATE_BYTES
            and type(args.top) is int and 1 <= args.top <= MAX_TOP and isinstance(args.chain, tuple)
            and len(args.chain) <= MAX_STAGES and all(valid_stage(name, value) for name, value in args.chain))


def valid_stage(name: str, value: Any) -> bool:
    bounds = STAGE_BOUNDS[name]
    return type(value) is (int if bounds.integer else float) and math.isfinite(value) and bounds.holds(value)


# --- the parser, fuzzed ---------------------------------------------------------------------------
any_text = st.text(st.characters(exclude_categories=()), max_size=40)  # lone surrogates included
scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=-2**70, max_value=2**70)
           | st.sampled_from([10**400, -10**400, 2**63, 2**64 + 1]) | st.floats()
           | st.sampled_from([math.inf, -math.inf, math.nan, -0.0, 1e308, 5e-324]) | any_text)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(any_text, inner, max_size=4), max_leaves=20)
stage_names = st.sampled_from(sorted(STAGE_BOUNDS)) | any_text
numbers = (st.integers(-5, 100_005) | st.floats(-1, 6) | st.sampled_from([0, 1, 0.01, 5.0, 100_000, 100_001, 1.0, 0.0])
           | scalars)
pairs = st.lists(st.tuples(stage_names, numbers).map(list) | json_values, max_size=MAX_STAGES + 2)
# dp_chain as Python's json.dumps writes it: Infinity, NaN and 1e999-sized ints in the text
HOSTILE_CHAINS = ["[" * 5000 + "]" * 5000, "[" * 1000 + "]" * 1000, '[["top_k", 1e999]]', '[["top_p", NaN]]',
                  '[["temperature", -Infinity]]', '[["top_k", 1' + "0" * 2000 + "]]", '[["top_k", 50]] x', "\ud800"]
chain_texts = pairs.map(json.dumps) | json_values.map(json.dumps) | any_text | st.sampled_from(HOSTILE_CHAINS)
states = (st.just(STATE) | json_values
          | st.binary(min_size=STATE_BYTES, max_size=STATE_BYTES).map(lambda b: base64.b64encode(b).decode())
          | st.integers(0, len(STATE) - 1).map(lambda i: STATE[:i] + "!" + STATE[i + 1:]))
tops = json_values | st.integers(-3, MAX_TOP + 3) | st.sampled_from(["100", "0100", "１００", "²", " 100", "1e2", "", "9999"])
fields = {"dp_state": states, "dp_top": tops, "dp_chain": chain_texts | json_values, "other": json_values}
extras = st.fixed_dictionaries({}, optional=fields) | json_values


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(extras)
@example(REPORTED[0]).via("issue #50: dp_top Infinity")
@example(REPORTED[1]).via("issue #50: dp_top 1e999")
@example(REPORTED[2]).via("issue #50: a chain's top_k Infinity")
def test_any_json_for_any_field_gives_a_valid_record_or_none_never_an_exception(extra):
    args = draw_args(extra)
    assert args is None or is_valid(args)


@pytest.mark.parametrize("extra", REPORTED, ids=["top-infinity", "top-1e999", "chain-top-k-infinity"])
def test_the_reported_requests_are_refused(extra):
    assert draw_args(extra) is None


@pytest.mark.parametrize("name, inside, outside", [
    ("temperature", [0.01, 0.7, 1, 5.0], [0, 0.0099, 5.0001, -1, True]),
    ("top_k", [1, 50, 50.0, 100_000], [0, 100_001, 50.5, -1, True, 10**400]),
    ("top_p", [1e-9, 0.9, 1, 1.0], [0, 0.0, 1.0001, -0.0]),
    ("min_p", [0, 0.0, 0.05, 1.0], [-1e-9, 1.0001, False]),
    ("typical_p", [1e-9, 0.5, 0.999], [0, 1, 1.0, 1.5]),
])
def test_each_stage_s_bounds_by_hand(name, inside, outside):
    for value in inside:
        checked = dp_args.stage_value(name, value)
        assert checked == value and valid_stage(name, checked), (name, value)
    for value in outside + ["0.5", None, [1], math.nan, math.inf, -math.inf]:
        assert dp_args.stage_value(name, value) is None, (name, value)


def test_a_valid_request_s_fields_are_read_as_sent():
    chain = [["temperature", 0.8], ["top_k", 50], ["top_p", 0.9], ["min_p", 0.05], ["typical_p", 0.9]]
    args = draw_args({"dp_state": STATE, "dp_top": 100, "dp_chain": json.dumps(chain)})
    assert args.top == 100 and args.chain == tuple(map(tuple, chain))
    assert torch.equal(args.generator.get_state(), torch.Generator().manual_seed(1).get_state())
    bare = draw_args({"dp_state": STATE})
    assert (bare.top, bare.chain) == (100, ())  # the defaults: step mode's top 100, no stage
    assert [draw_args({"dp_state": STATE, "dp_top": top}).top for top in ("7", 7.0, 1000)] == [7, 7, 1000]
    assert draw_args({"dp_top": 5}) is None and draw_args(None) is None  # no state: not ours


def test_a_state_torch_refuses_is_refused():
    state = bytearray(base64.b64decode(STATE))
    state[8:12] = b"\xff" * 4  # mt19937's position ("left"), which torch checks: "Invalid mt19937 state"
    assert dp_args.parse_state(base64.b64encode(bytes(state)).decode()) is None
    assert dp_args.parse_state(STATE + "=") is None and dp_args.parse_state(STATE[:-4]) is None


# --- the bounds are the engine's --------------------------------------------------------------------
def knob(name: str):
    return next(k for k in STAGES[name].knobs if k.name == name)


@st.composite
def stage_values(draw):
    name = draw(st.sampled_from(served_decode.SERVER_DRAW_STAGES))
    k = knob(name)
    wide = st.integers(int(k.low) - 2, int(k.high) + 2) if k.kind == "int" else \
        st.floats(k.low - 0.5, k.high + 0.5) | st.sampled_from([k.low, k.high, k.floor or k.low, 0.0099, 1.0])
    return name, draw(wide)


@settings(max_examples=400, deadline=None)
@given(stage_values())
def test_every_value_the_engine_drafts_is_accepted_and_every_accepted_value_is_the_engine_s(case):
    """The oracle: engine.config (the knob's bounds) and engine.backends.served_decode.server_draws (the
    arguments a run sends). A run with the stage active sends it and the parser takes it as sent; a value
    the parser takes is one the engine accepts (as an active stage, or the stage's neutral value)."""
    name, value = case
    try:
        config = DecodingConfig(strategy="sample", seed=1, **{name: value})
    except ConfigError:
        config = None
    accepted = dp_args.stage_value(name, value)
    if config is not None and name in config.active_stages():
        model = SimpleNamespace(capabilities=served_capabilities(100, our_draws=True))
        sent = served_decode.server_draws(model, SimpleNamespace(config=config, generator=torch.Generator(), force=None), 100)
        assert sent is None or draw_args(sent).chain == ((name, getattr(config, name)),)  # None: greedy (T 0)
    if accepted is not None:
        assert config is not None and (name in config.active_stages() or value == knob(name).neutral)


# --- the processor, against a stand-in of vLLM's interface --------------------------------------------
class MoveDirectionality(enum.Enum):
    UNIDIRECTIONAL = enum.auto()
    SWAP = enum.auto()


@dataclass(frozen=True)
class BatchUpdate:
    batch_size: int
    removed: Sequence[int]
    added: Sequence[tuple[int, Any, Any, Any]]  # (index, SamplingParams, prompt ids, output ids)
    moved: Sequence[tuple[int, int, MoveDirectionality]]


@pytest.fixture(scope="module")
def dp_draws():
    """deploy/vllm_plugin/dp_draws.py loaded with vllm.v1.sample.logits_processor stood in for, and
    dp_args as the plugin imports it (beside it on the path)."""
    interface = types.ModuleType("vllm.v1.sample.logits_processor")
    interface.BatchUpdate, interface.MoveDirectionality = BatchUpdate, MoveDirectionality
    interface.LogitsProcessor = type("LogitsProcessor", (), {})
    stand_ins = {"vllm": types.ModuleType("vllm"), "vllm.v1": types.ModuleType("vllm.v1"),
                 "vllm.v1.sample": types.ModuleType("vllm.v1.sample"), "vllm.v1.sample.logits_processor": interface,
                 "dp_args": dp_args}
    with pytest.MonkeyPatch.context() as patch:
        for name, module in stand_ins.items():
            patch.setitem(sys.modules, name, module)
        spec = importlib.util.spec_from_file_location("dp_draws", PLUGIN / "dp_draws.py")
        module = importlib.util.module_from_spec(spec)
        patch.setitem(sys.modules, "dp_draws", module)
        spec.loader.exec_module(module)
        yield module


def params(extra: Any) -> SimpleNamespace:
    return SimpleNamespace(extra_args=extra)


def engine_pick(config: DecodingConfig, logprobs: torch.Tensor, top: int, generator: torch.Generator) -> int:
    """Our engine's step-mode pick: the chain over the raw top-N (every other logit -inf), the softmax,
    engine.sampling.sample_rows with the run's generator."""
    values, ids = torch.topk(logprobs, top)
    row = torch.full((1, logprobs.shape[-1]), -math.inf).index_copy(1, ids, values[None])
    probs = torch.softmax(Chain.from_config(config)(torch.zeros((1, 1), dtype=torch.long), row), dim=-1)
    return sample_rows(probs, [generator])[0].token_id


CONFIGS = [DecodingConfig(strategy="sample", seed=1),
           DecodingConfig(strategy="sample", temperature=0.8, top_k=50, top_p=0.9, seed=1),
           DecodingConfig(strategy="sample", temperature=1.3, min_p=0.05, seed=1),
           DecodingConfig(strategy="sample", top_p=0.95, typical_p=0.9, temperature=0.9, seed=1,
                          stage_order=("typical_p", "temperature", "top_p"))]


@pytest.mark.parametrize("config", CONFIGS, ids=["no-stage", "top-k-top-p", "min-p", "typical-first"])
def test_a_valid_request_picks_our_engine_s_token_with_its_draws(dp_draws, config):
    """Eight positions of a 49,152-token vocabulary: the processor's only finite logit is the engine's
    pick from the same state, and both generators end in the same state."""
    vocab, top = 49_152, 100
    model = SimpleNamespace(capabilities=served_capabilities(100, our_draws=True))
    ours = torch.Generator().manual_seed(config.seed)
    xargs = served_decode.server_draws(model, SimpleNamespace(config=config, generator=ours, force=None), top)
    processor = dp_draws.OurDraws(None, torch.device("cpu"), False)
    processor.update_state(BatchUpdate(2, [], [(1, params(xargs), [], [])], []))
    logits = torch.Generator().manual_seed(7)
    for position in range(8):
        row = torch.randn((2, vocab), generator=logits) * 4
        expected = engine_pick(config, row[1].log_softmax(-1), top, ours)
        out = processor.apply(row.clone())
        assert torch.equal(out[0], row[0])  # a row without our arguments is vLLM's
        assert out[1].isfinite().nonzero().flatten().tolist() == [expected] and out[1, expected] == 0
    assert torch.equal(processor.rows[1].generator.get_state(), ours.get_state())


indices = st.integers(-2, 7)
added = st.tuples(indices, extras.map(params) | json_values, st.none(), st.none()) | json_values
moved = st.tuples(indices, indices, st.sampled_from(list(MoveDirectionality))) | json_values
updates = st.builds(BatchUpdate, st.integers(0, 8), st.lists(indices | json_values, max_size=3),
                    st.lists(added, max_size=4), st.lists(moved, max_size=3)) | st.none() | json_values
good = st.tuples(st.integers(0, 5), st.just(params({"dp_state": STATE, "dp_top": 5})), st.none(), st.none())
shapes = st.sampled_from([(0, 16), (1, 16), (3, 16), (6, 16), (8, 16), (4, 0), (16,), (2, 3, 16), (4, 3)])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(updates | st.builds(BatchUpdate, st.just(6), st.just([]), st.lists(good, max_size=3),
                                                     st.just([])), shapes), min_size=1, max_size=6))
def test_update_state_and_apply_never_raise_and_touch_only_our_rows(dp_draws, steps):
    """Any sequence of batch updates (vLLM's shape or any JSON value, rows beyond the batch, arguments
    of every kind) and logits of any shape: no exception; a row without draws keeps vLLM's logits, a
    row with them has exactly one finite logit (0)."""
    processor = dp_draws.OurDraws(None, torch.device("cpu"), False)
    for update, shape in steps:
        processor.update_state(update)
        assert all(isinstance(d, dp_draws.RowDraws) for d in processor.rows.values())
        logits = torch.randn(shape)
        out = processor.apply(logits.clone())
        assert out.shape == logits.shape
        if logits.dim() != 2 or logits.shape[-1] == 0:
            assert torch.equal(out, logits)
            continue
        for i in range(shape[0]):
            if i in processor.rows:
                assert out[i].isfinite().sum() == 1 and out[i].max() == 0
            else:
                assert torch.equal(out[i], logits[i])


def test_a_row_whose_pick_fails_is_dropped_and_left_as_vllm_computed_it(dp_draws):
    processor = dp_draws.OurDraws(None, torch.device("cpu"), False)
    processor.update_state(BatchUpdate(2, [], [(0, params({"dp_state": STATE}), [], []),
                                                (1, params({"dp_state": STATE}), [], [])], []))

    def broken(*_):
        raise ArithmeticError("a bug in one row's work")

    processor.rows[0] = dp_draws.RowDraws(processor.rows[0].generator, [broken], 100)
    logits = torch.randn((2, 300))
    out = processor.apply(logits.clone())
    assert torch.equal(out[0], logits[0]) and 0 not in processor.rows  # dropped, vLLM's logits
    assert out[1].isfinite().sum() == 1 and 1 in processor.rows  # the batch went on
