"""KnobPanel: a preset picker plus one control per knob, built from the engine's KNOBS (ranges,
neutral values and docs come from engine/config.py, never duplicated here).

Picking a preset fills the controls; editing any control marks the preset as modified.
``panel.config(*values)`` turns the controls' values back into a validated DecodingConfig.
"""

from __future__ import annotations

from typing import Any, Sequence

import gradio as gr

from engine.config import DEFAULT_STAGE_ORDER, KNOBS, STAGE_NAMES, DecodingConfig, Knob
from engine.presets import Preset, builtin_presets

from .user_presets import CUSTOM, find_preset, preset_choices
from .shared import Shared, UserError, config_or_error

# Sliders read better with a practical top end; the engine's bound still validates (Number inputs
# are used for knobs whose full range makes a slider useless).
NUMBER_INPUT_KNOBS = {"seed", "top_k"}

SAMPLING_KNOBS = ("temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff")
PENALTY_KNOBS = ("repetition_penalty", "frequency_penalty", "presence_penalty", "no_repeat_ngram_size")
STAGE_KNOBS = SAMPLING_KNOBS + PENALTY_KNOBS


def knob_component(knob: Knob, value: Any = None, prefix: str = "") -> gr.components.Component:
    """One control for a knob; its element id is ``<prefix>knob-<name>``, unique per view."""
    value = knob.neutral if value is None else value
    label = knob.name
    info = knob.doc
    elem_id = f"{prefix}knob-{knob.name}"
    if knob.kind in ("float", "int") and knob.name in NUMBER_INPUT_KNOBS:
        # No minimum/maximum here: the engine's validation names the knob and its range in the message.
        return gr.Number(value=value, label=label, info=f"{info} Range {knob.range_text()}.", precision=0, elem_id=elem_id)
    if knob.kind in ("float", "int"):
        return gr.Slider(minimum=knob.low, maximum=knob.high, value=value, step=knob.step or (1 if knob.kind == "int" else 0.01),
                         label=label, info=f"{info} Range {knob.range_text()}.", elem_id=elem_id)
    if knob.kind == "bool":
        return gr.Checkbox(value=bool(value), label=label, info=info, elem_id=elem_id)
    if knob.kind == "choice":
        return gr.Dropdown([_choice_label(c) for c in knob.choices], value=_choice_label(value), label=label, info=info, elem_id=elem_id)
    if knob.kind == "str_list":
        return gr.Textbox(value=", ".join(value), label=label, info=f"{info} Comma-separated.", elem_id=elem_id)
    return gr.Textbox(value=str(value), label=label, info=info, elem_id=elem_id)


def _choice_label(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def component_value(knob: Knob, value: Any) -> Any:
    """A control's value -> the knob's type (the config validates it afterwards)."""
    if knob.kind == "int" and isinstance(value, float) and value.is_integer():
        return int(value)
    if knob.kind == "choice":
        for choice in knob.choices:
            if _choice_label(choice) == value:
                return choice
        return value
    if knob.kind == "str_list":
        return [s.strip() for s in (value or "").split(",") if s.strip()]
    if value is None and knob.kind in ("float", "int"):
        raise UserError(f"{knob.name}: empty; expected a number in {knob.range_text()}")
    return value


def display_value(knob: Knob, value: Any) -> Any:
    if knob.kind == "choice":
        return _choice_label(value)
    if knob.kind == "str_list":
        return ", ".join(value)
    return value


class KnobPanel:
    """Controls for ``knob_names`` (+ strategy and stage order), with a preset picker."""

    def __init__(self, shared: Shared, knob_names: Sequence[str], strategies: Sequence[str],
                 preset: str = CUSTOM, stage_order: bool = True, prefix: str = ""):
        self.shared = shared
        self.names = list(knob_names)
        self.strategies = list(strategies)
        start = builtin_presets().get(preset)
        start_cfg = start.config if start else DecodingConfig(strategy=self.strategies[0])
        self.preset = gr.Dropdown(preset_choices([]), value=preset, label="Preset", elem_id=f"{prefix}preset",
                                  info="Picking one fills the controls below.")
        self.modified = gr.Markdown(self._preset_note(preset, False), elem_id=f"{prefix}preset-note")
        self.strategy = gr.Radio(self.strategies, value=start_cfg.strategy if start_cfg.strategy in self.strategies else self.strategies[0],
                                 label="Strategy", elem_id=f"{prefix}strategy")
        self.components: dict[str, gr.components.Component] = {}
        self._build_controls(start_cfg, prefix)
        self.stage_order = None
        if stage_order:
            self.stage_order = gr.Dropdown(
                list(STAGE_NAMES), value=list(start_cfg.stage_order), multiselect=True, label="Stage order",
                info="Order the stages run in. Remove a stage and add it back to move it to the end.",
                elem_id=f"{prefix}stage-order",
            )

    def _build_controls(self, cfg: DecodingConfig, prefix: str) -> None:
        groups = [("Sampling stages", [n for n in self.names if n in SAMPLING_KNOBS]),
                  ("Penalties", [n for n in self.names if n in PENALTY_KNOBS]),
                  ("Run", [n for n in self.names if n not in STAGE_KNOBS])]
        for title, names in groups:
            if not names:
                continue
            with gr.Accordion(title, open=title != "Penalties"):
                for name in names:
                    self.components[name] = knob_component(KNOBS[name], getattr(cfg, name), prefix)

    @property
    def inputs(self) -> list[gr.components.Component]:
        """Controls in a fixed order: strategy, knobs..., stage order (if shown)."""
        return [self.strategy, *self.components.values()] + ([self.stage_order] if self.stage_order else [])

    def values(self, *values: Any) -> dict[str, Any]:
        """Controls' values (in ``inputs`` order) -> a config dict."""
        strategy, rest = values[0], list(values[1:])
        out: dict[str, Any] = {"strategy": strategy}
        for name, value in zip(self.components, rest):
            out[name] = component_value(KNOBS[name], value)
        if self.stage_order is not None:
            out["stage_order"] = list(rest[len(self.components)] or DEFAULT_STAGE_ORDER)
        return out

    def config(self, *values: Any, **overrides: Any) -> DecodingConfig:
        return config_or_error(self.values(*values) | overrides)

    def fill(self, cfg: DecodingConfig) -> dict[Any, Any]:
        """``{control: value}`` showing a config."""
        strategy = cfg.strategy if cfg.strategy in self.strategies else self.strategies[0]
        out: dict[Any, Any] = {self.strategy: strategy}
        out |= {c: display_value(KNOBS[n], getattr(cfg, n)) for n, c in self.components.items()}
        if self.stage_order is not None:
            out[self.stage_order] = list(cfg.stage_order)
        return out

    @staticmethod
    def _preset_note(choice: str, modified: bool) -> str:
        if not choice or choice == CUSTOM:
            return "<small>Custom settings</small>"
        return f"<small>Preset <b>{choice}</b>{' · <i>modified</i>' if modified else ''}</small>"

    def wire(self) -> None:
        """Preset picking fills controls; any user edit marks the preset modified."""

        def on_pick(choice: str, user_presets: list) -> dict:
            preset = find_preset(choice, user_presets)
            note = {self.modified: self._preset_note(choice, False)}
            return note if preset is None else self.fill(preset.config) | note

        self.preset.input(on_pick, [self.preset, self.shared.user_presets], self.inputs + [self.modified],
                          api_visibility="private", queue=False)
        for component in self.inputs:
            component.input(lambda choice: self._preset_note(choice, True), [self.preset], [self.modified],
                            api_visibility="private", queue=False)
        self.shared.user_presets.change(lambda presets, choice: gr.update(choices=preset_choices(presets), value=choice),
                                        [self.shared.user_presets, self.preset], [self.preset], api_visibility="private", queue=False)

    def apply_preset(self, preset: Preset, label: str = CUSTOM, modified: bool = False) -> dict[Any, Any]:
        """``{component: value}`` for the controls, picker and note, showing ``preset`` (share links)."""
        return self.fill(preset.config) | {self.preset: label, self.modified: self._preset_note(label, modified)}
