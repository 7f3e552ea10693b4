"""KnobPanel: a preset picker plus one control per knob, built from the engine's KNOBS (ranges,
neutral values and docs come from engine/config.py, never duplicated here).

Picking a preset fills the controls; editing any control marks the preset as modified. Sampler
knobs are grouped (temperature shaping, truncation, penalties, repetition, adaptive), each group a
collapsible accordion; with the greedy strategy the sampling-only knobs are greyed ("ignored by
greedy", engine.config.SAMPLING_ONLY_STAGES). The stage order is a sortable list (drag, or the ↑/↓
buttons) written into a hidden textbox. ``panel.config(*values)`` turns the controls' values back
into a validated DecodingConfig and reports every invalid knob of a click at once.
"""

from __future__ import annotations

import html
import json
from typing import Any, Sequence

import gradio as gr

from engine import config as engine_config
from engine.config import KNOBS, ConfigError, DecodingConfig, Knob, check_knob
from engine.presets import Preset, builtin_presets
from engine.stages import declared

from .assets import static_text
from .user_presets import CUSTOM, find_preset, preset_choices
from .shared import Shared, UserError, config_or_error

# Sliders read better with a practical top end; the engine's bound still validates (a knob whose full
# range makes a slider useless says Knob.widget "number": a Number input). A str_list knob whose items
# may hold commas or newlines says widget "json": edited as a JSON list, not comma-separated.

# The sampler groups by what they do: (title, open at first) per group key; each stage's spec names
# its group (StageSpec.group). A view shows the groups it has knobs of.
GROUP_TITLES = {
    "temperature": ("Temperature shaping", True),
    "truncation": ("Truncation", True),
    "penalties": ("Penalties", False),
    "repetition": ("Repetition (DRY, no-repeat n-gram)", False),
    "adaptive": ("Adaptive (mirostat, XTC)", False),
    "structured": ("Structured output (grammar)", False),
}


def knob_groups() -> tuple[tuple[str, tuple[str, ...], bool], ...]:
    """(title, knobs, open at first) per sampler group, from the stage specs (in the order they are
    declared, each stage's knobs in its spec's order); a group key without a title is titled by itself."""
    members: dict[str, list[str]] = {key: [] for key in GROUP_TITLES}
    for spec in declared():
        if spec.group is not None:
            members.setdefault(spec.group, []).extend(k.name for k in spec.knobs)
    out = []
    for key, names in members.items():
        if names:
            title, is_open = GROUP_TITLES.get(key, (key.replace("_", " ").capitalize(), False))
            out.append((title, tuple(names), is_open))
    return tuple(out)


def stage_knobs() -> tuple[str, ...]:
    """Every knob of a sampler group, group by group."""
    return tuple(name for _, names, _ in knob_groups() for name in names)


def sampling_knobs() -> tuple[str, ...]:
    """The grouped knobs of the sampling-only stages (greedy greys them)."""
    return tuple(n for n in stage_knobs() if KNOBS[n].stage in engine_config.SAMPLING_ONLY_STAGES)


def __getattr__(name: str) -> Any:
    """``KNOB_GROUPS``, ``STAGE_KNOBS``, ``SAMPLING_KNOBS``: the functions above, read when imported
    (so a stage registered before the import is in them)."""
    tables = {"KNOB_GROUPS": knob_groups, "STAGE_KNOBS": stage_knobs, "SAMPLING_KNOBS": sampling_knobs}
    if name in tables:
        return tables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def strategy_knobs(name: str) -> tuple[str, ...]:
    """The knobs strategy ``name`` declares in its spec (``StrategySpec.knobs``), in its order: a view
    lists them from here, so a knob added to a strategy shows in its view without an edit there."""
    import engine  # noqa: F401  (importing the engine registers every strategy)
    from engine.base.strategy_spec import STRATEGIES

    return tuple(knob.name for knob in STRATEGIES[name].knobs)


# The penalties beam search applies (it ignores the sampling-only stages).
PENALTY_KNOBS = ("repetition_penalty", "frequency_penalty", "presence_penalty", "no_repeat_ngram_size")
IGNORED_BY_GREEDY = "Ignored by greedy (it always takes the most likely token)."
# KnobPanel._preset_note(choice, True), written in the page when a knob is edited: no round trip, and
# the events after it on the same knob (Gradio runs one trigger's events one after another; the
# what-if is one) do not wait for a server note.
MODIFIED_JS = static_text("knobs_modified.js", CUSTOM=json.dumps(CUSTOM))
# The stage order's box changes when the page's sortable list writes it (a person's edit: the list
# sets window.dp.stageEdit) and when a preset or link fills it (not an edit): only the first marks.
STAGE_MODIFIED_JS = static_text("knobs_stage_modified.js", MODIFIED=MODIFIED_JS)


def knob_component(knob: Knob, value: Any = None, prefix: str = "", interactive: bool = True) -> gr.components.Component:
    """One control for a knob; its element id is ``<prefix>knob-<name>``, unique per view."""
    value = knob.neutral if value is None else value
    label = knob.name
    info = knob.doc
    elem_id = f"{prefix}knob-{knob.name}"
    common: dict[str, Any] = {"label": label, "elem_id": elem_id, "interactive": interactive}
    if knob.kind in ("float", "int") and knob.widget == "number":
        # No minimum/maximum here: the engine's validation names the knob and its range in the message.
        return gr.Number(value=value, info=f"{info} Range {knob.range_text()}.", precision=0, **common)
    if knob.kind in ("float", "int"):
        return gr.Slider(minimum=knob.low, maximum=knob.high, value=value, step=knob.step or (1 if knob.kind == "int" else 0.01),
                         info=f"{info} Range {knob.range_text()}.", elem_classes=["dp-knob-slider"], **common)
    if knob.kind == "bool":
        return gr.Checkbox(value=bool(value), info=info, **common)
    if knob.kind == "choice":
        return gr.Dropdown([_choice_label(c) for c in knob.choices], value=_choice_label(value), info=info, **common)
    if knob.kind == "bias_map":
        return gr.Textbox(value=display_value(knob, value), info=f'{info} A JSON object, e.g. {{"sea": -5, "13": 2}}.',
                          **common)
    if knob.kind == "str_list" and knob.widget == "json":
        return gr.Textbox(value=display_value(knob, value), info=f"{info} A JSON list of strings.", **common)
    if knob.kind == "str_list":
        return gr.Textbox(value=", ".join(value), info=f"{info} Comma-separated.", **common)
    if knob.kind == "text":  # several lines (a grammar), at most knob.high characters
        return gr.Textbox(value=str(value), info=f"{info} At most {int(knob.high):,} characters.", lines=4,
                          max_lines=16, **common)
    return gr.Textbox(value=str(value), info=info, **common)


def _choice_label(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _strict_json(knob: Knob, text: Any, expected: type) -> Any:
    """JSON text of a knob's box -> its value; NaN/Infinity and the wrong JSON type are refused."""
    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not allowed")

    try:
        value = json.loads(text or ("{}" if expected is dict else "[]"), parse_constant=no_constants)
    except ValueError as exc:
        raise UserError(f"{knob.name}: not valid JSON ({str(exc)[:80]}); expected {knob.range_text()}") from None
    if not isinstance(value, expected):
        raise UserError(f"{knob.name}: expected {knob.range_text()}, got a JSON {type(value).__name__}")
    return value


def component_value(knob: Knob, value: Any) -> Any:
    """A control's value -> the knob's type (the config validates it afterwards)."""
    if knob.kind == "int" and isinstance(value, float) and value.is_integer():
        return int(value)
    if knob.kind == "choice":
        for choice in knob.choices:
            if _choice_label(choice) == value:
                return choice
        return value
    if knob.kind == "bias_map":
        return _strict_json(knob, value, dict)
    if knob.kind == "str_list" and knob.widget == "json":
        return _strict_json(knob, value, list)
    if knob.kind == "str_list":
        return [s.strip() for s in (value or "").split(",") if s.strip()]
    if value is None and knob.kind in ("float", "int"):
        raise UserError(f"{knob.name}: empty; expected a number in {knob.range_text()}")
    return value


def display_value(knob: Knob, value: Any) -> Any:
    if knob.kind == "choice":
        return _choice_label(value)
    if knob.kind == "bias_map":
        return json.dumps(dict(value), ensure_ascii=False) if value else "{}"
    if knob.kind == "str_list" and knob.widget == "json":
        return json.dumps(list(value), ensure_ascii=False)
    if knob.kind == "str_list":
        return ", ".join(value)
    return value


def checked_values(names: Sequence[str], values: Sequence[Any]) -> tuple[dict[str, Any], list[str]]:
    """Controls' values -> (knob values, one message per invalid knob): every bad knob is reported,
    not only the first."""
    out: dict[str, Any] = {}
    errors: list[str] = []
    for name, value in zip(names, values):
        try:
            out[name] = check_knob(name, component_value(KNOBS[name], value))
        except (UserError, ConfigError) as exc:
            errors.append(str(exc))
    return out, errors


def stage_list_html(order: Sequence[str], target: str) -> str:
    """The sortable stage list: drag a row, or focus it and use ↑/↓ (the page's JS writes the new
    order into the hidden textbox ``#<target>``)."""
    rows = []
    for name in order:
        rows.append(f'<li draggable="true" tabindex="0" data-stage="{html.escape(name)}">'
                    f'<span class="dp-grip" aria-hidden="true">⠿</span> <span class="dp-stage-name">{html.escape(name)}</span>'
                    f'<button type="button" class="dp-up" aria-label="move {html.escape(name)} up">↑</button>'
                    f'<button type="button" class="dp-down" aria-label="move {html.escape(name)} down">↓</button></li>')
    return (f'<div class="dp-stages-label">Stage order: drag a stage, or use its ↑/↓ buttons '
            f'(stages whose knobs are neutral change nothing)</div>'
            f'<ol class="dp-stages" data-target="{html.escape(target)}">{"".join(rows)}</ol>')


def stage_order_text(order: Sequence[str]) -> str:
    return ", ".join(order)


def parse_stage_order(text: Any) -> list[str]:
    return [s.strip() for s in str(text or "").split(",") if s.strip()] or list(engine_config.DEFAULT_STAGE_ORDER)


class KnobPanel:
    """Controls for ``knob_names`` (+ strategy and stage order), with a preset picker."""

    def __init__(self, shared: Shared, knob_names: Sequence[str], strategies: Sequence[str],
                 preset: str = CUSTOM, stage_order: bool = True, prefix: str = ""):
        self.shared = shared
        self.names = list(knob_names)
        self.strategies = list(strategies)
        self.prefix = prefix
        start = builtin_presets().get(preset)
        start_cfg = start.config if start else DecodingConfig(strategy=self.strategies[0])
        self.preset = gr.Dropdown(preset_choices([]), value=preset, label="Preset", elem_id=f"{prefix}preset",
                                  info="Picking one fills the controls below.")
        self.modified = gr.Markdown(self._preset_note(preset, False), elem_id=f"{prefix}preset-note")
        strategy = start_cfg.strategy if start_cfg.strategy in self.strategies else self.strategies[0]
        self.strategy = gr.Radio(self.strategies, value=strategy, label="Strategy", elem_id=f"{prefix}strategy",
                                 visible=len(self.strategies) > 1)
        self.components: dict[str, gr.components.Component] = {}
        self._build_controls(start_cfg, strategy == "greedy")
        self.stage_order = self.stage_list = None
        if stage_order:
            target = f"{prefix}stage-order"
            self.stage_list = gr.HTML(stage_list_html(start_cfg.stage_order, target),
                                      elem_id=f"{prefix}stage-list")
            # The list's JS writes here; hidden by CSS (an invisible component is not in the page).
            self.stage_order = gr.Textbox(stage_order_text(start_cfg.stage_order), label="Stage order", elem_id=target,
                                          elem_classes=["dp-hidden"])

    def _build_controls(self, cfg: DecodingConfig, greedy: bool) -> None:
        groups = knob_groups()
        grouped = {n for _, names, _ in groups for n in names}
        sampling = set(sampling_knobs())
        run = [n for n in self.names if n not in grouped]
        if run:
            with gr.Accordion("Run", open=True):
                with gr.Row():
                    for name in run:
                        self.components[name] = knob_component(KNOBS[name], getattr(cfg, name), self.prefix)
        for title, names, is_open in groups:
            shown = [n for n in names if n in self.names]
            if not shown:
                continue
            with gr.Accordion(title, open=is_open, elem_id=f"{self.prefix}group-{title.split()[0].lower()}"):
                for name in shown:
                    control = knob_component(KNOBS[name], getattr(cfg, name), self.prefix)
                    self.components[name] = control
                    if greedy and name in sampling:
                        control.interactive = False
                        control.info = f"{IGNORED_BY_GREEDY} {control.info or ''}"

    @property
    def inputs(self) -> list[Any]:
        """Controls in a fixed order: strategy, knobs..., stage order (if shown): components of several
        kinds (each has its events)."""
        return [self.strategy, *self.components.values()] + ([self.stage_order] if self.stage_order else [])

    def values(self, *values: Any) -> dict[str, Any]:
        """Controls' values (in ``inputs`` order) -> a config dict; UserError listing every invalid knob."""
        strategy, rest = values[0], list(values[1:])
        knobs, errors = checked_values(list(self.components), rest)
        if errors:
            raise UserError(errors[0] if len(errors) == 1 else f"{len(errors)} invalid knobs: " + " · ".join(errors))
        out: dict[str, Any] = {"strategy": strategy, **knobs}
        if self.stage_order is not None:
            out["stage_order"] = parse_stage_order(rest[len(self.components)])
        return out

    def config(self, *values: Any, **overrides: Any) -> DecodingConfig:
        return config_or_error(self.values(*values) | overrides)

    def greying(self, strategy: str) -> dict[Any, Any]:
        """``{control: update}`` greying the sampling-only knobs when ``strategy`` is greedy."""
        greedy, sampling = strategy == "greedy", set(sampling_knobs())
        return {c: gr.update(interactive=not greedy,
                             info=(f"{IGNORED_BY_GREEDY} " if greedy else "") + f"{KNOBS[n].doc} " + _range_note(KNOBS[n]))
                for n, c in self.components.items() if n in sampling}

    def fill(self, cfg: DecodingConfig) -> dict[Any, Any]:
        """``{control: value}`` showing a config."""
        strategy = cfg.strategy if cfg.strategy in self.strategies else self.strategies[0]
        out: dict[Any, Any] = {self.strategy: strategy}
        out |= {c: display_value(KNOBS[n], getattr(cfg, n)) for n, c in self.components.items()}
        if self.stage_order is not None:
            out[self.stage_order] = stage_order_text(cfg.stage_order)
        return out

    @staticmethod
    def _preset_note(choice: str, modified: bool) -> str:
        """The note under the preset picker (MODIFIED_JS writes the modified one in the page)."""
        if not choice or choice == CUSTOM:
            return "<small>Custom settings</small>"
        return f"<small>Preset <b>{html.escape(choice)}</b>{' · <i>modified</i>' if modified else ''}</small>"

    def wire(self) -> None:
        """Preset picking fills controls; any user edit marks the preset modified; greedy greys the
        sampling-only knobs."""

        def on_pick(choice: str, user_presets: list) -> dict:
            preset = find_preset(choice, user_presets)
            note = {self.modified: self._preset_note(choice, False)}
            return note if preset is None else self.fill(preset.config) | note

        local: dict[str, Any] = {"api_visibility": "private", "queue": False}
        self.preset.input(on_pick, [self.preset, self.shared.user_presets], self.inputs + [self.modified], **local)
        for component in self.inputs:  # in the page: Gradio runs one trigger's events one after another
            component.input(None, [self.preset], [self.modified], js=MODIFIED_JS, **local)
        if self.stage_order is not None and self.stage_list is not None:  # a preset or share link filled the order
            target = f"{self.prefix}stage-order"
            self.stage_order.change(lambda text: stage_list_html(parse_stage_order(text), target), [self.stage_order],
                                    [self.stage_list], **local)
            self.stage_order.change(None, [self.preset, self.modified], [self.modified], js=STAGE_MODIFIED_JS, **local)
        sampling = set(sampling_knobs())
        self.strategy.change(self.greying, [self.strategy], [c for n, c in self.components.items() if n in sampling],
                             **local)
        self.shared.user_presets.change(lambda presets, choice: gr.update(choices=preset_choices(presets), value=choice),
                                        [self.shared.user_presets, self.preset], [self.preset], **local)

    def apply_preset(self, preset: Preset, label: str = CUSTOM, modified: bool = False) -> dict[Any, Any]:
        """``{component: value}`` for the controls, picker and note, showing ``preset`` (share links)."""
        return self.fill(preset.config) | {self.preset: label, self.modified: self._preset_note(label, modified)}


def _range_note(knob: Knob) -> str:
    return f"Range {knob.range_text()}." if knob.kind in ("float", "int") else ""


# --- compact controls (the Compare lanes): a small number box per knob, greyed by the same rule ----
IGNORED_BY_GREEDY_SHORT = "ignored by greedy"


def compact_knob_state(name: str, strategy: str) -> dict[str, Any]:
    """``interactive``/``info`` of a compact control under ``strategy``: the Step view's rule (greedy
    greys the sampling-only knobs), in a few words."""
    ignored = strategy == "greedy" and name in sampling_knobs()
    # "" and not None: an update with info=None leaves the old note in place.
    return {"interactive": not ignored, "info": IGNORED_BY_GREEDY_SHORT if ignored else ""}


def compact_knob_component(knob: Knob, value: Any, prefix: str, strategy: str) -> gr.Number:
    """A number box for a numeric knob, id ``<prefix>knob-<name>``: no slider and no bounds in the
    browser, so a typed out-of-range value reaches the engine, whose message names it and the range."""
    if knob.kind not in ("float", "int"):
        raise ValueError(f"{knob.name}: a compact control is for numeric knobs, not {knob.kind}")
    state = compact_knob_state(knob.name, strategy)
    return gr.Number(value=knob.neutral if value is None else value, label=knob.name, min_width=90,
                     precision=0 if knob.kind == "int" else None, step=knob.step or (1 if knob.kind == "int" else 0.05),
                     elem_id=f"{prefix}knob-{knob.name}", elem_classes=["dp-compact-knob"], **state)


def knob_errors_text(errors: Sequence[str]) -> str:
    """Every invalid knob of one click in one line, as the Step view reports them."""
    return errors[0] if len(errors) == 1 else f"{len(errors)} invalid knobs: " + " · ".join(errors)
