"""The ledger of retention strategies against hand-computed cases (planner/ledger.py).

Profile (as tests/unit/test_planner_simulate.py): block 128, 4096 KV bytes/token, c(x) = 1e-4 x,
b0 10 ms, pull 1 GB/s; plus 2 GPUs per worker and a host tier whose read costs 1 ms + 4096 bytes
per token at the given bandwidth. No queueing (``queue_prefills`` False), so each TTFT is the
profile's formula alone.

Traffic ``alternating``: session a (1000 tokens) at 0 s, session b (1000) at 10 s, a's second turn
(1300 tokens, sharing its first 1000) at 20 s; each request's server time 1 s (the last ends at
21 s). P's GPU space is 1200 tokens: b's prompt evicts a's, so a's second turn finds nothing in
GPU memory; the host tier (1 GB) still holds a's 1000 tokens: whole blocks of min(1000, 1299) =
896 tokens come back from host memory.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from loadgen.traces.agent_request import AgentRequest
from planner.ledger import Prices, ledger
from planner.profile import CostProfile
from planner.simulate import PlanSettings, Traffic, plan

GiB = 2**30
KV = 4096
SRC = {"source": "hand-made for the test"}
NO_QUEUE = PlanSettings(queue_prefills=False)


def profile(host_bw: float = 4.096e9, **extra) -> CostProfile:
    return CostProfile.model_validate({
        "name": "test", "block_size": 128, "kv_bytes_per_token": {"value": KV} | SRC,
        "prefill_a1_s_per_token": {"value": 1e-4} | SRC, "b0_default_s": {"value": 0.01} | SRC,
        "pull_bandwidth_bytes_per_s": {"value": 1e9} | SRC, "gpus_per_worker": {"value": 2} | SRC,
        "gpu_memory_bytes": {"value": GiB} | SRC, "prefill_kv_space_bytes": {"value": 1200 * KV} | SRC,
        "host_kv_space_bytes": {"value": 1e9} | SRC, "host_read_bandwidth_bytes_per_s": {"value": host_bw} | SRC,
        "host_read_latency_s": {"value": 0.001} | SRC} | extra)


def alternating() -> Traffic:
    return Traffic.of([AgentRequest("t", "a", 0, 0.0, 1000, 32, 0, server_s=1.0),
                       AgentRequest("t", "b", 0, 10.0, 1000, 32, 0, server_s=1.0),
                       AgentRequest("t", "a", 1, 20.0, 1300, 32, 1000, server_s=1.0)])


def rows(df):
    return {r["strategy"]: r for r in df.to_dict("records")}


def test_host_tier_saves_recomputation_by_hand():
    r = rows(ledger(alternating(), profile(), NO_QUEUE, Prices(gpu_hour_usd=3.6, host_gib_hour_usd=3.6)))
    assert r["pd"]["hit_rate"] == 0.0 and r["pd+host"]["hit_rate"] == 1.0
    assert r["pd+host"]["host_read_tokens"] == 896 and r["pd+host"]["reused_tokens"] == 896
    # only one later request: its TTFT. pd: 0.01 + 1e-4 x 1300; host: 0.01 + 1e-4 x (1300 - 896) + 0.001 + 896 x 1e-6
    assert r["pd"]["ttft_p50_later_s"] == pytest.approx(0.14)
    assert r["recompute"]["ttft_p50_later_s"] == pytest.approx(0.14)
    assert r["pd+host"]["ttft_p50_later_s"] == pytest.approx(0.01 + 0.0404 + 0.001 + 0.000896)
    # 896 tokens not computed: 1e-4 s each, on a worker of 2 GPUs
    assert r["pd+host"]["prefill_gpu_s_saved"] == pytest.approx(896 * 1e-4 * 2)
    assert r["pd"]["prefill_gpu_s_saved"] == 0.0
    # host LRU: 1000 tokens over [0, 10), 2000 over [10, 20), 2000 - 1000 + 1300 over [20, 21)
    host = (1000 * 10 + 2000 * 10 + 2300 * 1) * KV / GiB
    assert r["pd+host"]["host_gib_s"] == pytest.approx(host)
    # P's GPU LRU (1200 tokens): a 1000; a + b = 2000 evicts a -> 1000; then a's 1300 alone is more
    # than 1200: b and a both evicted -> 0
    assert r["pd+host"]["p_cache_gib_s"] == pytest.approx((1000 * 10 + 1000 * 10 + 0 * 1) * KV / GiB)
    assert r["pd+host"]["d_pinned_gib_s"] == 0.0
    # prices: $1e-3 per GiB-s of host memory, $1e-3 per GPU-s; P's evictable GPU cache is not priced
    assert r["pd+host"]["host_memory_usd"] == pytest.approx(host * 1e-3)
    assert r["pd+host"]["gpu_memory_usd"] == 0.0
    assert r["pd+host"]["memory_usd_per_m_saved_tokens"] == pytest.approx(host * 1e-3 / 896e-6)
    assert r["pd+host"]["net_usd_per_m_saved_tokens"] == pytest.approx((host * 1e-3 - 0.1792e-3) / 896e-6)
    assert pd.isna(r["recompute"]["memory_usd_per_m_saved_tokens"])   # nothing saved: no figure


def test_slow_host_link_is_slower_than_recomputing():
    # 2.048e7 B/s: 2e-4 s per token read, twice the 1e-4 s of computing it
    r = rows(ledger(alternating(), profile(host_bw=2.048e7), NO_QUEUE))
    assert r["pd+host"]["ttft_p50_later_s"] == pytest.approx(0.01 + 0.0404 + 0.001 + 896 * 2e-4)
    assert r["pd+host"]["ttft_p50_later_s"] > r["recompute"]["ttft_p50_later_s"] == pytest.approx(0.14)
    # the GPU still skips those tokens: the saving is in GPU time, the loss in TTFT
    assert r["pd+host"]["prefill_gpu_s_saved"] == pytest.approx(0.1792)


def test_no_prices_no_money():
    r = rows(ledger(alternating(), profile(), NO_QUEUE))
    for key in ("gpu_memory_usd", "host_memory_usd", "saved_prefill_usd", "memory_usd_per_m_saved_tokens",
                "net_usd_per_m_saved_tokens"):
        assert pd.isna(r["pd+host"][key])


def test_d_full_by_hand():
    # One session; P's GPU space (500 tokens) holds no prompt, so every reuse is D's. D's space is 10
    # blocks: turn 0's handle (1031 tokens, 9 blocks) fits and is read at 5 s (a hit, 1031 tokens
    # pulled); turn 1's (1331 tokens, 11 blocks) does not fit: lost to a full D.
    tr = Traffic.of([AgentRequest("t", "a", 0, 0.0, 1000, 32, 0, server_s=1.0),
                     AgentRequest("t", "a", 1, 5.0, 1300, 32, 1031, server_s=1.0)])
    prof = profile(prefill_kv_space_bytes={"value": 500 * KV} | SRC,
                   decode_kv_space_bytes={"value": 10 * 128 * KV} | SRC)
    r = rows(ledger(tr, prof, NO_QUEUE, strategies=("recompute", "pd", "pd-bidir")))
    b = r["pd-bidir"]
    assert b["d_full_events"] == 1 and b["hit_rate"] == 1.0 and b["reused_tokens"] == 1031
    assert b["ttft_p50_later_s"] == pytest.approx(0.01 + 1e-4 * (1300 - 1031) + 1031 * KV / 1e9)
    assert b["d_pinned_gib_s"] == pytest.approx(9 * 128 * KV * 4 / GiB)   # 9 blocks from 1 s to 5 s
    assert b["p_cache_gib_s"] == 0.0 and r["pd"]["hit_rate"] == 0.0
    assert b["prefill_gpu_s_saved"] == pytest.approx(1031 * 1e-4 * 2)


@pytest.mark.parametrize("rendered", [False, True])
def test_pd_and_bidir_ttft_are_the_planners(rendered):
    # a second route: with queueing on (and chat renders), the ledger's pd and pd-bidir TTFTs are plan()'s
    tr = Traffic.of([AgentRequest("t", s, k, 2.0 * k + 0.5 * j, 1000 + 300 * k, 32, 0 if k == 0 else 700 + 300 * k,
                                  server_s=1.0) for j, s in enumerate("abc") for k in range(3)])
    prof = profile(prefill_kv_space_bytes={"value": 2500 * KV} | SRC, render_s_per_token={"value": 2e-5} | SRC)
    settings = PlanSettings(rendered_prompts=rendered)
    p = plan(tr, prof, settings)
    r = rows(ledger(tr, prof, settings))
    later = tr.request_index >= 1
    for strategy in ("recompute", "pd", "pd-bidir"):
        mode = {"recompute": "pd-nocache"}.get(strategy, strategy)
        assert r[strategy]["ttft_mean_s"] == pytest.approx(p.modes[mode].ttft_s.mean())
        assert r[strategy]["ttft_p50_later_s"] == pytest.approx(np.median(p.modes[mode].ttft_s[later]))
    assert r["pd-bidir"]["d_pinned_gib_s"] == pytest.approx(p.modes["pd-bidir"].held_gib_s())


def test_host_strategy_needs_the_profiles_tier():
    prof = profile().model_copy(update={"host_kv_space_bytes": None})
    with pytest.raises(ValueError, match="host_kv_space_bytes"):
        ledger(alternating(), prof, NO_QUEUE, strategies=("pd+host",))
    assert "pd+host" not in set(ledger(alternating(), prof, NO_QUEUE)["strategy"])
