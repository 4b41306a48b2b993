"""handle_holds / run_handle_memory against a hand computation: runs back to back, known TTLs,
known handle ages and prefill legs, and the outcomes that end a hold (a pull; a turn below the
recompute threshold, after which P tells D to free the handle it was given) or not (any other miss).

Written with the store's real writer; the truths below are computed by hand from the rows, not
through the views.
"""

from __future__ import annotations

import datetime as dt

import pytest

from store.writer import Store

T0 = dt.datetime(2026, 12, 1, 10, 0, tzinfo=dt.UTC)
KV = 4096  # bytes per token of both runs
GIB = 2**30
RUNS = {"run-a": (480, 0), "run-b": (120, 10), "run-c": (480, 20), "run-d": (60, 30)}  # run -> (D's TTL s, start offset min)
# (run, session, turn, handle_tokens, reuse, handle_age_s, prefill_leg_s, gap_before_s)
TURNS = [
    ("run-a", "a0", 0, 1000, "miss_first_turn", None, 0.2, 0.0),
    ("run-a", "a0", 1, 1200, "hit", 10.0, 0.5, 9.9),        # pulls a0/0's handle: held 10.0 + 0.5 s
    ("run-a", "a1", 0, 500, "miss_first_turn", None, 0.2, 0.0),
    ("run-a", "a1", 1, 800, "miss_mismatch", None, 0.3, 5.0),  # a1/0's handle not pulled: held the TTL
    ("run-b", "b0", 0, 300, "miss_first_turn", None, 0.2, 0.0),
    ("run-b", "b0", 1, 400, "miss_expired", None, 0.2, 100.0),  # 100 s > 120 - 30: b0/0's handle expired
    ("run-c", "c0", 0, None, "miss_first_turn", None, 0.2, 0.0),  # D kept nothing (one-way): no row
    ("run-d", "d0", 0, 600, "miss_first_turn", None, 0.2, 0.0),
    # P was given d0/0's handle, pulled nothing (below kv_recompute_threshold) and notified D, which
    # freed it (vLLM nixl/pull_scheduler.py update_state_after_alloc, pull_worker.py _read_blocks):
    # held 18.4 + 0.5 s, not the 60 s TTL
    ("run-d", "d0", 1, 700, "miss_below_threshold", 18.4, 0.5, 18.5),
    ("run-d", "d0", 2, 800, "miss_transfer_failed", 18.4, 0.5, 18.5),  # d0/1's handle: held the TTL
]
# By hand: bytes x seconds per hold, over 2^30.
EXPECTED_GIB_S = {
    "run-a": (1000 * KV * 10.5 + 1200 * KV * 480 + 500 * KV * 480 + 800 * KV * 480) / GIB,
    "run-b": (300 * KV * 120 + 400 * KV * 120) / GIB,
    "run-d": (600 * KV * 18.9 + 700 * KV * 60 + 800 * KV * 60) / GIB,
}
D_USAGE_AT_START = {"run-a": 0.0, "run-b": 0.25, "run-c": 0.1, "run-d": 0.3}  # run-a's handles still pinned later


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Store:
    s = Store(tmp_path_factory.mktemp("store"))
    s.init()
    for run_id, (ttl_s, offset_min) in RUNS.items():
        start = T0 + dt.timedelta(minutes=offset_min)
        w = s.writer(run_id, "test", flush_interval_s=60)
        try:
            w.append("runs_log", {"run_id": run_id, "mode": "pd-bidir", "status": "complete", "started_at": start,
                                  "updated_at": start, "config": {"kv_bytes_per_token": KV,
                                                                  "connector": {"decoder_kv_blocks_ttl": ttl_s}}})
            for k, (run, session, turn, tokens, reuse, age, leg, gap) in enumerate(
                    t for t in TURNS if t[0] == run_id):
                # D's handle holds prompt + output - 1 tokens (core.reuse_rules): 32-token replies
                prompt = (tokens or 500) + 1 - 32
                w.append("turns", {"run_id": run, "session_id": session, "turn_index": turn, "status": "ok",
                                   "sent_at": start + dt.timedelta(seconds=20 * k), "e2e_s": 1.5, "ttft_s": 0.3,
                                   "reuse": reuse, "handle_age_s": age, "prefill_leg_s": leg,
                                   "handle_tokens": tokens, "prompt_tokens": prompt, "completion_tokens": 32,
                                   "gap_before_s": gap})
            for sec, usage in ((1, D_USAGE_AT_START[run_id]), (30, 0.6)):
                w.append("metric_samples", {"run_id": run_id, "scraped_at": start + dt.timedelta(seconds=sec),
                                            "endpoint": "http://d", "role": "decode",
                                            "name": "vllm:kv_cache_usage_perc", "labels": {}, "value": usage})
        finally:
            w.close()
    return s


def _rows(store: Store, sql: str) -> list[tuple]:
    con = store.connect()
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def test_each_hold_ends_at_its_pull_or_its_expiry(store: Store) -> None:
    got = {(r, s, t): (ended, held) for r, s, t, ended, held in _rows(
        store, "SELECT run_id, session_id, turn_index, ended_by, held_s FROM handle_holds")}
    assert got == {
        ("run-a", "a0", 0): ("pulled", pytest.approx(10.5)), ("run-a", "a0", 1): ("expired", 480.0),
        ("run-a", "a1", 0): ("expired", 480.0), ("run-a", "a1", 1): ("expired", 480.0),
        ("run-b", "b0", 0): ("expired", 120.0), ("run-b", "b0", 1): ("expired", 120.0),
        ("run-d", "d0", 0): ("freed", pytest.approx(18.9)), ("run-d", "d0", 1): ("expired", 60.0),
        ("run-d", "d0", 2): ("expired", 60.0),
    }


def test_run_memory_is_its_own_handles_to_their_end(store: Store) -> None:
    rows = {r[0]: r[1:] for r in _rows(
        store, "SELECT run_id, handles, pulled, held_gib_s, held_until, d_kv_usage_at_start FROM run_handle_memory")}
    for run_id, expected in EXPECTED_GIB_S.items():
        _, _, held, _, usage = rows[run_id]
        assert held == pytest.approx(expected)
        assert usage == D_USAGE_AT_START[run_id]
    assert rows["run-a"][:2] == (4, 1) and rows["run-b"][:2] == (2, 0)
    assert rows["run-d"][:2] == (3, 0)  # a freed handle is not a pulled one
    assert rows["run-c"][:3] == (0, 0, 0.0)  # no handles: nothing held
    # run-a's last hold ends a TTL after its last turn (sent at +60 s, 1.5 s long): past run-b's start
    assert rows["run-a"][3] == T0 + dt.timedelta(seconds=60 + 1.5 + 480)
    # run-d's last handle (d0/2, sent at +40 s, 1.5 s long) is held its 60 s TTL
    assert rows["run-d"][3] == T0 + dt.timedelta(minutes=30, seconds=40 + 1.5 + 60)


def test_memory_page_held_is_the_runs_own_handles(store: Store) -> None:
    """The Memory page's "held (GiB·s)" (queries.reuse_cost) is run_handle_memory's figure."""
    from store import db, queries

    df = db.read(db.StoreLocation(store.root), queries.reuse_cost, list(RUNS)).set_index("run_id")
    for run_id, expected in EXPECTED_GIB_S.items():
        assert df.loc[run_id, "held_gib_s"] == pytest.approx(expected)
        assert df.loc[run_id, "held_source"] == "handles"


@pytest.mark.parametrize("run_id", ["run-a", "run-b", "run-d"])
def test_whatif_at_the_runs_own_ttl_agrees_with_the_held_memory(store: Store, run_id: str) -> None:
    """The Memory page's what-if replayed at the run's own TTL and its measured held GiB·s are the
    same rule from two routes (recorded gaps vs the proxy's handle ages): within 5%."""
    from store import db, queries

    ttl_s = float(RUNS[run_id][0])
    whatif = db.read(db.StoreLocation(store.root), queries.whatif_ttl, [run_id], (ttl_s,)).iloc[0]
    assert whatif["held_gib_s"] == pytest.approx(EXPECTED_GIB_S[run_id], rel=0.05)


def test_ended_by_follows_the_rule_for_every_outcome(tmp_path) -> None:
    """The view's rule is core.reuse_rules.d_frees_taken_handle (the planner's and the what-if's):
    one session per outcome the proxy records, its first turn's handle ends 'pulled' after a hit,
    'freed' after miss_below_threshold (both at the next turn's age + leg: 10 + 1 s), else 'expired'
    at the 300 s TTL."""
    from core.contract import OUTCOMES
    from core.reuse_rules import d_frees_taken_handle

    s = Store(tmp_path / "store")
    s.init()
    w = s.writer("run-e", "test", flush_interval_s=60)
    try:
        w.append("runs_log", {"run_id": "run-e", "mode": "pd-bidir", "status": "complete", "started_at": T0,
                              "updated_at": T0, "config": {"kv_bytes_per_token": KV,
                                                           "connector": {"decoder_kv_blocks_ttl": 300}}})
        for outcome in OUTCOMES:
            for turn, (reuse, tokens, age) in enumerate([("miss_first_turn", 100, None), (outcome, None, 10.0)]):
                w.append("turns", {"run_id": "run-e", "session_id": outcome, "turn_index": turn, "status": "ok",
                                   "sent_at": T0 + dt.timedelta(seconds=20 * turn), "e2e_s": 1.5,
                                   "reuse": reuse, "handle_age_s": age, "prefill_leg_s": 1.0,
                                   "handle_tokens": tokens})
    finally:
        w.close()
    got = {r[0]: r[1:] for r in _rows(s, "SELECT session_id, ended_by, held_s FROM handle_holds")}
    assert got == {o: ({"hit": "pulled", "miss_below_threshold": "freed"}.get(o, "expired"),
                       11.0 if d_frees_taken_handle(o) else 300.0) for o in OUTCOMES}
