"""A capacity ramp as ``turnscope capacity`` records it, written with store.writer's real writer;
every value is written out by hand here, and the truths the tests check are computed by hand
below (independently of store/queries/capacity.py and analysis/capacity_crossing.py).

Ramp ``CAP_ID``: modes ``pd`` and ``pd-bidir``, steps ``USERS`` = 1, 2, 4 concurrent sessions,
SLO TTFT <= 0.5 s and TPOT <= 0.05 s (in ``runs.config.slo``). Every step has 10 ok turns, turn i
sent at start + i s with E2E 1.0 s: span = 9 + 1 = 10 s.

- ``pd``: TTFT 0.2 + 0.05 x users s, TPOT 0.02 s; at 2 users turn 7 has TPOT 0.06 s (misses).
  Met SLO: 10, 9, 10 -> goodput 1.0, 0.9, 1.0 turns/s.
- ``pd-bidir``: TTFT 0.15 s (1 user), 0.18 s (2 users), at 4 users 0.15 s for turns 0-5 and 0.9 s
  for turns 6-9 (misses); TPOT 0.02 s. At 2 users an 11th turn failed (status error, sent at
  +5 s, E2E 0.5 s: counted in turns, not in ok or SLO). Met SLO: 10, 10, 6 -> goodput 1.0, 1.0,
  0.6 turns/s; TTFT p90 at 4 users = 0.9 s (rank 0.9 x 9 = 8.1 between two 0.9 s values).
- Crossing (5% tolerance): 1 user: 1.0 vs 1.0 goodput, p90 0.15 vs 0.25: no. 2 users: 1.0 vs 0.9,
  0.18 vs 0.30: no. 4 users: 0.6 < 1.0 x 0.95 and 0.9 > 0.4 x 1.05: crossing at 4, both reasons.

Scrapes of ``pd-bidir`` at 4 users (``BIDIR4``) at +0, +5, +10 s, two decode engines:
D KV usage [0.1, 0.5, 0.3] and [0.05, 0.6, 0.1] -> fullest per scrape [0.1, 0.6, 0.3]: start
0.1, mean 1/3, peak 0.6; D waiting [0, 3, 1] + [1, 1, 1] -> [1, 4, 2]: peak 4, mean 7/3; proxy
handle bytes [0, 8, 4] MiB: peak 8 MiB, mean 4 MiB; D preemptions counter [5, 5, 7] on one
engine: increase 2. Every other step: one decode engine, KV [0.1, 0.2, 0.1], no preemption
counter. A plain eval run (``PLAIN``) is not a step.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from store.writer import Store

T0 = dt.datetime(2026, 12, 1, 9, 0, tzinfo=dt.UTC)
CAP_ID = "capacity-20261201T090000"
USERS = (1, 2, 4)
MODES = ("pd", "pd-bidir")
SLO_TTFT_S, SLO_TPOT_S = 0.5, 0.05
D_KV_BYTES = 16_384 * 4096
PLAIN = "eval-plain"
MiB = 2**20
BIDIR4 = f"{CAP_ID}-pd-bidir-u4"

# hand-computed truths per (mode, users)
EXPECTED_SLO_TURNS = {("pd", 1): 10, ("pd", 2): 9, ("pd", 4): 10,
                      ("pd-bidir", 1): 10, ("pd-bidir", 2): 10, ("pd-bidir", 4): 6}
EXPECTED_TURNS = {k: 11 if k == ("pd-bidir", 2) else 10 for k in EXPECTED_SLO_TURNS}
EXPECTED_GOODPUT = {k: v / 10.0 for k, v in EXPECTED_SLO_TURNS.items()}
EXPECTED_TTFT_P50 = {("pd", 1): 0.25, ("pd", 2): 0.30, ("pd", 4): 0.40,
                     ("pd-bidir", 1): 0.15, ("pd-bidir", 2): 0.18, ("pd-bidir", 4): 0.15}
EXPECTED_TTFT_P90 = EXPECTED_TTFT_P50 | {("pd-bidir", 4): 0.9}
EXPECTED_CROSSING_USERS = 4
EXPECTED_BIDIR4 = {"decode_kv_usage_start": 0.1, "decode_kv_usage_mean": 1 / 3, "decode_kv_usage_max": 0.6,
                   "decode_waiting_max": 4.0, "decode_waiting_mean": 7 / 3, "handle_bytes_max": 8 * MiB,
                   "handle_bytes_mean": 4 * MiB, "decode_preemptions": 2.0}


def run_id(mode: str, users: int) -> str:
    return f"{CAP_ID}-{mode}-u{users}"


def ttft(mode: str, users: int, i: int) -> float:
    if mode == "pd":
        return 0.2 + 0.05 * users
    if users == 4:
        return 0.15 if i < 6 else 0.9
    return {1: 0.15, 2: 0.18}[users]


def tpot(mode: str, users: int, i: int) -> float:
    return 0.06 if (mode, users, i) == ("pd", 2, 7) else 0.02


def _row(rid: str, mode: str, users: int | None, index: int, start: dt.datetime) -> dict:
    spec: dict = {"sessions": 2 * (users or 1), "users": users or 1}
    config: dict = {"kv_bytes_per_token": 4096}
    if users is not None:
        spec["capacity"] = {"id": CAP_ID, "workload": "capacity", "step": index, "users": users,
                            "sessions": 2 * users, "steps": list(USERS), "decode_kv_cache_bytes": D_KV_BYTES,
                            "decode_kv_tokens": 16_384, "decoder_kv_blocks_ttl_s": 20,
                            "slo_ttft_s": SLO_TTFT_S, "slo_tpot_s": SLO_TPOT_S}
        config["slo"] = {"ttft_s": SLO_TTFT_S, "tpot_s": SLO_TPOT_S}
    return {"run_id": rid, "label": "capacity", "mode": mode, "workload": "capacity", "workload_spec": spec,
            "history_mode": "token_ids", "model": "turnscope-tiny", "config": config, "started_at": start,
            "status": "complete", "finished_at": start + dt.timedelta(seconds=12),
            "updated_at": start + dt.timedelta(seconds=12)}


def _sample(rid, at, endpoint, role, name, value, engine="0") -> dict:
    return {"run_id": rid, "scraped_at": at, "endpoint": endpoint, "role": role, "name": name,
            "labels": {"engine": engine, "model_name": "turnscope-tiny"}, "value": value}


def _metrics(w, rid: str, start: dt.datetime) -> None:
    d0, d1, proxy = "http://127.0.0.1:8101", "http://127.0.0.1:8103", "http://127.0.0.1:8200"
    for k, at in enumerate(start + dt.timedelta(seconds=s) for s in (0, 5, 10)):
        if rid == BIDIR4:
            w.append("metric_samples", _sample(rid, at, d0, "decode", "vllm:kv_cache_usage_perc", [0.1, 0.5, 0.3][k]))
            w.append("metric_samples", _sample(rid, at, d1, "decode", "vllm:kv_cache_usage_perc", [0.05, 0.6, 0.1][k]))
            w.append("metric_samples", _sample(rid, at, d0, "decode", "vllm:num_requests_waiting", [0, 3, 1][k]))
            w.append("metric_samples", _sample(rid, at, d1, "decode", "vllm:num_requests_waiting", 1.0))
            w.append("metric_samples", _sample(rid, at, proxy, "proxy", "turnscope_handle_bytes_live",
                                               [0, 8 * MiB, 4 * MiB][k]))
            w.append("metric_samples", _sample(rid, at, d0, "decode", "vllm:num_preemptions_total", [5, 5, 7][k]))
        else:
            w.append("metric_samples", _sample(rid, at, d0, "decode", "vllm:kv_cache_usage_perc", [0.1, 0.2, 0.1][k]))


def build(root: Path) -> Path:
    """Write the store under ``root``; returns ``root``."""
    store = Store(root)
    store.init()
    with store.writer(PLAIN, "test") as w:
        w.append("runs_log", _row(PLAIN, "pd", None, 0, T0 - dt.timedelta(hours=1)))
        w.append("turns", {"run_id": PLAIN, "session_id": "s0", "turn_index": 0, "sent_at": T0 - dt.timedelta(hours=1),
                           "ttft_s": 5.0, "e2e_s": 6.0, "tpot_s": 0.02, "status": "ok"})
    k = 0
    for mode in MODES:
        for index, users in enumerate(USERS):
            rid = run_id(mode, users)
            start = T0 + dt.timedelta(minutes=k)
            k += 1
            with store.writer(rid, "test") as w:
                w.append("runs_log", _row(rid, mode, users, index, start))
                for i in range(10):
                    w.append("turns", {"run_id": rid, "session_id": f"s{i % users}", "turn_index": i // users,
                                       "sent_at": start + dt.timedelta(seconds=i), "ttft_s": ttft(mode, users, i),
                                       "tpot_s": tpot(mode, users, i), "e2e_s": 1.0, "status": "ok",
                                       "reuse": "hit" if mode == "pd-bidir" and i >= users else None})
                if (mode, users) == ("pd-bidir", 2):
                    w.append("turns", {"run_id": rid, "session_id": "s9", "turn_index": 0,
                                       "sent_at": start + dt.timedelta(seconds=5), "ttft_s": None, "e2e_s": 0.5,
                                       "status": "error", "error": "upstream 500"})
                _metrics(w, rid, start)
    return root
