"""The memory the loaded models keep is bounded in bytes (issue #50): ``ModelRegistry`` counts every
model it loaded that is still alive (kept, lent to a report, or evicted but still running) against
``DP_MODEL_MEMORY_MB``; a report's variants are lent one at a time and released after it; a load or a
report that cannot fit is refused in one line naming the budget and the setting.

The registry on small stand-in models (their bytes are whatever the test says), the estimates
against real bitsandbytes loads of the embedded model, and a whole public app in a subprocess whose
RSS (/proc/<pid>/status) is read after each call of every endpoint that builds a variant."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest
import torch

from tests.helpers.common import ARTIFACTS, ROOT, free_port, make_tiny_llama
from engine.backends import local, registry as registry_module
from engine.backends.local import LoadedModel, ModelLoadError, ModelSpec
from engine.backends.registry import MB, ModelRegistry, estimated_bytes, model_bytes, model_memory_budget
from engine.reports import drift, quant_report
from engine.settings import SettingsError, check_environment
from tests.helpers.api import api_client

SETTING = "DP_MODEL_MEMORY_MB"


# --- the registry on stand-in models -----------------------------------------------------------------
class FakeLoads:
    """``load_model`` for the registry: a 1-layer tiny Llama whose ``memory_bytes`` is ``sizes[source]``
    (or ``sizes[quantization]``), counting the loads."""

    def __init__(self, tokenizer, sizes: dict[str, int]):
        self.tokenizer, self.sizes, self.loads = tokenizer, sizes, []

    def __call__(self, spec: ModelSpec, progress=None) -> LoadedModel:
        self.loads.append(spec)
        size = self.sizes.get(spec.quantization, self.sizes.get(spec.source))
        return LoadedModel(name=spec.source, model=make_tiny_llama(layers=1, hidden=32), tokenizer=self.tokenizer,
                           device=torch.device("cpu"), dtype=torch.float32, quantization=spec.quantization,
                           source=spec.source, eos_token_ids=(2,), memory_bytes=size)


@pytest.fixture
def fake_loads(tiny_lm, monkeypatch):
    def install(sizes: dict[str, int]) -> FakeLoads:
        loads = FakeLoads(tiny_lm.tokenizer, sizes)
        monkeypatch.setattr(registry_module, "load_model", loads)
        return loads
    return install


def test_the_budget_is_in_bytes_and_evicts_the_least_recently_used(fake_loads):
    fake_loads({"a": 1 * MB, "b": 1 * MB, "c": 1_500_000})
    registry = ModelRegistry(capacity=10, memory_bytes=3 * MB)
    for source in ("a", "b"):
        registry.get(ModelSpec(source))
    assert registry.held_bytes() == 2 * MB
    registry.get(ModelSpec("a"))  # now b is the least recently used
    registry.get(ModelSpec("c"))  # 1 + 1 + 1.5 MB > 3 MB: b goes
    assert registry.loaded() == [ModelSpec("a"), ModelSpec("c")]
    assert registry.held_bytes() == 2_500_000 <= 3 * MB


def test_a_model_over_the_budget_is_refused_in_one_line_and_nothing_is_evicted(fake_loads):
    fake_loads({"a": 1 * MB, "big": 4 * MB})
    registry = ModelRegistry(capacity=10, memory_bytes=3 * MB)
    registry.get(ModelSpec("a"))
    with pytest.raises(ModelLoadError) as refused:
        registry.get(ModelSpec("big"))
    assert str(refused.value) == ("model: 'big' needs about 4 MB in memory, more than the 3 MB this server allows its "
                                  "models (DP_MODEL_MEMORY_MB; the operator can raise it)")
    assert registry.loaded() == [ModelSpec("a")] and registry.held_bytes() == 1 * MB


def test_a_lent_variant_is_released_and_a_kept_one_stays(fake_loads):
    loads = fake_loads({"tiny": 2 * MB, "int8": 1 * MB, "nf4": 1 * MB})
    registry = ModelRegistry(capacity=10, memory_bytes=0)
    float_lm = registry.get(ModelSpec("tiny"))
    seen = []

    def use(lm: LoadedModel) -> int:
        seen.append(weakref.ref(lm))
        return registry.held_bytes()

    assert registry.lend(ModelSpec("tiny", "int8"), use) == 3 * MB  # counted while lent
    assert seen[0]() is None  # released as lend returns: nothing keeps it (no collector needed)
    assert registry.loaded() == [ModelSpec("tiny")] and registry.held_bytes() == model_bytes(float_lm) == 2 * MB
    kept = registry.get(ModelSpec("tiny", "nf4"))
    assert registry.lend(ModelSpec("tiny", "nf4"), lambda lm: lm is kept)  # a kept model is lent as it is
    assert registry.loaded() == [ModelSpec("tiny"), ModelSpec("tiny", "nf4")]
    assert [s.quantization for s in loads.loads] == ["none", "int8", "nf4"]


def test_a_variant_is_estimated_and_refused_before_it_is_built(fake_loads, monkeypatch):
    loads = fake_loads({"tiny": 2 * MB, "rtn-g64": 2 * MB})
    registry = ModelRegistry(capacity=10, memory_bytes=3 * MB)
    float_lm = registry.get(ModelSpec("tiny"))
    # a 4-bit checkpoint is dequantized at load: the float model's bytes, known before loading
    assert estimated_bytes(float_lm, "rtn-g64") == model_bytes(float_lm) == 2 * MB
    with pytest.raises(ModelLoadError, match=r"^model: the inside-one-layer report needs about 4 MB of models in "
                                             r"memory at once, more than the 3 MB this server allows "
                                             r"\(DP_MODEL_MEMORY_MB; the operator can raise it\)$"):
        quant_report.inside_layer(registry, "tiny", 0, "q_proj", 64)
    with pytest.raises(ModelLoadError, match=r"^variants: the drift report needs about 4 MB .* \(DP_MODEL_MEMORY_MB; "):
        drift.quantization_report(registry, "tiny", "Hello", False, 2, ["none", "rtn-g64"])
    assert loads.loads == [ModelSpec("tiny")]  # no variant was built
    monkeypatch.setattr(registry_module, "ROOM_WAIT_S", 0.0)
    with pytest.raises(ModelLoadError, match=r"^model: 'tiny' as rtn-g64 needs about 2 MB in memory, and running "
                                             r"requests hold 2 MB of the 3 MB .*; try again when they end$"):
        registry.lend(ModelSpec("tiny", "rtn-g64"), lambda lm: lm)  # float_lm, in use here, cannot be freed
    assert loads.loads == [ModelSpec("tiny")]


class SpiedCondition(threading.Condition):
    """A Condition that says when someone waits on it."""

    def __init__(self, lock):
        super().__init__(lock)
        self.waiting = threading.Event()

    def wait(self, timeout=None):
        self.waiting.set()
        return super().wait(timeout)


def test_a_load_waits_for_a_lent_variant_to_be_released(fake_loads):
    """Two reports at once: the second's variant waits for the first's to go, then loads; never both."""
    loads = fake_loads({"tiny": 1 * MB, "int8": 1 * MB, "nf4": 1 * MB})
    registry = ModelRegistry(capacity=10, memory_bytes=2 * MB)
    registry._room = SpiedCondition(registry._lock)
    float_lm = registry.get(ModelSpec("tiny"))
    release, held = threading.Event(), []

    def first(lm):
        held.append(registry.held_bytes())
        release.wait(60)

    worker = threading.Thread(target=registry.lend, args=(ModelSpec("tiny", "int8"), first))
    worker.start()
    while not held:
        time.sleep(0.01)
    second = threading.Thread(target=lambda: held.append(registry.lend(ModelSpec("tiny", "nf4"),
                                                                       lambda lm: registry.held_bytes())))
    second.start()
    assert registry._room.waiting.wait(60)  # the nf4 load waits: 1 + 1 + 1 MB would pass 2 MB
    assert [s.quantization for s in loads.loads] == ["none", "int8"]
    release.set()
    worker.join(60)
    second.join(60)
    assert held == [2 * MB, 2 * MB]  # never more than the budget at once
    assert [s.quantization for s in loads.loads] == ["none", "int8", "nf4"]
    assert registry.held_bytes() == model_bytes(float_lm)


def test_the_budget_setting(monkeypatch):
    for name in (SETTING, "DP_PUBLIC", "SPACE_ID"):
        monkeypatch.delenv(name, raising=False)
    assert model_memory_budget() == 0 and ModelRegistry().memory_bytes == 0  # no limit outside public mode
    monkeypatch.setenv("DP_PUBLIC", "1")
    assert model_memory_budget() == registry_module.PUBLIC_MODEL_MEMORY_MB * MB == 6_000_000_000
    monkeypatch.setenv(SETTING, "2500")
    assert ModelRegistry().memory_bytes == 2_500_000_000
    monkeypatch.setenv(SETTING, "lots")
    with pytest.raises(SettingsError, match=f"^{SETTING}: expected an integer >= 0, got 'lots'$"):
        check_environment()


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["int8", "nf4"])
def test_a_bitsandbytes_variant_s_estimate_is_its_real_size(embedded, quantization):
    """The estimate made before loading (from the float model's parameters) against the loaded model."""
    estimate = estimated_bytes(embedded, quantization)
    lm = local.load_model(ModelSpec(quantization=quantization))
    real = model_bytes(lm)
    del lm
    registry_module.trim_heap()
    assert real <= estimate <= real * 1.04, (estimate, real)
    assert estimate < model_bytes(embedded) * 0.4


# --- a whole public app in a subprocess: RSS after each call --------------------------------------------
def rss_mb(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (the peak) of a process, in MB (10^6 bytes)."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) * 1024 // MB
    return fields


MODEL_BYTES_MB = 1_100  # the embedded model as the registry counts it: fp32 weights + oneDNN's packed copies (1,076)
BNB_MAPPING_MB = 700  # RSS counts a bitsandbytes variant's mapping of the float checkpoint's file (651) again
KEPT_SLACK_MB = 200  # what a report may leave behind: heap, Gradio's session, cached rows
OVERHEAD_MB = 500  # tokenizers, heap the allocator keeps, sessions: docs/deployment.md's bound


@dataclass
class PublicApp:
    process: subprocess.Popen
    url: str
    budget_mb: int
    no_model_mb: int  # RSS before any model is loaded (the app starts with --no-preload)

    seen: list[str] = field(default_factory=list)

    def rss(self, after: str = "") -> int:
        """VmRSS now, in MB; noted with the peak (test-artifacts/<log>.rss) when ``after`` names the call."""
        now = rss_mb(self.process.pid)
        if after:
            self.seen.append(f"{after}: VmRSS {now['VmRSS']} MB, peak {now['VmHWM']} MB")
        return now["VmRSS"]

    def bound(self, bnb_kept: int) -> int:
        """docs/deployment.md's bound: the app with no model + DP_MODEL_MEMORY_MB + the file mapping
        of each bitsandbytes variant kept + the overhead."""
        return self.no_model_mb + self.budget_mb + BNB_MAPPING_MB * bnb_kept + OVERHEAD_MB


READY = "To create a public link"  # Gradio prints it once its own probe of the local URL has passed
PROBE_FAILED = "When localhost is not accessible"  # that probe timed out (3 s, on a loaded machine): start again


def start_app(env: dict[str, str], log_path: Path) -> subprocess.Popen | None:
    """``python app.py --no-preload`` once its launch is complete; None when Gradio's own probe of the
    local URL timed out (the app then exits), for the caller to start it again."""
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "app.py", "--no-preload"], cwd=ROOT, env=env, stdout=log,
                                   stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while READY not in log_path.read_text(errors="replace"):
        if process.poll() is not None:
            assert PROBE_FAILED in log_path.read_text(errors="replace"), f"the app did not start (log: {log_path})"
            return None
        assert time.monotonic() < deadline, f"the app did not start within 300 s (log: {log_path})"
        time.sleep(0.5)
    return process


@contextlib.contextmanager
def public_app(budget_mb: int, log_name: str) -> Iterator[PublicApp]:
    """A public app (``--no-preload``: its RSS at start has no model) with ``DP_MODEL_MEMORY_MB=budget_mb``
    on a free port; its RSS notes go to test-artifacts/<log_name>.rss."""
    port = free_port()
    env = {**os.environ, "DP_PUBLIC": "1", "DP_EXAMPLES": "0", SETTING: str(budget_mb), "PYTHONUNBUFFERED": "1",
           "DP_REQUEST_SECONDS": "0",  # a report takes minutes on a loaded 2-core machine; time is not what is tested
           "GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_SERVER_PORT": str(port)}
    ARTIFACTS.mkdir(exist_ok=True)
    process = None
    for _ in range(3):
        process = process or start_app(env, ARTIFACTS / log_name)
    assert process is not None, f"Gradio's probe of its own URL timed out three times (log: {log_name})"
    app = PublicApp(process, f"http://127.0.0.1:{port}", budget_mb, rss_mb(process.pid)["VmRSS"])
    try:
        app.rss("start, no model")
        yield app
    finally:
        (ARTIFACTS / f"{log_name}.rss").write_text("\n".join(app.seen) + "\n")
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(30)


def client_of(app: PublicApp):

    return api_client(app.url, 900)


def refused(client, *args, api_name: str) -> str:
    """The one-line error a call gets."""
    with pytest.raises(Exception) as error:
        client.predict(*args, api_name=api_name)
    return str(error.value)


GREEDY4 = {"strategy": "greedy", "max_new_tokens": 4}
PROMPT = "The sky is"
BUDGET_LINE = (r"^{key}: the {what} needs about 2,\d{{3}} MB of models in memory at once, more than the 1,500 MB "
               r"this server allows \(DP_MODEL_MEMORY_MB; the operator can raise it\)$")


@pytest.mark.alone
@pytest.mark.slow
def test_a_public_app_keeps_no_report_s_variants_and_its_models_fit_the_budget():
    """The hostile tester's calls (#50) and every kind of endpoint that builds a variant, on a public app
    whose models may keep 1,500 MB: the float model (1,076 MB) and one bitsandbytes variant beside it.
    A report leaves nothing behind; a report that cannot fit is refused in one line before it builds
    anything (checkpoints made or not); kept variants are evicted by bytes; RSS stays under the bound."""
    with public_app(1_500, "public-memory-app.log") as app:
        client = client_of(app)
        trace = client.predict(PROMPT, GREEDY4, "", False, "embedded", "none", api_name="/step_trace")
        assert len(trace["generated_token_ids"]) == 4
        base = app.rss("/step_trace (the float model loaded)")

        def report_keeps_nothing(name: str) -> None:
            rss = app.rss(name)
            assert rss <= base + KEPT_SLACK_MB, f"{name} kept {rss - base} MB"
            assert rss <= app.bound(bnb_kept=0)

        methods = client.predict(["int8", "nf4"], "embedded", api_name="/quantization_methods_report")
        assert [r["variant"] for r in methods["rows"]] == ["none", "int8", "nf4"] and not methods["errors"]
        rows = {r["variant"]: r for r in methods["rows"]}
        assert rows["none"]["mean_kl"] == 0 and rows["int8"]["memory_bytes"] < rows["none"]["memory_bytes"] / 2
        report_keeps_nothing("the methods' comparison")
        drifted = client.predict(PROMPT, False, 8, ["none", "int8", "nf4"], "embedded", api_name="/quantization_report")
        assert [v["quantization"] for v in drifted["variants"]] == ["none", "int8", "nf4"]
        assert drifted["variants"][0]["mean_kl"] == 0 and drifted["reference_token_ids"]
        report_keeps_nothing("the drift report")
        for layer, module, group in ((15, "q_proj", 64), (3, "gate_proj", 32)):
            said = refused(client, layer, module, group, "embedded", api_name="/quantization_inside_layer")
            assert re.match(BUDGET_LINE.format(key="model", what="inside-one-layer report"), said), said
        said = refused(client, None, "embedded", api_name="/quantization_methods_report")
        assert re.match(BUDGET_LINE.format(key="variants", what="methods' comparison"), said), said
        report_keeps_nothing("the refused reports")

        int8 = client.predict(PROMPT, GREEDY4, "", False, "embedded", "int8", api_name="/step_trace")
        assert len(int8["generated_token_ids"]) == 4
        kept = app.rss("/step_trace int8 (kept)")
        assert kept <= app.bound(bnb_kept=1)
        drafted = client.predict(PROMPT, {"max_new_tokens": 8}, "speculative-self-int8", False, "embedded", "none",
                                 api_name="/speculative_trace")
        assert drafted["rounds"] and len(drafted["generated_token_ids"]) == 8
        # the drafter is the page's int8 model, not a second copy
        assert app.rss("/speculative_trace self-int8") <= kept + KEPT_SLACK_MB
        lanes = [{"preset": "greedy", "quantization": "nf4"}, {"preset": "contrastive-decoding"}]
        compared = client.predict(PROMPT, lanes, 0, 6, False, "embedded", "none", api_name="/compare")
        assert [len(lane["trace"]["generated_token_ids"]) for lane in compared["lanes"]] == [6, 6]
        # 1,076 + 333 + 287 MB > 1,500: the kept int8 was evicted for the nf4 lane
        assert app.rss("/compare nf4 + contrastive (self-nf4)") <= app.bound(bnb_kept=1)
        kv = client.predict(PROMPT, False, 8, "embedded", "nf4", api_name="/kv_cache_report")
        assert kv["quantization"] == "nf4"
        assert kv["bytes_per_token"] == kv["formula_bytes_per_token"] == 2 * 30 * 3 * 64 * 4  # K and V, fp32
        assert app.rss("/kv_cache_report nf4") <= app.bound(bnb_kept=1)
        hwm = rss_mb(app.process.pid)["VmHWM"]
        assert hwm <= app.bound(bnb_kept=1) + MODEL_BYTES_MB, f"peak {hwm} MB"


@pytest.mark.alone
@pytest.mark.slow
@pytest.mark.quantized
def test_a_public_app_releases_the_four_bit_variants_of_every_report(quant_checkpoints):
    """The 4-bit checkpoints (dequantized at load: the float model's bytes each) on a public app whose
    models may keep 2,300 MB, the float model and one variant: every report lends its variants one at
    a time and releases them; a Compare lane keeps its variant within the budget."""
    with public_app(2_300, "public-memory-quantized-app.log") as app:
        client = client_of(app)
        client.predict(PROMPT, GREEDY4, "", False, "embedded", "none", api_name="/step_trace")
        base = app.rss("/step_trace (the float model loaded)")
        for layer, module, group in ((15, "q_proj", 64), (3, "gate_proj", 32), (29, "q_proj", 32)):
            inside = client.predict(layer, module, group, "embedded", api_name="/quantization_inside_layer")
            names = [f"{m}-g{group}" for m in ("rtn", "gptq", "awq")]
            assert inside["methods"] == names and inside["layer"] == layer
            assert {len(v) for v in inside["weight_error"].values()} == {576 if module == "q_proj" else 1536}
            assert len(inside["awq_scales"]) == 576
            rss = app.rss(f"/quantization_inside_layer {layer} {module} {group}")
            assert rss <= base + KEPT_SLACK_MB, f"inside layer {layer} kept {rss - base} MB"
        methods = client.predict(None, "embedded", api_name="/quantization_methods_report")
        assert [r["variant"] for r in methods["rows"]] == list(quant_report.COMPARED) and not methods["errors"]
        assert app.rss("/quantization_methods_report (all)") <= base + KEPT_SLACK_MB
        drifted = client.predict(PROMPT, False, 8, ["none", "gptq-g64", "awq-g32"], "embedded",
                                 api_name="/quantization_report")
        assert [v["quantization"] for v in drifted["variants"]] == ["none", "gptq-g64", "awq-g32"]
        assert app.rss("/quantization_report gptq-g64 awq-g32") <= base + KEPT_SLACK_MB
        lanes = [{"preset": "greedy", "quantization": "gptq-g64"}, {"preset": "greedy"}]
        compared = client.predict(PROMPT, lanes, 0, 6, False, "embedded", "none", api_name="/compare")
        assert [len(lane["trace"]["generated_token_ids"]) for lane in compared["lanes"]] == [6, 6]
        assert app.rss("/compare gptq-g64 lane (kept)") <= app.bound(bnb_kept=0)
        hwm = rss_mb(app.process.pid)["VmHWM"]
        assert hwm <= app.bound(bnb_kept=0) + MODEL_BYTES_MB, f"peak {hwm} MB"
