"""Where a dashboard page's browser seconds go: Chromium's own profiler, per page and per element kind.

bench/dashboard_browser.py says how long a page takes to open and how much CPU the visit costs; this
says what that CPU is spent on. For each page it starts a fresh server (as the browser bench does),
opens the page in headless Chromium with CDP's sampling JavaScript profiler (``Profiler``, 200 us
samples) and ``Performance`` metrics running, waits for the same idle state as the browser bench,
and reports, in seconds of the renderer's main thread:

- ``script``, ``layout``, ``style`` and ``task`` (all work) from ``Performance.getMetrics``
  (``ScriptDuration``, ``LayoutDuration``, ``RecalcStyleDuration``, ``TaskDuration``);
- the profiler's busy samples split by the code that ran them (the innermost frame's script):
  ``plotly`` (Streamlit's PlotlyChart chunk: plotly.js parsing, drawing, its forced layouts),
  ``dataframe`` (the DataFrame chunk: glide-data-grid), ``streamlit`` (the app's own chunks: React,
  protobuf, markdown, metrics), ``native`` (the browser's work outside any script: compile, GC,
  layout and paint between tasks);
- CPU seconds of each Chromium process kind over the visit (renderer, GPU/compositor, browser,
  utility), from ``psutil``;
- the page's elements: Plotly charts, data frames, metrics, markdown blocks.

    .venv/bin/python bench/dashboard_trace.py                       # the demo store, every page
    .venv/bin/python bench/dashboard_trace.py --store data --pages overview,turns --warm
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dashboard_browser as bb

#: Script (chunk) name prefix -> what runs it, for the profiler's split; anything else is "streamlit".
CHUNK_KINDS = {"PlotlyChart": "plotly", "DataFrame": "dataframe"}
#: Profiler node function names that are no script's: the browser's own work on the main thread.
NATIVE = {"(program)", "(garbage collector)"}
IDLE = "(idle)"
SAMPLING_US = 200
#: Elements counted on the page, by Streamlit's test ids.
ELEMENTS = {"charts": "stPlotlyChart", "dataframes": "stDataFrame", "metrics": "stMetric",
            "markdown": "stMarkdown"}  # fmt: skip


@dataclass
class Split:
    """One visit: seconds of the renderer's main thread by activity and by code, CPU seconds per
    Chromium process kind, and element counts."""

    page: str
    wall_s: float = 0.0
    metrics_s: dict[str, float] = field(default_factory=dict)
    by_code_s: dict[str, float] = field(default_factory=dict)
    cpu_s: dict[str, float] = field(default_factory=dict)
    elements: dict[str, int] = field(default_factory=dict)


def code_kind(url: str, function: str) -> str | None:
    """The code a profiler frame belongs to (`CHUNK_KINDS`, "streamlit", "native"), None for idle."""
    if function == IDLE:
        return None
    if function in NATIVE or not url:
        return "native"
    name = url.rsplit("/", 1)[-1]
    return next((kind for prefix, kind in CHUNK_KINDS.items() if name.startswith(prefix)), "streamlit")


def profile_split(profile: dict) -> dict[str, float]:
    """Seconds of samples per code kind (`code_kind` of each sample's innermost frame) of a CDP
    ``Profiler.Profile``; idle samples left out."""
    nodes = {n["id"]: n["callFrame"] for n in profile["nodes"]}
    out: collections.Counter[str] = collections.Counter()
    for node_id, delta_us in zip(profile["samples"], profile["timeDeltas"], strict=True):
        frame = nodes[node_id]
        kind = code_kind(frame.get("url", ""), frame.get("functionName", ""))
        if kind:
            out[kind] += delta_us / 1e6
    return dict(out)


def _process_kind(pid: int) -> str:
    """A Chromium process's kind from its ``--type=`` flag ("browser" without one)."""
    import psutil

    try:
        cmd = psutil.Process(pid).cmdline()
    except psutil.Error:
        return "gone"
    kind = next((a.split("=", 1)[1] for a in cmd if a.startswith("--type=")), "browser")
    if kind == "utility":
        sub = next((a.split("=", 1)[1] for a in cmd if a.startswith("--utility-sub-type=")), "")
        return "network" if "network" in sub else "utility"
    return kind


def _cpu_by_kind(server_pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far per Chromium process kind, and the server's."""
    out: collections.Counter[str] = collections.Counter()
    for pid, cpu in bb._cpu_by_pid(bb._browser_pids(server_pid)).items():
        out[_process_kind(pid)] += cpu
    out["server"] = sum(bb._cpu_by_pid([server_pid]).values())
    return dict(out)


COUNT_ELEMENTS = "(ids) => Object.fromEntries(Object.entries(ids).map(([k, v]) => " \
                 "[k, document.querySelectorAll(`[data-testid=\"${v}\"]`).length]))"  # fmt: skip


def traced_visit(context, url: str, title: str, server_pid: int, page_name: str) -> Split:
    """One visit of `url` in a new tab of `context` under the profiler; its `Split`."""
    page = context.new_page()
    cdp = context.new_cdp_session(page)
    split = Split(page_name)
    try:
        cdp.send("Performance.enable", {"timeDomain": "threadTicks"})
        cdp.send("Profiler.enable")
        cdp.send("Profiler.setSamplingInterval", {"interval": SAMPLING_US})
        cdp.send("Profiler.start")
        before = _cpu_by_kind(server_pid)
        page.add_init_script(bb.IDLE_PROBE % json.dumps(title))
        page.goto(url, wait_until="commit")
        since = page.wait_for_function(
            "(() => { const s = window.__tsIdleSince;"
            f" return s !== null && performance.now() - s > {bb.QUIET_S * 1e3} ? String(s) : ''; }})()",
            timeout=bb.TIMEOUT_S * 1e3, polling=50,
        ).json_value()  # fmt: skip
        split.wall_s = float(since) / 1e3
        after = _cpu_by_kind(server_pid)
        split.cpu_s = {k: round(v - before.get(k, 0.0), 3) for k, v in after.items()}
        profile = cdp.send("Profiler.stop")["profile"]
        split.by_code_s = profile_split(profile)
        metrics = {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}
        split.metrics_s = {k: metrics.get(v, 0.0) for k, v in
                           (("task", "TaskDuration"), ("script", "ScriptDuration"),
                            ("layout", "LayoutDuration"), ("style", "RecalcStyleDuration"))}  # fmt: skip
        split.elements = page.evaluate(COUNT_ELEMENTS, ELEMENTS)
        return split
    finally:
        page.close()


def measure(root: Path, pages: list[str], warm: bool, log: Path) -> list[Split]:
    """Each page on a fresh server in a fresh context: the cold visit's split (with `warm`, the
    second visit's)."""
    from playwright.sync_api import sync_playwright

    out = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(bb.CHROMIUM), args=bb.CHROMIUM_ARGS)
        try:
            for name in pages:
                path, title = bb.PAGES[name]
                with bb.streamlit_server(root, log) as (url, pid):
                    context = browser.new_context(viewport={"width": 1440, "height": 1200})
                    try:
                        split = traced_visit(context, f"{url}/{path}", title, pid, name)
                        if warm:
                            split = traced_visit(context, f"{url}/{path}", title, pid, name)
                    finally:
                        context.close()
                out.append(split)
                print(json.dumps(split.__dict__), flush=True)
        finally:
            browser.close()
    return out


def report(splits: list[Split], what: str) -> None:
    """Print the split as a markdown table, seconds."""
    codes = ("plotly", "dataframe", "streamlit", "native")
    procs = ("renderer", "gpu-process", "browser", "network", "utility", "server")
    print(f"\n{what}: seconds of Chromium's renderer main thread (Performance.getMetrics; the profiler's split "
          "by code) and CPU seconds per process over one visit")  # fmt: skip
    print("| page | wall | elements (charts/frames/metrics/markdown) | main thread: task (script, layout, style) "
          "| by code: " + " / ".join(codes) + " | CPU: " + " / ".join(procs) + " |\n|---|---|---|---|---|---|")
    for s in splits:
        m, e = s.metrics_s, s.elements
        print(f"| {s.page} | {s.wall_s:.2f} | {e['charts']}/{e['dataframes']}/{e['metrics']}/{e['markdown']} "
              f"| {m['task']:.2f} ({m['script']:.2f}, {m['layout']:.2f}, {m['style']:.2f}) "
              f"| {' / '.join(f'{s.by_code_s.get(c, 0.0):.2f}' for c in codes)} "
              f"| {' / '.join(f'{s.cpu_s.get(p, 0.0):.2f}' for p in procs)} |")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", type=Path, help="an existing store (default: build tests/dashboard_store.py's)")
    ap.add_argument("--pages", default=",".join(bb.PAGES), help=f"comma-separated, of {','.join(bb.PAGES)}")
    ap.add_argument("--warm", action="store_true", help="report the second visit (default: the first, cold)")
    args = ap.parse_args()
    pages = [p.strip() for p in args.pages.split(",") if p.strip()]
    if bad := [p for p in pages if p not in bb.PAGES]:
        ap.error(f"--pages: unknown {bad}")
    root = args.store or Path(tempfile.mkdtemp(prefix="turnscope-trace-"))
    what = f"store {root}" if (root / "turnscope.duckdb").exists() else bb.build_store(root, None)
    print(f"{what}; load average before {os.getloadavg()[0]:.2f}", flush=True)
    splits = measure(root, pages, args.warm, Path(tempfile.gettempdir()) / "turnscope-trace.log")
    print(f"load average after {os.getloadavg()[0]:.2f}")
    report(splits, f"{what}, {'warm' if args.warm else 'cold'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
