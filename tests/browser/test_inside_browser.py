"""Inside the model (issue #54) in a real browser on the embedded model, as a person uses it, on a
phone (390x844) and a projector (1280x720): a share link opens the view with its prompt and
watermark knobs, Generate colours the text, a click on a hesitation star opens its step's stage
chart, the logit lens, the ranks, the detector and the calibration diagram draw inside the page's
width, and Stop stops a long run."""

import pytest

from engine.config import DecodingConfig
from engine.presets import Preset
from engine.sharelink import ShareState, share_query
from playground import ids
from playground.page_js import PHONE_PX
from tests.helpers.common import browser_page

pytestmark = [pytest.mark.slow, pytest.mark.browser]

SIZES = [(390, 844), (1280, 720)]
PROMPT = "Name three rivers of France."
WAIT_MS = 300_000


def link(tokens: int) -> str:
    config = DecodingConfig(strategy="sample", seed=3, max_new_tokens=tokens, watermark_delta=3.0)
    return share_query(ShareState("inside", PROMPT, Preset.create("Watermarked", "A watermarked run.", config), 3, True))


def fits(page, selector: str, width: int) -> None:
    """The element is drawn and lies inside the page's width; the page does not scroll sideways."""
    box = page.locator(selector).first.bounding_box()
    assert box is not None and box["width"] > 100 and box["x"] >= -1 and box["x"] + box["width"] <= width + 1, box
    assert page.evaluate("() => document.scrollingElement.scrollWidth") <= width + 1


@pytest.mark.parametrize("size", SIZES, ids=["phone", "projector"])
def test_inside_the_model_draws_every_part_inside_the_page(browser, live_app, artifacts, size):
    width = size[0]
    for page in browser_page(browser, *size, timeout_ms=WAIT_MS):
        page.goto(live_app + "/" + link(8))
        page.wait_for_function(f"() => document.querySelector('#inside-prompt textarea')?.value === {PROMPT!r}")
        page.locator("#inside-group-watermark").get_by_text("Watermark").first.click()  # its accordion opens
        assert page.locator("#inside-knob-watermark_delta input[type=number]").first.input_value() == "3"
        for knob, value in (("seed", "3"), ("max_new_tokens", "8")):  # the link's run knobs too
            assert page.locator(f"#inside-knob-{knob} input[type=number]").first.input_value() == value
        assert page.locator("#inside-strategy input[value=sample]").is_checked()
        page.click("#inside-generate")
        page.wait_for_selector("#inside-status:has-text('done:')", timeout=WAIT_MS)
        assert page.locator("#inside-text-note").inner_text().startswith("Of ")  # the ranks' sentence
        fits(page, "#inside-over-run .js-plotly-plot", width)
        click_the_last_star_for_its_stages(page, width)
        page.click("#inside-lens-run")
        page.wait_for_selector("#inside-lens-chart .js-plotly-plot", timeout=WAIT_MS)
        assert page.locator("#inside-lens-note").inner_text().startswith("Step ")
        fits(page, "#inside-lens-chart .js-plotly-plot", width)
        page.click("#inside-detect-run")
        page.wait_for_selector("#inside-detect-chart .js-plotly-plot", timeout=WAIT_MS)
        assert "scored tokens are green" in page.locator("#inside-detect-note").inner_text()
        fits(page, "#inside-detect-chart .js-plotly-plot", width)
        page.locator("#inside-colour label", has_text="watermark").click()
        page.wait_for_function("() => document.querySelector('#inside-text-note')?.textContent.includes('z =')")
        page.click("#inside-rank-run")
        page.wait_for_selector("#inside-rank-chart .js-plotly-plot", timeout=WAIT_MS)
        fits(page, "#inside-rank-chart .js-plotly-plot", width)
        fits(page, "#inside-human-text", width)
        page.click("#inside-calibration-run")
        page.wait_for_selector("#inside-calibration-chart .js-plotly-plot", timeout=WAIT_MS)
        assert "ECE" in page.locator("#inside-calibration-note").inner_text()
        fits(page, "#inside-calibration-chart .js-plotly-plot", width)
        page.screenshot(path=str(artifacts / f"inside-{width}.png"), full_page=True)


def click_the_last_star_for_its_stages(page, width: int) -> None:
    """Point 5: a click on a hesitation step's star opens that step's stage chart (laid out for the
    page's width) and sets the logit lens's step to it."""
    stars = page.evaluate(f"() => document.querySelector('#{ids.INSIDE_OVER_RUN} .js-plotly-plot')"
                          ".data.find(t => t.name === 'hesitation').x")
    assert stars, "the run (seed 3) hesitates at steps 0, 1 and 7 on the embedded model"
    star = page.locator(f"#{ids.INSIDE_OVER_RUN} .scatterlayer .trace").nth(2).locator("path.point").last
    star.scroll_into_view_if_needed()
    box = star.bounding_box()
    page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    page.wait_for_function(f"() => document.querySelector('#inside-stage-chart .js-plotly-plot')?.layout?.title?.text"
                           f"?.startsWith('step {stars[-1]}: chose')", timeout=60_000)
    assert page.evaluate("() => document.querySelector('#inside-stage-chart .js-plotly-plot').layout.meta.phone") \
        is (width < PHONE_PX)
    assert page.locator("#inside-lens-step input[type=number]").first.input_value() == str(stars[-1])
    assert page.locator("#inside-stage-note").inner_text().startswith(f"Step {stars[-1]} ")
    fits(page, "#inside-stage-chart .js-plotly-plot", width)


def test_stop_stops_a_long_run_and_a_bad_value_is_one_line(projector_page, live_app):
    page = projector_page
    page.goto(live_app + "/" + link(1024))
    page.wait_for_function(f"() => document.querySelector('#inside-prompt textarea')?.value === {PROMPT!r}")
    page.click("#inside-generate")
    page.wait_for_selector("#inside-status:has-text('generating')", timeout=WAIT_MS)
    page.click("#inside-stop")
    page.wait_for_selector("#inside-status:has-text('stopped')", timeout=60_000)
    page.fill("#inside-human textarea", "")
    page.click("#inside-rank-run")
    page.wait_for_selector("#inside-status .dp-error", timeout=WAIT_MS)
    message = page.locator("#inside-status .dp-error").inner_text()
    assert "text: empty" in message and "\n" not in message.strip()
