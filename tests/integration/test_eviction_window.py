"""P's eviction ladder over a store written by the real writer (tests/eviction_store.py): the
capacity_prefill_cache view, the capacity query's P columns, the per-step speed-up and the window,
each against the hand-computed truths there."""

from __future__ import annotations

import duckdb
import pandas as pd
import pytest

from analysis import eviction_window as ew
from store import db
from store.queries import capacity as capacity_queries
from tests import eviction_store as es

IDS = [es.run_id(m, u) for m in es.MODES for u in es.USERS]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return es.build(tmp_path_factory.mktemp("evstore"))


@pytest.fixture(scope="module")
def steps(root):
    return db.read(db.StoreLocation(root), capacity_queries.capacity_steps, IDS)


@pytest.fixture(scope="module")
def turns(root):
    return db.read(db.StoreLocation(root), capacity_queries.capacity_turns, IDS)


def test_the_view_gives_each_steps_p_cache_and_pulled_tokens(root):
    con = duckdb.connect(str(root / "turnscope.duckdb"), read_only=True)
    rows = con.execute("SELECT mode, users, prefill_kv_cache_bytes, aggregated_kv_cache_bytes, cache_role, "
                       "queried_tokens, hit_tokens, hit_rate, pulled_tokens, proxy_pulled_tokens FROM capacity_prefill_cache"
                       ).fetchall()
    con.close()
    assert len(rows) == len(IDS)
    for mode, users, p_kv, agg_kv, role, queried, hits, rate, pulled, proxy_pulled in rows:
        assert (p_kv, agg_kv, role) == (es.P_KV_BYTES, es.P_KV_BYTES + es.D_KV_BYTES, "prefill")
        assert (queried, hits) == (es.QUERIED, es.HITS[(mode, users)])
        assert rate == pytest.approx(es.EXPECTED_HIT_RATE[(mode, users)])
        # vLLM's external_kv_transfer count (only pd-bidir's P has one), and the proxy's split apart
        assert pulled == (es.EXPECTED_PULLED[users] if mode == "pd-bidir" else None)
        assert proxy_pulled == (es.EXPECTED_PROXY_PULLED[users] if mode == "pd-bidir" else 0)


def test_the_capacity_query_carries_them(steps):
    for r in steps.itertuples():
        assert r.p_hit_rate == pytest.approx(es.EXPECTED_HIT_RATE[(r.mode, r.users)])
        assert r.prefill_kv_cache_bytes == es.P_KV_BYTES


def test_speedups_per_step(steps, turns):
    sp = ew.step_speedups(steps, turns).set_index("users")
    assert list(sp.index) == list(es.USERS)
    for u in es.USERS:
        assert sp.at[u, "speedup"] == pytest.approx(es.EXPECTED_SPEEDUP[u]), u
        assert sp.at[u, "verdict"] == es.EXPECTED_VERDICT[u], u
        assert sp.at[u, "turns_baseline"] == sp.at[u, "turns_treatment"] == 8  # turns 1 and 2 of 4 sessions
        assert sp.at[u, "p_hit_rate_baseline"] == pytest.approx(es.EXPECTED_HIT_RATE[("pd", u)])
        assert sp.at[u, "decode_kv_usage_max"] == pytest.approx(es.D_PEAK[u])
    # at 2 sessions every resample's pd-bidir median lies in 0.10-0.12 s and pd's is 0.20 s
    assert 0.20 / 0.12 - 1e-9 <= sp.at[2, "ci_low"] <= sp.at[2, "ci_high"] <= 0.20 / 0.10 + 1e-9


def test_the_window(steps, turns):
    w = ew.find_window(steps, turns)
    assert (w.pays_from, w.ends_at, w.steps) == (es.EXPECTED_WINDOW[0], es.EXPECTED_CROSSING, es.EXPECTED_WINDOW)
    assert w.d_full_from == es.EXPECTED_D_FULL
    assert w.crossing.reason == "goodput and ttft_p90"
    words = ew.window_words(w)
    assert "pays from 2 concurrent sessions** (`pd`'s P hit rate 80% there) up to 4" in words
    assert "runs out at **6 concurrent sessions**" in words
    assert "`pd-bidir`'s D is full (>= 95% of its KV in use) from 4 concurrent sessions on" in words
    assert "2: 1.82x (" in words and "6: 0.50x" in words


def test_no_window_when_it_never_pays(steps, turns):
    slow = turns.copy()
    later = (slow["mode"] == "pd-bidir") & (slow["turn_index"] >= 1)
    slow.loc[later, "ttft_s"] = slow.loc[later, "users"].map({1: 0.10, 2: 0.20, 4: 0.40, 6: 0.80})
    w = ew.find_window(steps, slow)
    assert (w.pays_from, w.steps) == (None, ())
    assert ew.window_words(w).startswith("**No window on this ramp**")


def test_a_forecast_window_from_its_speedups():
    fc = pd.DataFrame({"mode": ["pd", "pd-bidir"] * 3, "users": [1, 1, 2, 2, 4, 4],
                       "goodput_per_s": 1.0, "ttft_p50_s": 0.1, "ttft_p90_s": [0.2, 0.2, 0.2, 0.2, 0.2, 0.5],
                       "speedup": [None, 1.04, None, 1.5, None, 0.3]})
    fc["d_in_use_peak_fraction"] = [0.1, 0.5, 0.1, 0.96, 0.1, 0.9]
    w = ew.find_window(fc, forecast=True)
    # 1.04 is within the 5% tolerance: pays from 2; p90 0.5 vs 0.2 at 4 (no turns: no noise check);
    # D full at 2 but not at 4 after it: not full "from" any step
    assert (w.pays_from, w.ends_at, w.steps, w.d_full_from) == (2, 4, (2,), None)
