"""The reads of the TTFT split (``analysis.ttft_split``: a forecast's terms beside the workers' own
histograms) and of the prefill engine's speed over a run."""

from __future__ import annotations

from collections.abc import Sequence

import duckdb
import pandas as pd


def _marks(values: Sequence) -> str:
    return ", ".join("?" for _ in values)


def worker_increases(con: duckdb.DuckDBPyConnection, run_ids: Sequence[str], names: Sequence[str]) -> pd.DataFrame:
    """Per run, worker role (``prefill``, ``decode``, ``aggregated``) and metric of `names`: the
    run's increase of the counter (view ``metric_increases``, summed over the role's endpoints).
    Columns: run_id, role, name, v."""
    return con.execute(
        f"SELECT run_id, role, name, sum(increase) AS v FROM metric_increases WHERE run_id IN ({_marks(run_ids)}) "
        f"AND role IN ('prefill', 'decode', 'aggregated') AND name IN ({_marks(names)}) GROUP BY ALL",
        [*run_ids, *names]).df()


def ok_ttft(con: duckdb.DuckDBPyConnection, run_ids: Sequence[str]) -> pd.DataFrame:
    """Per run: its ok turns with a TTFT and their mean TTFT (seconds). Columns: run_id, ok_turns, ttft_s."""
    return con.execute(
        f"SELECT run_id, count(*) AS ok_turns, avg(ttft_s) AS ttft_s FROM turns WHERE status = 'ok' "
        f"AND ttft_s IS NOT NULL AND run_id IN ({_marks(run_ids)}) GROUP BY run_id", list(run_ids)).df()


def prefill_speed_intervals(con: duckdb.DuckDBPyConnection, run_ids: Sequence[str]) -> pd.DataFrame:
    """The prefill (or aggregated) engine's scrape intervals (view ``engine_prefill_speed``) of
    `run_ids`, by run and time: run_id, interval_end (UTC), prefills, prefill_s (s),
    computed_tokens. Raises ``duckdb.CatalogException`` when the store's views predate the view."""
    return con.execute(
        f"SELECT run_id, interval_end, prefills, prefill_s, computed_tokens FROM engine_prefill_speed "
        f"WHERE run_id IN ({_marks(run_ids)}) AND interval_s IS NOT NULL ORDER BY run_id, interval_end",
        list(run_ids)).df()
