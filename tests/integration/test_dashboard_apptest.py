"""The dashboard, run headless by Streamlit's AppTest over a real store (store.writer's writer).

Expected numbers come from hand-written SQL over the raw Parquet shards (not the store's views,
not the dashboard's queries) or from values written out by hand in tests/dashboard_store.py.
"""

from __future__ import annotations

import base64
import statistics
from pathlib import Path

import duckdb
import numpy as np
import plotly.io as pio
import pytest
import streamlit as st
from streamlit.proto.Metric_pb2 import Metric
from streamlit.testing.v1 import AppTest

from dashboard import charts
from store.writer import Store
from tests import dashboard_store

APP = Path(__file__).resolve().parents[2] / "dashboard" / "app.py"
TIMEOUT_S = 60


@pytest.fixture(scope="module")
def store_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return dashboard_store.build(tmp_path_factory.mktemp("store"))


def run_app(monkeypatch: pytest.MonkeyPatch, root: Path) -> AppTest:
    monkeypatch.setenv("TURNSCOPE_STORE", str(root))
    monkeypatch.setenv(charts.ENV_VAR, "1")  # charts drawn (the default), whatever the environment says
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT_S).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_charts_are_drawn_by_default_and_can_be_hidden(monkeypatch, store_root):
    """By default the Overview draws its three charts (TTFT by turn, reuse outcomes, P's external KV
    tokens: the test store has prefill samples); "Hide charts" leaves them out and says how to draw
    them; "Draw charts" brings them back. TURNSCOPE_DASHBOARD_CHARTS=0 starts hidden."""
    monkeypatch.delenv(charts.ENV_VAR, raising=False)
    monkeypatch.setenv("TURNSCOPE_STORE", str(store_root))
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT_S).run()
    assert not at.exception and len(at.get("plotly_chart")) == 3
    assert not any(charts.LABEL in c.value for c in at.caption)
    at.sidebar.button(key=charts.BUTTON_KEY).click().run()
    assert not at.exception and len(at.get("plotly_chart")) == 0
    assert any(charts.LABEL in c.value for c in at.caption)
    at.sidebar.button(key=charts.BUTTON_KEY).click().run()
    assert not at.exception and len(at.get("plotly_chart")) == 3
    monkeypatch.setenv(charts.ENV_VAR, "0")
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT_S).run()
    assert not at.exception and len(at.get("plotly_chart")) == 0


def raw_sql(root: Path, sql: str) -> list[tuple]:
    """Hand-written SQL straight over the Parquet shards: {turns} and {runs_log} are read_parquet."""
    glob = {
        t: f"read_parquet('{root}/runs/*/{t}/*.parquet', union_by_name=true)" for t in ("turns", "runs_log")
    }
    con = duckdb.connect()
    try:
        return con.execute(sql.format(**glob)).fetchall()
    finally:
        con.close()


def values(v) -> list:
    """A Plotly trace array as a list; plotly >= 6 serialises numeric arrays as base64 ``bdata``."""
    if isinstance(v, dict) and "bdata" in v:
        return np.frombuffer(base64.b64decode(v["bdata"]), dtype=np.dtype(v["dtype"])).tolist()
    return list(v)


def median_later_ttft(root: Path, mode: str) -> float:
    return raw_sql(
        root,
        f"""
        SELECT median(t.ttft_s)
        FROM {{turns}} t JOIN (SELECT DISTINCT run_id, mode FROM {{runs_log}}) r USING (run_id)
        WHERE r.mode = '{mode}' AND t.status = 'ok' AND t.turn_index >= 1
        """,
    )[0][0]


def later_turn_medians_by_hand() -> tuple[float, float]:
    """Median TTFT (s) of pd-bidir's and aggregated's later turns, from the fixture's formulas."""
    bidir = statistics.median(
        dashboard_store.ttft_s(r, s, t)
        for r in ("bidir-1", "bidir-2")
        for s in range(dashboard_store.SESSIONS)
        for t in range(1, dashboard_store.TURNS)
        if dashboard_store.ttft_s(r, s, t) is not None
    )
    agg = statistics.median(
        dashboard_store.ttft_s("agg-1", s, t) for s in range(dashboard_store.SESSIONS) for t in range(1, 4)
    )
    return bidir, agg


def test_overview_renders_with_headline_equal_to_sql(monkeypatch, store_root):
    at = run_app(monkeypatch, store_root)

    # Exactly one headline: there is no pd or pd-nocache run, so only pd-bidir vs aggregated.
    assert [m.label for m in at.metric] == ["pd-bidir vs aggregated"]
    bidir = median_later_ttft(store_root, "pd-bidir")
    agg = median_later_ttft(store_root, "aggregated")
    # The same medians, computed by hand from the fixture's formulas.
    by_hand_bidir, by_hand_agg = later_turn_medians_by_hand()
    assert bidir == pytest.approx(by_hand_bidir) and agg == pytest.approx(by_hand_agg)
    # The speed-up (baseline / bidirectional), as the CLI prints it; the chip is the verdict.
    assert at.metric[0].value == f"{agg / bidir:.2f}x"
    assert at.metric[0].proto.delta == "faster" and at.metric[0].proto.color == Metric.GREEN  # by verdict

    captions = [c.value for c in at.caption]
    assert any(f"median TTFT {bidir * 1e3:.1f} ms vs {agg * 1e3:.1f} ms" in c for c in captions), captions
    # 17 = 2 runs x 3 sessions x 3 later turns, less the timed-out one; 9 = 3 x 3.
    assert any("n = 17 vs 9 turns (6 vs 3 sessions)" in c for c in captions), captions
    assert any("pd-bidir-nocache vs pd-nocache" in c and "`pd-nocache`" in c for c in captions), captions
    # the fixture's runs recorded no schedule (as runs before schedules were recorded): read as sequential
    assert "How the runs were played: One mode after another (sequential schedule)." in captions, captions
    verdicts = [m.value for m in at.markdown if m.value.startswith("pd-bidir is faster than aggregated")]
    assert len(verdicts) == 1 and "it pays off against this baseline" in verdicts[0]

    # pd-bidir-nocache never hit: said plainly.
    warnings = [w.value for w in at.warning]
    assert any("`pd-bidir-nocache` was a miss" in w and "miss_no_handle_returned (9)" in w for w in warnings)


def test_overview_charts_and_run_table(monkeypatch, store_root):
    at = run_app(monkeypatch, store_root)
    charts = {c.proto.id: pio.from_json(c.proto.spec) for c in at.get("plotly_chart")}
    assert len(charts) == 3
    by_title = {fig.layout.title.text: fig for fig in charts.values()}

    ext = next(f for t, f in by_title.items() if "external_kv_transfer" in t)
    finals = {tr.name.split(" · ")[0]: values(tr.y)[-1] for tr in ext.data}
    labels = {run_id: dashboard_store.RUNS[run_id][1] for run_id in dashboard_store.RUNS}
    assert finals == {labels[r]: v for r, v in dashboard_store.EXPECTED_EXTERNAL_TOKENS.items()}
    assert ext.layout.xaxis.title.text == "time since run start (s)"

    ttft = next(f for t, f in by_title.items() if t.startswith("TTFT by turn index"))
    assert ttft.layout.yaxis.title.text == "TTFT (ms)"
    # aggregated p50 at turn_index 2, drawn in ms.
    agg_p50 = next(tr for tr in ttft.data if tr.name == "aggregated, p50")
    (expected_s,) = raw_sql(
        store_root,
        "SELECT quantile_cont(ttft_s, 0.5) FROM {turns} WHERE run_id = 'agg-1' AND turn_index = 2",
    )[0]
    assert values(agg_p50.y)[values(agg_p50.x).index(2)] == pytest.approx(expected_s * 1e3)

    reuse = next(f for t, f in by_title.items() if t.startswith("Reuse outcome"))
    hits = next(tr for tr in reuse.data if tr.name == "hit")
    (n_hits,) = raw_sql(
        store_root,
        "SELECT count(*) FROM {turns} t JOIN (SELECT DISTINCT run_id, mode FROM {runs_log}) r USING (run_id) "
        "WHERE r.mode = 'pd-bidir' AND t.reuse = 'hit'",
    )[0]
    assert dict(zip(values(hits.x), values(hits.y), strict=True)) == {"pd-bidir": n_hits}

    table = at.dataframe[0].value
    assert sorted(table["run_id"]) == sorted(dashboard_store.RUNS)
    assert set(table["status"]) == {"complete"}  # the latest runs_log row wins
    row = table.set_index("run_id").loc["bidir-1"]
    (p50_s, failed) = raw_sql(
        store_root,
        "SELECT quantile_cont(ttft_s, 0.5), count(*) FILTER (WHERE status <> 'ok') FROM {turns} "
        "WHERE run_id = 'bidir-1'",
    )[0]
    assert row["TTFT p50 (ms)"] == pytest.approx(p50_s * 1e3)
    assert row["failed"] == failed == 1


def test_mode_filter_without_a_pair_shows_no_headline(monkeypatch, store_root):
    at = run_app(monkeypatch, store_root)
    at.sidebar.multiselect(key="ts_modes").set_value(["aggregated"]).run()
    assert not at.exception
    assert len(at.metric) == 0
    assert any(i.value.startswith("No headline yet") for i in at.info)
    assert sorted(at.dataframe[0].value["run_id"]) == ["agg-1"]


def test_app_holds_no_lock_on_the_store(monkeypatch, store_root):
    run_app(monkeypatch, store_root)
    # A writer re-creating the views needs the file read-write; an open dashboard must not block it.
    con = duckdb.connect(str(store_root / "turnscope.duckdb"))
    con.close()


def test_missing_store(monkeypatch, tmp_path):
    at = run_app(monkeypatch, tmp_path / "nowhere")
    assert len(at.info) == 1 and at.info[0].value.startswith("No store yet")
    assert "turnscope demo" in at.info[0].value
    assert len(at.get("plotly_chart")) == 0


def test_store_without_runs(monkeypatch, tmp_path):
    Store(tmp_path).init()
    at = run_app(monkeypatch, tmp_path)
    assert len(at.info) == 1 and at.info[0].value.startswith("No runs yet")
    assert len(at.get("plotly_chart")) == 0


def test_run_that_just_started(monkeypatch, tmp_path):
    """A run with its status row but no turns or scrapes yet renders, with the empty charts saying so,
    and the page says it follows the run (dashboard/live.py: a fragment re-reading the store)."""
    store = Store(tmp_path)
    store.init()
    with store.writer("live-1", "test") as w:
        now = dashboard_store.T0
        w.append("runs_log", {"mode": "pd-bidir", "status": "running", "started_at": now, "updated_at": now})
    at = run_app(monkeypatch, tmp_path)
    assert len(at.metric) == 0
    assert any(i.value.startswith("No headline yet") for i in at.info)
    assert any("1 still recording" in c.value for c in at.sidebar.caption)
    assert any("`live-1` is recording: this page re-reads the store every" in c.value for c in at.main.caption)
    table = at.dataframe[0].value
    assert list(table["run_id"]) == ["live-1"] and table.loc[0, "turns"] == 0
    assert len(at.get("plotly_chart")) == 2  # by turn and outcomes; no external-KV chart without samples


def test_run_filter(monkeypatch, store_root):
    at = run_app(monkeypatch, store_root)
    at.sidebar.multiselect(key="ts_runs").set_value(["bidir-2", "agg-1"]).run()
    assert not at.exception
    (expected,) = raw_sql(
        store_root,
        """
        SELECT (SELECT median(ttft_s) FROM {turns} WHERE run_id = 'agg-1' AND status = 'ok' AND turn_index >= 1)
             / (SELECT median(ttft_s) FROM {turns} WHERE run_id = 'bidir-2' AND status = 'ok' AND turn_index >= 1)
        """,
    )[0]
    assert [m.value for m in at.metric] == [f"{expected:.2f}x"]
    assert not at.warning  # pd-bidir-nocache is filtered out


def test_store_locked_by_a_writer(monkeypatch, store_root):
    """Another process holding turnscope.duckdb read-write (creating views): a warning, no traceback,
    where the server has no copy of the views yet (store.db.views_db); where it has, the page reads
    the shards through it meanwhile."""
    import subprocess
    import sys

    from store import db

    run_app(monkeypatch, store_root)  # the server's copy of the views is made
    held_copy = db._views_dbs[store_root.resolve()]
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import duckdb, sys; c = duckdb.connect(sys.argv[1]); print('held', flush=True); sys.stdin.read()",
         str(store_root / "turnscope.duckdb")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setenv("TURNSCOPE_STORE", str(store_root))
        st.cache_data.clear()  # earlier tests' cached results would hide the lock for 5 s
        at = AppTest.from_file(str(APP), default_timeout=TIMEOUT_S)
        at.run()
        assert not at.exception and len(at.metric) == 1  # through the copy
        assert not any("being set up by a writer" in w.value for w in at.warning)
        db._views_dbs.clear()  # a server that has no copy yet: it must open the file
        st.cache_data.clear()
        at = AppTest.from_file(str(APP), default_timeout=TIMEOUT_S)
        at.run()
        assert not at.exception
        assert any("being set up by a writer" in w.value for w in at.warning)
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    # Once the writer is gone the page renders again (errors are never cached).
    at.run()
    assert not at.exception and len(at.metric) == 1
    assert db._views_dbs[store_root.resolve()].key == held_copy.key  # the file is unchanged: the same views


def test_cli_bottom_line_is_the_overview_headline_as_a_speed_up(store_root, capsys, monkeypatch):
    """`turnscope eval`/`demo` end with the headline: pd-bidir vs aggregated as a speed-up
    (aggregated's median / pd-bidir's, hand-computed from the fixture's formulas)."""
    from turnscope.commands.summaries import print_bottom_line

    monkeypatch.setenv("COLUMNS", "80")
    print_bottom_line(store_root, list(dashboard_store.RUNS))
    out = capsys.readouterr().out
    by_hand_bidir, by_hand_agg = later_turn_medians_by_hand()
    lines = out.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("pd-bidir vs aggregated"))
    assert lines[i + 1].startswith(f"  speed-up {by_hand_agg / by_hand_bidir:.2f}x, 95% CI "), out
    assert lines[i + 1].endswith(": faster")  # as the Overview's verdict on the same store says
    assert f"median TTFT {by_hand_bidir * 1e3:.0f} vs {by_hand_agg * 1e3:.0f} ms" in lines[i + 2]
    assert "pd-bidir vs pd " not in out  # no pd run: no row
    assert "One mode after another (sequential schedule)." in out  # no schedule recorded by the fixture
    assert max(len(line) for line in lines) <= 80


def test_cli_and_overview_show_the_same_comparison_the_same_way(store_root, capsys, monkeypatch):
    """One convention: the CLI's bottom line and the Overview card give the same label, the same
    speed-up, the same interval and the same verdict for the same comparison; the number is the
    hand-computed speed-up (baseline median / bidirectional median, > 1 = bidirectional faster)."""
    from turnscope.commands.summaries import print_bottom_line

    monkeypatch.setenv("COLUMNS", "120")
    print_bottom_line(store_root, list(dashboard_store.RUNS))
    lines = capsys.readouterr().out.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("pd-bidir vs aggregated"))
    label, rest = lines[i + 1].strip().split(" ", 1)
    cli_value, rest = rest.split(", 95% CI ")
    cli_ci, cli_verdict = rest.split(": ")

    at = run_app(monkeypatch, store_root)
    (card,) = at.metric
    assert card.label == "pd-bidir vs aggregated"
    bidir, agg = later_turn_medians_by_hand()
    assert card.value == cli_value == f"{agg / bidir:.2f}x"
    assert card.proto.delta == cli_verdict == "faster"
    caption = next(c.value for c in at.caption if c.value.startswith("speed-up 95% CI "))
    assert label == "speed-up" and caption.startswith(f"{label} 95% CI {cli_ci} ·"), (caption, cli_ci)
