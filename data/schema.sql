-- turnscope store contract (DESIGN.md §6).
--
-- Writers (loadgen/) append Parquet shards under <store>/runs/<run_id>/<table>/*.parquet.
-- The DuckDB file <store>/turnscope.duckdb holds only views over those shards, so readers
-- (the dashboard, `duckdb data/turnscope.duckdb`) never take a lock a writer needs.
--
-- Section "tables" gives each shard table's exact column types; the store writes an empty,
-- typed shard per table so the views bind even before the first run. Section "views" holds
-- the derived views; they only reference the table names defined here.
-- Units: *_s seconds (float64), *_tokens tokens, *_bytes bytes; instants are TIMESTAMPTZ (UTC).

-- section: tables

-- One row per status change of a run; the `runs` view keeps the latest row per run_id.
CREATE TABLE runs_log (
    run_id         VARCHAR NOT NULL,
    label          VARCHAR,
    mode           VARCHAR,       -- aggregated | pd | pd-bidir | pd-nocache | pd-bidir-nocache | attach
    workload       VARCHAR,       -- workload name
    workload_spec  JSON,          -- the validated workload, as run
    history_mode   VARCHAR,       -- text | token_ids (DESIGN §4)
    topology       JSON,
    versions       JSON,          -- {"vllm": ..., "nixl": ..., "turnscope": ...}
    model          VARCHAR,
    config         JSON,          -- effective turnscope configuration
    started_at     TIMESTAMPTZ,
    finished_at    TIMESTAMPTZ,
    status         VARCHAR,       -- running | complete | stopped | failed | aborted
    updated_at     TIMESTAMPTZ NOT NULL,
    heartbeat_s    DOUBLE         -- a running run's row is rewritten this often (NULL: never)
);

CREATE TABLE sessions (
    run_id          VARCHAR NOT NULL,
    session_id      VARCHAR NOT NULL,
    archetype       VARCHAR,
    source          VARCHAR,      -- "synthetic" or "<trace>:<id>"
    started_at      TIMESTAMPTZ,
    finished_at     TIMESTAMPTZ,
    turns           INTEGER,
    task_latency_s  DOUBLE,       -- first request sent -> last response finished
    llm_s           DOUBLE,       -- sum of E2E
    tool_wait_s     DOUBLE,
    think_s         DOUBLE,
    pause_s         DOUBLE,
    status          VARCHAR       -- ok | error | cancelled
);

CREATE TABLE turns (
    run_id                    VARCHAR NOT NULL,
    session_id                VARCHAR NOT NULL,
    turn_index                INTEGER NOT NULL,   -- 0-based position in the session
    request_id                VARCHAR,
    kind                      VARCHAR,            -- turn | retry | edit | fresh | resume
    gap_before_s              DOUBLE,
    gap_kind                  VARCHAR,            -- none | tool | think | pause
    sent_at                   TIMESTAMPTZ,
    ttft_s                    DOUBLE,             -- NULL when no token arrived
    ttfc_s                    DOUBLE,             -- time to first content token
    last_token_s              DOUBLE,             -- sent -> last token (a usage-only chunk is no token)
    e2e_s                     DOUBLE,
    tpot_s                    DOUBLE,             -- (last_token_s - ttft_s) / (completion_tokens - 1)
    itl_p50_s                 DOUBLE,
    itl_p90_s                 DOUBLE,
    itl_samples               INTEGER,
    prompt_tokens             INTEGER,
    completion_tokens         INTEGER,
    cached_tokens             INTEGER,            -- server usage.prompt_tokens_details.cached_tokens
    expected_reusable_tokens  INTEGER,            -- LCP of previous prompt+output ids and this prompt's ids
    divergence_position       INTEGER,            -- first differing id (NULL when none)
    status                    VARCHAR,            -- ok | error | timeout | cancelled
    error                     VARCHAR,
    http_status               INTEGER,
    finish_reason             VARCHAR,            -- stop | length | tool_calls | ... (NULL when none came)
    tool_calls                INTEGER,            -- streamed tool calls in the reply (0 when none)
    reuse                     VARCHAR,            -- proxy outcome (DESIGN §3)
    prefill_leg_s             DOUBLE,
    prefill_engine            VARCHAR,
    decode_engine             VARCHAR,
    prefill_cached_tokens     INTEGER,            -- P's local prefix-cache hit
    remote_tokens             INTEGER,            -- tokens of D's handle offered to P
    reused_tokens             INTEGER,            -- tokens P pulled from D over NIXL
    recomputed_tokens         INTEGER,            -- tokens P computed
    handle_age_s              DOUBLE,
    prompt_sha256             VARCHAR             -- hash of the rendered prompt ids (prompt text is not stored)
);

CREATE TABLE metric_samples (
    run_id      VARCHAR NOT NULL,
    scraped_at  TIMESTAMPTZ NOT NULL,
    endpoint    VARCHAR NOT NULL,   -- base URL scraped
    role        VARCHAR,            -- prefill | decode | aggregated | proxy
    name        VARCHAR NOT NULL,   -- sample name as exposed, e.g. vllm:prefix_cache_hits_total
    labels      JSON,
    value       DOUBLE
);

-- section: views

-- The latest row of each run. A writer that records a running run rewrites its row every
-- heartbeat_s seconds; a `running` run whose latest row is older than three heartbeats lost its
-- writer (killed, machine gone) and reads `aborted`.
CREATE VIEW runs AS
SELECT * EXCLUDE (rn) REPLACE (
    CASE WHEN status = 'running' AND heartbeat_s > 0 AND epoch(now()) - epoch(updated_at) > 3 * heartbeat_s
         THEN 'aborted' ELSE status END AS status)
FROM (
    SELECT *, row_number() OVER (PARTITION BY run_id ORDER BY updated_at DESC) AS rn FROM runs_log
) WHERE rn = 1;

-- Per-run settings read from runs.config (JSON), with the defaults that applied when a key is
-- absent: vLLM's decoder_kv_blocks_ttl (480 s) and the proxy's handle TTL margin (30 s; the proxy
-- offers a handle for decoder_kv_blocks_ttl minus this). kv_bytes_per_token is NULL when unknown.
CREATE VIEW run_config AS
SELECT run_id,
       coalesce(TRY_CAST(json_extract_string(config, '$.connector.decoder_kv_blocks_ttl') AS DOUBLE), 480.0)
           AS decoder_kv_blocks_ttl_s,
       coalesce(TRY_CAST(json_extract_string(config, '$.handle_ttl_margin_s') AS DOUBLE), 30.0)
           AS handle_ttl_margin_s,
       TRY_CAST(json_extract_string(config, '$.kv_bytes_per_token') AS BIGINT) AS kv_bytes_per_token
FROM runs;

-- Per-turn breakdown with the run's mode and history mode, and the session's archetype (from the
-- session row, which is written when the session ends: NULL while it is still running).
-- measured_reused_tokens: prompt tokens whose KV the engine did not compute for this turn: P's
-- pull from D plus P's local prefix-cache hit where the proxy recorded its facts, else the
-- server's usage.cached_tokens (aggregated serving).
-- The archetype join costs a query over many turns even when the column is not used (DuckDB keeps
-- the join): a query that needs speed and no archetype can read turns JOIN runs instead.
CREATE VIEW turn_breakdown AS
SELECT t.*, r.mode, r.label AS run_label, r.workload, r.history_mode,
       t.e2e_s - t.ttft_s AS decode_s,
       greatest(t.ttft_s - coalesce(t.prefill_leg_s, 0), 0) AS after_prefill_s,
       s.archetype,
       CASE WHEN t.reuse IS NOT NULL
            THEN coalesce(t.reused_tokens, 0) + coalesce(t.prefill_cached_tokens, 0)
            ELSE t.cached_tokens END AS measured_reused_tokens
FROM turns t JOIN runs r USING (run_id)
LEFT JOIN (SELECT run_id, session_id, any_value(archetype) AS archetype FROM sessions GROUP BY run_id, session_id) s
    USING (run_id, session_id);

CREATE VIEW session_tasks AS
SELECT s.*, r.mode, r.label AS run_label, r.workload
FROM sessions s JOIN runs r USING (run_id);

-- Counter increases between consecutive scrapes (Prometheus `increase` reset handling, no
-- extrapolation). A reset is a drop in value, or a change of the endpoint's
-- process_start_time_seconds in the same scrape (a restart whose counter already passed the old
-- value); after a reset the whole new value is increase. Same rule as loadgen/prom.counter_increase.
-- The scraper writes every sample of one scrape with the same scraped_at, which the join relies on.
CREATE VIEW metric_increases AS
WITH starts AS (
    SELECT run_id, endpoint, scraped_at, any_value(value) AS process_start_s
    FROM metric_samples WHERE name = 'process_start_time_seconds'
    GROUP BY ALL
), ordered AS (
    SELECT m.run_id, m.endpoint, m.role, m.name, m.labels, m.scraped_at, m.value,
           lag(m.value) OVER w AS prev,
           coalesce(st.process_start_s <> lag(st.process_start_s) OVER w, false) AS restarted
    FROM metric_samples m
    LEFT JOIN starts st ON st.run_id = m.run_id AND st.endpoint = m.endpoint AND st.scraped_at = m.scraped_at
    WINDOW w AS (PARTITION BY m.run_id, m.endpoint, m.name, m.labels ORDER BY m.scraped_at)
)
SELECT run_id, endpoint, role, name, labels, scraped_at, value,
       CASE WHEN prev IS NULL THEN 0
            WHEN value < prev OR restarted THEN value
            ELSE value - prev END AS increase,
       (prev IS NOT NULL AND (value < prev OR restarted)) AS reset
FROM ordered;

CREATE VIEW run_summary AS
SELECT r.run_id, r.label, r.mode, r.workload, r.history_mode, r.status, r.started_at, r.finished_at,
       count(t.turn_index)                                       AS turns,
       count(*) FILTER (WHERE t.status = 'ok')                   AS ok_turns,
       count(*) FILTER (WHERE t.status <> 'ok')                  AS failed_turns,
       count(*) FILTER (WHERE t.reuse = 'hit')                   AS hits,
       quantile_cont(t.ttft_s, 0.5) FILTER (WHERE t.status = 'ok') AS ttft_p50_s,
       quantile_cont(t.ttft_s, 0.9) FILTER (WHERE t.status = 'ok') AS ttft_p90_s,
       avg(t.ttft_s) FILTER (WHERE t.status = 'ok')               AS ttft_mean_s,
       sum(t.reused_tokens)                                      AS reused_tokens
FROM runs r LEFT JOIN turns t USING (run_id)
GROUP BY ALL;

-- TTFT by mode and turn index, the A/B view.
CREATE VIEW mode_ab AS
SELECT mode, workload, history_mode, turn_index,
       count(*)                        AS turns,
       quantile_cont(ttft_s, 0.5)      AS ttft_p50_s,
       quantile_cont(ttft_s, 0.9)      AS ttft_p90_s,
       avg(ttft_s)                     AS ttft_mean_s,
       count(*) FILTER (WHERE reuse = 'hit') AS hits
FROM turn_breakdown
WHERE status = 'ok'
GROUP BY ALL;

-- KV transfer time measured on the prefill workers of each run: the increase over the run of vLLM's
-- vllm:nixl_xfer_time_seconds histogram (_sum: seconds, _count: transfers) and of
-- vllm:nixl_bytes_transferred_sum (bytes) on role 'prefill' (in pd-bidir modes P's NIXL reads are
-- its pulls from D), and the tokens P pulled (turns.reused_tokens). Transfers are not timed per
-- turn; xfer_s_per_token turns a turn's reused tokens into an estimate, xfer_bytes_per_s is the
-- measured bandwidth of P's transfers.
CREATE VIEW run_kv_transfer AS
WITH x AS (
    SELECT run_id,
           sum(increase) FILTER (WHERE name = 'vllm:nixl_xfer_time_seconds_sum')   AS xfer_s,
           sum(increase) FILTER (WHERE name = 'vllm:nixl_xfer_time_seconds_count') AS xfers,
           sum(increase) FILTER (WHERE name = 'vllm:nixl_bytes_transferred_sum')   AS xfer_bytes
    FROM metric_increases
    WHERE role = 'prefill'
      AND name IN ('vllm:nixl_xfer_time_seconds_sum', 'vllm:nixl_xfer_time_seconds_count',
                   'vllm:nixl_bytes_transferred_sum')
    GROUP BY run_id
), t AS (
    SELECT run_id, sum(reused_tokens) AS reused_tokens FROM turns GROUP BY run_id
)
SELECT r.run_id, x.xfer_s, x.xfers, t.reused_tokens,
       CASE WHEN t.reused_tokens > 0 THEN x.xfer_s / t.reused_tokens END AS xfer_s_per_token,
       x.xfer_bytes,
       CASE WHEN x.xfer_s > 0 THEN x.xfer_bytes / x.xfer_s END AS xfer_bytes_per_s
FROM runs r LEFT JOIN x USING (run_id) LEFT JOIN t USING (run_id);

-- The runs of prefix sweeps (`turnscope sweep`): the sweep parameters each run recorded in
-- runs.workload_spec ($.sweep), next to its mode and history mode. One row per run of a sweep.
CREATE VIEW sweep_points AS
SELECT run_id, label, mode, history_mode, status, started_at, finished_at,
       json_extract_string(workload_spec, '$.sweep.id')                            AS sweep_id,
       json_extract_string(workload_spec, '$.sweep.name')                          AS sweep_name,
       json_extract_string(workload_spec, '$.sweep.field')                         AS swept_field,
       json_extract_string(workload_spec, '$.sweep.scale')                         AS sweep_scale,
       TRY_CAST(json_extract_string(workload_spec, '$.sweep.prefix_tokens') AS INTEGER) AS prefix_tokens,
       TRY_CAST(json_extract_string(workload_spec, '$.sweep.index') AS INTEGER)    AS point_index,
       TRY_CAST(json_extract_string(workload_spec, '$.sweep.sessions') AS INTEGER) AS sessions,
       TRY_CAST(json_extract_string(workload_spec, '$.sweep.users') AS INTEGER)    AS users
FROM runs
WHERE json_extract_string(workload_spec, '$.sweep.id') IS NOT NULL;

-- The runs of capacity ramps (`turnscope capacity`): each load step's parameters as recorded in
-- runs.workload_spec ($.capacity) and its SLO (runs.config $.slo), next to its mode and history
-- mode. One row per run of a ramp.
CREATE VIEW capacity_steps AS
SELECT run_id, label, mode, history_mode, status, started_at, finished_at,
       json_extract_string(workload_spec, '$.capacity.id')                          AS capacity_id,
       json_extract_string(workload_spec, '$.capacity.workload')                    AS capacity_workload,
       TRY_CAST(json_extract_string(workload_spec, '$.capacity.step') AS INTEGER)     AS step_index,
       TRY_CAST(json_extract_string(workload_spec, '$.capacity.users') AS INTEGER)    AS users,
       TRY_CAST(json_extract_string(workload_spec, '$.capacity.sessions') AS INTEGER) AS sessions,
       TRY_CAST(json_extract_string(workload_spec, '$.capacity.decode_kv_cache_bytes') AS BIGINT)
           AS decode_kv_cache_bytes,
       TRY_CAST(json_extract_string(workload_spec, '$.capacity.decoder_kv_blocks_ttl_s') AS DOUBLE)
           AS decoder_kv_blocks_ttl_s,
       TRY_CAST(json_extract_string(config, '$.slo.ttft_s') AS DOUBLE)                AS slo_ttft_s,
       TRY_CAST(json_extract_string(config, '$.slo.tpot_s') AS DOUBLE)                AS slo_tpot_s
FROM runs
WHERE json_extract_string(workload_spec, '$.capacity.id') IS NOT NULL;
