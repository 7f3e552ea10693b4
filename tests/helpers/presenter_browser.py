"""Shared by the tests: what tests/browser/test_presenter_browser.py and the tests beside it use."""

from __future__ import annotations


__all__ = ['LESSON', 'wait_for_step']


# A lesson of one short sampled run (4 panels: raw, temperature, final, the draw), carried by its link.
LESSON = {"version": 1, "id": "presenter-test", "title": "Temperature 0.8", "view": "step", "chat": False,
          "prompt": "The capital of France is", "select_step": 0,
          "preset": {"version": 1, "name": "T 0.8", "strategy": "sample", "temperature": 0.8, "seed": 1,
                     "max_new_tokens": 4},
          "steps": ["Temperature 0.8 sharpens the distribution.", "Step through the four tokens."]}


CHART_TITLE = "() => document.querySelector('#present-chart .gtitle')?.textContent || ''"


def wait_for_step(page, index: int) -> None:
    page.wait_for_selector(f"#present-text:has-text('Step {index} of')")
    page.wait_for_function(f"() => ({CHART_TITLE})().startsWith('step {index}:')")
