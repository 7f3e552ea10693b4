"""Presets tab: the built-in library, your own presets (kept in this browser), import and export,
and the same preset for text-generation-webui or llama.cpp.

Everything here works on the preset JSON in the editor: pick a preset to load it, edit it, then save
it as your own, export it, or see it in another tool's terms. Nothing here touches the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import Any

import gradio as gr

from engine.config import KNOBS
from engine.interop import InteropExport, to_llama_cpp, to_textgen_webui
from engine.presets import Preset, PresetError, builtin_presets, file_stem, parse_preset_json, sanitize_name
from engine.sharelink import ShareState, share_query

from .. import downloads
from .. import user_presets as ui
from ..events import data_api
from ..shared import Shared, error_html, status_html

TARGETS = {"text-generation-webui (YAML preset)": to_textgen_webui, "llama.cpp (command-line flags)": to_llama_cpp}
TABLE_HEADERS = ["Name", "Strategy", "Settings", "Description"]
COLUMN_WIDTHS: list[str | int] = ["18%", "14%", "30%", "38%"]
DEFAULT_CHOICE = "balanced"


def settings_text(preset: Preset) -> str:
    """The preset's non-neutral knobs, compactly: ``temperature 0.8 · top_p 0.9``."""
    body = preset.config.to_dict(sparse=True)
    parts = [f"{k} {v}" for k, v in body.items() if k in KNOBS]
    if "stage_order" in body:
        parts.append("custom stage order")
    return " · ".join(parts) or "—"


def table_rows(presets: list[Preset]) -> list[list[str]]:
    return [[p.name, p.config.strategy, settings_text(p), p.description] for p in presets]


def editor_preset(text: str) -> Preset:
    """The editor's JSON as a preset (PresetError with the key on anything wrong)."""
    return parse_preset_json(text or "")


def interop_view(text: str, target: str) -> tuple[str, str, str | None]:
    """(exported text, notes markdown, download path) for the editor's preset."""
    try:
        preset = editor_preset(text)
    except PresetError as exc:
        return "", f"Fix the preset JSON first: {exc}", None
    export: InteropExport = TARGETS.get(target, to_textgen_webui)(preset)
    lines = [f"- **{n.key}** does not map: {n.reason}" for n in export.unmapped]
    lines += [f"- **{n.key}**: {n.reason}" for n in export.caveats]
    notes = "\n".join(lines) if lines else "Every setting maps exactly."
    path = None
    if export.target == "text-generation-webui":
        path = downloads.write_text(f"{file_stem(preset.name)}.yaml", export.text)
    return export.text, notes, path


def interop_api(preset_json: str, target: str = "llama.cpp") -> dict:
    """A preset (JSON text) in another tool's terms: {"text", "unmapped": [{key, reason}], "caveats": [...]}.
    ``target``: "llama.cpp" or "text-generation-webui"."""
    if not isinstance(target, str) or not target.startswith(("llama", "text-generation")):
        raise PresetError(f"target: expected 'llama.cpp' or 'text-generation-webui', got {str(target)[:40]!r}")
    exporter = to_llama_cpp if target.startswith("llama") else to_textgen_webui
    export = exporter(editor_preset(preset_json))
    return {"target": export.target, "text": export.text,
            "unmapped": [{"key": n.key, "reason": n.reason} for n in export.unmapped],
            "caveats": [{"key": n.key, "reason": n.reason} for n in export.caveats]}


def validate_api(preset_json: str) -> dict:
    """A preset (JSON text) validated and in canonical sparse form, or an error naming the key."""
    return editor_preset(preset_json).to_dict()


def share_link_api(view: str, prompt: str, preset_json: str, seed: int | None = None, chat: bool | None = None) -> str:
    """The query string (``?share=...``) that opens ``view`` with this prompt, preset and seed."""
    return share_query(ShareState(view, prompt, editor_preset(preset_json), seed, chat))


def build_tab(shared: Shared) -> None:
    gr.Markdown("Pick a preset to load its JSON below; edit it, save it as your own (kept in this browser only), "
                "export it, or see it as a text-generation-webui preset or llama.cpp flags.")
    with gr.Row():
        with gr.Column(scale=3):
            c = _editor_column()
        with gr.Column(scale=2):
            m = _mine_column()
    with gr.Accordion("Use this preset in another tool", open=True):
        first = next(iter(TARGETS))
        text, notes, path = interop_view(builtin_presets()[DEFAULT_CHOICE].to_json(), first)
        target = gr.Radio(list(TARGETS), value=first, label="Export for", elem_id="presets-target")
        interop_text = gr.Code(text, language="yaml", label="Exported", interactive=False, elem_id="presets-interop")
        interop_notes = gr.Markdown(notes, elem_id="presets-interop-notes")
        interop_file = gr.File(path, label="Download", interactive=False, height=90, visible=path is not None,
                               elem_id="presets-interop-file")
    gr.Markdown("#### Built-in library")
    gr.Dataframe(table_rows(list(builtin_presets().values())), headers=TABLE_HEADERS, interactive=False,
                 wrap=True, column_widths=COLUMN_WIDTHS, elem_id="presets-library")
    _wire_editor(shared, c, Interop(target, interop_text, interop_notes, interop_file))
    _wire_mine(shared, c, m)
    _wire_import(shared, c, m)
    data_api(validate_api, "preset_validate")
    data_api(interop_api, "preset_interop")
    data_api(share_link_api, "share_link")


@dataclass(frozen=True)
class Interop:
    """The "use this preset in another tool" panel."""

    target: gr.Radio
    text: gr.Code
    notes: gr.Markdown
    file: gr.File


@dataclass(frozen=True)
class Editor:
    """The preset editor column: picker, JSON, status, save and export controls."""

    picker: gr.Dropdown
    editor: gr.Code
    status: gr.HTML
    save_name: gr.Textbox
    save: gr.Button
    export_one: gr.Button
    export_mine: gr.Button
    export_library: gr.Button
    exported: gr.File


@dataclass(frozen=True)
class Mine:
    """The "your presets" column: table, picker, rename/delete and import."""

    table: gr.Dataframe
    chosen: gr.Dropdown
    new_name: gr.Textbox
    rename: gr.Button
    delete: gr.Button
    upload: gr.File


def _editor_column() -> Editor:
    picker = gr.Dropdown(ui.preset_choices([])[1:], value=DEFAULT_CHOICE, label="Preset", elem_id="presets-picker",
                         info="Built-ins, then yours (★).")
    editor = gr.Code(builtin_presets()[DEFAULT_CHOICE].to_json(), language="json", label="Preset JSON",
                     interactive=True, elem_id="presets-json")
    status = gr.HTML(elem_id="presets-status")
    with gr.Row():
        save_name = gr.Textbox(label="Save as", placeholder="a name for your copy (default: the JSON's name)",
                               scale=3, elem_id="presets-save-name")
        save = gr.Button("Save as my preset", variant="primary", scale=1, elem_id="presets-save")
    with gr.Row():
        export_one = gr.Button("Export this preset", size="sm", elem_id="presets-export-one")
        export_mine = gr.Button("Export all my presets", size="sm", elem_id="presets-export-mine")
        export_library = gr.Button("Export the built-in library", size="sm", elem_id="presets-export-library")
    exported = gr.File(label="Exported file", interactive=False, height=90, visible=False, elem_id="presets-exported")
    return Editor(picker, editor, status, save_name, save, export_one, export_mine, export_library, exported)


def _mine_column() -> Mine:
    gr.Markdown("#### Your presets\nKept in this browser's storage: they survive reloads and app restarts, "
                "and no one else can see them.")
    table = gr.Dataframe([], headers=TABLE_HEADERS, interactive=False, wrap=True, column_widths=COLUMN_WIDTHS,
                         elem_id="presets-mine")
    chosen = gr.Dropdown([], label="Your preset", elem_id="presets-mine-pick")
    with gr.Row():
        new_name = gr.Textbox(label="New name", scale=3, elem_id="presets-new-name")
        rename = gr.Button("Rename", size="sm", scale=1, elem_id="presets-rename")
        delete = gr.Button("Delete", size="sm", variant="stop", scale=1, elem_id="presets-delete")
    upload = gr.File(label="Import presets (.json: one preset or a list)", file_types=[".json"], type="filepath",
                     elem_id="presets-import")
    return Mine(table, chosen, new_name, rename, delete, upload)


def _wire_editor(shared: Shared, c: Editor, interop: Interop) -> None:
    target, interop_text, interop_notes, interop_file = interop.target, interop.text, interop.notes, interop.file

    def on_pick(choice: str, stored: Any):
        preset = ui.find_preset(choice, stored)
        return (preset.to_json(), "") if preset else (gr.update(), error_html(f"preset: {choice!r} not found"))

    def on_interop(text: str, which: str):
        out_text, notes, path = interop_view(text, which)
        language = "yaml" if which.startswith("text-generation") else "shell"
        return gr.update(value=out_text, language=language), notes, gr.update(value=path, visible=path is not None)

    private: dict[str, Any] = {"api_visibility": "private"}
    c.picker.input(on_pick, [c.picker, shared.user_presets], [c.editor, c.status], **private
                      ).then(on_interop, [c.editor, target], [interop_text, interop_notes, interop_file], **private)
    # blur, not input: the export (and its file) is rebuilt once per edit, not once per keystroke
    gr.on([c.editor.blur, target.change], on_interop, [c.editor, target],
          [interop_text, interop_notes, interop_file], **private)

    def on_export(what: str, text: str, stored: Any):
        try:
            if what == "one":
                presets = [editor_preset(text)]
            else:
                presets = ui.read_user_presets(stored)[0] if what == "mine" else list(builtin_presets().values())
            stem = {"one": None, "mine": "my-presets", "library": "decoding-playground-presets"}[what]
            path = ui.export_file(presets, stem)
            return gr.update(value=path, visible=True), status_html(f"Exported {len(presets)} preset(s).")
        except PresetError as exc:
            return gr.update(value=None, visible=False), error_html(str(exc))

    for what, button in (("one", c.export_one), ("mine", c.export_mine), ("library", c.export_library)):
        button.click(lambda text, stored, what=what: on_export(what, text, stored),
                                  [c.editor, shared.user_presets], [c.exported, c.status], **private)


def _wire_mine(shared: Shared, c: Editor, m: Mine) -> None:
    private: dict[str, Any] = {"api_visibility": "private"}

    def refresh(stored: Any, choice: str, mine_choice: str):
        presets, errors = ui.read_user_presets(stored)
        names = [p.name for p in presets]
        choices = ui.preset_choices(stored)[1:]
        return (table_rows(presets), gr.update(choices=names, value=mine_choice if mine_choice in names else None),
                gr.update(choices=choices, value=choice if choice in choices else DEFAULT_CHOICE),
                error_html("; ".join(errors)) if errors else gr.update())

    shared.user_presets.change(refresh, [shared.user_presets, c.picker, m.chosen],
                               [m.table, m.chosen, c.picker, c.status], **private)

    def on_save(text: str, name: str, stored: Any):
        try:
            preset = editor_preset(text)
            preset = preset.renamed(name) if sanitize_name(name or "") else preset
            new = ui.save_user_preset(stored, preset)
        except PresetError as exc:
            return gr.update(), error_html(str(exc))
        return new, status_html(f"Saved {preset.name!r} in this browser.")

    c.save.click(on_save, [c.editor, c.save_name, shared.user_presets], [shared.user_presets, c.status],
                    **private)

    def on_change(action: str, stored: Any, chosen: str, new_name: str):
        try:
            if not chosen:
                raise PresetError("preset: pick one of your presets first")
            if action == "rename":
                new = ui.rename_user_preset(stored, chosen, new_name)
                return new, status_html(f"Renamed {chosen!r} to {sanitize_name(new_name)!r}.")
            return ui.delete_user_preset(stored, chosen), status_html(f"Deleted {chosen!r}.")
        except PresetError as exc:
            return gr.update(), error_html(str(exc))

    for action, button in (("rename", m.rename), ("delete", m.delete)):
        button.click(lambda stored, chosen, new, action=action: on_change(action, stored, chosen, new),
                        [shared.user_presets, m.chosen, m.new_name], [shared.user_presets, c.status],
                        **private)


def _wire_import(shared: Shared, c: Editor, m: Mine) -> None:
    def on_upload(path: str | None, stored: Any):
        try:
            new, imported, errors = ui.import_user_presets(stored, ui.read_upload(path))
        except (PresetError, OSError) as exc:
            return gr.update(), error_html(str(exc)), None
        message = f"Imported {len(imported)}: {', '.join(imported)}." if imported else "Imported nothing."
        html = status_html(message) + "".join(error_html(e) for e in errors[:20])
        return new, html, None

    m.upload.upload(on_upload, [m.upload, shared.user_presets], [shared.user_presets, c.status, m.upload],
                       api_visibility="private")
