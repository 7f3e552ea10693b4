"""Share links: a "Copy link" row that puts a view's prompt, preset and seed in the URL itself
(engine.sharelink), and, on page load, a ``?share=`` link restored into its view.

Views take part through their ``PanelView`` handle (playground/shared.py); the app passes the
handles it built to ``wire_share_links`` once every view exists.

A link longer than any the app makes (``MAX_URL_CHARS``: share and lesson tokens are at most 6,000
characters) never reaches Gradio, which fails on a page address over 65,536 characters and leaves
the page-load event hanging: ``LinkTooLong`` (web middleware, ``playground.app.launch_kwargs``)
answers it with a small page that says the link is too long and links to the app without it.
"""

from __future__ import annotations

import html
import json
from typing import Any, Mapping, Sequence

import gradio as gr

from engine.config import DecodingConfig
from engine.presets import Preset, PresetError
from engine.sharelink import SHARE_PARAM, ShareLinkError, ShareState, decode, encode

from .assets import static_text
from .shared import PanelView, UserError
from .user_presets import find_preset, matching_choice

BAD_LINK = "This share link could not be opened ({reason}); the defaults are shown instead."
MAX_URL_CHARS = 16_384  # a request target (path + query); the app's own links are under 6,100
TOO_LONG_PAGE = ("<!doctype html><meta charset=utf-8><meta name=viewport content='width=device-width, initial-scale=1'>"
                 "<title>Link too long</title>"
                 "<body style='font-family:sans-serif;max-width:40em;margin:3em auto;padding:0 1em'>"
                 "<h1>This link is too long</h1><p>It has {length:,} characters; the playground's share and lesson "
                 "links are at most 6,000, so it was cut, joined or made by hand and cannot be opened.</p>"
                 "<p><a href='{root}'>Open the playground without it</a></p></body>")


# The request head uvicorn's HTTP parser (h11) may hold while it is incomplete. Its default, 16 KiB, turns
# a long link whose request arrives in more than one piece (a browser's, over any network; 2 pieces are
# enough) into uvicorn's bare "400 Bad Request" before LinkTooLong sees it; in one piece the same link got
# the 414 page. Twice Gradio's own 65,536-character limit: a longer link still gets that 400.
MAX_REQUEST_HEAD_BYTES = 128 << 10


def allow_long_request_heads() -> None:
    """Let uvicorn's h11 parser hold a request head of up to MAX_REQUEST_HEAD_BYTES, so a too-long link
    reaches LinkTooLong however it arrives. Gradio builds uvicorn's Config without
    ``h11_max_incomplete_event_size``, so uvicorn falls back to its module's default, raised here
    (never lowered); a uvicorn without that default is left alone (tests/browser/test_fault_app.py would
    see the 400)."""
    from uvicorn.protocols.http import h11_impl

    default = getattr(h11_impl, "DEFAULT_MAX_INCOMPLETE_EVENT_SIZE", None)
    if isinstance(default, int) and default < MAX_REQUEST_HEAD_BYTES:
        h11_impl.DEFAULT_MAX_INCOMPLETE_EVENT_SIZE = MAX_REQUEST_HEAD_BYTES


class LinkTooLong:
    """ASGI middleware: a request whose path and query are over MAX_URL_CHARS gets HTTP 414 and
    ``TOO_LONG_PAGE`` (one line of what happened and a link to the app), nothing else runs
    (``allow_long_request_heads``: also when the request came in pieces)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope.get("type") == "http":
            length = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
            if length > MAX_URL_CHARS:
                root = html.escape((scope.get("root_path") or "").rstrip("/") + "/", quote=True)
                body = TOO_LONG_PAGE.format(length=length, root=root).encode()
                await send({"type": "http.response.start", "status": 414,
                            "headers": [(b"content-type", b"text/html; charset=utf-8"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


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
COPY_LINK_JS = static_text("share_copy_link.js", SHARE_PARAM=json.dumps(SHARE_PARAM))


def _share_inputs(view: PanelView) -> list:
    """The controls a link carries, in the order ``_make_token`` reads them."""
    return [view.prompt, *([view.chat] if view.chat is not None else []), view.panel.preset, *view.panel.inputs]


def _make_token(view: PanelView, stored: Any, values: Sequence[Any]) -> str:
    """The token for one view's control values (in ``_share_inputs`` order); "" plus a warning on failure."""
    values = list(values)
    prompt = values.pop(0)
    chat = bool(values.pop(0)) if view.chat is not None else None
    choice = values.pop(0)
    try:
        config = view.panel.config(*values)
        return share_token(view.name, prompt, config, choice, stored, chat)
    except (UserError, ShareLinkError, PresetError) as exc:
        gr.Warning(html.escape(f"No link: {exc}"))
        return ""


def _copy_link_row(views: dict[str, PanelView], user_presets: gr.BrowserState) -> None:
    """One "Copy link" row at the bottom of the page: pick the view, copy its link."""
    names = list(views)
    with gr.Accordion("Share a link", open=False, elem_id="dp-share"):
        with gr.Row():
            which = gr.Radio(names, value=names[0], label="View", scale=2, elem_id="dp-share-view")
            button = gr.Button("Copy link", size="sm", scale=0, min_width=120, elem_id="dp-copy-link")
            link = gr.Textbox(show_label=False, interactive=False, scale=4, elem_id="dp-share-link")
    groups = [_share_inputs(views[name]) for name in names]
    starts = [sum(len(g) for g in groups[:i]) for i in range(len(groups))]

    def on_click(name: str, stored: Any, *values: Any) -> str:
        i = names.index(name)
        return _make_token(views[name], stored, values[starts[i]: starts[i] + len(groups[i])])

    button.click(on_click, [which, user_presets, *(c for g in groups for c in g)], [link], api_visibility="private"
                 ).then(None, [link], [link], js=COPY_LINK_JS, api_visibility="private")


def _restore_updates(state: ShareState, view: PanelView, stored: Any) -> dict:
    """``{component: value}`` updates that show ``state`` in ``view``."""
    panel = view.panel
    choice, modified = matching_choice(state.preset.config, stored, state.preset.name)
    updates = {view.prompt: state.prompt} | panel.apply_preset(state.preset, choice, modified)
    if view.chat is not None and state.chat is not None:
        updates[view.chat] = state.chat
    return updates


def _restore_outputs(view: PanelView) -> list:
    panel = view.panel
    return [view.prompt, *([view.chat] if view.chat is not None else []), *panel.inputs, panel.preset, panel.modified]


def wire_share_links(demo: gr.Blocks, tabs: gr.Tabs, views: Sequence[PanelView], user_presets: gr.BrowserState) -> None:
    """The "Copy link" row, and on page load a ``?share=`` link restoring its view (tab, prompt,
    preset controls, seed); a bad link shows a warning and leaves the defaults."""
    by_name = {view.name: view for view in views}
    _copy_link_row(by_name, user_presets)
    outputs = [tabs] + [c for view in views for c in _restore_outputs(view)]

    def on_load(stored: Any, request: gr.Request) -> dict:
        result = restore_from_query(dict(request.query_params) if request is not None else {})
        if isinstance(result, ShareState) and result.view not in by_name:
            result = BAD_LINK.format(reason=f"view: this app has no view called {result.view!r}")
        if isinstance(result, str):
            gr.Warning(html.escape(result))  # toasts render HTML: a link's text must stay text
        if not isinstance(result, ShareState):
            return {tabs: gr.skip()}  # an empty dict would read as one output value, not as "no updates"
        return {tabs: gr.Tabs(selected=f"tab-{result.view}")} | _restore_updates(result, by_name[result.view], stored)

    demo.load(on_load, [user_presets], outputs, api_visibility="private")
