"""Issue #39 in a real browser (Debian chromium via Playwright), at a projector's 1280x720 and a
phone's 390x844: a presenter picks the JSON example (the "json-object" preset), runs it, clicks the
first step, where the model wanted prose, and sees the grammar's panel draw the prose removed (the
hatched "removed" bars, like top-k's), the sentence naming what the model wanted, and the run's
grammar cost in the summary; the knob panel shows the grammar the preset filled."""

from __future__ import annotations

import json
import re

import pytest

from engine.presets import builtin_presets

from tests.helpers.common import browser_page, open_tab

pytestmark = [pytest.mark.browser, pytest.mark.slow]

PROMPT = "Describe a fictional person."
# The step chart's grammar panel, read from the plot: its title and the bars drawn as removed there.
GRAMMAR_PANEL = """() => {
  const plot = document.querySelector('#step-chart .js-plotly-plot');
  if (!plot || !plot.layout) return null;
  const titles = (plot.layout.annotations || []).map(a => a.text || '');
  const at = titles.findIndex(t => t.startsWith('grammar'));
  if (at < 0) return {titles};
  const axis = at === 0 ? 'y' : 'y' + (at + 1);
  const removed = plot.data.filter(t => t.name === 'removed' && t.yaxis === axis).flatMap(t => t.y);
  const kept = plot.data.filter(t => t.name === 'grammar' && t.yaxis === axis).flatMap(t => t.y);
  return {titles, title: titles[at], removed, kept, chart: plot.layout.title.text};
}"""


# Elements of the step view that reach past the page's right edge and are not inside a box that scrolls
# sideways on its own (a wide chart's or code block's): what a reader would scroll the page for.
WIDER_THAN_PAGE = """(width) => {
  const clipped = el => { for (let a = el.parentElement; a && a.id !== 'tab-step'; a = a.parentElement) {
      const s = getComputedStyle(a);
      if (['auto', 'scroll', 'hidden'].includes(s.overflowX) && a.getBoundingClientRect().right <= width + 1) return true; }
    return false; };
  return [...document.querySelectorAll('#tab-step *')].filter(el => {
      const r = el.getBoundingClientRect();
      return r.width > 0 && r.height > 0 && r.right > width + 1 && !clipped(el);
    }).slice(0, 8).map(el => `${el.tagName}#${el.id}.${el.className?.baseVal ?? el.className} ${Math.round(el.getBoundingClientRect().right)}`);
}"""


@pytest.fixture(params=[(1280, 720), (390, 844)], ids=["projector", "phone"])
def sized_page(browser, request):
    yield from browser_page(browser, *request.param)


def test_a_presenter_sees_the_grammar_remove_the_prose(sized_page, live_app, artifacts):
    page = sized_page
    width = page.viewport_size["width"]
    page.goto(live_app)
    open_tab(page, "Step through")
    page.locator("#step-prompt textarea").fill(PROMPT)
    page.locator("#step-preset input").click()
    page.locator("ul[role=listbox] li").filter(has_text="json-object").first.click()
    schema = json.loads(builtin_presets()["json-object"].config.grammar)
    page.click("#step-group-structured")  # the accordion holding the grammar knobs
    page.wait_for_function("() => (document.querySelector('#step-knob-grammar textarea') || {}).value?.includes('mood')",
                           timeout=30_000)
    assert json.loads(page.locator("#step-knob-grammar textarea").input_value()) == schema
    page.click("#step-generate")
    page.wait_for_selector("#step-status:has-text('done')", timeout=300_000)
    page.locator("#step-text .token").first.click()
    page.wait_for_function("() => (document.querySelector('#step-chart .gtitle')?.textContent || '').startsWith('step 0:')",
                           timeout=60_000)
    page.wait_for_function(f"() => ({GRAMMAR_PANEL})()?.title !== undefined", timeout=60_000)
    panel = page.evaluate(GRAMMAR_PANEL)
    assert "JSON" in panel["title"] and "masked" in panel["title"], panel["titles"]
    # the prose the model wanted is drawn removed; what is left starts the object
    assert panel["removed"] and all(label.startswith("✕ ") for label in panel["removed"])
    assert any(any(c.isalpha() for c in label[2:]) for label in panel["removed"]), panel["removed"]
    assert panel["kept"] and all(label.lstrip().startswith("{") for label in panel["kept"]), panel["kept"]
    explain = page.locator("#step-explain").inner_text()
    wanted = next(label[2:] for label in panel["removed"] if any(c.isalpha() for c in label[2:]))
    assert "The model wanted" in explain and "which the grammar forbids" in explain, explain
    assert "before the mask" in explain and "after it" in explain
    summary = page.locator("#step-summary").inner_text()
    assert "grammar cost" in summary and "nats" in summary, summary
    chart = page.locator("#step-chart").bounding_box()
    assert chart["x"] >= 0 and chart["x"] + chart["width"] <= width + 1  # the chart fits the screen
    # Issue #52: after a JSON-schema run, elements of the view were 468-1,101 px wide on a 390 px phone
    assert page.evaluate(WIDER_THAN_PAGE, width) == [], width
    assert page.evaluate("() => document.scrollingElement.scrollWidth") <= width + 1
    page.screenshot(path=str(artifacts / f"grammar-step0-{width}.png"), full_page=False)
    if "…" not in wanted:  # named in the chart as removed, and in the sentence above it
        assert f"“{wanted}”" in explain, (wanted, explain)
    tokens = page.locator("#step-text .token")
    last = tokens.count() - 1
    for at in (last // 2, last):  # a middle step, and the last: the end of text, all the complete grammar allows
        tokens.nth(at).click()
        page.wait_for_function(f"() => (document.querySelector('#step-chart .gtitle')?.textContent || '')"
                               f".startsWith('step {at}:')", timeout=60_000)
        page.wait_for_function(f"() => ({GRAMMAR_PANEL})()?.title !== undefined", timeout=60_000)
        explain = page.locator("#step-explain").inner_text()
        if at == last:
            assert "The grammar was complete: only the end of text" in explain, explain
        else:
            assert "the grammar allowed" in explain and "before the mask" in explain, explain


def test_the_distortion_lesson_draws_what_masking_costs(sized_page, live_app, artifacts):
    """The lesson "JSON mode never breaks the format: what it costs": Run and check ends with its
    claim checked (✓) and the chart of both exact distributions over the three answers."""
    page = sized_page
    width = page.viewport_size["width"]
    page.goto(f"{live_app}/?lesson=grammar")
    page.locator("#lessons-steps h3", has_text="JSON mode never breaks").wait_for()
    page.click("#lessons-run")
    page.wait_for_selector("#lessons-status:has-text('done'), #lessons-status .dp-error", timeout=600_000)
    outcome = page.locator("#lesson-outcome-text").inner_text()
    assert outcome.startswith("✓") and "Masked decoding picks" in outcome, outcome
    # the chart comes in the update that says done (at once when this deployment kept the result): drawn just after
    page.wait_for_function("() => document.querySelector('#lessons-chart .js-plotly-plot')?.data?.length > 0",
                           timeout=30_000)
    bars = page.evaluate("""() => {
        const plot = document.querySelector('#lessons-chart .js-plotly-plot');
        return plot ? plot.data.map(t => ({name: t.name, y: t.y, x: t.x})) : [];
    }""")
    assert [b["name"].split(",")[0].split(" (")[0] for b in bars] == ["the model", "masked decoding"]
    assert sorted(bars[0]["y"]) == ["Maybe", "No", "Yes"] and abs(sum(bars[1]["x"]) - 1) < 1e-3
    chart = page.locator("#lessons-chart").bounding_box()
    assert chart["x"] >= 0 and chart["x"] + chart["width"] <= width + 1
    page.screenshot(path=str(artifacts / f"grammar-lesson-{width}.png"), full_page=False)


IMG = '<img src=x onerror="window.__pwned=1">'


def type_grammar(page, text: str, kind: str) -> None:
    """Open the Structured output group, pick the grammar's kind and type the grammar, as a person does."""
    if not page.locator("#step-knob-grammar textarea").is_visible():
        page.click("#step-group-structured")
    page.locator("#step-knob-grammar_kind input").click()
    page.locator("ul[role=listbox] li").filter(has_text=kind).first.click()
    page.locator("#step-knob-grammar textarea").fill(text)


def assert_no_markup_ran(page) -> None:
    assert page.locator("img[src='x']").count() == 0 and page.evaluate("() => window.__pwned === undefined")


def test_a_hostile_grammar_stays_text_or_is_one_line(sized_page, live_app, artifacts):
    """Typed into the grammar box: a regex whose every string is markup runs, and the model's output
    (the markup, letter for letter) is drawn as text, never as an element; an invalid one with markup, a
    huge one (5,000 characters) and a schema that is not JSON each give one line naming ``grammar``,
    and the prompt stays in its box."""
    page = sized_page
    width = page.viewport_size["width"]
    page.goto(live_app)
    open_tab(page, "Step through")
    prompt = "Answer yes or no: is the sky blue?"
    page.locator("#step-prompt textarea").fill(prompt)
    type_grammar(page, IMG.replace(".", r"\.") + "(yes|no)", "regex")
    page.click("#step-generate")
    page.wait_for_selector("#step-status:has-text('done'), #step-status .dp-error", timeout=300_000)
    assert page.locator("#step-status .dp-error").count() == 0
    shown = "".join("".join(page.locator("#step-text .token").all_text_contents()).split())  # the tokens' text
    assert re.fullmatch(re.escape("".join(IMG.split())) + r"(yes|no)(⟪im_end⟫)?", shown), shown
    page.locator("#step-text .token").first.click()
    page.wait_for_selector("#step-chart .gtitle", timeout=60_000)
    assert_no_markup_ran(page)
    for text, kind, words in [(IMG + "(", "regex", "grammar: this regular expression does not compile"),
                              ("a" * 5000, "regex", "grammar: 5,000 characters is over the 4,000-character limit"),
                              ("{" + IMG, "json_schema", "grammar: the JSON schema is not valid JSON")]:
        type_grammar(page, text, kind)
        page.click("#step-generate")
        error = page.locator("#step-status .dp-error")
        try:  # the line for this grammar (the one before it may still be shown)
            error.filter(has_text=words).wait_for(timeout=120_000)
        finally:
            message = error.inner_text() if error.count() else page.locator("#step-status").inner_text()
        assert words in message and "\n" not in message.strip() and "Traceback" not in message, message
        assert page.locator("#step-prompt textarea").input_value() == prompt
        assert_no_markup_ran(page)
    page.screenshot(path=str(artifacts / f"grammar-hostile-{width}.png"), full_page=False)
