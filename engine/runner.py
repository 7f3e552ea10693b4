"""One entry point for every strategy: ``run`` (a whole Trace) and ``stream`` (events as they come).

Strategy modules each provide ``run(lm, prompt, config, *, chat, registry) -> Trace``. The CLI, the
API endpoints and the benchmarks all come through here, so they emit the same trace JSON.
"""

from __future__ import annotations

import importlib

from .config import DecodingConfig
from .models import LoadedModel, ModelRegistry
from .trace import Trace

# strategy -> module providing run(...)
STRATEGY_MODULES = {
    "greedy": "engine.decode",
    "sample": "engine.decode",
    "beam": "engine.beam",
    "speculative": "engine.speculative",
    "contrastive_search": "engine.contrastive",
    "contrastive_decoding": "engine.contrastive",
}


class StrategyUnavailable(RuntimeError):
    pass


def strategy_module(strategy: str):
    try:
        return importlib.import_module(STRATEGY_MODULES[strategy])
    except ModuleNotFoundError as exc:
        raise StrategyUnavailable(f"strategy: {strategy!r} is not available in this build ({exc.name})") from None


def run(lm: LoadedModel, prompt: str, config: DecodingConfig, *, chat: bool = False,
        registry: ModelRegistry | None = None) -> Trace:
    module = strategy_module(config.strategy)
    if config.strategy in ("greedy", "sample"):
        return module.run(lm, prompt, config, chat=chat)
    return module.run(lm, prompt, config, chat=chat, registry=registry or ModelRegistry())
