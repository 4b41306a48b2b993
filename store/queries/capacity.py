"""SQL for the capacity ramp (``turnscope capacity``): one row per load step and mode.

Read by the Memory page's capacity section and the CLI's summary. Every statistic is DuckDB's
(``quantile_cont``: linear interpolation between order statistics, the same as numpy's default).
"""

from __future__ import annotations

from collections.abc import Sequence

import duckdb
import pandas as pd

from store import hit_rate
from store.writer import Store

#: Prometheus series each step reads from ``metric_samples`` (names as the scraper stores them).
DECODE_KV_USAGE = "vllm:kv_cache_usage_perc"        # fraction 0-1 of the engine's KV blocks in use
REQUESTS_WAITING = "vllm:num_requests_waiting"
PREEMPTIONS = "vllm:num_preemptions_total"           # vLLM's Counter vllm:num_preemptions, as exposed
HANDLE_BYTES = "turnscope_handle_bytes_live"        # the proxy's live handle KV (bytes)

_STEPS_SQL = f"""
WITH s AS (
    SELECT * FROM capacity_steps WHERE run_id IN (SELECT unnest($ids))
), t AS (
    SELECT t.run_id,
           count(*)                                                   AS turns,
           count(*) FILTER (WHERE t.status = 'ok')                    AS ok_turns,
           count(*) FILTER (WHERE t.status = 'ok' AND t.ttft_s <= s.slo_ttft_s
                                  AND (t.tpot_s IS NULL OR t.tpot_s <= s.slo_tpot_s)) AS slo_turns,
           quantile_cont(t.ttft_s, 0.5) FILTER (WHERE t.status = 'ok') AS ttft_p50_s,
           quantile_cont(t.ttft_s, 0.9) FILTER (WHERE t.status = 'ok') AS ttft_p90_s,
           list(t.ttft_s ORDER BY t.sent_at) FILTER (WHERE t.status = 'ok') AS ttft_ok_s,
           quantile_cont(t.e2e_s, 0.5) FILTER (WHERE t.status = 'ok')  AS e2e_p50_s,
           quantile_cont(t.e2e_s, 0.9) FILTER (WHERE t.status = 'ok')  AS e2e_p90_s,
           count(*) FILTER (WHERE {hit_rate.hit_sql('t')})             AS hits,
           epoch(max(t.sent_at + to_microseconds(CAST(round(coalesce(t.e2e_s, 0) * 1e6) AS BIGINT))))
               - epoch(min(t.sent_at))                                AS span_s
    FROM turns t JOIN s USING (run_id)
    GROUP BY t.run_id
), per_scrape AS (
    -- one value per scrape: KV usage of the fullest decode engine, waiting requests and handle
    -- bytes summed over engines/endpoints
    SELECT run_id, scraped_at,
           max(value) FILTER (WHERE role = 'decode' AND name = '{DECODE_KV_USAGE}')   AS decode_kv_usage,
           sum(value) FILTER (WHERE role = 'decode' AND name = '{REQUESTS_WAITING}')  AS decode_waiting,
           sum(value) FILTER (WHERE role = 'prefill' AND name = '{REQUESTS_WAITING}') AS prefill_waiting,
           sum(value) FILTER (WHERE role = 'proxy' AND name = '{HANDLE_BYTES}')       AS handle_bytes
    FROM metric_samples
    WHERE run_id IN (SELECT unnest($ids))
      AND name IN ('{DECODE_KV_USAGE}', '{REQUESTS_WAITING}', '{HANDLE_BYTES}')
    GROUP BY ALL
), m AS (
    SELECT run_id,
           arg_min(decode_kv_usage, scraped_at) FILTER (WHERE decode_kv_usage IS NOT NULL) AS decode_kv_usage_start,
           avg(decode_kv_usage)   AS decode_kv_usage_mean,
           max(decode_kv_usage)   AS decode_kv_usage_max,
           max(decode_waiting)    AS decode_waiting_max,
           avg(decode_waiting)    AS decode_waiting_mean,
           max(prefill_waiting)   AS prefill_waiting_max,
           avg(handle_bytes)      AS handle_bytes_mean,
           max(handle_bytes)      AS handle_bytes_max
    FROM per_scrape GROUP BY run_id
), p AS (
    SELECT run_id,
           sum(increase) FILTER (WHERE role = 'decode')  AS decode_preemptions,
           sum(increase) FILTER (WHERE role = 'prefill') AS prefill_preemptions
    FROM metric_increases
    WHERE run_id IN (SELECT unnest($ids)) AND name = '{PREEMPTIONS}'
    GROUP BY run_id
), pc AS (
    SELECT run_id, prefill_kv_cache_bytes, aggregated_kv_cache_bytes, queried_tokens AS p_queried_tokens,
           hit_tokens AS p_hit_tokens, hit_rate AS p_hit_rate, pulled_tokens, proxy_pulled_tokens
    FROM capacity_prefill_cache WHERE run_id IN (SELECT unnest($ids))
)
SELECT s.capacity_id, s.capacity_workload, s.mode, s.history_mode, s.step_index, s.users, s.sessions,
       s.run_id, s.status, s.decode_kv_cache_bytes, s.decoder_kv_blocks_ttl_s, s.slo_ttft_s, s.slo_tpot_s,
       coalesce(t.turns, 0) AS turns, coalesce(t.ok_turns, 0) AS ok_turns, coalesce(t.slo_turns, 0) AS slo_turns,
       t.hits, t.span_s,
       CASE WHEN t.span_s > 0 THEN t.slo_turns / t.span_s END AS goodput_per_s,
       CASE WHEN t.span_s > 0 THEN t.ok_turns / t.span_s END  AS throughput_per_s,
       CASE WHEN t.turns > 0 THEN t.slo_turns / t.turns END   AS slo_attainment,
       t.ttft_p50_s, t.ttft_p90_s, t.e2e_p50_s, t.e2e_p90_s, t.ttft_ok_s,
       m.decode_kv_usage_start, m.decode_kv_usage_mean, m.decode_kv_usage_max,
       m.decode_waiting_max, m.decode_waiting_mean, m.prefill_waiting_max,
       m.handle_bytes_mean, m.handle_bytes_max,
       p.decode_preemptions, p.prefill_preemptions,
       pc.prefill_kv_cache_bytes, pc.aggregated_kv_cache_bytes, pc.p_queried_tokens, pc.p_hit_tokens,
       pc.p_hit_rate, pc.pulled_tokens, pc.proxy_pulled_tokens
FROM s LEFT JOIN t USING (run_id) LEFT JOIN m USING (run_id) LEFT JOIN p USING (run_id) LEFT JOIN pc USING (run_id)
ORDER BY s.capacity_id DESC, s.mode, s.users
"""


def capacity_run_ids(con: duckdb.DuckDBPyConnection, run_ids: Sequence[str]) -> pd.DataFrame:
    """The runs of ``run_ids`` that are steps of a capacity ramp (column run_id): the ``capacity_steps``
    view alone, which reads the runs' rows only, so a page asks `capacity_steps` (turns, scrapes and
    counter increases) only for these. One row per run."""
    return con.execute("SELECT run_id FROM capacity_steps WHERE run_id IN (SELECT unnest($ids)) ORDER BY run_id",
                       {"ids": list(run_ids)}).df()


def capacity_steps(con: duckdb.DuckDBPyConnection, run_ids: Sequence[str]) -> pd.DataFrame:
    """Per load step and mode of the capacity ramps among ``run_ids``: one row per run.

    Columns: the ``capacity_steps`` view's (``capacity_id``, ``mode``, ``users``, ``sessions``,
    ``slo_ttft_s``, ``slo_tpot_s``, ...), then over the run's turns: ``turns``, ``ok_turns``,
    ``slo_turns`` (ok, TTFT <= the SLO's bound and TPOT <= its bound or no TPOT), ``hits``,
    ``span_s`` (first turn sent -> last turn finished, seconds), ``goodput_per_s`` (slo_turns /
    span_s, turns/s; DistServe, Zhong et al. OSDI'24), ``throughput_per_s`` (ok turns/s),
    ``slo_attainment`` (slo_turns / turns), ``ttft_p50_s``/``ttft_p90_s``/``e2e_p50_s``/
    ``e2e_p90_s`` (ok turns, seconds), ``ttft_ok_s`` (the ok turns' TTFTs in the order sent, seconds:
    a list; the crossing's noise check, ``analysis.capacity_crossing.p90_ratio_interval``); over its scrapes (one value per scrape, then over time):
    ``decode_kv_usage_start``/``_mean``/``_max`` (fraction 0-1 of D's KV blocks in use, the
    fullest D engine), ``decode_waiting_max``/``_mean`` and ``prefill_waiting_max`` (requests
    waiting, summed over engines), ``handle_bytes_mean``/``_max`` (the proxy's live handle bytes);
    ``decode_preemptions``/``prefill_preemptions`` (increase of ``vllm:num_preemptions_total``
    over the run); from the ``capacity_prefill_cache`` view: ``prefill_kv_cache_bytes`` and
    ``aggregated_kv_cache_bytes`` (bytes; NULL where the ramp left them the topology's),
    ``p_queried_tokens``/``p_hit_tokens``/``p_hit_rate`` (the computing worker's own prefix cache:
    vLLM's ``prefix_cache_queries``/``prefix_cache_hits`` increases, tokens, and their ratio 0-1)
    and ``pulled_tokens`` (tokens P pulled from D, vLLM's ``external_kv_transfer`` count; NULL where
    not scraped) next to ``proxy_pulled_tokens`` (the proxy's per-turn split, an estimate). NULL where a run has no turns or no scrape of
    that series. Ordered by ramp (newest first), mode, users.
    """
    return con.execute(_STEPS_SQL, {"ids": list(run_ids)}).df()


_TURNS_SQL = """
SELECT s.capacity_id, s.mode, s.users, t.run_id, t.session_id, t.turn_index, t.status, t.reuse, t.ttft_s
FROM turns t JOIN capacity_steps s USING (run_id)
WHERE t.run_id IN (SELECT unnest($ids))
ORDER BY s.capacity_id DESC, s.mode, s.users, t.session_id, t.turn_index
"""


def capacity_turns(con: duckdb.DuckDBPyConnection, run_ids: Sequence[str]) -> pd.DataFrame:
    """Every turn of the capacity steps among ``run_ids``: ``capacity_id``, ``mode``, ``users``,
    ``run_id``, ``session_id``, ``turn_index`` (0-based), ``status``, ``reuse`` (the proxy's
    outcome; NULL in aggregated serving) and ``ttft_s`` (seconds). The per-step speed-up's
    session-level bootstrap and the reuse outcomes read them
    (``analysis.eviction_window``)."""
    return con.execute(_TURNS_SQL, {"ids": list(run_ids)}).df()


def prefill_legs(store: Store, run_id: str) -> pd.DataFrame:
    """Each turn's P leg (``turns.prefill_leg_s``: the proxy's request to P until P answered,
    seconds) of ``run_id``, on a connection of its own. Columns: session_id, turn_index, prefill_leg_s."""
    con = store.connect()
    try:
        return con.execute("SELECT session_id, turn_index, prefill_leg_s FROM turns WHERE run_id = ?", [run_id]).df()
    finally:
        con.close()
