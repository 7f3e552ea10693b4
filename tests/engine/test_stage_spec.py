"""Issue #28, one spec per stage: a stage is its class plus ONE ``StageSpec`` (engine/stages/spec.py),
and everything else reads the spec. A toy stage registered here (tail-free sampling, docs/architecture.md's
"Add a stage" example, verbatim) shows up in the config (knob, order, validation, active stages),
the chain (built, recorded, shared across rows), the step chart's note and title, both exports and
the knob panel, and leaves no trace once removed. Every built-in stage has a note, a title, an entry
for each tool and an oracle test that exists."""

from __future__ import annotations

import re
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from engine import config, stages
from engine.chain import Chain, traced_rows
from engine.config import ConfigError, DecodingConfig
from engine.interop import effective_knobs, to_llama_cpp, to_textgen_webui
from engine.presets import Preset
from engine.stages import Stage, require
from engine.stages import STAGES, Export, Interop, Knob, StageSpec, param, register, truncation_note, unregister
from engine.trace import StageTrace, TokenProb
from playground import knobs as knob_panel
from playground.charts.stage_notes import stage_heading, stage_note

ROOT = Path(__file__).resolve().parents[2]


# --- docs/architecture.md's worked example (tests/project/test_docs.py keeps them equal): what a contributor adds
class TailFree(Stage):
    """Tail-free sampling (text-generation-webui's ``tfs``): sort the probabilities, take the absolute
    second differences of that curve and normalise them to sum to 1; keep the top tokens while the
    running sum of those stays at or below z (the top token always stays, the last never)."""

    name = "tail_free"

    def __init__(self, tfs: float):
        require(0 < tfs < 1, "tfs", tfs, "(0, 1) for a stage (1 = disabled)")
        super().__init__(tfs=tfs)

    def apply(self, input_ids, logits):  # -> (new logits, diagnostics: none here)
        ordered, order = torch.sort(logits, descending=True)  # [B, V]
        curve = ordered.softmax(-1).diff().diff().abs()  # [B, V - 2]
        running = (curve / curve.sum(-1, keepdim=True)).cumsum(-1)
        edge = torch.zeros_like(running[:, :1], dtype=torch.bool)
        drop = torch.cat([edge, running > self.knobs["tfs"], ~edge], dim=-1)  # in sorted order [B, V]
        return logits.masked_fill(drop.scatter(1, order, drop), float("-inf")), {}


TAIL_FREE = StageSpec(
    "tail_free", order=185, sampling_only=True, shareable=True, group="truncation", label="tail-free",
    knobs=(Knob("tfs", "float", 1.0, 0.0, 1.0, low_open=True, doc="Tail-free sampling: keep tokens until the "
                "normalised second differences of the sorted probabilities add up to z. 1 = disabled.", step=0.01),),
    build=lambda c, ctx: TailFree(c.tfs),
    note=truncation_note,
    heading=lambda s: f"tail-free: cut where the sorted probabilities flatten, z = {param(s, 'tfs')}",
    interop=Interop(webui=Export("tfs", knobs=("tfs",)), llama=Export(unmapped="llama.cpp has no tail-free sampler")),
    oracle="tests/engine/test_stage_spec.py::test_tail_free_by_hand",
)


@contextmanager
def registered(spec: StageSpec):
    register(spec)
    try:
        yield spec
    finally:
        unregister(spec.name)


# --- its oracle test (what the contributor adds to tests/engine/test_samplers.py) -------------------------------
def test_tail_free_by_hand():
    # probabilities 0.5, 0.25, 0.15, 0.06, 0.04: second differences |0.15|, |0.01|, |0.07| -> normalised
    # 0.652, 0.043, 0.304; running 0.652, 0.696, 1.0: z = 0.9 keeps the first two of them (ranks 2, 3)
    # plus the top token, and the last token always goes
    probs = torch.tensor([[0.06, 0.5, 0.04, 0.25, 0.15]])
    out = TailFree(0.9)(None, probs.log())
    assert torch.isinf(out).tolist() == [[True, False, True, False, False]]
    assert torch.equal(out[0, [1, 3, 4]], probs.log()[0, [1, 3, 4]])
    assert torch.isinf(TailFree(0.5)(None, probs.log())).tolist() == [[True, False, True, True, True]]
    with pytest.raises(ConfigError, match=r"tfs: 1 is out of range"):
        TailFree(1)


# --- one registration, seen everywhere -----------------------------------------------------------------
def test_a_registered_stage_reaches_the_config():
    with registered(TAIL_FREE):
        assert "tail_free" in config.STAGE_NAMES and "tail_free" in config.SAMPLING_ONLY_STAGES
        order = config.DEFAULT_STAGE_ORDER
        assert order.index("eta") < order.index("tail_free") < order.index("top_h")
        assert config.KNOBS["tfs"].stage == "tail_free" and "tfs" in config.CONFIG_KEYS
        cfg = DecodingConfig.from_dict({"tfs": 0.9, "temperature": 0.8})
        assert cfg.tfs == 0.9 and DecodingConfig(tfs=0.9).tfs == 0.9
        assert cfg.active_stages() == ("temperature", "tail_free")
        assert cfg.to_dict(sparse=True) == {"strategy": "sample", "temperature": 0.8, "tfs": 0.9}
        assert DecodingConfig.from_dict(cfg.to_dict()) == cfg and cfg.replace(seed=3).tfs == 0.9
        assert cfg.replace(strategy="greedy").active_stages() == ()  # sampling-only: greedy drops it
        moved = cfg.replace(stage_order=["tail_free", "temperature"])
        assert moved.active_stages() == ("tail_free", "temperature")
        assert config.parse_set_value("tfs", "0.95") == 0.95
        with pytest.raises(ConfigError, match=r"^tfs: 0\.0 is out of range; allowed \(0, 1\]"):
            DecodingConfig.from_dict({"tfs": 0})
        assert DecodingConfig().tfs == 1.0  # its neutral value


def test_a_registered_stage_is_built_recorded_and_shared():
    with registered(TAIL_FREE):
        cfg = DecodingConfig.from_dict({"tfs": 0.9, "top_k": 4})
        chain = Chain.from_config(cfg)
        assert chain.names == ["top_k", "tail_free"] and isinstance(chain.stages[1], TailFree)
        logits = torch.tensor([[2.0, 1.5, 1.4, 0.2, -1.0, -3.0]])
        traced = chain.traced(torch.tensor([[0]]), logits, 5, str)
        record = traced.stages[2]
        assert (record.name, record.params) == ("tail_free", {"tfs": 0.9})
        assert torch.equal(traced.logits, TailFree(0.9)(None, stages.TopK(4)(None, logits)))
        # shareable: two rows with equal knobs share one call, with the same floats as alone
        assert stages.share_key(chain.stages[1]) == stages.share_key(Chain.from_config(cfg).stages[1])
        rows = traced_rows([chain, Chain.from_config(cfg)], [torch.tensor([[0]])] * 2, logits.repeat(2, 1), [5, 5], str)
        assert all(torch.equal(r.logits, traced.logits) for r in rows)
        assert [s.kept for s in rows[1].stages] == [s.kept for s in traced.stages]


def test_a_registered_stage_has_its_note_title_and_exports():
    with registered(TAIL_FREE):
        trace = StageTrace("tail_free", 2, 0.25, 0.6, 0.25, [TokenProb(1, " a", 0.7)], [TokenProb(2, " b", 0.2)],
                           {"tfs": 0.9})
        assert stage_note(trace) == "tail-free 0.9: removed 25.0% of the mass (' b'); 2 tokens left"
        assert stage_heading(trace) == "tail-free: cut where the sorted probabilities flatten, z = 0.9"
        # (Preset() as it is: engine.presets took its key list at import, before this late registration)
        preset = Preset("Tail", "Tail-free sampling.", DecodingConfig.from_dict({"tfs": 0.95, "top_p": 0.9}))
        assert effective_knobs(preset.config) == ["top_p", "tfs"]
        webui = to_textgen_webui(preset)
        assert "tfs: 0.95\n" in webui.text and "sampler_priority" not in webui.text  # its order is webui's own
        assert webui.unmapped == ()
        llama = to_llama_cpp(preset)
        assert llama.text.startswith('--samplers "top_p" --top-p 0.9')
        assert [(n.key, n.reason) for n in llama.unmapped] == [("tfs", "llama.cpp has no tail-free sampler")]


def test_a_registered_stage_is_in_the_knob_panel():
    with registered(TAIL_FREE):
        groups = {title: names for title, names, _ in knob_panel.knob_groups()}
        assert "tfs" in groups["Truncation"] and "tfs" in knob_panel.STAGE_KNOBS
        assert "tfs" in knob_panel.SAMPLING_KNOBS  # greedy greys it
        assert knob_panel.compact_knob_state("tfs", "greedy")["interactive"] is False
        assert 'data-stage="tail_free"' in knob_panel.stage_list_html(config.STAGE_NAMES, "t")
        assert knob_panel.checked_values(["tfs"], [0.0])[1] == ["tfs: 0.0 is out of range; allowed (0, 1]"]


def test_an_unregistered_stage_leaves_no_trace():
    before = (config.STAGE_NAMES, dict(config.KNOBS), config.CONFIG_KEYS, knob_panel.STAGE_KNOBS)
    with registered(TAIL_FREE):
        made_with_it = DecodingConfig.from_dict({"tfs": 0.9})
    assert (config.STAGE_NAMES, dict(config.KNOBS), config.CONFIG_KEYS, knob_panel.STAGE_KNOBS) == before
    assert "tail_free" not in STAGES
    with pytest.raises(ConfigError, match="tfs: unknown key"):
        DecodingConfig.from_dict({"tfs": 0.9})
    assert made_with_it.active_stages() == () and "tfs" not in made_with_it.to_dict()
    made_before = DecodingConfig()
    with registered(TAIL_FREE):
        assert made_before.tfs == 1.0 and made_before.to_dict()["tfs"] == 1.0  # a config older than the stage


def test_a_spec_is_checked_when_registered():
    with pytest.raises(ValueError, match="registered twice"):
        register(STAGES["top_k"])
    clash = StageSpec("other_k", order=1, knobs=(Knob("top_k", "int", 0, 0, 5),), build=lambda c, ctx: None)
    with pytest.raises(ValueError, match="knob 'top_k' belongs to another stage"):
        register(clash)
    assert "other_k" not in STAGES
    with pytest.raises(ValueError, match="belongs to stage 'top_p'"):
        StageSpec("mine", order=1, knobs=(config.KNOBS["top_p"],), build=lambda c, ctx: None)


# --- every built-in stage is complete ------------------------------------------------------------------
@pytest.mark.parametrize("name", list(STAGES))
def test_every_stage_has_its_note_title_exports_and_oracle(name):
    spec = STAGES[name]
    assert [k.name for k in spec.knobs] == [n for n, k in config.KNOBS.items() if k.stage == name]
    trace = StageTrace(name, 3, 0.1, 1.0, 0.1, [TokenProb(1, " a", 0.5)], [], {k.name: k.neutral for k in spec.knobs})
    assert stage_note(trace) and "\n" not in stage_note(trace)
    assert spec.heading is not None and "_" not in stage_heading(trace), stage_heading(trace)
    assert "_" not in spec.text_label
    for tool in ("webui", "llama"):  # each tool: its name for the stage, or why it has none
        export = getattr(spec.interop, tool)
        assert export.sampler or export.knobs or export.lines or export.unmapped, (name, tool)
    oracles = spec.oracle.split()
    assert oracles, f"{name}: no oracle test named"
    for ref in oracles:
        path, _, test = ref.partition("::")
        assert re.search(rf"^def {re.escape(test)}\(", (ROOT / path).read_text(), re.M), ref


def test_no_other_module_keeps_a_per_stage_table():
    """The modules that used to list stages read the specs: none names a stage's label or knob."""
    for path in ("engine/interop.py", "playground/charts/stage_notes.py", "playground/knobs.py", "engine/config.py"):
        # (not stage tables: the Beam view's choice of controls, text-generation-webui's own sampler list)
        text = re.sub(r"(PENALTY_KNOBS|TGW_PRIORITY) = \(.*?\)", "", (ROOT / path).read_text(), flags=re.S)
        for spec in STAGES.values():
            for knob in spec.knobs:
                if knob.name in ("top_k", "temperature", "repetition_penalty", "frequency_penalty",
                                 "presence_penalty"):
                    continue  # also names outside a stage table (top_k 1 for greedy, GenerationConfig fields...)
                assert f'"{knob.name}"' not in text, (path, knob.name)
    # config.KNOBS' order of stage knobs is the default stage order, whichever family module declares a stage
    assert [s.name for s in stages.declared()] == list(STAGES) and stages.declared()[0].name == "constraints"
    stage_knobs = [k for k in config.KNOBS.values() if k.stage is not None]
    assert stage_knobs == [k for s in STAGES.values() for k in s.knobs]


# --- diagnostics as values, state through the stage's own API ----------------------------------------
def test_a_stage_returns_its_diagnostics_and_keeps_its_knobs():
    dry = stages.Dry(1.0, 2.0, 1)
    ids, logits = torch.tensor([[3, 4, 3]]), torch.zeros(1, 6)
    out, found = dry.apply(ids, logits)
    assert out[0, 4] == -1.0 and found["penalized"][0]["token_id"] == 4
    assert dry.knobs == {"dry_multiplier": 1.0, "dry_base": 2.0, "dry_allowed_length": 1, "dry_penalty_last_n": -1}
    assert dry.params == dry.knobs  # apply alone remembers nothing; run / calling the stage does
    dry(ids, logits)
    assert dry.params == {**dry.knobs, **found}
    dry.params["dry_base"] = 9.0  # params is a copy: the stage is unchanged
    assert dry.knobs["dry_base"] == 2.0


def test_mirostat_accept_reset_and_clone():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    stage = stages.Mirostat(2, 3.0, 0.5)
    _, found = stage.run(None, logits)
    assert found == {"mu": 6.0, "kept": found["kept"], "mu_after": None} and stage.state() == {"mu": 6.0}
    learnt = stage.accept(None, 2)
    assert learnt["mu_after"] == stage.mu != 6.0 and stage.params["mu_after"] == stage.mu
    twin = stage.clone()
    stage.run(None, logits)
    stage.accept(None, 0)
    assert twin.mu == learnt["mu_after"] != stage.mu  # the clone went nowhere
    twin.run(None, logits)
    assert twin.state() == {"mu": learnt["mu_after"]}
    stage.reset()
    assert stage.mu == 6.0 and stage.params == stage.knobs and stage.accept(None, 0) == {}


def test_xtc_reset_forgets_a_loaded_draw_and_clone_shares_the_generator():
    generator = torch.Generator().manual_seed(3)
    stage = stages.Xtc(0.1, 0.5, generator)
    stage.load_state({"u": 0.25})
    assert stage.run(None, torch.tensor([[3.0, 2.9, 0.0]]))[1]["u"] == 0.25
    twin = stage.clone()
    assert twin.generator is generator and twin.state() == {"u": 0.25}
    stage.reset()
    assert stage.state() == {"u": None}
    drawn = stage.run(None, torch.tensor([[3.0, 2.9, 0.0]]))[1]["u"]
    assert drawn == float(torch.rand((), generator=torch.Generator().manual_seed(3)))


def test_chain_clone_and_reset_follow_the_stages():
    cfg = DecodingConfig(strategy="sample", mirostat=2, mirostat_tau=3.0, mirostat_eta=0.5)
    chain = Chain.from_config(cfg)
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    traced = chain.traced(torch.tensor([[0]]), logits, 5, str)
    chain.observe(torch.tensor([[0]]), 1)
    chain.annotate(traced.stages)
    assert traced.stages[1].params["mu_after"] == chain.stages[0].mu  # the pick's lesson lands in the record
    branch = chain.clone()
    chain.reset()
    assert chain.stages[0].mu == 6.0 and branch.stages[0].mu == traced.stages[1].params["mu_after"]
