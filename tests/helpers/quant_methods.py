"""Shared by the tests: what tests/backends/test_quant_methods.py and the tests beside it use."""

from __future__ import annotations


__all__ = ['_comparison']


# --- the comparison's charts and sentences, on hand-made reports; the view's handlers on the tiny Llama ---
def _row(variant, ppl, kl, top1=0.7, bits=4.5, disk=0, packed=0):
    from engine.reports.quant_report import HeldoutScore

    return HeldoutScore(variant, f"about {variant}", ppl, kl, top1, bits, disk, packed, 540 << 20, 1.5, 0.0)


def _comparison():
    from engine.reports.quant_report import MethodComparison

    rows = [_row("none", 99.0, 0.0, 1.0, 32.0), _row("nf4", 130.0, 0.3), _row("rtn-g64", 148.7, 0.47),
            _row("gptq-g64", 160.1, 0.52, disk=80 << 20, packed=60 << 20), _row("awq-g64", 116.0, 0.18)]
    return MethodComparison("m", 1024, ["none", "nf4", "rtn-g64", "gptq-g64", "awq-g64", "awq-g32"], rows,
                            {"awq-g32": "quantization: the awq-g32 checkpoint is not made yet; run `make quantize`"})
