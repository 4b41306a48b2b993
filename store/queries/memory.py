"""The Memory page's queries: KV usage and handle bytes over time, the hit rate, what reuse
costs in held memory, and what other decoder_kv_blocks_ttl values would have given.
"""

from __future__ import annotations

from collections.abc import Sequence

import duckdb
import pandas as pd

from core import reuse_rules as rules
from core.contract import Role
from store import hit_rate
from store.queries.common import (
    HANDLE_BYTES,
    KV_USAGE,
    TurnFilter,
    as_filter,
    id_list,
    run_sql,
    where_sql,
)
from store.queries.worker_cache import cache_config

#: The TTLs (seconds) the Memory page replays besides the runs' own, and that a run's rollup
#: (:mod:`store.rollup`) precomputes: around vLLM's 480 s default (``decoder_kv_blocks_ttl``,
#: vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py) up to an hour; at or below the
#: proxy's 30 s margin nothing could ever hit.
WHATIF_TTLS_S: tuple[float, ...] = (60.0, 120.0, 240.0, 480.0, 900.0, 1800.0, 3600.0)
#: The rolled-up what-if (no plain view computes it: it is a replay in Python,
#: ``planner.recorded_whatif``; ``store.rollup`` writes it) and the TEMP view naming the runs it covers.
WHATIF_RELATION = "run_whatif_d_limit"
ROLLED_UP_RUNS = "rolled_up_runs"

# Seconds between two instants are (epoch_us(a) - epoch_us(b)) / 1e6: the same figure as
# epoch(a - b), without TIMESTAMPTZ arithmetic, which costs ~0.4 s per million rows (time zone
# rules) where this costs ~0.01 s.
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
           floor((epoch_us(s.scraped_at) - epoch_us(w.t0)) / 1e6 / w.bucket_s) * w.bucket_s AS elapsed_s,
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
        "run_ids": id_list(as_filter(f).run_ids),
        "kv_usage": KV_USAGE,
        "handle_bytes": HANDLE_BYTES,
        "buckets": max(int(buckets), 1),
        "min_bucket_s": float(min_bucket_s),
    }
    return run_sql(con, _MEMORY_TIMELINE, params)


# The selected runs' turns are read once (MATERIALIZED): all of them for each run's span, the
# filtered later turns for the buckets.
_HIT_RATE_TIMELINE = """
WITH b AS MATERIALIZED (
    SELECT run_id, session_id, kind, gap_kind, turn_index, reuse, sent_at
    FROM turns
    WHERE list_contains($run_ids::VARCHAR[], run_id)
), span AS (
    SELECT b.run_id, coalesce(any_value(r.started_at), min(b.sent_at)) AS t0, max(b.sent_at) AS t1
    FROM b JOIN runs r USING (run_id)
    GROUP BY b.run_id
), w AS (
    SELECT run_id, t0, greatest(epoch(t1 - t0) / $buckets, $min_bucket_s) AS bucket_s FROM span
)
SELECT b.run_id, coalesce(any_value(r.label), b.run_id) AS run_label, any_value(r.mode) AS mode,
       floor((epoch_us(b.sent_at) - epoch_us(w.t0)) / 1e6 / w.bucket_s) * w.bucket_s AS elapsed_s, any_value(w.bucket_s) AS bucket_s,
       {counts}
FROM b JOIN w USING (run_id) JOIN runs r USING (run_id)
WHERE {where_b} AND {later} AND b.sent_at IS NOT NULL
GROUP BY b.run_id, floor((epoch_us(b.sent_at) - epoch_us(w.t0)) / 1e6 / w.bucket_s) * w.bucket_s
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
    sql = _HIT_RATE_TIMELINE.format(where_b=where_sql(as_filter(f), "b"), counts=hit_rate.counts_sql("b"),
                                    later=hit_rate.later_turn_sql("b"))
    df = run_sql(con, sql, params).rename(columns={hit_rate.HITS: "hits"})
    return df.assign(hit_rate=hit_rate.rate(df["hits"], df["later_turns"]))


# Handle bytes held: each of the run's handles from its turn's end to its pull or D's expiry
# (view run_handle_memory), also past the run's end and never another run's; for runs recorded
# without turns.handle_tokens, the step integral of the proxy's gauge over the run's scrapes (each
# scrape's value held until the next one; it counts whatever the proxy held, other runs' too). Prefill seconds saved: tokens pulled from D x the run's compute
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
), gauge AS (
    SELECT run_id, sum(byte_s) AS held_byte_s, max(bytes) AS peak_bytes FROM steps GROUP BY run_id
), held AS (  -- each handle to its pull or expiry (run_handle_memory); the gauge for older runs
    SELECT coalesce(m.run_id, g.run_id) AS run_id,
           CASE WHEN m.handles > 0 THEN m.held_gib_s ELSE g.held_byte_s / 1073741824.0 END AS held_gib_s,
           CASE WHEN m.handles > 0 THEN 'handles' WHEN g.run_id IS NOT NULL THEN 'gauge' END AS held_source,
           g.peak_bytes
    FROM (SELECT * FROM run_handle_memory WHERE list_contains($run_ids::VARCHAR[], run_id)) m
    FULL JOIN gauge g USING (run_id)
), tk AS (
    SELECT run_id,
           count(*) FILTER (WHERE {hit})                                AS hits,
           {later_counts},
           sum(reused_tokens)                                           AS reused_tokens,
           sum(prefill_leg_s) FILTER (WHERE coalesce(reused_tokens, 0) = 0 AND recomputed_tokens > 0
                                      AND prefill_leg_s IS NOT NULL)    AS compute_s,
           sum(recomputed_tokens) FILTER (WHERE coalesce(reused_tokens, 0) = 0 AND recomputed_tokens > 0
                                          AND prefill_leg_s IS NOT NULL) AS compute_tokens
    FROM turns
    WHERE list_contains($run_ids::VARCHAR[], run_id) AND status = 'ok'
    GROUP BY run_id
), j AS (
    SELECT r.run_id, coalesce(r.label, r.run_id) AS run_label, r.mode, r.history_mode,
           held.held_gib_s, held.held_source, held.peak_bytes,
           tk.hits, tk.later_turns, tk.reused_tokens,
           tk.compute_s / nullif(tk.compute_tokens, 0) AS prefill_s_per_token,
           k.xfer_s, pc.prefix_cache_hit_rate
    FROM runs r
    LEFT JOIN held USING (run_id) LEFT JOIN tk USING (run_id) LEFT JOIN run_kv_transfer k USING (run_id)
    LEFT JOIN (SELECT run_id, sum(hit_tokens) / nullif(sum(queried_tokens), 0) AS prefix_cache_hit_rate
               FROM run_prefix_cache GROUP BY run_id) pc USING (run_id)
    WHERE list_contains($run_ids::VARCHAR[], r.run_id) AND (held.held_source IS NOT NULL OR tk.reused_tokens > 0)
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
    do not apply). held_gib_s (GiB x s): ``run_handle_memory.held_gib_s`` (each handle of the run to
    its pull or expiry) with held_source ``handles``; for runs without ``turns.handle_tokens``, the
    step integral of ``turnscope_handle_bytes_live`` over the scrapes, held_source ``gauge``;
    peak_bytes: the gauge's peak during the run; prefill_s_per_token: sum of prefill legs / sum of recomputed tokens over the ok
    turns that pulled nothing (s/token); saved_s (estimate) = reused_tokens x prefill_s_per_token
    - xfer_s (the run's measured NIXL time, ``run_kv_transfer``); gib_s_per_saved_s =
    held_gib_s / saved_s, NULL when nothing was saved.
    prefix_cache_hit_rate: P's own prefix cache over the run (view ``run_prefix_cache``, 0..1; NULL
    where not scraped), beside the pulls: what P would have found without D.
    Columns: run_id, run_label, mode, history_mode, held_gib_s, held_source, peak_bytes, hits, later_turns, reused_tokens,
    prefill_s_per_token, xfer_s, prefix_cache_hit_rate, saved_s, gib_s_per_saved_s.
    """
    params = {"run_ids": id_list(as_filter(f).run_ids), "handle_bytes": HANDLE_BYTES}
    sql = _REUSE_COST.replace("{later_counts}", hit_rate.counts_sql()).replace("{hit}", hit_rate.hit_sql())
    return run_sql(con, sql, params)



_NIXL_FAILURES = """
SELECT n.run_id, coalesce(r.label, n.run_id) AS run_label, r.mode, n.expired_turns, n.transfer_failed_turns,
       n.p_kv_expired_reqs, n.p_failed_transfers, n.p_failed_notifications,
       n.d_kv_expired_reqs, n.d_failed_transfers, n.d_failed_notifications,
       n.p_notifications_after_expiry, n.d_notifications_after_expiry
FROM run_nixl_failures n JOIN runs r USING (run_id)
WHERE list_contains($run_ids::VARCHAR[], n.run_id)
ORDER BY n.run_id
"""


def nixl_failures(con: duckdb.DuckDBPyConnection, f: TurnFilter | Sequence[str]) -> pd.DataFrame:
    """Pulls that did not happen per run (view ``run_nixl_failures``; whole runs: turn filters do
    not apply): the proxy's turns ``miss_expired`` (its margin kept the handle back) and
    ``miss_transfer_failed`` (offered, not pulled) beside vLLM's NIXL counters' increases on P and
    D, in requests (``*_kv_expired_reqs``) and failures (``*_failed_transfers``,
    ``*_failed_notifications``, already inside the failed transfers) and late notifications
    (``*_notifications_after_expiry``: one per remote rank, not per request; blocks possibly reused
    before a transfer ended); NaN where the role was not scraped or does not export them.
    Columns: run_id, run_label, mode, expired_turns, transfer_failed_turns, p_kv_expired_reqs,
    p_failed_transfers, p_failed_notifications, d_kv_expired_reqs, d_failed_transfers,
    d_failed_notifications, p_notifications_after_expiry, d_notifications_after_expiry.
    """
    return run_sql(con, _NIXL_FAILURES, {"run_ids": id_list(as_filter(f).run_ids)})


# The unlimited replay in SQL: the second route that checks whatif_ttl_d_limit (the page's) when D's
# space does not bind, and the one that follows the turn filters.
# Per turn (all turns of the selected runs, so each turn's successor is known before filtering):
# the KV D would hold after it (an ok turn's remote_num_tokens: prompt + output - 1) until the session's next turn
# frees it (the gap to that turn, when that turn takes the handle at this TTL and pulls it or, recorded
# below the recompute threshold, tells D it needs none of it: core.reuse_rules.d_frees_taken_handle,
# the rule of view handle_holds), else for the whole TTL (vLLM pins a handle until then). A later
# turn hits when it is not `fresh`, its recorded outcome was a hit or a miss by expiry (other misses
# do not depend on the TTL), and its gap is below TTL - the proxy's margin; it frees the previous
# handle under the same gap condition when it hits or was recorded below the threshold.
# Exact, in one pass: with the TTLs sorted T_0 < ... < T_k-1, each turn falls in the bin of the
# first TTL above what its successor needs to free its handle (bin_next) and above what it needs
# itself to hit (bin_hit); then, for T_j,
# held = sum(h x next gap) over bins <= j + T_j x sum(h) over bins > j, and hits = turns in bins
# <= j. The per-turn work is two comparisons chains and one small group-by, whatever the number
# of TTLs.
_WHATIF_TTL = """
WITH t AS (
    SELECT t.run_id, t.session_id, t.turn_index, t.kind, t.gap_kind, t.gap_before_s,
           -- D's remote_num_tokens: prompt + output - 1 (core.reuse_rules.handle_kv_tokens)
           CASE WHEN t.status <> 'ok' THEN 0
                WHEN coalesce(t.completion_tokens, 0) > 0 THEN coalesce(t.prompt_tokens, 0) + t.completion_tokens - 1
                ELSE coalesce(t.prompt_tokens, 0) END::DOUBLE AS held_tokens,
           -- the TTL this turn needs to pull the previous turn's handle; NULL where no TTL can make
           -- it (turn 0, `fresh`, or a recorded miss that does not depend on the TTL: mismatch,
           -- below threshold, failed transfer, no handle)
           CASE WHEN t.turn_index >= 1 AND t.kind IS DISTINCT FROM 'fresh'
                     AND (t.reuse IS NULL OR t.reuse IN ('hit', 'miss_expired'))
                THEN t.gap_before_s + c.handle_ttl_margin_s END AS needs_ttl_s,
           -- the TTL above which this turn frees the previous turn's handle: it hits then, or it
           -- was recorded among the outcomes after which D frees a handle it was given
           CASE WHEN t.turn_index >= 1 AND t.kind IS DISTINCT FROM 'fresh'
                     AND (t.reuse IS NULL OR t.reuse IN ('hit', 'miss_expired') OR t.reuse IN ({frees_outcomes}))
                THEN t.gap_before_s + c.handle_ttl_margin_s END AS frees_ttl_s,
           c.kv_bytes_per_token
    FROM turns t JOIN run_config c USING (run_id)
    WHERE {where_sessions}  -- whole sessions, before the window reads them
), w AS (
    SELECT *,
           lead(gap_before_s) OVER (PARTITION BY hash(run_id, session_id) ORDER BY turn_index) AS next_gap_s,
           lead(frees_ttl_s) OVER (PARTITION BY hash(run_id, session_id) ORDER BY turn_index) AS next_frees_ttl_s
    FROM t
), x AS (
    SELECT w.run_id, w.turn_index, w.held_tokens, w.next_gap_s, w.next_frees_ttl_s, w.kv_bytes_per_token,
           w.needs_ttl_s
    FROM w
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
    not ``fresh``, recorded ``hit`` or ``miss_expired``) hits when its gap_before_s < TTL - the
    run's handle margin (``run_config``); a recorded miss of another kind (mismatch, below
    threshold, failed transfer, no handle) stays a miss at every TTL. After each ok turn D holds
    its prompt + output - 1 tokens (``remote_num_tokens``, :func:`core.reuse_rules.handle_kv_tokens`;
    not rounded to blocks, no limit on D's space) until the session's next turn frees them (the gap to it,
    when that turn's gap is below TTL - margin and it hits or was recorded ``miss_below_threshold``:
    :func:`core.reuse_rules.d_frees_taken_handle`), else for the whole TTL (the rule of the
    ``handle_holds`` view, so at a run's own TTL the held GiB·s is close to
    ``run_handle_memory.held_gib_s``). Columns: ttl_s, later_turns, hits, held_token_s (tokens x s),
    held_gib_s (GiB x s, using runs.config kv_bytes_per_token; NULL parts skipped),
    turns_without_kv_bytes (ok turns of runs with no kv_bytes_per_token). One row per TTL.
    """
    ff = as_filter(f)
    ttls = sorted({float(t) for t in ttls_s})
    if not ttls:
        return pd.DataFrame(columns=_WHATIF_COLUMNS)
    # The TTLs are floats formatted here (repr), never text from outside.
    where_sessions = where_sql(TurnFilter(ff.run_ids, ff.archetypes))
    where_turns = where_sql(TurnFilter((), (), ff.kinds, ff.gap_kinds), "w").replace(
        "list_contains($run_ids::VARCHAR[], w.run_id)", "true"
    )
    sql = _WHATIF_TTL.format(
        where_sessions=where_sessions,
        where_turns=where_turns,
        bin_next=_bin("next_frees_ttl_s", ttls),
        frees_outcomes=", ".join(f"'{o}'" for o in rules.D_FREES_TAKEN_HANDLE),
        bin_hit=_bin("needs_ttl_s", ttls),
        totals=",\n       ".join(_WHATIF_TOTALS.format(i=i, ttl=repr(t)) for i, t in enumerate(ttls)),
    )
    wide = run_sql(con, sql, ff.params()).iloc[0]
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
    return con.execute(_RUN_CONFIG, {"run_ids": id_list(as_filter(f).run_ids)}).df()


def _int_label(labels: dict, key: str) -> int | None:
    try:
        return int(labels[key])
    except (KeyError, TypeError, ValueError):
        return None


def decode_kv_space(con: duckdb.DuckDBPyConnection, run_ids: Sequence[str]) -> pd.DataFrame:
    """D's KV space per run from :func:`cache_config` on the ``decode`` role: block_size (tokens),
    decode_workers (endpoints that reported), kv_space_tokens (``num_gpu_blocks x block_size``
    summed over those workers). Runs without the gauge on D are absent."""
    cc = cache_config(con, run_ids)
    rows = []
    for run_id, g in cc[cc["role"] == Role.DECODE].groupby("run_id", sort=True):
        sizes = [(_int_label(lab, "block_size"), _int_label(lab, "num_gpu_blocks")) for lab in g["labels"]]
        sizes = [(b, n) for b, n in sizes if b and n]
        if sizes:
            rows.append({"run_id": run_id, "block_size": sizes[0][0], "decode_workers": len(sizes),
                         "kv_space_tokens": sum(b * n for b, n in sizes)})
    return pd.DataFrame(rows, columns=["run_id", "block_size", "decode_workers", "kv_space_tokens"])


_WHATIF_TURNS = """
SELECT t.run_id, t.session_id, t.turn_index, t.kind, t.status, epoch(t.sent_at) AS sent_s, t.e2e_s,
       t.prompt_tokens, t.completion_tokens, t.reuse
FROM turns t
WHERE list_contains($run_ids::VARCHAR[], t.run_id) AND t.sent_at IS NOT NULL
"""


def whatif_turns(con: duckdb.DuckDBPyConnection, run_ids: Sequence[str]) -> pd.DataFrame:
    """The turns the TTL what-if replays (``planner.ttl_whatif.TURN_COLUMNS`` with run_id; sent_s
    in epoch seconds), of `run_ids`, whole runs, unordered."""
    return con.execute(_WHATIF_TURNS, {"run_ids": id_list(run_ids)}).df()


def rolled_up_runs(con: duckdb.DuckDBPyConnection) -> set[str]:
    """The runs whose rollup `con` reads (:meth:`store.rollup.Rollups.install`'s TEMP view
    ``rolled_up_runs``); none where `con` has no rollups installed."""
    installed = con.execute(
        "SELECT count(*) FROM duckdb_views() WHERE temporary AND view_name = $name", {"name": ROLLED_UP_RUNS}
    ).fetchone()[0]
    if not installed:
        return set()
    return {r for (r,) in con.execute(f"SELECT run_id FROM {ROLLED_UP_RUNS}").fetchall()}


def rolled_whatif(con: duckdb.DuckDBPyConnection, run_ids: Sequence[str], ttls: Sequence[float]) -> pd.DataFrame:
    """The rolled-up what-if rows (:data:`WHATIF_RELATION`) of `run_ids` at `ttls` (seconds)."""
    return con.execute(
        f"SELECT * FROM {WHATIF_RELATION} WHERE list_contains($run_ids::VARCHAR[], run_id)"
        " AND list_contains($ttls::DOUBLE[], ttl_s)",
        {"run_ids": id_list(sorted(run_ids)), "ttls": [float(t) for t in ttls]},
    ).df()
