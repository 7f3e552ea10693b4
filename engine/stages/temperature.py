"""Temperature-like stages: they reshape the distribution without removing tokens: temperature,
dynamic temperature (llama.cpp's temp-ext) and smoothing (quadratic sampling)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from transformers.generation import logits_process as tlp

from engine.stages.spec import (Export, Interop, Knob, StageSpec, number, param,
                                register, title_number)
from engine.stages.spec import STEP_SPREAD, Served, same_fields
from engine.stages.base import Stage, Wrapped, require, softmax

if TYPE_CHECKING:
    from engine.config import DecodingConfig
    from engine.trace import StageTrace


class Temperature(Wrapped):
    name = "temperature"

    def __init__(self, temperature: float):
        require(temperature > 0, "temperature", temperature, "(0, inf) for a stage; 0 means greedy")
        super().__init__(tlp.TemperatureLogitsWarper(temperature), temperature=temperature)


def _temperature_note(stage: StageTrace) -> str:
    t = stage.params.get("temperature", 1.0)
    effect = "sharper" if t < 1 else "flatter" if t > 1 else "unchanged"
    return f"temperature {t:g}: logits ÷ {t:g}, {effect} (entropy {stage.entropy:.2f} nats)"


register(StageSpec(
    "temperature", order=90, sampling_only=True, shareable=True, group="temperature",
    knobs=(Knob("temperature", "float", 1.0, 0.0, 5.0, floor=0.01, doc="Divide logits by T. 1 = neutral, 0 = greedy.",
                step=0.05),),
    # dynamic temperature *replaces* plain temperature (llama.cpp's temp-ext), which steps aside then
    active=lambda c: c.temperature != 1.0 and c.dynatemp_range == 0.0,
    build=lambda c, ctx: Temperature(c.temperature),
    note=_temperature_note,
    heading=lambda s: f"temperature: logits ÷ {param(s, 'temperature')}",
    interop=Interop("TemperatureLogitsWarper", webui=Export("temperature", knobs=("temperature",)),
                    llama=Export("temperature", flag="--temp")),
    oracle="tests/engine/test_processors.py::test_stage_equals_transformers_processor",
    served=Served(same_fields("temperature"), same_fields("temperature")),
))


class DynamicTemperature(Stage):
    """Entropy-scaled temperature (llama.cpp's temp-ext with delta > 0): over the surviving tokens,
    T = T_min + (T_max - T_min) · (H / log n)^exponent with T_min = max(0, T - range),
    T_max = T + range, H the entropy of softmax(logits) and n the number of finite logits.
    It *replaces* the plain temperature stage (the config turns that one off while it is active);
    T <= 0 keeps only the top token, as llama.cpp. Its diagnostics: the T used and the normalised
    entropy (row 0)."""

    name = "dynamic_temperature"

    def __init__(self, temperature: float, dynatemp_range: float, dynatemp_exponent: float = 1.0):
        require(dynatemp_range > 0, "dynatemp_range", dynatemp_range, "(0, 5] for a stage")
        require(dynatemp_exponent > 0, "dynatemp_exponent", dynatemp_exponent, "(0, 10]")
        super().__init__(temperature=temperature, dynatemp_range=dynatemp_range, dynatemp_exponent=dynatemp_exponent)

    def apply(self, input_ids, logits):
        t, delta, exponent = self.knobs["temperature"], self.knobs["dynatemp_range"], self.knobs["dynatemp_exponent"]
        low, high = max(0.0, t - delta), t + delta
        probs = softmax(logits)
        entropy = torch.special.entr(probs).sum(-1, keepdim=True)  # [B, 1], nats
        n = torch.isfinite(logits).sum(-1, keepdim=True).float()
        normalised = torch.where(n > 1, entropy / n.clamp(min=2).log(), torch.zeros_like(entropy))
        temp = low + (high - low) * normalised.pow(exponent)  # [B, 1]
        scaled = logits / temp.clamp(min=1e-30).to(logits.dtype)
        top_only = logits.masked_fill(logits < logits.max(-1, keepdim=True).values, float("-inf"))
        out = torch.where(temp > 0, scaled, top_only)
        out = torch.where(n > 1, out, logits)  # one candidate: nothing to scale (llama.cpp returns early)
        return out, {"T": float(temp[0]), "normalized_entropy": float(normalised[0])}


def _dynamic_temperature_note(stage: StageTrace) -> str:
    t, h = stage.params.get("T"), stage.params.get("normalized_entropy")
    if t is None:
        return "dynamic temperature"
    return f"dynamic temperature: T = {t:.2f} from normalised entropy {h:.2f} (entropy now {stage.entropy:.2f} nats)"


def _dynamic_temperature_heading(stage: StageTrace) -> str:
    t, r = stage.params.get("temperature"), stage.params.get("dynatemp_range")
    used = stage.params.get("T")
    return f"dynamic temperature {title_number(t)} ± {title_number(r)}" + \
        (f": T={title_number(used, '.2f')}" if isinstance(used, float) else "")


def _dynamic_temperature_webui(c: DecodingConfig, view: Any) -> list[str]:
    low, high = max(0.0, c.temperature - c.dynatemp_range), c.temperature + c.dynatemp_range
    return ["dynamic_temperature: true", f"dynatemp_low: {number(low)}", f"dynatemp_high: {number(high)}",
            f"dynatemp_exponent: {number(c.dynatemp_exponent)}"]


register(StageSpec(
    "dynamic_temperature", order=100, sampling_only=True, group="temperature", label="dynamic temperature",
    label_value=False,
    knobs=(Knob("dynatemp_range", "float", 0.0, 0.0, 5.0, doc="Dynamic temperature: T spans temperature ± range, "
                "scaled by the normalised entropy. 0 = disabled.", step=0.05),
           Knob("dynatemp_exponent", "float", 1.0, 0.0, 10.0, low_open=True, doc="Dynamic temperature: exponent on "
                "the normalised entropy. 1 = linear.", step=0.05)),
    active=lambda c: c.dynatemp_range > 0,
    build=lambda c, ctx: DynamicTemperature(c.temperature, c.dynatemp_range, c.dynatemp_exponent),
    note=_dynamic_temperature_note,
    heading=_dynamic_temperature_heading,
    # llama.cpp: its temperature sampler with a range (temp-ext)
    interop=Interop(webui=Export("dynamic_temperature", lines=_dynamic_temperature_webui),
                    llama=Export("temperature", lines=lambda c, x: [
                        f"--temp {number(c.temperature)}", f"--dynatemp-range {number(c.dynatemp_range)}",
                        f"--dynatemp-exp {number(c.dynatemp_exponent)}"]),
                    export_all_knobs=True),
    oracle="tests/engine/test_samplers.py::test_dynamic_temperature_by_hand",
    served=Served(same_fields("dynatemp_range", "dynatemp_exponent"), step_caveats=(STEP_SPREAD,)),
))


class Smoothing(Stage):
    """Quadratic ("smoothing") sampling, text-generation-webui's QuadraticSamplingLogitsWarper:
    with d = logit - max, k = (3 - curve)/2, s = (curve - 1)/2, every finite logit becomes
    max - k·f·d² + s·f·d³ (curve 1: max - f·d²). The max is per row (the reference takes it over
    the whole batch, the same thing for one sequence)."""

    name = "smoothing"

    def __init__(self, smoothing_factor: float, smoothing_curve: float = 1.0):
        require(smoothing_factor > 0, "smoothing_factor", smoothing_factor, "(0, 10] for a stage")
        require(smoothing_curve >= 1, "smoothing_curve", smoothing_curve, "[1, 10]")
        super().__init__(smoothing_factor=smoothing_factor, smoothing_curve=smoothing_curve)

    def apply(self, input_ids, logits):
        f, curve = self.knobs["smoothing_factor"], self.knobs["smoothing_curve"]
        top = logits.max(-1, keepdim=True).values
        d = logits - top
        k, s = (3 - curve) / 2, (curve - 1) / 2
        return torch.where(torch.isfinite(logits), -(k * f * d ** 2) + s * f * d ** 3 + top, logits), {}


register(StageSpec(
    "smoothing", order=110, sampling_only=True, shareable=True, group="temperature",
    knobs=(Knob("smoothing_factor", "float", 0.0, 0.0, 10.0, doc="Quadratic sampling: logit = max - factor x "
                "(max - logit)^2. 0 = disabled.", step=0.01),
           Knob("smoothing_curve", "float", 1.0, 1.0, 10.0, doc="Quadratic sampling: cubic term; 1 = pure quadratic.",
                step=0.05)),
    active=lambda c: c.smoothing_factor > 0,
    build=lambda c, ctx: Smoothing(c.smoothing_factor, c.smoothing_curve),
    heading=lambda s: f"smoothing: factor {param(s, 'smoothing_factor')}, curve {param(s, 'smoothing_curve')}",
    interop=Interop(webui=Export("quadratic_sampling", knobs=("smoothing_factor", "smoothing_curve")),
                    llama=Export(unmapped="llama.cpp has no quadratic (smoothing) sampler"), export_all_knobs=True),
    oracle="tests/engine/test_samplers.py::test_smoothing_by_hand",
))
