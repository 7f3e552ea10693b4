"""The presenter view in a real browser (embedded model, one lesson run): at 1280x720 the step's
chart fills the screen below the controls, ←/→ step through the tokens and redraw the chart, Esc
leaves; resized to a phone (390x844) the chart is redrawn two panels a row within the page width.
Step through's keyboard: Enter on a focused token chip opens that step. Out-of-range values typed
into slider boxes are refused, each named with its typed value."""

import json

import pytest

from playground.views.lessons import lesson_token
from playground.charts.step import NARROW_PX, panel_columns
from tests.helpers.common import open_tab
from tests.helpers.presenter_browser import CHART_TITLE, LESSON, wait_for_step  # noqa: F401


def test_panel_columns_one_row_on_a_projector_two_on_a_phone():
    assert [panel_columns(n, 1280) for n in (2, 3, 4, 5, 6, 8)] == [2, 3, 4, 3, 3, 4]  # rows of at most 4
    assert [panel_columns(n, None) for n in (2, 4)] == [2, 4]  # width not known yet: laid out wide
    assert [panel_columns(n, 390) for n in (1, 2, 4, 5)] == [1, 2, 2, 2]
    assert panel_columns(4, NARROW_PX - 1) == 2 and panel_columns(4, NARROW_PX) == 4


def box(page, selector: str) -> dict:
    return page.locator(selector).bounding_box()


@pytest.mark.slow
@pytest.mark.browser
def test_presenter_fills_the_screen_steps_by_keys_and_fits_a_phone(projector_page, live_app):
    page = projector_page
    page.goto(f"{live_app}/?lesson={lesson_token(json.dumps(LESSON))}&present=1")
    page.wait_for_selector("#presenter:visible")
    page.click("#present-run")  # the overlay covers the Lessons tab's own Run button
    page.wait_for_selector("#present-chart .gtitle", timeout=300_000)
    wait_for_step(page, 0)

    chart, controls = box(page, "#present-chart .js-plotly-plot"), box(page, "#present-controls")
    assert chart["y"] >= controls["y"] + controls["height"] - 1  # below the controls
    assert chart["y"] + chart["height"] <= 720 + 1  # and within the screen: no scrolling to see it
    assert chart["height"] >= 0.6 * 720 and chart["width"] >= 0.9 * 1280, chart
    size = page.evaluate("() => parseFloat(getComputedStyle(document.querySelector('#present-chart .ytick text')).fontSize)")
    assert size >= 18

    page.keyboard.press("ArrowRight")
    wait_for_step(page, 1)
    page.keyboard.press("ArrowRight")
    wait_for_step(page, 2)
    page.keyboard.press("ArrowLeft")
    wait_for_step(page, 1)

    page.set_viewport_size({"width": 390, "height": 844})  # the page's script sends the new width
    page.wait_for_function("() => document.querySelector('#present-chart .js-plotly-plot')?.layout?.meta?.narrow === true")
    wait_for_step(page, 1)
    assert page.evaluate("() => document.documentElement.scrollWidth") <= 390
    chart = box(page, "#present-chart .js-plotly-plot")
    assert chart["x"] >= 0 and chart["x"] + chart["width"] <= 390 + 1
    assert page.evaluate("() => document.querySelector('#present-chart .js-plotly-plot').layout.meta.columns") <= 2

    page.keyboard.press("Escape")
    page.wait_for_selector("#presenter", state="detached")
    assert not page.locator("#lessons-present input").is_checked()


@pytest.mark.slow
@pytest.mark.browser
def test_enter_on_a_focused_token_chip_opens_its_step(page, live_app):
    page.goto(live_app)
    open_tab(page, "Step through")
    page.fill("#step-knob-max_new_tokens input[type=number]", "4")
    page.locator("#step-knob-max_new_tokens input[type=number]").press("Enter")
    page.click("#step-generate")
    page.wait_for_selector("#step-status:has-text('done')", timeout=300_000)
    chip = page.locator("#step-text .token").nth(2)
    chip.focus()
    page.keyboard.press("Enter")
    title = "() => document.querySelector('#step-chart .gtitle')?.textContent || ''"
    page.wait_for_function(f"() => ({title})().startsWith('step 2:')")
    page.keyboard.press("ArrowRight")  # the focus moved with the selection: the next token
    page.wait_for_function(f"() => ({title})().startsWith('step 3:')")


@pytest.mark.slow
@pytest.mark.browser
def test_out_of_range_slider_values_are_refused_each_named_with_its_typed_value(page, live_app):
    """Issue #19 "Inputs silently changed": T 999, max_new_tokens 100000 and top-p -1 typed into
    the sliders' boxes. Each box shows its own refusal naming the knob and the typed value, and
    goes back to its previous value (Gradio's slider would clamp T to 5 and max_new_tokens to 1024)."""
    page.goto(live_app)
    open_tab(page, "Step through")
    typed = {"temperature": "999", "max_new_tokens": "100000", "top_p": "-1"}
    before = {}
    for name, value in typed.items():
        box = page.locator(f"#step-knob-{name} input[type=number]")
        before[name] = box.input_value()
        box.fill(value)
        box.press("Enter")
    for name, value in typed.items():
        note = page.locator(f"#step-knob-{name} .dp-refused")
        note.wait_for()
        assert f"{name}: {value} is out of range" in note.inner_text()
    page.wait_for_timeout(500)
    shown = {name: page.locator(f"#step-knob-{name} input[type=number]").input_value() for name in typed}
    assert shown == before, f"typed {typed}: the boxes went from {before} to {shown}"
    assert page.locator(".dp-refused").count() == 3  # every invalid knob at once, not only the first


@pytest.mark.slow
@pytest.mark.browser
def test_presenter_temperature_slider_redraws_the_shown_step(projector_page, live_app):
    """The projector's what-if: the slider redraws the shown step at another temperature through the
    route (no generation), the next step starts from the run's own temperature, and nothing is drawn
    while the guess hides the token."""
    page = projector_page
    page.goto(f"{live_app}/?lesson={lesson_token(json.dumps(LESSON))}&present=1")
    page.wait_for_selector("#presenter:visible")
    page.click("#present-run")
    page.wait_for_selector("#present-chart .gtitle", timeout=300_000)
    wait_for_step(page, 0)
    slider = page.locator("#present-temperature input[type=number]")
    assert float(slider.input_value()) == 0.8  # the run's own temperature
    own = page.locator("#present-chart").inner_text()
    page.evaluate("""() => { window.dpT1 = undefined;
        document.querySelector('#present-temperature input[type=number]').addEventListener('input',
            () => { window.dpT0 = performance.now(); }, true);
        new MutationObserver(() => { window.dpT1 = performance.now(); }).observe(
            document.querySelector('#present-chart'), {subtree: true, childList: true, attributes: true}); }""")
    slider.fill("2.5")
    page.wait_for_function("(b) => document.querySelector('#present-chart').innerText !== b", arg=own)
    page.wait_for_timeout(400)
    print(f"presenter what-if: {page.evaluate('() => Math.round(window.dpT1 - window.dpT0)')} ms in the page")
    hot = page.locator("#present-chart").inner_text()
    size = page.evaluate("() => parseFloat(getComputedStyle(document.querySelector('#present-chart .ytick text')).fontSize)")
    assert size >= 18  # still projector-sized
    slider.fill("0.8")  # back to the run's own temperature: the run's own chart again
    page.wait_for_function("(b) => document.querySelector('#present-chart').innerText === b", arg=own)
    assert hot != own

    page.click("#present-next")  # (the arrow keys move the focused slider)
    wait_for_step(page, 1)
    assert float(slider.input_value()) == 0.8
    page.check("#present-guess input")
    page.wait_for_selector("#present-text:has-text('Guess the next token')")
    page.wait_for_function("() => !document.querySelector('#present-chart .gtitle')")
    slider.fill("2")
    page.wait_for_timeout(1500)
    assert page.locator("#present-chart .gtitle").count() == 0  # the guess is not given away


# --- issue #35 -------------------------------------------------------------------------------------
HOT = LESSON | {"id": "presenter-hot", "title": "Temperature 5",
                "preset": LESSON["preset"] | {"name": "T 5", "temperature": 5.0}}
# The drawn range of each stage panel's probability axis (plotly's own, after autorange) and the subtitle.
DRAWN_AXES = """() => {
    const plot = document.querySelector('#present-chart .js-plotly-plot'), L = plot._fullLayout;
    const panels = (plot.layout.annotations || []).filter(a => (a.text || '').includes('kept')).length;
    const ranges = [...Array(panels).keys()].map(i => L['xaxis' + (i ? i + 1 : '')].range.map(v => +v.toFixed(9)));
    return {ranges, title: plot.layout.title.text};
}"""


def subtitle_matches_the_drawn_axes(page) -> bool:
    drawn = page.evaluate(DRAWN_AXES)
    ranges, subtitle = drawn["ranges"], drawn["title"].split("<sup>")[1]
    shared = all(r == ranges[0] for r in ranges)
    assert ("one probability axis for all stages" in subtitle) == shared, drawn
    assert ("each panel on its own scale" in subtitle) == (not shared), drawn
    return shared


@pytest.mark.slow
@pytest.mark.browser
def test_presenter_slider_shows_a_t5_run_and_its_subtitle_names_the_drawn_axes(projector_page, live_app):
    """The slider stopped at 3 and showed 3 for a T = 5 run, and the what-if subtitle said "one
    probability axis for all stages" over panels running 0-10% and 0-0.2%."""
    page = projector_page
    page.goto(f"{live_app}/?lesson={lesson_token(json.dumps(HOT))}&present=1")
    page.wait_for_selector("#presenter:visible")
    page.click("#present-run")
    page.wait_for_selector("#present-chart .gtitle", timeout=300_000)
    wait_for_step(page, 0)
    slider = page.locator("#present-temperature input[type=number]")
    assert float(slider.input_value()) == 5.0
    bounds = page.locator("#present-temperature input[type=range]")
    assert (float(bounds.get_attribute("min")), float(bounds.get_attribute("max"))) == (0.0, 5.0)
    kinds, shown = set(), 0
    for at in (0, 1, 3):  # the first, a middle and the last step
        while shown < at:
            page.click("#present-next")
            shown += 1
            wait_for_step(page, shown)
        assert float(slider.input_value()) == 5.0  # every step starts from the run's own value
        kinds.add(subtitle_matches_the_drawn_axes(page))  # the run's own chart
        for t in ("1", "3.5"):
            slider.fill(t)
            page.wait_for_function(f"() => ({CHART_TITLE})().startsWith('step {at}: what if')", timeout=60_000)
            page.wait_for_timeout(300)
            kinds.add(subtitle_matches_the_drawn_axes(page))
        slider.fill("5")  # back to the run's own
        page.wait_for_function(f"() => ({CHART_TITLE})().startsWith('step {at}: chose')", timeout=60_000)
    print(f"axes drawn shared / own-scale: {sorted(kinds)}")


@pytest.mark.slow
@pytest.mark.browser
def test_the_truncation_presenter_opens_on_the_first_token_of_the_top_p_lane(projector_page, live_app, artifacts):
    """It opened on its last step (Next did nothing) and showed the top-k lane (-0.0%)."""
    page = projector_page
    page.goto(f"{live_app}/?lesson=truncation&present=1")
    page.wait_for_selector("#presenter:visible")
    page.click("#present-run")
    page.wait_for_selector("#present-chart .gtitle", timeout=600_000)
    wait_for_step(page, 0)
    label = page.locator("#present-text .dp-present-label").inner_text()
    assert label.startswith("Step 0 of") and "the lesson's step is" in label, label
    titles = page.evaluate("() => document.querySelector('#present-chart .js-plotly-plot').layout.annotations"
                           ".map(a => a.text).join(' ')")
    assert "top-p" in titles and "top-k" not in titles and "min-p" not in titles, titles
    page.screenshot(path=str(artifacts / "presenter-truncation-step0.png"))
    page.click("#present-next")
    wait_for_step(page, 1)
    page.keyboard.press("Escape")
    page.wait_for_selector("#presenter", state="detached")
    # The Lessons tab's chart: the same lane, on the projector's first screen.
    chart = box(page, "#lessons-chart .js-plotly-plot")
    assert page.evaluate("() => window.scrollY") == 0
    assert chart["y"] >= 0 and chart["y"] + chart["height"] <= 720 + 1, chart
    assert "top-p" in page.locator("#lessons-chart").inner_text()
