"""The Sweep page, run headless by Streamlit's AppTest over a sweep written by the real recorder
(tests/sweep_store.py, store.writer's writer). Expected numbers are worked out here from the
fixture's formulas (plain arithmetic, not the dashboard's code)."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import plotly.io as pio
import pytest
from streamlit.testing.v1 import AppTest

from dashboard import pages
from dashboard.charts import ENV_VAR as CHARTS_ENV
from dashboard.sweep_figures import IDEAL_NAME, LIMIT_NAME
from store import db
from store.queries import run_report
from tests import sweep_store as sx

APP = Path(__file__).resolve().parents[2] / "dashboard" / "app.py"


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sx.build(tmp_path_factory.mktemp("sweep-store"))


def open_sweep(monkeypatch: pytest.MonkeyPatch, root: Path, vendor: bool = True) -> AppTest:
    """The Sweep page; with `vendor`, switched to the vendor's view (mean TTFT over every request)
    from the page's default (the dashboard's convention: the median from the second turn)."""
    monkeypatch.setenv("TURNSCOPE_STORE", str(root))
    monkeypatch.setenv(CHARTS_ENV, "1")  # charts drawn (the default), whatever the environment says
    at = AppTest.from_file(str(APP), default_timeout=60).run()
    at.switch_page(pages.page("sweep").script).run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.title[0].value == "Sweep"
    if vendor and any(r.key == "sweep_turns" for r in at.radio):  # a store without sweeps has no radios
        at.radio(key="sweep_turns").set_value("every request (the vendor's count)").run()
        at.radio(key="sweep_stat").set_value("mean").run()
    return at


def median(xs: list[float]) -> float:
    v = sorted(xs)
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2


def test_default_is_the_median_from_the_second_turn(monkeypatch, root):
    """The page opens on the dashboard's convention: baseline / bidirectional median TTFT of turns >= 1."""
    at = open_sweep(monkeypatch, root, vendor=False)
    fig = next(f for t, f in charts(at).items() if t.startswith("Speed-up of median TTFT: baseline / bidirectional"))
    vendor = next(tr for tr in fig.data if tr.name == "pd-bidir-nocache vs pd-nocache")
    want = [median(ttfts("pd-nocache", p, 1)) / median(ttfts("pd-bidir-nocache", p, 1)) for p in sx.PREFIXES]
    assert values(vendor.y) == pytest.approx(want, rel=1e-9)


def values(v) -> list:
    if isinstance(v, dict) and "bdata" in v:
        return np.frombuffer(base64.b64decode(v["bdata"]), dtype=np.dtype(v["dtype"])).tolist()
    return list(v)


def charts(at: AppTest) -> dict:
    return {(f := pio.from_json(c.proto.spec)).layout.title.text: f for c in at.get("plotly_chart")}


def ttfts(mode: str, prefix: int, min_turn: int = 0) -> list[float]:
    return [sx.ttft_s(mode, prefix, s, t) for s in range(sx.SESSIONS) for t in range(min_turn, sx.TURNS)]


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def p90(xs: list[float]) -> float:
    """quantile_cont / linear interpolation at 0.9, by hand."""
    v = sorted(xs)
    pos = 0.9 * (len(v) - 1)
    lo = int(pos)
    return v[lo] + (pos - lo) * (v[min(lo + 1, len(v) - 1)] - v[lo])


def ideal(prefix: int, turn: int) -> float:
    """The ideal TTFT of a turn: the fit recovers B0, A1, A2 exactly (pd-nocache is that quadratic)."""
    n, r = sx.prompt(prefix, turn), sx.reusable(prefix, turn) or 0
    return sx.B0 + sx.c(n) - sx.c(r) + r * sx.T_X[prefix]


def test_ttft_against_prefix_per_mode_and_the_ideal(monkeypatch, root):
    at = open_sweep(monkeypatch, root)
    # The newest sweep is shown, and only its runs (the old one has a point at 500 tokens).
    assert at.selectbox(key="sweep_id").value == sx.SWEEP_ID
    assert at.selectbox(key="sweep_id").options == [
        f"{sx.SWEEP_ID} · vendor-sweep · default scale · 2 points · 5 modes",
        f"{sx.OLD_SWEEP} · vendor-sweep · default scale · 1 points · 1 modes"]
    fig = charts(at)["TTFT against prefix length, per mode (ideal dashed)"]
    by = {(tr.name, tr.xaxis): tr for tr in fig.data}
    for mode in sx.MODES:
        mean_tr, p90_tr = by[(mode, "x")], by[(mode, "x2")]
        assert values(mean_tr.x) == [1000, 2000]
        assert values(mean_tr.y) == pytest.approx([mean(ttfts(mode, p)) * 1e3 for p in sx.PREFIXES], rel=1e-9)
        assert values(p90_tr.y) == pytest.approx([p90(ttfts(mode, p)) * 1e3 for p in sx.PREFIXES], rel=1e-9)
    ideal_mean = [mean([ideal(p, t) for _ in range(sx.SESSIONS) for t in range(sx.TURNS)]) for p in sx.PREFIXES]
    assert values(by[(IDEAL_NAME, "x")].y) == pytest.approx([v * 1e3 for v in ideal_mean], rel=1e-6)
    # Turn 0 of pd-bidir-nocache's session 0 is a full prefill and its later turns are ideal: the
    # mean of that session is the ideal mean.
    assert mean([sx.ttft_s("pd-bidir-nocache", 1000, 0, t) for t in range(sx.TURNS)]) == pytest.approx(ideal_mean[0])
    assert fig.layout.yaxis.title.text == "TTFT (ms)"
    assert fig.layout.xaxis.title.text == "prefix tokens per conversation (its own context)"

    table = next(d.value for d in at.dataframe if "P external_kv_transfer tokens" in d.value.columns)
    row = table.set_index(["prefix tokens", "mode"]).loc[(2000, "pd-bidir-nocache")]
    # 3 sessions x (r(1) + r(2)) = 3 x ((2000 + 112) + (2000 + 312)) pulled; the counter says the same.
    assert row["P external_kv_transfer tokens"] == row["proxy reused tokens"] == 3 * (2112 + 2312)
    assert row["hits"] == 6 and row["turns"] == 9 and row["sessions"] == 3
    failed = table.set_index(["prefix tokens", "mode"]).loc[(1000, "pd-nocache")]
    assert failed["failed"] == 1 and failed["turns"] == 9  # the timed-out turn is not in the statistics
    assert not at.warning  # both bidirectional modes reused KV


def test_speedups_with_confidence_intervals_and_the_limit(monkeypatch, root):
    at = open_sweep(monkeypatch, root)
    fig = next(f for t, f in charts(at).items() if t.startswith("Speed-up of mean TTFT: baseline / bidirectional"))
    by = {tr.name: tr for tr in fig.data}
    assert list(by) == ["pd-bidir-nocache vs pd-nocache", "pd-bidir vs pd", "pd-bidir vs aggregated", LIMIT_NAME]
    vendor = by["pd-bidir-nocache vs pd-nocache"]
    want, lows, highs = [], [], []
    for p in sx.PREFIXES:
        b = mean(ttfts("pd-nocache", p))
        # pd-nocache's sessions are identical; pd-bidir-nocache's session s is 0.01 s x s slower on
        # every turn. Resampling 3 sessions, "all three the slowest" (or fastest) has probability
        # 1/27 > 2.5%, so the percentile interval's ends are exactly those extremes.
        t = [mean([sx.ttft_s("pd-bidir-nocache", p, s, k) for k in range(sx.TURNS)]) for s in range(sx.SESSIONS)]
        want.append(b / mean(t))
        lows.append(b / max(t))
        highs.append(b / min(t))
    assert values(vendor.y) == pytest.approx(want, rel=1e-9)
    assert values(vendor.error_y.array) == pytest.approx([h - w for h, w in zip(highs, want)], rel=1e-6)
    assert values(vendor.error_y.arrayminus) == pytest.approx([w - lo for w, lo in zip(want, lows)], rel=1e-6)
    assert want[1] > want[0] and lows[1] > highs[0]  # the gain grows with prefix length
    agg = by["pd-bidir vs aggregated"]
    assert values(agg.y) == pytest.approx([mean(ttfts("aggregated", p)) / mean(ttfts("pd-bidir", p))
                                           for p in sx.PREFIXES], rel=1e-9)
    limit = [mean(ttfts("pd-nocache", p)) / mean([ideal(p, t) for t in range(sx.TURNS)]) for p in sx.PREFIXES]
    assert values(by[LIMIT_NAME].y) == pytest.approx(limit, rel=1e-6)

    lines = [m.value for m in at.markdown if " vs " in m.value and "speed-up at" in m.value]
    assert lines[0] == (f"pd-bidir-nocache vs pd-nocache: {want[1]:.2f}x (95% CI {lows[1]:.2f}-{highs[1]:.2f}x) mean "
                        f"TTFT speed-up at 2,000 prefix tokens, faster with bidirectional transfer; {want[0]:.2f}x "
                        f"(95% CI {lows[0]:.2f}-{highs[0]:.2f}x) at 1,000; the speed-up grows with prefix length.")
    # pd-bidir is 0.005 s faster than pd on later turns but 0.01 x s slower at turn 0 and 0.004 x s
    # on later turns: no clear difference; against aggregated it is slower at both points.
    assert "pd-bidir vs pd" in lines[1] and "no clear difference (the interval includes 1)" in lines[1]
    assert "pd-bidir vs aggregated" in lines[2] and "slower with bidirectional transfer" in lines[2]

    sp = next(d.value for d in at.dataframe if "speed-up" in d.value.columns and "pair" in d.value.columns)
    r = sp.set_index(["pair", "prefix tokens"]).loc[("pd-bidir-nocache vs pd-nocache", 2000)]
    assert (r["speed-up"], r["95% CI low"], r["95% CI high"]) == pytest.approx((want[1], lows[1], highs[1]), rel=1e-6)


def test_the_ideal_table_and_the_fit(monkeypatch, root):
    at = open_sweep(monkeypatch, root)
    table = next(d.value for d in at.dataframe if "bandwidth (GB/s)" in d.value.columns).set_index("prefix tokens")
    # 0.1 s x BANDWIDTH bytes in each of the two pd-bidir* runs of a point: 40.96 and 81.92 MB/s.
    assert table["bandwidth (GB/s)"].tolist() == pytest.approx([0.04096, 0.08192])
    assert table["pull (ms/1k tokens)"].tolist() == pytest.approx([100.0, 50.0])  # 4096 B / bandwidth
    pull = [mean([(sx.reusable(p, t) or 0) * sx.T_X[p] for t in range(sx.TURNS)]) for p in sx.PREFIXES]
    assert table["of which KV pull (ms)"].tolist() == pytest.approx([v * 1e3 for v in pull], rel=1e-9)
    cap = next(c.value for c in at.caption if "Prefill fit over" in c.value)
    # 18 pd-nocache turns (1064..2464 prompt tokens), B0 = 50 ms, c'(0) = A1 = 0.300 ms/token,
    # c'(2000) = A1 + 2 A2 x 2000 = 0.380 ms/token.
    assert ("Prefill fit over 18 `pd-nocache` turns (1,064-2,464 prompt tokens, quadratic): b0 = 50.0 ms, "
            "0.300 ms/token at the start, 0.380 ms/token after 2,000 tokens.") in cap


def test_from_the_second_turn_and_p90(monkeypatch, root):
    at = open_sweep(monkeypatch, root)
    at.radio(key="sweep_turns").set_value("from the second turn").run()
    at.radio(key="sweep_stat").set_value("p90").run()
    assert not at.exception
    fig = next(f for t, f in charts(at).items() if t.startswith("Speed-up of p90 TTFT: baseline / bidirectional"))
    vendor = next(tr for tr in fig.data if tr.name == "pd-bidir-nocache vs pd-nocache")
    assert values(vendor.y) == pytest.approx([p90(ttfts("pd-nocache", p, 1)) / p90(ttfts("pd-bidir-nocache", p, 1))
                                              for p in sx.PREFIXES], rel=1e-9)
    table = next(d.value for d in at.dataframe if "P external_kv_transfer tokens" in d.value.columns)
    assert set(table["turns"]) == {6}  # turn_index >= 1 only


def test_old_sweep_and_no_sweep(monkeypatch, root, tmp_path):
    at = open_sweep(monkeypatch, root)
    at.selectbox(key="sweep_id").set_value(sx.OLD_SWEEP).run()
    assert not at.exception
    figs = charts(at)
    assert any(t.startswith("TTFT against prefix length") for t in figs)
    assert any("no point has both modes of a pair" in a.text for f in figs.values() for a in f.layout.annotations)
    assert any("No ideal" in i.value for i in at.info)
    # A store without sweeps says how to make one.
    from tests import dashboard_store

    at = open_sweep(monkeypatch, dashboard_store.build(tmp_path / "plain"))
    assert any("No sweep among the selected runs: run `turnscope sweep`" in i.value for i in at.info)


def test_report_sweep_summary_reads_the_same_numbers(root):
    ids = [sx.run_id(sx.SWEEP_ID, m, p) for m in sx.MODES for p in sx.PREFIXES] + ["plain-1"]
    df = db.read(db.StoreLocation(root), run_report.sweep_summary, ids)
    assert len(df) == 10  # the plain run is not a sweep point
    r = df.set_index(["prefix_tokens", "mode"]).loc[(1000, "pd-nocache")]
    assert r["turns"] == 9 and r["ttft_mean_s"] == pytest.approx(mean(ttfts("pd-nocache", 1000)))
    assert r["ttft_p90_s"] == pytest.approx(p90(ttfts("pd-nocache", 1000)))
    b = df.set_index(["prefix_tokens", "mode"]).loc[(1000, "pd-bidir")]
    assert (b["hits"], b["later_turns"], b["external_kv_tokens"]) == (6, 6, 3 * (1112 + 1312))


def test_page_holds_no_lock(monkeypatch, root):
    import duckdb

    open_sweep(monkeypatch, root)
    duckdb.connect(str(root / "turnscope.duckdb")).close()  # what a writer creating views needs


def test_hits_without_the_prefill_counter_are_flagged(monkeypatch, tmp_path):
    at = open_sweep(monkeypatch, sx.build(tmp_path / "store", no_counter=("pd-bidir",)))
    # pd-bidir: 2 points x 3 sessions x 2 later turns = 12 hits by the proxy, no P counter.
    assert [w.value for w in at.warning] == [
        ("`pd-bidir` has 12 hits by the proxy's account, but the prefill worker's external_kv_transfer counter "
         "did not rise (was P scraped?): check before trusting its numbers.")]
