"""A QR code for the current share link, made locally (segno, pure Python; no network), so a room
can open the presenter's exact state on their phones."""

from __future__ import annotations

import base64
import io

import segno

MAX_QR_CHARS = 2_900  # a version-40 QR code at error level L holds 2,953 bytes


def qr_png_data_url(url: str, scale: int = 8) -> str:
    """A ``data:image/png;base64,...`` URL of the QR code for ``url`` (error correction M, with the
    standard 4-module quiet zone). Raises ValueError naming the argument when ``url`` is unusable."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError("url: empty; there is no share link to encode")
    if len(url.encode("utf-8")) > MAX_QR_CHARS:
        raise ValueError(f"url: {len(url):,} characters is too long for a QR code; shorten the prompt")
    buffer = io.BytesIO()
    segno.make(url, error="m", micro=False).save(buffer, kind="png", scale=scale, border=4)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


MAX_CAPTION_CHARS = 72


def qr_html(url: str, size_px: int = 320) -> str:
    """An <img> of the QR code, sized for a projector, with the link as its accessible label."""
    import html

    src = qr_png_data_url(url)
    # A pasted lesson's link carries the whole lesson (hundreds of characters): the caption shows its
    # start, so it never pushes the presenter's chart down; the code itself holds the whole link.
    shown = url if len(url) <= MAX_CAPTION_CHARS else url[:MAX_CAPTION_CHARS - 1] + "…"
    return (f'<figure class="dp-qr"><img src="{src}" width="{size_px}" height="{size_px}" '
            f'alt="QR code of the share link" style="image-rendering: pixelated"/>'
            f'<figcaption>Scan to open this exact state: {html.escape(shown)}</figcaption></figure>')
