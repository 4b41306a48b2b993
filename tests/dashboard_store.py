"""A small, fully known store for the dashboard tests, written with store.writer's real writer.

Four runs of one workload (``coding-agent``, history ``token_ids``) in three modes:

- ``agg-1``      aggregated        (no proxy: reuse NULL; the server's cached_tokens instead)
- ``bidir-1``    pd-bidir          (later turns hit; one timed-out turn with no TTFT)
- ``bidir-2``    pd-bidir          (one ``miss_mismatch`` turn; prefill counter resets once)
- ``bnc-1``      pd-bidir-nocache  (every later turn ``miss_no_handle_returned``)

Each run has 3 sessions of 4 turns (turn_index 0..3), the same plan in every run:

- turn 1: kind ``turn`` after a 2 s ``tool`` gap; turn 2: ``turn`` after a 5 s ``think`` gap;
- turn 3: session 0 ``resume`` after a 500 s ``pause`` (past the 480 s TTL: ``miss_expired`` in
  pd-bidir), session 1 ``retry`` after 1 s ``tool``, session 2 ``edit`` after 3 s ``think``;
- sessions 0 and 1 are archetype ``coding``, session 2 ``support``.

There is no ``pd-nocache`` run, so only the ``pd-bidir`` vs ``aggregated`` headline exists. Every
value is a function below (`ttft_s`, `reuse`, `turn_row`, ...) or a constant written out by hand
(`EXPECTED_*`), independently of the dashboard's code; tests recompute their truths from these.
"""

from __future__ import annotations

import datetime as dt
import math
from pathlib import Path

from store.writer import Store

T0 = dt.datetime(2026, 11, 1, 10, 0, tzinfo=dt.UTC)
WORKLOAD = "coding-agent"
HISTORY = "token_ids"
RUNS = {  # run_id -> (mode, label, start offset in minutes)
    "agg-1": ("aggregated", "baseline", 0),
    "bidir-1": ("pd-bidir", "bidir a", 10),
    "bidir-2": ("pd-bidir", "bidir b", 20),
    "bnc-1": ("pd-bidir-nocache", "bidir nocache", 30),
}
SESSIONS = 3
TURNS = 4
PREFILL_COUNTER = "vllm:prompt_tokens_by_source_total"
KV_BYTES_PER_TOKEN = 4096
TTL_S = 480.0  # decoder_kv_blocks_ttl of every run (bnc-1 leaves it out: the default applies)
MARGIN_S = 30.0  # the proxy's handle TTL margin (not in runs.config: the default applies)
BLOCK = 128  # tokens per KV block: reuse is whole blocks
PROXY_S = 0.030  # TTFT - prefill leg of every P/D turn
TIMEOUT_S = 120.0  # how long the timed-out turn ran
ARCHETYPES = {0: "coding", 1: "coding", 2: "support"}

# Counter values of the prefill workers' external_kv_transfer series: run -> endpoint ->
# [(seconds after run start, value)].
EXTERNAL_KV = {
    "bidir-1": {
        "http://127.0.0.1:8100": [(0, 5000), (10, 5000), (20, 5512), (30, 6024), (40, 7048)],
        "http://127.0.0.1:8101": [(5, 0), (15, 256), (25, 256)],
    },
    "bidir-2": {"http://127.0.0.1:8100": [(0, 100), (10, 612), (20, 50), (30, 562), (40, 1074)]},
    "bnc-1": {"http://127.0.0.1:8100": [(0, 0), (10, 0), (20, 0)]},
}
# The workers' own prefix-cache counters (tokens): run -> (endpoint, role, [(seconds after run start,
# queries, hits)]); bidir-2 and bnc-1 expose none. By hand: bidir-1's P looked up 3,000 tokens over
# the run and found 1,400 (the restart at 20 s counts its new values whole: 1,000 + 500 + 1,500
# looked up, 400 + 200 + 800 found); agg-1's worker 2,000 and 1,500.
PREFIX_CACHE = {
    "bidir-1": ("http://127.0.0.1:8100", "prefill", [(0, 0, 0), (10, 1000, 400), (20, 500, 200), (30, 2000, 1000)]),
    "agg-1": ("http://127.0.0.1:8000", "aggregated", [(0, 100, 10), (15, 2100, 1510)]),
}
PREFIX_CACHE_RATE = {"bidir-1": 1400 / 3000, "agg-1": 1500 / 2000}
# Tokens pulled during each run, by hand: increases between scrapes, a drop counts its new value.
#   bidir-1: 8100: 0 + 512 + 512 + 1024 = 2048; 8101: 256 + 0 = 256   -> 2304
#   bidir-2: 512 + 50 (reset 612 -> 50) + 512 + 512                    -> 1586
EXPECTED_EXTERNAL_TOKENS = {"bidir-1": 2304.0, "bidir-2": 1586.0, "bnc-1": 0.0}

# Memory scrapes every 60 s from the run's start (11 of them): P's and D's KV usage (fraction),
# the proxy's live handle bytes, and P's NIXL transfer-time histogram (_sum s, _count).
MEMORY_SCRAPE_S = [60 * i for i in range(11)]
P_USAGE = [0.05 + 0.01 * i for i in range(11)]
D_USAGE = [0.10 + 0.02 * i for i in range(11)]
AGG_USAGE = [0.20 + 0.01 * i for i in range(11)]
MIB = 1 << 20
HANDLE_BYTES = {
    "bidir-1": [0, 4 * MIB, 8 * MIB, 8 * MIB, 4 * MIB, 0, 0, 0, 2 * MIB, 0, 0],
    "bidir-2": [0, 2 * MIB, 6 * MIB, 6 * MIB, 0, 0, 0, 0, 0, 0, 0],
    "bnc-1": [0] * 11,
}
# Cumulative values of vllm:nixl_xfer_time_seconds_sum on P (the first scrape predates the run).
NIXL_XFER_SUM = {
    "bidir-1": [3.0, 3.0, 3.05, 3.10, 3.12, 3.12, 3.12, 3.12, 3.13, 3.13, 3.13],
    "bidir-2": [0.0, 0.02, 0.06, 0.09, 0.09, 0.09, 0.09, 0.09, 0.09, 0.09, 0.09],
}
NIXL_XFER_COUNT = {
    "bidir-1": [7, 7, 9, 11, 12, 12, 12, 12, 13, 13, 13],
    "bidir-2": [0, 1, 3, 4, 4, 4, 4, 4, 4, 4, 4],
}
# By hand: P's NIXL seconds during each run (last - first value, no resets).
EXPECTED_XFER_S = {"bidir-1": 0.13, "bidir-2": 0.09}
# By hand: GiB x s of handle bytes held, each scrape's value held 60 s until the next one.
EXPECTED_HELD_GIB_S = {
    "bidir-1": (4 + 8 + 8 + 4 + 2) * MIB * 60 / 2**30,
    "bidir-2": (2 + 6 + 6) * MIB * 60 / 2**30,
    "bnc-1": 0.0,
}


def gap(session: int, turn: int) -> tuple[float, str, str]:
    """(gap_before_s, gap_kind, kind) of a turn: the same plan in every run."""
    if turn == 0:
        return 0.0, "none", "turn"
    if turn == 1:
        return 2.0, "tool", "turn"
    if turn == 2:
        return 5.0, "think", "turn"
    return {0: (500.0, "pause", "resume"), 1: (1.0, "tool", "retry"), 2: (3.0, "think", "edit")}[session]


def ttft_s(run_id: str, session: int, turn: int) -> float | None:
    """The TTFT the fixture records for a turn (seconds), None for the one failed turn."""
    mode = RUNS[run_id][0]
    if run_id == "bidir-1" and session == 1 and turn == 3:
        return None  # timed out
    if mode == "aggregated":
        return 0.300 + 0.050 * turn + 0.010 * session
    if turn == 0:
        return 0.320 + 0.010 * session
    if run_id == "bidir-2" and session == 2 and turn == 2:
        return 0.400  # a mismatch: recomputed
    if mode == "pd-bidir" and reuse(run_id, session, turn) == "hit":
        return 0.120 + 0.005 * turn + 0.010 * session + (0.004 if run_id == "bidir-2" else 0.0)
    return 0.330 + 0.040 * turn + 0.010 * session  # a miss: the whole prompt recomputed


def e2e_s(run_id: str, session: int, turn: int) -> float | None:
    ttft = ttft_s(run_id, session, turn)
    return None if ttft is None else ttft + 0.5


def reuse(run_id: str, session: int, turn: int) -> str | None:
    mode = RUNS[run_id][0]
    if mode == "aggregated":
        return None
    if turn == 0:
        return "miss_first_turn"
    if mode == "pd-bidir-nocache":
        return "miss_no_handle_returned"
    if run_id == "bidir-2" and session == 2 and turn == 2:
        return "miss_mismatch"
    if gap(session, turn)[0] >= TTL_S - MARGIN_S:
        return "miss_expired"
    return "hit"


def prompt_tokens(turn: int) -> int:
    return 1000 + 300 * turn


def expected_reusable(session: int, turn: int) -> int | None:
    """The previous prompt + its 32 output tokens; the edited turn keeps only 700 of them."""
    if turn == 0:
        return None
    if gap(session, turn)[2] == "edit":
        return 700
    return prompt_tokens(turn - 1) + 32


def turn_row(run_id: str, session: int, turn: int, sent_at: dt.datetime) -> dict:
    """The turns row of one turn (without run_id)."""
    mode = RUNS[run_id][0]
    sid = f"{run_id}-s{session}"
    ttft = ttft_s(run_id, session, turn)
    outcome = reuse(run_id, session, turn)
    gap_s, gap_kind, kind = gap(session, turn)
    expected = expected_reusable(session, turn)
    ok = ttft is not None
    pd_mode = mode != "aggregated"
    reused = (expected // BLOCK) * BLOCK if outcome == "hit" else 0
    p_cached = 512 if outcome == "miss_mismatch" else 0
    row = {
        "session_id": sid,
        "turn_index": turn,
        "request_id": f"{sid}-t{turn}",
        "kind": kind,
        "gap_before_s": gap_s,
        "gap_kind": gap_kind,
        "sent_at": sent_at,
        "ttft_s": ttft,
        "e2e_s": e2e_s(run_id, session, turn),
        "itl_p50_s": 0.010 + 0.001 * turn if ok else None,
        "prompt_tokens": prompt_tokens(turn),
        "completion_tokens": 32 if ok else None,
        "expected_reusable_tokens": expected,
        "status": "ok" if ok else "timeout",
        "reuse": outcome,
        "reused_tokens": reused if pd_mode else None,
    }
    if pd_mode and ok:
        row |= {
            "prefill_leg_s": ttft - PROXY_S,
            "prefill_cached_tokens": p_cached,
            "remote_tokens": reused,
            "recomputed_tokens": prompt_tokens(turn) - reused - p_cached,
            "handle_age_s": gap_s + 0.1 if outcome == "hit" else None,
        }
    if not pd_mode and ok:
        row["cached_tokens"] = 0 if expected is None else (expected // BLOCK) * BLOCK
    return row


def sent_at(run_id: str, session: int, turn: int) -> dt.datetime:
    """Session s starts s seconds after its run; each turn is sent its gap after the last ended."""
    start = T0 + dt.timedelta(minutes=RUNS[run_id][2], seconds=session)
    for t in range(1, turn + 1):
        start += dt.timedelta(seconds=e2e_s(run_id, session, t - 1) + gap(session, t)[0])
    return start


def session_row(run_id: str, session: int) -> dict:
    """The sessions row: task latency = first send -> last end, split like loadgen.session."""
    first = sent_at(run_id, session, 0)
    last = TURNS - 1
    last_end = sent_at(run_id, session, last) + dt.timedelta(
        seconds=e2e_s(run_id, session, last) or TIMEOUT_S
    )
    gaps = {"tool": 0.0, "think": 0.0, "pause": 0.0}
    for t in range(1, TURNS):
        g, kind, _ = gap(session, t)
        gaps[kind] += g
    return {
        "session_id": f"{run_id}-s{session}",
        "archetype": ARCHETYPES[session],
        "source": "synthetic",
        "turns": TURNS,
        "started_at": first,
        "finished_at": last_end,
        "task_latency_s": (last_end - first).total_seconds(),
        "llm_s": math.fsum(e2e_s(run_id, session, t) or 0.0 for t in range(TURNS)),
        "tool_wait_s": gaps["tool"],
        "think_s": gaps["think"],
        "pause_s": gaps["pause"],
        "status": "ok" if all(ttft_s(run_id, session, t) is not None for t in range(TURNS)) else "error",
    }


def config(run_id: str) -> dict:
    if run_id == "bnc-1":
        return {"kv_bytes_per_token": KV_BYTES_PER_TOKEN}  # TTL left out: vLLM's default 480 s
    # the proxy's routing as `turnscope eval` records it (both pd-bidir runs alike: the Compare page pools them)
    proxy = {"prefill_routing": "session", "decode_routing": "session"} if run_id.startswith("bidir") else {}
    return {"connector": {"decoder_kv_blocks_ttl": int(TTL_S)}, "kv_bytes_per_token": KV_BYTES_PER_TOKEN,
            "topology": {"proxy": proxy}}


def _sample(w, at, endpoint, role, name, value, labels=None) -> None:
    w.append(
        "metric_samples",
        {
            "scraped_at": at,
            "endpoint": endpoint,
            "role": role,
            "name": name,
            "labels": labels or {"model_name": "tiny-llama"},
            "value": float(value),
        },
    )


def build(root: Path) -> Path:
    """Write the store under `root` (Store.init + one ShardWriter per run); returns `root`."""
    store = Store(root)
    store.init()
    for run_id, (mode, label, offset_min) in RUNS.items():
        start = T0 + dt.timedelta(minutes=offset_min)
        w = store.writer(run_id, "test", flush_interval_s=60)
        try:
            base = {
                "label": label,
                "mode": mode,
                "workload": WORKLOAD,
                "history_mode": HISTORY,
                "model": "tiny-llama",
                "versions": {"vllm": "0.32.0", "nixl": "1.5.1", "turnscope": "0.1.0"},
                "config": config(run_id),
                "started_at": start,
            }
            w.append("runs_log", {**base, "status": "running", "updated_at": start})
            end = start + dt.timedelta(minutes=15)
            w.append("runs_log", {**base, "status": "complete", "finished_at": end, "updated_at": end})
            for s in range(SESSIONS):
                w.append("sessions", session_row(run_id, s))
                for t in range(TURNS):
                    w.append("turns", turn_row(run_id, s, t, sent_at(run_id, s, t)))
            for endpoint, points in EXTERNAL_KV.get(run_id, {}).items():
                for sec, value in points:
                    at = start + dt.timedelta(seconds=sec)
                    labels = {"model_name": "tiny-llama", "source": "external_kv_transfer"}
                    _sample(w, at, endpoint, "prefill", PREFILL_COUNTER, value, labels)
                    # Must not count: another source on P, and the same series on D.
                    local = {"model_name": "tiny-llama", "source": "local_compute"}
                    _sample(w, at, endpoint, "prefill", PREFILL_COUNTER, 10 * value + 7, local)
                    _sample(w, at, "http://127.0.0.1:8200", "decode", PREFILL_COUNTER, 3 * value, labels)
            if run_id in PREFIX_CACHE:
                endpoint, role, points = PREFIX_CACHE[run_id]
                for sec, queried, hit in points:
                    at = start + dt.timedelta(seconds=sec)
                    _sample(w, at, endpoint, role, "vllm:prefix_cache_queries_total", queried)
                    _sample(w, at, endpoint, role, "vllm:prefix_cache_hits_total", hit)
                    # Must not count: D's own prefix cache
                    _sample(w, at, "http://127.0.0.1:8200", "decode", "vllm:prefix_cache_hits_total", 9 * hit)
            for i, sec in enumerate(MEMORY_SCRAPE_S):
                at = start + dt.timedelta(seconds=sec, milliseconds=500)
                if mode == "aggregated":
                    _sample(w, at, "http://127.0.0.1:8000", "aggregated", "vllm:kv_cache_usage_perc", AGG_USAGE[i])
                    continue
                p_labels = {"model_name": "tiny-llama", "pid": "11"}
                _sample(w, at, "http://127.0.0.1:8100", "prefill", "vllm:kv_cache_usage_perc", P_USAGE[i], p_labels)
                # An idle API-server process's copy of the gauge: 0, never the value.
                idle = {"model_name": "tiny-llama", "pid": "12"}
                _sample(w, at, "http://127.0.0.1:8100", "prefill", "vllm:kv_cache_usage_perc", 0.0, idle)
                _sample(w, at, "http://127.0.0.1:8200", "decode", "vllm:kv_cache_usage_perc", D_USAGE[i])
                _sample(w, at, "http://127.0.0.1:8300", "proxy", "turnscope_handle_bytes_live", HANDLE_BYTES[run_id][i])
                if run_id in NIXL_XFER_SUM:
                    p = "http://127.0.0.1:8100"
                    _sample(w, at, p, "prefill", "vllm:nixl_xfer_time_seconds_sum", NIXL_XFER_SUM[run_id][i])
                    _sample(w, at, p, "prefill", "vllm:nixl_xfer_time_seconds_count", NIXL_XFER_COUNT[run_id][i])
        finally:
            w.close()
    return root


def raw_sql(root: Path, sql: str) -> list[tuple]:
    """Hand-written SQL straight over the Parquet shards (not the store's views): {turns},
    {runs_log}, {sessions} and {metric_samples} are read_parquet of every shard, and {modes} is
    (run_id, mode) per run."""
    import duckdb

    glob = {
        t: f"read_parquet('{root}/runs/*/{t}/*.parquet', union_by_name=true)"
        for t in ("turns", "runs_log", "sessions", "metric_samples")
    }
    glob["modes"] = f"(SELECT DISTINCT run_id, mode FROM {glob['runs_log']})"
    con = duckdb.connect()
    try:
        return con.execute(sql.format(**glob)).fetchall()
    finally:
        con.close()
