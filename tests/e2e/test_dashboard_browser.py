"""The dashboard in a real browser: `streamlit run` on a known store, driven by Playwright.

Opens every page in headless Chromium and saves artifacts/screenshots/<page>.png (look at them).
Needs Debian's chromium at /usr/bin/chromium (scripts/install.sh installs it); skipped with the
reason when it is missing.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from dashboard import pages
from tests import capacity_store, dashboard_store, eviction_store, sweep_store

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
SHOTS = REPO / "artifacts" / "screenshots"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
WIDTH = 1440

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


@contextlib.contextmanager
def _streamlit(root: Path, tmp: Path):
    """`streamlit run dashboard/app.py` over the store at `root`; yields its URL."""
    port = _free_port()
    log = (tmp / "streamlit.log").open("w")
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


@pytest.fixture(scope="module")
def dashboard_url(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    with _streamlit(dashboard_store.build(tmp / "store"), tmp) as url:
        yield url


@pytest.fixture(scope="module")
def sweep_url(tmp_path_factory):
    """A store holding a prefix sweep (tests/sweep_store.py), for the Sweep page."""
    tmp = tmp_path_factory.mktemp("e2e-sweep")
    with _streamlit(sweep_store.build(tmp / "store"), tmp) as url:
        yield url


@pytest.fixture(scope="module")
def traffic_url(tmp_path_factory):
    """The dashboard store plus a traffic report of the 24 shipped kv-cache-tester traces."""
    from loadgen.traces.kv_cache_tester import DEFAULT_DIR
    from loadgen.traffic import build_report
    from store.writer import Store

    tmp = tmp_path_factory.mktemp("e2e-traffic")
    root = dashboard_store.build(tmp / "store")
    build_report(Store(root), [DEFAULT_DIR], label="kv-cache-tester")
    with _streamlit(root, tmp) as url:
        yield url


@pytest.fixture(scope="module")
def plan_url(planned_store, tmp_path_factory):
    """The dashboard over the shared planned store (``planned_store``, tests/e2e/conftest.py)."""
    with _streamlit(planned_store, tmp_path_factory.mktemp("e2e-plan")) as url:
        yield url


@pytest.fixture(scope="module")
def capacity_url(tmp_path_factory):
    """A store holding a capacity ramp (tests/capacity_store.py), for the Memory page's capacity section."""
    tmp = tmp_path_factory.mktemp("e2e-capacity")
    with _streamlit(capacity_store.build(tmp / "store"), tmp) as url:
        yield url


@pytest.fixture(scope="module")
def nixl_url(tmp_path_factory):
    """The hand-counted expired and failed pulls of tests/integration/test_pull_failures_store.py
    (proxy outcomes and vLLM's NIXL counters, P restarting once), for the Memory page's section."""
    from tests.integration.test_pull_failures_store import build

    tmp = tmp_path_factory.mktemp("e2e-nixl")
    with _streamlit(build(tmp / "store").root, tmp) as url:
        yield url


@pytest.fixture(scope="module")
def quiet_url(tmp_path_factory):
    """One pd-bidir run whose pulls neither expired nor failed (tests/integration/test_pull_failures_store.py's
    ``build_quiet``: flat NIXL counters), for the Memory page's quiet case."""
    from tests.integration.test_pull_failures_store import build_quiet

    tmp = tmp_path_factory.mktemp("e2e-quiet")
    with _streamlit(build_quiet(tmp / "store").root, tmp) as url:
        yield url


@pytest.fixture(scope="module")
def eviction_url(tmp_path_factory):
    """A store holding P's eviction ladder (tests/eviction_store.py), for the Memory page's window."""
    tmp = tmp_path_factory.mktemp("e2e-eviction")
    with _streamlit(eviction_store.build(tmp / "store"), tmp) as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


def _open(browser, url: str, title: str, charts: int):
    """A page at `url` with its heading `title` and at least `charts` Plotly charts drawn."""
    page = browser.new_page(viewport={"width": WIDTH, "height": 1200}, accept_downloads=True)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url, wait_until="domcontentloaded")
    page.get_by_role("heading", name=title, exact=True).wait_for(timeout=60_000)
    _wait_charts(page, charts)  # charts are drawn by default (dashboard/charts.py): no click
    return page, errors


def _wait_charts(page, charts: int) -> None:
    if charts:
        page.wait_for_function(
            f"document.querySelectorAll('.js-plotly-plot .main-svg').length >= {charts}", timeout=60_000
        )
    _wait_idle(page)


#: Streamlit idle: its script has run and is not running (the app's ``data-test-script-state``:
#: ``initial`` before the first run, then ``running`` / ``notRunning``) and no "running" status widget
#: is shown. Without the first condition a slow page's first run could look idle before it began.
IDLE = ("document.querySelector('[data-testid=\"stApp\"]')?.getAttribute('data-test-script-state') === 'notRunning'"
        " && !document.querySelector('[data-testid=\"stStatusWidget\"]')")


def _wait_idle(page) -> None:
    page.wait_for_function(IDLE, timeout=60_000)


def _tags(html: str) -> list[tuple[str, dict]]:
    """Every start tag of `html` with its attributes (script bodies are data, not tags)."""
    from html.parser import HTMLParser

    out: list[tuple[str, dict]] = []

    class P(HTMLParser):
        def handle_starttag(self, tag, attrs):
            out.append((tag, dict(attrs)))

    P().feed(html)
    return out


def _shot(page, name: str) -> Path:
    """Screenshot the whole page: Streamlit scrolls inside its main container, so the viewport is
    grown to the content's height first."""
    page.wait_for_timeout(1200)  # let Plotly finish its transitions before the picture
    height = page.evaluate(
        "Math.max(...[...document.querySelectorAll('[data-testid=\"stMain\"], [data-testid=\"stMainBlockContainer\"]')]"
        ".map(e => e.scrollHeight), 900)"
    )
    page.set_viewport_size({"width": WIDTH, "height": int(height) + 80})
    page.wait_for_timeout(800)
    SHOTS.mkdir(parents=True, exist_ok=True)
    path = SHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    assert page.locator('[data-testid="stException"]').count() == 0
    assert path.stat().st_size > 10_000
    return path


def test_overview_in_browser(dashboard_url, browser, tmp_path):
    page, errors = _open(browser, dashboard_url, "Overview", 3)
    metric = page.locator('[data-testid="stMetricValue"]')
    assert metric.count() == 1
    assert metric.first.inner_text().strip().endswith("x")  # a speed-up, as the CLI prints it
    # A local viewer's toolbar (client.toolbarMode = viewer, .streamlit/config.toml): no Deploy.
    assert page.get_by_text("Deploy", exact=True).count() == 0
    # Every page is in the navigation.
    nav = page.locator('[data-testid="stSidebarNav"]').inner_text()
    for p in pages.PAGES:
        assert p.title in nav
    _shot(page, "overview")
    # The export is one self-contained HTML file: plotly.js inlined, no script from the network.
    with page.expect_download(timeout=60_000) as dl:
        page.get_by_role("button", name="Export these runs as HTML").click(timeout=60_000)
    saved = tmp_path / "runs.html"
    dl.value.save_as(saved)
    tags = _tags(saved.read_text(encoding="utf-8"))
    assert [a for t, a in tags if t in ("script", "link") and ("src" in a or "href" in a)] == []
    assert sum(1 for t, a in tags if t == "div" and a.get("class") == "plotly-graph-div") >= 8
    assert not errors, errors
    page.close()


def test_turns_in_browser(dashboard_url, browser):
    page, errors = _open(browser, f"{dashboard_url}/turns", "Turns", 3)
    assert "where the engine reused" in page.inner_text("body")
    _shot(page, "turns")
    assert not errors, errors
    page.close()


def test_sessions_in_browser(dashboard_url, browser):
    page, errors = _open(browser, f"{dashboard_url}/sessions", "Sessions", 1)
    page.locator('[data-testid="stSelectbox"]').first.click(timeout=60_000)
    page.get_by_role("option").first.click(timeout=60_000)
    _wait_charts(page, 2)
    _shot(page, "sessions")
    assert not errors, errors
    page.close()


#: Every drawn Plotly trace on the page as plotly.js holds it: name, y axis, hover template, x and y.
READ_TRACES = """
() => Array.from(document.querySelectorAll('.js-plotly-plot')).flatMap(el => (el._fullData || []).map(t => ({
  name: t.name, yaxis: t.yaxis, hover: t.hovertemplate || '', x: Array.from(t.x || []), y: Array.from(t.y || [])})))
"""


def test_memory_in_browser(dashboard_url, browser):
    """The Memory page as first drawn (nothing pressed): the memory timeline holds the store's
    hand-written gauges (tests/dashboard_store.py: P's and D's KV usage, the aggregated worker's,
    the proxy's live handle bytes per run; P's idle API-server copy of the gauge never drawn), and
    the what-if TTL chart the hand-replayed hit rates of tests/integration/test_dashboard_pages.py
    (pd-bidir: 15 of 18 later turns at the runs' 480 s, 17 of 18 at 900 s; pd-bidir-nocache: none)."""
    page, errors = _open(browser, f"{dashboard_url}/memory", "Memory", 2)
    page.wait_for_function(f"({READ_TRACES})().some(t => t.name === 'pd-bidir · hit rate')", timeout=60_000)
    _wait_idle(page)
    traces = page.evaluate(READ_TRACES)

    def drawn(suffix: str) -> list[list[float]]:
        return [t["y"] for t in traces if f" · {suffix}<br>" in t["hover"]]

    def pct(values: list[float]):
        return pytest.approx([v * 100 for v in values])

    ds = dashboard_store
    p_d_runs = [r for r, (mode, *_) in ds.RUNS.items() if mode != "aggregated"]
    assert drawn("decode") == [pct(ds.D_USAGE)] * len(p_d_runs)
    assert drawn("prefill") == [pct(ds.P_USAGE)] * len(p_d_runs)
    assert drawn("aggregated") == [pct(ds.AGG_USAGE)]
    assert sorted(drawn("handles")) == sorted([b / ds.MIB for b in ds.HANDLE_BYTES[r]] for r in p_d_runs)
    rates = {t["name"]: dict(zip(t["x"], t["y"], strict=True)) for t in traces if t["name"].endswith(" · hit rate")}
    assert rates["pd-bidir · hit rate"][480] == pytest.approx(15 / 18 * 100)
    assert rates["pd-bidir · hit rate"][900] == pytest.approx(17 / 18 * 100)
    assert set(rates["pd-bidir-nocache · hit rate"].values()) == {0}
    _shot(page, "memory")
    assert not errors, errors
    page.close()


#: The bars of the drawn figure holding a trace named by the argument (its legend names are its own;
#: ``_fullLayout.title`` did not find it), as plotly.js holds them: trace name -> {y: x}.
READ_BARS = """
(name) => {
  for (const el of document.querySelectorAll('.js-plotly-plot')) {
    const fd = el._fullData;
    if (!fd || !fd.some(tr => tr.name === name)) continue;
    const out = {};
    for (const tr of fd) {
      out[tr.name] = {};
      Array.from(tr.y).forEach((y, i) => { out[tr.name][y] = tr.x[i]; });
    }
    return {bars: out, marks: el.querySelectorAll('.bars .point path').length};
  }
  return null;
}
"""
#: Every dataframe's cells as the grid's accessible table gives them: [[header...], [row...], ...].
READ_GRIDS = """
() => Array.from(document.querySelectorAll('[data-testid="stDataFrame"]')).map(df =>
  Array.from(df.querySelectorAll('tr')).map(tr =>
    Array.from(tr.querySelectorAll('th, td')).map(c => c.innerText.trim())))
"""


def test_memory_nixl_failures_in_browser(nixl_url, browser):
    """The Memory page's expired and failed pulls, drawn and tabled from the store's rows: run
    ``bidir``'s counts as counted by hand in tests/integration/test_pull_failures_store.py (proxy
    miss_expired 2 and miss_transfer_failed 3; P's KV expired 1 + 2 + 1 + 0 = 4 across its restart
    and failed transfers 2; D's KV expired 7); runs with neither an outcome nor a counter are left out."""
    from dashboard.figures import NIXL_FAILURE_BARS

    page, errors = _open(browser, f"{nixl_url}/memory", "Memory", 1)
    first = NIXL_FAILURE_BARS[0][1]
    page.wait_for_function(READ_BARS, arg=first, timeout=60_000)  # the figures are drawn in page order
    _wait_idle(page)
    drawn = page.evaluate(READ_BARS, first)
    name = "bidir · pd-bidir"
    want = dict(zip([label for _, label, _ in NIXL_FAILURE_BARS], [2, 4, 3, 2, 7], strict=True))
    assert {label: bars.get(name) for label, bars in drawn["bars"].items()} == want
    assert all(list(bars) == [name] for bars in drawn["bars"].values())  # agg, warm, no-turns: nothing to show
    assert drawn["marks"] == len(want)  # five bars, each drawn
    _shot(page, "memory-nixl-failures")
    grids = [g for g in page.evaluate(READ_GRIDS) if g and "P: KV expired" in g[0]]
    assert len(grids) == 1, page.evaluate(READ_GRIDS)
    head, *rows = grids[0]
    rows = [dict(zip(head, r, strict=False)) for r in rows if r]
    assert [r["run"] for r in rows] == ["bidir"]
    got = {k: rows[0][k] for k in ("proxy miss_expired", "proxy miss_transfer_failed", "P: KV expired",
                                   "P: failed transfers", "P: of which notifications", "D: KV expired")}
    assert got == {"proxy miss_expired": "2", "proxy miss_transfer_failed": "3", "P: KV expired": "4",
                   "P: failed transfers": "2", "P: of which notifications": "0", "D: KV expired": "7"}
    # not scraped: no value, never 0 (the grid's accessible table holds the columns in view only)
    assert rows[0]["P: notified after expiry"] in ("", "<NA>", "None")
    assert not errors, errors
    page.close()


def test_memory_without_failed_pulls_says_so_in_browser(quiet_url, browser):
    """Where every run's expired and failed pulls read 0 (by hand in ``build_quiet``), the Memory page
    says so in one line above the counters' table instead of drawing a chart of empty bars."""
    from dashboard.figures import NIXL_FAILURE_BARS

    page, errors = _open(browser, f"{quiet_url}/memory", "Memory", 0)
    line = page.get_by_text("No expired or failed pulls in the 1 run(s) that record them")
    line.wait_for(timeout=60_000)
    _wait_idle(page)
    line.scroll_into_view_if_needed()  # the grid below it fills its accessible table once in view
    page.wait_for_function(f"({READ_GRIDS})().some(g => g.length > 1 && g[0].includes('P: KV expired'))",
                           timeout=60_000)
    assert page.evaluate(READ_BARS, NIXL_FAILURE_BARS[0][1]) is None  # no such chart drawn
    grids = [g for g in page.evaluate(READ_GRIDS) if g and "P: KV expired" in g[0]]
    assert len(grids) == 1, page.evaluate(READ_GRIDS)
    head, *rows = grids[0]
    row = dict(zip(head, next(r for r in rows if r), strict=False))
    assert (row["run"], row["proxy miss_expired"], row["P: KV expired"], row["D: KV expired"]) == ("quiet", "0", "0", "0")
    _shot(page, "memory-no-failed-pulls")
    assert not errors, errors
    page.close()


def test_compare_in_browser(dashboard_url, browser):
    page, errors = _open(browser, f"{dashboard_url}/compare", "Compare", 2)
    assert page.locator('[data-testid="stMetricValue"]').count() == 3
    assert "Bottom line:" in page.inner_text("body")
    _shot(page, "compare")
    assert not errors, errors
    page.close()


def test_sql_in_browser(dashboard_url, browser):
    page, errors = _open(browser, f"{dashboard_url}/sql", "SQL", 0)
    page.get_by_role("button", name="Run").click(timeout=60_000)
    page.locator('[data-testid="stDataFrame"]').wait_for(timeout=60_000)
    _wait_idle(page)
    _shot(page, "sql")
    # A write is refused with a message, not run.
    box = page.get_by_label("Query")
    box.fill("COPY (SELECT 1) TO '/tmp/turnscope-should-not-exist.csv'")
    box.press("Control+Enter")
    page.get_by_role("button", name="Run").click(timeout=60_000)
    page.get_by_text("this console is read-only").wait_for(timeout=60_000)
    assert not Path("/tmp/turnscope-should-not-exist.csv").exists()
    _shot(page, "sql-refused")
    assert not errors, errors
    page.close()


def test_sweep_in_browser(sweep_url, browser):
    page, errors = _open(browser, f"{sweep_url}/sweep", "Sweep", 2)
    body = page.inner_text("body")
    assert "pd-bidir-nocache vs pd-nocache:" in body and "the speed-up grows with prefix length" in body
    _shot(page, "sweep")
    assert not errors, errors
    page.close()


def test_traffic_in_browser(traffic_url, browser):
    """The Traffic page of the shipped traces: its numbers (740 requests, 35 sessions) and five charts,
    the timeline of the session with the most requests (trace_0279, with its 2 sub-agents)."""
    page, errors = _open(browser, f"{traffic_url}/traffic", "Traffic", 5)
    values = page.locator('[data-testid="stMetricValue"]').all_inner_texts()
    assert values[:2] == ["35", "740"]
    body = page.inner_text("body")
    assert "trace_0279" in body
    _shot(page, "traffic")
    assert not errors, errors
    page.close()


def test_plan_in_browser(plan_url, browser):
    """The Plan page: the check against the recorded runs (newest plan), then the 24 traces' forecast
    with its frontier; every figure labelled a FORECAST with its profile."""
    page, errors = _open(browser, f"{plan_url}/plan", "Plan", 2)
    body = page.inner_text("body")
    assert "FORECAST (profile fitted)" in body and "Checked against the recorded runs" in body
    assert "outcome differs from the recorded one" in body  # the table of differences (a canvas grid)
    _shot(page, "plan-check")
    page.locator('[data-testid="stSelectbox"]').first.click(timeout=60_000)
    page.get_by_role("option", name="kv-cache-tester", exact=False).click(timeout=60_000)
    page.get_by_text("FORECAST (profile vendor-h200): TTL x D memory frontier").first.wait_for(timeout=60_000)
    _wait_charts(page, 1)
    body = page.inner_text("body")
    assert "pd-bidir-nocache vs pd-nocache" in body and "Checked against" not in body
    _shot(page, "plan-forecast")
    assert not errors, errors
    page.close()


def test_memory_capacity_in_browser(capacity_url, browser):
    page, errors = _open(browser, f"{capacity_url}/memory", "Memory", 3)
    page.get_by_role("heading", name="Capacity: when holding KV costs sessions").wait_for(timeout=60_000)
    body = page.inner_text("body")
    # the crossing of tests/capacity_store.py, worked out by hand there (test_capacity_store.py): 4
    # sessions by goodput; the TTFT p90 2.25x there but within the p90s' sampling noise (10 turns)
    assert f"Holding KV starts to cost capacity at {capacity_store.EXPECTED_CROSSING_USERS} concurrent sessions" in body
    assert "(at 4: goodput 0.60 vs 1.00 turns/s; steps measured: 1, 2, 4)" in body
    assert "At 4 concurrent session(s) pd-bidir's TTFT p90 was higher by more than 5%, but within" in body
    assert "TTFT ≤ 500 ms and TPOT ≤ 50 ms" in body
    # the store's runs record no schedule: read as sequential (analysis.schedule_text)
    assert "How the steps were played: One mode after another (sequential schedule)." in body
    assert "None" not in page.locator('[data-testid="stMarkdown"]').all_inner_texts()
    _shot(page, "memory-capacity")
    assert not errors, errors
    page.close()


#: Reads the eviction window's figure back from the DOM: its traces' names and points as plotly.js drew them.
READ_WINDOW = r"""
() => {
  for (const el of document.querySelectorAll('.js-plotly-plot')) {
    const fd = el._fullData;
    if (!fd || !fd.some((t) => t.name === 'speed-up')) continue;
    return fd.map((t) => ({name: t.name, x: Array.from(t.x), y: Array.from(t.y),
                           plus: t.error_y && t.error_y.array ? Array.from(t.error_y.array) : null,
                           minus: t.error_y && t.error_y.arrayminus ? Array.from(t.error_y.arrayminus) : null}));
  }
  return null;
}
"""


def test_memory_eviction_window_in_browser(eviction_url, browser):
    # the capacity curve and the window's figure
    page, errors = _open(browser, f"{eviction_url}/memory", "Memory", 4)
    page.get_by_role("heading", name="P's own prefix cache under eviction: the window").wait_for(timeout=60_000)
    body = page.inner_text("body")
    # the window of tests/eviction_store.py, worked out by hand there: pays from 2 sessions (pd's P
    # hit rate 80%), D runs out at 6 (the capacity crossing), so the window is 2 and 4
    assert "Holding the turn on D pays from 2 concurrent sessions (pd's P hit rate 80% there) up to 4" in body
    assert "runs out at 6 concurrent sessions" in body and "the window is 2, 4 concurrent session(s)" in body
    assert "pd-bidir's D is full (>= 95% of its KV in use) from 4 concurrent sessions on" in body
    drawn = {t["name"]: t for t in page.evaluate(READ_WINDOW)}
    users = list(eviction_store.USERS)
    # every step's P hit rate and speed-up as the store's hand truths give them, as plotly.js drew them
    for name, mode in (("pd P hit rate", "pd"), ("pd-bidir P hit rate", "pd-bidir")):
        assert drawn[name]["x"] == users
        assert drawn[name]["y"] == pytest.approx([eviction_store.EXPECTED_HIT_RATE[(mode, u)] * 100 for u in users])
    sp = drawn["speed-up"]
    assert sp["x"] == users and sp["y"] == pytest.approx([eviction_store.EXPECTED_SPEEDUP[u] for u in users])
    # the interval at 2 sessions lies within 0.20 / 0.12 - 0.20 / 0.10 (every resample's medians)
    i = users.index(2)
    assert 0.20 / 0.12 - 1e-6 <= sp["y"][i] - sp["minus"][i] and sp["y"][i] + sp["plus"][i] <= 0.20 / 0.10 + 1e-6
    _shot(page, "memory-eviction-window")
    assert not errors, errors
    page.close()
