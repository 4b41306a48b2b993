"""A small, fully known store for the dashboard tests, written with loadgen.store's real writer.

Four runs of one workload (``coding-agent``, history ``token_ids``) in three modes:

- ``agg-1``      aggregated        (no proxy: reuse NULL)
- ``bidir-1``    pd-bidir          (later turns hit; one timed-out turn with no TTFT)
- ``bidir-2``    pd-bidir          (one ``miss_mismatch`` turn; prefill counter resets once)
- ``bnc-1``      pd-bidir-nocache  (every later turn ``miss_no_handle_returned``)

Each run has 3 sessions of 4 turns (turn_index 0..3). There is no ``pd-nocache`` run, so only the
``pd-bidir`` vs ``aggregated`` headline exists. The expected numbers are written out here by hand
(`EXPECTED_*`), independently of the dashboard's code.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from loadgen.store import Store

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
# Tokens pulled during each run, by hand: increases between scrapes, a drop counts its new value.
#   bidir-1: 8100: 0 + 512 + 512 + 1024 = 2048; 8101: 256 + 0 = 256   -> 2304
#   bidir-2: 512 + 50 (reset 612 -> 50) + 512 + 512                    -> 1586
EXPECTED_EXTERNAL_TOKENS = {"bidir-1": 2304.0, "bidir-2": 1586.0, "bnc-1": 0.0}


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
    if mode == "pd-bidir":
        return 0.120 + 0.005 * turn + 0.010 * session + (0.004 if run_id == "bidir-2" else 0.0)
    return 0.330 + 0.040 * turn + 0.010 * session  # pd-bidir-nocache, every turn a miss


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
    return "hit"


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
                "started_at": start,
            }
            w.append("runs_log", {**base, "status": "running", "updated_at": start})
            end = start + dt.timedelta(minutes=5)
            w.append("runs_log", {**base, "status": "complete", "finished_at": end, "updated_at": end})
            for s in range(SESSIONS):
                sid = f"{run_id}-s{s}"
                w.append(
                    "sessions",
                    {
                        "session_id": sid,
                        "archetype": "coding",
                        "source": "synthetic",
                        "turns": TURNS,
                        "started_at": start + dt.timedelta(seconds=s),
                        "status": "ok",
                    },
                )
                for t in range(TURNS):
                    ttft = ttft_s(run_id, s, t)
                    w.append(
                        "turns",
                        {
                            "session_id": sid,
                            "turn_index": t,
                            "request_id": f"{sid}-t{t}",
                            "kind": "turn",
                            "gap_before_s": 0.0 if t == 0 else 2.0,
                            "gap_kind": "none" if t == 0 else "tool",
                            "sent_at": start + dt.timedelta(seconds=s + 10 * t),
                            "ttft_s": ttft,
                            "e2e_s": None if ttft is None else ttft + 0.5,
                            "prompt_tokens": 1000 + 300 * t,
                            "completion_tokens": None if ttft is None else 32,
                            "status": "ok" if ttft is not None else "timeout",
                            "reuse": reuse(run_id, s, t),
                            "reused_tokens": 1024 if reuse(run_id, s, t) == "hit" else 0,
                        },
                    )
            for endpoint, points in EXTERNAL_KV.get(run_id, {}).items():
                for sec, value in points:
                    at = start + dt.timedelta(seconds=sec)
                    w.append(
                        "metric_samples",
                        {
                            "scraped_at": at,
                            "endpoint": endpoint,
                            "role": "prefill",
                            "name": PREFILL_COUNTER,
                            "labels": {"model_name": "tiny-llama", "source": "external_kv_transfer"},
                            "value": float(value),
                        },
                    )
                    # Must not count: another source on P, and the same series on D.
                    w.append(
                        "metric_samples",
                        {
                            "scraped_at": at,
                            "endpoint": endpoint,
                            "role": "prefill",
                            "name": PREFILL_COUNTER,
                            "labels": {"model_name": "tiny-llama", "source": "local_compute"},
                            "value": float(10 * value + 7),
                        },
                    )
                    w.append(
                        "metric_samples",
                        {
                            "scraped_at": at,
                            "endpoint": "http://127.0.0.1:8200",
                            "role": "decode",
                            "name": PREFILL_COUNTER,
                            "labels": {"model_name": "tiny-llama", "source": "external_kv_transfer"},
                            "value": float(3 * value),
                        },
                    )
        finally:
            w.close()
    return root
