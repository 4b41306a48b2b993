"""The capacity_steps view and store.queries.capacity over a store written by store.writer's
real writer (tests/capacity_store.py), against its hand-computed truths."""

from __future__ import annotations

import pytest

from analysis import capacity_crossing as capacity
from store import db
from store.queries import capacity as capacity_queries
from tests import capacity_store as cs


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    root = cs.build(tmp_path_factory.mktemp("capstore"))
    ids = [cs.PLAIN] + [cs.run_id(m, u) for m in cs.MODES for u in cs.USERS]
    return db.read(db.StoreLocation(root), capacity_queries.capacity_steps, ids)


def test_one_row_per_step_and_mode_and_the_plain_run_left_out(steps):
    assert sorted(zip(steps["mode"], steps["users"], strict=True)) == sorted((m, u) for m in cs.MODES for u in cs.USERS)
    assert set(steps["capacity_id"]) == {cs.CAP_ID}
    assert set(steps["slo_ttft_s"]) == {cs.SLO_TTFT_S} and set(steps["slo_tpot_s"]) == {cs.SLO_TPOT_S}
    assert set(steps["decode_kv_cache_bytes"]) == {cs.D_KV_BYTES}
    assert steps.set_index("users").query("mode == 'pd'")["sessions"].to_dict() == {1: 2, 2: 4, 4: 8}


def test_turns_goodput_and_percentiles(steps):
    for r in steps.itertuples():
        key = (r.mode, r.users)
        assert (r.turns, r.slo_turns) == (cs.EXPECTED_TURNS[key], cs.EXPECTED_SLO_TURNS[key]), key
        assert r.span_s == pytest.approx(10.0)
        assert r.goodput_per_s == pytest.approx(cs.EXPECTED_GOODPUT[key]), key
        assert r.ttft_p50_s == pytest.approx(cs.EXPECTED_TTFT_P50[key]), key
        assert r.ttft_p90_s == pytest.approx(cs.EXPECTED_TTFT_P90[key]), key
        assert (r.e2e_p50_s, r.e2e_p90_s) == (pytest.approx(1.0), pytest.approx(1.0))
    bidir2 = steps[(steps["mode"] == "pd-bidir") & (steps["users"] == 2)].iloc[0]
    assert (bidir2.ok_turns, bidir2.slo_attainment) == (10, pytest.approx(10 / 11))


def test_scrapes_per_step(steps):
    r = steps[steps["run_id"] == cs.BIDIR4].iloc[0]
    for col, want in cs.EXPECTED_BIDIR4.items():
        assert r[col] == pytest.approx(want), col
    other = steps[steps["run_id"] == cs.run_id("pd", 4)].iloc[0]
    assert (other.decode_kv_usage_max, other.decode_kv_usage_start) == (pytest.approx(0.2), pytest.approx(0.1))
    assert other.decode_preemptions != other.decode_preemptions  # NaN: no counter scraped


def test_crossing_over_the_store(steps):
    c = capacity.find_crossing(steps)
    # At 4 sessions pd-bidir's p90 (900 ms) is 2.25x pd's (400 ms), but from 10 turns, 4 of them
    # slow: a resample keeps its p90 at 900 ms only with 2 or more slow turns, and draws 0 or 1 with
    # probability 0.6^10 + 10 x 0.4 x 0.6^9 = 4.6% > 2.5%, so the 95% interval of the ratio reaches
    # 0.225 / 0.4 = 0.56: within noise. The crossing stands on goodput alone.
    assert (c.users, c.reason) == (cs.EXPECTED_CROSSING_USERS, "goodput")
    assert c.within_noise == (4,)
    low, high = capacity.p90_ratio_interval(next(p for p in c.pairs if p.users == 4))
    assert low == pytest.approx(0.225 / 0.4, abs=0.01) and high == pytest.approx(2.25)
    words = capacity.crossing_words(c)
    assert "(at 4: goodput 0.60 vs 1.00 turns/s; steps measured: 1, 2, 4)" in words
    assert "At 4 concurrent session(s) `pd-bidir`'s TTFT p90 was higher by more than 5%, but within" in words
    assert "1: 250 ms → 150 ms; 2: 300 ms → 180 ms" in words
