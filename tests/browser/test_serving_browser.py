"""Issue #41 in the browser: the Serving view open on a projector-sized page while 16 simulated
users (gradio_client sessions, ``bench.room``'s load) run on the live app; the view updates while
they run, and afterwards shows the same TTFT and TPOT percentiles, rows per tick and KV figures
(padded batch, paged blocks, contiguous reservation) as the run's printout. Then the same page at
phone size: no sideways scroll, every card inside the screen."""

from __future__ import annotations

import re
import threading
import time

import pytest

from bench.concurrency import app_clients
from bench.room import printout, room_run, serving_stats, spread_text
from tests.helpers.common import open_tab, wait_for_a_quiet_room
from engine.numbers import percent

pytestmark = [pytest.mark.slow, pytest.mark.browser]
USERS, TOKENS = 16, 48  # long enough that the page refreshes (every 2 s) several times while it runs


def card(page, key: str) -> str:
    return page.inner_text(f"#serving-cards-grid [data-key={key}] .dp-serving-value").strip()


def window_text(page) -> str:
    return page.inner_text("#serving-status").strip()


def test_the_view_during_a_room_load_shows_the_printouts_numbers(browser, live_app, registry, artifacts):
    from playground.examples import cache_for

    assert cache_for(registry).wait(600), "the startup examples did not finish"
    context = browser.new_context(viewport={"width": 1280, "height": 720})
    page = context.new_page()
    page.set_default_timeout(120_000)
    try:
        page.goto(live_app)
        page.wait_for_selector("#dp-tabs")
        open_tab(page, "Serving")
        wait_for_a_quiet_room(live_app)  # the window opened below (and the printout's) counts this test's runs only
        page.click("#serving-new-window")
        page.wait_for_selector("#serving-status:has-text('0 runs ended')")
        page.click("#serving-live input")  # Watch live
        clients = app_clients(live_app, USERS)
        outcome: dict = {}
        load = threading.Thread(target=lambda: outcome.setdefault("run", room_run(live_app, USERS, TOKENS, clients)))
        load.start()
        seen_live, texts = set(), []
        while load.is_alive():  # the page refreshes itself while the room works
            text = window_text(page)
            match = re.search(r"· (\d[\d,]*) ticks", text)
            if match and load.is_alive():
                seen_live.add(int(match.group(1).replace(",", "")))
                texts.append(f"{time.strftime('%X')} {text[-60:]}")
            time.sleep(0.5)
        load.join()
        run = outcome["run"]
        assert any(n > 0 for n in seen_live), f"the view never showed a tick while the load ran: {sorted(set(texts))}"
        stats = serving_stats(live_app, run)
        text = printout(run, stats)
        (artifacts / "serving-load-printout.txt").write_text(text)
        page.click("#serving-live input")  # stop watching: the numbers below must not move under the test
        page.click("#serving-refresh")
        page.wait_for_selector(f"#serving-status:has-text('{USERS} runs ended')")
        page.screenshot(path=str(artifacts / "serving-after-load.png"), full_page=True)
        ttft, tpot = spread_text(run.ttft_ms()), spread_text(run.tpot_ms())
        assert card(page, "ttft") == ttft and f"time to first token p50 / p95 {ttft}" in text
        assert card(page, "tpot") == tpot and f"time per output token p50 / p95 {tpot}" in text
        assert f"scheduler: time to first token p50 / p95 {ttft}" in text  # the scheduler agrees with the traces
        assert card(page, "rows") == f"{stats['mean_rows']:.1f} / {stats['max_rows']}"
        assert f"rows per tick mean {stats['mean_rows']:.1f} / max {stats['max_rows']}" in text
        assert stats["runs"] == USERS and stats["max_rows"] > 1  # batched: more than one row per forward
        peak = stats["peak"]
        padded, paged = ((peak[k] - peak["used"]) / peak[k] for k in ("padded", "paged"))
        waste = f"{percent(padded)} → {percent(paged)}"
        assert card(page, "waste") == waste
        assert card(page, "peak") == f"{peak['padded']:,} / {peak['paged']:,} / {peak['reserved']:,}"
        assert (f"left-padded batch {peak['padded']:,}, paged (block 16) {peak['paged']:,}, contiguous reservation "
                f"{peak['reserved']:,}") in text
        assert min(peak["padded"], peak["paged"], peak["reserved"]) >= peak["used"] > 0
        size = page.evaluate("() => parseFloat(getComputedStyle(document.querySelector('.dp-serving-value')).fontSize)")
        assert size >= 24, f"a projector's big numbers are {size} px"
        for plot in ("rows", "kv", "latency", "runs"):
            assert page.locator(f"#serving-{plot} .js-plotly-plot").count() == 1
        page.set_viewport_size({"width": 390, "height": 844})
        page.wait_for_timeout(500)
        page.screenshot(path=str(artifacts / "serving-after-load-phone.png"), full_page=True)
        widths = page.evaluate("() => [document.documentElement.scrollWidth, window.innerWidth]")
        assert widths[0] <= widths[1], f"the page scrolls sideways on a phone: {widths}"
        outside = page.evaluate("() => [...document.querySelectorAll('.dp-serving-card')]"
                                ".filter(c => c.getBoundingClientRect().right > window.innerWidth + 1).length")
        assert outside == 0
    finally:
        context.close()
