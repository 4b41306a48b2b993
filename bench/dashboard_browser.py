"""The dashboard's pages timed in a real browser: the server `turnscope dashboard` starts, driven by Chromium.

bench/dashboard_scale.py times each page's script with Streamlit's AppTest, which neither serves
the page nor paints it; this bench times what a person waits for. For each page it starts a fresh
server over the store as `turnscope dashboard` does (``dashboard/serve.py``: `streamlit run
dashboard/app.py` with the pages' libraries imported first; ``--launcher streamlit`` for a plain
`streamlit run`, what a first visit cost before that launcher), opens the page's
URL in headless Chromium (Playwright, Debian's /usr/bin/chromium, as tests/e2e do) and times from
navigation start to Streamlit idle:

- the page's title (``h1``) is drawn,
- no ``[data-testid="stStatusWidget"]`` (Streamlit's "running" indicator) is shown,
- no ``[data-testid="stSkeleton"]`` (the placeholder of an element whose code is still loading, e.g.
  a chart while plotly.js loads: without this a fast rerun looked idle before its charts came),
- every ``[data-testid="stPlotlyChart"]`` holds a drawn Plotly figure (``.main-svg``),

and this state has held for `QUIET_S` without a change (the time reported is when it began, read
from the page's own ``performance.now()``, whose origin is the navigation start).

Cold = the first visit after the server starts (a fresh browser context too: nothing cached
anywhere); warm = a second visit, in a new tab of the same context, right after. Each page is
measured `--repeats` times (default 3), each time on a fresh server, and the median is reported:
the machine may be shared, so one run is noise.

Stores: ``--demo`` (default) builds tests/dashboard_store.py's small known store (4 runs, 48 turns);
``--turns N`` builds bench/dashboard_scale.py's synthetic store of N turns (10 runs) and rolls it
up as `turnscope rollup` does; ``--store PATH`` reads an existing store (e.g. one `make demo` wrote).
Targets: every page <= 2 s cold on the demo store, <= 3 s at 1,000,000 turns.

    .venv/bin/python bench/dashboard_browser.py --demo
    .venv/bin/python bench/dashboard_browser.py --turns 1000000 --store /tmp/ts-1m --keep
    .venv/bin/python bench/dashboard_browser.py --store data --pages overview,turns
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dashboard.pages import PAGES as REGISTRY

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip
#: page slug -> (URL path, "" for the default page; the title its script draws), of dashboard/pages.py.
PAGES = {p.slug: (p.url_path, p.title) for p in REGISTRY}
QUIET_S = 1.0
TIMEOUT_S = 180.0

#: Installed before any page script: every 25 ms, note whether the page is idle and since when.
IDLE_PROBE = """
(() => {
  window.__tsIdleSince = null;
  window.__tsTitle = %s;
  const idle = () => {
    const h1 = [...document.querySelectorAll('h1')].some(h => h.innerText.trim() === window.__tsTitle);
    if (!h1 || document.querySelector('[data-testid="stStatusWidget"], [data-testid="stSkeleton"]')) return false;
    const charts = [...document.querySelectorAll('[data-testid="stPlotlyChart"]')];
    return charts.every(c => c.querySelector('.main-svg'));
  };
  let shape = '';
  setInterval(() => {
    // a change in what is drawn (element count) restarts the idle stretch
    const now = String(document.querySelectorAll('[data-testid]').length);
    if (!idle()) { window.__tsIdleSince = null; }
    else if (window.__tsIdleSince === null || now !== shape) { window.__tsIdleSince = performance.now(); }
    shape = now;
  }, 25);
})();
"""


@dataclass
class PageTimes:
    """Seconds from navigation to idle, one per repeat; and the CPU seconds the visit cost the
    server and the browser (`visit`), which other work on the machine does not inflate the way it
    inflates wall time."""

    page: str
    cold: list[float] = field(default_factory=list)
    warm: list[float] = field(default_factory=list)
    cold_cpu: list[tuple[float, float]] = field(default_factory=list)
    warm_cpu: list[tuple[float, float]] = field(default_factory=list)

    def add(self, which: str, visit: tuple[float, float, float]) -> None:
        getattr(self, which).append(visit[0])
        getattr(self, f"{which}_cpu").append(visit[1:])


def _cpu_by_pid(pids: list[int]) -> dict[int, float]:
    """User + system CPU seconds of each process of `pids` still alive."""
    import psutil

    out = {}
    for pid in pids:
        try:
            c = psutil.Process(pid).cpu_times()
            out[pid] = c.user + c.system
        except psutil.Error:
            pass
    return out


def _browser_pids(server_pid: int) -> list[int]:
    """This process's Chromium processes (under Playwright's driver), the server excluded."""
    import psutil

    return [c.pid for c in psutil.Process().children(recursive=True)
            if c.pid != server_pid and "chrom" in (c.name() or "").lower()]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def streamlit_server(root: Path, log: Path, launcher: str = "turnscope"):
    """The dashboard over the store at `root`, started as `turnscope dashboard` starts it
    (`launcher` "turnscope": dashboard/serve.py) or by a plain `streamlit run dashboard/app.py`
    ("streamlit"); yields (its URL, the server's pid) once /_stcore/health answers. Raises RuntimeError if it exits,
    TimeoutError if it is not healthy within TIMEOUT_S."""
    port = _free_port()
    out = log.open("a")
    start = {"turnscope": [str(REPO / "dashboard" / "serve.py")],
             "streamlit": ["-m", "streamlit", "run", str(REPO / "dashboard" / "app.py")]}[launcher]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, *start, "--server.headless", "true",
         "--server.address", "127.0.0.1", "--server.port", str(port), "--browser.gatherUsageStats", "false"],
        cwd=REPO, env={**os.environ, "TURNSCOPE_STORE": str(root)}, stdout=out, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"streamlit exited with {proc.returncode} (log: {log})")
            try:
                with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"streamlit at {url} not healthy within {TIMEOUT_S} s")
            time.sleep(0.2)
        yield url, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        out.close()


def visit(context, url: str, title: str, server_pid: int) -> tuple[float, float, float]:
    """Open `url` in a new tab of `context`; (seconds from navigation start until the page is idle
    (see IDLE_PROBE), CPU seconds of the server process, CPU seconds of Chromium's processes) over
    the visit. Raises RuntimeError if the page shows a Python exception."""
    import json

    page = context.new_page()
    server0, browser0 = _cpu_by_pid([server_pid]), _cpu_by_pid(_browser_pids(server_pid))
    try:
        page.add_init_script(IDLE_PROBE % json.dumps(title))
        page.goto(url, wait_until="commit")
        # The start of the quiet stretch is read in the same evaluation that sees it long enough: a
        # rerun right after would set it back to null.
        since = page.wait_for_function(
            "(() => { const s = window.__tsIdleSince;"
            f" return s !== null && performance.now() - s > {QUIET_S * 1e3} ? String(s) : ''; }})()",
            timeout=TIMEOUT_S * 1e3, polling=50,
        ).json_value()  # fmt: skip
        if page.locator('[data-testid="stException"]').count():
            raise RuntimeError(f"{url}: {page.locator('[data-testid=stException]').first.inner_text()[:500]}")
        idle_s = float(since) / 1e3
        server1, browser1 = _cpu_by_pid([server_pid]), _cpu_by_pid(_browser_pids(server_pid))
        server_cpu = sum(v - server0.get(k, 0.0) for k, v in server1.items())
        browser_cpu = sum(v - browser0.get(k, 0.0) for k, v in browser1.items())
        return idle_s, server_cpu, browser_cpu
    finally:
        page.close()


def measure(
    root: Path, pages: list[str], repeats: int, log: Path, launcher: str = "turnscope"
) -> list[PageTimes]:
    """Each page cold then warm on a fresh server, `repeats` times."""
    from playwright.sync_api import sync_playwright

    results = [PageTimes(p) for p in pages]
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            for rep in range(repeats):
                for r in results:
                    path, title = PAGES[r.page]
                    with streamlit_server(root, log, launcher) as (url, pid):
                        context = browser.new_context(viewport={"width": 1440, "height": 1200})
                        try:
                            r.add("cold", visit(context, f"{url}/{path}", title, pid))
                            r.add("warm", visit(context, f"{url}/{path}", title, pid))
                        finally:
                            context.close()
                    print(f"  repeat {rep + 1}/{repeats} {r.page:<9} cold {r.cold[-1]:5.2f} s  warm {r.warm[-1]:5.2f} s"
                          f"  CPU server+browser cold {sum(r.cold_cpu[-1]):5.2f} s warm {sum(r.warm_cpu[-1]):5.2f} s",
                          flush=True)  # fmt: skip
        finally:
            browser.close()
    return results


def report(results: list[PageTimes], what: str, target_s: float) -> bool:
    """Print the table (medians, and the range over repeats); True when every page meets `target_s` cold."""
    ok = True
    n = len(results[0].cold) if results else 0
    print(f"\n{what}: seconds from navigation to Streamlit idle in Chromium, median of {n} (min-max); "
          f"target cold <= {target_s:g} s")  # fmt: skip
    print("| page | cold (s) | warm (s) | CPU cold: server + browser (s) | CPU warm: server + browser (s) |\n"
          "|---|---|---|---|---|")  # fmt: skip
    for r in results:
        cold, warm = statistics.median(r.cold), statistics.median(r.warm)
        miss = cold > target_s
        ok &= not miss
        cpu = {
            w: [statistics.median(c[i] for c in getattr(r, f"{w}_cpu")) for i in (0, 1)]
            for w in ("cold", "warm")
        }
        print(f"| {r.page} | {cold:.2f} ({min(r.cold):.2f}-{max(r.cold):.2f}){' **over**' if miss else ''} "
              f"| {warm:.2f} ({min(r.warm):.2f}-{max(r.warm):.2f}) "
              f"| {cpu['cold'][0]:.2f} + {cpu['cold'][1]:.2f} | {cpu['warm'][0]:.2f} + {cpu['warm'][1]:.2f} |")  # fmt: skip
    return ok


def build_store(root: Path, turns: int | None) -> str:
    """Build the store at `root`: tests/dashboard_store.py's when `turns` is None, else
    bench/dashboard_scale.py's synthetic one of `turns` turns, rolled up. Returns its description."""
    if turns is None:
        from tests import dashboard_store

        dashboard_store.build(root)
        return "demo-like store (tests/dashboard_store.py: 4 runs, 48 turns)"
    sys.path.insert(0, str(REPO / "bench"))
    import dashboard_scale

    from planner.recorded_whatif import whatif_ttl_d_limit
    from store.rollup import Rollups

    t0 = time.perf_counter()
    store = dashboard_scale.build(root, turns)
    Rollups(store, whatif=whatif_ttl_d_limit).write_finished()
    print(f"built and rolled up {turns:,} turns in {root} in {time.perf_counter() - t0:.0f} s", flush=True)
    return f"synthetic store of {turns:,} turns (bench/dashboard_scale.py, 10 runs, rolled up)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--demo", action="store_true", help="build tests/dashboard_store.py's store (the default)"
    )
    ap.add_argument(
        "--turns", type=int, help="build bench/dashboard_scale.py's synthetic store of this many turns"
    )
    ap.add_argument(
        "--store", type=Path, help="the store directory: read as is if it holds a store, else built there"
    )
    ap.add_argument("--keep", action="store_true", help="keep a store built in a temp dir")
    ap.add_argument("--repeats", type=int, default=3, help="measurements per page, cold and warm (default 3)")
    ap.add_argument("--pages", default=",".join(PAGES), help=f"comma-separated, of {','.join(PAGES)}")
    ap.add_argument(
        "--launcher",
        choices=("turnscope", "streamlit"),
        default="turnscope",
        help="start the server as `turnscope dashboard` does (default) or by a plain `streamlit run`",
    )
    ap.add_argument("--target", type=float, help="cold target in s (default 2 on the demo store, else 3)")
    args = ap.parse_args()
    pages = [p.strip() for p in args.pages.split(",") if p.strip()]
    if bad := [p for p in pages if p not in PAGES]:
        ap.error(f"--pages: unknown {bad}; expected some of {list(PAGES)}")
    if not CHROMIUM.exists():
        ap.error(f"{CHROMIUM} is missing: apt-get install chromium (scripts/install.sh does)")
    root = args.store or Path(tempfile.mkdtemp(prefix="turnscope-browser-bench-"))
    try:
        if (root / "turnscope.duckdb").exists():
            what = f"store {root}"
        else:
            what = build_store(root, args.turns)
        target = args.target or (3.0 if args.turns else 2.0)
        print(
            f"{what}; launcher {args.launcher}; {os.cpu_count()} CPUs, load average before {os.getloadavg()[0]:.2f}",
            flush=True,
        )
        results = measure(
            root,
            pages,
            max(1, args.repeats),
            Path(tempfile.gettempdir()) / "turnscope-browser-bench.log",
            args.launcher,
        )
        print(
            f"load average after {os.getloadavg()[0]:.2f} (other work on this machine adds to every number)"
        )
        return 0 if report(results, what, target) else 1
    finally:
        if args.store is None and not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
