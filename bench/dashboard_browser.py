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

Two tables (``--tables``, both by default):

- the journey a person takes (`journey`): a fresh server, the Overview in a new tab (time to its
  first headline number, ``[data-testid="stMetricValue"]``, and to every chart drawn), then every
  other page of ``--pages`` from the sidebar in the same tab (time from the click to the page drawn;
  the document and plotly.js stay loaded), then back to the Overview, with each step's CPU seconds
  of the server and of the browser. ``--before CHECKOUT`` times an older checkout's dashboard too
  (its charts on), the two interleaved repeat by repeat. Targets (`JOURNEY_TARGETS`, the demo store,
  idle): first number <= 1.5 s, every Overview chart <= 3.0 s, a move to a charted page <= 1.0 s
  median and <= 1.5 s worst, browser CPU per move <= 1.0 s; at 1,000,000 turns twice the times;
- each page cold (`pages`): the first visit after the server starts (a fresh browser context too:
  nothing cached anywhere); warm = a second visit, in a new tab of the same context, right after.

Each is measured `--repeats` times (default 3), each time on a fresh server, and the median is
reported: the machine may be shared, so one run is noise.

Stores: ``--demo`` (default) builds tests/dashboard_store.py's small known store (4 runs, 48 turns);
``--turns N`` builds bench/dashboard_scale.py's synthetic store of N turns (10 runs) and compacts
and rolls it up as `turnscope rollup` does; ``--store PATH`` reads an existing store (e.g. one `make demo` wrote).

    .venv/bin/python bench/dashboard_browser.py --store data --tables journey --before ../old-checkout
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
  window.__tsFirstNumber = null;
  window.__tsTitle = %s;
  const idle = () => {
    const h1 = [...document.querySelectorAll('h1')].some(h => h.innerText.trim() === window.__tsTitle);
    if (!h1 || document.querySelector('[data-testid="stStatusWidget"], [data-testid="stSkeleton"]')) return false;
    const charts = [...document.querySelectorAll('[data-testid="stPlotlyChart"]')];
    return charts.every(c => c.querySelector('.main-svg'));
  };
  let shape = '';
  setInterval(() => {
    // the first headline number of this page (its title drawn: not a number the last page left)
    if (window.__tsFirstNumber === null && document.querySelector('[data-testid="stMetricValue"]')
        && [...document.querySelectorAll('h1')].some(h => h.innerText.trim() === window.__tsTitle))
      window.__tsFirstNumber = performance.now();
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
def streamlit_server(root: Path, log: Path, launcher: str = "turnscope", code: Path = REPO,
                     env: dict[str, str] | None = None):
    """The dashboard of the checkout `code` (this one by default) over the store at `root`, started
    as `turnscope dashboard` starts it (`launcher` "turnscope": dashboard/serve.py) or by a plain
    `streamlit run dashboard/app.py` ("streamlit"), with `env` added to the environment; yields (its
    URL, the server's pid) once /_stcore/health answers. Raises RuntimeError if it exits,
    TimeoutError if it is not healthy within TIMEOUT_S."""
    port = _free_port()
    out = log.open("a")
    start = {"turnscope": [str(code / "dashboard" / "serve.py")],
             "streamlit": ["-m", "streamlit", "run", str(code / "dashboard" / "app.py")]}[launcher]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, *start, "--server.headless", "true",
         "--server.address", "127.0.0.1", "--server.port", str(port), "--browser.gatherUsageStats", "false"],
        cwd=code, env={**os.environ, "TURNSCOPE_STORE": str(root), **(env or {})}, stdout=out,
        stderr=subprocess.STDOUT,
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

#: The sidebar's link to a page, by its menu title.
NAV_LINK = '[data-testid="stSidebarNav"] a'


@dataclass
class Step:
    """One step of the journey: the page reached, seconds from its start (navigation start for the
    first, the click on the sidebar's link for the others) to the first headline number (None: the
    page draws none) and to the page idle with every chart drawn (IDLE_PROBE), the charts drawn,
    and the CPU seconds the step cost the server and the browser."""

    page: str
    first_number_s: float | None
    drawn_s: float
    charts: int
    server_cpu: float
    browser_cpu: float


def _until_idle(page, server_pid: int, cpu0: tuple[dict, dict]) -> tuple[float, float, float]:
    """Wait for IDLE_PROBE's quiet; (performance.now() when the quiet began, in s; server and browser
    CPU seconds since `cpu0`). Raises RuntimeError if the page shows a Python exception."""
    since = page.wait_for_function(
        "(() => { const s = window.__tsIdleSince;"
        f" return s !== null && performance.now() - s > {QUIET_S * 1e3} ? String(s) : ''; }})()",
        timeout=TIMEOUT_S * 1e3, polling=50,
    ).json_value()  # fmt: skip
    if page.locator('[data-testid="stException"]').count():
        raise RuntimeError(f"{page.url}: {page.locator('[data-testid=stException]').first.inner_text()[:500]}")
    server1, browser1 = _cpu_by_pid([server_pid]), _cpu_by_pid(_browser_pids(server_pid))
    return (float(since) / 1e3,
            sum(v - cpu0[0].get(k, 0.0) for k, v in server1.items()),
            sum(v - cpu0[1].get(k, 0.0) for k, v in browser1.items()))  # fmt: skip


def _charts(page) -> int:
    """The Plotly figures drawn on the page (one ``.js-plotly-plot`` each, of several ``.main-svg``)."""
    return page.evaluate("document.querySelectorAll('[data-testid=\"stPlotlyChart\"] .js-plotly-plot').length")


def journey(context, url: str, server_pid: int, slugs: list[str]) -> list[Step]:
    """The path a person takes: the Overview in a new tab (time to its first headline number and
    to every chart drawn), then each page of `slugs` from the sidebar in the same tab (the document,
    plotly.js included, stays loaded), then back to the Overview. One `Step` per page reached."""
    import json

    page = context.new_page()
    steps: list[Step] = []
    try:
        _, title = PAGES["overview"]
        page.add_init_script(IDLE_PROBE % json.dumps(title))
        cpu0 = (_cpu_by_pid([server_pid]), _cpu_by_pid(_browser_pids(server_pid)))
        page.goto(url, wait_until="commit")
        drawn, server_cpu, browser_cpu = _until_idle(page, server_pid, cpu0)
        first = page.evaluate("window.__tsFirstNumber")
        steps.append(Step("overview", None if first is None else first / 1e3, drawn, _charts(page), server_cpu,
                          browser_cpu))  # fmt: skip
        for slug in [*slugs, "overview"]:
            _, title = PAGES[slug]
            link = page.locator(NAV_LINK, has_text=title).filter(
                has=page.get_by_text(title, exact=True)).first  # fmt: skip
            cpu0 = (_cpu_by_pid([server_pid]), _cpu_by_pid(_browser_pids(server_pid)))
            clicked = page.evaluate(
                "(t) => { window.__tsTitle = t; window.__tsIdleSince = null; window.__tsFirstNumber = null;"
                " return performance.now(); }", title)  # fmt: skip
            link.click(timeout=TIMEOUT_S * 1e3)
            drawn, server_cpu, browser_cpu = _until_idle(page, server_pid, cpu0)
            first = page.evaluate("window.__tsFirstNumber")
            steps.append(Step(slug, None if first is None else (first - clicked) / 1e3, (drawn * 1e3 - clicked) / 1e3,
                              _charts(page), server_cpu, browser_cpu))  # fmt: skip
    finally:
        page.close()
    return steps


def measure_journey(slugs: list[str], repeats: int, log: Path, codes: list[tuple[str, Path, dict, Path]],
                    launcher: str = "turnscope") -> dict[str, list[list[Step]]]:
    """`repeats` journeys per code (name, checkout, extra environment, store), each on a fresh server
    and a fresh browser context, the codes interleaved (A B A B): name -> one list of steps per repeat."""
    from playwright.sync_api import sync_playwright

    out: dict[str, list[list[Step]]] = {name: [] for name, *_ in codes}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            for rep in range(repeats):
                for name, code, env, root in codes:
                    with streamlit_server(root, log, launcher, code, env) as (url, pid):
                        context = browser.new_context(viewport={"width": 1440, "height": 1200})
                        try:
                            steps = journey(context, url, pid, slugs)
                        finally:
                            context.close()
                    out[name].append(steps)
                    print(f"  journey {rep + 1}/{repeats} {name}: " + ", ".join(
                        f"{s.page} {s.drawn_s:.2f} s" for s in steps), flush=True)  # fmt: skip
        finally:
            browser.close()
    return out


def report_journey(runs: dict[str, list[list[Step]]], what: str, scale: float = 1.0) -> bool:
    """Print the journey's table (medians over repeats, per code side by side) and the targets'
    verdicts (JOURNEY_TARGETS times `scale`: 2 at 1,000,000 turns); True when the last code meets them."""
    names = list(runs)
    n = len(runs[names[0]])
    print(f"\n{what}: the journey, median of {n} (min-max); seconds from navigation (first row) or the "
          "sidebar click to the first headline number and to every chart drawn; CPU server + browser")
    head = " | ".join(f"{k} {m}" for m in names for k in ("first number", "charts drawn", "CPU"))
    print(f"| step | charts | {head} |\n|---|---:|" + "---:|" * (3 * len(names)))

    def med(xs: list[float]) -> str:
        xs = [x for x in xs if x is not None]
        return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})" if xs else ""

    first = runs[names[0]][0]
    for i, step in enumerate(first):
        label = ("Overview (new tab)" if i == 0 else f"-> {PAGES[step.page][1]}")
        cells = []
        for m in names:
            steps = [rep[i] for rep in runs[m]]
            cells += [med([s.first_number_s for s in steps]), med([s.drawn_s for s in steps]),
                      (f"{statistics.median(s.server_cpu for s in steps):.2f} + "
                      f"{statistics.median(s.browser_cpu for s in steps):.2f}")]  # fmt: skip
        print(f"| {label} | {step.charts} | " + " | ".join(cells) + " |")
    ok = True
    for m in names:
        reps = runs[m]
        ov = [rep[0] for rep in reps]
        moves = [s for rep in reps for s in rep[1:] if s.charts]
        per_page = [statistics.median(rep[i].drawn_s for rep in reps)
                    for i in range(1, len(reps[0])) if reps[0][i].charts]  # fmt: skip
        fn = statistics.median(s.first_number_s for s in ov if s.first_number_s is not None) if any(
            s.first_number_s is not None for s in ov) else float("nan")  # fmt: skip
        od = statistics.median(s.drawn_s for s in ov)
        mm = statistics.median(per_page) if per_page else float("nan")
        worst = max(per_page) if per_page else float("nan")
        cpu = statistics.median(s.browser_cpu for s in moves) if moves else float("nan")
        t = {k: v * scale if k != "move_browser_cpu" else v for k, v in JOURNEY_TARGETS.items()}
        verdicts = [("first headline number", fn, t["first_number"]),
                    ("every Overview chart", od, t["overview_drawn"]),
                    ("sidebar move, median of the charted pages", mm, t["move_median"]),
                    ("sidebar move, the worst charted page", worst, t["move_worst"]),
                    ("browser CPU per sidebar move, median", cpu, t["move_browser_cpu"])]  # fmt: skip
        print(f"{m}: " + "; ".join(f"{k} {v:.2f} s (target <= {t:g}: {'met' if v <= t else 'MISSED'})"
                                   for k, v, t in verdicts))  # fmt: skip
        if m == names[-1]:
            ok = all(v <= t for _, v, t in verdicts)
    return ok


#: The journey's targets on the demo store (seconds; at 1,000,000 turns, twice these).
JOURNEY_TARGETS = {"first_number": 1.5, "overview_drawn": 3.0, "move_median": 1.0, "move_worst": 1.5,
                   "move_browser_cpu": 1.0}


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
    from store.compact import compact_finished
    from store.rollup import Rollups

    t0 = time.perf_counter()
    store = dashboard_scale.build(root, turns)
    compact_finished(store)  # as `turnscope rollup` and the end of an eval do
    Rollups(store, whatif=whatif_ttl_d_limit).write_finished()
    print(f"built, compacted and rolled up {turns:,} turns in {root} in {time.perf_counter() - t0:.0f} s", flush=True)
    return f"synthetic store of {turns:,} turns (bench/dashboard_scale.py, 10 runs, compacted and rolled up)"


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
    ap.add_argument("--tables", default="journey,pages",
                    help="what to time, comma-separated: journey (the path a person takes, in one tab), pages "
                         "(each page cold on a fresh server, then warm); default both")  # fmt: skip
    ap.add_argument("--before", type=Path,
                    help="also time the journey of the checkout at this path (e.g. a `git worktree` of an older "
                         "commit), its charts on (TURNSCOPE_DASHBOARD_CHARTS=1), interleaved with this one")  # fmt: skip
    ap.add_argument("--before-store", type=Path,
                    help="time the 'before' journey over this store (e.g. --store's rows before `turnscope rollup` "
                         "compacted them; with --before, that checkout over it), interleaved with --store's")  # fmt: skip
    args = ap.parse_args()
    tables = {t.strip() for t in args.tables.split(",") if t.strip()}
    if bad := tables - {"journey", "pages"}:
        ap.error(f"--tables: unknown {sorted(bad)}; expected journey and/or pages")
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
        log = Path(tempfile.gettempdir()) / "turnscope-browser-bench.log"
        ok = True
        if "journey" in tables:
            codes = []
            if args.before or args.before_store:  # the older code, the store before compaction, or both
                codes.append(("before", (args.before or REPO).resolve(),
                              {"TURNSCOPE_DASHBOARD_CHARTS": "1"} if args.before else {},
                              (args.before_store or root).resolve()))  # fmt: skip
            codes.append(("after" if codes else "this", REPO, {}, root))
            runs = measure_journey([p for p in pages if p != "overview"], max(1, args.repeats), log, codes,
                                   args.launcher)  # fmt: skip
            print(f"load average after the journeys {os.getloadavg()[0]:.2f}", flush=True)
            ok &= report_journey(runs, what, 2.0 if args.turns and args.turns >= 1_000_000 else 1.0)
        if "pages" in tables:
            results = measure(root, pages, max(1, args.repeats), log, args.launcher)
            print(
                f"load average after {os.getloadavg()[0]:.2f} (other work on this machine adds to every number)"
            )
            ok &= report(results, what, target)
        return 0 if ok else 1
    finally:
        if args.store is None and not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
