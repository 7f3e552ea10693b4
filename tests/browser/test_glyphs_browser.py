"""Issue #35: every glyph the app writes renders in Debian's chromium with the fonts a Debian
machine has (DejaVu, Liberation): "ⓘ" drew an empty box. Each non-ASCII character of the app's
sources (playground/, engine/, presets/: labels, chart text, sentences, CSS content) is drawn on a
canvas in the page's own fonts (the app's text, its tables' monospace, the charts' font) and
compared with the missing-glyph box: a character drawn exactly as an unassigned code point is
drawn (same width, same pixels) has no glyph."""

from __future__ import annotations

import unicodedata
from pathlib import Path

import pytest

from tests.helpers.common import browser_page

pytestmark = [pytest.mark.browser, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("playground", "engine", "presets")
MISSING = ("\U0010FFFD", "\u0378")  # a private-use code point of plane 16 and an unassigned one: no font has them

# (width, pixels) of ``text`` drawn in ``font`` on a canvas: a digest of its alpha channel.
DRAW_JS = """([chars, font]) => {
  const canvas = document.createElement('canvas');
  canvas.width = 96; canvas.height = 96;
  const ctx = canvas.getContext('2d');
  return chars.map(ch => {
    ctx.clearRect(0, 0, 96, 96);
    ctx.font = font;
    ctx.textBaseline = 'middle';
    ctx.fillText(ch, 16, 48);
    const alpha = ctx.getImageData(0, 0, 96, 96).data.filter((_, i) => i % 4 === 3);
    let hash = 0;
    for (let i = 0; i < alpha.length; i++) hash = (hash * 31 + alpha[i] * (i + 1)) >>> 0;
    return [Math.round(ctx.measureText(ch).width * 100) / 100, hash];
  });
}"""


def app_glyphs() -> dict[str, str]:
    """Every non-ASCII character in the app's sources (not a combining mark: it is drawn on the
    letter before it), with a file that uses it."""
    found: dict[str, str] = {}
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in (".py", ".js", ".css", ".json", ".html") and path.is_file():
                for ch in path.read_text(encoding="utf-8"):
                    if ord(ch) > 127 and not unicodedata.category(ch).startswith(("M", "C", "Z")):
                        found.setdefault(ch, str(path.relative_to(ROOT)))
    return found


def test_every_glyph_the_app_uses_renders(browser, live_app):
    glyphs = app_glyphs()
    assert "ℹ" in glyphs and "↔" in glyphs and "␣" in glyphs  # the sources were read
    for page in browser_page(browser, 1280, 720):
        page.goto(live_app)
        page.wait_for_selector("#lessons-pick")
        page_font = page.evaluate("() => getComputedStyle(document.querySelector('.gradio-container')).fontFamily")
        fonts = (page_font, '"IBM Plex Mono", ui-monospace, Consolas, monospace',  # the tables'
                 '"Open Sans", verdana, arial, sans-serif')  # plotly's
        missing = []
        for family in fonts:
            font = f"32px {family}"
            box = page.evaluate(DRAW_JS, [list(MISSING), font])
            assert box[0] == box[1], (family, box)  # the missing-glyph box is one drawing, whatever the code point
            drawn = page.evaluate(DRAW_JS, [list(glyphs), font])
            missing += [f"{ch!r} U+{ord(ch):04X} {unicodedata.name(ch, '?')} ({glyphs[ch]}) in {family}"
                        for ch, seen in zip(glyphs, drawn) if seen == box[0]]
        assert missing == []


def test_the_check_sees_a_glyph_debian_lacks(browser, live_app):
    """The box the issue saw: "ⓘ" (U+24D8) draws as the missing glyph where no installed font has
    it (fontconfig's word), and "ℹ" (U+2139, DejaVu Sans) does not."""
    import subprocess

    has = bool(subprocess.run(["fc-list", ":charset=24d8", "family"], capture_output=True, text=True).stdout.strip())
    for page in browser_page(browser, 1280, 720):
        page.goto(live_app)
        page.wait_for_selector("#lessons-pick")
        family = page.evaluate("() => getComputedStyle(document.querySelector('.gradio-container')).fontFamily")
        box, info, circled = page.evaluate(DRAW_JS, [["\U0010FFFD", "ℹ", "ⓘ"], f"32px {family}"])
        assert info != box and (circled != box) == has
