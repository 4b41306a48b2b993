"""Where a forecast TTFT goes wrong: the forecast's terms of each checked run's TTFT (means per
request) beside what the run's workers measured of the same parts, and the engine's speed through
the run (docs/planner/concurrency.md).

**Forecast terms** (per request, seconds; they sum to the forecast TTFT,
:func:`planner.check.forecast_terms`): ``compute`` (c(n) - c(cached) on P or the
aggregated worker), ``pull`` (P's read of D's KV), ``queue_p`` (the wait for the prefill worker),
``wait_d`` (the wait on D for room in its KV space), ``handoff_wait`` (D's wait for P's KV) and
``d_first_step`` (D's first step: P/D's hand-off, 0 where the profile keeps it in b0), ``fixed`` (the mode's b0 and the chat renders)
and ``contention`` (the host's share: the request's own work slowed by the others in flight,
:mod:`planner.host_contention`; 0 where the profile has no such term).

**Measured** (per run, from the increases of vLLM's request histograms over the run,
``metric_increases``; vLLM 0.32 ``v1/metrics/stats.py`` ``update_from_finished_request``: queue =
first SCHEDULED - QUEUED, prefill = first token - first SCHEDULED), means per request of the role:

* ``compute``: P's (aggregated worker's) ``vllm:request_prefill_time_seconds``;
* ``queue_p + pull``: P's ``vllm:request_queue_time_seconds`` (vLLM keeps a request loading
  remote KV asynchronously out of the running batch, ``WAITING_FOR_REMOTE_KVS``, and schedules it
  only once loaded: its pull counts as waiting), beside ``pull``: P's
  ``vllm:nixl_xfer_time_seconds`` sum over P's requests;
* ``wait_d``: D's ``vllm:request_queue_time_seconds`` (D's wait for P's KV hand-off, forecast
  ``handoff_wait``, and for room in its KV space, forecast ``wait_d``);
* ``d_first_step``: D's ``vllm:request_prefill_time_seconds`` (its first decode step after the
  hand-off, forecast ``d_first_step``);
* ``fixed``: the rest, the client's mean TTFT less the measured terms above (proxy, HTTP, renders,
  the engines' frontends);
* ``ttft``: the client's mean TTFT over the run's ok turns (``turns.ttft_s``).

``contention`` has no measured counterpart: time lost to other work on the cores is inside every
measured term. The workers' histograms count every request they finished in the run, ok or not;
the forecast means are over the checked ok turns.
"""

from __future__ import annotations

from collections.abc import Sequence

import duckdb
import numpy as np
import pandas as pd

from core.contract import Role
from core.modes import AGGREGATED
from store.queries import ttft_split as queries
from store.writer import Store

#: The forecast's terms, in the order printed (they sum to the forecast TTFT).
FORECAST_TERMS = ("compute", "queue_p", "pull", "wait_d", "handoff_wait", "d_first_step", "fixed", "contention")
#: Seconds of one window of :func:`speed_windows` (demo runs last about a minute; capacity steps longer).
WINDOW_S = 10.0

_HIST = ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds", "vllm:time_to_first_token_seconds")
_NAMES = [f"{h}_{p}" for h in _HIST for p in ("sum", "count")] + ["vllm:nixl_xfer_time_seconds_sum"]


def measured_sums(store: Store, run_ids: Sequence[str]) -> pd.DataFrame:
    """Per run and worker role, the run's increase of each histogram sum and count of
    :data:`_NAMES` (columns named after the metric, ``vllm:`` dropped), and the run's ok turns
    and their mean TTFT (seconds; every role's row repeats them). Empty without scrapes."""
    con = store.connect()
    try:
        inc = queries.worker_increases(con, run_ids, _NAMES)
        ttft = queries.ok_ttft(con, run_ids)
    finally:
        con.close()
    if inc.empty:
        return pd.DataFrame(columns=["run_id", "role"])
    wide = inc.assign(name=inc["name"].str.removeprefix("vllm:")).pivot_table(
        index=["run_id", "role"], columns="name", values="v", aggfunc="sum").reset_index()
    wide.columns.name = None
    return wide.merge(ttft, on="run_id", how="left")


def _mean(row: pd.Series | None, hist: str) -> float:
    """sum / count of histogram ``hist`` in ``row`` (NaN when absent or no observation)."""
    if row is None:
        return np.nan
    s, n = row.get(f"{hist}_sum", np.nan), row.get(f"{hist}_count", np.nan)
    return float(s / n) if pd.notna(n) and n > 0 and pd.notna(s) else np.nan


def measured_terms(sums: pd.DataFrame) -> pd.DataFrame:
    """Per run (rows of :func:`measured_sums`), the measured terms of the module doc, seconds per
    request (NaN: not known). Columns: run_id, compute, queue_p_pull, pull, wait_d, d_first_step,
    fixed, ttft, ok_turns, p_requests."""
    rows = []
    for run_id, g in sums.groupby("run_id", sort=False):
        by = {r.role: r for _, r in g.iterrows()}
        p = by.get(Role.PREFILL, by.get(Role.AGGREGATED))
        d = by.get(Role.DECODE)
        p_requests = float(p.get("request_prefill_time_seconds_count", np.nan)) if p is not None else np.nan
        xfer = p.get("nixl_xfer_time_seconds_sum", np.nan) if p is not None else np.nan
        row = {"run_id": run_id, "compute": _mean(p, "request_prefill_time_seconds"),
               "queue_p_pull": _mean(p, "request_queue_time_seconds"),
               "pull": float(xfer / p_requests) if pd.notna(xfer) and p_requests > 0 else np.nan,
               "wait_d": _mean(d, "request_queue_time_seconds"),
               "d_first_step": _mean(d, "request_prefill_time_seconds"),
               "ttft": float(g["ttft_s"].iloc[0]) if "ttft_s" in g else np.nan,
               "ok_turns": int(g["ok_turns"].iloc[0]) if "ok_turns" in g and pd.notna(g["ok_turns"].iloc[0]) else 0,
               "p_requests": p_requests}
        if d is None:
            row["pull"] = row["pull"] if pd.notna(row["pull"]) else (0.0 if p is not None else np.nan)
        known = [row["compute"], row["queue_p_pull"]] + ([row["wait_d"], row["d_first_step"]] if d is not None else [])
        row["fixed"] = row["ttft"] - sum(known) if all(pd.notna(v) for v in known) else np.nan
        rows.append(row)
    return pd.DataFrame(rows)


def forecast_means(terms: pd.DataFrame) -> pd.DataFrame:
    """Per checked run, the mean of each forecast term (:data:`FORECAST_TERMS`) and of the forecast
    TTFT over its ok turns (``terms``: :func:`planner.check.forecast_terms` rows with the
    turn's ``status``). Columns: checked_run_id, mode, turns, the terms, ttft."""
    ok = terms[terms["status"] == "ok"]
    out = ok.groupby(["checked_run_id", "mode"], sort=False)[[*FORECAST_TERMS, "ttft"]].mean().reset_index()
    return out.merge(ok.groupby("checked_run_id").size().rename("turns").reset_index(), on="checked_run_id")


#: (label, forecast column or expression, measured column, where the measured figure comes from).
ROWS = (
    ("compute", "compute", "compute", "P's vllm:request_prefill_time_seconds"),
    ("queue for P + pull", "queue_p+pull", "queue_p_pull", "P's vllm:request_queue_time_seconds (async pulls wait)"),
    ("  of which pull", "pull", "pull", "P's vllm:nixl_xfer_time_seconds / P's requests"),
    ("wait on D", "wait_d+handoff_wait", "wait_d", "D's vllm:request_queue_time_seconds (hand-off of P's KV + room)"),
    ("  of which room", "wait_d", None, "forecast: D's admission queue; measured: inside the wait on D"),
    ("D's first step", "d_first_step", "d_first_step", "D's vllm:request_prefill_time_seconds"),
    ("b0 + renders", "fixed", "fixed", "measured: the rest (proxy, HTTP, renders, frontends)"),
    ("contention", "contention", None, "forecast: the host, others in flight; measured: inside every term"),
    ("TTFT", "ttft", "ttft", "turns.ttft_s"),
)


def split_table(forecast: pd.DataFrame, measured: pd.DataFrame) -> pd.DataFrame:
    """One row per checked run and :data:`ROWS` entry: run_id, mode, term, forecast_s, measured_s
    (NaN: not known), measured_from. Aggregated runs have no D rows."""
    meas = {r.run_id: r for r in measured.itertuples()} if not measured.empty else {}
    rows = []
    for f in forecast.itertuples():
        m = meas.get(f.checked_run_id)
        one_worker = f.mode == AGGREGATED
        for label, fcol, mcol, source in ROWS:
            if one_worker and mcol in ("wait_d", "d_first_step"):
                continue
            if one_worker and fcol == "wait_d":
                continue
            if fcol == "queue_p+pull":
                fv = f.queue_p + f.pull
            elif fcol == "wait_d+handoff_wait":   # a profile without the hand-off term keeps it in b0
                fv = f.wait_d + (0.0 if pd.isna(f.handoff_wait) else f.handoff_wait)
            else:
                fv = getattr(f, fcol) if fcol else np.nan
            mv = getattr(m, mcol) if (m is not None and mcol) else np.nan
            if one_worker and label == "compute":
                source = "the worker's vllm:request_prefill_time_seconds"
            rows.append({"run_id": f.checked_run_id, "mode": f.mode, "term": label, "forecast_s": fv,
                         "measured_s": mv, "measured_from": source})
    return pd.DataFrame(rows)


def speed_windows(store: Store, run_ids: Sequence[str], window_s: float = WINDOW_S) -> pd.DataFrame:
    """The prefill (or aggregated) engine's speed in windows of ``window_s`` seconds from each
    run's first scrape (view ``engine_prefill_speed``, intervals put in the window of their end):
    run_id, window (0, 1, ...), window_start (UTC), prefills, prefill_s, computed_tokens,
    prefill_s_per_token (seconds of prefill per computed token). Windows with no computed token
    are left out. Raises ``duckdb.CatalogException`` when the store's views predate the view."""
    con = store.connect()
    try:
        df = queries.prefill_speed_intervals(con, run_ids)
    finally:
        con.close()
    if df.empty:
        return pd.DataFrame(columns=["run_id", "window", "window_start", "prefills", "prefill_s", "computed_tokens",
                                     "prefill_s_per_token"])
    first = df.groupby("run_id")["interval_end"].transform("min")
    df["window"] = ((df["interval_end"] - first).dt.total_seconds() // window_s).astype(int)
    w = df.groupby(["run_id", "window"], as_index=False).agg(
        window_start=("interval_end", "min"), prefills=("prefills", "sum"), prefill_s=("prefill_s", "sum"),
        computed_tokens=("computed_tokens", "sum"))
    w = w[w["computed_tokens"] > 0].copy()
    w["prefill_s_per_token"] = w["prefill_s"] / w["computed_tokens"]
    return w.reset_index(drop=True)


def slow_stretch(windows: pd.DataFrame) -> pd.DataFrame:
    """Per run: windows (with computed tokens), the median window's and the slowest window's
    seconds per computed token, and their ratio (``slowest_over_median``: 1.5 = the slowest
    window ran 1.5 times slower than the run's median one). Columns: run_id, windows,
    median_s_per_token, slowest_s_per_token, slowest_window_start, slowest_over_median."""
    rows = []
    for run_id, g in windows.groupby("run_id", sort=False):
        spt = g["prefill_s_per_token"].to_numpy(float)
        med = float(np.median(spt))
        k = int(np.argmax(spt))
        rows.append({"run_id": run_id, "windows": len(g), "median_s_per_token": med,
                     "slowest_s_per_token": float(spt[k]), "slowest_window_start": g["window_start"].iloc[k],
                     "slowest_over_median": float(spt[k] / med) if med > 0 else np.nan})
    return pd.DataFrame(rows)


def read_speed(store: Store, run_ids: Sequence[str], window_s: float = WINDOW_S) -> tuple[pd.DataFrame, str | None]:
    """(:func:`speed_windows`, None), or (empty, why) when the store's views predate
    ``engine_prefill_speed`` (views made before it; ``Store.init`` re-creates them)."""
    try:
        return speed_windows(store, run_ids, window_s), None
    except duckdb.CatalogException:
        return pd.DataFrame(), (
            "the store's views predate view engine_prefill_speed: a command that records into the store, "
            "e.g. turnscope eval, re-creates them")


def _ms(v: float) -> str:
    return "?" if v is None or pd.isna(v) else f"{v * 1e3:,.1f}"


def describe(table: pd.DataFrame, stretch: pd.DataFrame | None = None, window_s: float = WINDOW_S,
             speed_note: str | None = None) -> str:
    """The split per checked run as text: one line per term, forecast and measured ms per request
    (``?``: not known) and the measured figure's source; with ``stretch`` (:func:`slow_stretch`),
    the run's slowest window against its median."""
    lines = ["TTFT split per checked run (mean ms per request; forecast | measured; ?: the store cannot tell):"]
    st = {} if stretch is None or stretch.empty else {r.run_id: r for r in stretch.itertuples()}
    for run_id, g in table.groupby("run_id", sort=False):
        lines.append(f"  {run_id} ({g['mode'].iloc[0]}):")
        for r in g.itertuples():
            lines.append(f"    {r.term:<20} {_ms(r.forecast_s):>9} | {_ms(r.measured_s):>9}   {r.measured_from}")
        s = st.get(run_id)
        if s is not None:
            lines.append(f"    engine speed ({window_s:g} s windows, {s.windows} with prefills): median "
                         f"{s.median_s_per_token * 1e6:,.0f} us/token, slowest {s.slowest_s_per_token * 1e6:,.0f} "
                         f"us/token at {s.slowest_window_start:%H:%M:%S} ({s.slowest_over_median:.2f}x the median)")
        elif speed_note:
            lines.append(f"    engine speed: not known ({speed_note})")
    return "\n".join(lines)
