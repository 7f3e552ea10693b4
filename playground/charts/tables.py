"""Column widths for the app's tables (gr.Dataframe), from what they hold (issue #35).

Gradio fixes each column's width; a word or a number longer than its column was broken mid-word
("4.783e/-08", "agree/ment"). The page's CSS (static/app.css) now never breaks inside a word, so each
column must be as wide as its longest word (header words included: headers wrap at spaces), and a
column of sentences gets room for a few words a line. A table wider than its box scrolls sideways
inside it, with a hint (static/page.js marks it). No gradio here.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

CHAR_PX = 8.6  # a character of the tables' 14 px monospace font (Debian chromium's: 8.43 px), with room
CELL_PAD_PX = 28  # the cell's padding (8 + 8), its gap and the header's menu button
PROSE_WORDS = 6  # a cell of this many words or more is a sentence: its column gets PROSE_PX
PROSE_PX = 190


def longest_word(text: Any) -> int:
    """The characters of the longest run without a space in ``text``."""
    return max((len(word) for word in str(text).split()), default=0)


def column_widths(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str | int]:
    """Each column's width in px (Gradio's ``column_widths``): its longest word, header or cell, whole
    on one line; PROSE_PX at least for a column of sentences."""
    widths: list[str | int] = []
    for j, header in enumerate(headers):
        cells = [row[j] for row in rows if j < len(row)]
        chars = max([longest_word(header), *(longest_word(c) for c in cells)])
        prose = any(len(str(c).split()) >= PROSE_WORDS for c in cells)
        widths.append(f"{max(math.ceil(chars * CHAR_PX) + CELL_PAD_PX, PROSE_PX if prose else 0)}px")
    return widths
