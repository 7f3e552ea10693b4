"""A stage: the ``Stage`` base (``apply``, the stateful API), the wrapper over transformers' logits
processors, and ``build_stage`` / ``share_key``, which read a stage's spec (``engine.stages.spec``).

A stage is a small named pure object ``(input_ids, logits) -> logits`` [B, S], [B, V] -> [B, V]: it
returns a new tensor and never modifies its inputs. Its family module declares its class and, right
under it, its ``register(StageSpec(...))``."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from engine.stages.spec import (STAGES, BuildContext, ConfigError)

if TYPE_CHECKING:
    from engine.config import DecodingConfig


class Stage:
    """A named transformation of next-token logits.

    ``apply(input_ids, logits)`` is the stage: it returns the new logits and what the call found
    out (its diagnostics, for row 0: DRY's penalised tokens, XTC's draw, mirostat's μ and kept
    count, ...; {} for most stages), as values: the chain records ``knobs | diagnostics``. A stage
    implements ``apply``; ``run`` is ``apply`` remembering the diagnostics, and calling the stage
    returns the logits alone. ``knobs`` are what it was built with; ``params`` (read-only) is
    ``knobs`` plus the last call's diagnostics, for a caller that holds the stage.

    Stateful stages (``stateful``: state across steps, or draws) follow llama.cpp's sampler API:
    ``accept(input_ids, token_id)`` after every pick (what it learnt, as values), ``reset()`` back to
    a fresh stage, ``clone()`` an independent copy in the same state, and ``state()`` /
    ``load_state(state)``: what the last call depended on besides its knobs, ids and logits, and
    putting it into a stage so its next call behaves as that one (what-if, without replaying)."""

    name: str = "stage"
    stateful: bool = False  # True: keeps state across steps or draws random numbers
    carries: bool = False  # True: state carried across steps (not only a draw): resuming needs its record

    def __init__(self, **knobs: Any):
        self.knobs = knobs
        self._last: dict[str, Any] = {}  # the last call's (and pick's) diagnostics, for ``params``

    def apply(self, input_ids: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        """The new logits [B, V] and this call's diagnostics (JSON-ready)."""
        raise NotImplementedError

    def run(self, input_ids: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        """``apply``, remembering the diagnostics for ``params`` (the chain calls this)."""
        out, self._last = self.apply(input_ids, logits)
        return out, self._last

    def __call__(self, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return self.run(input_ids, logits)[0]

    @property
    def params(self) -> dict[str, Any]:
        """The knobs and the last call's diagnostics (a new dict: writing to it changes nothing)."""
        return {**self.knobs, **self._last}

    def accept(self, input_ids: torch.Tensor, token_id: int) -> dict[str, Any]:
        """Called after every pick with the ids before it [1, S] and the token picked; returns what
        the stage learnt from it (mirostat: μ after, the surprise), {} for most."""
        return {}

    def reset(self) -> None:
        """Back to the state of a freshly built stage."""
        self._last = {}

    def clone(self) -> "Stage":
        """An independent copy in the same state (the run's generator, if any, is shared)."""
        twin = copy.copy(self)
        twin._last = dict(self._last)
        return twin

    def state(self) -> dict[str, Any]:
        """What the last call depended on besides the knobs, ids and logits (JSON-ready); {} for a
        stateless stage."""
        return {}

    def skip(self) -> None:
        """Consume what one call draws from the run's generator, computing nothing (a branch brings
        the generator to its step this way instead of replaying the steps before it)."""

    def resume(self, state: dict[str, Any]) -> None:
        """Carry into this stage what it had carried to the step that recorded ``state`` (its
        ``state()`` there), so a branch from that step goes on as the run did without replaying the
        steps before it: mirostat's μ. Stages whose state is a draw (XTC) take nothing: ``skip``
        already brought the generator to the same draw."""

    def load_state(self, state: dict[str, Any]) -> None:
        """Make the next call behave as the call that reported ``state`` (see ``state``)."""

    def prepare(self, input_ids: torch.Tensor) -> None:
        """Start, off the caller's thread, what the next call after ``input_ids`` [1, S] needs (the
        grammar's mask): the batched scheduler calls this after each pick, so that work runs beside
        its next forward. Most stages need nothing."""

    def ready(self) -> bool:
        """Whether the next call would start at once, not waiting for what ``prepare`` started
        (the scheduler's row skips its ticks until then). True for most stages."""
        return True

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.knobs.items())
        return f"{type(self).__name__}({args})"


def require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(key, f"{value!r} is out of range; allowed {allowed}")


class Wrapped(Stage):
    """A stage that delegates to one of transformers' logits processors."""

    def __init__(self, processor: Callable, **knobs: Any):
        super().__init__(**knobs)
        self._processor = processor

    def apply(self, input_ids, logits):
        # transformers' processors are out-of-place (test_stage_never_modifies_input guards this)
        return self._processor(input_ids, logits), {}


# The samplers at parity with llama.cpp / text-generation-webui follow their references: llama.cpp
# src/llama-sampling.cpp (temp-ext, top-n-sigma, XTC, mirostat, DRY) and text-generation-webui
# modules/sampler_hijack.py (DRY, quadratic sampling, top-a, dynamic temperature).
def softmax(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] probabilities in float32 (masked tokens get exactly 0)."""
    return torch.softmax(logits.float(), dim=-1)


def build_stage(name: str, config: DecodingConfig, prompt_length: int = 0, tokenizer: Any = None,
                eos_token_ids: Sequence[int] = (), generator: torch.Generator | None = None) -> Stage:
    """One stage from the config's knob(s), by its spec. ``generator``: the run's, for stages that
    draw (XTC)."""
    spec = STAGES.get(name)
    if spec is None:
        raise ConfigError("stage_order", f"unknown stage {name!r}")
    return spec.build(config, BuildContext(prompt_length, tokenizer, eos_token_ids, generator))


# --- many rows at once (the batched scheduler) ---------------------------------------------------------
def share_key(stage: Stage) -> tuple | None:
    """The key under which rows may share one call of ``stage`` (None: it runs per row): its spec
    says ``shareable`` (the output row depends only on that row's logits and on params fixed at
    construction: no input_ids, no state, no draws, params not rewritten per call), and rows whose
    stage has equal params share one call on [G, V]."""
    spec = STAGES.get(stage.name)
    if spec is None or not spec.shareable:
        return None
    return type(stage), tuple(sorted(stage.knobs.items()))
