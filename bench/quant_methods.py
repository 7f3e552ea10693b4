"""The 4-bit methods table of docs/quantization.md (issue #40), measured on the embedded model:
held-out perplexity, mean KL from fp32 and top-1 agreement (engine.reports.quant_report.compare_methods),
bits per weight, bytes on disk, and the CPU seconds deploy/quantize.py took to make each checkpoint
(its quantize.json). Prints a Markdown table whose rows go into the doc as printed.

    python -m bench.quant_methods [--variants rtn-g64 gptq-g64 awq-g64 ...] [--inside LAYER MODULE GROUP]

``--inside 15 q_proj 64`` prints the inside-one-layer numbers instead (engine.reports.quant_report.inside_layer):
each method's mean relative weight and output error, and the rank correlation of AWQ's scales with the
activations' mean |activation|.

Needs the checkpoints (`make quantize`); a variant that cannot be loaded is printed as its one-line error.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.backends.local import embedded_model_dir  # noqa: E402
from engine.backends.quant_methods import WEIGHT_METHODS, checkpoint_meta  # noqa: E402
from engine.backends.registry import ModelRegistry  # noqa: E402
from engine.reports.quant_report import (COMPARED, HeldoutScore, MethodComparison, compare_methods,  # noqa: E402
                                         inside_layer)

DEFAULT = [*COMPARED, "gptq-g64-code", "awq-g64-code"]


def versus_rtn(row: HeldoutScore, report: MethodComparison) -> str:
    """'(−17% vs RTN)' against the round-to-nearest checkpoint of the same group size ('' for RTN itself)."""
    method = WEIGHT_METHODS.get(row.variant)
    if method is None or method.method == "rtn":
        return ""
    rtn = report.row(f"rtn-g{method.group_size}")
    return f" ({row.perplexity / rtn.perplexity - 1:+.0%} vs RTN)" if rtn else ""


def table_row(row: HeldoutScore, report: MethodComparison) -> str:
    meta = checkpoint_meta(embedded_model_dir(), row.variant) if row.variant in WEIGHT_METHODS else {}
    made = f"{meta['cpu_seconds']:.0f} s" if "cpu_seconds" in meta else "—"
    drift = ("—", "—") if row.variant == "none" else (f"{row.mean_kl:.3f}", f"{row.top1_agreement:.1%}")
    disk = f"{row.disk_bytes / 1e6:.0f} MB" if row.disk_bytes else "— (quantized at load)"
    if row.variant == "none":  # the float model's own weights file
        disk = f"{(embedded_model_dir() / 'model.safetensors').stat().st_size / 1e6:.0f} MB"
    return (f"| `{row.variant}` | {row.bits_per_weight:.2f} | {row.perplexity:.1f}{versus_rtn(row, report)} | "
            f"{drift[0]} | {drift[1]} | {disk} | {row.memory_bytes / 2**20:.0f} MiB | {made} |")


def print_inside(layer: int, module: str, group: int) -> None:
    inside = inside_layer(ModelRegistry(capacity=2), "embedded", layer, module, group)
    print(f"layer {inside.layer} {inside.module}, group {inside.group_size}, {inside.input_tokens} held-out inputs")
    for name in inside.methods:
        print(f"{name}: mean relative weight error {inside.mean_weight_error[name]:.4f}, "
              f"output error {inside.mean_output_error[name]:.4f}")
    print(f"AWQ scales vs mean |activation| (calibration set): Spearman {inside.scale_activation_correlation:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=DEFAULT)
    parser.add_argument("--inside", nargs=3, metavar=("LAYER", "MODULE", "GROUP"))
    args = parser.parse_args()
    if args.inside:
        print_inside(int(args.inside[0]), args.inside[1], int(args.inside[2]))
        return
    start = time.perf_counter()
    report = compare_methods(ModelRegistry(capacity=2), "embedded", args.variants)
    print(f"model {report.model}, {report.heldout_tokens} held-out tokens, {time.perf_counter() - start:.0f} s")
    print("| variant | bits / weight | held-out perplexity | mean KL from fp32 (nats) | top-1 vs fp32 | on disk "
          "| in memory | CPU to make |")
    print("|---|---|---|---|---|---|---|---|")
    for row in report.rows:
        print(table_row(row, report))
    for variant, error in report.errors.items():
        print(f"| `{variant}` | not loaded: {error} |")


if __name__ == "__main__":
    main()
