"""Tables for display: store rows turned into what an operator reads (ms, rates, short names)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis import speedup
from store import hit_rate


def run_summary_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per run from the ``run_summary`` view, latencies in ms.

    `df`: ``store.queries.run_summary`` (seconds, counts). Returns columns run, mode, history,
    status, turns, ok, failed, hits, `hit_rate.LABEL` (``store.hit_rate``: hits / later turns,
    0..1; NaN without a proxy outcome), `hit_rate.PREFIX_CACHE_LABEL` (the workers' own prefix cache,
    tokens, 0..1; NaN where not scraped), TTFT p50/p90/mean (ms), reused tokens, workload, started
    (UTC), run_id: the numbers first, so they are in view without scrolling.
    """
    return pd.DataFrame(
        {
            "run": df["label"].where(df["label"].notna(), df["run_id"]),
            "mode": df["mode"],
            "history": df["history_mode"],
            "status": df["status"],
            "turns": df["turns"],
            "ok": df["ok_turns"],
            "failed": df["failed_turns"],
            "hits": df["hits"],
            hit_rate.LABEL: hit_rate.rate(df[hit_rate.HITS], df[hit_rate.LATER_TURNS]).to_numpy(),
            hit_rate.PREFIX_CACHE_LABEL: (df[hit_rate.PREFIX_CACHE] if hit_rate.PREFIX_CACHE in df
                                          else pd.Series(np.nan, index=df.index)).to_numpy(dtype=float),
            "TTFT p50 (ms)": df["ttft_p50_s"] * 1e3,
            "TTFT p90 (ms)": df["ttft_p90_s"] * 1e3,
            "TTFT mean (ms)": df["ttft_mean_s"] * 1e3,
            "reused tokens": df["reused_tokens"],
            "workload": df["workload"],
            "started (UTC)": df["started_at"],
            "run_id": df["run_id"],
        }
    )


def reuse_cost_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per run from ``store.queries.reuse_cost``, for reading.

    Columns: run, mode, history, "held (GiB·s)", "peak (MiB)", hits, `hit_rate.LABEL` (the
    bidirectional hit rate), `hit_rate.PREFIX_CACHE_LABEL` (P's own cache), "pulled (tokens)", "prefill ms/1k tok"
    (measured on turns that pulled nothing), "NIXL (s)", "saved (s, est.)", "GiB·s per s saved"
    (NaN when nothing was saved).
    """
    return pd.DataFrame(
        {
            "run": df["run_label"],
            "mode": df["mode"],
            "history": df["history_mode"],
            "held (GiB·s)": df["held_gib_s"],
            "peak (MiB)": df["peak_bytes"] / 2**20,
            "hits": df["hits"],
            hit_rate.LABEL: hit_rate.rate(df["hits"], df[hit_rate.LATER_TURNS]).to_numpy(),
            hit_rate.PREFIX_CACHE_LABEL: df[hit_rate.PREFIX_CACHE].to_numpy(dtype=float),
            "pulled (tokens)": df["reused_tokens"],
            "prefill ms/1k tok": df["prefill_s_per_token"] * 1e6,
            "NIXL (s)": df["xfer_s"],
            "saved (s, est.)": df["saved_s"],
            "GiB·s per s saved": df["gib_s_per_saved_s"],
        }
    )


def blank_missing(df: pd.DataFrame, formats: dict[str, str]) -> pd.DataFrame:
    """`df` with each column of `formats` as text: its values formatted (``str.format``), and ""
    where a value is missing (Streamlit prints "None" for a missing number in any table)."""
    out = df.copy()
    for col, fmt in formats.items():
        out[col] = [("" if pd.isna(v) else fmt.format(v)) for v in out[col]]
    return out


def shortfall_table(df: pd.DataFrame) -> pd.DataFrame:
    """``store.queries.reuse_shortfalls`` for reading (tokens; gap and handle age in s)."""
    return pd.DataFrame(
        {
            "run": df["run_label"],
            "mode": df["mode"],
            "history": df["history_mode"],
            "session": df["session_id"],
            "turn": df["turn_index"],
            "kind": df["kind"],
            "gap (s)": df["gap_before_s"],
            "gap kind": df["gap_kind"],
            "reuse": df["reuse"].where(df["reuse"].notna(), "not recorded"),
            "expected": df["expected_reusable_tokens"],
            "measured": df["measured_reused_tokens"],
            "shortfall": df["shortfall_tokens"],
            "pulled from D": df["reused_tokens"],
            "P prefix cache": df["prefill_cached_tokens"],
            "server cached": df["cached_tokens"],
            "divergence at": df["divergence_position"],
            "run_id": df["run_id"],
        }
    )


def session_table(df: pd.DataFrame) -> pd.DataFrame:
    """``store.queries.session_list`` for reading (seconds)."""
    return pd.DataFrame(
        {
            "run": df["run_label"],
            "mode": df["mode"],
            "history": df["history_mode"],
            "session": df["session_id"],
            "archetype": df["archetype"],
            "turns": df["turns"],
            "task (s)": df["task_latency_s"],
            "LLM (s)": df["llm_s"],
            "tool (s)": df["tool_wait_s"],
            "think (s)": df["think_s"],
            "pause (s)": df["pause_s"],
            "status": df["status"],
            "run_id": df["run_id"],
        }
    )


def whatif_table(df: pd.DataFrame) -> pd.DataFrame:
    """``planner.recorded_whatif.whatif_ttl_d_limit`` summed per mode and TTL (``figures.whatif_totals``) for
    reading: mode, TTL (s), later turns, hits, `hit_rate.LABEL` (0..1), later turns whose handle was
    lost to a full D, KV held (GiB·s), and how many runs' held KV would exceed their D's space."""
    from dashboard.figures.memory import whatif_totals

    tot = whatif_totals(df)
    return pd.DataFrame(
        {
            "mode": tot["mode"].to_numpy(),
            "decoder_kv_blocks_ttl (s)": tot["ttl_s"].to_numpy(),
            "later turns": tot["later_turns"].to_numpy(),
            "hits": tot["hits"].to_numpy(),
            hit_rate.LABEL: hit_rate.rate(tot["hits"], tot["later_turns"]).to_numpy(),
            "lost: D full": tot["lost_hits"].to_numpy(),
            "KV held (GiB·s)": tot["held_gib_s"].to_numpy(),
            "runs over D's space": [f"{o} of {n}" for o, n in zip(tot["runs_over"], tot["runs"], strict=True)],
        }
    )


#: The columns of ``store.queries.nixl_failures`` shown by :func:`nixl_failures_table`, with
#: their headers: the proxy's outcomes (turns), then vLLM's NIXL counters on P and D (requests;
#: failed notifications are inside failed transfers; notifications after expiry are per remote rank,
#: an alarm: blocks possibly reused before a transfer ended).
NIXL_FAILURE_COLUMNS = ("run_label", "expired_turns", "transfer_failed_turns", "p_kv_expired_reqs",
                        "p_failed_transfers", "p_failed_notifications", "p_notifications_after_expiry",
                        "d_kv_expired_reqs", "d_failed_transfers", "d_notifications_after_expiry")
_NIXL_FAILURE_HEADERS = ("run", "proxy miss_expired", "proxy miss_transfer_failed", "P: KV expired",
                         "P: failed transfers", "P: of which notifications", "P: notified after expiry",
                         "D: KV expired", "D: failed transfers", "D: notified after expiry")


def nixl_failures_table(df: pd.DataFrame) -> pd.DataFrame:
    """``store.queries.nixl_failures`` for reading: one row per run, the proxy's outcomes and
    vLLM's NIXL counters side by side (blank: the counter was not scraped)."""
    out = df.loc[:, list(NIXL_FAILURE_COLUMNS)].copy()
    out.columns = list(_NIXL_FAILURE_HEADERS)
    out.insert(1, "mode", df["mode"].to_numpy())
    return out.astype({h: "Int64" for h in _NIXL_FAILURE_HEADERS[1:]})


#: ``store.queries.nixl_failures``' counts from the proxy's outcomes (the rest are vLLM's counters).
NIXL_OUTCOME_COUNTS = ("expired_turns", "transfer_failed_turns")


def nixl_counter_columns(df: pd.DataFrame) -> list[str]:
    """The columns of ``store.queries.nixl_failures`` that hold vLLM's NIXL counters on P and D
    (``p_*``, ``d_*``; NaN where not scraped)."""
    return [c for c in df.columns if c.startswith(("p_", "d_"))]


def no_failed_pulls(df: pd.DataFrame) -> bool:
    """Whether every count of ``store.queries.nixl_failures`` (the proxy's outcomes,
    :data:`NIXL_OUTCOME_COUNTS`, and vLLM's counters, :func:`nixl_counter_columns`) is 0 or not
    scraped in every run of ``df``: nothing to draw."""
    counts = df.loc[:, [*NIXL_OUTCOME_COUNTS, *nixl_counter_columns(df)]].astype(float)
    return bool((counts.fillna(0) == 0).all().all())


def ratio_table(ratios: dict) -> pd.DataFrame:
    """The Compare page's three `analysis.headline.Ratio` values (or None) as rows: turns, the
    speed-up B / A (``analysis.speedup``) with its CI and verdict, median A/B (ms), turns and
    sessions per side."""
    rows = []
    for case, r in ratios.items():
        if r is None:
            continue
        s = speedup.of(r)
        rows.append(
            {
                "turns": case,
                f"{speedup.LABEL} (B/A)": speedup.fmt(s.value),
                "95% CI": speedup.fmt_ci(s.ci_low, s.ci_high),
                "verdict": s.verdict.value,
                "median A (ms)": r.median_treatment_s * 1e3,
                "median B (ms)": r.median_baseline_s * 1e3,
                "n A": r.n_treatment,
                "n B": r.n_baseline,
                "sessions A": r.sessions_treatment,
                "sessions B": r.sessions_baseline,
            }
        )
    return pd.DataFrame(rows)


def case_table(df: pd.DataFrame) -> pd.DataFrame:
    """``analysis.compare.case_table`` (long: case, side, turns, ttft_p50_s) as one row per case:
    case, "n A", "n B", "p50 A (ms)", "p50 B (ms)"; blanks where a side has no such turns."""
    cols = ["case", "n A", "n B", "p50 A (ms)", "p50 B (ms)"]
    if df.empty:
        return pd.DataFrame(columns=cols)
    cases = list(dict.fromkeys(df["case"]))
    wide = df.pivot(index="case", columns="side", values=["turns", "ttft_p50_s"]).reindex(cases)
    out = pd.DataFrame({"case": cases})
    for side in ("A", "B"):
        has = ("turns", side) in wide.columns
        out[f"n {side}"] = wide[("turns", side)].to_numpy() if has else np.nan
        out[f"p50 {side} (ms)"] = wide[("ttft_p50_s", side)].to_numpy() * 1e3 if has else np.nan
    return out[cols]
