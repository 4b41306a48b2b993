"""planner.ttl_whatif against a hand computation: three sessions on a D whose KV space
the held handles exceed (a handle lost, the next turn misses), and the same turns with no limit.

The truths are worked out by hand below from the turns, not through the code.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from planner.ttl_whatif import RunKV, RunTurns, replay_run, replay_unlimited, whatif_ttl_limited

GIB = 2**30
# 1 byte per token, 16-token blocks, D's space 100 blocks = 1,600 bytes, the proxy's margin 30 s.
KV = RunKV(handle_ttl_margin_s=30.0, kv_bytes_per_token=1.0, block_size=16, capacity_bytes=1600.0)
# (session, turn, sent s, e2e s, prompt, completion, recorded reuse); D keeps prompt + completion - 1
# tokens in whole 16-token blocks: A0 800, B0 640, C0 320, A1 816, C1 336, B1 656 bytes.
TURNS = [
    ("A", 0, 0.0, 1.0, 800, 1, "miss_first_turn"),
    ("B", 0, 0.5, 1.0, 640, 1, "miss_first_turn"),
    ("C", 0, 2.0, 1.0, 320, 1, "miss_first_turn"),
    ("A", 1, 10.0, 1.0, 815, 2, "hit"),
    ("C", 1, 12.0, 1.0, 335, 2, "hit"),
    ("B", 1, 20.0, 1.0, 655, 2, "hit"),
]


def frame(turns=TURNS) -> pd.DataFrame:
    return pd.DataFrame(
        [{"run_id": "r", "session_id": s, "turn_index": i, "kind": "turn", "status": "ok", "sent_s": 1e9 + t,
          "e2e_s": e, "prompt_tokens": p, "completion_tokens": c, "reuse": r} for s, i, t, e, p, c, r in turns])


def test_held_kv_over_ds_space_loses_a_handle_and_its_hit() -> None:
    # By hand, with the limit: t=1 A0 pinned (800), 1.5 B0 (1440), 3 C0 would make 1760 > 1600:
    # lost. 10 A1 pulls A0 (640), 11 A1 pinned (1456), 12 C1 finds C0 lost (a lost hit), 13 C1's
    # 336 would make 1792: lost. 20 B1 pulls B0 (816), 21 B1 pinned (1472); A1 expires at
    # 11 + 480 = 491 (656), B1 at 501 (0).
    r = replay_run(frame(), 480.0, KV, KV.capacity_bytes)
    assert (r.later_turns, r.hits, r.lost_hits, r.lost_handles) == (3, 2, 1, 2)
    assert r.peak_held_bytes == 1472
    byte_s = (800 * 0.5 + 1440 * 8.5 + 640 * 1 + 1456 * 9 + 816 * 1 + 1472 * 470 + 656 * 10)
    assert r.held_gib_s == pytest.approx(byte_s / GIB)


def test_without_the_limit_every_handle_is_kept() -> None:
    # By hand, no limit: C0 kept (3: 1760); 10 A1 pulls (960), 11 A1 (1776), 12 C1 pulls C0 (1456),
    # 13 C1 (1792), 20 B1 pulls (1152), 21 B1 (1808); A1 frees at 491 (992), C1 at 493 (656), B1 at 501.
    r = replay_run(frame(), 480.0, KV, None)
    assert (r.hits, r.lost_hits, r.lost_handles, r.peak_held_bytes) == (3, 0, 0, 1808)
    byte_s = (800 * 0.5 + 1440 * 1.5 + 1760 * 7 + 960 * 1 + 1776 * 1 + 1456 * 1 + 1792 * 7 + 1152 * 1
              + 1808 * 470 + 992 * 2 + 656 * 8)
    assert r.held_gib_s == pytest.approx(byte_s / GIB)


def test_per_ttl_rows_say_where_the_demand_exceeds_ds_space() -> None:
    out = whatif_ttl_limited(frame(), {"r": KV}, [20.0, 40.0, 480.0]).set_index("ttl_s")
    assert 20.0 not in out.index  # not above the 30 s margin: the proxy would offer nothing
    # TTL 40: proxy TTL 10 s; A1's handle is 9 s old (a hit), B1's 18.5 s (expired); every handle
    # unread after its turn frees 40 s later. With the limit: C0 lost at 3 (1760 > 1600), C1 finds
    # it lost; with no limit B0 is not read (expired) but stays pinned to 41.5 s, so the demand
    # peaks at 21 s: B0 640 + A1 816 + C1 336 + B1 656 = 2448.
    assert (out.loc[40.0, "hits"], out.loc[40.0, "lost_hits"]) == (1, 1)
    assert out.loc[40.0, "demand_peak_bytes"] == 2448
    assert out.loc[480.0, "demand_peak_bytes"] == 1808 > out.loc[480.0, "capacity_bytes"] == 1600
    assert out.loc[480.0, "peak_held_bytes"] == 1472


def test_ttl_independent_misses_and_failed_turns() -> None:
    turns = [("A", 0, 0.0, 1.0, 800, 1, "miss_first_turn"), ("A", 1, 5.0, 1.0, 815, 2, "miss_mismatch"),
             ("B", 0, 0.0, 1.0, 640, 1, "miss_first_turn"), ("B", 1, 5.0, 1.0, 655, 2, "hit")]
    df = frame(turns)
    df.loc[(df["session_id"] == "B") & (df["turn_index"] == 0), "status"] = "error"  # D kept nothing
    r = replay_run(df, 480.0, KV, None)
    # A1's mismatch is no TTL's doing; B0 failed, so B1 has no handle: no hit, and D holds A0, A1
    # (800, 816) and B1 (656) for the whole TTL.
    assert (r.later_turns, r.hits) == (2, 0)
    assert r.held_gib_s == pytest.approx((800 + 816 + 656) * 480 / GIB)


@pytest.mark.parametrize("ttl", [40.0, 480.0])
def test_a_below_threshold_turn_frees_the_handle_it_took(ttl) -> None:
    """P given a handle it pulls nothing from still notifies D, which frees it then (vLLM
    nixl/pull_scheduler.py update_state_after_alloc, nixl/pull_worker.py _read_blocks): a recorded
    miss_below_threshold ends its predecessor's hold at its send time when the proxy would offer
    the handle at this TTL, and does not when the handle is past the proxy's TTL."""
    turns = [("A", 0, 0.0, 1.0, 800, 1, "miss_first_turn"), ("A", 1, 5.0, 1.0, 815, 2, "miss_below_threshold"),
             ("A", 2, 25.0, 1.0, 830, 3, "miss_below_threshold")]
    # Handles 800, 816, 832 bytes (whole 16-token blocks), pinned at 1, 6 and 26 s. A1's handle is 4 s
    # old: offered at both TTLs (proxy TTL 10 s and 450 s), so A0 is freed at 5 s (held 4 s). A2's is
    # 19 s old: offered at 480 (A1 held 6 -> 25 s: 19 s), past the proxy's 10 s at 40 (A1 held 40 s).
    a1_held = 19.0 if ttl == 480.0 else 40.0
    byte_s = 800 * 4 + 816 * a1_held + 832 * ttl
    ledger = replay_run(frame(turns), ttl, KV, None)
    fast = replay_unlimited(RunTurns(frame(turns), KV), ttl, KV)
    for r in (ledger, fast):
        assert (r.later_turns, r.hits) == (2, 0)
        assert r.held_gib_s == pytest.approx(byte_s / GIB)
    # the peak: at 40 s, A1 (816) and A2 (832) from 26 s; at 480, one handle at a time, A2's the largest
    assert ledger.peak_held_bytes == fast.peak_held_bytes == (816 + 832 if ttl == 40.0 else 832)


@pytest.mark.parametrize("ttl", [40.0, 120.0, 480.0])
def test_the_unlimited_replay_is_the_ledger_with_no_limit(ttl):
    """replay_unlimited (arrays: each hold known from the turns) against the handle ledger turn by
    turn with no limit: the same hits, peak and GiB·s on random traffic (overlapping turns of a
    session, failed turns, TTL-independent misses, below-threshold turns that free the handle they
    took, and fresh requests included)."""
    rng = np.random.default_rng(7)
    rows = []
    for k in range(40):   # sessions played as the session player plays them: one request at a time
        sent = float(rng.uniform(0, 600))
        for i in range(int(rng.integers(1, 15))):
            fresh = i > 0 and rng.random() < 0.05
            e2e = float(rng.uniform(0.1, 30))
            rows.append({"run_id": "r", "session_id": f"s{k}~fresh{i}" if fresh else f"s{k}",
                         "turn_index": 0 if fresh else i, "kind": "fresh" if fresh else "turn",
                         "status": "ok" if rng.random() < 0.9 else "error", "sent_s": sent, "e2e_s": e2e,
                         "prompt_tokens": int(rng.integers(10, 5000)), "completion_tokens": int(rng.integers(0, 300)),
                         "reuse": str(rng.choice(["hit", "miss_expired", "miss_mismatch", "miss_below_threshold",
                                                  "none"]))})
            sent += e2e + float(rng.exponential(ttl / 2))
    df = pd.DataFrame(rows).replace({"reuse": {"none": None}})
    kv = RunKV(30.0, 2.0, 16, None)
    ledger = replay_run(df, ttl, kv, None)
    fast = replay_unlimited(RunTurns(df, kv), ttl, kv)
    assert (fast.later_turns, fast.hits) == (ledger.later_turns, ledger.hits) and ledger.hits > 0
    assert fast.peak_held_bytes == ledger.peak_held_bytes
    assert fast.held_gib_s == pytest.approx(ledger.held_gib_s, rel=1e-12)


def test_overlapping_requests_of_a_session_are_replayed_by_the_ledger():
    # B1 is sent before B0 ends (2 s < 0.5 + 2.5): no array replay; the rows still come (ledger)
    turns = [("A", 0, 0.0, 1.0, 800, 1, "miss_first_turn"), ("A", 1, 5.0, 1.0, 815, 2, "hit"),
             ("B", 0, 0.5, 2.5, 640, 1, "miss_first_turn"), ("B", 1, 2.0, 1.0, 655, 2, "hit")]
    rt = RunTurns(frame(turns), KV)
    assert not rt.sequential and RunTurns(frame(), KV).sequential
    out = whatif_ttl_limited(frame(turns), {"r": KV}, [480.0]).iloc[0]
    assert (out["hits"], out["demand_peak_bytes"]) == (1, replay_run(frame(turns), 480.0, KV, None).peak_held_bytes)
