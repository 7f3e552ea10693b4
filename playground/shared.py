"""What every view shares: the model registry (the only process-wide mutable state), the model and
quantization pickers, the browser-stored user presets, and helpers to turn errors into messages.

A view module exposes ``build_tab(shared: Shared) -> None``; the app calls it inside a gr.Tab.
Every event that touches the model passes ``**shared.model_event`` (one queue, one concurrency
limit) and a named ``api_name``.
"""

from __future__ import annotations

import dataclasses
import html
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import gradio as gr
import torch

from engine.config import ConfigError, DecodingConfig
from engine.models import EMBEDDED, QUANTIZATIONS, LoadedModel, ModelLoadError, ModelRegistry, ModelSpec

MODEL_CONCURRENCY_ID = "model"
USER_PRESETS_KEY = "decoding-playground-user-presets"
# The browser encrypts stored presets with this; a fixed value lets them survive app restarts.
BROWSER_SECRET = os.environ.get("DP_BROWSER_SECRET", "decoding-playground-presets-v1")
MAX_PROMPT_CHARS = 8_000


def default_concurrency() -> int:
    """How many model events run at once: 1 on CPU (two would only share the cores), more on GPU."""
    env = os.environ.get("DP_CONCURRENCY")
    if env and env.isdigit() and int(env) > 0:
        return int(env)
    return 4 if torch.cuda.is_available() else 1


@dataclass
class Shared:
    registry: ModelRegistry
    model: gr.Dropdown  # "embedded", a local directory or a Hub id
    quantization: gr.Radio  # none | int8 | nf4
    user_presets: gr.BrowserState  # list of preset JSON objects (engine.presets format)
    max_prompt_tokens: int = 2048
    concurrency_limit: int = 1
    share_state: gr.State | None = None  # set by the app: restored share-link payload, if any
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def model_event(self) -> dict[str, Any]:
        """kwargs for every event that touches the model."""
        return {"concurrency_id": MODEL_CONCURRENCY_ID, "concurrency_limit": self.concurrency_limit}

    def lm(self, source: str, quantization: str, progress: Callable[[str], None] | None = None) -> LoadedModel:
        """The loaded model, or a UserError naming what is wrong."""
        try:
            spec = ModelSpec(source=(source or EMBEDDED).strip(), quantization=quantization or "none")
            return self.registry.get(spec, progress)
        except ModelLoadError as exc:
            raise UserError(str(exc)) from None

    def prepare(self, panel: Any, values: tuple, model: str, quantization: str, prompt: str,
                chat: bool) -> tuple[DecodingConfig, LoadedModel, list[int]]:
        """Validate a run's inputs: the panel's config, the model, the prompt ids (UserError if bad)."""
        config = panel.config(*values)
        lm = self.lm(model, quantization)
        return config, lm, self.encode_prompt(lm, prompt, chat)

    def encode_prompt(self, lm: LoadedModel, prompt: str, chat: bool) -> list[int]:
        """Validated prompt ids: not empty, not too long."""
        if not prompt or not prompt.strip():
            raise UserError("prompt: empty; type something for the model to continue")
        if len(prompt) > MAX_PROMPT_CHARS:
            raise UserError(f"prompt: {len(prompt):,} characters is over the {MAX_PROMPT_CHARS:,}-character limit")
        try:
            ids = lm.encode(prompt, chat)
        except ModelLoadError as exc:
            raise UserError(str(exc)) from None
        if len(ids) > self.max_prompt_tokens:
            raise UserError(f"prompt: {len(ids):,} tokens is over the {self.max_prompt_tokens:,}-token limit")
        return ids


def gpu_task(fn: Callable) -> Callable:
    """On a ZeroGPU Space (the ``spaces`` package importable and SPACE_ID set) a handler must run
    under ``spaces.GPU`` to get a GPU; everywhere else this returns ``fn`` unchanged."""
    if not os.environ.get("SPACE_ID"):
        return fn
    try:
        import spaces  # type: ignore[import-not-found]
    except ImportError:
        return fn
    return spaces.GPU(fn)


class OutputSet:
    """Base for a view's bundle of output components (a dataclass): ``all()`` lists them in
    declaration order, the order every handler returns its updates in."""

    def all(self) -> list:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]


class UserError(ValueError):
    """Bad input from the page: shown next to the control, nothing else changes."""


def guarded(updates: Iterator[list], on_error: Callable[[str], list], what: str = "generation") -> Iterator[list]:
    """Never let an exception reach the page as a crash: bad input (and model load failures) show
    their own message next to the controls; anything else says what failed."""
    try:
        yield from updates
    except (UserError, ValueError, ConfigError, ModelLoadError) as exc:
        yield on_error(str(exc))
    except Exception as exc:  # a model failure must not take the page down
        yield on_error(f"{what} failed: {type(exc).__name__}: {exc}")


def config_or_error(values: dict[str, Any]) -> DecodingConfig:
    try:
        return DecodingConfig.from_dict(values)
    except ConfigError as exc:
        raise UserError(str(exc)) from None


def error_html(message: str) -> str:
    return f'<div class="dp-error" role="alert">⚠ {html.escape(message)}</div>'


def status_html(message: str) -> str:
    return f'<div class="dp-status">{html.escape(message)}</div>'


def model_pickers(default_model: str = EMBEDDED) -> tuple[gr.Dropdown, gr.Radio]:
    model = gr.Dropdown(
        choices=[EMBEDDED], value=default_model, allow_custom_value=True, label="Model",
        info="'embedded' (SmolLM2-135M-Instruct, offline), a local model directory, or a Hub id (needs network)",
        elem_id="dp-model", scale=3,
    )
    quant = gr.Radio(list(QUANTIZATIONS), value="none", label="Quantization (bitsandbytes)", elem_id="dp-quant", scale=2)
    return model, quant


def user_presets_state() -> gr.BrowserState:
    return gr.BrowserState([], storage_key=USER_PRESETS_KEY, secret=BROWSER_SECRET)
