"""Share links: the view, prompt, seed and preset, carried in the URL itself (no server-side file, so
a link survives server restarts).

Token format: ``"s2."`` + base64url(raw-deflate(compact JSON)) + ``"."`` + checksum, with the JSON object
``{"view": str, "prompt": str, "seed": int, "preset": {<preset object without its seed>}}``, plus
``"chat": bool`` when the view has a chat-template switch.
The checksum is the first 6 base64url characters (36 bits) of SHA-256 over the body, so a
corrupted or hand-edited link is refused with a clear message instead of decoding to another valid
link. Links made before the checksum (``"s1."`` + body) are still read, unchecked: they were
promised to survive server upgrades, and their content is validated like any other.
``decode`` treats the token as untrusted: size caps before and after decompression, strict JSON,
the preset validated by ``parse_preset``; it never raises anything but ShareLinkError.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
import zlib
from dataclasses import dataclass, replace
from typing import Any

from engine.config import ConfigError, check_knob, check_text
from engine.presets import Preset, PresetError, loads_strict, parse_preset, short_repr

SHARE_PARAM = "share"  # the URL query parameter: ?share=<token>
TOKEN_PREFIX = "s2."  # format version 2: with a checksum
LEGACY_PREFIX = "s1."  # version 1, no checksum: still read
CHECKSUM_CHARS = 6
MAX_TOKEN_CHARS = 6_000  # stays well under common URL limits (8 KiB request lines)
MAX_JSON_BYTES = 32_768  # after decompression: a bigger payload is refused, not inflated
MAX_PROMPT_CHARS = 8_000
VIEW_PATTERN = re.compile(r"[a-z][a-z0-9_-]{0,31}")
_TOKEN_CHARS = re.compile(r"[A-Za-z0-9_-]*")
_PAYLOAD_KEYS = ("view", "prompt", "seed", "preset")
_OPTIONAL_KEYS = ("chat",)


class ShareLinkError(ValueError):
    """A share link cannot be made or read; the message says why."""


@dataclass(frozen=True)
class ShareState:
    """What a link restores. ``preset.config.seed`` always equals ``seed`` (one source of truth);
    ``seed=None`` takes the preset's. ``chat``: the chat-template switch, None where a view has none."""

    view: str
    prompt: str
    preset: Preset
    seed: int | None = None
    chat: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.view, str) or not VIEW_PATTERN.fullmatch(self.view):
            raise ShareLinkError(f"view: expected a short lower-case name like 'step', got {short_repr(self.view)}")
        try:
            check_text("prompt", self.prompt, max_len=MAX_PROMPT_CHARS, allow_empty=True)
        except ConfigError as exc:
            raise ShareLinkError(str(exc)) from None
        if self.chat is not None and not isinstance(self.chat, bool):
            raise ShareLinkError(f"chat: expected true or false, got {short_repr(self.chat)}")
        if not isinstance(self.preset, Preset):
            raise ShareLinkError(f"preset: expected a Preset, got {type(self.preset).__name__}")
        try:
            seed = check_knob("seed", self.preset.config.seed if self.seed is None else self.seed)
        except ConfigError as exc:
            raise ShareLinkError(str(exc)) from None
        except (ValueError, TypeError, OverflowError):
            raise ShareLinkError("seed: expected an integer") from None
        object.__setattr__(self, "seed", seed)
        if self.preset.config.seed != seed:
            object.__setattr__(self, "preset", replace(self.preset, config=replace(self.preset.config, seed=seed)))


def encode(state: ShareState) -> str:
    """A URL-safe token for ``state``. Raises ShareLinkError if it would be over MAX_TOKEN_CHARS
    (a very long prompt)."""
    preset = state.preset.to_dict()
    preset.pop("seed", None)
    payload = {"view": state.view, "prompt": state.prompt, "seed": state.seed, "preset": preset}
    if state.chat is not None:
        payload["chat"] = state.chat
    raw = json.dumps(payload, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")
    packer = zlib.compressobj(9, zlib.DEFLATED, -15)  # raw deflate: no header, 6 bytes shorter
    packed = packer.compress(raw) + packer.flush()
    body = base64.urlsafe_b64encode(packed).rstrip(b"=").decode("ascii")
    token = f"{TOKEN_PREFIX}{body}.{checksum(body)}"
    if len(token) > MAX_TOKEN_CHARS:
        raise ShareLinkError(f"link: {len(token):,} characters is over the {MAX_TOKEN_CHARS:,}-character limit; "
                             "shorten the prompt")
    return token


def share_query(state: ShareState) -> str:
    """The query string to append to the app's URL: ``?share=<token>``."""
    return f"?{SHARE_PARAM}={encode(state)}"


def checksum(body: str) -> str:
    """The first CHECKSUM_CHARS base64url characters of SHA-256(body)."""
    digest = hashlib.sha256(body.encode("ascii")).digest()
    return base64.urlsafe_b64encode(digest).decode("ascii")[:CHECKSUM_CHARS]


def _body(token: Any) -> str:
    """The base64 body of a token, its checksum verified (legacy s1 tokens have none)."""
    if not isinstance(token, str):
        raise ShareLinkError(f"link: expected text, got {type(token).__name__}")
    if len(token) > MAX_TOKEN_CHARS:
        raise ShareLinkError(f"link: {len(token):,} characters is over the {MAX_TOKEN_CHARS:,}-character limit")
    if token.startswith(LEGACY_PREFIX):
        body, check = token[len(LEGACY_PREFIX):], None
    elif token.startswith(TOKEN_PREFIX):
        body, _, check = token[len(TOKEN_PREFIX):].rpartition(".")
    else:
        raise ShareLinkError(f"link: unknown format (expected it to start with {TOKEN_PREFIX!r}); was it cut short?")
    if not body or not _TOKEN_CHARS.fullmatch(body):
        raise ShareLinkError("link: contains characters a share link never has; was it copied whole?")
    if check is not None and check != checksum(body):
        raise ShareLinkError("link: damaged (its checksum does not match); was it copied whole?")
    return body


def _unpack(token: Any) -> bytes:
    body = _body(token)
    try:
        packed = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        unpacker = zlib.decompressobj(-15)
        raw = unpacker.decompress(packed, MAX_JSON_BYTES + 1)
    except (binascii.Error, ValueError, zlib.error):
        raise ShareLinkError("link: damaged (it does not decompress); was it copied whole?") from None
    if len(raw) > MAX_JSON_BYTES or unpacker.unconsumed_tail:
        raise ShareLinkError(f"link: its content is over the {MAX_JSON_BYTES:,}-byte limit")
    if not unpacker.eof or unpacker.unused_data:
        raise ShareLinkError("link: damaged (it ends early); was it copied whole?")
    return raw


def decode(token: Any) -> ShareState:
    """The ShareState in a token. Never raises anything but ShareLinkError."""
    raw = _unpack(token)
    try:
        payload = loads_strict(raw, "link", MAX_JSON_BYTES)
    except PresetError as exc:
        raise ShareLinkError(str(exc)) from None
    if not isinstance(payload, dict):
        raise ShareLinkError(f"link: expected an object, got {type(payload).__name__}")
    unknown = [k for k in payload if k not in _PAYLOAD_KEYS + _OPTIONAL_KEYS]
    missing = [k for k in _PAYLOAD_KEYS if k not in payload]
    if unknown or missing:
        raise ShareLinkError(f"link: expected keys {', '.join(_PAYLOAD_KEYS)} (and optionally chat); "
                             f"unknown {short_repr(unknown)}, missing {short_repr(missing)}")
    preset_data = payload["preset"]
    if isinstance(preset_data, dict) and "seed" in preset_data:
        raise ShareLinkError("preset: the seed belongs at the top level of a link")
    try:
        preset = parse_preset(preset_data)
    except PresetError as exc:
        raise ShareLinkError(f"preset: {exc}") from None
    return ShareState(view=payload["view"], prompt=payload["prompt"], preset=preset, seed=payload["seed"],
                      chat=payload.get("chat"))
