"""The Memory page's TTL what-if with D's KV space as the limit (whatif_ttl_d_limit),
through a real store: D's space read from the run's vllm:cache_config_info, a hand-built run whose
held KV exceeds it (hand-computed hits, lost handles, peak), and, where the limit does not bind,
agreement with the unlimited what-if computed in SQL (queries.whatif_ttl, a second route).
"""

from __future__ import annotations

import datetime as dt

import pandas as pd
import pytest

from planner import recorded_whatif
from planner.recorded_whatif import whatif_ttl_d_limit
from store import db, queries
from store.queries.memory import WHATIF_TTLS_S
from store.rollup import Rollups
from store.writer import Store

T0 = dt.datetime(2026, 12, 1, 10, 0, tzinfo=dt.UTC)
GIB = 2**30
# run -> (kv bytes per token, block size, D's num_gpu_blocks)
RUNS = {"bind": (1, 16, 100), "free": (4096, 16, 1_000_000), "gpu-less": (1, 16, None),
        "thr": (4096, 16, 1_000_000)}
# (session, turn, sent s, e2e s, prompt, completion, recorded reuse): the unit test's case
# (tests/unit/test_ttl_whatif.py): D's 1,600 bytes hold A0 + B0 but not C0 next to them.
BIND = [("A", 0, 0.0, 1.0, 800, 1, "miss_first_turn"), ("B", 0, 0.5, 1.0, 640, 1, "miss_first_turn"),
        ("C", 0, 2.0, 1.0, 320, 1, "miss_first_turn"), ("A", 1, 10.0, 1.0, 815, 2, "hit"),
        ("C", 1, 12.0, 1.0, 335, 2, "hit"), ("B", 1, 20.0, 1.0, 655, 2, "hit")]
# Block-aligned handles (prompt + 32 - 1 a multiple of 16) and gaps that hit at some TTLs only:
# 20 s, 100 s, 200 s, 500 s after the previous turn's end; one mismatch; one failed turn.
FREE = []
for s, gaps in enumerate([(20, 100, 200), (500, 20, 100), (200, 500, 20)]):
    sent, prompt = 30.0 * s, 1009
    FREE.append((f"s{s}", 0, sent, 2.0, prompt, 32, "miss_first_turn"))
    for k, gap in enumerate(gaps, start=1):
        sent += 2.0 + gap
        prompt += 32 + 16 * k
        reuse = "miss_mismatch" if (s, k) == (1, 3) else ("hit" if gap < 450 else "miss_expired")
        if (s, k) == (2, 2):
            reuse = "miss_consumed"  # s2/1 failed (below): the proxy had no handle left for s2/2
        FREE.append((f"s{s}", k, sent, 2.0, prompt, 32, reuse))
# Two turns below the recompute threshold, 20 s and 100 s after the previous turn's end: handles of
# 1009 + 31 = 1040, 1057 + 31 = 1088 and 1121 + 31 = 1152 tokens (whole 16-token blocks), each turn
# 2 s long.
THR = [("t0", 0, 0.0, 2.0, 1009, 32, "miss_first_turn"), ("t0", 1, 22.0, 2.0, 1057, 32, "miss_below_threshold"),
       ("t0", 2, 124.0, 2.0, 1121, 32, "miss_below_threshold")]
TURNS_OF = {"bind": BIND, "free": FREE, "gpu-less": BIND, "thr": THR}


def _write(store: Store, run_id: str, turns: list, kv: int, block: int, blocks: int | None) -> None:
    w = store.writer(run_id, "test", flush_interval_s=60)
    try:
        w.append("runs_log", {"run_id": run_id, "mode": "pd-bidir", "status": "complete", "started_at": T0,
                              "updated_at": T0, "config": {"kv_bytes_per_token": kv,
                                                           "connector": {"decoder_kv_blocks_ttl": 480}}})
        ends: dict[str, float] = {}
        for session, turn, sent, e2e, prompt, completion, reuse in turns:
            failed = (run_id, session, turn) == ("free", "s2", 1)
            w.append("turns", {"run_id": run_id, "session_id": session, "turn_index": turn, "kind": "turn",
                               "status": "error" if failed else "ok",
                               "sent_at": T0 + dt.timedelta(seconds=sent), "e2e_s": e2e, "ttft_s": 0.1,
                               "gap_before_s": sent - ends[session] if session in ends else 0.0,
                               "reuse": reuse, "prompt_tokens": prompt, "completion_tokens": completion})
            ends[session] = sent + e2e
        if blocks is not None:
            w.append("metric_samples", {"run_id": run_id, "scraped_at": T0, "endpoint": "http://d0", "role": "decode",
                                        "name": "vllm:cache_config_info", "value": 1.0,
                                        "labels": {"block_size": str(block), "num_gpu_blocks": str(blocks)}})
    finally:
        w.close()


def _build(path) -> Store:
    store = Store(path)
    store.init()
    for run_id, (kv, block, blocks) in RUNS.items():
        _write(store, run_id, TURNS_OF[run_id], kv, block, blocks)
    return store


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return db.StoreLocation(_build(tmp_path_factory.mktemp("store")).root)


def test_ds_space_comes_from_cache_config_info(root) -> None:
    space = db.read(root, queries.decode_kv_space, list(RUNS)).set_index("run_id")
    assert space.loc["bind", "kv_space_tokens"] == 16 * 100 and space.loc["bind", "block_size"] == 16
    assert "gpu-less" not in space.index


def test_held_kv_over_ds_space_by_hand(root) -> None:
    out = db.read(root, whatif_ttl_d_limit, ["bind"], (480.0,)).iloc[0]
    # By hand (tests/unit/test_ttl_whatif.py works the timeline): C0's 320 bytes do not fit next
    # to A0's 800 and B0's 640 in 1,600; C1 misses for it, and its own 336 do not fit either.
    assert (out["later_turns"], out["hits"], out["lost_hits"], out["lost_handles"]) == (3, 2, 1, 2)
    assert (out["peak_held_bytes"], out["demand_peak_bytes"], out["capacity_bytes"]) == (1472, 1808, 1600)
    assert out["held_gib_s"] == pytest.approx(725_600 / GIB)
    # Without D's gauge the same turns are replayed with no limit, in tokens: every handle kept.
    free = db.read(root, whatif_ttl_d_limit, ["gpu-less"], (480.0,)).iloc[0]
    assert (free["hits"], free["lost_handles"]) == (3, 0) and free["capacity_bytes"] != free["capacity_bytes"]


@pytest.mark.parametrize("ttl", [60.0, 120.0, 240.0, 480.0, 900.0])
def test_without_a_binding_limit_it_is_the_unlimited_sql_replay(root, ttl: float) -> None:
    limited = db.read(root, whatif_ttl_d_limit, ["free"], (ttl,)).iloc[0]
    sql = db.read(root, queries.whatif_ttl, ["free"], (ttl,)).iloc[0]
    assert limited["lost_handles"] == 0
    assert (limited["later_turns"], limited["hits"]) == (sql["later_turns"], sql["hits"])
    assert limited["held_gib_s"] == pytest.approx(sql["held_gib_s"], rel=1e-9)
    assert limited["peak_held_bytes"] == limited["demand_peak_bytes"]


@pytest.mark.parametrize("query", ["whatif_ttl_d_limit", "whatif_ttl"])
def test_a_below_threshold_turn_frees_the_handle_it_was_given(root, query: str) -> None:
    """P given a handle it pulls nothing from still notifies D, which frees it (vLLM
    nixl/pull_scheduler.py update_state_after_alloc, nixl/pull_worker.py _read_blocks), when the
    proxy offers it: gap + 30 s margin below the TTL. Both routes (the replay, the SQL)."""
    route = whatif_ttl_d_limit if query == "whatif_ttl_d_limit" else queries.whatif_ttl
    out = db.read(root, route, ["thr"], (60.0, 480.0)).set_index("ttl_s")
    # By hand, tokens x seconds. TTL 60: t0/1 (gap 20 < 30) frees t0/0 after 20 s; t0/2's gap 100 is
    # past the proxy's 30 s, so t0/1's handle is held 60 s; t0/2's 60 s. TTL 480: t0/2 frees t0/1
    # after 100 s; t0/2's held 480 s.
    by_hand = {60.0: 1040 * 20 + 1088 * 60 + 1152 * 60, 480.0: 1040 * 20 + 1088 * 100 + 1152 * 480}
    for ttl, token_s in by_hand.items():
        assert out.loc[ttl, "hits"] == 0
        assert out.loc[ttl, "held_gib_s"] == pytest.approx(token_s * 4096 / GIB)


def test_the_hits_rise_with_the_ttl(root) -> None:
    out = db.read(root, whatif_ttl_d_limit, ["free"], (60.0, 480.0, 900.0)).set_index("ttl_s")
    # By hand: the 20 s gaps hit from TTL 60 (s0/1, s1/2, s2/3); the 100 s and 200 s ones by 480
    # (s0/2, s0/3, s2/1, which pulled and then failed; s1/3 is a mismatch at any TTL); of the 500 s
    # ones only s1/1 at 900 (s2/2 has no handle: s2/1 failed, D kept nothing).
    assert list(out["hits"]) == [3, 6, 7]


def test_a_rolled_up_run_gives_the_same_rows_without_a_replay(tmp_path, monkeypatch) -> None:
    """Rollups (store.rollup) keep each finished run's what-if at the page's TTL grid: the
    dashboard reads those rows instead of replaying the run (the replay is made to fail here),
    and they are the replay's rows; a TTL outside the grid is still replayed."""
    store = _build(tmp_path / "store")
    loc = db.StoreLocation(store.root)
    replayed = db.read(loc, whatif_ttl_d_limit, list(RUNS), WHATIF_TTLS_S)  # nothing rolled up yet
    assert sorted(Rollups(store, whatif=whatif_ttl_d_limit).write_finished()) == sorted(RUNS)

    def no_replay(*args, **kwargs):
        raise AssertionError("replayed")

    monkeypatch.setattr(recorded_whatif, "whatif_ttl_limited", no_replay)
    rolled = db.read(loc, whatif_ttl_d_limit, list(RUNS), WHATIF_TTLS_S)
    pd.testing.assert_frame_equal(rolled, replayed)
    bind = db.read(loc, whatif_ttl_d_limit, ["bind"], (480.0,)).iloc[0]
    assert (bind["hits"], bind["lost_hits"], bind["lost_handles"]) == (2, 1, 2)  # the hand figures above
    with pytest.raises(AssertionError, match="replayed"):
        db.read(loc, whatif_ttl_d_limit, ["bind"], (75.0,))
