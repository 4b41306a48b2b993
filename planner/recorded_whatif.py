"""The TTL what-if of the store's recorded runs, with D's KV space as the limit (the Memory page's,
docs/dashboard.md: Memory, and the rollups', :mod:`store.rollup`): the runs' rows read by
:mod:`store.queries.memory` (SQL) and replayed by :mod:`planner.ttl_whatif` (the planner's handle
ledger), or read back from the runs' rollups where they hold the TTLs asked for.
"""

from __future__ import annotations

from collections.abc import Sequence

import duckdb
import pandas as pd

from planner.ttl_whatif import RESULT_COLUMNS, TURN_COLUMNS, RunKV, whatif_ttl_limited
from store.queries import memory
from store.queries.common import TurnFilter, as_filter


def whatif_ttl_d_limit(
    con: duckdb.DuckDBPyConnection, f: TurnFilter | Sequence[str], ttls_s: Sequence[float], *, rollups: bool = True
) -> pd.DataFrame:
    """The TTL what-if with D's KV space as the limit (:mod:`planner.ttl_whatif`: the
    planner's handle ledger over each run's recorded turns), for the runs of `f`, whole runs (D
    holds every turn's KV whatever a filter keeps: the archetype and kind filters do not apply).

    D's KV space: :func:`store.queries.memory.decode_kv_space` (``num_gpu_blocks x block_size`` of D's
    ``vllm:cache_config_info``, summed over the run's decode workers) x the run's
    ``kv_bytes_per_token`` (``store.queries.memory.run_config``); handles are whole blocks of that block size. A run
    without the gauge is replayed without a limit (capacity_bytes NaN) and in tokens, a run
    without ``kv_bytes_per_token`` is left out (no bytes to compare). TTLs at or below a run's
    handle margin are skipped for it (nothing could be offered).

    Where `con` has rollups installed (:meth:`store.rollup.Rollups.install`) and `rollups`, a
    rolled-up run asked only for TTLs of the rollup's grid (``WHATIF_TTLS_S`` and the run's own
    TTL) is read from its rollup rows, the same figures without the replay
    (tests/integration/test_rollups.py); every other run is replayed here.
    Columns: :data:`planner.ttl_whatif.RESULT_COLUMNS` plus run_label, mode, block_size,
    decode_workers (Int64, NA without the gauge). One row per (run, TTL), by run_id then ttl_s.
    """
    run_ids = list(as_filter(f).run_ids)
    ttls = sorted({float(t) for t in ttls_s})
    cfg = memory.run_config(con, run_ids).set_index("run_id")
    covered = _covered_runs(con, cfg, ttls) if rollups else set()
    parts = [_rolled_whatif(con, covered, ttls)] if covered else []
    replay_ids = [r for r in cfg.index if r not in covered]
    if replay_ids:
        parts.append(_replay_whatif(con, cfg.loc[replay_ids], ttls))
    parts = [p for p in parts if len(p)]
    out = (pd.concat(parts, ignore_index=True) if parts
           else pd.DataFrame({c: [] for c in (*RESULT_COLUMNS, "block_size", "decode_workers")}))
    out = out.sort_values(["run_id", "ttl_s"], kind="stable").reset_index(drop=True)
    out["run_label"] = out["run_id"].map(cfg["run_label"])
    out["mode"] = out["run_id"].map(cfg["mode"])
    for c in ("later_turns", "hits", "lost_hits", "lost_handles"):
        out[c] = out[c].astype("int64")
    for c in ("ttl_s", "held_gib_s", "peak_held_bytes", "demand_peak_bytes", "capacity_bytes"):
        out[c] = out[c].astype("float64")
    for c in ("block_size", "decode_workers"):
        out[c] = out[c].astype("Int64")
    return out[[*RESULT_COLUMNS, "run_label", "mode", "block_size", "decode_workers"]]


def _covered_runs(con: duckdb.DuckDBPyConnection, cfg: pd.DataFrame, ttls: list[float]) -> set[str]:
    """The runs of `cfg` (``run_config`` rows by run_id) whose rollup covers `ttls` (every one in
    the grid the rollup holds); none where `con` has no rollups installed."""
    fresh = memory.rolled_up_runs(con)
    if not fresh:
        return set()
    out = set()
    for run_id, c in cfg.iterrows():
        grid = set(memory.WHATIF_TTLS_S)
        if not pd.isna(c["decoder_kv_blocks_ttl_s"]):
            grid.add(float(c["decoder_kv_blocks_ttl_s"]))
        if run_id in fresh and set(ttls) <= grid:
            out.add(str(run_id))
    return out


def _rolled_whatif(con: duckdb.DuckDBPyConnection, covered: set[str], ttls: list[float]) -> pd.DataFrame:
    """The rollup rows of the `covered` runs at `ttls` (:func:`_covered_runs`)."""
    return memory.rolled_whatif(con, sorted(covered), ttls)


def _replay_whatif(con: duckdb.DuckDBPyConnection, cfg: pd.DataFrame, ttls: list[float]) -> pd.DataFrame:
    """The runs of `cfg` (``run_config`` rows by run_id) replayed at `ttls` from their turns."""
    space = memory.decode_kv_space(con, list(cfg.index)).set_index("run_id")
    runs: dict[str, RunKV] = {}
    for run_id, c in cfg.iterrows():
        if pd.isna(c["kv_bytes_per_token"]):
            continue
        kvb = float(c["kv_bytes_per_token"])
        sp = space.loc[run_id] if run_id in space.index else None
        runs[str(run_id)] = RunKV(
            handle_ttl_margin_s=float(c["handle_ttl_margin_s"]), kv_bytes_per_token=kvb,
            block_size=None if sp is None else int(sp["block_size"]),
            capacity_bytes=None if sp is None else float(sp["kv_space_tokens"]) * kvb)
    turns = memory.whatif_turns(con, list(runs))
    out = whatif_ttl_limited(turns[["run_id", *TURN_COLUMNS]], runs, ttls)
    out["block_size"] = out["run_id"].map(space["block_size"]) if len(space) else pd.NA
    out["decode_workers"] = out["run_id"].map(space["decode_workers"]) if len(space) else pd.NA
    return out
