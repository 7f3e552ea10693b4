"""Entry point: load the default model, build the UI, launch.

Host and port follow Gradio's own GRADIO_SERVER_NAME / GRADIO_SERVER_PORT (default
127.0.0.1:7860). On Hugging Face Spaces (SPACE_ID set) the server listens on 0.0.0.0.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Decoding Playground")
    p.add_argument("--model", default=os.environ.get("DP_MODEL", "embedded"),
                   help="default model: 'embedded', a local directory or a Hub id (env DP_MODEL)")
    p.add_argument("--quantization", default=os.environ.get("DP_QUANTIZATION", "none"), choices=("none", "int8", "nf4"))
    p.add_argument("--no-preload", action="store_true", help="load the model on the first request instead of at start")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    from engine.models import ModelLoadError, ModelRegistry, ModelSpec
    from playground.app import build_app, launch_kwargs

    registry = ModelRegistry()
    if not args.no_preload:
        try:
            lm = registry.get(ModelSpec(args.model, args.quantization), progress=print)
            print(f"Loaded {lm.name} ({lm.quantization}) on {lm.device} in {lm.load_seconds:.1f} s")
        except ModelLoadError as exc:
            print(f"error: {exc}", file=sys.stderr)
            if args.model == "embedded":
                return 1
            print("Falling back to the embedded model.", file=sys.stderr)
            args.model = "embedded"
            registry.get(ModelSpec("embedded"), progress=print)
    demo = build_app(registry, default_model=args.model)
    if os.environ.get("SPACE_ID"):
        os.environ.setdefault("GRADIO_SERVER_NAME", "0.0.0.0")
    demo.launch(**launch_kwargs())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
