"""Issue #35, the tables in a real browser at 1280x720 and 390x844: the KV-cache kinds ("16.1/0",
"4.783e/-08", "refere/nce"), the quantization variants ("agree/ment", the last column cut to "re"),
the memory calculator and Compare's metrics. No header or cell breaks inside a word or a number
(a line may break at a space, or after a hyphen between letters: "full-/precision"); no text spills
out of its cell; a table wider than its box scrolls sideways inside it and says so above it, with
the right edge shaded until the last column is scrolled into view."""

from __future__ import annotations

import re

import pytest

from tests.helpers.common import browser_page, open_tab

pytestmark = [pytest.mark.browser, pytest.mark.slow]

# Per header and cell: its text, and the top of each character's line (a character on its own
# line as its neighbour tells a break); whether its text spills out of the cell.
CELLS_JS = """root => [...root.querySelectorAll('th, [role=gridcell]')].filter(c => c.getClientRects().length).map(cell => {
  const chars = [];
  const walker = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    if (node.parentElement.closest('button')) continue;  // the header's menu button (⋮)
    for (let i = 0; i < node.length; i++) {
      const range = document.createRange();
      range.setStart(node, i); range.setEnd(node, i + 1);
      const rect = range.getBoundingClientRect();
      chars.push([node.data[i], rect.width > 0 ? Math.round(rect.top) : null]);
    }
  }
  const wrap = cell.querySelector('.cell-wrap') || cell;
  return {text: cell.innerText.trim(), chars, spills: wrap.scrollWidth > cell.clientWidth + 1};
})"""
SCROLL_JS = """root => {
  const wrap = root.querySelector('.table-wrap'), view = root.querySelector('.virtual-table-viewport');
  return {wide: view.scrollWidth > view.clientWidth + 1, flagged: wrap.hasAttribute('data-dp-scrolls'),
          hint: getComputedStyle(wrap, '::before').content, end: wrap.hasAttribute('data-dp-end')};
}"""
SIZES = ((1280, 720), (390, 844))
NUMBER = re.compile(r"^[−+-]?[\d,.]+(e[−+-]?\d+)?%?[),;:]?$")


def broken_words(cells: list[dict]) -> list[tuple[str, str]]:
    """(cell, word) for each word with its characters on more than one line: a word is a run
    without spaces; a line may break after a hyphen between letters, never inside a number."""
    broken = []
    for cell in cells:
        word: list[tuple[str, int | None]] = []
        for ch, top in [*cell["chars"], (" ", None)]:
            if not ch.isspace():
                word.append((ch, top))
                continue
            text = "".join(c for c, _ in word)
            parts = [text] if NUMBER.match(text) else re.split(r"(?<=[A-Za-z]-)(?=[A-Za-z(])", text)
            at = 0
            for part in parts:
                tops = {t for _, t in word[at:at + len(part)] if t is not None}
                if len({round(t / 4) for t in tops}) > 1:
                    broken.append((cell["text"], text))
                at += len(part)
            word = []
    return broken


def check_table(page, elem_id: str) -> list[str]:
    table = page.locator(f"#{elem_id}")
    table.scroll_into_view_if_needed()
    cells = table.evaluate(CELLS_JS)
    assert len(cells) > 4, elem_id
    problems = [f"{elem_id}: {word!r} broken in {cell!r}" for cell, word in broken_words(cells)]
    problems += [f"{elem_id}: {c['text']!r} spills out of its cell" for c in cells if c["spills"]]
    scroll = table.evaluate(SCROLL_JS)
    if scroll["wide"]:
        if not (scroll["flagged"] and "scroll sideways" in scroll["hint"] and not scroll["end"]):
            problems.append(f"{elem_id}: wider than its box and nothing says so ({scroll})")
        table.locator(".virtual-table-viewport").evaluate("v => { v.scrollLeft = v.scrollWidth; }")
        page.wait_for_timeout(200)
        if not table.evaluate(SCROLL_JS)["end"]:
            problems.append(f"{elem_id}: its right edge stays shaded at the end")
    elif scroll["flagged"]:
        problems.append(f"{elem_id}: says it scrolls but fits ({scroll})")
    return problems


def test_no_table_breaks_a_word_or_a_number_at_1280_or_390(browser, live_app, artifacts):
    for page in browser_page(browser, 1280, 720, timeout_ms=600_000):
        page.goto(live_app)
        page.wait_for_selector("#lessons-pick")
        open_tab(page, "Compare")
        boxes = page.locator(".cmp-lane:visible [id$='knob-max_new_tokens'] input")
        for i in range(boxes.count()):
            boxes.nth(i).fill("3")
            boxes.nth(i).press("Enter")
        page.click("#cmp-run")
        page.wait_for_selector("#cmp-status:has-text('done:')")
        page.wait_for_selector("#cmp-metrics [role=gridcell]")
        problems = []
        for width, height in SIZES:  # the same page relaid out, as a person turns a tablet
            page.set_viewport_size({"width": width, "height": height})
            page.wait_for_timeout(800)
            problems += [f"{width} px: {p}" for p in check_table(page, "cmp-metrics")]
        page.set_viewport_size({"width": 1280, "height": 720})  # a phone folds the tabs into a menu
        open_tab(page, "Quantization & KV cache")
        page.click("#kinds-measure")
        page.wait_for_selector("#kinds-status:has-text('done')")
        # fp32 and int8 over 4 tokens: the table's every column (its header words, "reference", a
        # percentage) at a cost a loaded 2-core machine pays in minutes (with nf4 and 20 tokens the
        # held-out perplexities took past 10 minutes)
        tokens = page.locator("#quant-tokens input[type=number]")
        tokens.fill("4")
        tokens.press("Enter")
        page.locator("#quant-variants label").filter(has_text=re.compile(r"^\s*nf4\s*$")).click()
        page.click("#quant-measure")
        page.wait_for_selector("#quant-status:has-text('done')")
        assert page.locator("#quant-table [role=gridcell]", has_text="int8").count() == 1
        for width, height in SIZES:
            page.set_viewport_size({"width": width, "height": height})
            page.wait_for_timeout(800)
            for elem_id in ("kinds-table", "quant-table", "calc-table"):
                problems += [f"{width} px: {p}" for p in check_table(page, elem_id)]
                page.locator(f"#{elem_id}").screenshot(path=str(artifacts / f"table-{elem_id}-{width}.png"))
        assert problems == []
