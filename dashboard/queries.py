"""SQL over the store's views (data/schema.sql), one function per question.

Each function takes an open DuckDB connection (read-only, see `dashboard.db`) and returns a
pandas DataFrame. Times are in seconds (float64) as stored; instants are UTC timestamps.
Rows are restricted by a `TurnFilter` (the sidebar's selection: runs, archetypes, turn kinds, gap
kinds); a plain sequence of run ids means "these runs, every archetype and kind". Only view
names and columns of data/schema.sql are used here.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import duckdb
import pandas as pd


@dataclass(frozen=True)
class TurnFilter:
    """The rows the pages show. Each field is a tuple of str; an empty tuple means "all".

    `run_ids` is never "all": pass every run id for all runs (an empty tuple selects nothing).
    `archetypes` matches ``sessions.archetype`` (known once a session's row is written, at its
    end), `kinds` ``turns.kind`` and `gap_kinds` ``turns.gap_kind``. Hashable, so it can be a
    cache key.
    """

    run_ids: tuple[str, ...]
    archetypes: tuple[str, ...] = ()
    kinds: tuple[str, ...] = ()
    gap_kinds: tuple[str, ...] = ()

    def params(self) -> dict[str, list[str]]:
        """The named parameters the ``_WHERE`` fragments use."""
        return {
            "run_ids": [str(r) for r in self.run_ids],
            "archetypes": [str(a) for a in self.archetypes],
            "kinds": [str(k) for k in self.kinds],
            "gap_kinds": [str(g) for g in self.gap_kinds],
        }

    @property
    def narrows_turns(self) -> bool:
        """True when archetype, kind or gap-kind filters are set (not only runs)."""
        return bool(self.archetypes or self.kinds or self.gap_kinds)


def as_filter(f: TurnFilter | Sequence[str]) -> TurnFilter:
    """`f` itself, or a `TurnFilter` of those run ids and nothing else."""
    return f if isinstance(f, TurnFilter) else TurnFilter(tuple(str(r) for r in f))


#: ``turn_rows``: ``turn_breakdown`` (data/schema.sql) without its archetype column, as a TEMP
#: view of each connection (temp objects are allowed on a read-only connection and vanish with
#: it). The view's archetype comes from a join on ``sessions`` that DuckDB performs even when the
#: column is unused, which costs 0.2-0.5 s per query at a million turns; the dashboard filters by
#: archetype with a semi-join instead (`_where`). tests/integration/test_dashboard_pages.py
#: checks that turn_rows holds exactly turn_breakdown's rows and columns, less the archetype.
TURN_ROWS_SQL = """
CREATE OR REPLACE TEMP VIEW turn_rows AS
SELECT t.*, r.mode, r.label AS run_label, r.workload, r.history_mode,
       t.e2e_s - t.ttft_s AS decode_s,
       greatest(t.ttft_s - coalesce(t.prefill_leg_s, 0), 0) AS after_prefill_s,
       CASE WHEN t.reuse IS NOT NULL
            THEN coalesce(t.reused_tokens, 0) + coalesce(t.prefill_cached_tokens, 0)
            ELSE t.cached_tokens END AS measured_reused_tokens
FROM turns t JOIN runs r USING (run_id)
"""


def _where(f: TurnFilter, alias: str = "", sessions: bool = False) -> str:
    """The row filter of `f` over turn_rows (or, with `sessions`, session_tasks: runs and
    archetypes only), parameterised by `TurnFilter.params`. Filters that are "all" are left
    out; an archetype filter on turns is a semi-join on ``sessions`` (the archetype lives on
    the session row)."""
    p = f"{alias}." if alias else ""
    parts = [f"list_contains($run_ids::VARCHAR[], {p}run_id)"]
    if f.archetypes and sessions:
        parts.append(f"list_contains($archetypes::VARCHAR[], {p}archetype)")
    elif f.archetypes:  # a semi-join on the sessions of those archetypes
        parts.append(
            f"({p}run_id, {p}session_id) IN (SELECT (run_id, session_id) FROM sessions "
            "WHERE list_contains($archetypes::VARCHAR[], archetype))"
        )
    if not sessions and f.kinds:
        parts.append(f"list_contains($kinds::VARCHAR[], {p}kind)")
    if not sessions and f.gap_kinds:
        parts.append(f"list_contains($gap_kinds::VARCHAR[], {p}gap_kind)")
    return "(" + " AND ".join(parts) + ")"


#: Reuse outcome label for turns without one (aggregated serving: no proxy).
NOT_RECORDED = "not recorded"
#: Proxy gauge of the bytes of KV that D holds for live handles.
HANDLE_BYTES = "turnscope_handle_bytes_live"
#: vLLM gauge of the KV cache in use, 0..1.
KV_USAGE = "vllm:kv_cache_usage_perc"

#: The prefill worker's counter of prompt tokens by where their KV came from (vLLM /metrics).
PROMPT_TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
#: Its label value for tokens whose KV was pulled from another worker (D, over NIXL).
EXTERNAL_KV_SOURCE = "external_kv_transfer"

_RUNS = """
SELECT run_id, label, mode, workload, history_mode, model, status, started_at, finished_at
FROM runs
ORDER BY started_at DESC NULLS LAST, run_id
"""

_TTFT_BY_TURN = """
SELECT mode, workload, history_mode, turn_index,
       count(ttft_s)              AS turns,
       quantile_cont(ttft_s, 0.5) AS ttft_p50_s,
       quantile_cont(ttft_s, 0.9) AS ttft_p90_s
FROM turn_rows
WHERE {where} AND status = 'ok' AND ttft_s IS NOT NULL
GROUP BY ALL
ORDER BY mode, workload, history_mode, turn_index
"""

# Whole sessions are sampled by a hash of (run_id, session_id), so the same sessions are kept on
# every call and a kept session keeps all its turns.
_TTFT_SAMPLES = """
WITH n AS (
    SELECT mode, workload, history_mode, count(*) AS group_turns
    FROM turn_rows
    WHERE {where} AND status = 'ok' AND ttft_s IS NOT NULL AND turn_index >= $min_turn_index
    GROUP BY ALL
)
SELECT b.run_id, b.mode, b.workload, b.history_mode, b.session_id, b.turn_index, b.ttft_s
FROM turn_rows b JOIN n ON b.mode IS NOT DISTINCT FROM n.mode AND b.workload IS NOT DISTINCT FROM n.workload
                             AND b.history_mode IS NOT DISTINCT FROM n.history_mode
WHERE {where_b} AND b.status = 'ok' AND b.ttft_s IS NOT NULL AND b.turn_index >= $min_turn_index
  AND ($max_turns::BIGINT IS NULL OR n.group_turns <= $max_turns::BIGINT
       OR hash(b.run_id, b.session_id) % 1000000 < 1000000.0 * $max_turns::BIGINT / n.group_turns)
ORDER BY b.run_id, b.session_id, b.turn_index
"""

_TTFT_STATS = """
WITH per_session AS (
    SELECT mode, workload, history_mode, run_id, session_id, count(*) AS n
    FROM turn_rows
    WHERE {where} AND status = 'ok' AND ttft_s IS NOT NULL AND turn_index >= $min_turn_index
    GROUP BY ALL
), session_counts AS (
    SELECT mode, workload, history_mode, count(*) AS sessions FROM per_session GROUP BY ALL
), medians AS (
    SELECT mode, workload, history_mode, count(*) AS turns, quantile_cont(ttft_s, 0.5) AS ttft_p50_s
    FROM turn_rows
    WHERE {where} AND status = 'ok' AND ttft_s IS NOT NULL AND turn_index >= $min_turn_index
    GROUP BY ALL
)
SELECT m.mode, m.workload, m.history_mode, m.turns, s.sessions, m.ttft_p50_s
FROM medians m JOIN session_counts s ON m.mode IS NOT DISTINCT FROM s.mode AND m.workload IS NOT DISTINCT FROM s.workload
                               AND m.history_mode IS NOT DISTINCT FROM s.history_mode
ORDER BY ALL
"""

_REUSE_OUTCOMES = """
SELECT mode, coalesce(reuse, 'not recorded') AS reuse,
       count(*)                                          AS turns,
       count(*) FILTER (WHERE turn_index >= $min_turn_index) AS later_turns
FROM turn_rows
WHERE {where}
GROUP BY ALL
ORDER BY mode, reuse
"""

_RUN_SUMMARY = """
SELECT *
FROM run_summary
WHERE list_contains($run_ids::VARCHAR[], run_id)
ORDER BY started_at NULLS LAST, run_id
"""

_PREFILL_COUNTER = """
WITH inc AS (
    SELECT run_id, endpoint, scraped_at, increase
    FROM metric_increases
    WHERE list_contains($run_ids::VARCHAR[], run_id) AND role = 'prefill' AND name = $name
      AND json_extract_string(labels, '$.source') = $source
)
SELECT i.run_id, coalesce(r.label, i.run_id) AS run_label, r.mode, i.endpoint, i.scraped_at,
       epoch(i.scraped_at - coalesce(r.started_at, min(i.scraped_at) OVER (PARTITION BY i.run_id)))
           AS elapsed_s,
       sum(i.increase) OVER (PARTITION BY i.run_id ORDER BY i.scraped_at, i.endpoint
                             ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS tokens
FROM inc i JOIN runs r USING (run_id)
ORDER BY i.run_id, i.scraped_at, i.endpoint
"""


def _ids(run_ids: Sequence[str]) -> list[str]:
    return [str(r) for r in run_ids]


def _run(con: duckdb.DuckDBPyConnection, sql: str, params: dict) -> pd.DataFrame:
    """`sql` with the named `params` it uses (DuckDB refuses unused ones), as a DataFrame. The
    connection gets the ``turn_rows`` temp view first when `sql` reads it."""
    if "turn_rows" in sql:
        con.execute(TURN_ROWS_SQL)
    used = {k: v for k, v in params.items() if re.search(rf"\${k}\b", sql)}
    return con.execute(sql, used).df()


def runs(con: duckdb.DuckDBPyConnection) -> pd.DataFrame:
    """Every run's latest status row (view ``runs``), newest first.

    Columns: run_id, label, mode, workload, history_mode, model, status, started_at,
    finished_at (UTC timestamps). One row per run.
    """
    return con.execute(_RUNS).df()


def ttft_by_turn(con: duckdb.DuckDBPyConnection, f: TurnFilter | Sequence[str]) -> pd.DataFrame:
    """TTFT percentiles of ok turns by mode and turn index (0-based), pooled over the runs of `f`.

    Columns: mode, workload, history_mode, turn_index, turns (count of ok turns with a TTFT),
    ttft_p50_s, ttft_p90_s (seconds, linear interpolation like ``mode_ab``). One row per
    (mode, workload, history_mode, turn_index).
    """
    return _run(con, _TTFT_BY_TURN.format(where=_where(as_filter(f))), as_filter(f).params())


def ttft_samples(
    con: duckdb.DuckDBPyConnection,
    f: TurnFilter | Sequence[str],
    min_turn_index: int = 1,
    max_turns: int | None = None,
) -> pd.DataFrame:
    """Raw TTFT of the ok turns with ``turn_index >= min_turn_index`` that `f` keeps.

    With `max_turns`, a (mode, workload, history_mode) group of more turns is sampled by whole
    sessions (a hash of run and session id, so the same ones every time) to about `max_turns`
    turns: the bootstrap's input. Exact medians and counts come from `ttft_stats`.
    Columns: run_id, mode, workload, history_mode, session_id, turn_index, ttft_s (seconds).
    One row per turn (kept), ordered by run, session and turn.
    """
    params = {
        **as_filter(f).params(),
        "min_turn_index": int(min_turn_index),
        "max_turns": None if max_turns is None else int(max_turns),
    }
    ff = as_filter(f)
    return _run(con, _TTFT_SAMPLES.format(where=_where(ff), where_b=_where(ff, "b")), params)


def ttft_stats(
    con: duckdb.DuckDBPyConnection, f: TurnFilter | Sequence[str], min_turn_index: int = 1
) -> pd.DataFrame:
    """Exact counts and median TTFT of the ok turns with ``turn_index >= min_turn_index`` that
    `f` keeps, per (mode, workload, history_mode): the headline's point estimates.

    Columns: mode, workload, history_mode, turns, sessions (distinct run and session),
    ttft_p50_s (seconds, linear interpolation: numpy's median).
    """
    params = {**as_filter(f).params(), "min_turn_index": int(min_turn_index)}
    return _run(con, _TTFT_STATS.format(where=_where(as_filter(f))), params)


def reuse_outcomes(
    con: duckdb.DuckDBPyConnection, f: TurnFilter | Sequence[str], min_turn_index: int = 1
) -> pd.DataFrame:
    """Count of turns (any status) by mode and the proxy's reuse outcome.

    Columns: mode, reuse (outcome; ``not recorded`` where the turn has none, e.g. no proxy),
    turns (all turns), later_turns (turns with ``turn_index >= min_turn_index``, those that
    could reuse a handle). One row per (mode, reuse).
    """
    params = {**as_filter(f).params(), "min_turn_index": int(min_turn_index)}
    return _run(con, _REUSE_OUTCOMES.format(where=_where(as_filter(f))), params)


def run_summary(con: duckdb.DuckDBPyConnection, run_ids: TurnFilter | Sequence[str]) -> pd.DataFrame:
    """The ``run_summary`` view for `run_ids`, oldest first.

    Columns as in data/schema.sql: run_id, label, mode, workload, history_mode, status,
    started_at, finished_at, turns, ok_turns, failed_turns, hits, ttft_p50_s, ttft_p90_s,
    ttft_mean_s (seconds), reused_tokens (tokens). One row per run.
    """
    return con.execute(_RUN_SUMMARY, {"run_ids": _ids(as_filter(run_ids).run_ids)}).df()


def external_kv_tokens(con: duckdb.DuckDBPyConnection, run_ids: TurnFilter | Sequence[str]) -> pd.DataFrame:
    """Prompt tokens whose KV prefill workers pulled from elsewhere, cumulative over each run.

    From ``metric_increases`` (counter deltas that tolerate restarts) of
    ``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}`` on ``role='prefill'``
    endpoints, summed over endpoints. The first scrape of each series counts 0, so tokens from
    before the run (workers reused across runs) are not counted.

    Columns: run_id, run_label, mode, endpoint, scraped_at (UTC), elapsed_s (seconds since the
    run's started_at, else since its first scrape), tokens (cumulative tokens, float). One row
    per scrape of a prefill endpoint, ordered by run and time.
    """
    params = {
        "run_ids": _ids(as_filter(run_ids).run_ids),
        "name": PROMPT_TOKENS_BY_SOURCE,
        "source": EXTERNAL_KV_SOURCE,
    }
    return _run(con, _PREFILL_COUNTER, params)


# --- filters ----------------------------------------------------------------------------------

#: Turn kinds and gap kinds as the contract defines them (data/schema.sql; docs/schema.md, `turns.kind`): offered as
#: filters without scanning the turns.
TURN_KINDS = ("turn", "retry", "edit", "fresh", "resume")
GAP_KINDS = ("none", "tool", "think", "pause")

_FILTER_OPTIONS = """
SELECT 'archetype' AS field, archetype AS value, count(*) AS n
FROM sessions WHERE list_contains($run_ids::VARCHAR[], run_id) AND archetype IS NOT NULL
GROUP BY ALL
ORDER BY value
"""


def filter_options(con: duckdb.DuckDBPyConnection, run_ids: Sequence[str]) -> pd.DataFrame:
    """The values the sidebar's archetype, turn-kind and gap-kind filters can take in `run_ids`.

    Archetypes are those of the runs' finished sessions (``sessions``: small, unlike the
    turns); turn kinds and gap kinds are the contract's (`TURN_KINDS`, `GAP_KINDS`; n = NULL).
    Columns: field (``archetype`` | ``kind`` | ``gap_kind``), value, n (sessions). One row per
    (field, value).
    """
    archetypes = _run(con, _FILTER_OPTIONS, {"run_ids": _ids(run_ids)})
    fixed = pd.DataFrame(
        [("kind", k, None) for k in TURN_KINDS] + [("gap_kind", g, None) for g in GAP_KINDS],
        columns=["field", "value", "n"],
    )
    return pd.concat([archetypes, fixed], ignore_index=True)


# --- Turns --------------------------------------------------------------------------------------

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
        return _run(con, _LATENCY_BY_TURN.format(where=_where(ff)), ff.params())
    if by == "history":
        params = {**ff.params(), "bins": max(int(bins), 1)}
        return _run(con, _LATENCY_BY_HISTORY.format(where=_where(ff)), params)
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
    return _run(con, _KV_TRANSFER, {"run_ids": _ids(as_filter(f).run_ids)})


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
    return _run(con, _TIME_SPLIT.format(where=_where(ff), rates=table), params)


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
    return _run(con, _REUSE_VS_EXPECTED.format(where=_where(as_filter(f))), params)


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
REUSE_FROM_D_MODES: tuple[str, ...] = ("pd-bidir", "pd-bidir-nocache")


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
    return _run(con, _REUSE_SHORTFALLS.format(where=_where(as_filter(f))), params)


# --- Sessions -----------------------------------------------------------------------------------

_TASK_SPLIT = """
SELECT mode, coalesce(archetype, 'unknown') AS archetype,
       count(*)                           AS sessions,
       avg(task_latency_s)                AS task_latency_s,
       quantile_cont(task_latency_s, 0.5) AS task_latency_p50_s,
       avg(llm_s)                         AS llm_s,
       avg(tool_wait_s)                   AS tool_wait_s,
       avg(think_s)                       AS think_s,
       avg(pause_s)                       AS pause_s
FROM session_tasks
WHERE {where} AND task_latency_s IS NOT NULL
GROUP BY ALL
ORDER BY mode, archetype
"""


def task_split(con: duckdb.DuckDBPyConnection, f: TurnFilter | Sequence[str]) -> pd.DataFrame:
    """Mean task latency of finished sessions split into LLM time, tool wait, think and pause.

    By mode and archetype (``unknown`` when the session has none); the turn-kind and gap-kind
    filters do not apply to whole sessions. Columns: mode, archetype, sessions, task_latency_s
    (mean), task_latency_p50_s, llm_s (sum of the turns' E2E), tool_wait_s, think_s, pause_s
    (means, seconds per session). task_latency_s minus the four parts is the client's own time
    between turns (rendering, tokenizing).
    """
    return _run(con, _TASK_SPLIT.format(where=_where(as_filter(f), sessions=True)), as_filter(f).params())


_SESSION_LIST = """
SELECT run_id, run_label, mode,
       (SELECT r.history_mode FROM runs r WHERE r.run_id = session_tasks.run_id) AS history_mode,
       session_id, archetype, turns, task_latency_s, llm_s, tool_wait_s,
       think_s, pause_s, status, started_at, count(*) OVER () AS total
FROM session_tasks
WHERE {where}
ORDER BY task_latency_s DESC NULLS LAST, run_id, session_id
LIMIT $limit
"""


def session_list(
    con: duckdb.DuckDBPyConnection, f: TurnFilter | Sequence[str], limit: int = 500
) -> pd.DataFrame:
    """The sessions `f` keeps (runs and archetypes), slowest task first, at most `limit` rows.

    Columns: run_id, run_label, mode, session_id, archetype, turns, task_latency_s, llm_s,
    tool_wait_s, think_s, pause_s (seconds), status, started_at (UTC), total (sessions before
    the limit).
    """
    params = {**as_filter(f).params(), "limit": int(limit)}
    return _run(con, _SESSION_LIST.format(where=_where(as_filter(f), sessions=True)), params)


_SESSION_TURNS = """
SELECT run_id, session_id, turn_index, kind, gap_kind, gap_before_s, sent_at,
       epoch(sent_at - min(sent_at) OVER ()) AS start_s,
       ttft_s, e2e_s, status, coalesce(reuse, 'not recorded') AS reuse, prompt_tokens,
       completion_tokens, reused_tokens, recomputed_tokens, prefill_leg_s
FROM turn_rows
WHERE run_id = $run_id AND session_id = $session_id
ORDER BY turn_index
"""


def session_turns(con: duckdb.DuckDBPyConnection, run_id: str, session_id: str) -> pd.DataFrame:
    """Every turn of one session (any status), in order: the input of the session timeline.

    Columns: run_id, session_id, turn_index, kind, gap_kind, gap_before_s, sent_at (UTC),
    start_s (seconds from the session's first request to this one's), ttft_s, e2e_s, status,
    reuse, prompt_tokens, completion_tokens, reused_tokens, recomputed_tokens, prefill_leg_s.
    """
    return _run(con, _SESSION_TURNS, {"run_id": str(run_id), "session_id": str(session_id)})


# --- Memory -------------------------------------------------------------------------------------

# Per-pid copies of a gauge: the live one is the non-zero copy (loadgen/prom.gauge_value), so the
# max over copies of one endpoint's scrape. Endpoints of one role are averaged (usage, 0..1) or
# summed (handle bytes) per time bucket.
_MEMORY_TIMELINE = """
WITH s AS (
    SELECT run_id, role, name, endpoint, scraped_at, max(value) AS value
    FROM metric_samples
    WHERE list_contains($run_ids::VARCHAR[], run_id) AND name IN ($kv_usage, $handle_bytes)
      AND ((name = $kv_usage AND role IN ('prefill', 'decode', 'aggregated'))
           OR (name = $handle_bytes AND role = 'proxy'))
    GROUP BY ALL
), span AS (
    SELECT s.run_id, coalesce(any_value(r.started_at), min(s.scraped_at)) AS t0, max(s.scraped_at) AS t1
    FROM s JOIN runs r USING (run_id)
    GROUP BY s.run_id
), w AS (
    SELECT run_id, t0, greatest(epoch(t1 - t0) / $buckets, $min_bucket_s) AS bucket_s FROM span
), per_endpoint AS (
    SELECT s.run_id, s.role, s.name, s.endpoint,
           floor(epoch(s.scraped_at - w.t0) / w.bucket_s) * w.bucket_s AS elapsed_s,
           any_value(w.bucket_s) AS bucket_s, avg(s.value) AS value
    FROM s JOIN w USING (run_id)
    GROUP BY 1, 2, 3, 4, 5
)
SELECT p.run_id, coalesce(any_value(r.label), p.run_id) AS run_label, any_value(r.mode) AS mode, p.role, p.name,
       p.elapsed_s, any_value(p.bucket_s) AS bucket_s,
       CASE WHEN p.name = $handle_bytes THEN sum(p.value) ELSE avg(p.value) END AS value,
       count(DISTINCT p.endpoint) AS endpoints
FROM per_endpoint p JOIN runs r USING (run_id)
GROUP BY p.run_id, p.role, p.name, p.elapsed_s
ORDER BY p.run_id, p.role, p.name, p.elapsed_s
"""


def memory_timeline(
    con: duckdb.DuckDBPyConnection, f: TurnFilter | Sequence[str], buckets: int = 300, min_bucket_s: float = 1.0
) -> pd.DataFrame:
    """KV usage of P, D (or the aggregated worker) and the proxy's live handle bytes over time.

    From ``metric_samples`` of the runs of `f` (turn filters do not apply to scrapes): vLLM's
    ``vllm:kv_cache_usage_perc`` (fraction 0..1) on prefill/decode/aggregated endpoints and
    ``turnscope_handle_bytes_live`` (bytes) on the proxy. Time is bucketed per run into about
    `buckets` buckets of at least `min_bucket_s` seconds; a bucket holds the mean of its scrapes,
    averaged over a role's endpoints (usage) or summed over them (bytes).
    Columns: run_id, run_label, mode, role, name, elapsed_s (bucket start, seconds since the run
    started), bucket_s (bucket width, s), value, endpoints (count). One row per (run, role, name,
    bucket).
    """
    params = {
        "run_ids": _ids(as_filter(f).run_ids),
        "kv_usage": KV_USAGE,
        "handle_bytes": HANDLE_BYTES,
        "buckets": max(int(buckets), 1),
        "min_bucket_s": float(min_bucket_s),
    }
    return _run(con, _MEMORY_TIMELINE, params)


_HIT_RATE_TIMELINE = """
WITH span AS (
    SELECT t.run_id, coalesce(any_value(r.started_at), min(t.sent_at)) AS t0, max(t.sent_at) AS t1
    FROM turns t JOIN runs r USING (run_id)
    WHERE list_contains($run_ids::VARCHAR[], t.run_id)
    GROUP BY t.run_id
), w AS (
    SELECT run_id, t0, greatest(epoch(t1 - t0) / $buckets, $min_bucket_s) AS bucket_s FROM span
)
SELECT b.run_id, coalesce(any_value(r.label), b.run_id) AS run_label, any_value(r.mode) AS mode,
       floor(epoch(b.sent_at - w.t0) / w.bucket_s) * w.bucket_s AS elapsed_s, any_value(w.bucket_s) AS bucket_s,
       count(*) AS later_turns, count(*) FILTER (WHERE b.reuse = 'hit') AS hits,
       count(*) FILTER (WHERE b.reuse = 'hit') / count(*) AS hit_rate
FROM turn_rows b JOIN w USING (run_id) JOIN runs r USING (run_id)
WHERE {where_b} AND b.turn_index >= 1 AND b.reuse IS NOT NULL AND b.sent_at IS NOT NULL
GROUP BY b.run_id, floor(epoch(b.sent_at - w.t0) / w.bucket_s) * w.bucket_s
ORDER BY b.run_id, elapsed_s
"""


def hit_rate_timeline(
    con: duckdb.DuckDBPyConnection, f: TurnFilter | Sequence[str], buckets: int = 60, min_bucket_s: float = 1.0
) -> pd.DataFrame:
    """Reuse hit rate of later turns (turn_index >= 1, with a proxy outcome) over time, per run.

    Turns are bucketed by when they were sent (about `buckets` buckets per run, each at least
    `min_bucket_s` seconds). Columns: run_id, run_label, mode, elapsed_s (bucket start, seconds
    since the run started), bucket_s, later_turns, hits, hit_rate (hits / later_turns, 0..1).
    """
    params = {**as_filter(f).params(), "buckets": max(int(buckets), 1), "min_bucket_s": float(min_bucket_s)}
    return _run(con, _HIT_RATE_TIMELINE.format(where_b=_where(as_filter(f), "b")), params)


# Handle bytes held: the step integral of the proxy's gauge over the run's scrapes (each scrape's
# value held until the next one). Prefill seconds saved: tokens pulled from D x the run's compute
# seconds per token (prefill leg / recomputed tokens over the turns that pulled nothing), less
# the measured NIXL transfer time.
_REUSE_COST = """
WITH hb AS (
    SELECT run_id, endpoint, scraped_at, max(value) AS bytes
    FROM metric_samples
    WHERE list_contains($run_ids::VARCHAR[], run_id) AND role = 'proxy' AND name = $handle_bytes
    GROUP BY ALL
), steps AS (
    SELECT run_id, bytes,
           bytes * epoch(lead(scraped_at) OVER (PARTITION BY run_id, endpoint ORDER BY scraped_at) - scraped_at)
               AS byte_s
    FROM hb
), held AS (
    SELECT run_id, sum(byte_s) AS held_byte_s, max(bytes) AS peak_bytes FROM steps GROUP BY run_id
), tk AS (
    SELECT run_id,
           count(*) FILTER (WHERE reuse = 'hit')                        AS hits,
           count(*) FILTER (WHERE turn_index >= 1 AND reuse IS NOT NULL) AS later_turns,
           sum(reused_tokens)                                           AS reused_tokens,
           sum(prefill_leg_s) FILTER (WHERE coalesce(reused_tokens, 0) = 0 AND recomputed_tokens > 0
                                      AND prefill_leg_s IS NOT NULL)    AS compute_s,
           sum(recomputed_tokens) FILTER (WHERE coalesce(reused_tokens, 0) = 0 AND recomputed_tokens > 0
                                          AND prefill_leg_s IS NOT NULL) AS compute_tokens
    FROM turns
    WHERE list_contains($run_ids::VARCHAR[], run_id) AND status = 'ok'
    GROUP BY run_id
), j AS (
    SELECT r.run_id, coalesce(r.label, r.run_id) AS run_label, r.mode,
           held.held_byte_s / 1073741824.0 AS held_gib_s, held.peak_bytes,
           tk.hits, tk.later_turns, tk.reused_tokens,
           tk.compute_s / nullif(tk.compute_tokens, 0) AS prefill_s_per_token,
           k.xfer_s
    FROM runs r
    LEFT JOIN held USING (run_id) LEFT JOIN tk USING (run_id) LEFT JOIN run_kv_transfer k USING (run_id)
    WHERE list_contains($run_ids::VARCHAR[], r.run_id) AND (held.run_id IS NOT NULL OR tk.reused_tokens > 0)
)
SELECT *, reused_tokens * prefill_s_per_token - coalesce(xfer_s, 0) AS saved_s,
       CASE WHEN reused_tokens * prefill_s_per_token - coalesce(xfer_s, 0) > 0
            THEN held_gib_s / (reused_tokens * prefill_s_per_token - coalesce(xfer_s, 0)) END AS gib_s_per_saved_s
FROM j
ORDER BY run_id
"""


def reuse_cost(con: duckdb.DuckDBPyConnection, f: TurnFilter | Sequence[str]) -> pd.DataFrame:
    """The memory cost of reuse per run: GiB-seconds of handle KV held per second of prefill saved.

    For the runs of `f` that have handle-byte scrapes or pulled tokens (whole runs: turn filters
    do not apply). held_gib_s: step integral of ``turnscope_handle_bytes_live`` over the scrapes
    (GiB x s); prefill_s_per_token: sum of prefill legs / sum of recomputed tokens over the ok
    turns that pulled nothing (s/token); saved_s (estimate) = reused_tokens x prefill_s_per_token
    - xfer_s (the run's measured NIXL time, ``run_kv_transfer``); gib_s_per_saved_s =
    held_gib_s / saved_s, NULL when nothing was saved.
    Columns: run_id, run_label, mode, held_gib_s, peak_bytes, hits, later_turns, reused_tokens,
    prefill_s_per_token, xfer_s, saved_s, gib_s_per_saved_s.
    """
    params = {"run_ids": _ids(as_filter(f).run_ids), "handle_bytes": HANDLE_BYTES}
    return _run(con, _REUSE_COST, params)


# --- What-if TTL --------------------------------------------------------------------------------

# Per turn (all turns of the selected runs, so each turn's successor is known before filtering):
# the KV D would hold after it (prompt + output tokens of an ok turn) for min(gap to the next
# turn, TTL), or the whole TTL after a session's last turn. A later turn hits when it is not
# `fresh` and its gap is below TTL - the proxy's margin.
# Exact, in one pass: with the TTLs sorted T_0 < ... < T_k-1, each turn falls in the bin of the
# first TTL above its next gap (bin_next) and above the gap it needs (bin_hit); then, for T_j,
# held = sum(h x next gap) over bins <= j + T_j x sum(h) over bins > j, and hits = turns in bins
# <= j. The per-turn work is two comparisons chains and one small group-by, whatever the number
# of TTLs.
_WHATIF_TTL = """
WITH w AS (
    SELECT run_id, turn_index, kind, gap_kind, gap_before_s,
           CASE WHEN status = 'ok' THEN coalesce(prompt_tokens, 0) + coalesce(completion_tokens, 0) ELSE 0 END
               ::DOUBLE AS held_tokens,
           lead(gap_before_s) OVER (PARTITION BY hash(run_id, session_id) ORDER BY turn_index) AS next_gap_s
    FROM turns
    WHERE {where_sessions}
), x AS (
    SELECT w.run_id, w.turn_index, w.held_tokens, w.next_gap_s, c.kv_bytes_per_token,
           -- the gap a hit must beat; NULL where no TTL can make the turn hit
           CASE WHEN w.turn_index >= 1 AND w.kind IS DISTINCT FROM 'fresh'
                THEN w.gap_before_s + c.handle_ttl_margin_s END AS needs_ttl_s
    FROM w JOIN run_config c USING (run_id)
    WHERE {where_turns}
), bins AS (
    SELECT run_id, any_value(kv_bytes_per_token) AS kv_bytes_per_token,
           {bin_next} AS bin_next, {bin_hit} AS bin_hit,
           count(*) FILTER (WHERE turn_index >= 1) AS later_turns,
           count(*) FILTER (WHERE held_tokens > 0) AS holding_turns,
           count(*) AS turns,
           sum(held_tokens) AS h,
           sum(held_tokens * coalesce(next_gap_s, 0)) AS h_next
    FROM x
    GROUP BY run_id, bin_next, bin_hit
)
SELECT sum(later_turns) AS later_turns,
       coalesce(sum(holding_turns) FILTER (WHERE kv_bytes_per_token IS NULL), 0) AS turns_without_kv_bytes,
       {totals}
FROM bins
"""
_WHATIF_TOTALS = """sum(turns) FILTER (WHERE bin_hit <= {i}) AS hits_{i},
       sum(CASE WHEN bin_next <= {i} THEN h_next ELSE h * {ttl} END) AS held_token_s_{i},
       sum(CASE WHEN bin_next <= {i} THEN h_next ELSE h * {ttl} END * kv_bytes_per_token) / 1073741824.0
           AS held_gib_s_{i}"""


def _bin(column: str, ttls: list[float]) -> str:
    """SQL: the index of the first of the sorted `ttls` above `column`, len(ttls) when none is
    (or `column` is NULL)."""
    whens = " ".join(f"WHEN {column} < {t!r} THEN {i}" for i, t in enumerate(ttls))
    return f"CASE {whens} ELSE {len(ttls)} END"


def whatif_ttl(
    con: duckdb.DuckDBPyConnection, f: TurnFilter | Sequence[str], ttls_s: Sequence[float]
) -> pd.DataFrame:
    """What other ``decoder_kv_blocks_ttl`` values would have given, replayed from recorded gaps.

    For each TTL in `ttls_s` (seconds) over the turns `f` keeps: a later turn (turn_index >= 1,
    not ``fresh``) hits when its gap_before_s < TTL - the run's handle margin (``run_config``);
    after each ok turn D holds its prompt + output tokens for min(gap to the session's next turn,
    TTL), the whole TTL after the last turn recorded. Other causes of a miss (mismatch, transfer
    failure) are not modelled. Columns: ttl_s, later_turns, hits, held_token_s (tokens x s),
    held_gib_s (GiB x s, using runs.config kv_bytes_per_token; NULL parts skipped),
    turns_without_kv_bytes (ok turns of runs with no kv_bytes_per_token). One row per TTL.
    """
    ff = as_filter(f)
    ttls = sorted({float(t) for t in ttls_s})
    if not ttls:
        return pd.DataFrame(columns=_WHATIF_COLUMNS)
    # The TTLs are floats formatted here (repr), never text from outside.
    where_sessions = _where(TurnFilter(ff.run_ids, ff.archetypes))
    where_turns = _where(TurnFilter((), (), ff.kinds, ff.gap_kinds), "w").replace(
        "list_contains($run_ids::VARCHAR[], w.run_id)", "true"
    )
    sql = _WHATIF_TTL.format(
        where_sessions=where_sessions,
        where_turns=where_turns,
        bin_next=_bin("next_gap_s", ttls),
        bin_hit=_bin("needs_ttl_s", ttls),
        totals=",\n       ".join(_WHATIF_TOTALS.format(i=i, ttl=repr(t)) for i, t in enumerate(ttls)),
    )
    wide = _run(con, sql, ff.params()).iloc[0]
    rows = [
        {
            "ttl_s": t,
            "later_turns": wide["later_turns"],
            "hits": wide[f"hits_{i}"],
            "held_token_s": wide[f"held_token_s_{i}"],
            "held_gib_s": wide[f"held_gib_s_{i}"],
            "turns_without_kv_bytes": wide["turns_without_kv_bytes"],
        }
        for i, t in enumerate(ttls)
    ]
    out = pd.DataFrame(rows, columns=_WHATIF_COLUMNS)
    for c in ("later_turns", "hits", "turns_without_kv_bytes"):
        out[c] = pd.to_numeric(out[c]).fillna(0).astype("int64")
    return out


_WHATIF_COLUMNS = ["ttl_s", "later_turns", "hits", "held_token_s", "held_gib_s", "turns_without_kv_bytes"]


_RUN_CONFIG = """
SELECT c.*, r.mode, coalesce(r.label, r.run_id) AS run_label, r.workload, r.history_mode
FROM run_config c JOIN runs r USING (run_id)
WHERE list_contains($run_ids::VARCHAR[], c.run_id)
ORDER BY c.run_id
"""


def run_config(con: duckdb.DuckDBPyConnection, f: TurnFilter | Sequence[str]) -> pd.DataFrame:
    """Per-run settings (view ``run_config``) for the runs of `f`.

    Columns: run_id, decoder_kv_blocks_ttl_s (s), handle_ttl_margin_s (s), kv_bytes_per_token
    (bytes, NULL when unknown), mode, run_label, workload, history_mode.
    """
    return con.execute(_RUN_CONFIG, {"run_ids": _ids(as_filter(f).run_ids)}).df()


# --- Compare ------------------------------------------------------------------------------------

# Favourable: a continuation (kind 'turn') within the proxy's TTL (decoder_kv_blocks_ttl minus the
# margin), the case reuse is made for. Everything else after the first turn is unfavourable, by
# case: a turn continued after the TTL, or its kind.
_COMPARE_BASE = """
WITH k AS (
    SELECT CASE WHEN list_contains($a::VARCHAR[], t.run_id) THEN 'A' ELSE 'B' END AS side,
           t.run_id, t.session_id, t.turn_index, t.kind, t.ttft_s,
           coalesce(t.kind = 'turn' AND t.gap_before_s < c.decoder_kv_blocks_ttl_s - c.handle_ttl_margin_s, false)
               AS favourable
    FROM turn_rows t JOIN run_config c USING (run_id)
    WHERE (list_contains($a::VARCHAR[], t.run_id) OR list_contains($b::VARCHAR[], t.run_id))
      AND {where} AND t.status = 'ok' AND t.ttft_s IS NOT NULL
), base AS (
    SELECT k.*,
           CASE WHEN favourable THEN 'continued within TTL'
                WHEN kind = 'turn' THEN 'continued after TTL'
                ELSE coalesce(kind, 'unknown') END AS case_name
    FROM k
)
"""

_COMPARE_SAMPLES = _COMPARE_BASE + """
, n AS (SELECT side, count(*) AS side_turns FROM base GROUP BY side)
SELECT b.side, b.run_id, b.session_id, b.turn_index, b.kind, b.ttft_s, b.favourable, b.case_name
FROM base b JOIN n USING (side)
WHERE $max_turns::BIGINT IS NULL OR n.side_turns <= $max_turns::BIGINT
   OR hash(b.run_id, b.session_id) % 1000000 < 1000000.0 * $max_turns::BIGINT / n.side_turns
ORDER BY b.side, b.run_id, b.session_id, b.turn_index
"""

_COMPARE_STATS = _COMPARE_BASE + """
, later AS (
    SELECT side, run_id, session_id, ttft_s, case_name,
           CASE WHEN favourable THEN 'favourable' ELSE 'unfavourable' END AS fav
    FROM base WHERE turn_index >= $min_turn_index
), per_session AS (  -- sessions per (side, fav) and per side: count(DISTINCT) is slow, two levels are not
    SELECT side, fav, run_id, session_id FROM later GROUP BY ALL
), session_counts AS (
    SELECT side, fav AS key, count(*) AS sessions FROM per_session GROUP BY ALL
    UNION ALL
    SELECT side, 'all', count(*) FROM (SELECT DISTINCT side, run_id, session_id FROM per_session) GROUP BY side
)
SELECT side, 'turn_index' AS scope, CAST(turn_index AS VARCHAR) AS key,
       count(*) AS turns, 0 AS sessions, quantile_cont(ttft_s, 0.5) AS ttft_p50_s
FROM base GROUP BY side, turn_index
UNION ALL
SELECT side, 'case', case_name, count(*), 0, quantile_cont(ttft_s, 0.5) FROM later GROUP BY side, case_name
UNION ALL
SELECT l.side, 'later', l.key, l.turns, s.sessions, l.ttft_p50_s
FROM (SELECT side, fav AS key, count(*) AS turns, quantile_cont(ttft_s, 0.5) AS ttft_p50_s FROM later GROUP BY ALL
      UNION ALL
      SELECT side, 'all', count(*), quantile_cont(ttft_s, 0.5) FROM later GROUP BY side) l
JOIN session_counts s USING (side, key)
ORDER BY side, scope, key
"""


def _compare_where(f: TurnFilter | None) -> str:
    """`f`'s archetype and kind filters over ``turn_rows t`` (its run ids are replaced by
    the two sides')."""
    w = _where(TurnFilter((), *(((f.archetypes, f.kinds, f.gap_kinds)) if f else ((), (), ()))), "t")
    return w.replace("list_contains($run_ids::VARCHAR[], t.run_id)", "true")


def _compare_params(a_run_ids: Sequence[str], b_run_ids: Sequence[str], f: TurnFilter | None) -> dict:
    params = {**(f or TurnFilter(())).params(), "a": _ids(a_run_ids), "b": _ids(b_run_ids)}
    params.pop("run_ids")
    return params


def compare_samples(
    con: duckdb.DuckDBPyConnection,
    a_run_ids: Sequence[str],
    b_run_ids: Sequence[str],
    f: TurnFilter | None = None,
    max_turns: int | None = None,
) -> pd.DataFrame:
    """TTFT of the ok turns of side A (`a_run_ids`, the treatment) and side B (the baseline).

    `f`'s archetype, kind and gap-kind filters apply (its run ids do not). A run in both lists
    counts as A. With `max_turns`, a side of more turns is sampled by whole sessions (hash of run
    and session id) to about that many: the bootstraps' input; exact medians come from
    `compare_stats`. Columns: side (``A`` | ``B``), run_id, session_id, turn_index, kind,
    ttft_s (seconds), favourable (a ``turn`` continued within the run's proxy TTL: gap_before_s <
    decoder_kv_blocks_ttl - handle margin), case_name (``continued within TTL``, ``continued
    after TTL`` or the turn's kind). One row per turn kept.
    """
    params = _compare_params(a_run_ids, b_run_ids, f) | {"max_turns": None if max_turns is None else int(max_turns)}
    return _run(con, _COMPARE_SAMPLES.format(where=_compare_where(f)), params)


def compare_stats(
    con: duckdb.DuckDBPyConnection,
    a_run_ids: Sequence[str],
    b_run_ids: Sequence[str],
    f: TurnFilter | None = None,
    min_turn_index: int = 1,
) -> pd.DataFrame:
    """Exact counts and median TTFT of each side's ok turns (same rows as `compare_samples`
    without sampling), in three scopes:

    ``turn_index`` (key: the index, every turn), ``case`` (key: case name, turn_index >=
    `min_turn_index`), ``later`` (key: ``all``, ``favourable`` or ``unfavourable``, turn_index
    >= `min_turn_index`). Columns: side, scope, key (str), turns, sessions (distinct run and
    session; counted for scope ``later`` only, 0 otherwise), ttft_p50_s (seconds).
    """
    params = _compare_params(a_run_ids, b_run_ids, f) | {"min_turn_index": int(min_turn_index)}
    return _run(con, _COMPARE_STATS.format(where=_compare_where(f)), params)


# --- Sweep (turnscope sweep) ------------------------------------------------------------------------

_SWEEP_POINTS = """
SELECT run_id, label, mode, history_mode, status, started_at, finished_at, sweep_id, sweep_name,
       swept_field, sweep_scale, prefix_tokens, point_index, sessions, users
FROM sweep_points
WHERE list_contains($run_ids::VARCHAR[], run_id)
ORDER BY started_at DESC NULLS LAST, sweep_id, history_mode, prefix_tokens, mode
"""


def sweep_points(con: duckdb.DuckDBPyConnection, run_ids: Sequence[str]) -> pd.DataFrame:
    """The runs among `run_ids` that are points of a prefix sweep (view ``sweep_points``).

    Columns: run_id, label, mode, history_mode, status, started_at, finished_at (UTC), sweep_id,
    sweep_name, swept_field, sweep_scale, prefix_tokens (tokens), point_index, sessions, users.
    One row per run, newest first.
    """
    return _run(con, _SWEEP_POINTS, {"run_ids": _ids(run_ids)})


_SWEEP_TURNS = """
SELECT p.sweep_id, p.history_mode, p.prefix_tokens, t.run_id, t.mode, t.session_id, t.turn_index,
       t.status, t.ttft_s, t.prompt_tokens, t.expected_reusable_tokens, t.reuse, t.reused_tokens,
       t.prefill_cached_tokens
FROM sweep_points p JOIN turn_rows t ON t.run_id = p.run_id
WHERE {where} AND p.sweep_id = $sweep_id
ORDER BY p.history_mode, p.prefix_tokens, t.mode, t.run_id, t.session_id, t.turn_index
"""


def sweep_turns(con: duckdb.DuckDBPyConnection, f: TurnFilter | Sequence[str], sweep_id: str) -> pd.DataFrame:
    """Every turn (any status) of sweep `sweep_id` among the runs of `f` (its turn filters apply).

    Columns: sweep_id, history_mode, prefix_tokens (the point, tokens), run_id, mode, session_id,
    turn_index, status, ttft_s (seconds), prompt_tokens, expected_reusable_tokens, reuse,
    reused_tokens, prefill_cached_tokens (tokens). One row per turn.
    """
    ff = as_filter(f)
    return _run(con, _SWEEP_TURNS.format(where=_where(ff, "t")), ff.params() | {"sweep_id": str(sweep_id)})


_SWEEP_TRANSFER = """
WITH ext AS (
    SELECT run_id, sum(increase) AS external_kv_tokens
    FROM metric_increases
    WHERE list_contains($run_ids::VARCHAR[], run_id) AND role = 'prefill' AND name = $name
      AND json_extract_string(labels, '$.source') = $source
    GROUP BY run_id
)
SELECT p.sweep_id, p.history_mode, p.prefix_tokens, p.mode, p.run_id,
       k.xfer_s, k.xfers, k.xfer_bytes, k.xfer_bytes_per_s, k.reused_tokens,
       c.kv_bytes_per_token, coalesce(ext.external_kv_tokens, 0) AS external_kv_tokens
FROM sweep_points p
LEFT JOIN run_kv_transfer k USING (run_id) LEFT JOIN run_config c USING (run_id) LEFT JOIN ext USING (run_id)
WHERE list_contains($run_ids::VARCHAR[], p.run_id) AND p.sweep_id = $sweep_id
ORDER BY p.history_mode, p.prefix_tokens, p.mode, p.run_id
"""


def sweep_transfer(con: duckdb.DuckDBPyConnection, run_ids: Sequence[str], sweep_id: str) -> pd.DataFrame:
    """Per run of sweep `sweep_id` among `run_ids`: the prefill workers' measured NIXL transfers
    (``run_kv_transfer``: xfer_s seconds, xfers, xfer_bytes bytes, xfer_bytes_per_s bytes/s,
    reused_tokens tokens the proxy saw pulled), the model's kv_bytes_per_token (``run_config``)
    and external_kv_tokens: how much P's ``vllm:prompt_tokens_by_source_total{source=
    "external_kv_transfer"}`` rose (tokens vLLM says it pulled). Columns: sweep_id, history_mode,
    prefix_tokens, mode, run_id and those. One row per run.
    """
    params = {"run_ids": _ids(run_ids), "sweep_id": str(sweep_id), "name": PROMPT_TOKENS_BY_SOURCE,
              "source": EXTERNAL_KV_SOURCE}
    return _run(con, _SWEEP_TRANSFER, params)
