-- turnscope store contract (docs/schema/overview.md).
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
    mode           VARCHAR,       -- a name of core.modes.MODES, or attach (a server turnscope did not launch)
    workload       VARCHAR,       -- workload name
    workload_spec  JSON,          -- the validated workload, as run
    history_mode   VARCHAR,       -- text | token_ids (docs/workloads.md)
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

-- The speed probe (turnscope/conductor/speed_probe.py, docs/planner/calibration.md): the same fixed prefill
-- sent straight to the run's prefill (or aggregated) worker at the run's start and end.
CREATE TABLE run_probes (
    run_id         VARCHAR NOT NULL,
    phase          VARCHAR NOT NULL,   -- start | end
    target         VARCHAR,            -- the role probed: prefill | aggregated
    endpoint       VARCHAR,            -- the worker's URL
    sent_at        TIMESTAMPTZ,
    prompt_tokens  INTEGER,
    ttft_s         DOUBLE,             -- NULL when the probe failed
    status         VARCHAR,            -- ok | error
    error          VARCHAR
);

-- The known-answer canary (serving/canary.py, docs/reliability.md): a fixed two-turn session answered
-- greedily through the proxy and by a reference worker, compared token by token; one row per turn.
CREATE TABLE run_canaries (
    run_id          VARCHAR NOT NULL,
    phase           VARCHAR NOT NULL,   -- start | end | during (the soak)
    sent_at         TIMESTAMPTZ,
    canary_id       VARCHAR,            -- one canary's rows share it
    result          VARCHAR,            -- the canary's: match | mismatch | error
    reference       VARCHAR,            -- the reference worker's name
    turn            INTEGER,            -- 0 or 1 (NULL: an error before any turn)
    prompt_tokens   INTEGER,
    reuse           VARCHAR,            -- the proxy's reuse outcome of the serving path's request
    first_mismatch  INTEGER,            -- first index where the generated ids differ (NULL: equal)
    reference_ids   JSON,               -- the generated ids, a JSON list
    served_ids      JSON,
    error           VARCHAR
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
    status          VARCHAR,      -- ok | error | cancelled
    planned_turns   INTEGER,      -- own turns the plan held (fresh requests excluded)
    stop_reason     VARCHAR       -- complete | max_prompt_tokens | tokenize_error | cancelled
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
    expected_reusable_tokens  INTEGER,            -- LCP of previous prompt+output ids and this prompt's ids (0 on turn 0)
    trace_reusable_tokens     INTEGER,            -- trace replay: the trace's reusable prefix, scaled
    divergence_position       INTEGER,            -- first differing id (NULL when none)
    status                    VARCHAR,            -- ok | error | timeout | cancelled
    error                     VARCHAR,
    http_status               INTEGER,
    finish_reason             VARCHAR,            -- stop | length | tool_calls | ... (NULL when none came)
    tool_calls                INTEGER,            -- streamed tool calls in the reply (0 when none)
    reuse                     VARCHAR,            -- proxy outcome (docs/design.md, "The proxy")
    prefill_leg_s             DOUBLE,
    prefill_engine            VARCHAR,
    decode_engine             VARCHAR,
    prefill_cached_tokens     INTEGER,            -- P's local prefix-cache hit
    remote_tokens             INTEGER,            -- tokens of D's handle offered to P
    reused_tokens             INTEGER,            -- tokens P pulled from D over NIXL
    recomputed_tokens         INTEGER,            -- tokens P computed
    handle_age_s              DOUBLE,
    handle_tokens             INTEGER,            -- tokens of KV D kept for this turn's own handle (NULL: none)
    prompt_sha256             VARCHAR,            -- hash of the rendered prompt ids (prompt text is not stored)
    proxy_divergence_position INTEGER,            -- the proxy's: first prompt id D's handle does not hold (NULL: none)
    prefill_attempts          INTEGER             -- prefill legs the proxy ran (2: a leg with a handle failed, recomputed)
);

CREATE TABLE metric_samples (
    run_id      VARCHAR NOT NULL,
    scraped_at  TIMESTAMPTZ NOT NULL,
    endpoint    VARCHAR NOT NULL,   -- base URL scraped
    role        VARCHAR,            -- prefill | decode | aggregated | proxy
    name        VARCHAR NOT NULL,   -- sample name (a renamed vLLM metric under its current name), e.g. vllm:prefix_cache_hits_total
    labels      JSON,
    value       DOUBLE
);

-- Which exposed name each renamed vLLM metric was read under (loadgen/prom.RENAMED_METRICS), per
-- endpoint: written at the endpoint's first scrape and whenever the names change.
CREATE TABLE metric_sources (
    run_id      VARCHAR NOT NULL,
    scraped_at  TIMESTAMPTZ NOT NULL,
    endpoint    VARCHAR NOT NULL,
    role        VARCHAR,
    metric      VARCHAR NOT NULL,   -- current name, e.g. vllm:kv_cache_usage_perc
    source      VARCHAR             -- family read, e.g. vllm:gpu_cache_usage_perc; NULL: missing
);

-- One row per worker lifetime seen by the scraper (and again when its settings read differently).
CREATE TABLE engine_info (
    run_id                    VARCHAR NOT NULL,
    scraped_at                TIMESTAMPTZ NOT NULL,
    endpoint                  VARCHAR NOT NULL,
    role                      VARCHAR,
    process_start_s           DOUBLE,    -- process_start_time_seconds (Unix s): the lifetime
    vllm_version              VARCHAR,   -- GET /version; NULL when the server does not answer it
    spec_decode               BOOLEAN,   -- vllm:spec_decode_* counters exposed
    spec_decode_draft_tokens  DOUBLE     -- draft tokens per draft; NULL: unknown or no spec decoding
);

-- Traffic reports (`turnscope traffic`, loadgen/traffic.py, docs/schema/traffic.md): traces read
-- without serving. One traffic_log row per report; its requests are one traffic_requests row each,
-- stored under runs/<traffic_id>/.
CREATE TABLE traffic_log (
    traffic_id                  VARCHAR NOT NULL,
    label                       VARCHAR,
    created_at                  TIMESTAMPTZ NOT NULL,
    inputs                      JSON,          -- [{"path", "format"}] as read
    ttl_s                       DOUBLE,        -- the configured decoder KV TTL the report is about (480)
    recompute_threshold_tokens  INTEGER        -- vLLM's kv_recompute_threshold (64)
);

CREATE TABLE traffic_requests (
    traffic_id            VARCHAR NOT NULL,
    format                VARCHAR NOT NULL,   -- kv_cache_tester | tracelab | mooncake | azure | run
    source                VARCHAR NOT NULL,   -- the trace's identity, one clock per source
    session_id            VARCHAR NOT NULL,
    parent_session_id     VARCHAR,            -- a sub-agent's parent session
    request_index         INTEGER NOT NULL,   -- 0-based within the session
    arrival_s             DOUBLE NOT NULL,    -- seconds since the source's first request
    input_tokens          BIGINT NOT NULL,
    output_tokens         BIGINT NOT NULL,
    shared_prefix_tokens  BIGINT NOT NULL,    -- prefix of the session's previous request (0 first)
    server_s              DOUBLE,
    gap_s                 DOUBLE,             -- previous request's end -> this arrival, in [0, start to start]
    gap_kind              VARCHAR,            -- tool | think | pause | NULL
    tool_s                DOUBLE,
    gap_estimated         BOOLEAN             -- the trace does not say when the previous request ended
);

-- Planner forecasts (`turnscope plan`, docs/planner/overview.md): one plan_log row per plan, its rows under
-- runs/<plan_id>/. Every figure is a FORECAST made with the profile named in plan_log.
CREATE TABLE plan_log (
    plan_id        VARCHAR NOT NULL,
    label          VARCHAR,
    created_at     TIMESTAMPTZ NOT NULL,
    inputs         JSON,          -- [{"path", "format"}] as read
    profile_name   VARCHAR,
    profile        JSON,          -- the cost profile, every figure with its source
    settings       JSON,          -- TTL, margin, threshold, workers, routing, modes
    notes          JSON,          -- what the plan assumed or left out
    requests       BIGINT,
    forecast_label VARCHAR        -- "FORECAST (profile <name>)"
);

CREATE TABLE plan_requests (
    plan_id               VARCHAR NOT NULL,
    mode                  VARCHAR NOT NULL,
    source                VARCHAR,
    session_id            VARCHAR NOT NULL,
    request_index         INTEGER NOT NULL,
    arrival_s             DOUBLE,
    input_tokens          BIGINT,
    shared_prefix_tokens  BIGINT,
    outcome               VARCHAR,   -- proxy outcome, or miss_d_full; NULL for aggregated
    pulled_tokens         BIGINT,
    local_tokens          BIGINT,
    recomputed_tokens     BIGINT,
    handle_age_s          DOUBLE,
    ttft_s                DOUBLE,
    queue_wait_s          DOUBLE,    -- of ttft_s, the wait for the prefill (or aggregated) worker
    decode_wait_s         DOUBLE     -- of ttft_s, the wait on D for room in its KV space (P/D modes)
);

CREATE TABLE plan_speedups (
    plan_id                VARCHAR NOT NULL,
    treatment              VARCHAR NOT NULL,
    baseline               VARCHAR NOT NULL,
    requests               BIGINT,
    later_requests         BIGINT,
    treatment_hits         BIGINT,
    treatment_ttft_median_s DOUBLE,   -- later requests (request_index >= 1), the headline's
    baseline_ttft_median_s DOUBLE,
    speedup                DOUBLE,    -- the Overview's: baseline / treatment median TTFT, later requests
    speedup_ci_low         DOUBLE,    -- its session-bootstrap 95% CI (analysis/headline.py)
    speedup_ci_high        DOUBLE,
    treatment_ttft_mean_s  DOUBLE,    -- secondary: every request
    baseline_ttft_mean_s   DOUBLE,
    mean_speedup           DOUBLE,    -- secondary: baseline / treatment mean TTFT, every request
    later_mean_speedup     DOUBLE,
    treatment_queue_share  DOUBLE,    -- mean wait for the prefill worker / mean TTFT
    baseline_queue_share   DOUBLE,
    speedup_interval_low   DOUBLE,    -- 80% forecast interval from the profile's held-out errors
    speedup_interval_high  DOUBLE,    -- (NULL: the profile has none)
    treatment_ttft_interval_low_s  DOUBLE,
    treatment_ttft_interval_high_s DOUBLE,
    baseline_ttft_interval_low_s   DOUBLE,
    baseline_ttft_interval_high_s  DOUBLE
);

CREATE TABLE plan_frontier (
    plan_id                  VARCHAR NOT NULL,
    mode                     VARCHAR NOT NULL,
    decoder_kv_blocks_ttl_s  DOUBLE,
    decode_kv_space_bytes    DOUBLE,    -- NULL: unbounded
    current                  BOOLEAN,
    hit_rate                 DOUBLE,
    hit_rate_interval_low    DOUBLE,    -- 80% forecast interval (NULL: no held-out errors)
    hit_rate_interval_high   DOUBLE,
    ttft_saved_s             DOUBLE,
    peak_held_bytes          DOUBLE,
    held_gib_s               DOUBLE,
    d_full_events            BIGINT
);

-- The ledger of retention strategies (`turnscope recommend --store`), one row per strategy, with 80%
-- forecast intervals from the profile's held-out errors (NULL: none; interval_note says why).
CREATE TABLE plan_ledger (
    plan_id                  VARCHAR NOT NULL,
    strategy                 VARCHAR NOT NULL,   -- recompute | pd | pd+host | pd-bidir | pd-bidir+host
    mode                     VARCHAR,            -- the planner mode it is costed as
    later_requests           BIGINT,
    hit_rate                 DOUBLE,             -- later requests reusing any token
    hit_rate_interval_low    DOUBLE,
    hit_rate_interval_high   DOUBLE,
    reused_tokens            BIGINT,
    host_read_tokens         BIGINT,
    ttft_p50_later_s         DOUBLE,
    ttft_p50_later_interval_low_s  DOUBLE,
    ttft_p50_later_interval_high_s DOUBLE,
    ttft_mean_s              DOUBLE,
    ttft_mean_interval_low_s DOUBLE,
    ttft_mean_interval_high_s DOUBLE,
    speedup_vs_recompute     DOUBLE,             -- recompute / this TTFT p50 of later requests
    speedup_interval_low     DOUBLE,
    speedup_interval_high    DOUBLE,
    ttft_saved_s             DOUBLE,             -- recompute minus this TTFT p50 of later requests
    ttft_saved_interval_low_s  DOUBLE,
    ttft_saved_interval_high_s DOUBLE,
    p_cache_gib_s            DOUBLE,
    d_pinned_gib_s           DOUBLE,
    d_pinned_interval_low_gib_s  DOUBLE,
    d_pinned_interval_high_gib_s DOUBLE,
    host_gib_s               DOUBLE,
    d_full_events            BIGINT,
    prefill_gpu_s_saved      DOUBLE,
    gpu_memory_usd           DOUBLE,             -- NULL: no price given
    host_memory_usd          DOUBLE,
    saved_prefill_usd        DOUBLE,
    memory_usd_per_m_saved_tokens DOUBLE,
    net_usd_per_m_saved_tokens    DOUBLE,
    interval_note            VARCHAR,
    overload                 VARCHAR,            -- NULL: keeps up; else e.g. "overloaded: P at 3.4x its capacity"
    overload_factor          DOUBLE              -- offered work over capacity, busiest window (NULL: none)
);

-- The recommendation of `turnscope recommend --store`: current and recommended setting, each figure
-- with its 80% interval (NULL: none), and the diffs to deploy it.
CREATE TABLE plan_recommendations (
    plan_id                  VARCHAR NOT NULL,
    current_setting          JSON,
    recommended_setting      JSON,
    current_label            VARCHAR,
    recommended_label        VARCHAR,
    settings_searched        BIGINT,
    feasible                 BOOLEAN,            -- the recommended setting meets the SLO
    enables_bidir            BOOLEAN,
    current_ttft_mean_s            DOUBLE,
    current_ttft_mean_interval_low_s   DOUBLE,
    current_ttft_mean_interval_high_s  DOUBLE,
    current_ttft_p90_s             DOUBLE,
    current_ttft_p90_interval_low_s    DOUBLE,
    current_ttft_p90_interval_high_s   DOUBLE,
    current_hit_rate               DOUBLE,
    current_hit_rate_interval_low      DOUBLE,
    current_hit_rate_interval_high     DOUBLE,
    current_d_pinned_gib_s         DOUBLE,
    current_d_pinned_interval_low_gib_s  DOUBLE,
    current_d_pinned_interval_high_gib_s DOUBLE,
    current_host_gib_s             DOUBLE,
    recommended_ttft_mean_s            DOUBLE,
    recommended_ttft_mean_interval_low_s   DOUBLE,
    recommended_ttft_mean_interval_high_s  DOUBLE,
    recommended_ttft_p90_s             DOUBLE,
    recommended_ttft_p90_interval_low_s    DOUBLE,
    recommended_ttft_p90_interval_high_s   DOUBLE,
    recommended_hit_rate               DOUBLE,
    recommended_hit_rate_interval_low      DOUBLE,
    recommended_hit_rate_interval_high     DOUBLE,
    recommended_d_pinned_gib_s         DOUBLE,
    recommended_d_pinned_interval_low_gib_s  DOUBLE,
    recommended_d_pinned_interval_high_gib_s DOUBLE,
    recommended_host_gib_s             DOUBLE,
    speedup                  DOUBLE,             -- current / recommended mean TTFT
    speedup_interval_low     DOUBLE,
    speedup_interval_high    DOUBLE,
    cost_change_usd          DOUBLE,             -- recommended minus current; NULL: no price
    knob_effects             JSON,
    what_would_change        JSON,
    flags_diff               VARCHAR,            -- `vllm serve` flags, unified diff
    topology_diff            VARCHAR,            -- topology file, unified diff
    recommended_topology     VARCHAR,            -- the recommended topology file (YAML)
    interval_note            VARCHAR,
    current_overload         VARCHAR,            -- NULL: keeps up at the load; else the overload in words
    recommended_overload     VARCHAR
);

-- Fleet sizing (the planner's fleet search): per retention strategy, the smallest fleet whose forecast p90
-- TTFT meets the SLO at one stated load, one row per strategy (docs/schema/plans.md). A role whose
-- arrivals outpace it is "overloaded": no TTFT, only its offered work over its capacity.
CREATE TABLE plan_fleets (
    plan_id                  VARCHAR NOT NULL,
    load_kind                VARCHAR,            -- sessions_per_hour | concurrent_sessions | recorded
    load_value               DOUBLE,             -- new sessions/h; concurrent sessions; recorded clock speed-up
    load_label               VARCHAR,            -- the load in words
    slo_ttft_p90_s           DOUBLE,
    strategy                 VARCHAR,            -- recompute | pd | pd+host | pd-bidir | pd-bidir+host
    prefill_workers          INTEGER,
    decode_workers           INTEGER,
    decode_kv_bytes_per_worker DOUBLE,           -- NULL: the profile's
    gpus                     DOUBLE,
    ttft_p50_s               DOUBLE,             -- NULL when overloaded
    ttft_p90_s               DOUBLE,             -- NULL when overloaded
    hit_rate                 DOUBLE,
    p_cache_gib_s            DOUBLE,
    d_pinned_gib_s           DOUBLE,
    host_gib_s               DOUBLE,
    prefill_gpu_s_saved      DOUBLE,
    usd_per_m_tokens         DOUBLE,             -- NULL: no price given
    meets_slo                BOOLEAN,
    overloaded               BOOLEAN,
    overload_role            VARCHAR,            -- prefill | decode | NULL
    overload_factor          DOUBLE,             -- offered work / capacity of the busiest worker (NULL: none, or no factor)
    recommended              BOOLEAN,            -- the cheapest fleet meeting the SLO; at most one per plan
    fleets_searched          BIGINT,
    overload                 VARCHAR,            -- the overload in words (NULL: keeps up); the one verdict
    ttft_p90_over_slo        DOUBLE,             -- p90 TTFT / SLO (NULL: no SLO, or overloaded)
    close_to_slo             BOOLEAN,            -- within the planner's known error (25%) of the SLO
    lowest_ttft_p90_s        DOUBLE              -- no fleet meets the SLO: the p90 of the largest fleet in the limits
);

-- The load curve: per strategy, its fleet of plan_fleets forecast at several loads.
CREATE TABLE plan_load_curve (
    plan_id                  VARCHAR NOT NULL,
    strategy                 VARCHAR,
    prefill_workers          INTEGER,
    decode_workers           INTEGER,
    decode_kv_bytes_per_worker DOUBLE,           -- NULL: the profile's
    load_kind                VARCHAR,
    load_value               DOUBLE,
    ttft_p50_s               DOUBLE,             -- NULL when overloaded
    ttft_p90_s               DOUBLE,             -- NULL when overloaded
    overloaded               BOOLEAN,
    overload_role            VARCHAR,
    overload_factor          DOUBLE,
    slo_ttft_p90_s           DOUBLE,
    overload                 VARCHAR,            -- the overload in words (NULL: keeps up)
    knee                     BOOLEAN             -- the highest load this fleet serves at the SLO, every lower one too
);

CREATE TABLE plan_sessions (
    plan_id        VARCHAR NOT NULL,
    mode           VARCHAR NOT NULL,
    source         VARCHAR,
    session_id     VARCHAR NOT NULL,
    requests       BIGINT,
    expired        BIGINT,
    mismatched     BIGINT,
    d_full         BIGINT,
    consumed       BIGINT,
    lost_tokens    BIGINT,
    longest_gap_s  DOUBLE,
    reason         VARCHAR
);

CREATE TABLE plan_checks (
    plan_id            VARCHAR NOT NULL,
    checked_run_id     VARCHAR NOT NULL,   -- the recorded run (not run_id: a plan's shards are its own)
    mode               VARCHAR,
    session_id         VARCHAR NOT NULL,
    turn_index         INTEGER NOT NULL,
    status             VARCHAR,
    recorded_outcome   VARCHAR,
    predicted_outcome  VARCHAR,
    outcome_match      BOOLEAN,     -- NULL for a failed turn
    measured_ttft_s    DOUBLE,
    predicted_ttft_s   DOUBLE,
    recorded_pulled_tokens   BIGINT,
    predicted_pulled_tokens  BIGINT,
    recorded_local_tokens    BIGINT,
    predicted_local_tokens   BIGINT,
    why                VARCHAR,
    speed_factor       DOUBLE       -- run's speed probe TTFT / the profile's (b0, c(x) scaled); NULL: not scaled
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
-- turnscope eval/sweep/capacity record the topology they ran ($.topology.connector, $.topology.proxy);
-- a config written by other tools may give the keys at the top level ($.connector, $.handle_ttl_margin_s).
CREATE VIEW run_config AS
SELECT run_id,
       coalesce(TRY_CAST(json_extract_string(config, '$.topology.connector.decoder_kv_blocks_ttl') AS DOUBLE),
                TRY_CAST(json_extract_string(config, '$.connector.decoder_kv_blocks_ttl') AS DOUBLE), 480.0)
           AS decoder_kv_blocks_ttl_s,
       coalesce(TRY_CAST(json_extract_string(config, '$.topology.proxy.handle_ttl_margin_s') AS DOUBLE),
                TRY_CAST(json_extract_string(config, '$.handle_ttl_margin_s') AS DOUBLE), 30.0)
           AS handle_ttl_margin_s,
       TRY_CAST(json_extract_string(config, '$.kv_bytes_per_token') AS BIGINT) AS kv_bytes_per_token,
       json_extract_string(config, '$.topology.proxy.prefill_routing') AS prefill_routing,
       json_extract_string(config, '$.topology.proxy.decode_routing') AS decode_routing
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
    SELECT m.run_id, m.endpoint, m.role, m.name, m.labels, m.scraped_at, m.value, st.process_start_s,
           lag(m.value) OVER w AS prev,
           coalesce(st.process_start_s <> lag(st.process_start_s) OVER w, false) AS restarted
    FROM metric_samples m
    LEFT JOIN starts st ON st.run_id = m.run_id AND st.endpoint = m.endpoint AND st.scraped_at = m.scraped_at
    WINDOW w AS (PARTITION BY m.run_id, m.endpoint, m.name, m.labels ORDER BY m.scraped_at)
)
SELECT run_id, endpoint, role, name, labels, scraped_at, value, process_start_s,
       CASE WHEN prev IS NULL THEN 0
            WHEN value < prev OR restarted THEN value
            ELSE value - prev END AS increase,
       (prev IS NOT NULL AND (value < prev OR restarted)) AS reset
FROM ordered;

-- Engine lifetimes: one row per endpoint and process_start_time_seconds value seen in a run.
-- started_at is the process start itself, not the scrape that first showed it; ended_at the next
-- lifetime's start on the same endpoint (NULL: the last one seen). engine is the endpoint's
-- host:port. restarts_before counts the lifetimes of the endpoint that started earlier in the run.
CREATE VIEW engine_lifetimes AS
SELECT run_id, endpoint, role, regexp_extract(endpoint, '^[a-z]+://([^/]+)', 1) AS engine,
       process_start_s, to_timestamp(process_start_s) AS started_at,
       -- prometheus_client's process collector adds /proc/stat's boot time, which the kernel gives in
       -- whole seconds: a start reads up to 1 s early. No vLLM worker answers within a second of its
       -- process start (imports alone take tens of seconds), so it serves from 1 s after it at the
       -- earliest.
       to_timestamp(process_start_s) + INTERVAL 1 SECOND AS serving_from,
       lead(to_timestamp(process_start_s)) OVER w AS ended_at,
       first_scraped_at, last_scraped_at,
       CAST(row_number() OVER w - 1 AS INTEGER) AS restarts_before
FROM (SELECT run_id, endpoint, any_value(role) AS role, value AS process_start_s,
             min(scraped_at) AS first_scraped_at, max(scraped_at) AS last_scraped_at
      FROM metric_samples WHERE name = 'process_start_time_seconds' GROUP BY run_id, endpoint, value)
WINDOW w AS (PARTITION BY run_id, endpoint ORDER BY process_start_s);

-- Each P/D turn joined to its decode worker's lifetimes (engine_lifetimes): the one it ran on
-- (the latest start at or before sent_at) and the one its handle came from (the latest start at
-- or before the handle's issue, sent_at - handle_age_s). A turn's decode_engine is matched to a
-- lifetime's engine (host:port); a run with one decode endpoint matches its turns to it whatever
-- the proxy named it. handle_spans_restart: D restarted between the handle's issue and its use,
-- so the handle named blocks of a dead engine (vLLM refuses a handshake whose engine id changed):
-- such a turn cannot be a real hit (stale_hit), and a miss of it is explained by the restart.
-- Turns and handles are matched to a lifetime by its serving_from (engine_lifetimes: its start can
-- read up to 1 s early).
CREATE VIEW turn_lifetimes AS
WITH d AS (
    SELECT run_id, endpoint, engine, started_at, serving_from FROM engine_lifetimes WHERE role = 'decode'
), engines AS (
    SELECT DISTINCT run_id, engine FROM d
), single AS (
    SELECT run_id, any_value(engine) AS engine FROM d GROUP BY run_id HAVING count(DISTINCT endpoint) = 1
), t AS (
    SELECT t.run_id, t.session_id, t.turn_index, t.sent_at, t.status, t.reuse, t.decode_engine, t.handle_age_s,
           t.sent_at - to_microseconds(CAST(round(t.handle_age_s * 1e6) AS BIGINT)) AS handle_issued_at,
           coalesce(e.engine, s.engine) AS engine
    FROM turns t LEFT JOIN engines e ON e.run_id = t.run_id AND e.engine = t.decode_engine
    LEFT JOIN single s ON s.run_id = t.run_id
), j AS (
    SELECT t.*, l1.started_at AS lifetime_started_at, l1.serving_from AS lifetime_serving_from,
           l2.started_at AS handle_lifetime_started_at
    FROM t
    ASOF LEFT JOIN d l1 ON t.run_id = l1.run_id AND t.engine = l1.engine AND t.sent_at >= l1.serving_from
    ASOF LEFT JOIN d l2 ON t.run_id = l2.run_id AND t.engine = l2.engine AND t.handle_issued_at >= l2.serving_from
)
SELECT run_id, session_id, turn_index, sent_at, status, reuse, decode_engine, engine, handle_age_s,
       handle_issued_at, lifetime_started_at, handle_lifetime_started_at,
       coalesce(handle_issued_at IS NOT NULL AND lifetime_serving_from > handle_issued_at
                AND lifetime_started_at IS DISTINCT FROM handle_lifetime_started_at, false) AS handle_spans_restart,
       coalesce(handle_issued_at IS NOT NULL AND lifetime_serving_from > handle_issued_at
                AND lifetime_started_at IS DISTINCT FROM handle_lifetime_started_at, false)
           AND reuse = 'hit' AS stale_hit
FROM j;

-- Server-side inter-token latency per run and decode-side endpoint, from the counter increases
-- (seconds; counts). vllm:inter_token_latency_seconds observes one value per streamed output
-- event, which holds several tokens under speculative decoding (vllm#52853), so it is reported
-- per event, with decode tokens per event beside it ((generation tokens - finished requests) /
-- events) and the per-token figure only after dividing by it.
CREATE VIEW server_itl AS
WITH inc AS (
    SELECT run_id, endpoint, any_value(role) AS role,
           sum(increase) FILTER (WHERE name = 'vllm:inter_token_latency_seconds_count') AS itl_events,
           sum(increase) FILTER (WHERE name = 'vllm:inter_token_latency_seconds_sum') AS itl_sum_s,
           sum(increase) FILTER (WHERE name = 'vllm:generation_tokens_total') AS generation_tokens,
           sum(increase) FILTER (WHERE name = 'vllm:request_success_total') AS requests
    FROM metric_increases
    WHERE role IN ('decode', 'aggregated')
      AND name IN ('vllm:inter_token_latency_seconds_count', 'vllm:inter_token_latency_seconds_sum',
                   'vllm:generation_tokens_total', 'vllm:request_success_total')
    GROUP BY run_id, endpoint
)
SELECT run_id, endpoint, role, itl_events, itl_sum_s / nullif(itl_events, 0) AS itl_mean_s_per_event,
       (generation_tokens - requests) / nullif(itl_events, 0) AS tokens_per_event,
       itl_sum_s / nullif(generation_tokens - requests, 0) AS itl_mean_s_per_token
FROM inc;

-- The KV each turn's handle kept pinned on D, from the turn's end until the session's next turn
-- freed it (its proxy-measured handle age at use plus that turn's prefill leg): 'pulled' when that
-- turn was a hit; 'freed' when it was miss_below_threshold, since P, given the handle, pulls nothing
-- and still sends D the completion notification, on which D frees the blocks (vLLM 0.32
-- nixl/pull_scheduler.py get_num_new_matched_tokens returns 0 tokens, update_state_after_alloc
-- queues the request with no local blocks, nixl/pull_worker.py _read_blocks notifies D;
-- core.reuse_rules.d_frees_taken_handle). Otherwise (no next turn, any other miss: mismatch
-- and expired handles are not forwarded, a failed transfer) 'expired' after D's whole
-- decoder_kv_blocks_ttl (nixl/pull_scheduler.py: request_finished pins the blocks,
-- _reap_expired_send_leases frees them). Each hold belongs to the run whose turn created it, also
-- after the run's last turn.
CREATE VIEW handle_holds AS
WITH t AS (
    SELECT run_id, session_id, turn_index, sent_at, e2e_s, handle_tokens,
           lead(reuse)         OVER w AS next_reuse,
           lead(handle_age_s)  OVER w AS next_handle_age_s,
           lead(prefill_leg_s) OVER w AS next_prefill_leg_s
    FROM turns
    WINDOW w AS (PARTITION BY run_id, session_id ORDER BY turn_index)
)
SELECT t.run_id, t.session_id, t.turn_index, t.handle_tokens,
       t.handle_tokens * c.kv_bytes_per_token                                AS handle_bytes,
       t.sent_at + to_microseconds(CAST(round(coalesce(t.e2e_s, 0) * 1e6) AS BIGINT)) AS held_from,
       CASE t.next_reuse WHEN 'hit' THEN 'pulled' WHEN 'miss_below_threshold' THEN 'freed'
            ELSE 'expired' END                                                 AS ended_by,
       CASE WHEN t.next_reuse IN ('hit', 'miss_below_threshold')
            THEN least(coalesce(t.next_handle_age_s, 0) + coalesce(t.next_prefill_leg_s, 0),
                       c.decoder_kv_blocks_ttl_s)
            ELSE c.decoder_kv_blocks_ttl_s END                                 AS held_s
FROM t JOIN run_config c USING (run_id)
WHERE t.handle_tokens > 0;

-- Per run: D's KV held for the run's handles (handle_holds), and D's KV usage at the run's first
-- scrape (the baseline other runs left behind; fraction 0..1, the fullest engine of the fullest D).
CREATE VIEW run_handle_memory AS
WITH h AS (
    SELECT run_id, count(*) AS handles,
           count(*) FILTER (WHERE ended_by = 'pulled') AS pulled,
           sum(handle_bytes * held_s) / 1073741824.0 AS held_gib_s,
           max(held_from + to_microseconds(CAST(round(held_s * 1e6) AS BIGINT))) AS held_until
    FROM handle_holds GROUP BY run_id
), d AS (
    SELECT run_id, arg_min(value, scraped_at) AS d_kv_usage_at_start
    FROM (SELECT run_id, scraped_at, max(value) AS value FROM metric_samples
          WHERE role = 'decode' AND name = 'vllm:kv_cache_usage_perc' GROUP BY run_id, scraped_at)
    GROUP BY run_id
)
SELECT r.run_id, r.mode, coalesce(h.handles, 0) AS handles, coalesce(h.pulled, 0) AS pulled,
       coalesce(h.held_gib_s, 0) AS held_gib_s, h.held_until, d.d_kv_usage_at_start
FROM runs r LEFT JOIN h USING (run_id) LEFT JOIN d USING (run_id);

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

-- Each worker role's own prefix cache over a run: how much of its prompts it found in its own cache
-- (vllm:prefix_cache_hits) of what it looked up (vllm:prefix_cache_queries), both in tokens, as
-- their increases over the run (restarts handled by metric_increases). role 'prefill' is P in the
-- P/D modes (KV pulled from D is not a hit of P's own cache: vLLM counts it as
-- prompt_tokens_by_source{source="external_kv_transfer"}), 'aggregated' the single worker. One
-- row per run and role that exposed the counters; the hit rate is NULL without a lookup.
CREATE VIEW run_prefix_cache AS
WITH c AS (
    SELECT run_id, role,
           sum(increase) FILTER (WHERE name = 'vllm:prefix_cache_queries_total') AS queried_tokens,
           sum(increase) FILTER (WHERE name = 'vllm:prefix_cache_hits_total')    AS hit_tokens
    FROM metric_increases
    WHERE role IN ('prefill', 'aggregated')
      AND name IN ('vllm:prefix_cache_queries_total', 'vllm:prefix_cache_hits_total')
    GROUP BY run_id, role
)
SELECT run_id, role, queried_tokens, hit_tokens,
       CASE WHEN queried_tokens > 0 THEN hit_tokens / queried_tokens END AS hit_rate
FROM c;

-- Pulls that did not happen, as the proxy recorded them beside vLLM's own NIXL counters, per run
-- (docs/monitoring.md). The proxy: turns recorded miss_expired (its TTL margin kept the handle back:
-- no pull tried) and miss_transfer_failed (it offered a handle; P's pull failed or was declined).
-- vLLM 0.32 (nixl/stats.py, counted per worker since its process start, read as increases over the
-- run): vllm:nixl_num_kv_expired_reqs_total, a request whose KV lease ran out; on P it counts the
-- reads of D's blocks P declined within 5 s of D's deadline (nixl/pull_worker.py
-- _is_turn2_read_expired: a turn the proxy offered a handle for, an expiry its margin did not
-- prevent) and P's own prompt blocks no D read within kv_lease_duration; on D the handles no P
-- pulled within decoder_kv_blocks_ttl. vllm:nixl_num_failed_transfers_total: transport failures
-- (failed transfers, handshakes and notifications; an expiry is not one since vLLM PR 55854);
-- vllm:nixl_num_failed_notifications_total: the notifications among them (already inside failed
-- transfers: never add the two). vllm:nixl_num_notifications_after_expiry_total: completion
-- notifications for requests no longer tracked (their lease ran out: the blocks may have been
-- reused before the transfer finished), one per remote rank, not per request.
CREATE VIEW run_nixl_failures AS
WITH n AS (
    SELECT run_id,
           sum(increase) FILTER (WHERE role = 'prefill' AND name = 'vllm:nixl_num_kv_expired_reqs_total')     AS p_kv_expired_reqs,
           sum(increase) FILTER (WHERE role = 'prefill' AND name = 'vllm:nixl_num_failed_transfers_total')     AS p_failed_transfers,
           sum(increase) FILTER (WHERE role = 'prefill' AND name = 'vllm:nixl_num_failed_notifications_total') AS p_failed_notifications,
           sum(increase) FILTER (WHERE role = 'decode' AND name = 'vllm:nixl_num_kv_expired_reqs_total')      AS d_kv_expired_reqs,
           sum(increase) FILTER (WHERE role = 'decode' AND name = 'vllm:nixl_num_failed_transfers_total')      AS d_failed_transfers,
           sum(increase) FILTER (WHERE role = 'decode' AND name = 'vllm:nixl_num_failed_notifications_total')  AS d_failed_notifications,
           sum(increase) FILTER (WHERE role = 'prefill' AND name = 'vllm:nixl_num_notifications_after_expiry_total') AS p_notifications_after_expiry,
           sum(increase) FILTER (WHERE role = 'decode' AND name = 'vllm:nixl_num_notifications_after_expiry_total')  AS d_notifications_after_expiry
    FROM metric_increases
    WHERE role IN ('prefill', 'decode')
      AND name IN ('vllm:nixl_num_kv_expired_reqs_total', 'vllm:nixl_num_failed_transfers_total',
                   'vllm:nixl_num_failed_notifications_total', 'vllm:nixl_num_notifications_after_expiry_total')
    GROUP BY run_id
), t AS (
    SELECT run_id, count(*) FILTER (WHERE reuse = 'miss_expired')         AS expired_turns,
                   count(*) FILTER (WHERE reuse = 'miss_transfer_failed') AS transfer_failed_turns
    FROM turns GROUP BY run_id
)
SELECT r.run_id, coalesce(t.expired_turns, 0) AS expired_turns,
       coalesce(t.transfer_failed_turns, 0) AS transfer_failed_turns,
       n.p_kv_expired_reqs, n.p_failed_transfers, n.p_failed_notifications,
       n.d_kv_expired_reqs, n.d_failed_transfers, n.d_failed_notifications,
       n.p_notifications_after_expiry, n.d_notifications_after_expiry
FROM runs r LEFT JOIN t USING (run_id) LEFT JOIN n USING (run_id);

-- Did the run start cold? Each run that turnscope records sends its own cache_salt, so it claims to
-- start with nothing cached; a cache tier a salt or a reset does not reach (a CPU offload tier)
-- would break that claim. Per run, its first ok turn (earliest sent_at): the prompt tokens vLLM
-- found without computing them, from vLLM's own count for that request: in the P/D modes P's
-- remote_prefill_cached_tokens (PrefillStats.num_cached_tokens: its prefix-cache hits plus KV
-- loaded from elsewhere) = turns.prefill_cached_tokens + turns.reused_tokens; in aggregated mode
-- the worker's usage cached_tokens (a P/D turn is one with a prefill leg). cold: none found; NULL
-- where the turn carries no count.
CREATE VIEW run_cold_start AS
WITH f AS (
    SELECT run_id, session_id, turn_index, sent_at, prompt_tokens,
           CASE WHEN prefill_leg_s IS NOT NULL THEN 'prefill'
                WHEN cached_tokens IS NOT NULL THEN 'aggregated' END AS counted_by,
           CASE WHEN prefill_leg_s IS NOT NULL THEN prefill_cached_tokens ELSE cached_tokens END AS local_hit_tokens,
           CASE WHEN prefill_leg_s IS NOT NULL THEN coalesce(reused_tokens, 0) END AS external_tokens
    FROM turns WHERE status = 'ok'
    QUALIFY row_number() OVER (PARTITION BY run_id ORDER BY sent_at, session_id, turn_index) = 1
)
SELECT r.run_id, f.session_id, f.turn_index, f.sent_at, f.prompt_tokens, f.counted_by,
       f.local_hit_tokens, f.external_tokens,
       f.local_hit_tokens + coalesce(f.external_tokens, 0) = 0 AS cold
FROM runs r JOIN f USING (run_id);

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

-- Traffic reports -----------------------------------------------------------------------------

-- Every follow-up request (request_index > 0) with its gap (end of the previous request to this
-- arrival), gap_estimated where the trace does not say when the previous request ended (the
-- reader's estimate, within [0, start to start]; docs/workloads.md "Gaps"). A row written without
-- a gap (a report of an older turnscope) gets the arrival-to-arrival upper bound, estimated.
CREATE VIEW traffic_followups AS
SELECT * FROM (
    SELECT traffic_id, format, source, session_id, parent_session_id, request_index, arrival_s,
           input_tokens, shared_prefix_tokens, coalesce(gap_kind, 'unknown') AS gap_kind, tool_s,
           coalesce(gap_s, arrival_s - lag(arrival_s) OVER w) AS gap_s,
           coalesce(gap_estimated, gap_s IS NULL) AS gap_estimated
    FROM traffic_requests
    WINDOW w AS (PARTITION BY traffic_id, source, session_id ORDER BY request_index)
) WHERE request_index > 0 AND gap_s IS NOT NULL;

-- Share of follow-ups that arrive within each TTL, per gap kind and for all kinds ('all'):
-- 30 s ... 1 h, plus the report's configured ttl_s (configured = true).
CREATE VIEW traffic_ttl AS
WITH ttls AS (
    SELECT l.traffic_id, t.ttl_s, t.ttl_s = l.ttl_s AS configured
    FROM traffic_log l,
         (SELECT unnest([30.0, 60.0, 120.0, 300.0, 480.0, 600.0, 900.0, 1800.0, 3600.0]) AS ttl_s
          UNION SELECT ttl_s FROM traffic_log WHERE ttl_s IS NOT NULL) t
), k AS (
    SELECT traffic_id, gap_kind, gap_s FROM traffic_followups
    UNION ALL SELECT traffic_id, 'all', gap_s FROM traffic_followups
)
SELECT t.traffic_id, k.gap_kind, t.ttl_s, t.configured,
       count(*) AS follow_ups,
       count(*) FILTER (WHERE k.gap_s <= t.ttl_s) AS within_ttl,
       count(*) FILTER (WHERE k.gap_s <= t.ttl_s) / count(*) AS share_within_ttl
FROM ttls t JOIN k USING (traffic_id)
GROUP BY ALL;

-- Gap percentiles per gap kind (quantile_cont: linear interpolation), how many of the gaps are
-- estimates, and the tool part of gaps where the trace says (tool_s over tool_known_gap_s:
-- TraceLab's tool wall latencies).
CREATE VIEW traffic_gaps AS
SELECT traffic_id, gap_kind, count(*) AS follow_ups,
       count(*) FILTER (WHERE gap_estimated) AS estimated_gaps,
       quantile_cont(gap_s, 0.5) AS gap_p50_s, quantile_cont(gap_s, 0.9) AS gap_p90_s,
       quantile_cont(gap_s, 0.99) AS gap_p99_s, max(gap_s) AS gap_max_s,
       sum(tool_s) AS tool_s, sum(gap_s) FILTER (WHERE tool_s IS NOT NULL) AS tool_known_gap_s
FROM (SELECT * FROM traffic_followups UNION ALL BY NAME
      SELECT * REPLACE ('all' AS gap_kind) FROM traffic_followups)
GROUP BY ALL;

-- Input tokens that were a prefix of the session's previous request (reusable) against new ones;
-- reusable_in_ttl_tokens: of those, the ones whose gap is within the configured TTL and whose
-- shared prefix reaches the recompute threshold (what bidirectional P/D could pull rather than
-- recompute; vLLM recomputes a prefix shorter than kv_recompute_threshold).
CREATE VIEW traffic_reuse AS
WITH f AS (SELECT traffic_id, source, session_id, request_index, gap_s FROM traffic_followups)
SELECT r.traffic_id, r.format,
       count(*) AS requests,
       sum(r.input_tokens) AS input_tokens,
       sum(r.shared_prefix_tokens) AS reusable_tokens,
       sum(r.input_tokens - r.shared_prefix_tokens) AS new_tokens,
       sum(r.shared_prefix_tokens) / nullif(sum(r.input_tokens), 0) AS reusable_share,
       coalesce(sum(r.shared_prefix_tokens) FILTER (
           WHERE f.gap_s <= l.ttl_s AND r.shared_prefix_tokens >= l.recompute_threshold_tokens), 0)
           AS reusable_in_ttl_tokens,
       coalesce(sum(r.shared_prefix_tokens) FILTER (
           WHERE f.gap_s <= l.ttl_s AND r.shared_prefix_tokens >= l.recompute_threshold_tokens), 0)
           / nullif(sum(r.input_tokens), 0) AS reusable_in_ttl_share
FROM traffic_requests r JOIN traffic_log l USING (traffic_id)
LEFT JOIN f USING (traffic_id, source, session_id, request_index)
GROUP BY GROUPING SETS ((r.traffic_id), (r.traffic_id, r.format));

-- One row per session: its span on its source's clock and its context growth.
CREATE VIEW traffic_sessions AS
SELECT traffic_id, format, source, session_id, any_value(parent_session_id) AS parent_session_id,
       count(*) AS requests,
       min(arrival_s) AS start_s,
       max(arrival_s + coalesce(server_s, 0)) AS end_s,
       arg_min(input_tokens, request_index) AS first_input_tokens,
       arg_max(input_tokens, request_index) AS last_input_tokens,
       max(input_tokens) AS max_input_tokens,
       CASE WHEN count(*) > 1 THEN regr_slope(input_tokens, request_index) END AS growth_tokens_per_request,
       sum(input_tokens) AS input_tokens,
       sum(shared_prefix_tokens) AS reusable_tokens
FROM traffic_requests
GROUP BY ALL;

-- Sessions of the same source that overlap in time (a sub-agent with its parent, concurrent
-- users): per source the most sessions active at once and how many overlap another one.
CREATE VIEW traffic_overlap AS
WITH ev AS (
    SELECT traffic_id, source, start_s AS t, 1 AS d FROM traffic_sessions
    UNION ALL SELECT traffic_id, source, end_s, -1 FROM traffic_sessions
), c AS (
    SELECT traffic_id, source,
           sum(d) OVER (PARTITION BY traffic_id, source ORDER BY t, d ROWS UNBOUNDED PRECEDING) AS active
    FROM ev
), o AS (
    SELECT traffic_id, source,
           start_s < max(end_s) OVER (PARTITION BY traffic_id, source ORDER BY start_s, session_id
                                      ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING)
           OR lead(start_s) OVER (PARTITION BY traffic_id, source ORDER BY start_s, session_id) < end_s
           AS overlapping
    FROM traffic_sessions
)
SELECT traffic_id, source, m.max_active_sessions, n.sessions, n.overlapping_sessions
FROM (SELECT traffic_id, source, max(active) AS max_active_sessions FROM c GROUP BY ALL) m
JOIN (SELECT traffic_id, source, count(*) AS sessions,
             count(*) FILTER (WHERE coalesce(overlapping, false)) AS overlapping_sessions
      FROM o GROUP BY ALL) n USING (traffic_id, source);

-- One session's timeline: its requests (server time) and the gaps between them, a gap longer
-- than the report's TTL being a 'pause'.
CREATE VIEW traffic_timeline AS
SELECT r.traffic_id, r.source, r.session_id, r.parent_session_id, r.request_index,
       'request' AS segment, r.arrival_s AS start_s, r.arrival_s + coalesce(r.server_s, 0) AS end_s,
       r.input_tokens, r.shared_prefix_tokens
FROM traffic_requests r
UNION ALL
SELECT f.traffic_id, f.source, f.session_id, f.parent_session_id, f.request_index,
       CASE WHEN f.gap_s > l.ttl_s THEN 'pause' ELSE f.gap_kind END,
       f.arrival_s - f.gap_s, f.arrival_s, f.input_tokens, f.shared_prefix_tokens
FROM traffic_followups f JOIN traffic_log l USING (traffic_id);

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

-- The prefill (or aggregated) engine's speed through a run, one row per scrape interval of each
-- endpoint, from the increases of vLLM's request histograms (metric_increases; vLLM 0.32
-- v1/metrics/stats.py update_from_finished_request): prefill_s is the summed prefill time (from a
-- request's first SCHEDULED event to its first token: its compute, time-sliced with whatever else
-- ran on the cores) of the requests that finished in the interval, computed_tokens their new KV
-- tokens (prompt less the local and remote prefix-cache hits), queue_s their summed WAITING time
-- (vLLM counts a request loading remote KV asynchronously as waiting). prefill_s_per_token is the
-- engine's speed over the interval (NULL where nothing was computed).
CREATE VIEW engine_prefill_speed AS
WITH inc AS (
    SELECT run_id, endpoint, any_value(role) AS role, scraped_at,
           sum(increase) FILTER (WHERE name = 'vllm:request_prefill_time_seconds_count') AS prefills,
           sum(increase) FILTER (WHERE name = 'vllm:request_prefill_time_seconds_sum') AS prefill_s,
           sum(increase) FILTER (WHERE name = 'vllm:request_prefill_kv_computed_tokens_sum') AS computed_tokens,
           sum(increase) FILTER (WHERE name = 'vllm:request_queue_time_seconds_sum') AS queue_s
    FROM metric_increases
    WHERE role IN ('prefill', 'aggregated')
      AND name IN ('vllm:request_prefill_time_seconds_count', 'vllm:request_prefill_time_seconds_sum',
                   'vllm:request_prefill_kv_computed_tokens_sum', 'vllm:request_queue_time_seconds_sum')
    GROUP BY run_id, endpoint, scraped_at
)
SELECT run_id, endpoint, role, lag(scraped_at) OVER w AS interval_start, scraped_at AS interval_end,
       epoch(scraped_at) - epoch(lag(scraped_at) OVER w) AS interval_s,
       prefills, prefill_s, computed_tokens, queue_s,
       prefill_s / nullif(computed_tokens, 0) AS prefill_s_per_token
FROM inc
WINDOW w AS (PARTITION BY run_id, endpoint ORDER BY scraped_at);

-- P's own prefix cache per step of a capacity ramp (`turnscope capacity`; P's eviction ladder,
-- `--prefill-kv-tokens`, docs/eviction.md): the KV spaces the step recorded in
-- runs.workload_spec ($.capacity: bytes; NULL where the ramp left P's the topology's), and the
-- worker that computes prompts' own prefix cache over the run (view run_prefix_cache: role
-- 'prefill' in the P/D modes, 'aggregated' for the single worker; tokens, hit_rate 0-1), and the
-- tokens P pulled from D (turns.reused_tokens). One row per run of a ramp.
CREATE VIEW capacity_prefill_cache AS
WITH pc AS (
    SELECT run_id, role, queried_tokens, hit_tokens, hit_rate FROM run_prefix_cache
), x AS (
    SELECT run_id, sum(increase) AS pulled_tokens
    FROM metric_increases
    WHERE role = 'prefill' AND name = 'vllm:prompt_tokens_by_source_total'
      AND json_extract_string(labels, '$.source') = 'external_kv_transfer'
    GROUP BY run_id
), t AS (
    SELECT run_id, sum(reused_tokens) AS proxy_pulled_tokens FROM turns GROUP BY run_id
)
SELECT r.run_id, r.mode,
       json_extract_string(r.workload_spec, '$.capacity.id')                                   AS capacity_id,
       TRY_CAST(json_extract_string(r.workload_spec, '$.capacity.users') AS INTEGER)           AS users,
       TRY_CAST(json_extract_string(r.workload_spec, '$.capacity.prefill_kv_cache_bytes') AS BIGINT)
           AS prefill_kv_cache_bytes,
       TRY_CAST(json_extract_string(r.workload_spec, '$.capacity.aggregated_kv_cache_bytes') AS BIGINT)
           AS aggregated_kv_cache_bytes,
       pc.role AS cache_role, pc.queried_tokens, pc.hit_tokens, pc.hit_rate,
       x.pulled_tokens, coalesce(t.proxy_pulled_tokens, 0) AS proxy_pulled_tokens
FROM runs r
LEFT JOIN pc ON pc.run_id = r.run_id AND pc.role = CASE WHEN r.mode = 'aggregated' THEN 'aggregated' ELSE 'prefill' END
LEFT JOIN x ON x.run_id = r.run_id
LEFT JOIN t ON t.run_id = r.run_id
WHERE json_extract_string(r.workload_spec, '$.capacity.id') IS NOT NULL;
