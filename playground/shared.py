"""What every view shares: the model registry (the only process-wide mutable state), the model and
quantization pickers, the browser-stored user presets, the model-event registrar, and the one
method every run goes through (``Shared.stream`` / ``Shared.branch``, both over engine.runner).

A view module exposes ``build_tab(shared: Shared)`` (the app calls it inside a gr.Tab) and
returns its typed handle (``PanelView`` for views that share links restore). Model events are
registered through ``shared.events`` (playground/events.py), never with their own queue kwargs.
"""

from __future__ import annotations

import dataclasses
import html
import inspect
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol, Sequence, TypeVar, runtime_checkable

import gradio as gr

from engine import runner
from engine.base.seam import Model
from engine.runner import RunRequest
from engine.config import STRATEGIES, ConfigError, DecodingConfig, check_flag, check_text
from engine.control import RunControl
from engine.backends.local import EMBEDDED, QUANTIZATIONS, ModelLoadError, ModelSpec
from engine.backends.registry import ModelPolicy, ModelRegistry
from engine.backends.registry import is_remote_source, model_policy
from engine.backends.client import RemoteError
from engine.backends.served import MODES, ModelPick
from engine.presets import load_preset
from engine.reports.lessons import Lesson
from engine.scheduler import Scheduler, Schedulers
from engine.settings import env_text
from engine.trace import Event, Trace, untrusted_trace

from .events import ModelEvents, claim_model_slot, toast_text
from .page_js import RUN_BUTTONS
from .user_presets import matching_choice

T = TypeVar("T")

USER_PRESETS_KEY = "decoding-playground-user-presets"
# The browser encrypts stored presets with this; a fixed value lets them survive app restarts.
BROWSER_SECRET = env_text("DP_BROWSER_SECRET")
MAX_PROMPT_CHARS = 8_000
SESSION_TTL_S = 3600  # gr.State of an idle session is dropped after this


class UserError(ValueError):
    """Bad input from the page: shown next to the control, nothing else changes."""


# What a served model (engine.backends) cannot give a view or strategy, by what the page calls it:
# the API hands out a top-N per token, not the model's logits, weights, hidden states or cache.
def require(lm: Any, what: str) -> None:
    """UserError when ``lm``'s capabilities lack what a view needs (``what``: "quantization" or
    "KV cache", engine.base.seam.VIEW_NEEDS), in the engine's own words."""
    reason = lm.capabilities.lacks(what)
    if reason:
        raise UserError(reason)


MAX_MESSAGE_CHARS = 300


def one_line(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``message`` as one line of at most ``limit`` characters (a huge echoed input is cut)."""
    text = " ".join(message.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


@dataclass(frozen=True)
class CheckedRegistry:
    """The registry as the page may use it: every load, drafters and amateurs named in a config or
    a share link included (``model:<x>``), is checked against the model policy first."""

    registry: ModelRegistry
    policy: ModelPolicy

    def get(self, spec: ModelSpec, progress: Callable[[str], None] | None = None, *, key: str = "model") -> Model:
        self.policy.check(spec.source, key)
        claim_model_slot(is_remote_source(spec.source))  # a drafter or amateur of another kind: that pool's slot too
        return self.registry.get(spec, progress, key=key)

    def lend(self, spec: ModelSpec, use: Callable[[Model], T], *, key: str = "model") -> T:
        """``ModelRegistry.lend`` (a report's variant, released after ``use``), the policy checked first."""
        self.policy.check(spec.source, key)
        claim_model_slot(is_remote_source(spec.source))
        return self.registry.lend(spec, use, key=key)

    def check_room(self, need: int, what: str, key: str = "model") -> None:
        self.registry.check_room(need, what, key=key)

    def loaded(self) -> list[ModelSpec]:
        return self.registry.loaded()


@dataclass
class Shared:
    registry: ModelRegistry
    model: gr.Dropdown  # "embedded", or another source the model policy allows
    quantization: gr.Dropdown  # engine.backends.local.QUANTIZATIONS: none | int8 | nf4 | rtn/gptq/awq-g64/g32 | ...
    user_presets: gr.BrowserState  # list of preset JSON objects (engine.presets format)
    events: ModelEvents = dataclasses.field(default_factory=ModelEvents)
    policy: ModelPolicy = dataclasses.field(default_factory=model_policy)
    max_prompt_tokens: int = 2048
    schedulers: Schedulers = dataclasses.field(default_factory=Schedulers)  # the app's own, one per model
    whatif: Any = None  # the app's one WhatIfService (playground.whatif_service), set by build_app

    def lm(self, source: str, quantization: str, progress: Callable[[str], None] | None = None) -> Model:
        """The loaded model if the policy allows ``source``, else a UserError naming what is wrong;
        a served model is connected to on first use (a failed connection: its one-line RemoteError).
        ``source`` is a model pick's value (engine.backends.served.ModelPick: ``fast:<server>`` runs
        that server in fast mode). The run takes a slot of the model's kind here
        (playground.events.claim_model_slot)."""
        pick = ModelPick.parse(source) if isinstance(source, str) else ModelPick(source)
        try:
            spec = self.spec(pick.source, quantization)
            claim_model_slot(is_remote_source(spec.source))
            lm = self.registry.get(spec, progress)
        except (ModelLoadError, RemoteError) as exc:
            raise UserError(one_line(str(exc))) from None
        if pick.mode == "step":
            return lm
        if lm.capabilities.in_process:
            raise UserError(f"model: {source[:80]!r}: fast mode needs a served model (the server's own sampler)")
        return lm.with_mode(pick.mode)

    def loaded_lm(self, source: Any, quantization: Any) -> Model | None:
        """The model the pickers name if the policy allows it and it is loaded already, else None
        (a page route that must not load a model: engine.backends.registry.ModelRegistry.peek)."""
        try:
            spec = self.spec(source, quantization)
        except ModelLoadError as exc:
            raise UserError(one_line(str(exc))) from None
        return self.registry.peek(spec)

    def spec(self, source: Any, quantization: Any) -> ModelSpec:
        """The pickers' values as a ModelSpec the policy allows (ModelLoadError otherwise); a served
        model has no bitsandbytes quantization here (its server quantized it): "none"."""
        source = self.policy.check((source or EMBEDDED).strip() if isinstance(source, str) else source)
        return ModelSpec(source=source, quantization="none" if is_remote_source(source) else quantization or "none")

    def prepare(self, panel: Any, values: Sequence, model: str, quantization: str, prompt: str,
                chat: bool) -> tuple[DecodingConfig, Model, list[int]]:
        """Validate a run's inputs: the panel's config, the model, the prompt ids (UserError if bad)."""
        config = panel.config(*values)
        lm = self.lm(model, quantization)
        return config, lm, self.encode_prompt(lm, prompt, chat)

    def encode_prompt(self, lm: Model, prompt: Any, chat: bool) -> list[int]:
        """Validated prompt ids: a string, not empty, not too long."""
        try:
            prompt = check_text("prompt", prompt, max_len=MAX_PROMPT_CHARS, allow_empty=True)
        except ConfigError as exc:
            raise UserError(str(exc)) from None
        if not prompt.strip():
            raise UserError("prompt: empty; type something for the model to continue")
        try:
            check_flag("chat", chat)
        except ConfigError as exc:
            raise UserError(str(exc)) from None
        try:
            ids = lm.encode(prompt, chat)
        except ModelLoadError as exc:
            raise UserError(one_line(str(exc))) from None
        if len(ids) > self.max_prompt_tokens:
            raise UserError(f"prompt: {len(ids):,} tokens is over the {self.max_prompt_tokens:,}-token limit")
        return ids

    def scheduler_for(self, lm: Model) -> Scheduler | None:
        """The batched scheduler of ``lm``: every user's greedy/sampling runs share its forwards
        (None for a served model: its server batches)."""
        return self.schedulers.get(lm) if lm.capabilities.scheduled else None

    def stream(self, lm: Model, prompt: str, config: DecodingConfig, *, chat: bool, prompt_ids: Sequence[int],
               control: RunControl, compare_baseline: bool = False) -> Iterator[Event]:
        """Every run of every view and endpoint: engine.runner.stream with this app's registry.
        ``chat`` and ``compare_baseline`` must be True or False (a UserError names them otherwise)."""
        for key, flag in (("chat", chat), ("compare_baseline", compare_baseline)):
            try:
                check_flag(key, flag)
            except ConfigError as exc:
                raise UserError(str(exc)) from None
        reason = STRATEGIES[config.strategy].unavailable(lm.capabilities)
        if reason:
            raise UserError(reason)
        return runner.stream(RunRequest(lm, prompt, config, chat=chat, prompt_ids=prompt_ids,
                             registry=CheckedRegistry(self.registry, self.policy),
                             control=control, compare_baseline=compare_baseline, scheduler=self.scheduler_for(lm)))

    def run(self, lm: Model, prompt: str, config: DecodingConfig, *, chat: bool, prompt_ids: Sequence[int],
            control: RunControl, compare_baseline: bool = False) -> Trace:
        """``stream`` collected: the run's Trace."""
        for event in self.stream(lm, prompt, config, chat=chat, prompt_ids=prompt_ids, control=control,
                                 compare_baseline=compare_baseline):
            if event.trace is not None:
                return event.trace
        raise RuntimeError("run ended without a trace")

    def branch(self, lm: Model, parent: Trace, at_step: int, token_id: int | None, *,
               control: RunControl) -> Iterator[Event]:
        """``parent`` continued from ``at_step`` with ``token_id`` (None: drawn under the parent's knobs;
        one prefill, no kept cache)."""
        return runner.branch(lm, parent, at_step, token_id, control=control, scheduler=self.scheduler_for(lm))

    def api_config(self, preset: Any, overrides: Any, *, default_strategy: str,
                   strategies: Sequence[str]) -> DecodingConfig:
        """An API call's config: a built-in preset (or preset JSON) overridden by ``config`` knobs;
        the strategy must be one of ``strategies`` (a single one is forced)."""
        if overrides is not None and not isinstance(overrides, dict):
            raise ConfigError("config", f"expected an object of knobs, got {type(overrides).__name__}")
        base = load_preset(preset).config.to_dict(sparse=True) if preset else {"strategy": default_strategy}
        values = base | dict(overrides or {})
        if len(strategies) == 1:
            values["strategy"] = strategies[0]
        config = DecodingConfig.from_dict(values)
        if config.strategy not in strategies:
            raise ConfigError("strategy", f"this endpoint runs {' | '.join(strategies)}, got {config.strategy!r}")
        return config

    def trace_json(self, prompt: Any, config: Any, preset: Any, chat: bool, model: str, quantization: str, *,
                   strategies: Sequence[str], control: RunControl, compare_baseline: bool = False,
                   default_strategy: str | None = None) -> dict:
        """The one body of every run endpoint (/step_trace, /beam_trace, /speculative_trace,
        /mcts_trace, /medusa_trace, /eagle_trace): the call's config (``api_config``; without a preset,
        ``default_strategy``, else the first of ``strategies``), the model, the prompt's ids, the
        run, its trace JSON. Each endpoint keeps its own signature: its parameters' names, order and
        defaults are the public API (whose boundary, ``config.check_arguments``, has checked each
        argument's type: ``compare_baseline`` is true or false here)."""
        cfg = self.api_config(preset, config, default_strategy=default_strategy or strategies[0], strategies=strategies)
        lm = self.lm(model, quantization)
        prompt_ids = self.encode_prompt(lm, prompt, chat)
        return self.run(lm, prompt, cfg, chat=chat, prompt_ids=prompt_ids, control=control,
                        compare_baseline=compare_baseline).to_dict()


MAX_CHOICE_CHARS = 1_000  # a value of a choice component (dropdown, radio, checkbox group); the longest choice is ~100
MAX_INPUT_CHARS = 1 << 20  # any other text a page event sends (the prompt's own limit is 8,000; a pasted lesson 32 KB)
MAX_INPUT_ITEMS = 10_000  # items of a list a page event sends


class PlaygroundBlocks(gr.Blocks):
    """gr.Blocks whose named API endpoints (``gr.api``) take a raw call with too few arguments as
    gradio_client does: missing trailing arguments get their defaults, and a missing required one
    is a one-line error naming it (Gradio's own check answers such a call with ``{"error": null}``).

    Every echo is capped: a page event's value over its size (``MAX_CHOICE_CHARS`` for a choice
    component, ``MAX_INPUT_CHARS`` for any other text, ``MAX_INPUT_ITEMS`` a list) is refused in
    one line naming the component before Gradio reads it (Gradio would keep it in the session and
    quote it whole in its "not in the list of choices" error: a 10 MB reply and log line); and any
    error Gradio raises while reading inputs is cut to one line (``one_line``)."""

    def validate_inputs(self, block_fn: Any, inputs: list[Any]) -> None:
        from gradio.components.api_component import Api

        wanted = block_fn.inputs
        if len(inputs) < len(wanted) and wanted and all(isinstance(b, Api) for b in wanted):
            params = list(inspect.signature(block_fn.fn).parameters.values())[:len(wanted)]
            for param in params[len(inputs):]:
                if param.default is inspect.Parameter.empty:
                    raise gr.Error(f"{param.name}: missing; this endpoint needs it (see the app's API page)")
                inputs.append(param.default)
        for block, value in zip(wanted, inputs):
            if not isinstance(block, Api):
                check_input_size(block, value)
        super().validate_inputs(block_fn, inputs)

    async def preprocess_data(self, block_fn: Any, inputs: list[Any], state: Any, explicit_call: bool = False) -> Any:
        try:
            return await super().preprocess_data(block_fn, inputs, state, explicit_call)
        except gr.Error as exc:
            raise gr.Error(toast_text(one_line(str(exc.message))), print_exception=False) from None


def check_input_size(block: Any, value: Any) -> None:
    """gr.Error naming ``block`` (its label) when ``value`` is over the size a page event may send."""
    limit = MAX_CHOICE_CHARS if isinstance(block, (gr.Dropdown, gr.Radio, gr.CheckboxGroup)) else MAX_INPUT_CHARS
    items = value if isinstance(value, list) else [value]
    name = str(getattr(block, "label", None) or getattr(block, "elem_id", None) or type(block).__name__)[:60]
    if len(items) > MAX_INPUT_ITEMS:
        raise gr.Error(toast_text(f"{name}: {len(items):,} items is over the {MAX_INPUT_ITEMS:,}-item limit"),
                       print_exception=False)
    for item in items:
        if isinstance(item, str) and len(item) > limit:
            raise gr.Error(toast_text(f"{name}: a value of {len(item):,} characters is over the "
                                      f"{limit:,}-character limit"), print_exception=False)


@runtime_checkable
class LessonTarget(Protocol):
    """A page a lesson's "Open in its view" fills (Step through, Beam, Speculative, Compare,
    Quantization & KV cache), so the Lessons tab opens a lesson without importing any view: the app
    (the one place that knows every view) hands it the pages. ``name``: the share-link view name
    (its tab is ``tab-<name>``, a lesson's ``view``)."""

    @property
    def name(self) -> str: ...

    def lesson_outputs(self) -> list:
        """Every component ``lesson_updates`` may set."""
        ...

    def lesson_updates(self, lesson: Lesson, stored: Any, allowed: Sequence[str] | None) -> tuple[dict, str]:
        """Updates putting ``lesson`` into the page (``stored``: the browser's user presets, for the
        preset pickers' labels; ``allowed``: the servers the operator lists) and the id of the button
        that runs it there; LessonError or UserError when the lesson cannot open here."""
        ...


@dataclass
class PanelView:
    """A view's handle for the share-link loader and for lessons (a LessonTarget): its prompt, chat
    checkbox and knob panel."""

    name: str  # the share-link view name; its tab id is ``tab-<name>``
    prompt: gr.Textbox
    panel: Any  # playground.knobs.KnobPanel
    chat: gr.Checkbox | None = None

    def lesson_outputs(self) -> list:
        return [self.prompt, *([self.chat] if self.chat is not None else []), *self.panel.inputs,
                self.panel.preset, self.panel.modified]

    def lesson_updates(self, lesson: Lesson, stored: Any, allowed: Sequence[str] | None) -> tuple[dict, str]:
        """The lesson's prompt, chat and first preset in the view's knob panel, and its run button."""
        preset = lesson.runs[0]
        choice, modified = matching_choice(preset.config, stored, preset.name)
        updates = {self.prompt: lesson.prompt} | self.panel.apply_preset(preset, choice, modified)
        if self.chat is not None:
            updates[self.chat] = lesson.chat
        return updates, RUN_BUTTONS.get(self.name, "")


@dataclasses.dataclass
class OutputSet:
    """Base for a view's bundle of output components (a dataclass): ``all()`` lists them, for an
    event's ``outputs=``; handlers return ``{component: value}`` dicts, so order never matters."""

    def all(self) -> list:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]


def throttle(events: Iterator[Event], every_s: float) -> Iterator[tuple[Event, bool]]:
    """The run's events, each with whether to redraw now: at most every ``every_s`` seconds, and
    always at the last event (the one carrying the Trace)."""
    last = 0.0
    for event in events:
        now = time.perf_counter()
        redraw = event.trace is not None or now - last >= every_s
        if redraw:
            last = now
        yield event, redraw


def config_or_error(values: dict[str, Any]) -> DecodingConfig:
    try:
        return DecodingConfig.from_dict(values)
    except ConfigError as exc:
        raise UserError(str(exc)) from None


def error_html(message: str) -> str:
    return f'<div class="dp-error" role="alert">⚠ {html.escape(message)}</div>'


def status_html(message: str) -> str:
    return f'<div class="dp-status">{html.escape(message)}</div>'


def model_pickers(default_model: str = EMBEDDED, offered: Sequence[str] = (EMBEDDED,)) -> tuple[gr.Dropdown, gr.Dropdown]:
    model = gr.Dropdown(
        choices=list(dict.fromkeys([*offered, default_model])), value=default_model, allow_custom_value=True, label="Model",
        info="'embedded' (SmolLM2-135M-Instruct, offline), a model the operator allows (DP_MODELS), or a server the "
             "operator lists (DP_REMOTE_MODELS: llamacpp:/openai: backend and URL)",
        elem_id="dp-model", scale=3,
    )
    quant = gr.Dropdown(list(QUANTIZATIONS), value="none", label="Quantization",
                        info="int8 / nf4: bitsandbytes at load; rtn / gptq / awq: 4-bit checkpoints made here (make quantize)",
                        elem_id="dp-quant", scale=2)
    return model, quant


# --- a served model's mode: one radio, the same in Step through and in every Compare lane ----------------
REMOTE_MODES = MODES  # the radio's choices: engine.backends.served.MODES
REMOTE_MODE_LABEL = "Served model: who picks each token"
REMOTE_MODE_INFO = ("step: one request per token; our stages and our seeded draw over the server's top 100, every "
                    "stage drawn (exact up to the top-N). fast: one streamed request; the server's own sampler picks, "
                    "and each token shows its raw and final top-N (no stages in between; a branch from it goes on in "
                    "step mode).")


def remote_mode_radio(elem_id: str, value: str = "step", visible: bool = False) -> gr.Radio:
    """The step | fast radio shown beside a served model's pick (Step through's model box, a Compare
    lane's model): the one way the page shows a served model's mode."""
    return gr.Radio(REMOTE_MODES, value=value, label=REMOTE_MODE_LABEL, info=REMOTE_MODE_INFO, visible=visible,
                    elem_id=elem_id)


def with_mode(model: Any, mode: Any, api: bool = False) -> Any:
    """The model pick's value (engine.backends.served.ModelPick, read by ``Shared.lm``) of a model box's
    ``model`` and the mode radio's ``mode``: "fast" runs a served model in fast mode, "step" keeps
    the pick as it is. A UserError naming ``remote_mode`` for another value, or, for an API call (the
    page hides the radio then), for fast on a model loaded here."""
    if mode not in MODES:
        raise UserError(f"remote_mode: expected step or fast, got {str(mode)[:40]!r}")
    if mode == "step" or not isinstance(model, str):
        return model
    source = ModelPick.parse(model).source
    if not is_remote_source(source):
        if api:
            raise UserError(f"remote_mode: fast needs a served model; model {model[:60]!r} runs here (use step)")
        return model
    return ModelPick(source, "fast").value


def shown_pick(value: Any) -> tuple[str, dict]:
    """A pick's value as the page shows it: (the model box's value, the mode radio's update: its
    mode, shown only for a served model)."""
    pick = ModelPick.parse(value if isinstance(value, str) else "")
    return pick.source, gr.update(value=pick.mode, visible=is_remote_source(pick.source))


def wire_model_check(shared: Shared) -> gr.HTML:
    """The model box's check, as a person picks a model: the policy first (a value not offered is
    refused in one line), and a served model is connected to at once. A refused or unreachable
    pick puts the previous model back in the box, with the one line below it. Returns that line's
    component (laid out where this is called)."""
    status = gr.HTML("", elem_id="dp-model-status")
    current = gr.State(shared.model.value)  # the last model this page picked that worked

    def on_model(picked: Any, last: Any, *, control: RunControl) -> Iterator[dict]:
        control.check()
        try:
            spec = shared.spec(picked, "none")
            lm = shared.lm(spec.source, "none") if is_remote_source(spec.source) else None
        except (ModelLoadError, UserError) as exc:
            yield {shared.model: last, status: error_html(f"{one_line(str(exc))}; still using {last}")}
            return
        note = f"model: {picked} (a served model, step mode: our stages over its top-{lm.capabilities.top_n})" if lm else ""
        yield {current: picked, status: status_html(note) if note else ""}

    shared.events.on([shared.model.input], on_model, [shared.model, current], [shared.model, current, status],
                     on_error=lambda message: {status: error_html(message)}, what="model")
    return status


def user_presets_state() -> gr.BrowserState:
    return gr.BrowserState([], storage_key=USER_PRESETS_KEY, secret=BROWSER_SECRET)


def page_width(value: Any) -> float | None:
    """The page width the page's script wrote (px), or None when it is not known (yet)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None


def parent_trace(shared: Shared, lm: Model, parent: Any, key: str = "parent") -> Trace:
    """An untrusted trace JSON (object or text) as a Trace whose token ids fit ``lm``; errors name
    ``key`` (the API argument that carried it)."""
    try:
        trace = untrusted_trace(parent, key)  # size-capped as a run (engine.trace.check_trace_size)
    except ConfigError as exc:
        raise UserError(str(exc)) from None
    ids = [*trace.prompt_token_ids, *trace.generated_token_ids]
    if not trace.prompt_token_ids or len(trace.prompt_token_ids) > shared.max_prompt_tokens:
        raise UserError(f"{key}: prompt_token_ids must hold 1 to {shared.max_prompt_tokens} tokens")
    if not all(_token_in(i, lm) for i in ids):
        raise UserError(f"{key}: token ids must be integers in [0, {lm.vocab_size})")
    check_parent_steps(trace, lm, key)
    return trace


def _token_in(value: Any, lm: Model) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < lm.vocab_size


def check_parent_steps(trace: Trace, lm: Model, key: str = "parent") -> None:
    """The token ids inside a parent's steps (each step's ``chosen_token_id``, the same as its
    ``generated_token_ids`` entry, and its stages' top and removed ids) fit ``lm``: a branch
    keeps and shows the steps before it, so a forged id would be echoed or decoded. UserError
    naming the field otherwise."""
    generated = trace.generated_token_ids
    for i, step in enumerate(trace.steps):
        if not _token_in(step.chosen_token_id, lm) or (i < len(generated) and step.chosen_token_id != generated[i]):
            raise UserError(f"{key}: steps[{i}].chosen_token_id: expected generated_token_ids[{i}], an integer in "
                            f"[0, {lm.vocab_size}), got {str(step.chosen_token_id)[:40]}")
        for stage in step.stages:
            if not all(_token_in(t.token_id, lm) for t in [*stage.top, *stage.removed]):
                raise UserError(f"{key}: steps[{i}].stages ({str(stage.name)[:40]!r}): token ids must be integers "
                                f"in [0, {lm.vocab_size})")
