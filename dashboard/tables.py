"""Tables for display: store rows turned into what an operator reads (ms, rates, short names)."""

from __future__ import annotations

import numpy as np
import pandas as pd


def run_summary_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per run from the ``run_summary`` view, latencies in ms.

    `df`: ``dashboard.queries.run_summary`` (seconds, counts). Returns columns run, mode, status,
    turns, ok, failed, hits, "hit rate (all turns)" (hits / turns, 0..1; first turns cannot
    hit), TTFT p50/p90/mean (ms), reused tokens, workload, history, started (UTC), run_id: the
    numbers first, so they are in view without scrolling.
    """
    turns = df["turns"].astype(float)
    with np.errstate(divide="ignore", invalid="ignore"):
        hit_rate = np.where(turns > 0, df["hits"].astype(float) / turns, np.nan)
    return pd.DataFrame(
        {
            "run": df["label"].where(df["label"].notna(), df["run_id"]),
            "mode": df["mode"],
            "status": df["status"],
            "turns": df["turns"],
            "ok": df["ok_turns"],
            "failed": df["failed_turns"],
            "hits": df["hits"],
            "hit rate (all turns)": hit_rate,
            "TTFT p50 (ms)": df["ttft_p50_s"] * 1e3,
            "TTFT p90 (ms)": df["ttft_p90_s"] * 1e3,
            "TTFT mean (ms)": df["ttft_mean_s"] * 1e3,
            "reused tokens": df["reused_tokens"],
            "workload": df["workload"],
            "history": df["history_mode"],
            "started (UTC)": df["started_at"],
            "run_id": df["run_id"],
        }
    )
