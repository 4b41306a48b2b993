"""The runs `turnscope serve` scrapes for (turnscope/conductor/serve_metrics.py): those recording now,
with the address their client sent them to."""

from __future__ import annotations

import duckdb
import pandas as pd

_RECORDING = "SELECT run_id, json_extract_string(config, '$.host') AS host FROM runs WHERE status = 'running'"


def recording_hosts(con: duckdb.DuckDBPyConnection) -> pd.DataFrame:
    """The runs whose latest ``runs`` row reads ``running`` (view ``runs``: a run whose heartbeats
    stopped reads ``aborted``), with ``host``: ``config.host``, the server Locust's ``--host`` named
    (loadgen/run_recorder.py; NULL for a run recorded otherwise). Columns run_id, host; one row per run."""
    return con.execute(_RECORDING).df()
