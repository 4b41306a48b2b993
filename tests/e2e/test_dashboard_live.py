"""The tour's live case in a real browser: a run records in the background (the store's real writer,
as Locust's run recorder and users write: a ``running`` row rewritten every heartbeat, turns flushed
as they end), the Overview is open, and its new turns appear without a click; when the run ends the
page says so and stops re-reading (dashboard/live.py).

Truths: the turn indexes the test wrote (the TTFT-by-turn chart's x values, read back from plotly.js),
Streamlit's own script-run state (``data-test-script-state``) for the reruns after the end."""

from __future__ import annotations

import datetime as dt
import threading
import time

import pytest

from store.writer import Store
from tests.e2e.test_dashboard_browser import (  # noqa: F401  (browser: a fixture used below)
    CHROMIUM,
    SHOTS,
    WIDTH,
    _streamlit,
    _wait_idle,
    browser,
)

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} is missing: apt-get install chromium"),
]

RUN = "locust-20261206T120000Z-abc123"
LIVE_S = 1.0  # TURNSCOPE_DASHBOARD_LIVE_S: the page's store checks, seconds apart
TURNS = 6  # turns 0..5 of one session: 0 and 1 before the page opens, 2..5 while it is open

#: The largest turn index the drawn "TTFT by turn index" figure shows (its traces' x values, as
#: plotly.js holds them); -1 while it is not drawn. The figure is found by its x axis's title (Streamlit
#: draws a figure's own title outside the plot, so ``_fullLayout.title`` is empty).
MAX_TURN_DRAWN = """() => {
  let best = -1;
  for (const el of document.querySelectorAll('.js-plotly-plot')) {
    const axis = el._fullLayout && el._fullLayout.xaxis && el._fullLayout.xaxis.title;
    if (!axis || !(axis.text || '').startsWith('turn index')) continue;
    for (const tr of (el._fullData || [])) {
      for (const v of Array.from(tr.x || [])) { if (Number.isFinite(+v)) best = Math.max(best, +v); }
    }
  }
  return best;
}"""

#: Counts the script runs Streamlit starts from now on (its ``data-test-script-state``).
COUNT_RUNS = """() => {
  const app = document.querySelector('[data-testid="stApp"]');
  window.__tsRuns = 0;
  new MutationObserver(() => { if (app.getAttribute('data-test-script-state') === 'running') window.__tsRuns += 1; })
    .observe(app, {attributes: true, attributeFilter: ['data-test-script-state']});
}"""


#: What the page shows, for a failure's message: each figure's title and its traces' x values.
DRAWN = """() => [...document.querySelectorAll('.js-plotly-plot')].map(el => ({
  x_title: el._fullLayout ? (((el._fullLayout.xaxis || {}).title || {}).text || '') : '(not drawn)',
  x: (el._fullData || []).map(t => Array.from(t.x || []).map(String))}))"""


def _until(page, expression: str, timeout_ms: int) -> None:
    """Wait for `expression` to hold in the page; on a timeout, fail with what the page drew."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_function(expression, timeout=timeout_ms)
    except PlaywrightTimeout:
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / "live-timeout.png"), full_page=True)
        raise AssertionError(f"{expression[-40:]} not within {timeout_ms} ms; drawn: {page.evaluate(DRAWN)}; "
                             f"text: {page.inner_text('body')[:1500]}") from None


def _run_row(status: str, started: dt.datetime) -> dict:
    now = dt.datetime.now(dt.UTC)
    return {"run_id": RUN, "label": "live", "mode": "pd-bidir", "workload": "mixed", "history_mode": "text",
            "model": "turnscope-tiny", "config": {"host": "http://127.0.0.1:8200"}, "started_at": started,
            "updated_at": now, "finished_at": None if status == "running" else now, "status": status,
            "heartbeat_s": 1.0 if status == "running" else None}


def _turn(i: int, sent: dt.datetime) -> dict:
    return {"session_id": f"{RUN}-s0", "turn_index": i, "request_id": f"r{i}", "kind": "turn",
            "sent_at": sent, "ttft_s": 0.05 + 0.01 * i, "e2e_s": 0.2, "prompt_tokens": 200 + 100 * i,
            "completion_tokens": 16, "status": "ok", "reuse": "miss_first_turn" if i == 0 else "hit"}


def test_new_turns_appear_without_a_click(browser, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("TURNSCOPE_DASHBOARD_LIVE_S", str(LIVE_S))
    store = Store(tmp_path / "store")
    store.init()
    started = dt.datetime.now(dt.UTC)
    run_writer = store.writer(RUN, "locust-run", flush_interval_s=0.2)
    users = store.writer(RUN, "locust-users", flush_interval_s=0.2)
    row = _run_row("running", started)
    run_writer.append("runs_log", row)
    run_writer.flush()
    run_writer.keep_alive("runs_log", row, 1.0)
    for i in (0, 1):
        users.append("turns", _turn(i, started + dt.timedelta(seconds=i)))
    users.flush()
    go = threading.Event()

    def record() -> None:  # the rest of the run, a turn every 1.5 s once the page is open
        go.wait(120)
        for i in range(2, TURNS):
            time.sleep(1.5)
            users.append("turns", _turn(i, dt.datetime.now(dt.UTC)))
            users.flush()

    recorder = threading.Thread(target=record, daemon=True)
    recorder.start()
    try:
        with _streamlit(tmp_path / "store", tmp_path) as url:
            page = browser.new_page(viewport={"width": WIDTH, "height": 1400})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(url, wait_until="domcontentloaded")
            page.get_by_role("heading", name="Overview", exact=True).wait_for(timeout=60_000)
            page.get_by_text("is recording", exact=False).first.wait_for(timeout=60_000)
            _until(page, f"({MAX_TURN_DRAWN})() === 1", 60_000)
            go.set()
            # no click from here on: the page re-reads the store and draws the new turns itself
            _until(page, f"({MAX_TURN_DRAWN})() === {TURNS - 1}", 90_000)
            recorder.join(30)
            run_writer.stop_keep_alive()
            run_writer.append("runs_log", _run_row("complete", started))
            run_writer.flush()
            # the run's end lands: the page says nothing is recording any more, and stops re-reading
            page.wait_for_function("!document.body.innerText.includes('is recording')", timeout=60_000)
            _wait_idle(page)
            page.wait_for_timeout(1000)
            page.evaluate(COUNT_RUNS)
            page.wait_for_timeout(int(4 * LIVE_S * 1000))
            assert page.evaluate("window.__tsRuns") == 0, "the page kept rerunning after the run ended"
            assert page.locator('[data-testid="stException"]').count() == 0
            assert not errors, errors
            page.close()
    finally:
        go.set()
        run_writer.close()
        users.close()
