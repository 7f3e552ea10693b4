"""Make the 4-bit weight-only checkpoints (issue #40) with llm-compressor, in its own environment.

Run by deploy/quantize.sh inside the cached llm-compressor venv (llm-compressor pins an older
transformers than the app's), never imported by the app. Standard library and llm-compressor only.

    python deploy/quantize.py --model DIR --out DIR --calibration NAME=FILE ... VARIANT ...

VARIANT is ``<method>-g<group size>[-<calibration name>]``: method rtn (round to nearest, no data),
gptq or awq; the calibration set defaults to the first one given. Every checkpoint is W4A16: 4-bit
symmetric integer weights, one float scale per group of input channels, activations left in float;
the LM head (tied to the embedding) and the norms stay as they are. Each is written in the
compressed-tensors format (``pack-quantized``) to a temporary folder beside its place and renamed
into place when complete, so an interrupted run leaves no half-written checkpoint; a checkpoint
already there is kept. ``quantize.json`` in each records its recipe, calibration tokens and time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

SEPARATOR = "====="  # a line of its own between two samples of a calibration file
METHODS = ("rtn", "gptq", "awq")


def parse_variant(name: str, calibrations: dict[str, Path]) -> dict:
    """``gptq-g64-code`` -> {"method": "gptq", "group_size": 64, "calibration": "code"}."""
    parts = name.split("-")
    if len(parts) not in (2, 3) or parts[0] not in METHODS or not parts[1].startswith("g") \
            or not parts[1][1:].isdigit():
        raise SystemExit(f"quantize: variant {name!r}: expected <rtn|gptq|awq>-g<group size>[-<calibration>]")
    calibration = parts[2] if len(parts) == 3 else next(iter(calibrations))
    if calibration not in calibrations:
        raise SystemExit(f"quantize: variant {name!r}: no calibration set {calibration!r} ({', '.join(calibrations)})")
    return {"method": parts[0], "group_size": int(parts[1][1:]), "calibration": calibration}


def read_samples(path: Path) -> list[str]:
    """The samples of a calibration file (separated by lines holding only SEPARATOR)."""
    samples, current = [], []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip() == SEPARATOR:
            samples.append("\n".join(current).strip())
            current = []
        else:
            current.append(line)
    samples.append("\n".join(current).strip())
    return [s for s in samples if s]


def calibration_dataset(tokenizer, path: Path, max_tokens: int):
    """A ``datasets.Dataset`` of the file's samples, tokenized, each cut to ``max_tokens``."""
    from datasets import Dataset

    ids = [tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens] for text in read_samples(path)]
    return Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(i) for i in ids]})


def scheme(group_size: int):
    """W4A16: 4-bit symmetric integer weights, one scale per ``group_size`` input channels."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)
    return {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}


def modifier(recipe: dict):
    """The llm-compressor modifier of a recipe: plain round-to-nearest, GPTQ or AWQ."""
    common = {"config_groups": scheme(recipe["group_size"]), "ignore": ["lm_head"]}
    if recipe["method"] == "rtn":
        from llmcompressor.modifiers.quantization import QuantizationModifier

        return QuantizationModifier(**common)
    if recipe["method"] == "gptq":
        from llmcompressor.modifiers.quantization import GPTQModifier

        return GPTQModifier(**common, dampening_frac=recipe["dampening_frac"], actorder=recipe["actorder"])
    from llmcompressor.modifiers.awq import AWQModifier

    return AWQModifier(**common, n_grid=recipe["n_grid"])


def allow_cpu_only_awq() -> None:
    """AWQ pins its cached activations in page-locked memory before its grid search, to copy them
    to an accelerator faster (llm-compressor 0.14, IntermediatesCache.pin_memory); torch cannot pin
    memory without an accelerator and raises. With none there is no copy to speed up, so pinning is
    skipped (the tensors stay where they are, the results are the same)."""
    if torch.accelerator.is_available():
        return
    from llmcompressor.pipelines.cache import IntermediatesCache

    IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None


def quantize_one(model_dir: Path, target: Path, recipe: dict, dataset) -> dict:
    """Quantize a fresh copy of the model per ``recipe`` and write it to ``target`` (atomically)."""
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    start, cpu = time.perf_counter(), time.process_time()
    kwargs = {} if recipe["method"] == "rtn" else {
        "dataset": dataset, "num_calibration_samples": len(dataset), "max_seq_length": recipe["max_tokens"],
        "shuffle_calibration_samples": False}
    oneshot(model=model, recipe=[modifier(recipe)], **kwargs)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        model.save_pretrained(tmp, save_compressed=True)
        tokenizer.save_pretrained(tmp)
        unused = {"rtn": ("dampening_frac", "actorder", "n_grid", "calibration", "max_tokens"),
                  "gptq": ("n_grid",), "awq": ("dampening_frac", "actorder")}[recipe["method"]]
        meta = {**{k: v for k, v in recipe.items() if k not in unused}, "seconds": round(seconds, 1),
                "cpu_seconds": round(cpu_seconds, 1), "torch_threads": torch.get_num_threads(), "calibration_tokens": sum(map(len, dataset["input_ids"]))
                if recipe["method"] != "rtn" else 0}
        (tmp / "quantize.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return meta


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True, help="the float32 model directory to quantize")
    p.add_argument("--out", type=Path, required=True, help="the folder that holds one folder per variant")
    p.add_argument("--calibration", action="append", required=True, metavar="NAME=FILE",
                   help="a calibration set; the first is the default of every variant")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per calibration sample at most")
    p.add_argument("--dampening", type=float, default=0.01, help="GPTQ: dampening, a fraction of the mean diagonal")
    p.add_argument("--actorder", default="static", help="GPTQ: activation order (static | group | weight | none)")
    p.add_argument("--n-grid", type=int, default=20, help="AWQ: grid points of the scale search")
    p.add_argument("variants", nargs="+")
    args = p.parse_args(argv)
    calibrations = dict(item.split("=", 1) for item in args.calibration)
    calibrations = {name: Path(file) for name, file in calibrations.items()}
    args.out.mkdir(parents=True, exist_ok=True)
    for stale in args.out.glob(".*-*"):  # a killed run's temporary folder
        shutil.rmtree(stale, ignore_errors=True)
    allow_cpu_only_awq()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    for name in args.variants:
        target = args.out / name
        if (target / "config.json").is_file():
            print(f"quantize: {name} is already made", file=sys.stderr)
            continue
        recipe = {**parse_variant(name, calibrations), "max_tokens": args.max_tokens,
                  "dampening_frac": args.dampening, "actorder": None if args.actorder == "none" else args.actorder,
                  "n_grid": args.n_grid}
        print(f"quantize: making {name} ...", file=sys.stderr, flush=True)
        dataset = calibration_dataset(tokenizer, calibrations[recipe["calibration"]], args.max_tokens)
        meta = quantize_one(args.model, target, recipe, dataset)
        print(f"quantize: {name} made in {meta['seconds']} s", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
