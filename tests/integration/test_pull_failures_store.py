"""The store's views of expired and failed pulls (``run_nixl_failures``) and of a run's cold start
(``run_cold_start``), read back through the Memory page's query, figure and table and the run
report's query, over hand-written rows whose answers are counted by hand below (no workers; the
real-worker routes are tests/integration/test_proxy_outcomes_vllm.py and test_faults_vllm.py).
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pandas as pd
import pytest

from dashboard import figures, tables
from store import queries
from store.queries import run_report
from store.writer import Store

T0 = dt.datetime(2026, 12, 6, 12, 0, tzinfo=dt.UTC)
P, D, PROXY = "http://127.0.0.1:8100", "http://127.0.0.1:8101", "http://127.0.0.1:8200"
LABELS = {"engine": "0", "model_name": "turnscope-tiny"}
EXPIRED, FAILED, NOTIFS = ("vllm:nixl_num_kv_expired_reqs_total", "vllm:nixl_num_failed_transfers_total",
                           "vllm:nixl_num_failed_notifications_total")

#: Run "bidir": P's counters per scrape (process start, expired, failed transfers, failed notifications)
#: and D's (expired). P restarts between the 3rd and 4th scrape: its counters start again from 0.
P_SCRAPES = [(1.7e9, 5, 2, 1), (1.7e9, 6, 2, 1), (1.7e9, 8, 3, 1), (1.8e9, 1, 0, 0), (1.8e9, 1, 1, 0)]
D_SCRAPES = [(1.7e9, 40), (1.7e9, 40), (1.7e9, 43), (1.7e9, 44), (1.7e9, 47)]
# By hand: P expired 1 + 2 + 1 (the new process's whole value) + 0 = 4; failed 0 + 1 + 0 + 1 = 2;
# notifications 0 + 0 + 0 + 0 = 0; D expired 0 + 3 + 1 + 3 = 7. The first scrape counts 0.


def _sample(run_id, i, endpoint, role, name, value, labels=None):
    return {"run_id": run_id, "scraped_at": T0 + dt.timedelta(seconds=i), "endpoint": endpoint, "role": role,
            "name": name, "labels": labels or {}, "value": float(value)}


def _turn(run_id, sid, k, at_s, reuse, **kw):
    return {"run_id": run_id, "session_id": sid, "turn_index": k, "sent_at": T0 + dt.timedelta(seconds=at_s),
            "status": kw.pop("status", "ok"), "reuse": reuse, "prompt_tokens": kw.pop("prompt_tokens", 700), **kw}


def build(root: Path) -> Store:
    """The store of this module's hand-counted runs under `root` (also the Memory page's in a real
    browser: tests/e2e/test_dashboard_browser.py)."""
    store = Store(root)
    store.init()
    runs = {"bidir": "pd-bidir", "agg": "aggregated", "warm": "pd-bidir", "no-turns": "pd"}
    turns = {
        # bidir: session b's turn 0 is sent first (0.5 s) and found nothing; two miss_expired, three
        # miss_transfer_failed, one hit
        "bidir": [_turn("bidir", "a", 0, 1.0, "miss_first_turn", prefill_leg_s=0.1, prefill_cached_tokens=0,
                        reused_tokens=0),
                  _turn("bidir", "b", 0, 0.5, "miss_first_turn", prefill_leg_s=0.1, prefill_cached_tokens=0,
                        reused_tokens=0),
                  *[_turn("bidir", "a", k, 1.0 + k, o, prefill_leg_s=0.1, prefill_cached_tokens=128)
                    for k, o in enumerate(["miss_expired", "miss_expired", "miss_transfer_failed",
                                           "miss_transfer_failed", "miss_transfer_failed", "hit"], start=1)]],
        # aggregated: the first turn sent failed (no count); the first ok turn found 0 in its usage
        "agg": [_turn("agg", "a", 0, 0.0, None, status="error", prompt_tokens=None),
                _turn("agg", "b", 0, 0.2, None, cached_tokens=0),
                _turn("agg", "b", 1, 2.0, None, cached_tokens=512)],
        # a warm start: P found 256 tokens of the first turn in its own cache and pulled 128 more
        "warm": [_turn("warm", "a", 0, 0.0, "miss_first_turn", prefill_leg_s=0.1, prefill_cached_tokens=256,
                       reused_tokens=128)],
    }
    for run_id, mode in runs.items():
        with store.writer(run_id, "t") as w:
            w.append("runs_log", {"run_id": run_id, "label": run_id, "mode": mode, "status": "complete",
                                  "started_at": T0, "updated_at": T0})
            for row in turns.get(run_id, []):
                w.append("turns", row)
    with store.writer("bidir", "scraper") as w:
        for i, ((start, exp, failed, notifs), (d_start, d_exp)) in enumerate(zip(P_SCRAPES, D_SCRAPES, strict=True)):
            w.append("metric_samples", _sample("bidir", i, P, "prefill", "process_start_time_seconds", start))
            w.append("metric_samples", _sample("bidir", i, P, "prefill", EXPIRED, exp, LABELS))
            w.append("metric_samples", _sample("bidir", i, P, "prefill", FAILED, failed, LABELS))
            w.append("metric_samples", _sample("bidir", i, P, "prefill", NOTIFS, notifs, LABELS))
            w.append("metric_samples", _sample("bidir", i, D, "decode", "process_start_time_seconds", d_start))
            w.append("metric_samples", _sample("bidir", i, D, "decode", EXPIRED, d_exp, LABELS))
            # the proxy's own series of the same names never count as vLLM's
            w.append("metric_samples", _sample("bidir", i, PROXY, "proxy", EXPIRED, 100 * i))
    return store


def build_quiet(root: Path) -> Store:
    """A store of one pd-bidir run ("quiet") whose proxy had no miss_expired or miss_transfer_failed
    and whose vLLM NIXL counters stayed flat across its three scrapes (P: 2 expired, 1 failed transfer
    before the run; D: 9 expired): by hand, every count of the run is 0 (the Memory page's quiet case,
    also in a real browser: tests/e2e/test_dashboard_browser.py)."""
    store = Store(root)
    store.init()
    with store.writer("quiet", "t") as w:
        w.append("runs_log", {"run_id": "quiet", "label": "quiet", "mode": "pd-bidir", "status": "complete",
                              "started_at": T0, "updated_at": T0})
        w.append("turns", _turn("quiet", "a", 0, 0.0, "miss_first_turn", prefill_leg_s=0.1, prefill_cached_tokens=0,
                                reused_tokens=0))
        w.append("turns", _turn("quiet", "a", 1, 1.0, "hit", prefill_leg_s=0.05, prefill_cached_tokens=0,
                                reused_tokens=640))
    with store.writer("quiet", "scraper") as w:
        for i in range(3):
            w.append("metric_samples", _sample("quiet", i, P, "prefill", "process_start_time_seconds", 1.7e9))
            w.append("metric_samples", _sample("quiet", i, P, "prefill", EXPIRED, 2, LABELS))
            w.append("metric_samples", _sample("quiet", i, P, "prefill", FAILED, 1, LABELS))
            w.append("metric_samples", _sample("quiet", i, P, "prefill", NOTIFS, 0, LABELS))
            w.append("metric_samples", _sample("quiet", i, D, "decode", "process_start_time_seconds", 1.7e9))
            w.append("metric_samples", _sample("quiet", i, D, "decode", EXPIRED, 9, LABELS))
    return store


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return build(tmp_path_factory.mktemp("store"))


@pytest.fixture(scope="module")
def con(store):
    c = store.connect()
    yield c
    c.close()


def test_nixl_failures_view_sets_vllm_counters_beside_the_proxy_outcomes(con):
    got = {r[0]: r[1:] for r in con.execute(
        "SELECT run_id, expired_turns, transfer_failed_turns, p_kv_expired_reqs, p_failed_transfers, "
        "p_failed_notifications, d_kv_expired_reqs, d_failed_transfers FROM run_nixl_failures").fetchall()}
    assert got["bidir"] == (2, 3, 4.0, 2.0, 0.0, 7.0, None)  # D exported no failed-transfer counter: NULL
    # runs without scrapes: the proxy's outcomes (0 without turns), every counter NULL, never 0
    assert got["agg"] == (0, 0, None, None, None, None, None)
    assert got["no-turns"] == (0, 0, None, None, None, None, None)


def test_memory_page_query_figure_and_table(con):
    df = queries.nixl_failures(con, ["bidir", "agg"])
    assert list(df["run_id"]) == ["agg", "bidir"]
    fig = figures.nixl_failures(df[df.run_id == "bidir"])
    drawn = {t.name: list(t.x) for t in fig.data}
    assert [name for _, name, _ in figures.NIXL_FAILURE_BARS] == list(drawn)
    assert [v[0] for v in drawn.values()] == [2, 4, 3, 2, 7]  # in NIXL_FAILURE_BARS' order
    table = tables.nixl_failures_table(df).set_index("run")
    assert table.loc["bidir", "P: KV expired"] == 4 and table.loc["bidir", "proxy miss_transfer_failed"] == 3
    assert pd.isna(table.loc["agg", "P: KV expired"])


def test_no_failed_pulls_only_where_every_count_reads_0(con, tmp_path):
    """The Memory page's one line in place of the chart: the quiet run's counts are 0 (flat counters,
    no such outcome); run bidir's are not (2 miss_expired, ...); a run with no counter scraped and no
    such outcome counts as none."""
    quiet = build_quiet(tmp_path / "quiet")
    c = quiet.connect()
    try:
        df = queries.nixl_failures(c, ["quiet"])
    finally:
        c.close()
    assert df.loc[0, ["p_kv_expired_reqs", "p_failed_transfers", "d_kv_expired_reqs"]].tolist() == [0, 0, 0]
    assert tables.no_failed_pulls(df)
    # any one of vLLM's counters, the table's columns or not (D's failed notifications), is a failure
    assert not tables.no_failed_pulls(df.assign(d_failed_notifications=1.0))
    both = queries.nixl_failures(con, ["bidir", "agg"])
    assert not tables.no_failed_pulls(both)
    assert tables.no_failed_pulls(both[both.run_id == "agg"])


def test_cold_start_reads_the_first_ok_turn(con):
    got = {r.run_id: r for r in run_report.cold_start(con, ["bidir", "agg", "warm", "no-turns"]).itertuples()}
    assert set(got) == {"bidir", "agg", "warm"}  # no turn, no row
    b = got["bidir"]
    assert (b.session_id, b.turn_index, b.counted_by, b.local_hit_tokens, b.external_tokens, b.cold) == \
        ("b", 0, "prefill", 0, 0, True)
    a = got["agg"]  # the failed turn sent first is skipped; aggregated: no external count
    assert (a.session_id, a.turn_index, a.counted_by, a.local_hit_tokens, a.cold) == ("b", 0, "aggregated", 0, True)
    assert pd.isna(a.external_tokens)
    w = got["warm"]
    assert (w.local_hit_tokens, w.external_tokens, w.cold) == (256, 128, False)


def test_the_run_summary_says_whether_the_run_started_cold(con):
    from turnscope.commands.summaries import cold_start_line

    rows = run_report.cold_start(con, ["bidir", "agg", "warm"]).set_index("run_id")
    lines = {r: cold_start_line(rows.loc[r]) for r in rows.index}
    assert lines["bidir"] == ("cold start: checked, the first turn (session b, turn 0, 700 prompt tokens) found 0 "
                              "tokens cached")
    assert lines["agg"].startswith("cold start: checked")
    assert lines["warm"] == ("NOT A COLD START: the first turn (session a, turn 0, 700 prompt tokens) found 384 "
                             "tokens cached on P (256 in its own prefix cache, 128 loaded from elsewhere)")


def test_memory_page_draws_expired_and_failed_pulls(monkeypatch, store):
    """The Memory page over this store: the panel's chart draws each run's five bars and its table
    the counts above (Streamlit's AppTest; the browser check is tests/e2e)."""
    from tests.integration.test_dashboard_pages import charts, open_page, values

    at = open_page(monkeypatch, store.root, "memory")
    fig = charts(at)["Expired and failed pulls per run (requests)"]
    bars = {t.name: dict(zip(list(t.y), values(t.x), strict=True)) for t in fig.data}
    name = next(n for n in next(iter(bars.values())) if n.startswith("bidir"))
    assert [bars[label][name] for _, label, _ in figures.NIXL_FAILURE_BARS] == [2, 4, 3, 2, 7]
    table = next(d.value for d in at.dataframe if "P: KV expired" in d.value.columns).set_index("run")
    assert table.loc["bidir", "P: KV expired"] == 4 and table.loc["bidir", "D: KV expired"] == 7
