"""What the workers reported of their KV cache: the labels of vLLM's ``vllm:cache_config_info``
gauge in a run's scrapes (the planner's fit, the capacity ramp's forecast and the dashboard's Memory
page read it here).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import duckdb
import pandas as pd

from store.writer import Store

_CACHE_CONFIG = """
SELECT run_id, role, endpoint, any_value(labels) AS labels
FROM metric_samples
WHERE name = 'vllm:cache_config_info' AND list_contains($run_ids::VARCHAR[], run_id)
GROUP BY run_id, role, endpoint
ORDER BY run_id, role, endpoint
"""


def cache_config(con: duckdb.DuckDBPyConnection, run_ids: Sequence[str]) -> pd.DataFrame:
    """The labels of vLLM's ``vllm:cache_config_info`` gauge (``block_size``, ``num_gpu_blocks``,
    ... as vLLM reports them) per run, role and worker endpoint, from the runs' scrapes: the one
    reader of it (the planner's fit and the Memory page use it). Columns: run_id, role, endpoint, labels (a dict;
    rows whose labels are not a JSON object are dropped)."""
    df = con.execute(_CACHE_CONFIG, {"run_ids": [str(r) for r in run_ids]}).df()
    labels = [json.loads(v) if isinstance(v, str) else v for v in df["labels"]]
    df = df.assign(labels=labels)
    keep = pd.Series([isinstance(v, dict) for v in labels], index=df.index, dtype=bool)
    return df.loc[keep].reset_index(drop=True)


def labels_by_role(store: Store, run_ids: Sequence[str]) -> dict[str, dict]:
    """Role -> the labels of its workers' ``vllm:cache_config_info`` (``block_size``,
    ``num_gpu_blocks``, ...) in ``run_ids``' scrapes (:func:`cache_config`, on a connection of its
    own; the first worker's where a role has several); roles without that gauge are absent."""
    con = store.connect()
    try:
        cc = cache_config(con, run_ids)
    finally:
        con.close()
    return {role: g["labels"].iloc[0] for role, g in cc.groupby("role", sort=True)}
