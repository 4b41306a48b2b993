"""The Turns page's queries: latency by turn and history length, where each turn's time went,
expected vs measured reuse and the turns that fell short.
"""

from __future__ import annotations

from collections.abc import Sequence

import duckdb
import pandas as pd

from core.modes import BIDIRECTIONAL_MODES
from store.queries.common import TurnFilter, as_filter, id_list, run_sql, where_sql

_LATENCY_BY_TURN = """
SELECT mode, coalesce(reuse, 'not recorded') AS reuse, turn_index AS x,
       count(*)                      AS turns,
       quantile_cont(ttft_s, 0.5)    AS ttft_p50_s,
       quantile_cont(itl_p50_s, 0.5) AS itl_p50_s,
       quantile_cont(e2e_s, 0.5)     AS e2e_p50_s
FROM turn_rows
WHERE {where} AND status = 'ok'
GROUP BY ALL
ORDER BY mode, reuse, x
"""

# Prompt length in tokens (the history plus the new turn), in bins of a "nice" width (1, 2 or 5
# x a power of ten) giving about $bins bins.
_LATENCY_BY_HISTORY = """
WITH width AS (
    SELECT mag * CASE WHEN w0 <= mag THEN 1 WHEN w0 <= 2 * mag THEN 2 WHEN w0 <= 5 * mag THEN 5 ELSE 10 END
               AS bin_tokens
    FROM (SELECT w0, pow(10, floor(log10(w0))) AS mag
          FROM (SELECT greatest(max(prompt_tokens) / $bins, 1) AS w0
                FROM turn_rows WHERE {where} AND status = 'ok'))
)
SELECT mode, coalesce(reuse, 'not recorded') AS reuse, floor(prompt_tokens / bin_tokens) * bin_tokens AS x,
       any_value(bin_tokens)         AS bin_tokens,
       count(*)                      AS turns,
       quantile_cont(ttft_s, 0.5)    AS ttft_p50_s,
       quantile_cont(itl_p50_s, 0.5) AS itl_p50_s,
       quantile_cont(e2e_s, 0.5)     AS e2e_p50_s
FROM turn_rows CROSS JOIN width
WHERE {where} AND status = 'ok' AND prompt_tokens IS NOT NULL
GROUP BY ALL
ORDER BY mode, reuse, x
"""


def latency_by(
    con: duckdb.DuckDBPyConnection, f: TurnFilter | Sequence[str], by: str = "turn_index", bins: int = 20
) -> pd.DataFrame:
    """Median TTFT, ITL and E2E of ok turns by mode and reuse outcome, against `by`.

    `by`: ``turn_index`` (x = the 0-based turn index) or ``history`` (x = the lower edge of the
    turn's prompt-length bin in tokens; bins of a 1/2/5 x 10^k width, about `bins` of them).
    Columns: mode, reuse (outcome, ``not recorded`` without a proxy), x, turns (count),
    ttft_p50_s, itl_p50_s (median over turns of each turn's median inter-token latency),
    e2e_p50_s (seconds), and with ``history`` also bin_tokens (the bin width). One row per
    (mode, reuse, x).
    """
    ff = as_filter(f)
    if by == "turn_index":
        return run_sql(con, _LATENCY_BY_TURN.format(where=where_sql(ff)), ff.params())
    if by == "history":
        params = {**ff.params(), "bins": max(int(bins), 1)}
        return run_sql(con, _LATENCY_BY_HISTORY.format(where=where_sql(ff)), params)
    raise ValueError(f"latency_by: by must be 'turn_index' or 'history', got {by!r}")


_TIME_SPLIT = """
WITH f AS (
    SELECT t.mode, t.turn_index, t.ttft_s, t.e2e_s, t.prefill_leg_s, t.reused_tokens,
           k.xfer_s_per_token,
           t.prefill_leg_s IS NOT NULL AS split,
           -- least() skips NULLs in DuckDB: without a measured rate the estimate is NULL (counted 0)
           CASE WHEN coalesce(t.reused_tokens, 0) = 0 THEN 0.0
                WHEN k.xfer_s_per_token IS NULL OR t.prefill_leg_s IS NULL THEN NULL
                ELSE least(t.reused_tokens * k.xfer_s_per_token, t.prefill_leg_s) END AS xfer_est_s
    FROM turn_rows t LEFT JOIN {rates} k USING (run_id)
    WHERE {where} AND t.status = 'ok' AND t.ttft_s IS NOT NULL AND t.e2e_s IS NOT NULL
)
SELECT mode, turn_index,
       count(*)                                                                  AS turns,
       count(*) FILTER (WHERE split)                                             AS split_turns,
       avg(CASE WHEN split THEN greatest(ttft_s - prefill_leg_s, 0) ELSE 0 END)  AS proxy_s,
       avg(CASE WHEN split THEN prefill_leg_s - coalesce(xfer_est_s, 0) ELSE 0 END) AS prefill_s,
       avg(CASE WHEN split THEN coalesce(xfer_est_s, 0) ELSE 0 END)              AS kv_transfer_est_s,
       avg(e2e_s - ttft_s)                                                       AS decode_s,
       avg(CASE WHEN split THEN 0 ELSE ttft_s END)                               AS unsplit_ttft_s,
       avg(e2e_s)                                                                AS e2e_mean_s,
       count(*) FILTER (WHERE split AND coalesce(reused_tokens, 0) > 0 AND xfer_s_per_token IS NULL)
                                                                                 AS transfer_unknown_turns
FROM f
GROUP BY ALL
ORDER BY mode, turn_index
"""


_KV_TRANSFER = """
SELECT run_id, xfer_s, xfers, reused_tokens, xfer_s_per_token
FROM run_kv_transfer
WHERE list_contains($run_ids::VARCHAR[], run_id)
ORDER BY run_id
"""


def kv_transfer(con: duckdb.DuckDBPyConnection, f: TurnFilter | Sequence[str]) -> pd.DataFrame:
    """The ``run_kv_transfer`` view for the runs of `f`: P's measured NIXL time per run.

    Columns: run_id, xfer_s (seconds), xfers (count), reused_tokens (tokens P pulled),
    xfer_s_per_token (seconds per pulled token; NULL without NIXL scrapes or pulled tokens).
    """
    return run_sql(con, _KV_TRANSFER, {"run_ids": id_list(as_filter(f).run_ids)})


def xfer_rates(kv: pd.DataFrame) -> tuple[tuple[str, float], ...]:
    """(run_id, seconds per pulled token) of `kv_transfer`'s rows that have one: a hashable
    argument for `time_split`."""
    known = kv[kv["xfer_s_per_token"].notna()]
    return tuple((str(r), float(v)) for r, v in zip(known["run_id"], known["xfer_s_per_token"], strict=True))


def time_split(
    con: duckdb.DuckDBPyConnection,
    f: TurnFilter | Sequence[str],
    rates: tuple[tuple[str, float], ...] | None = None,
) -> pd.DataFrame:
    """Where each ok turn's time went, averaged by mode and turn index (seconds per turn).

    Per turn, with the proxy's prefill leg known (P/D modes):
    proxy_s = TTFT - prefill leg (proxy, queueing, D's pull of P's KV and D's first token);
    kv_transfer_est_s = reused_tokens x the run's measured NIXL seconds per pulled token
    (``run_kv_transfer``; an estimate, transfers are not timed per turn), at most the prefill leg;
    prefill_s = prefill leg - that estimate; decode_s = E2E - TTFT. Without a prefill leg
    (aggregated) the whole TTFT is unsplit_ttft_s. The five means add up to e2e_mean_s.
    Columns: mode, turn_index, turns, split_turns, proxy_s, prefill_s, kv_transfer_est_s,
    decode_s, unsplit_ttft_s, e2e_mean_s, transfer_unknown_turns (turns that pulled tokens in a
    run without a NIXL timing, counted as 0 transfer time).
    `rates`: the runs' seconds per pulled token (`xfer_rates` of `kv_transfer`) when the caller
    has them already; by default they are read from ``run_kv_transfer`` here.
    """
    ff = as_filter(f)
    params = ff.params()
    if rates is None:
        table = "run_kv_transfer"
    else:
        table = "(SELECT unnest($rate_runs::VARCHAR[]) AS run_id, unnest($rate_values::DOUBLE[]) AS xfer_s_per_token)"
        params |= {"rate_runs": [r for r, _ in rates], "rate_values": [v for _, v in rates]}
    return run_sql(con, _TIME_SPLIT.format(where=where_sql(ff), rates=table), params)


_REUSE_VS_EXPECTED = """
SELECT mode, turn_index,
       count(*)                          AS turns,
       avg(expected_reusable_tokens)     AS expected_tokens,
       avg(measured_reused_tokens)       AS measured_tokens,
       count(*) FILTER (WHERE expected_reusable_tokens - measured_reused_tokens >= $min_shortfall)
                                         AS short_turns
FROM turn_rows
WHERE {where} AND status = 'ok' AND turn_index >= 1
  AND expected_reusable_tokens IS NOT NULL AND measured_reused_tokens IS NOT NULL
GROUP BY ALL
ORDER BY mode, turn_index
"""


def reuse_vs_expected(
    con: duckdb.DuckDBPyConnection, f: TurnFilter | Sequence[str], min_shortfall_tokens: int = 128
) -> pd.DataFrame:
    """Expected against measured reuse of ok later turns (turn_index >= 1), by mode and turn index.

    expected: ``expected_reusable_tokens`` (the longest common prefix of the previous turn's
    prompt + output ids and this prompt's ids); measured: ``turn_breakdown.measured_reused_tokens``
    (P's pull from D plus P's prefix-cache hit; the server's cached_tokens without a proxy). Turns
    lacking either are left out. Columns: mode, turn_index, turns, expected_tokens,
    measured_tokens (means, tokens per turn), short_turns (turns whose shortfall is at least
    `min_shortfall_tokens`).
    """
    params = {**as_filter(f).params(), "min_shortfall": int(min_shortfall_tokens)}
    return run_sql(con, _REUSE_VS_EXPECTED.format(where=where_sql(as_filter(f))), params)


_REUSE_SHORTFALLS = """
SELECT run_id, run_label, mode, history_mode, session_id, turn_index, kind, gap_kind, gap_before_s, reuse,
       expected_reusable_tokens, measured_reused_tokens,
       expected_reusable_tokens - measured_reused_tokens AS shortfall_tokens,
       reused_tokens, prefill_cached_tokens, cached_tokens, divergence_position, handle_age_s,
       count(*) OVER () AS total
FROM turn_rows
WHERE {where} AND status = 'ok' AND turn_index >= 1
  AND expected_reusable_tokens IS NOT NULL AND measured_reused_tokens IS NOT NULL
  AND expected_reusable_tokens - measured_reused_tokens >= $min_shortfall
  AND list_contains($modes, mode)
ORDER BY shortfall_tokens DESC, run_id, session_id, turn_index
LIMIT $limit
"""

#: The modes whose later turns can reuse KV from the decode worker (bidirectional transfer): only
#: there is a shortfall an engine miss. ``pd-nocache`` recomputes every prompt by design; ``pd``
#: and ``aggregated`` reuse only their own prefix cache (README, "What each mode compares").
REUSE_FROM_D_MODES: tuple[str, ...] = BIDIRECTIONAL_MODES


def reuse_shortfalls(
    con: duckdb.DuckDBPyConnection,
    f: TurnFilter | Sequence[str],
    min_shortfall_tokens: int = 128,
    limit: int = 200,
    modes: tuple[str, ...] = REUSE_FROM_D_MODES,
) -> pd.DataFrame:
    """The ok later turns of `modes` (by default those that can reuse KV from D) where the engine
    reused at least `min_shortfall_tokens` fewer tokens than expected (see `reuse_vs_expected`),
    the largest shortfall first, at most `limit` rows. Other modes' shortfalls are by design:
    `reuse_vs_expected`'s short_turns counts them.

    Columns: run_id, run_label, mode, session_id, turn_index, kind, gap_kind, gap_before_s (s),
    reuse, expected_reusable_tokens, measured_reused_tokens, shortfall_tokens, reused_tokens,
    prefill_cached_tokens, cached_tokens, divergence_position, handle_age_s (s), total (number of
    such turns before the limit).
    """
    params = {**as_filter(f).params(), "min_shortfall": int(min_shortfall_tokens), "limit": int(limit),
              "modes": list(modes)}
    return run_sql(con, _REUSE_SHORTFALLS.format(where=where_sql(as_filter(f))), params)


# Per decode-side endpoint of each run: vLLM's own ITL (per output event, tokens per event beside
# it), the metric name it was read under, the server's version and speculative decoding, and the
# endpoint's restarts with the turns that used a handle from before one.
_SERVER_SIDE = """
WITH ep AS (
    SELECT DISTINCT run_id, endpoint, role FROM metric_samples
    WHERE list_contains($run_ids::VARCHAR[], run_id) AND role IN ('decode', 'aggregated')
), src AS (
    SELECT run_id, endpoint, arg_max(source, scraped_at) AS itl_source FROM metric_sources
    WHERE list_contains($run_ids::VARCHAR[], run_id) AND metric = 'vllm:inter_token_latency_seconds'
    GROUP BY ALL
), info AS (
    SELECT run_id, endpoint, arg_max(vllm_version, scraped_at) AS vllm_version,
           arg_max(spec_decode, scraped_at) AS spec_decode FROM engine_info
    WHERE list_contains($run_ids::VARCHAR[], run_id) GROUP BY ALL
), life AS (
    SELECT run_id, endpoint, max(restarts_before) AS restarts FROM engine_lifetimes
    WHERE list_contains($run_ids::VARCHAR[], run_id) GROUP BY ALL
)
SELECT ep.run_id, ep.endpoint, ep.role, info.vllm_version, info.spec_decode, src.itl_source,
       i.itl_events, i.itl_mean_s_per_event, i.tokens_per_event, i.itl_mean_s_per_token,
       coalesce(life.restarts, 0) AS restarts
FROM ep LEFT JOIN server_itl i USING (run_id, endpoint) LEFT JOIN src USING (run_id, endpoint)
LEFT JOIN info USING (run_id, endpoint) LEFT JOIN life USING (run_id, endpoint)
ORDER BY ep.run_id, ep.endpoint
"""

# One run's turns on handles issued before a decode restart. Asked only of runs whose decode
# restarted (without a restart no handle can span one), one run at a time: DuckDB pushes an
# equality on run_id into turn_lifetimes' ASOF joins, not a list_contains, and over every turn the
# view cost 24 s at 10,000,000 turns (bench/dashboard_scale.py; 6 s for one run of 1,000,000).
_STALE = """
SELECT count(*) FILTER (WHERE handle_spans_restart) AS turns_on_pre_restart_handles,
       count(*) FILTER (WHERE stale_hit) AS stale_hits
FROM turn_lifetimes WHERE run_id = $run_id
"""


def server_side(con: duckdb.DuckDBPyConnection, f: TurnFilter | Sequence[str]) -> pd.DataFrame:
    """vLLM's own view of the decode (or aggregated) workers of the runs of `f` (turn filters do not
    apply to scrapes). Columns: run_id, endpoint, role, vllm_version (NULL: not answered),
    spec_decode, itl_source (the ITL histogram's name as exposed; NULL: missing), itl_events,
    itl_mean_s_per_event (s per output event), tokens_per_event, itl_mean_s_per_token (s),
    restarts (engine lifetimes after the first), turns_on_pre_restart_handles and stale_hits (the
    run's turns whose handle was issued before a decode restart, and those recorded as hits;
    docs/schema/views.md, ``turn_lifetimes``). One row per endpoint."""
    out = run_sql(con, _SERVER_SIDE, {"run_ids": id_list(as_filter(f).run_ids)})
    out["turns_on_pre_restart_handles"] = 0
    out["stale_hits"] = 0
    for run_id in out.loc[out["restarts"] > 0, "run_id"].unique():
        stale = run_sql(con, _STALE, {"run_id": run_id}).iloc[0]
        at = out["run_id"] == run_id
        out.loc[at, "turns_on_pre_restart_handles"] = int(stale["turns_on_pre_restart_handles"])
        out.loc[at, "stale_hits"] = int(stale["stale_hits"])
    return out
