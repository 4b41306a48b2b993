"""The dashboard at scale: a synthetic store of 1,000,000 turns, each page's query and render time.

Builds a store in the real layout (``store.writer.Store.init`` for the views, Parquet shards of
the contract's Arrow types under ``runs/<run_id>/<table>/``) holding 10 runs (5 serving modes x
2 history modes) of 100,000 turns each by default: about 10,000 sessions per run of 2 to 18
turns, four archetypes, every turn kind and gap kind (pauses past the 480 s TTL included), the
proxy's per-turn facts, and /metrics scrapes every second (P's and D's KV usage with an idle
per-pid copy, the proxy's handle bytes, P's NIXL histogram, plus 20 unrelated series per endpoint,
as vLLM exposes many more than the dashboard reads).

Then the finished runs are rolled up (``store.rollup``, as ``turnscope rollup`` and the end of
an eval do; ``--no-rollups`` reads the plain views only) and, with the dashboard's caches cleared, each page is rendered by Streamlit's AppTest (the
same script a browser gets; no browser paint) and every query the page runs is timed inside
``store.queries`` (wall clock, and the process's CPU time over DuckDB's threads). Each page is
rendered cold (empty cache, on an app whose frame has run once) `--repeats` times and the fastest is kept, per page and per query,
since a shared machine's other load only ever adds time; then once warm (cached). Prints one
line per page and its queries, and the load average before and after.
Targets: each query <= 300 ms, each page <= 2 s (cold).

    .venv/bin/python bench/dashboard_scale.py                 # 1,000,000 turns in a temp dir
    .venv/bin/python bench/dashboard_scale.py --turns 200000 --store /tmp/ts-bench --keep
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import os
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from core.modes import MODES
from dashboard import pages
from store.writer import Store

HISTORIES = ("text", "token_ids")
ARCHETYPES = ("coding", "research", "support", "analyst")
KINDS = np.array(["turn", "retry", "edit", "fresh", "resume"])
GAP_KINDS = np.array(["tool", "think", "pause"])
T0 = dt.datetime(2026, 11, 1, 8, 0, tzinfo=dt.UTC)
TURN_SHARDS_PER_RUN = 10
KV_BYTES_PER_TOKEN = 4096
TTL_S, MARGIN_S = 480.0, 30.0
QUERY_TARGET_S, PAGE_TARGET_S = 0.300, 2.0
#: The pages an evaluation's store fills (dashboard/pages.py).
PAGES = tuple(p.slug for p in pages.drawing("runs", "store"))


# --- the synthetic store ------------------------------------------------------------------------


def _table(store: Store, name: str, cols: dict) -> pa.Table:
    schema = store.schema.tables[name].arrow_schema()
    n = len(next(iter(cols.values())))
    arrays = []
    for field in schema:
        v = cols.get(field.name)
        arrays.append(pa.nulls(n, field.type) if v is None else pa.array(v, type=field.type, from_pandas=True))
    return pa.Table.from_arrays(arrays, schema=schema)


def _write(store: Store, run_id: str, name: str, table: pa.Table, shards: int = 1) -> None:
    d = store.root / "runs" / run_id / name
    d.mkdir(parents=True, exist_ok=True)
    step = max(1, -(-table.num_rows // shards))
    for i, off in enumerate(range(0, max(table.num_rows, 1), step)):
        pq.write_table(table.slice(off, step), d / f"bench-{i:04d}.parquet")


def _ts(base: dt.datetime, seconds: np.ndarray) -> pa.Array:
    us = (np.datetime64(base.replace(tzinfo=None), "us") + (seconds * 1e6).astype("timedelta64[us]"))
    return pa.array(us, type=pa.timestamp("us", tz="UTC"))


def build_run(store: Store, rng: np.random.Generator, run_id: str, mode: str, history: str, turns: int,
              start: dt.datetime) -> float:  # fmt: skip
    """Write one run of about `turns` turns; returns its duration in seconds."""
    # Sessions of 2..18 turns until the run has `turns` turns.
    lengths = rng.integers(2, 19, size=turns // 2)
    lengths = lengths[: np.searchsorted(np.cumsum(lengths), turns) + 1]
    lengths[-1] -= lengths.sum() - turns
    lengths = lengths[lengths > 0]
    n_sess = lengths.size
    sess = np.repeat(np.arange(n_sess), lengths)
    first = np.r_[0, np.cumsum(lengths)[:-1]]
    tidx = np.arange(turns) - np.repeat(first, lengths)
    later = tidx > 0

    kind = np.where(later, rng.choice(KINDS, size=turns, p=[0.90, 0.03, 0.03, 0.02, 0.02]), "turn")
    gap_kind = np.where(later, rng.choice(GAP_KINDS, size=turns, p=[0.6, 0.3, 0.1]), "none")
    gap = np.select(
        [gap_kind == "tool", gap_kind == "think", gap_kind == "pause"],
        [rng.lognormal(0.5, 0.8, turns), rng.lognormal(2.0, 0.7, turns), rng.lognormal(5.8, 0.8, turns)],
        0.0,
    )
    gap = np.where(kind == "resume", np.maximum(gap, 600.0), gap)
    prompt = (1500 + 350 * tidx + rng.integers(0, 300, turns)).astype(np.int64)
    completion = rng.integers(16, 256, turns)
    expected = np.where(later, np.maximum(prompt - 300, 0), 0)

    pd_mode = mode != "aggregated"
    bidir = mode.startswith("pd-bidir")
    ok = rng.random(turns) > 0.005
    status = np.where(ok, "ok", rng.choice(["error", "timeout"], size=turns))
    if bidir:
        hit = later & (gap < TTL_S - MARGIN_S) & np.isin(kind, ["turn", "retry", "edit"]) & ok
        reuse = np.where(~later, "miss_first_turn", np.where(hit, "hit", np.where(gap >= TTL_S - MARGIN_S,
                                                                                   "miss_expired", "miss_mismatch")))  # fmt: skip
        if mode == "pd-bidir-nocache":
            reuse = np.where(later & (rng.random(turns) < 0.1), "miss_no_handle_returned", reuse)
            hit = reuse == "hit"
    elif pd_mode:
        hit = np.zeros(turns, bool)
        reuse = np.where(later, "miss_no_handle_returned", "miss_first_turn")
    else:
        hit = np.zeros(turns, bool)
        reuse = None
    reused = np.where(hit, (expected // 128) * 128, 0)
    p_cached = np.where(pd_mode & ~mode.endswith("nocache") & later & ~hit, (expected // 256) * 128, 0)
    recomputed = prompt - reused - p_cached
    prefill_leg = 0.004 + recomputed * 4e-5 + reused * 2e-6
    ttft = prefill_leg + 0.03 + rng.exponential(0.01, turns)
    if not pd_mode:
        ttft = 0.02 + np.where(later, prompt - expected, prompt) * 4e-5 + rng.exponential(0.01, turns)
    itl = 0.012 + rng.exponential(0.002, turns)
    e2e = ttft + completion * itl
    ttft = np.where(ok, ttft, np.nan)
    e2e_rec = np.where(ok, e2e, np.nan)
    # Sessions start at random over the run; a turn is sent after the previous ended plus its gap.
    step = np.where(later, gap, 0.0) + np.r_[0.0, e2e[:-1]] * later
    sess_start = np.sort(rng.uniform(0, 1800, n_sess))
    cum = np.cumsum(step)
    offset = cum - np.repeat(cum[first], lengths) + np.repeat(sess_start, lengths)
    duration = float(offset.max() + e2e.max())

    sid = np.char.add(f"{run_id}-s", sess.astype(str))
    cols = {
        "run_id": np.full(turns, run_id), "session_id": sid, "turn_index": tidx.astype(np.int32),
        "request_id": np.char.add(np.char.add(sid, "-t"), tidx.astype(str)), "kind": kind,
        "gap_before_s": gap, "gap_kind": gap_kind, "sent_at": _ts(start, offset), "ttft_s": ttft,
        "e2e_s": e2e_rec, "tpot_s": np.where(ok, itl, np.nan), "itl_p50_s": np.where(ok, itl, np.nan),
        "itl_p90_s": np.where(ok, itl * 1.5, np.nan), "prompt_tokens": prompt.astype(np.int32),
        "completion_tokens": completion.astype(np.int32),
        "cached_tokens": None if pd_mode else ((expected // 16) * 16).astype(np.int32),
        "expected_reusable_tokens": np.where(later, expected, np.nan), "status": status,
        "http_status": np.full(turns, 200, np.int32),
    }  # fmt: skip
    if pd_mode:
        cols |= {
            "reuse": reuse, "prefill_leg_s": prefill_leg, "prefill_cached_tokens": p_cached.astype(np.int32),
            "remote_tokens": reused.astype(np.int32), "reused_tokens": reused.astype(np.int32),
            "recomputed_tokens": recomputed.astype(np.int32), "handle_age_s": np.where(hit, gap, np.nan),
        }  # fmt: skip
    _write(store, run_id, "turns", _table(store, "turns", cols), TURN_SHARDS_PER_RUN)

    # sessions: one row per session, task latency split as loadgen.session writes it
    llm = np.bincount(sess, weights=np.nan_to_num(e2e_rec), minlength=n_sess)
    parts = {k: np.bincount(sess, weights=np.where(gap_kind == k, gap, 0.0), minlength=n_sess) for k in GAP_KINDS}
    last = first + lengths - 1
    task = offset[last] + e2e[last] - offset[first]
    scols = {
        "run_id": np.full(n_sess, run_id), "session_id": sid[first],
        "archetype": rng.choice(ARCHETYPES, n_sess), "source": np.full(n_sess, "synthetic"),
        "started_at": _ts(start, offset[first]), "finished_at": _ts(start, offset[last] + e2e[last]),
        "turns": lengths.astype(np.int32), "task_latency_s": task, "llm_s": llm,
        "tool_wait_s": parts["tool"], "think_s": parts["think"], "pause_s": parts["pause"],
        "status": np.full(n_sess, "ok"),
    }  # fmt: skip
    _write(store, run_id, "sessions", _table(store, "sessions", scols))

    # metric_samples: every second, per endpoint 20 unrelated series plus the ones the pages read
    secs = np.arange(0.0, duration, 1.0)
    n = secs.size
    rows: dict[str, list] = defaultdict(list)

    def add(endpoint: str, role: str, name: str, values: np.ndarray, labels: str = '{"model_name":"m"}') -> None:
        rows["scraped_at"].append(secs)
        rows["endpoint"].append(np.full(n, endpoint))
        rows["role"].append(np.full(n, role))
        rows["name"].append(np.full(n, name))
        rows["labels"].append(np.full(n, labels))
        rows["value"].append(values)

    endpoints = [("http://p:8100", "prefill"), ("http://d:8200", "decode")] if pd_mode else [("http://a:8000", "aggregated")]
    for url, role in endpoints:
        usage = np.clip(0.3 + 0.2 * np.sin(secs / 300) + rng.normal(0, 0.02, n), 0, 1)
        add(url, role, "vllm:kv_cache_usage_perc", usage, '{"model_name":"m","pid":"1"}')
        add(url, role, "vllm:kv_cache_usage_perc", np.zeros(n), '{"model_name":"m","pid":"2"}')
        for k in range(20):
            add(url, role, f"vllm:other_series_{k}_total", np.cumsum(rng.random(n)))
    if pd_mode:
        add("http://p:8100", "prefill", "vllm:nixl_xfer_time_seconds_sum", np.cumsum(rng.random(n) * 0.01))
        add("http://p:8100", "prefill", "vllm:nixl_xfer_time_seconds_count", np.cumsum(rng.integers(0, 5, n)).astype(float))
        add("http://x:8300", "proxy", "turnscope_handle_bytes_live",
            np.clip(2e9 + 1e9 * np.sin(secs / 200) + rng.normal(0, 1e8, n), 0, None) if bidir else np.zeros(n))  # fmt: skip
        for k in range(20):
            add("http://x:8300", "proxy", f"turnscope_other_{k}", rng.random(n))
    mcols = {k: np.concatenate(v) for k, v in rows.items()}
    m = mcols["value"].size
    mcols["scraped_at"] = _ts(start, mcols["scraped_at"])
    mcols["run_id"] = np.full(m, run_id)
    _write(store, run_id, "metric_samples", _table(store, "metric_samples", mcols), TURN_SHARDS_PER_RUN)

    config = (
        f'{{"connector": {{"decoder_kv_blocks_ttl": {int(TTL_S)}}}, "kv_bytes_per_token": {KV_BYTES_PER_TOKEN}}}'
    )
    end = start + dt.timedelta(seconds=duration)
    rl = {
        "run_id": [run_id, run_id], "label": ["bench"] * 2, "mode": [mode] * 2, "workload": ["bench-agents"] * 2,
        "history_mode": [history] * 2, "model": ["synthetic"] * 2, "config": [config] * 2,
        "started_at": pa.array([start, start], pa.timestamp("us", tz="UTC")),
        "finished_at": pa.array([None, end], pa.timestamp("us", tz="UTC")),
        "status": ["running", "complete"], "updated_at": pa.array([start, end], pa.timestamp("us", tz="UTC")),
    }  # fmt: skip
    _write(store, run_id, "runs_log", _table(store, "runs_log", rl))
    return duration


def build(root: Path, turns: int, seed: int = 0) -> Store:
    """A synthetic store of `turns` turns split over 10 runs (5 modes x 2 history modes)."""
    store = Store(root)
    store.init()
    rng = np.random.default_rng(seed)
    per_run = turns // (len(MODES) * len(HISTORIES))
    i = 0
    for mode in MODES:
        for history in HISTORIES:
            n = per_run if i else turns - per_run * (len(MODES) * len(HISTORIES) - 1)
            build_run(store, rng, f"bench-{mode}-{history}", mode, history, n, T0 + dt.timedelta(hours=i))
            i += 1
    return store


# --- timing -------------------------------------------------------------------------------------


def instrument(log: list[tuple[str, float, float]]) -> None:
    """Time every public query function of store.queries (the package re-exports each page
    module's queries; pages look them up there by name at call)."""
    import store.queries as q

    for name in dir(q):
        fn = getattr(q, name)
        if name.startswith("_") or not callable(fn) or not str(getattr(fn, "__module__", "")).startswith(q.__name__):
            continue
        if isinstance(fn, type) or name in ("as_filter",):
            continue

        def timed(*args, __fn=fn, __name=name, **kw):
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                return __fn(*args, **kw)
            finally:
                log.append((__name, time.perf_counter() - t0, time.process_time() - c0))

        setattr(q, name, functools.wraps(fn)(timed))


def render(page: str, at=None):
    """Render `page` once with empty caches; returns (AppTest, seconds)."""
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    st.cache_data.clear()
    if at is None:
        at = AppTest.from_file(str(pages.APP), default_timeout=600)
    t0 = time.perf_counter()
    if pages.page(page).default:
        at.run()
    else:
        at.switch_page(pages.page(page).script).run()
    elapsed = time.perf_counter() - t0
    if at.exception:
        raise RuntimeError(f"{page}: {[e.value for e in at.exception]}")
    return at, elapsed


def _fastest(runs: list[list[tuple[str, float, float]]]) -> list[tuple[str, float, float]]:
    """Per query (by position and name) the fastest wall time over repeated renders, with its CPU."""
    out = []
    for i, (name, _, _) in enumerate(runs[0]):
        same = [r[i] for r in runs if i < len(r) and r[i][0] == name]
        out.append(min(same, key=lambda x: x[1]))
    return out


def measure(root: Path, repeats: int) -> list[dict]:
    from streamlit.testing.v1 import AppTest

    os.environ["TURNSCOPE_STORE"] = str(root)
    log: list[tuple[str, float, float]] = []
    instrument(log)
    # Warm the process (imports, plotly templates) on the first page before measuring anything.
    render("overview", AppTest.from_file(str(pages.APP), default_timeout=600))
    results = []
    for page in PAGES:
        colds, runs = [], []
        for _ in range(repeats):
            at = AppTest.from_file(str(pages.APP), default_timeout=600)
            # The app frame first, as a browser would have it, for every page (the Overview is then
            # rendered a second time, caches emptied): an AppTest's first run also scans every
            # installed package for Streamlit components (BidiComponentManager, ~0.3 s here),
            # which a server does once at start, not per page view.
            render("overview", at)
            del log[:]
            at, cold = render(page, at)
            colds.append(cold)
            runs.append(list(log))
        del log[:]
        t0 = time.perf_counter()
        at.run()
        warm = time.perf_counter() - t0
        extra = {}
        if page == "sessions":  # pick the slowest session: its timeline
            import duckdb
            import streamlit as st

            con = duckdb.connect(str(root / "turnscope.duckdb"), read_only=True)
            try:
                run_id, session_id = con.execute(
                    "SELECT run_id, session_id FROM session_tasks ORDER BY task_latency_s DESC LIMIT 1"
                ).fetchone()
            finally:
                con.close()
            best = None
            for _ in range(repeats):
                st.cache_data.clear()
                at.selectbox(key="session_pick").set_value(None).run()
                st.cache_data.clear()
                del log[:]
                at.selectbox(key="session_pick").set_value(f"{run_id}/{session_id}")
                t0 = time.perf_counter()
                at.run()
                took = time.perf_counter() - t0
                if best is None or took < best[0]:
                    best = (took, list(log))
            extra["pick a session (cold)"] = best
        if page == "sql":  # run a query over turn_breakdown
            from store import console as sqlconsole

            best = None
            for _ in range(repeats):
                at.text_area(key="sql_text").set_value(sqlconsole.EXAMPLES["TTFT p50 by mode and turn index"])
                at.button(key="sql_run").click()
                t0, c0 = time.perf_counter(), time.process_time()
                at.run()
                took, cpu = time.perf_counter() - t0, time.process_time() - c0
                if best is None or took < best[0]:
                    best = (took, [("console: TTFT p50 by mode and turn index", took, cpu)])
            extra["run an example query"] = best
        results.append(
            {"page": page, "cold_s": min(colds), "warm_s": warm, "queries": _fastest(runs), "extra": extra}
        )
    return results


def _fmt(qlog: list[tuple[str, float, float]]) -> str:
    return ", ".join(f"{n} {w * 1e3:.0f} ({c * 1e3:.0f})" for n, w, c in qlog)


def report(results: list[dict], turns: int, repeats: int) -> bool:
    ok = True
    print(f"\nDashboard at {turns:,} turns: cold = empty cache, fastest of {repeats}; queries: wall ms (CPU ms "
          "summed over DuckDB's threads), timed inside store.queries")  # fmt: skip
    print(f"{'page':<10} {'render cold':>12} {'warm':>8}   queries")
    for r in results:
        slow = r["cold_s"] > PAGE_TARGET_S
        ok &= not slow
        mark = "  << page over 2 s" if slow else ""
        print(f"{r['page']:<10} {r['cold_s'] * 1e3:>10.0f}ms {r['warm_s'] * 1e3:>6.0f}ms   {_fmt(r['queries'])}{mark}")
        for name, (secs, qlog) in r["extra"].items():
            print(f"{'':<10} {secs * 1e3:>10.0f}ms {'':>8}   {name}: {_fmt(qlog)}")
        for n, w, _ in r["queries"]:
            if w > QUERY_TARGET_S:
                ok = False
                print(f"{'':<10} {'':>12} {'':>8}   << {n} over 300 ms ({w * 1e3:.0f} ms)")
    worst_q = max((w for r in results for _, w, _ in r["queries"]), default=0.0)
    worst_p = max(r["cold_s"] for r in results)
    print(f"\nslowest query {worst_q * 1e3:.0f} ms (target 300), slowest page {worst_p * 1e3:.0f} ms (target 2000): "
          + ("targets met" if ok else "TARGETS MISSED"))  # fmt: skip
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=1_000_000, help="turns in the synthetic store (default 1,000,000)")
    ap.add_argument("--store", type=Path, help="store directory (default: a temp dir); reused if it has a store")
    ap.add_argument("--keep", action="store_true", help="keep the temp store")
    ap.add_argument("--rebuild", action="store_true", help="rebuild even if --store already holds one")
    ap.add_argument("--repeats", type=int, default=3, help="cold renders per page; the fastest is kept (default 3)")
    ap.add_argument("--no-rollups", action="store_true",
                    help="read the plain views only (no per-run rollups, store/rollup.py): the before figures")
    args = ap.parse_args()
    root = args.store or Path(tempfile.mkdtemp(prefix="turnscope-bench-"))
    try:
        if args.rebuild or not (root / "turnscope.duckdb").exists() or not (root / "runs").is_dir():
            if args.rebuild and root.exists():
                shutil.rmtree(root / "runs", ignore_errors=True)
            t0 = time.perf_counter()
            build(root, args.turns)
            print(f"built {args.turns:,} turns in {root} in {time.perf_counter() - t0:.1f} s")
        if args.no_rollups:
            from store import db

            db.use_rollups = False  # the plain views only: the "before" of docs/schema/overview.md's rollups
            print("rollups: not read (--no-rollups)")
        else:
            from planner.recorded_whatif import whatif_ttl_d_limit
            from store.rollup import Rollups

            t0 = time.perf_counter()
            written = Rollups(Store(root), whatif=whatif_ttl_d_limit).write_finished()
            print(f"rollups: {len(written)} run(s) rolled up in {time.perf_counter() - t0:.1f} s "
                  "(`turnscope rollup`; a finished eval does it at its end)")  # fmt: skip
        size = sum(p.stat().st_size for p in (root / "runs").rglob("*.parquet"))
        print(f"store: {root} ({size / 2**20:.0f} MiB of Parquet), {os.cpu_count()} CPUs, "
              f"load average before {os.getloadavg()[0]:.1f}")  # fmt: skip
        results = measure(root, max(1, args.repeats))
        print(f"load average after {os.getloadavg()[0]:.1f} (other work on this machine adds to every number)")
        return 0 if report(results, args.turns, max(1, args.repeats)) else 1
    finally:
        if args.store is None and not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
