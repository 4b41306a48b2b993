"""P's eviction ladder as ``turnscope capacity --prefill-kv-tokens`` records it, written with
store.writer's real writer; every value is written out by hand here and the truths the
tests check are computed by hand below (independently of store/queries/capacity.py,
data/schema.sql's capacity_prefill_cache and analysis/eviction_window.py).

Ramp ``CAP_ID``: modes ``pd`` and ``pd-bidir``, steps ``USERS`` = 1, 2, 4, 6 concurrent sessions;
P's KV space 16,384 tokens, D's 32,768 (x 4,096 bytes), the aggregated worker's their sum. SLO
TTFT <= 0.5 s, TPOT <= 0.05 s. Every step: 4 sessions s0-s3 of 3 turns (12 ok turns), turn k of
session j sent at start + (3j + k) s with E2E 1.0 s: span 11 + 1 = 12 s. Turn 0: TTFT 0.5 s in
both modes (nothing to reuse). Later turns (turn_index 1, 2):

- ``pd``: 0.10, 0.20, 0.40, 0.40 s at 1, 2, 4, 6 sessions.
- ``pd-bidir``: 0.10 s at 1; at 2, sessions s0, s1 0.10 s and s2, s3 0.12 s (median 0.11 s); 0.10 s
  at 4; 0.80 s at 6 (misses the SLO).

Speed-up pd / pd-bidir of later-turn medians: 1.0 (every resample too: the interval is the point 1,
not above 1: no clear difference), 0.20 / 0.11 = 1.818 (every resample's pd-bidir median is
between 0.10 and 0.12 s: interval within 1.667-2.0, above 1: faster), 4.0 (faster), 0.5 (slower).
Crossing: at 6 pd-bidir meets the SLO on 4 of 12 turns (goodput 4/12 vs 12/12 turns/s) and its
TTFT p90 is 0.8 s against pd's 0.5 s (8 of its 12 turns at 0.8 s), at 1-4 the goodputs (12/12) and
p90s (0.5 s, 4 of 12 turns) are equal: the crossing is at 6, by goodput and TTFT p90. The window:
2 and 4 sessions (pays from 2: faster at 2 and 4; at 1 no clear difference).

P's prefix-cache counters (role prefill, one engine, scrapes at +0, +6, +12 s): queries 1,000 ->
1,000 + Q/2 -> 1,000 + Q with Q = 10,000, hits 500 -> 500 + H/2 -> 500 + H with H per step below,
so the increase over the run is (Q, H) and the hit rate H / Q. Tokens pulled from D, as the
proxy split them (turns.reused_tokens): pd-bidir's later turns 100 tokens each at 1-4 sessions,
900 at 6: 800 and 7,200 per step; as vLLM counted them (P's
``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}``, 0 -> X/2 -> X): X = 900,
1,000, 1,500, 9,000 at 1, 2, 4, 6 sessions (pd: no such series). D's KV usage
(``vllm:kv_cache_usage_perc``, one decode engine, the same three scrapes): pd-bidir peaks 0.3, 0.5,
0.97, 1.0 at 1, 2, 4, 6 sessions (D full, >= 0.95, from 4 on), pd 0.2 at every step.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from store.writer import Store

T0 = dt.datetime(2026, 12, 6, 9, 0, tzinfo=dt.UTC)
CAP_ID = "ev-test"
USERS = (1, 2, 4, 6)
MODES = ("pd", "pd-bidir")
P_KV_BYTES, D_KV_BYTES = 16_384 * 4096, 32_768 * 4096
SLO_TTFT_S, SLO_TPOT_S = 0.5, 0.05
QUERIED = 10_000
HITS = {("pd", 1): 9_000, ("pd", 2): 8_000, ("pd", 4): 5_000, ("pd", 6): 3_000,
        ("pd-bidir", 1): 9_000, ("pd-bidir", 2): 8_500, ("pd-bidir", 4): 6_000, ("pd-bidir", 6): 4_000}
PULLED_PER_TURN = {1: 100, 2: 100, 4: 100, 6: 900}
VLLM_PULLED = {1: 900, 2: 1_000, 4: 1_500, 6: 9_000}
D_PEAK = {1: 0.3, 2: 0.5, 4: 0.97, 6: 1.0}
EXPECTED_D_FULL = 4

# hand-computed truths
EXPECTED_HIT_RATE = {k: v / QUERIED for k, v in HITS.items()}
EXPECTED_PROXY_PULLED = {u: 8 * PULLED_PER_TURN[u] for u in USERS}
EXPECTED_PULLED = VLLM_PULLED
EXPECTED_SPEEDUP = {1: 1.0, 2: 0.20 / 0.11, 4: 4.0, 6: 0.5}
EXPECTED_VERDICT = {1: "no clear difference", 2: "faster", 4: "faster", 6: "slower"}
EXPECTED_CROSSING = 6
EXPECTED_WINDOW = (2, 4)


def run_id(mode: str, users: int) -> str:
    return f"{CAP_ID}-{mode}-u{users}"


def later_ttft(mode: str, users: int, session: int) -> float:
    if mode == "pd":
        return {1: 0.10, 2: 0.20, 4: 0.40, 6: 0.40}[users]
    if users == 2:
        return 0.10 if session < 2 else 0.12
    return {1: 0.10, 4: 0.10, 6: 0.80}[users]


def _row(rid: str, mode: str, users: int, index: int, start: dt.datetime) -> dict:
    spec = {"sessions": 4, "users": users, "capacity": {
        "id": CAP_ID, "workload": "eviction", "step": index, "users": users, "sessions": 4, "steps": list(USERS),
        "decode_kv_cache_bytes": D_KV_BYTES, "decode_kv_tokens": 32_768, "decoder_kv_blocks_ttl_s": 20,
        "slo_ttft_s": SLO_TTFT_S, "slo_tpot_s": SLO_TPOT_S, "prefill_kv_cache_bytes": P_KV_BYTES,
        "prefill_kv_tokens": 16_384, "aggregated_kv_cache_bytes": P_KV_BYTES + D_KV_BYTES}}
    config = {"kv_bytes_per_token": 4096, "slo": {"ttft_s": SLO_TTFT_S, "tpot_s": SLO_TPOT_S}}
    return {"run_id": rid, "label": "capacity", "mode": mode, "workload": "eviction", "workload_spec": spec,
            "history_mode": "token_ids", "model": "turnscope-tiny", "config": config, "started_at": start,
            "status": "complete", "finished_at": start + dt.timedelta(seconds=12),
            "updated_at": start + dt.timedelta(seconds=12)}


def _sample(rid, at, role, name, value, **labels) -> dict:
    return {"run_id": rid, "scraped_at": at, "endpoint": "http://127.0.0.1:8100", "role": role, "name": name,
            "labels": {"engine": "0", "model_name": "turnscope-tiny"} | labels, "value": value}


def build(root: Path) -> Path:
    """Write the store under ``root``; returns ``root``."""
    store = Store(root)
    store.init()
    k = 0
    for mode in MODES:
        for index, users in enumerate(USERS):
            rid = run_id(mode, users)
            start = T0 + dt.timedelta(minutes=k)
            k += 1
            with store.writer(rid, "test") as w:
                w.append("runs_log", _row(rid, mode, users, index, start))
                for j in range(4):
                    for t in range(3):
                        ttft = 0.5 if t == 0 else later_ttft(mode, users, j)
                        pulled = PULLED_PER_TURN[users] if (mode == "pd-bidir" and t > 0) else 0
                        w.append("turns", {"run_id": rid, "session_id": f"s{j}", "turn_index": t,
                                           "sent_at": start + dt.timedelta(seconds=3 * j + t), "ttft_s": ttft,
                                           "tpot_s": 0.02, "e2e_s": 1.0, "status": "ok", "reused_tokens": pulled,
                                           "reuse": ("hit" if t > 0 else "miss_first_turn") if mode == "pd-bidir"
                                           else ("miss_no_handle_returned" if t > 0 else "miss_first_turn")})
                for n, at in enumerate(start + dt.timedelta(seconds=s) for s in (0, 6, 12)):
                    w.append("metric_samples", _sample(rid, at, "prefill", "vllm:prefix_cache_queries_total",
                                                       1_000 + QUERIED * n / 2))
                    w.append("metric_samples", _sample(rid, at, "prefill", "vllm:prefix_cache_hits_total",
                                                       500 + HITS[(mode, users)] * n / 2))
                    peak = D_PEAK[users] if mode == "pd-bidir" else 0.2
                    w.append("metric_samples", _sample(rid, at, "decode", "vllm:kv_cache_usage_perc",
                                                       [0.1, peak, 0.1][n]) | {"endpoint": "http://127.0.0.1:8101"})
                    if mode == "pd-bidir":
                        w.append("metric_samples", _sample(rid, at, "prefill", "vllm:prompt_tokens_by_source_total",
                                                           VLLM_PULLED[users] * n / 2, source="external_kv_transfer"))
                        w.append("metric_samples", _sample(rid, at, "prefill", "vllm:prompt_tokens_by_source_total",
                                                           5_000 * n, source="local_compute"))
    return root
