"""Every dashboard page, run headless by Streamlit's AppTest over a real store (store.writer's writer).

Expected numbers come from hand-written SQL over the raw Parquet shards (`dashboard_store.raw_sql`:
not the store's views, not the dashboard's queries) or are computed here by hand from the
fixture's own functions (tests/dashboard_store.py).
"""

from __future__ import annotations

import base64
import datetime as dt
import statistics
from pathlib import Path

import duckdb
import numpy as np
import pandas as pd
import plotly.io as pio
import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest

from dashboard import pages
from dashboard.charts import ENV_VAR as CHARTS_ENV
from store import hit_rate
from store.writer import Store
from tests import dashboard_store as fx

APP = pages.APP
TIMEOUT_S = 60
#: The pages an evaluation's store fills (dashboard/pages.py).
PAGES = tuple(p.slug for p in pages.drawing("runs", "store"))
GIB = 2**30


@pytest.fixture(scope="module")
def store_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fx.build(tmp_path_factory.mktemp("store"))


def open_page(monkeypatch: pytest.MonkeyPatch, root: Path, page: str) -> AppTest:
    monkeypatch.setenv("TURNSCOPE_STORE", str(root))
    monkeypatch.setenv(CHARTS_ENV, "1")  # charts drawn (the default), whatever the environment says
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT_S).run()
    if not pages.page(page).default:
        at.switch_page(pages.page(page).script).run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.title[0].value == pages.page(page).title
    return at


def rerun(at: AppTest) -> AppTest:
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def values(v) -> list:
    """A Plotly trace array as a list; plotly >= 6 serialises numeric arrays as base64 ``bdata``."""
    if isinstance(v, dict) and "bdata" in v:
        return np.frombuffer(base64.b64decode(v["bdata"]), dtype=np.dtype(v["dtype"])).tolist()
    return list(v)


def charts(at: AppTest) -> dict:
    """The page's Plotly figures by their title."""
    out = {}
    for c in at.get("plotly_chart"):
        fig = pio.from_json(c.proto.spec)
        out[fig.layout.title.text] = fig
    return out


def frame(at: AppTest, column: str):
    """The first table on the page with a column named `column` (AppTest keys only widgets)."""
    return next(d.value for d in at.dataframe if column in d.value.columns)


def xy(trace) -> dict:
    return dict(zip(values(trace.x), values(trace.y), strict=True))


def later_turns(run_ids=None):
    """(run_id, session, turn) of every turn with turn_index >= 1 in the fixture."""
    for r in run_ids or fx.RUNS:
        for s in range(fx.SESSIONS):
            for t in range(1, fx.TURNS):
                yield r, s, t


# --- Turns --------------------------------------------------------------------------------------


def test_turns_latency_by_turn_index_and_history(monkeypatch, store_root):
    at = open_page(monkeypatch, store_root, "turns")
    fig = next(f for t, f in charts(at).items() if t.startswith("Latency by turn index"))
    ttft_hit = next(tr for tr in fig.data if tr.name == "pd-bidir · hit" and tr.xaxis == "x")
    e2e_hit = next(tr for tr in fig.data if tr.name == "pd-bidir · hit" and tr.xaxis == "x3")
    got, got_e2e = xy(ttft_hit), xy(e2e_hit)
    for turn in (1, 2, 3):
        (ttft, e2e) = fx.raw_sql(
            store_root,
            f"""SELECT quantile_cont(t.ttft_s, 0.5), quantile_cont(t.e2e_s, 0.5)
                FROM {{turns}} t JOIN {{modes}} m USING (run_id)
                WHERE m.mode = 'pd-bidir' AND t.reuse = 'hit' AND t.status = 'ok' AND t.turn_index = {turn}""",
        )[0]
        assert got[turn] == pytest.approx(ttft * 1e3) and got_e2e[turn] == pytest.approx(e2e * 1e3)
    # By hand: turn 1 hits are every session of both pd-bidir runs.
    by_hand = statistics.median(fx.ttft_s(r, s, 1) for r in ("bidir-1", "bidir-2") for s in range(3))
    assert got[1] == pytest.approx(by_hand * 1e3)
    assert fig.layout.yaxis.title.text == "median (ms)"

    at.segmented_control(key="turns_by").set_value("history length")
    rerun(at)
    fig = next(f for t, f in charts(at).items() if t.startswith("Latency by history length"))
    nores = xy(next(tr for tr in fig.data if tr.name == "pd-bidir-nocache · miss_no_handle_returned" and tr.xaxis == "x"))
    # Prompts are 1000 + 300 t tokens (max 1900): bins of 100 tokens, so one bin per turn index.
    assert sorted(nores) == [1300.0, 1600.0, 1900.0]
    (p50,) = fx.raw_sql(
        store_root,
        "SELECT quantile_cont(ttft_s, 0.5) FROM {turns} WHERE run_id = 'bnc-1' AND prompt_tokens = 1600",
    )[0]
    assert nores[1600.0] == pytest.approx(p50 * 1e3)
    assert fig.layout.xaxis.title.text == "prompt length (tokens, history included)"


def test_turns_time_split(monkeypatch, store_root):
    at = open_page(monkeypatch, store_root, "turns")
    fig = next(f for t, f in charts(at).items() if t.startswith("Where each turn's time went"))
    panel = {a.text: i + 1 for i, a in enumerate(fig.layout.annotations)}  # subplot titles = modes

    def part(name: str, mode: str) -> dict:
        axis = "x" if panel[mode] == 1 else f"x{panel[mode]}"
        return xy(next(tr for tr in fig.data if tr.name == name and tr.xaxis == axis))

    # By hand, pd-bidir turn 2: the mean over its ok turns of each part, in ms.
    rate = {}  # run -> NIXL seconds per pulled token: measured NIXL time / tokens the turns pulled
    for r in ("bidir-1", "bidir-2"):
        pulled = sum(fx.turn_row(r, s, t, fx.T0).get("reused_tokens") or 0 for s in range(3) for t in range(4))
        rate[r] = fx.EXPECTED_XFER_S[r] / pulled
    rows = [(r, s) for r in ("bidir-1", "bidir-2") for s in range(3)]
    xfer = [fx.turn_row(r, s, 2, fx.T0)["reused_tokens"] * rate[r] for r, s in rows]
    legs = [fx.ttft_s(r, s, 2) - fx.PROXY_S for r, s in rows]
    assert part("KV transfer from D (estimate)", "pd-bidir")[2] == pytest.approx(np.mean(xfer) * 1e3)
    assert part("prefill leg (compute)", "pd-bidir")[2] == pytest.approx((np.mean(legs) - np.mean(xfer)) * 1e3)
    assert part("proxy, queue, D's first token", "pd-bidir")[2] == pytest.approx(fx.PROXY_S * 1e3)
    assert part("decode (after first token)", "pd-bidir")[2] == pytest.approx(500.0)
    # pd-bidir-nocache pulls nothing: no transfer bar at all; aggregated has no split.
    assert not any(tr.name == "KV transfer from D (estimate)" and tr.xaxis == f"x{panel['pd-bidir-nocache']}"
                   for tr in fig.data)  # fmt: skip
    agg = part("to first token (no proxy: not split)", "aggregated")
    assert agg[1] == pytest.approx(np.mean([fx.ttft_s("agg-1", s, 1) for s in range(3)]) * 1e3)
    assert any("estimate" in c.value for c in at.caption)


def shortfall_sql(root: Path, extra: str = "") -> list[tuple]:
    return fx.raw_sql(
        root,
        f"""SELECT run_id, session_id, turn_index FROM {{turns}}
            WHERE status = 'ok' AND turn_index >= 1 AND expected_reusable_tokens IS NOT NULL
              AND expected_reusable_tokens
                  - CASE WHEN reuse IS NOT NULL THEN coalesce(reused_tokens, 0) + coalesce(prefill_cached_tokens, 0)
                         ELSE cached_tokens END >= 128 {extra}
            ORDER BY ALL""",
    )


def test_turns_expected_vs_measured_reuse(monkeypatch, store_root):
    at = open_page(monkeypatch, store_root, "turns")
    expected = shortfall_sql(store_root)
    # By hand: both pd-bidir runs' resumed turn (expired) and bidir-2's mismatch, and every later
    # turn of pd-bidir-nocache (9); the edited turns reused 640 of 700 (under one block).
    assert len(expected) == 2 + 1 + 9
    table = at.dataframe[0].value
    assert sorted(zip(table["run_id"], table["session"], table["turn"], strict=True)) == expected
    assert any(m.value.startswith(f"**{len(expected)} turn(s) of `pd-bidir`, `pd-bidir-nocache` where the engine reused")
               for m in at.markdown)
    mismatch = table[(table["run_id"] == "bidir-2") & (table["turn"] == 2)].iloc[0]
    assert mismatch["shortfall"] == fx.expected_reusable(2, 2) - 512

    fig = next(f for t, f in charts(at).items() if t == "Expected vs measured reuse")
    measured = xy(next(tr for tr in fig.data if tr.name == "pd-bidir, measured"))
    (avg,) = fx.raw_sql(
        store_root,
        """SELECT avg(coalesce(reused_tokens, 0) + coalesce(prefill_cached_tokens, 0)) FROM {turns} t
           JOIN {modes} m USING (run_id) WHERE m.mode = 'pd-bidir' AND status = 'ok' AND turn_index = 2""",
    )[0]
    assert measured[2] == pytest.approx(avg)

    # A larger tolerance keeps only the bigger shortfalls.
    at.number_input(key="turns_min_shortfall").set_value(1400)
    rerun(at)
    big = fx.raw_sql(store_root, """SELECT count(*) FROM {turns} WHERE status = 'ok' AND turn_index >= 1
        AND expected_reusable_tokens - coalesce(reused_tokens, 0) - coalesce(prefill_cached_tokens, 0) >= 1400
        AND reuse IS NOT NULL""")[0][0]  # fmt: skip
    assert len(at.dataframe[0].value) == big == 4  # the expired resumes, bnc-1's resume and retry


def _add_run_short_by_design(root: Path, run_id: str, mode: str, sessions: int, p_cached: int) -> None:
    """A run of `mode` whose later turns expected 1,000 reusable tokens and got `p_cached` from P's
    own prefix cache (none from D): every one falls short, by design of the mode."""
    w = Store(root).writer(run_id, "test", flush_interval_s=60)
    try:
        start = fx.T0 + dt.timedelta(hours=2)
        w.append("runs_log", {"label": run_id, "mode": mode, "workload": fx.WORKLOAD, "history_mode": fx.HISTORY,
                              "status": "complete", "started_at": start, "updated_at": start})
        for s in range(sessions):
            for t in range(3):
                w.append("turns", {
                    "session_id": f"{run_id}-s{s}", "turn_index": t, "request_id": f"{run_id}-s{s}-t{t}",
                    "kind": "turn", "gap_kind": "tool", "gap_before_s": 1.0,
                    "sent_at": start + dt.timedelta(seconds=10 * s + t), "ttft_s": 0.1, "e2e_s": 0.2,
                    "prompt_tokens": 1200, "completion_tokens": 32, "status": "ok",
                    "expected_reusable_tokens": 1000 if t else None, "reuse": "miss_no_handle" if t else None,
                    "reused_tokens": 0, "prefill_cached_tokens": p_cached,
                })  # fmt: skip
    finally:
        w.close()


def test_shortfall_list_covers_only_modes_that_can_reuse_from_d(monkeypatch, tmp_path):
    """`pd` and `pd-nocache` cannot reuse KV from D: their shortfalls are counted apart, not listed."""
    root = fx.build(tmp_path / "store")
    _add_run_short_by_design(root, "pdnc-1", "pd-nocache", sessions=3, p_cached=0)  # 3 x 2 later turns short
    _add_run_short_by_design(root, "pd-1", "pd", sessions=2, p_cached=512)  # 1000 - 512 >= 128: 2 x 2 short
    st.cache_data.clear()
    at = open_page(monkeypatch, root, "turns")
    table = at.dataframe[0].value
    assert set(table["mode"]) == {"pd-bidir", "pd-bidir-nocache"}
    assert sorted(zip(table["run_id"], table["session"], table["turn"], strict=True)) == shortfall_sql(
        root, "AND run_id NOT IN ('pdnc-1', 'pd-1')")
    assert set(table["history"]) == {fx.HISTORY}
    heading = next(m.value for m in at.markdown if "where the engine reused" in m.value)
    assert "`pd-bidir`, `pd-bidir-nocache`" in heading and heading.startswith("**12 turn(s)")
    caption = next(c.value for c in at.caption if c.value.startswith("Short by design"))
    assert "`pd` 4 turn(s)" in caption and "`pd-nocache` 6 turn(s)" in caption, caption


def test_turn_kind_filter_applies_to_turns(monkeypatch, store_root):
    at = open_page(monkeypatch, store_root, "turns")
    at.sidebar.multiselect(key="ts_kinds").set_value(["resume"])
    rerun(at)
    table = at.dataframe[0].value
    assert sorted(zip(table["run_id"], table["turn"], strict=True)) == [
        (r, 3) for r, _, _ in shortfall_sql(store_root, "AND kind = 'resume'")
    ]
    assert set(table["kind"]) == {"resume"}


def test_gap_kind_and_archetype_filters_narrow_the_headline(monkeypatch, store_root):
    at = open_page(monkeypatch, store_root, "overview")
    at.sidebar.multiselect(key="ts_gap_kinds").set_value(["think"])
    at.sidebar.multiselect(key="ts_archetypes").set_value(["coding"])
    rerun(at)
    (ratio,) = fx.raw_sql(
        store_root,
        """WITH k AS (
               SELECT m.mode, t.ttft_s FROM {turns} t JOIN {modes} m USING (run_id)
               JOIN {sessions} s USING (run_id, session_id)
               WHERE t.status = 'ok' AND t.turn_index >= 1 AND t.gap_kind = 'think' AND s.archetype = 'coding')
           SELECT (SELECT median(ttft_s) FROM k WHERE mode = 'pd-bidir')
                / (SELECT median(ttft_s) FROM k WHERE mode = 'aggregated')""",
    )[0]
    assert [m.value for m in at.metric] == [f"{1 / ratio:.2f}x"]  # the speed-up


# --- Sessions -----------------------------------------------------------------------------------


def test_sessions_task_split_and_timeline(monkeypatch, store_root):
    at = open_page(monkeypatch, store_root, "sessions")
    fig = next(f for t, f in charts(at).items() if t.startswith("Task latency per session"))
    llm = next(tr for tr in fig.data if tr.name == "LLM (sum of E2E)")
    pause = next(tr for tr in fig.data if tr.name == "pause")
    bars = dict(zip(values(llm.y), values(llm.x), strict=True))
    pauses = dict(zip(values(pause.y), values(pause.x), strict=True))
    (avg_llm, avg_pause, n) = fx.raw_sql(
        store_root,
        """SELECT avg(s.llm_s), avg(s.pause_s), count(*) FROM {sessions} s JOIN {modes} m USING (run_id)
           WHERE m.mode = 'pd-bidir' AND s.archetype = 'coding'""",
    )[0]
    assert bars[f"pd-bidir · coding ({n})"] == pytest.approx(avg_llm)
    by_hand = np.mean([sum(fx.e2e_s(r, s, t) or 0 for t in range(4)) for r in ("bidir-1", "bidir-2") for s in (0, 1)])
    assert avg_llm == pytest.approx(by_hand)
    assert pauses[f"pd-bidir · coding ({n})"] == pytest.approx(avg_pause) == pytest.approx(500.0 / 2)  # one paused

    # No session picked: no timeline yet, and the table lists every session, slowest first.
    assert len(charts(at)) == 1
    table = at.dataframe[0].value
    assert len(table) == len(fx.RUNS) * fx.SESSIONS
    assert list(table["task (s)"]) == sorted(table["task (s)"], reverse=True)

    at.selectbox(key="session_pick").set_value("bidir-1/bidir-1-s0")
    rerun(at)
    timeline = charts(at)["Session timeline"]
    bars = {(tr.name, tr.y[0]): (tr.base[0], tr.x[0]) for tr in timeline.data}
    start3 = (fx.sent_at("bidir-1", 0, 3) - fx.sent_at("bidir-1", 0, 0)).total_seconds()
    assert bars[("gap: pause", "turn 3 · resume")] == pytest.approx((start3 - 500.0, 500.0))
    assert bars[("to first token: miss_expired", "turn 3 · resume")] == pytest.approx(
        (start3, fx.ttft_s("bidir-1", 0, 3))
    )
    assert bars[("streaming", "turn 1 · turn")][1] == pytest.approx(0.5)


def test_sessions_archetype_filter(monkeypatch, store_root):
    at = open_page(monkeypatch, store_root, "sessions")
    at.sidebar.multiselect(key="ts_archetypes").set_value(["support"])
    rerun(at)
    table = at.dataframe[0].value
    (n,) = fx.raw_sql(store_root, "SELECT count(*) FROM {sessions} WHERE archetype = 'support'")[0]
    assert len(table) == n == len(fx.RUNS) and set(table["archetype"]) == {"support"}


# --- Memory -------------------------------------------------------------------------------------


def test_memory_timeline(monkeypatch, store_root):
    at = open_page(monkeypatch, store_root, "memory")
    fig = charts(at)["Memory next to reuse"]

    def series(prefix: str) -> list:
        tr = next(t for t in fig.data if t.hovertemplate.startswith(prefix))
        return values(tr.y)

    # The idle per-pid copy (0) never wins over P's live value.
    assert series("bidir a · pd-bidir · prefill") == pytest.approx([v * 100 for v in fx.P_USAGE])
    assert series("bidir a · pd-bidir · decode") == pytest.approx([v * 100 for v in fx.D_USAGE])
    assert series("baseline · aggregated · aggregated") == pytest.approx([v * 100 for v in fx.AGG_USAGE])
    assert series("bidir b · pd-bidir · handles") == pytest.approx([b / fx.MIB for b in fx.HANDLE_BYTES["bidir-2"]])
    # Hit rate per bucket of send time, against SQL over the raw turns.
    rates = series("bidir a · pd-bidir · hit rate")
    (hits, later) = fx.raw_sql(
        store_root,
        "SELECT count(*) FILTER (WHERE reuse = 'hit'), count(*) FROM {turns} WHERE run_id = 'bidir-1' AND turn_index >= 1",
    )[0]
    assert min(rates) < 100 and hits / later < 1  # the expired resume shows as a dip


def test_memory_cost_of_reuse(monkeypatch, store_root):
    at = open_page(monkeypatch, store_root, "memory")
    cost = frame(at, "GiB·s per s saved").set_index("run")
    for run_id in ("bidir-1", "bidir-2"):
        label = fx.RUNS[run_id][1]
        row = cost.loc[label]
        # By hand: compute seconds per token over the ok turns that pulled nothing.
        leg = tok = 0.0
        pulled = 0
        for s in range(fx.SESSIONS):
            for t in range(fx.TURNS):
                r = fx.turn_row(run_id, s, t, fx.T0)
                if r["status"] != "ok":
                    continue
                pulled += r["reused_tokens"]
                if r["reused_tokens"] == 0 and r["recomputed_tokens"] > 0:
                    leg += r["prefill_leg_s"]
                    tok += r["recomputed_tokens"]
        saved = pulled * leg / tok - fx.EXPECTED_XFER_S[run_id]
        assert row["held (GiB·s)"] == pytest.approx(fx.EXPECTED_HELD_GIB_S[run_id])
        assert row["NIXL (s)"] == f"{fx.EXPECTED_XFER_S[run_id]:.3f}"  # shown as text: blank where none
        assert row["pulled (tokens)"] == pulled
        assert float(row["prefill ms/1k tok"]) == pytest.approx(leg / tok * 1e6, abs=0.005)  # text, 2 places
        assert float(row["saved (s, est.)"]) == pytest.approx(saved, abs=0.0005)  # text, 3 places
        assert row["GiB·s per s saved"] == f"{fx.EXPECTED_HELD_GIB_S[run_id] / saved:.4f}"
    assert cost.loc["bidir nocache", "GiB·s per s saved"] == ""  # nothing saved: a blank, not None


def whatif_by_hand(ttl: float, sessions=range(fx.SESSIONS), kinds=None, mode: str | None = None
                   ) -> tuple[int, int, float]:
    """(later turns, hits, GiB x s held) replayed from the fixture's gaps for one TTL, over the
    turns of `sessions` whose kind is in `kinds` (all when None), in the runs that keep handles.
    A turn can hit only when its recorded outcome depends on the TTL (a hit or a miss by expiry);
    a kept turn's KV is held until its successor in the session pulls it (the gap, when the
    successor hits at this TTL), else for the whole TTL. `mode`: that mode's runs only (else all)."""
    later = hits = 0
    byte_s = 0.0

    def hits_at(r: str, s: int, t: int) -> bool:
        gap, _, kind = fx.gap(s, t)
        return (t >= 1 and kind != "fresh" and fx.reuse(r, s, t) in ("hit", "miss_expired")
                and gap < ttl - fx.MARGIN_S)

    for r in (r for r, (m, *_) in fx.RUNS.items() if m.startswith("pd-bidir") and mode in (None, m)):  # hold handles
        for s in sessions:
            for t in range(fx.TURNS):
                _, _, kind = fx.gap(s, t)
                if kinds is not None and kind not in kinds:
                    continue
                if t >= 1:
                    later += 1
                    hits += hits_at(r, s, t)
                if fx.ttft_s(r, s, t) is None:
                    continue  # a failed turn leaves no KV behind
                pulled = t + 1 < fx.TURNS and hits_at(r, s, t + 1)
                held_for = fx.gap(s, t + 1)[0] if pulled else ttl
                byte_s += (fx.prompt_tokens(t) + 32 - 1) * fx.KV_BYTES_PER_TOKEN * held_for  # remote_num_tokens
    return later, hits, byte_s / GIB


def test_memory_whatif_ttl(monkeypatch, store_root):
    at = open_page(monkeypatch, store_root, "memory")
    table = frame(at, "decoder_kv_blocks_ttl (s)").set_index(["mode", "decoder_kv_blocks_ttl (s)"])
    assert ("pd-bidir", 480.0) in table.index  # the runs' own TTL is always replayed
    # one row per mode and TTL: modes are never pooled (store.hit_rate)
    for mode in ("pd-bidir", "pd-bidir-nocache"):
        for ttl in (60.0, 120.0, 480.0, 900.0):
            later, hits, gib_s = whatif_by_hand(ttl, mode=mode)
            row = table.loc[(mode, ttl)]
            assert (row["later turns"], row["hits"]) == (later, hits)
            assert row["KV held (GiB·s)"] == pytest.approx(gib_s)
            assert row["hit rate (later turns)"] == pytest.approx(hits / later)
    # The 500 s pause hits only once TTL - 30 s exceeds it.
    # 2 pd-bidir runs x 3 sessions x 3 later turns = 18; bidir-2's mismatch is not the TTL's: 17 can
    # hit, and at 480 s the 2 resumes after a 500 s pause do not. bnc-1's 9 never had a handle.
    assert table.loc[("pd-bidir", 900.0), "later turns"] == 18
    assert table.loc[("pd-bidir", 480.0), "hits"] == 17 - 2 and table.loc[("pd-bidir", 900.0), "hits"] == 17
    assert table.loc[("pd-bidir-nocache", 900.0), "later turns"] == 9
    assert table.loc[("pd-bidir-nocache", 900.0), "hits"] == 0
    fig = next(f for t, f in charts(at).items() if t.startswith("What if the TTL"))
    assert {shape.x0 for shape in fig.layout.shapes} == {480.0}  # the configured TTL, marked in each panel


def test_memory_whatif_replays_whole_runs_whatever_the_filters(monkeypatch, store_root):
    """D holds every turn's KV whatever the sidebar keeps: the what-if with D's space as the limit
    replays whole runs, so the archetype and kind filters leave it as it is."""
    at = open_page(monkeypatch, store_root, "memory")
    before = frame(at, "decoder_kv_blocks_ttl (s)")
    at.sidebar.multiselect(key="ts_archetypes").set_value(["support"])
    at.sidebar.multiselect(key="ts_kinds").set_value(["turn"])
    rerun(at)
    after = frame(at, "decoder_kv_blocks_ttl (s)")
    pd.testing.assert_frame_equal(before, after)
    later, hits, _ = whatif_by_hand(480.0, mode="pd-bidir")
    got = after.set_index(["mode", "decoder_kv_blocks_ttl (s)"]).loc[("pd-bidir", 480.0), ["later turns", "hits"]]
    assert got.tolist() == [later, hits] == [18, 15]


# --- Compare ------------------------------------------------------------------------------------


def compare_sql(root: Path, a: str, b: str, where: str) -> float:
    """median TTFT of A / median TTFT of B over ok later turns matching `where`; a and b are SQL
    conditions on the run (e.g. ``m.mode = 'pd-bidir'``)."""
    (ratio,) = fx.raw_sql(
        root,
        f"""WITH k AS (SELECT t.*, m.mode FROM {{turns}} t JOIN {{modes}} m USING (run_id)
                       WHERE t.status = 'ok' AND t.turn_index >= 1 AND ({where}))
            SELECT (SELECT median(ttft_s) FROM k m WHERE {a}) / (SELECT median(ttft_s) FROM k m WHERE {b})""",
    )[0]
    return ratio


# Favourable by hand: a continuation within the proxy TTL, 480 s - 30 s for every run.
FAVOURABLE = "kind = 'turn' AND gap_before_s < 450"


def test_compare_modes_headline_equals_sql(monkeypatch, store_root):
    at = open_page(monkeypatch, store_root, "compare")
    a, b = "m.mode = 'pd-bidir'", "m.mode = 'aggregated'"
    # Hit rate of A's later turns (store.hit_rate), from the fixture's outcomes by hand: 2 runs x 3
    # sessions x 3 later turns = 18; not hits: each run's resume after the 500 s pause (expired) and
    # bidir-2's mismatch: 15 / 18 = 83%. B (aggregated) has no proxy outcome.
    later = [fx.reuse(r, s, t) for r in ("bidir-1", "bidir-2") for s in range(fx.SESSIONS) for t in range(1, fx.TURNS)]
    assert len(later) == 18 and later.count("hit") == 15
    assert any(c.value.startswith("Hit rate (later turns): A 83%, B n/a (n/a: no proxy outcome") for c in at.caption), [c.value for c in at.caption]
    metrics = {m.label: m.value for m in at.metric}
    # Speed-ups B / A (the one convention: baseline over bidirectional).
    assert metrics == {
        "all later turns": f"{1 / compare_sql(store_root, a, b, 'true'):.2f}x",
        "favourable turns": f"{1 / compare_sql(store_root, a, b, FAVOURABLE):.2f}x",
        "unfavourable turns": f"{1 / compare_sql(store_root, a, b, 'NOT (' + FAVOURABLE + ')'):.2f}x",
    }
    # The favourable turns are turns 1 and 2 of every session: by hand.
    fav = statistics.median(fx.ttft_s(r, s, t) for r in ("bidir-1", "bidir-2") for s in range(3) for t in (1, 2))
    agg = statistics.median(fx.ttft_s("agg-1", s, t) for s in range(3) for t in (1, 2))
    assert metrics["favourable turns"] == f"{agg / fav:.2f}x"
    text = "\n".join(m.value for m in at.markdown)
    assert "pd-bidir is faster than aggregated on favourable turns" in text and "Bottom line:" in text

    fig = next(f for t, f in charts(at).items() if t.startswith("Speed-up of A by turn index"))
    ratio = {k: 1 / v for k, v in xy(fig.data[0]).items()}
    for turn in (0, 2):
        (expected,) = fx.raw_sql(
            store_root,
            f"""SELECT (SELECT median(ttft_s) FROM {{turns}} t JOIN {{modes}} m USING (run_id)
                        WHERE m.mode = 'pd-bidir' AND status = 'ok' AND turn_index = {turn})
                     / (SELECT median(ttft_s) FROM {{turns}} WHERE run_id = 'agg-1' AND turn_index = {turn})""",
        )[0]
        assert ratio[turn] == pytest.approx(expected)
    lo = np.array(values(fig.data[0].error_y.arrayminus))
    hi = np.array(values(fig.data[0].error_y.array))
    assert (lo >= 0).all() and (hi >= 0).all()  # the CI brackets the speed-up

    cases = frame(at, "case").set_index("case")
    assert list(cases.index) == ["continued within TTL", "resume", "edit", "retry"]
    (n_resume_a,) = fx.raw_sql(
        store_root,
        "SELECT count(*) FROM {turns} t JOIN {modes} m USING (run_id) WHERE m.mode = 'pd-bidir' AND kind = 'resume'",
    )[0]
    assert cases.loc["resume", "n A"] == n_resume_a == 2


def test_compare_runs(monkeypatch, store_root):
    at = open_page(monkeypatch, store_root, "compare")
    at.segmented_control(key="cmp_by").set_value("runs")
    rerun(at)
    # each run is named with its routing policies when it recorded them (tests/dashboard_store.config)
    options = at.selectbox(key="cmp_a_runs").options
    assert "bidir b · pd-bidir · P session · D session · token_ids" in options, options
    assert "bidir nocache · pd-bidir-nocache · token_ids" in options, options
    at.selectbox(key="cmp_a_runs").set_value("bnc-1")
    at.selectbox(key="cmp_b_runs").set_value("bidir-2")
    rerun(at)
    a, b = "m.run_id = 'bnc-1'", "m.run_id = 'bidir-2'"
    assert at.metric[0].value == f"{1 / compare_sql(store_root, a, b, 'true'):.2f}x"
    assert at.metric[1].value == f"{1 / compare_sql(store_root, a, b, FAVOURABLE):.2f}x"
    assert any("slower than" in m.value for m in at.markdown)


def test_compare_needs_two(monkeypatch, store_root):
    at = open_page(monkeypatch, store_root, "compare")
    at.sidebar.multiselect(key="ts_modes").set_value(["aggregated"])
    rerun(at)
    assert any("needs two modes" in i.value for i in at.info) and not at.metric


# --- SQL ----------------------------------------------------------------------------------------


def test_sql_console_runs_queries(monkeypatch, store_root):
    at = open_page(monkeypatch, store_root, "sql")
    at.button(key="sql_run").click()
    rerun(at)
    assert sorted(at.dataframe[0].value["run_id"]) == sorted(fx.RUNS)  # the default example
    at.text_area(key="sql_text").set_value("SELECT mode, count(*) AS n FROM turn_breakdown GROUP BY mode ORDER BY mode")
    at.button(key="sql_run").click()
    rerun(at)
    got = at.dataframe[0].value
    expected = fx.raw_sql(store_root, "SELECT mode, count(*) FROM {turns} JOIN {modes} USING (run_id) GROUP BY 1 ORDER BY 1")
    assert list(zip(got["mode"], got["n"], strict=True)) == expected
    # Every example runs.
    from store import console as sqlconsole

    for name in sqlconsole.EXAMPLES:
        at.selectbox(key="sql_example").set_value(name)
        rerun(at)
        at.button(key="sql_run").click()
        rerun(at)
        assert not at.error, (name, [e.value for e in at.error])


@pytest.mark.parametrize(
    "sql, why",
    [
        ("COPY (SELECT * FROM turns) TO '{out}'", "COPY"),
        ("ATTACH '{out}' AS x", "ATTACH"),
        ("CREATE TABLE x AS SELECT 1", "CREATE"),
        ("INSERT INTO runs_log (run_id, updated_at) VALUES ('x', now())", "INSERT"),
        ("EXPLAIN ANALYZE COPY (SELECT 1) TO '{out}'", "EXPLAIN"),
        ("SELECT 1; DROP VIEW turns", "One statement at a time"),
        ("SET threads = 1", "SET"),
    ],
)
def test_sql_console_refuses_writes(monkeypatch, store_root, tmp_path, sql, why):
    out = tmp_path / "out.db"
    at = open_page(monkeypatch, store_root, "sql")
    at.text_area(key="sql_text").set_value(sql.format(out=out))
    at.button(key="sql_run").click()
    rerun(at)
    assert len(at.error) == 1 and why in at.error[0].value, at.error[0].value
    assert not out.exists()
    assert not at.dataframe


def test_sql_console_reports_errors(monkeypatch, store_root):
    at = open_page(monkeypatch, store_root, "sql")
    at.text_area(key="sql_text").set_value("SELECT * FROM no_such_view")
    at.button(key="sql_run").click()
    rerun(at)
    assert len(at.error) == 1 and at.error[0].value.startswith("DuckDB:") and "no_such_view" in at.error[0].value


# --- the store while a run writes -----------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES)
def test_every_page_holds_no_lock(monkeypatch, store_root, page):
    open_page(monkeypatch, store_root, page)
    con = duckdb.connect(str(store_root / "turnscope.duckdb"))  # what a writer creating views needs
    con.close()


def test_pages_follow_a_run_that_is_still_writing(monkeypatch, tmp_path):
    """A run appends turns while the dashboard is open: each page renders throughout, and after a
    refresh shows the new rows."""
    store = Store(tmp_path)
    store.init()
    w = store.writer("live-1", "test", flush_interval_s=0.05)
    start = fx.T0
    w.append("runs_log", {"mode": "pd-bidir", "status": "running", "started_at": start, "updated_at": start,
                          "config": fx.config("bidir-1")})  # fmt: skip
    w.flush()
    try:
        # Just started: every page renders its empty state.
        for page in PAGES:
            at = open_page(monkeypatch, tmp_path, page)
        at = open_page(monkeypatch, tmp_path, "turns")
        assert any("No ok turns" in i.value for i in at.info)
        at = open_page(monkeypatch, tmp_path, "sessions")
        assert any("No finished sessions" in i.value for i in at.info)
        at = open_page(monkeypatch, tmp_path, "memory")
        assert any("No `vllm:kv_cache_usage_perc`" in i.value for i in at.info)

        for t in range(3):
            w.append("turns", fx.turn_row("bidir-1", 0, t, fx.sent_at("bidir-1", 0, t)) | {"session_id": "s0"})
            w.append("metric_samples", {"scraped_at": start + dt.timedelta(seconds=t), "endpoint": "http://d",
                                        "role": "decode", "name": "vllm:kv_cache_usage_perc", "value": 0.1 * t})  # fmt: skip
            w.flush()
            for page in PAGES:
                at = open_page(monkeypatch, tmp_path, page)
                if page == "turns":
                    at.sidebar.button[0].click()  # Refresh: forget cached results
                    rerun(at)
        st.cache_data.clear()
        at = open_page(monkeypatch, tmp_path, "sql")
        at.text_area(key="sql_text").set_value("SELECT count(*) AS n FROM turns")
        at.button(key="sql_run").click()
        rerun(at)
        assert at.dataframe[0].value["n"][0] == 3
        at = open_page(monkeypatch, tmp_path, "turns")
        fig = next(f for t, f in charts(at).items() if t.startswith("Latency by turn index"))
        assert sorted(xy(next(tr for tr in fig.data if tr.name == "pd-bidir · hit" and tr.xaxis == "x"))) == [1, 2]
        # A writer re-creating the views (read-write open) is not blocked by the open dashboard.
        duckdb.connect(str(tmp_path / "turnscope.duckdb")).close()
    finally:
        w.close()


def test_compare_follows_the_archetype_filter(monkeypatch, store_root):
    at = open_page(monkeypatch, store_root, "compare")
    at.sidebar.multiselect(key="ts_archetypes").set_value(["coding"])
    rerun(at)
    where = "(run_id, session_id) IN (SELECT (run_id, session_id) FROM {sessions} WHERE archetype = 'coding')"
    a, b = "m.mode = 'pd-bidir'", "m.mode = 'aggregated'"
    assert at.metric[0].value == f"{1 / compare_sql(store_root, a, b, where):.2f}x"
    assert at.metric[1].value == f"{1 / compare_sql(store_root, a, b, where + ' AND ' + FAVOURABLE):.2f}x"


def test_run_report_export(store_root):
    from dashboard import html_reports
    from store import db
    from store.queries import TurnFilter

    html = html_reports.run_report(db.StoreLocation(store_root), TurnFilter(tuple(fx.RUNS)), "4 runs")
    ratio = compare_sql(store_root, "m.mode = 'pd-bidir'", "m.mode = 'aggregated'", "true")
    assert f"pd-bidir vs aggregated: speed-up {1 / ratio:.2f}x" in html
    assert html.count('class="plotly-graph-div"') == 8 and "<script src=" not in html.split("</script>", 1)[1]
    for title in ("Where each turn", "Task latency per session", "Memory next to reuse", "Expected vs measured reuse"):
        assert title in html


def test_turn_rows_is_turn_breakdown_without_the_archetype(store_root):
    """The dashboard's lean relation (store.queries.TURN_ROWS_SQL) must not drift from the
    contract's turn_breakdown view: same columns, same rows, less the archetype."""
    from store import queries

    con = duckdb.connect(str(store_root / "turnscope.duckdb"), read_only=True)
    try:
        con.execute(queries.TURN_ROWS_SQL)
        lean = [r[0] for r in con.execute("DESCRIBE turn_rows").fetchall()]
        full = [r[0] for r in con.execute("DESCRIBE turn_breakdown").fetchall()]
        assert lean == [c for c in full if c != "archetype"]
        cols = ", ".join(f'"{c}"' for c in lean)
        for a, b in (("turn_breakdown", "turn_rows"), ("turn_rows", "turn_breakdown")):
            (n,) = con.execute(f"SELECT count(*) FROM (SELECT {cols} FROM {a} EXCEPT ALL SELECT {cols} FROM {b})").fetchone()
            assert n == 0
        assert con.execute("SELECT count(*) FROM turn_rows").fetchone()[0] == len(fx.RUNS) * fx.SESSIONS * fx.TURNS
    finally:
        con.close()


def test_overview_and_memory_show_p_own_prefix_cache_beside_the_hit_rate(monkeypatch, store_root):
    """P's own prefix-cache hit rate (vLLM's counters, view run_prefix_cache) in the Overview's Runs
    table and the Memory page's cost table, from the counters the known store was given by hand
    (a restart included); blank where no worker exposed them."""
    label = hit_rate.PREFIX_CACHE_LABEL
    runs = frame(open_page(monkeypatch, store_root, "overview"), label).set_index("run_id")
    assert {r: runs.loc[r, label] for r in fx.RUNS} == {
        r: (f"{fx.PREFIX_CACHE_RATE[r]:.1%}" if r in fx.PREFIX_CACHE_RATE else "") for r in fx.RUNS}
    assert runs.loc["bidir-1", label] == "46.7%" and runs.loc["agg-1", label] == "75.0%"
    cost = frame(open_page(monkeypatch, store_root, "memory"), label).set_index("run")
    assert cost.loc["bidir a", label] == "46.7%" and cost.loc["bidir b", label] == ""


def test_overview_run_table_hit_rate_blank_without_proxy(monkeypatch, store_root):
    """The Runs table's hit rate: hits / later turns as a percentage; blank (not Streamlit's "None")
    for the aggregated run, which has no proxy outcome."""
    at = open_page(monkeypatch, store_root, "overview")
    runs = frame(at, "hit rate (later turns)").set_index("run_id")
    assert runs.loc["agg-1", "hit rate (later turns)"] == ""
    for run_id, (mode, _, _) in fx.RUNS.items():
        if mode == "aggregated":
            continue
        later = [(s, t) for r, s, t in later_turns([run_id])]
        hits = sum(fx.reuse(run_id, s, t) == "hit" for s, t in later)
        assert runs.loc[run_id, "hit rate (later turns)"] == f"{hits / len(later):.1%}"
