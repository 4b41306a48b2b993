"""The Plan page, run headless by Streamlit's AppTest over stores written by the real ``turnscope plan``.

Truths: the recorded-run fixture's hand computations (tests/planner_store.py) for the check, and
hand-written SQL over the raw Parquet shards for what the page shows of a plan.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import duckdb
import pytest
from streamlit.testing.v1 import AppTest
from typer.testing import CliRunner

from dashboard import charts, pages
from tests import planner_store as fx
from turnscope.commands import app

REPO = Path(__file__).resolve().parents[2]
APP = REPO / "dashboard" / "app.py"
TRACE = REPO / "data" / "traces" / "kv-cache-tester" / "trace_0036.json"
VENDOR = REPO / "data" / "profiles" / "vendor-h200.yaml"


def plan(*args: str) -> None:
    r = CliRunner().invoke(app, ["plan", *args], env={"COLUMNS": "4000"})
    assert r.exit_code == 0, r.output


@pytest.fixture(scope="module")
def checked_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = fx.build(tmp_path_factory.mktemp("checked"))
    plan(str(root), "--store", str(root), "--fit-runs", ",".join(fx.RUNS.values()), "--label", "check")
    return root


@pytest.fixture(scope="module")
def plans_only(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("plans-only")
    plan(str(TRACE), "--profile", str(VENDOR), "--store", str(root), "--label", "one trace")
    return root


def open_plan(monkeypatch: pytest.MonkeyPatch, root: Path) -> AppTest:
    monkeypatch.setenv("TURNSCOPE_STORE", str(root))
    monkeypatch.setenv(charts.ENV_VAR, "1")  # charts drawn (the default), whatever the environment says
    at = AppTest.from_file(str(APP), default_timeout=60).run()
    at.switch_page(pages.page("plan").script).run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.title[0].value == "Plan"
    return at


def shards(root: Path, table: str, sql: str) -> list[tuple]:
    con = duckdb.connect()
    try:
        return con.execute(sql.format(t=f"read_parquet('{root}/runs/plan-*/{table}/*.parquet')")).fetchall()
    finally:
        con.close()


def test_check_against_recorded_runs_is_shown(monkeypatch, checked_store):
    at = open_plan(monkeypatch, checked_store)
    assert any("FORECAST (profile fitted)" in h.value for h in at.subheader)
    summ = next(d.value for d in at.dataframe if "TTFT MARE" in d.value.columns).set_index("mode")
    assert summ.loc["pd", "TTFT MARE"] == pytest.approx(statistics.median(fx.pd_relative_errors()))
    assert not summ.loc["pd", "TTFT check (<= 25%)"] and summ.loc["pd-nocache", "TTFT check (<= 25%)"]
    assert summ.loc["pd-bidir-nocache", "outcome matches"] == 7 and summ.loc["pd-bidir-nocache", "ok turns"] == 8
    diff = next(d.value for d in at.dataframe if "why" in d.value.columns)
    assert list(zip(diff["session_id"], diff["turn_index"], diff["predicted_outcome"], strict=True)) == [("s0", 2, "hit")]
    assert len(at.get("plotly_chart")) == 2  # the frontier and forecast-against-measured TTFT
    # the check says what it calculates: each run alone, in its own mode, against its own measurement
    assert any("What this table calculates: each recorded run planned alone" in c.value for c in at.caption)
    # the Overview's speed-up of the runs, measured and forecast, by hand: median TTFT of later ok turns
    hc = next(d.value for d in at.dataframe if "measured speed-up" in d.value.columns)
    row = hc[(hc["treatment"] == "pd-bidir-nocache") & (hc["baseline"] == "pd-nocache")].iloc[0]
    later = [(s, k) for s in range(fx.SESSIONS) for k in range(1, fx.TURNS)]
    base = statistics.median(fx.ttft_s("pd-nocache", s, k) for s, k in later if not fx.failed("pd-nocache", s, k))
    measured = statistics.median(fx.ttft_s("pd-bidir-nocache", s, k) for s, k in later)

    def forecast(s: int, k: int) -> float:   # the failed read forecast as the hit the rules say
        pull = fx.prompt(s, k - 1) + fx.OUT - 1 if (s, k) != fx.EXPIRED else 0
        return fx.B0["pd-bidir-nocache"] + fx.c(fx.prompt(s, k)) - fx.c(pull) + pull * fx.PULL_S_PER_TOKEN

    assert row["measured speed-up"] == pytest.approx(round(base / measured, 2))
    assert row["forecast speed-up"] == pytest.approx(round(base / statistics.median(forecast(s, k) for s, k in later), 2))
    # the frontier's rows that matter, and the secondary figures, each in its own table
    rows = next(d.value for d in at.dataframe if "why shown" in d.value.columns)
    assert set(rows["mode"]) == {"pd-bidir", "pd-bidir-nocache"} and rows["why shown"].str.contains("current").sum() == 2
    assert any("mean-TTFT ratio, all requests" in d.value.columns for d in at.dataframe)


def test_a_store_with_only_plans_shows_the_plan_page(monkeypatch, plans_only):
    monkeypatch.setenv("TURNSCOPE_STORE", str(plans_only))
    monkeypatch.setenv(charts.ENV_VAR, "1")  # charts drawn (the default), whatever the environment says
    at = AppTest.from_file(str(APP), default_timeout=60).run()
    assert not at.exception, [e.value for e in at.exception]
    assert not any(i.value.startswith("No runs yet") for i in at.info)
    assert any("No recorded runs" in c.value for c in at.sidebar.caption)
    at.switch_page(pages.page("plan").script).run()
    assert not at.exception, [e.value for e in at.exception]
    assert any("FORECAST (profile vendor-h200)" in h.value for h in at.subheader)
    # the speed-up lines are the plan_speedups rows, each labelled as a forecast
    rows = shards(plans_only, "plan_speedups", "SELECT treatment, baseline, speedup FROM {t} ORDER BY treatment, baseline")
    text = " ".join(m.value for m in at.markdown)
    for treatment, baseline, speedup in rows:
        assert f"**{treatment} vs {baseline}**: speed-up {speedup:.2f}x" in text
    assert text.count("FORECAST (profile vendor-h200)") >= len(rows)
    # outcome counts: hand SQL over the shards
    wide = next(d.value for d in at.dataframe if "miss_first_turn" in d.value.index)  # outcome x mode
    assert list(wide.columns) == ["aggregated", "pd-nocache", "pd", "pd-bidir-nocache", "pd-bidir"]
    shown = {(m, o): int(n) for o, row in wide.iterrows() for m, n in row.items() if n}
    truth = {(m, o): n for m, o, n in shards(
        plans_only, "plan_requests", "SELECT mode, coalesce(outcome, 'none'), count(*) FROM {t} GROUP BY ALL")}
    assert shown == truth
    # forecast TTFT and queue wait per mode: the shards' rows summed by hand in Python
    parts = next(d.value for d in at.dataframe if "queue share of TTFT (%)" in d.value.columns).set_index("mode")
    rows = shards(plans_only, "plan_requests",
                  "SELECT mode, ttft_s, coalesce(queue_wait_s, 0), coalesce(decode_wait_s, 0) FROM {t}")
    for mode in {r[0] for r in rows}:
        ttft = [t for m, t, _, _ in rows if m == mode]
        wait = [w + d for m, _, w, d in rows if m == mode]   # the prefill worker's queue and D's
        assert parts.loc[mode, "D wait mean (ms)"] == pytest.approx(
            1000 * statistics.fmean(d for m, _, _, d in rows if m == mode), abs=0.05)
        assert parts.loc[mode, "requests"] == len(ttft)
        assert parts.loc[mode, "TTFT mean (ms)"] == pytest.approx(1000 * statistics.fmean(ttft), abs=0.05)
        assert parts.loc[mode, "TTFT p50 (ms)"] == pytest.approx(1000 * statistics.median(ttft), abs=0.05)
        assert parts.loc[mode, "queue share of TTFT (%)"] == pytest.approx(100 * sum(wait) / sum(ttft), abs=0.05)
    # the frontier's rows: the vendor profile has no held-out errors, so every interval cell is a
    # blank (Streamlit prints a missing value as "None")
    frontier = next(d.value for d in at.dataframe if "80% interval (%)" in d.value.columns)
    assert len(frontier) > 0 and (frontier["80% interval (%)"] == "").all()


def held_out_profile(root: Path) -> Path:
    """vendor-h200 with hand-made held-out errors (TTFT ratio p10-p90 per mode, D hit-rate error)."""
    import yaml

    data = yaml.safe_load(VENDOR.read_text())
    data["held_out"] = {"split": "hand-made", "runs": 4, "turns": 40,
                        "ttft_ratio": {"pd-nocache": [0.9, 1.2], "pd": [0.8, 1.25], "pd-bidir": [0.85, 1.3]},
                        "hit_rate_error": {"pd-bidir": [-0.1, 0.05]}}
    path = root / "held.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def recommended(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("recommended")
    r = CliRunner().invoke(app, ["recommend", str(TRACE), "--profile", str(held_out_profile(root)), "--store",
                                 str(root), "--label", "rec", "--max-prefill-workers", "2", "--gpu-hour-usd", "4"],
                           env={"COLUMNS": "4000"})
    assert r.exit_code == 0, r.output
    return root


def test_a_recommendation_shows_its_answer_ledger_and_diff(monkeypatch, recommended):
    at = open_plan(monkeypatch, recommended)
    ((flags, topo),) = shards(recommended, "plan_recommendations", "SELECT flags_diff, topology_diff FROM {t}")
    # the answer first: the cheapest fleet of the stored fleets (a recommendation sizes fleets at its
    # load: here the one trace file's own recorded clock), read back by hand SQL
    fleets = shards(recommended, "plan_fleets", "SELECT strategy, prefill_workers, decode_workers, ttft_p90_s, "
                                                "recommended, forecast_load FROM (SELECT *, load_kind AS "
                                                "forecast_load FROM {t})")
    chosen = [f for f in fleets if f[4]]
    metrics = {m.label: m.value for m in at.metric}
    if chosen:
        strategy, p, d, p90, _, _ = chosen[0]
        assert metrics["recommended"] == f"{strategy} {p}P {d}D" and metrics["TTFT p90 (ms)"] == f"{p90 * 1000:,.0f}"
        assert f"Recommended: {strategy} on {p}P {d}D" in at.markdown[0].value
        assert "at the recorded clock" in at.markdown[0].value
    assert {f[5] for f in fleets} == {"recorded"} and len(fleets) == 5
    # the ledger: one table (values as stored, read by hand SQL) and one chart
    table = next(d.value for d in at.dataframe if "mode costed" in d.value.columns).set_index("strategy")
    for strategy, p50, p50_lo, p50_hi, d_pin in shards(recommended, "plan_ledger",
                                                       "SELECT strategy, ttft_p50_later_s, ttft_p50_later_interval_low_s, "
                                                       "ttft_p50_later_interval_high_s, d_pinned_gib_s FROM {t}"):
        assert table.loc[strategy, "TTFT p50, turn 2 on (ms)"] == pytest.approx(round(p50 * 1000, 1))
        got = table.loc[strategy, "TTFT 80% interval (ms)"]
        if p50_lo is None:   # a host-tier strategy: no interval, a blank cell
            assert strategy.endswith("+host") and got == ""
        else:
            assert got == f"{p50_lo * 1000:,.1f}-{p50_hi * 1000:,.1f}"
        assert table.loc[strategy, "D pinned (GiB-s)"] == pytest.approx(round(d_pin, 1))
    assert list(table.index) == ["recompute", "pd", "pd+host", "pd-bidir", "pd-bidir+host"]
    assert len(at.get("plotly_chart")) == 1
    # the diffs, copyable
    codes = [c.value for c in at.code]
    assert flags in codes and (topo or "(no change)") in codes
    # captions stay short (at most two lines of the page: about 240 characters)
    assert all(len(c.value) <= 240 for c in at.caption), [c.value for c in at.caption if len(c.value) > 240]


@pytest.fixture(scope="module")
def fleet_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The hand-made fleet plan alone (tests/planner_store.py: FLEET_ROWS, CURVE)."""
    return fx.build_fleet_plan(tmp_path_factory.mktemp("fleet"))


def test_a_fleet_plan_shows_its_answer_and_fleet_table_first(monkeypatch, fleet_store):
    """The fleet plan's answer (the recommended fleet), the load in words, then the fleet table
    with the hand-made figures of tests/planner_store.py (restated here as the page should print
    them) and the load curve; every heading a FORECAST stating the load."""
    at = open_plan(monkeypatch, fleet_store)
    tag = "FORECAST (profile vendor-h200) at 100 new sessions per hour"
    assert at.subheader[0].value == tag and at.subheader[1].value == f"Fleet per retention strategy ({tag})"
    metrics = {m.label: m.value for m in at.metric}
    assert metrics == {"recommended": "pd-bidir 2P 2D", "GPUs": "32", "TTFT p90 (ms)": "740", "$ / M tokens": "2.74"}
    assert at.markdown[0].value.startswith("**Recommended: pd-bidir on 2P 2D (32 GPUs), forecast p90 TTFT 740 ms at "
                                           "100 new sessions per hour (SLO p90 TTFT ≤ 1,000 ms); 3 of 5 strategies")
    assert at.markdown[1].value == ("**Load:** 100 new sessions per hour (Poisson starts, seed 0), 800 sessions drawn "
                                    "from 24 session trees. **SLO:** p90 TTFT ≤ 1,000 ms, every request.")
    assert any("(59 fleets searched)" in c.value for c in at.caption)   # 9 + 12 + 12 + 10 + 16
    assert not any(c.value.startswith("Note: Load:") for c in at.caption)  # stated once, above the table
    assert any(c.value == "Note: Sessions drawn with replacement." for c in at.caption)
    table = at.dataframe[0].value   # the first table of the page
    assert list(table.columns) == ["", "strategy", "fleet", "GPUs", "TTFT p90 (ms)", "TTFT p50 (ms)", "meets SLO",
                                   "$ / M tokens", "p90 / SLO", "close to SLO", "lowest SLO reached (ms)", "knee",
                                   "hit rate (%)", "D KV per worker (GiB)", "P cache (GiB-s)",
                                   "D pinned (GiB-s)", "host (GiB-s)", "prefill GPU-s saved", "fleets searched"]
    shown = [tuple(r) for r in table.astype(object).itertuples(index=False)]
    # the profile's D KV space: 9.496e11 bytes / 2^30 = 884.4 GiB; p90 / SLO: each p90 over the 1 s SLO,
    # close within 0.25 of 1; the lowest SLO where no fleet meets it (pd-bidir+host's 1.12 s on its 2P 2D;
    # recompute's fleet overloaded); each fleet's knee on the curve (none for recompute: 1.2 s at 25/h)
    h = "new sessions per hour"
    assert shown == [
        ("", "recompute", "2P 2D", "32", "overloaded: P at 3.40x its capacity", "—", "no", 2.91, "—", "",
         "none within the limits (2P 2D overloaded)", "none on the curve", 0.0, "884.4 (profile's)", 0.0, 0.0, 0.0,
         0.0, 9),
        ("", "pd", "3P 3D", "48", "930", "420", "yes", 4.12, "0.93", "close", "—", f"100 {h}", 61.0,
         "884.4 (profile's)", 1250.4, 0.0, 0.0, 5400.0, 12),
        ("", "pd+host", "3P 2D", "40", "880", "380", "yes", 3.55, "0.88", "close", "—", f"100 {h}", 78.0,
         "884.4 (profile's)", 1250.4, 0.0, 86400.0, 7900.0, 12),
        ("★ recommended", "pd-bidir", "2P 2D", "32", "740", "310", "yes", 2.74, "0.74", "", "—", f"100 {h}", 86.0,
         "512.0", 1100.2, 5200.7, 0.0, 8600.0, 10),
        ("", "pd-bidir+host", "2P 2D", "32", "1,120", "450", "no", 2.80, "1.12", "close", "1,120 on 2P 2D", f"50 {h}",
         88.0, "256.0", 1100.2, 2600.3, 43000.0, 8800.0, 16)]
    assert any(c.value.startswith("p90 / SLO: the margin") for c in at.caption)
    assert len(at.get("plotly_chart")) == 1   # the load curve


def test_fleet_table_without_prices_and_a_decode_overload():
    """No price: no $ column; an overloaded D reads "D at ...", and a factor near 1 keeps its digits."""
    import pandas as pd

    from dashboard.figures import plan as plan_figures

    rows = fx.fleet_rows()[:2]
    rows[0] |= {"overload_role": "decode", "overload_factor": 1.05, "overload": None}   # stored before the words
    fl = pd.DataFrame(rows).assign(usd_per_m_tokens=None)
    table = plan_figures.fleet_table(fl, None)
    assert "$ / M tokens" not in table.columns
    assert list(table["TTFT p90 (ms)"]) == ["overloaded: D at 1.05x its capacity", "930"]
    assert list(table["D KV per worker (GiB)"]) == ["profile's", "profile's"]
    assert list(table["knee"]) == ["—", "—"]   # no load curve read
    # a plan stored before the margin, close and lowest SLO columns: dashes, not guesses
    old = plan_figures.fleet_table(fl.drop(columns=["ttft_p90_over_slo", "close_to_slo", "lowest_ttft_p90_s"]), None)
    assert [list(old[c]) for c in ("p90 / SLO", "close to SLO", "lowest SLO reached (ms)")] == [["—", "—"]] * 3
    figures, sentence = plan_figures.fleet_headline(fl.assign(recommended=False, meets_slo=False))
    assert figures[0][1] == "pd 3P 3D" and sentence.startswith(
        "No fleet searched meets the SLO p90 TTFT ≤ 1,000 ms at 100 new sessions per hour: the closest is pd")
