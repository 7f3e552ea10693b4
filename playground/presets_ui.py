"""Presets in the browser: the user's own presets (kept in gr.BrowserState, i.e. this browser's
localStorage), the merged picker list, share links (copy and restore) and export files.

Stored shape (``shared.user_presets``): a JSON list of preset objects in the engine's format
(``Preset.to_dict()``), at most MAX_USER_PRESETS, names unique. The browser's copy is untrusted:
every read validates it with ``parse_preset`` and drops what does not parse.

The functions before the Gradio wiring are pure (lists in, lists out) and raise PresetError with a
message for the page.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

import gradio as gr

from engine.config import DecodingConfig
from engine.presets import (
    MAX_FILE_BYTES, Preset, PresetError, builtin_presets, file_stem, parse_preset, parse_preset_file,
    presets_to_json, sanitize_name, unique_name,
)
from engine.sharelink import SHARE_PARAM, ShareLinkError, ShareState, decode, encode

MAX_USER_PRESETS = 100
CUSTOM = "(custom)"  # the picker's "no preset" entry (same value as playground.knobs.CUSTOM)
USER_PREFIX = "★ "  # user presets in the picker (same value as playground.knobs.USER_PREFIX)

# --- user presets: pure list operations -------------------------------------------------------------


def read_user_presets(stored: Any) -> tuple[list[Preset], list[str]]:
    """The browser-stored list -> valid presets (unique names, capped) and one message per dropped entry."""
    presets: list[Preset] = []
    errors: list[str] = []
    items = stored if isinstance(stored, list) else []
    if stored not in (None, []) and not isinstance(stored, list):
        errors.append("stored presets: not a list; ignored")
    for i, item in enumerate(items[:MAX_USER_PRESETS], start=1):
        try:
            preset = parse_preset(item)
        except PresetError as exc:
            errors.append(f"stored preset {i}: {exc}")
            continue
        if any(p.name == preset.name for p in presets):
            errors.append(f"stored preset {i}: a second {preset.name!r}; dropped")
            continue
        presets.append(preset)
    return presets, errors


def to_stored(presets: Sequence[Preset]) -> list[dict]:
    """The value to write back to the BrowserState."""
    return [p.to_dict() for p in presets]


def save_user_preset(stored: Any, preset: Preset, overwrite: bool = False) -> list[dict]:
    """Add ``preset`` (or replace the one of that name when ``overwrite``)."""
    presets, _ = read_user_presets(stored)
    names = [p.name for p in presets]
    if preset.name in names:
        if not overwrite:
            raise PresetError(f"name: you already have a preset called {preset.name!r}; pick another name")
        presets[names.index(preset.name)] = preset
    elif len(presets) >= MAX_USER_PRESETS:
        raise PresetError(f"presets: you have {MAX_USER_PRESETS}, the most this browser keeps; delete some first")
    else:
        presets.append(preset)
    return to_stored(presets)


def rename_user_preset(stored: Any, old: str, new: str) -> list[dict]:
    presets, _ = read_user_presets(stored)
    new_name = sanitize_name(new or "")
    if not new_name:
        raise PresetError("name: empty; type a new name")
    index = _index(presets, old)
    if new_name != old and any(p.name == new_name for p in presets):
        raise PresetError(f"name: you already have a preset called {new_name!r}")
    presets[index] = presets[index].renamed(new_name)
    return to_stored(presets)


def delete_user_preset(stored: Any, name: str) -> list[dict]:
    presets, _ = read_user_presets(stored)
    del presets[_index(presets, name)]
    return to_stored(presets)


def _index(presets: Sequence[Preset], name: str) -> int:
    for i, preset in enumerate(presets):
        if preset.name == name:
            return i
    raise PresetError(f"preset: no saved preset called {name!r}")


def import_user_presets(stored: Any, text: str | bytes) -> tuple[list[dict], list[str], list[str]]:
    """Add the presets in a file; names that clash get " (2)" etc. Returns (stored, imported names,
    errors): the good presets are kept even when others are bad."""
    presets, _ = read_user_presets(stored)
    result = parse_preset_file(text)
    errors = list(result.errors)
    imported = []
    for preset in result.presets:
        if len(presets) >= MAX_USER_PRESETS:
            errors.append(f"{preset.name!r}: not imported; this browser keeps at most {MAX_USER_PRESETS} presets")
            continue
        name = unique_name(preset.name, [p.name for p in presets])
        presets.append(preset if name == preset.name else preset.renamed(name))
        imported.append(name)
    return to_stored(presets), imported, errors


# --- the merged picker ------------------------------------------------------------------------------


def all_presets(stored: Any) -> dict[str, Preset]:
    """Picker value -> preset: built-ins by file stem, then the user's as "★ name"."""
    merged = dict(builtin_presets())
    for preset in read_user_presets(stored)[0]:
        merged[USER_PREFIX + preset.name] = preset
    return merged


def preset_choices(stored: Any) -> list[str]:
    return [CUSTOM, *all_presets(stored)]


def find_preset(choice: str, stored: Any) -> Preset | None:
    return all_presets(stored).get(choice)


def matching_choice(config: DecodingConfig, stored: Any, name: str = "") -> tuple[str, bool]:
    """The picker entry for a config: (choice, modified). An exact match (seed aside) wins; else the
    entry whose display name is ``name``, marked modified; else (CUSTOM, False)."""
    by_name = None
    for choice, preset in all_presets(stored).items():
        if preset.config.replace(seed=config.seed) == config:
            return choice, False
        if name and preset.name == name and by_name is None:
            by_name = choice
    return (by_name, True) if by_name else (CUSTOM, False)


# --- files ------------------------------------------------------------------------------------------


def export_file(presets: Sequence[Preset], stem: str | None = None) -> str:
    """Write presets to a new .json file in a fresh temporary folder; returns its path (for gr.File)."""
    if not presets:
        raise PresetError("export: nothing to export")
    name = file_stem(stem or (presets[0].name if len(presets) == 1 else "presets"))
    path = Path(tempfile.mkdtemp(prefix="dp-presets-")) / f"{name}.json"
    path.write_text(presets_to_json(presets), encoding="utf-8")
    return str(path)


def read_upload(path: str | None) -> bytes:
    """An uploaded file's bytes, refusing big files before reading them."""
    if not path:
        raise PresetError("import: choose a .json file first")
    file = Path(path)
    if file.stat().st_size > MAX_FILE_BYTES:
        raise PresetError(f"import: the file is over the {MAX_FILE_BYTES:,}-byte limit")
    return file.read_bytes()


# --- share links ------------------------------------------------------------------------------------

BAD_LINK = "This share link could not be opened ({reason}); the defaults are shown instead."


def restore_from_query(query_params: Mapping[str, str] | None) -> ShareState | str | None:
    """A share link's state from the page's query parameters (``gr.Request.query_params``).
    None: there is no link. A str: a message saying why the link could not be opened."""
    token = (query_params or {}).get(SHARE_PARAM)
    if token is None:
        return None
    try:
        return decode(token)
    except ShareLinkError as exc:
        return BAD_LINK.format(reason=exc)


def share_token(view: str, prompt: str, config: DecodingConfig, choice: str, stored: Any,
                chat: bool | None = None) -> str:
    """The token for a view's current state; ``choice`` is the picker entry (names the preset)."""
    picked = find_preset(choice, stored)
    modified = picked is not None and picked.config.replace(seed=config.seed) != config
    name = picked.name if picked else "Shared settings"
    description = picked.description if picked and not modified else "Settings shared by link."
    state = ShareState(view=view, prompt=prompt or "", preset=Preset.create(name, description, config),
                       seed=config.seed, chat=chat)
    return encode(state)


# Runs in the browser after the token is made: builds the full URL from the page's own address (so
# it works behind any host or proxy), copies it, and shows it. The clipboard API needs a secure
# context (https or localhost); elsewhere a hidden textarea and execCommand do the copy.
COPY_LINK_JS = f"""
(token) => {{
  if (!token) return "";
  const url = new URL(window.location.href);
  url.hash = "";
  url.searchParams.set("{SHARE_PARAM}", token);
  const link = url.toString();
  const fallback = () => {{
    const area = document.createElement("textarea");
    area.value = link; area.style.position = "fixed"; area.style.opacity = "0";
    document.body.appendChild(area); area.select();
    try {{ document.execCommand("copy"); }} catch (e) {{}}
    area.remove();
  }};
  if (navigator.clipboard && window.isSecureContext) {{
    navigator.clipboard.writeText(link).catch(fallback);
  }} else {{
    fallback();
  }}
  return link;
}}
"""


# --- Gradio wiring ----------------------------------------------------------------------------------


def _registered_views(shared) -> dict[str, dict]:
    """Views that registered ``shared.extra[name] = {"panel": KnobPanel, "prompt": Textbox, "chat": ...}``."""
    return {name: entry for name, entry in shared.extra.items()
            if isinstance(entry, dict) and "panel" in entry and "prompt" in entry}


def _share_inputs(entry: dict) -> list:
    chat = entry.get("chat")
    return [entry["prompt"], *([chat] if chat is not None else []), entry["panel"].preset, *entry["panel"].inputs]


def _make_token(shared, view: str, entry: dict, stored: Any, values: Sequence[Any]) -> str:
    """The token for one view's control values (in ``_share_inputs`` order); "" plus a warning on failure."""
    values = list(values)
    prompt = values.pop(0)
    chat = bool(values.pop(0)) if entry.get("chat") is not None else None
    choice = values.pop(0)
    try:
        config = entry["panel"].config(*values)
        return share_token(view, prompt, config, choice, stored, chat)
    except (ValueError, ShareLinkError, PresetError) as exc:  # UserError is a ValueError
        gr.Warning(f"No link: {exc}")
        return ""


def share_link_controls(shared, view: str) -> tuple[gr.Button, gr.Textbox]:
    """A "Copy link" button and the link box, placed where it is called, for a view that has
    registered itself in ``shared.extra[view]`` (call it after registering)."""
    entry = _registered_views(shared)[view]
    with gr.Row():
        button = gr.Button("🔗 Copy link", size="sm", scale=0, min_width=120, elem_id=f"{view}-copy-link")
        link = gr.Textbox(label="Share link", show_label=False,
                          placeholder="A link to this view, its prompt, preset and seed",
                          interactive=False, scale=4, elem_id=f"{view}-share-link")
    inputs = [shared.user_presets, *_share_inputs(entry)]
    button.click(lambda stored, *values: _make_token(shared, view, entry, stored, values), inputs, [link],
                 api_visibility="private").then(None, [link], [link], js=COPY_LINK_JS, api_visibility="private")
    entry["share"] = (button, link)
    return button, link


def _fallback_share_row(shared, views: dict[str, dict]) -> None:
    """One "Copy link" row for the views that placed none of their own."""
    missing = [name for name, entry in views.items() if "share" not in entry]
    if not missing:
        return
    with gr.Accordion("Share a link", open=False, elem_id="dp-share"):
        with gr.Row():
            which = gr.Radio(missing, value=missing[0], label="View", scale=2, elem_id="dp-share-view")
            button = gr.Button("🔗 Copy link", size="sm", scale=0, min_width=120, elem_id="dp-copy-link")
            link = gr.Textbox(show_label=False, interactive=False, scale=4, elem_id="dp-share-link")
    inputs = [which, shared.user_presets] + [c for name in missing for c in _share_inputs(views[name])]
    sizes = [len(_share_inputs(views[name])) for name in missing]

    def on_click(view: str, stored: Any, *values: Any) -> str:
        start = sum(sizes[: missing.index(view)])
        return _make_token(shared, view, views[view], stored, values[start: start + sizes[missing.index(view)]])

    button.click(on_click, inputs, [link], api_visibility="private"
                 ).then(None, [link], [link], js=COPY_LINK_JS, api_visibility="private")


def _restore_updates(state: ShareState, entry: dict, stored: Any) -> list:
    """Updates for ``_restore_outputs(entry)`` that show ``state``."""
    panel = entry["panel"]
    choice, modified = matching_choice(state.preset.config, stored, state.preset.name)
    updates = panel.apply_preset(state.preset, choice, modified)
    chat = []
    if entry.get("chat") is not None:
        chat = [gr.update(value=state.chat) if state.chat is not None else gr.update()]
    return [gr.update(value=state.prompt), *chat, *updates]


def _restore_outputs(entry: dict) -> list:
    chat = entry.get("chat")
    panel = entry["panel"]
    return [entry["prompt"], *([chat] if chat is not None else []), *panel.inputs, panel.preset, panel.modified]


def wire_share_link(demo: gr.Blocks, shared) -> None:
    """Called once by the app after every view is built: on page load, a ``?share=`` link restores its
    view (tab, prompt, preset controls, seed); a bad link shows a warning and leaves the defaults.
    Views without their own "Copy link" get one in a row at the bottom of the page."""
    views = _registered_views(shared)
    _fallback_share_row(shared, views)
    tabs = shared.extra.get("tabs")
    outputs = [tabs] if tabs is not None else []
    spans: dict[str, tuple[int, int]] = {}
    for name, entry in views.items():
        spans[name] = (len(outputs), len(_restore_outputs(entry)))
        outputs += _restore_outputs(entry)

    def on_load(stored: Any, request: gr.Request) -> list:
        updates = [gr.update() for _ in outputs]
        result = restore_from_query(dict(request.query_params) if request is not None else {})
        if isinstance(result, ShareState) and result.view not in views:
            result = BAD_LINK.format(reason=f"view: this app has no view called {result.view!r}")
        if isinstance(result, str):
            gr.Warning(result)
        if not isinstance(result, ShareState):
            return updates
        start, size = spans[result.view]
        updates[start: start + size] = _restore_updates(result, views[result.view], stored)
        if tabs is not None:
            updates[0] = gr.update(selected=f"tab-{result.view}")
        return updates

    if outputs:
        demo.load(on_load, [shared.user_presets], outputs, api_visibility="private")
