"""Shared by the tests: what tests/browser/test_screenshots_browser.py and the tests beside it use."""

from __future__ import annotations

from pathlib import Path

__all__ = ['DOCS', 'phone_problems']


DOCS = Path(__file__).resolve().parents[2] / "docs"


# Bounding boxes of every chart's texts (figure title, subplot titles, annotations, axis titles,
# tick labels, legend entries, and the component's label over it) on the shown tab: the texts cut
# off at the chart's sides, and the pairs of one chart that intersect by more than 2 px each way.
OVERLAPS_JS = """
() => {
  const out = [];
  for (const plot of document.querySelectorAll('.js-plotly-plot')) {
    if (!plot.getClientRects().length) continue;
    const label = plot.closest('.block')?.querySelector(':scope > [data-testid=block-label]:not(.sr-only):not(.hide)');
    const texts = '.gtitle, .annotation-text, .xtitle, .ytitle, .legendtext, .xaxislayer-above text, .yaxislayer-above text';
    const boxes = [...plot.querySelectorAll(texts), ...(label ? [label] : [])]
      .map(el => [el.textContent.trim(), el.getBoundingClientRect()]).filter(([, r]) => r.width > 0);
    const edge = plot.getBoundingClientRect();
    for (const [a, r] of boxes) if (r.left < edge.left - 2 || r.right > edge.right + 2) out.push(`${plot.parentElement.closest('[id]')?.id}: "${a}" is cut off`);
    for (let i = 0; i < boxes.length; i++) for (let j = i + 1; j < boxes.length; j++) {
      const [a, r] = boxes[i], [b, s] = boxes[j];
      const dx = Math.min(r.right, s.right) - Math.max(r.left, s.left);
      const dy = Math.min(r.bottom, s.bottom) - Math.max(r.top, s.top);
      if (dx > 2 && dy > 2) out.push(`${plot.parentElement.closest('[id]')?.id}: "${a}" / "${b}"`);
    }
  }
  return out;
}
"""


def phone_problems(page, name: str) -> list[str]:
    """What is wrong at the current (phone) width: a sideways page scroll, overlapping chart texts."""
    width = page.evaluate("() => [document.documentElement.scrollWidth, window.innerWidth]")
    wide = [f"{name}: the page is {width[0]} px wide in a {width[1]} px window"] if width[0] > width[1] else []
    return wide + [f"{name}: {pair}" for pair in page.evaluate(OVERLAPS_JS)]
