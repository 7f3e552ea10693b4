"""Calibration of a quantized variant beside fp32 (issue #54, point 4) on the embedded model: the
Inside view's Measure calibration with int8 picked in the header loads the bitsandbytes int8 copy
(no checkpoint needed) and draws its reliability curve beside fp32's, each ECE the one a loop over
the positions recomputes from that variant's own logits. (A 4-bit checkpoint not made yet is its one
line: tests/playground/test_inside_view.py.)"""

import re

import gradio as gr
import pytest
import torch

from engine.backends.local import ModelSpec
from engine.control import RunControl
from engine.reports import calibration as cal
from playground.views import inside

from tests.helpers.inside import hand_calibration

pytestmark = pytest.mark.slow

T_ONE = re.compile(r"^(\w+), T = 1(?:\.00)? \(ECE (\d\.\d{3})\)$")  # a variant's curve at T = 1, its ECE


def test_int8_is_calibrated_beside_fp32_on_the_embedded_model(registry, embedded):
    from playground.shared import Shared, model_pickers, user_presets_state

    with gr.Blocks():
        model, quant = model_pickers()
        shared = Shared(registry=registry, model=model, quantization=quant, user_presets=user_presets_state())
        view = inside.build_tab(shared)
    sections = view.handlers.sections
    last = list(view.handlers.on_calibration(10, "embedded", "int8", control=RunControl()))[-1]
    note, fig = last[sections.calibration_note], last[sections.calibration_chart]
    assert note.startswith("**fp32**: ") and "**int8**: " in note
    shown = {m.group(1): float(m.group(2)) for m in (T_ONE.match(t.name or "") for t in fig.data) if m}
    assert set(shown) == {"fp32", "int8"}
    int8 = registry.get(ModelSpec(quantization="int8"))
    assert int8.quantization == "int8" and int8 is not embedded
    ids = cal.heldout_ids(embedded)
    with torch.inference_mode():
        fp32_logits, targets = cal.teacher_forced(embedded, ids)
        int8_logits, int8_targets = cal.teacher_forced(int8, ids)
    assert torch.equal(targets, int8_targets) and (int8_logits - fp32_logits).abs().max() > 1e-3  # really int8
    for name, logits in (("fp32", fp32_logits), ("int8", int8_logits)):
        ece, _ = hand_calibration(logits, targets, 1.0, 10)
        assert shown[name] == pytest.approx(ece, abs=6e-4), name
