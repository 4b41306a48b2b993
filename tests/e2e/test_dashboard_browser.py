"""The dashboard in a real browser: `streamlit run` on a known store, driven by Playwright.

Saves artifacts/screenshots/overview.png (look at it). Needs Debian's chromium at /usr/bin/chromium
(scripts/install.sh installs it); skipped with the reason when it is missing.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests import dashboard_store

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOT = REPO / "artifacts" / "screenshots" / "overview.png"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} is missing: apt-get install chromium"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"streamlit exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"streamlit at {url} not healthy within {timeout_s} s")


@pytest.fixture
def dashboard_url(tmp_path):
    root = dashboard_store.build(tmp_path / "store")
    port = _free_port()
    log = (tmp_path / "streamlit.log").open("w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "streamlit",
            "run",
            str(REPO / "dashboard" / "app.py"),
            "--server.headless",
            "true",
            "--server.address",
            "127.0.0.1",
            "--server.port",
            str(port),
            "--browser.gatherUsageStats",
            "false",
        ],
        cwd=REPO,
        env={**os.environ, "TURNSCOPE_STORE": str(root)},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_overview_in_browser(dashboard_url):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            # Streamlit scrolls inside its main container, so a full-page screenshot would stop at the
            # viewport: make the viewport tall enough for the whole Overview instead.
            page = browser.new_page(viewport={"width": 1440, "height": 2300})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(dashboard_url, wait_until="domcontentloaded")
            page.get_by_role("heading", name="Overview").wait_for(timeout=60_000)
            # Three Plotly charts drawn (their SVG exists), and the headline metric.
            page.wait_for_function(
                "document.querySelectorAll('.js-plotly-plot .main-svg').length >= 3", timeout=60_000
            )
            metric = page.locator('[data-testid="stMetricValue"]')
            metric.first.wait_for(timeout=30_000)
            assert metric.count() == 1
            assert metric.first.inner_text().strip().endswith("×")
            assert page.locator('[data-testid="stException"]').count() == 0
            page.wait_for_timeout(1500)  # let Plotly finish its transitions before the picture
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SCREENSHOT), full_page=True)
            assert not errors, errors
        finally:
            browser.close()
    assert SCREENSHOT.stat().st_size > 10_000
