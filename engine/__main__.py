"""CLI: python -m engine --preset PATH_OR_NAME --prompt TEXT [--set KEY=VALUE ...] [--chat]
[--model ID_OR_DIR] [--quantization none|int8|nf4] [--dtype auto|float32|bfloat16|float16] [--json]

Bad arguments (an invalid preset or knob value included) exit with code 2 and one line on stderr.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from engine.config import ConfigError, DecodingConfig, check_text, parse_set_value
from engine.backends.local import DTYPES, QUANTIZATIONS, ModelLoadError, ModelSpec
from engine.backends.registry import ModelRegistry
from engine.presets import PresetError, load_preset


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m engine", description="Run one decoding and print its trace.")
    p.add_argument("--preset", default="greedy", help="a built-in preset name or a preset JSON file")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override one knob")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--model", default="embedded", help="'embedded', a local model directory or a Hub id")
    p.add_argument("--quantization", default="none", choices=QUANTIZATIONS)
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="weights and compute dtype (auto: env DP_DTYPE, else float32 on CPU, half precision on a GPU)")
    p.add_argument("--json", action="store_true", help="print exactly one trace JSON object")
    return p


def config_from_args(args: argparse.Namespace) -> DecodingConfig:
    check_text("--preset", args.preset, max_len=4096)
    values = load_preset(args.preset, allow_paths=True).config.to_dict(sparse=True)
    for item in args.set:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError("--set", f"expected KEY=VALUE, got {item[:60]!r}")
        values[key] = parse_set_value(key, text)
    return DecodingConfig.from_dict(values)


def render(trace) -> str:
    """A readable rendering: the text, then one line per step."""
    lines = [f"{trace.model} · {trace.strategy} · {trace.stop_reason} · "
             f"{trace.timing.tokens_per_s:.1f} tok/s · ttft {trace.timing.ttft_ms:.0f} ms", "", trace.text, ""]
    for s in trace.steps:
        draw = f" u={s.draw:.3f}" if s.draw is not None else ""
        stages = " → ".join(f"{st.name}:{st.kept}" for st in s.stages)
        lines.append(f"{s.index:4d} {s.chosen_token!r:>14} p={s.chosen_prob:.3f}{draw} H={s.entropy:.2f}  {stages}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from engine import runner
    from engine.runner import RunRequest

    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
        if not check_text("--prompt", args.prompt, max_len=100_000).strip():
            raise ConfigError("--prompt", "empty; give some text")
        spec = ModelSpec(source=check_text("--model", args.model, max_len=500), quantization=args.quantization,
                         dtype=args.dtype)
    except (ConfigError, PresetError, ModelLoadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        registry = ModelRegistry()
        lm = registry.get(spec)
        trace = runner.run(RunRequest(lm, args.prompt, config, chat=args.chat, registry=registry))
    except (ModelLoadError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(trace.to_json() if args.json else render(trace))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
