"""``turnscope plan-check``: a profile fitted on one store forecasts another store's runs, recorded on a
machine 1.5 times slower (tests/planner_store.py, ``slow``), each run planned alone; the errors and
the intervals they give are hand computations from the fixture's formulas."""

from __future__ import annotations

import math
import re
import statistics
from pathlib import Path

import duckdb
import numpy as np
import pytest
from streamlit.testing.v1 import AppTest
from typer.testing import CliRunner

from dashboard import pages
from planner.fit import fit_profile
from planner.held_out import check_split, held_out_check
from planner.profile import load_profile
from store.writer import Store
from tests import planner_store as fx
from turnscope.commands import app

SLOW = 1.5
RUN_IDS = list(fx.RUNS.values())


def quantile(values: list[float], q: float) -> float:
    """The linear-interpolation quantile, by hand: position q (n - 1) between the sorted values."""
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = math.floor(pos)
    return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (pos - lo)


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return fx.build(tmp_path_factory.mktemp("fit")), fx.build(tmp_path_factory.mktemp("check"), slow=SLOW)


def measured(mode: str, s: int, k: int, slow: float = SLOW) -> float:
    """The slow machine's TTFT: compute ``slow`` times the formula's, the pull as fast."""
    return slow * fx.ttft_s(mode, s, k) - (slow - 1) * fx.recorded(mode, s, k)[2] * fx.PULL_S_PER_TOKEN


def forecast(mode: str, s: int, k: int) -> float:
    """The fitted profile's forecast (the fixture's costs): the recorded tokens, except the failed read,
    which the rules forecast as the hit it should have been."""
    if (mode, s, k) != fx.TRANSFER_FAILED:
        return fx.ttft_s(mode, s, k)
    pull = fx.prompt(s, k - 1) + fx.OUT - 1
    return fx.B0[mode] + fx.c(fx.prompt(s, k)) - fx.c(pull) + pull * fx.PULL_S_PER_TOKEN


def ok_turns(mode: str) -> list[tuple[int, int]]:
    return [(s, k) for s in range(fx.SESSIONS) for k in range(fx.TURNS) if not fx.failed(mode, s, k)]


def errors(mode: str) -> list[float]:
    return [abs(forecast(mode, s, k) - measured(mode, s, k)) / measured(mode, s, k) for s, k in ok_turns(mode)]


def ratios(mode: str) -> list[float]:
    return [measured(mode, s, k) / forecast(mode, s, k) for s, k in ok_turns(mode)]


def test_held_out_errors_per_mode(stores):
    fit, check = stores
    split = check_split(str(fit), None, str(check), None)
    assert len(split.fit_runs) == len(split.check_runs) == 5
    prof, _, summ = held_out_check(split)
    summ = summ.set_index("mode")
    slow_error = (SLOW - 1) / SLOW                   # |f - 1.5 f| / (1.5 f) = 1/3 where nothing is pulled
    for mode in ("pd-nocache", "aggregated"):
        assert errors(mode) == pytest.approx([slow_error] * len(ok_turns(mode)))
    for mode in ("pd-nocache", "aggregated", "pd-bidir", "pd-bidir-nocache"):
        assert summ.loc[mode, "ttft_mare"] == pytest.approx(statistics.median(errors(mode)), rel=1e-6), mode
        assert summ.loc[mode, "ttft_error_p90"] == pytest.approx(quantile(errors(mode), 0.9), rel=1e-6), mode
        # the p90 TTFT's error: the 90th percentile of the forecasts over that of the measured TTFTs
        turns = ok_turns(mode)
        p90_f = quantile([forecast(mode, s, k) for s, k in turns], 0.9)
        p90_m = quantile([measured(mode, s, k) for s, k in turns], 0.9)
        assert summ.loc[mode, "ttft_p90_forecast_s"] == pytest.approx(p90_f, rel=1e-6), mode
        assert summ.loc[mode, "p90_ttft_error"] == pytest.approx(p90_f / p90_m - 1, rel=1e-6), mode
    # nothing pulled: every measured TTFT is 1.5 times its forecast, so is their p90 (-1/3, a miss)
    assert summ.loc["pd-nocache", "p90_ttft_error"] == pytest.approx(1 / SLOW - 1)
    assert not summ.loc["pd-nocache", "p90_ttft_pass"] and not summ.loc["pd-nocache", "error_p90_pass"]
    # hit rates over the 6 later turns: pd-bidir 4/6 both (below threshold, expired); pd-bidir-nocache
    # recorded 4/6 (failed read, expired), forecast 5/6: +16.7 pp
    assert summ.loc["pd-bidir", "hit_rate_error_pp"] == pytest.approx(0)
    assert summ.loc["pd-bidir-nocache", "hit_rate_error_pp"] == pytest.approx(100 / 6)
    assert not summ.loc["pd-bidir-nocache", "hit_rate_pass"] and summ.loc["pd-bidir", "hit_rate_pass"]
    # pulled tokens: every recorded hit pulls what the forecast pulls; the forecast adds the failed read's
    recorded = sum(fx.recorded("pd-bidir-nocache", s, k)[2] for s in range(fx.SESSIONS) for k in range(fx.TURNS))
    extra = fx.prompt(0, 1) + fx.OUT - 1
    assert summ.loc["pd-bidir-nocache", "pulled_error"] == pytest.approx(extra / recorded)
    assert summ.loc["pd-bidir", "pulled_error"] == pytest.approx(0)
    assert np.isnan(summ.loc["pd-nocache", "pulled_error"])
    # the intervals' source: measured / forecast percentiles
    assert prof.held_out.ttft_ratio["pd-nocache"] == pytest.approx((SLOW, SLOW), rel=1e-6)
    r = ratios("pd-bidir-nocache")
    assert prof.held_out.ttft_ratio["pd-bidir-nocache"] == pytest.approx((quantile(r, 0.1), quantile(r, 0.9)), rel=1e-6)
    assert prof.held_out.hit_rate_error["pd-bidir-nocache"] == pytest.approx((-1 / 6, -1 / 6))


def test_a_run_both_fitted_and_checked_is_refused(stores):
    fit, _ = stores
    with pytest.raises(ValueError, match="both fitted and checked"):
        held_out_check(check_split(str(fit), [fx.RUNS["pd"]], str(fit), [fx.RUNS["pd"]]))


def test_cli_plan_check_then_plan_with_intervals(stores, tmp_path, monkeypatch):
    fit, check = stores
    out = tmp_path / "held-out.yaml"
    r = CliRunner().invoke(app, ["plan-check", "--fit-store", str(fit), "--check-store", str(check),
                                 "--write-profile", str(out)], env={"COLUMNS": "4000"})
    assert r.exit_code == 0, r.output
    assert f"fitted on 5 runs of store {fit}" in r.output and f"checked on 5 runs of store {check}" in r.output
    assert "pd-nocache: 1 runs, 7 ok turns, outcome 7/7; TTFT MARE 33.3% (FAIL), error p90 33.3% (FAIL); p90 TTFT" in r.output
    p90_f = quantile([forecast("pd-nocache", s, k) for s, k in ok_turns("pd-nocache")], 0.9)
    assert (f"p90 TTFT {p90_f * 1e3:,.1f} ms forecast vs {SLOW * p90_f * 1e3:,.1f} ms measured (-33.3%, FAIL)"
            in r.output)
    assert "hit rate 83.3% vs 66.7% recorded (+16.7 pp, FAIL)" in r.output
    # the Overview's speed-up of the checked runs: the slow machine slows both sides alike
    later = [(s, k) for s in range(fx.SESSIONS) for k in range(1, fx.TURNS)]
    slow_base = statistics.median(measured("pd-nocache", s, k) for s, k in later if not fx.failed("pd-nocache", s, k))
    speedup = slow_base / statistics.median(measured("pd-bidir-nocache", s, k) for s, k in later)
    assert f"pd-bidir-nocache vs pd-nocache: measured {speedup:.2f}x, forecast" in r.output
    # ... beside the measured speed-up's 95% CI, and whether the forecast lies inside it (read off the line)
    line = next(x for x in r.output.splitlines() if "pd-bidir-nocache vs pd-nocache: measured" in x)
    got = re.search(r"forecast ([0-9.]+)x .*the measured 95% CI ([0-9.]+)-([0-9.]+)x: forecast (inside|OUTSIDE)$", line)
    f, lo, hi = (float(got.group(i)) for i in (1, 2, 3))
    assert lo < speedup < hi and got.group(4) == ("inside" if lo <= f <= hi else "OUTSIDE")
    prof = load_profile(out)
    assert prof.held_out.ttft_ratio["aggregated"] == pytest.approx((SLOW, SLOW), rel=1e-6)
    # a plan with that profile: every interval moved by the held-out percentiles (docs/planner/held-out.md)
    store = check
    r = CliRunner().invoke(app, ["plan", str(check), "--format", "run", "--profile", str(out), "--store", str(store),
                                 "--fit-runs", ",".join(fx.RUNS.values())], env={"COLUMNS": "4000"})
    assert r.exit_code == 0, r.output
    assert "intervals: 80%, from the held-out errors stored with profile fitted" in r.output
    con = duckdb.connect()
    try:
        row = con.execute(f"SELECT speedup, speedup_interval_low, speedup_interval_high, baseline_ttft_median_s, "
                          f"baseline_ttft_interval_low_s FROM read_parquet('{store}/runs/plan-*/plan_speedups/*.parquet') "
                          f"WHERE treatment = 'pd-bidir-nocache' AND baseline = 'pd-nocache'").fetchone()
    finally:
        con.close()
    s, lo, hi, base, base_lo = row
    rr = ratios("pd-bidir-nocache")
    rt = (quantile(rr, 0.1), quantile(rr, 0.9))
    assert lo == pytest.approx(s * SLOW / rt[1], rel=1e-6) and hi == pytest.approx(s * SLOW / rt[0], rel=1e-6)
    assert base_lo == pytest.approx(base * SLOW, rel=1e-6)
    assert f"speed-up {s:.2f}x (80% interval {lo:.2f}-{hi:.2f}x)" in r.output
    # the Plan page shows the intervals and the profile's held-out errors
    monkeypatch.setenv("TURNSCOPE_STORE", str(store))
    at = AppTest.from_file(str(Path(__file__).resolve().parents[2] / "dashboard" / "app.py"), default_timeout=60).run()
    at.switch_page(pages.page("plan").script).run()
    assert not at.exception, [e.value for e in at.exception]
    text = " ".join(m.value for m in at.markdown)
    assert f"**pd-bidir-nocache vs pd-nocache**: speed-up {s:.2f}x (80% interval {lo:.2f}-{hi:.2f}x)" in text
    table = next(d.value for d in at.dataframe if "measured / forecast TTFT, p90" in d.value.columns).set_index("mode")
    assert table.loc["pd-nocache", "measured / forecast TTFT, p10"] == pytest.approx(SLOW, abs=1e-3)
    assert table.loc["pd-bidir-nocache", "hit rate error (pp), p90"] == pytest.approx(round(-100 / 6, 1))


def test_the_speed_probe_puts_the_forecast_on_the_runs_speed(tmp_path):
    """Fitted where the probe took 0.2 s, checked on runs 1.5 times slower whose probe took 0.3 s:
    b0 and c(x) scaled by 0.3 / 0.2 = 1.5 make every forecast exact again (pulls are not scaled: the
    fixture's slow machine has the same network)."""
    fit = fx.build(tmp_path / "fit", probe_s=(0.19, 0.21))
    check = fx.build(tmp_path / "check", slow=SLOW, probe_s=(0.3, 0.3))
    prof, checks, summ = held_out_check(check_split(str(fit), None, str(check), None))
    assert prof.probe_ttft_s.value == pytest.approx(0.2)
    assert checks["speed_factor"].tolist() == [pytest.approx(SLOW)] * len(checks)
    summ = summ.set_index("mode")
    for mode in ("pd-nocache", "pd-bidir", "aggregated"):
        assert summ.loc[mode, "ttft_mare"] == pytest.approx(0, abs=1e-6)
        assert summ.loc[mode, "ttft_error_p90"] == pytest.approx(0, abs=1e-6)
        assert summ.loc[mode, "p90_ttft_error"] == pytest.approx(0, abs=1e-6) and summ.loc[mode, "p90_ttft_pass"]
    # without a probe on the checked runs nothing is scaled: the slow machine's 1/3 error again
    plain = fx.build(tmp_path / "plain", slow=SLOW)
    _, checks, summ = held_out_check(check_split(str(fit), None, str(plain), None))
    assert checks["speed_factor"].isna().all()
    assert summ.set_index("mode").loc["pd-nocache", "ttft_mare"] == pytest.approx((SLOW - 1) / SLOW, rel=1e-6)


def test_the_fit_puts_each_run_on_one_speed(tmp_path):
    """Each mode recorded at another machine speed (its compute 1x, 1.2x, 1.5x, 2x, 0.8x the formula's,
    pulls as fast), its probe saying so (0.2 s times the same): fitted on the probes' median speed
    (0.24 s, the 1.2x run's), c(x) and every b0 are the fixture's times 1.2."""
    slow = {"pd-nocache": 1.0, "pd": 1.2, "pd-bidir": 1.5, "pd-bidir-nocache": 2.0, "aggregated": 0.8}
    probes = {m: (0.2 * f, 0.2 * f) for m, f in slow.items()}
    prof = fit_profile(Store(fx.build(tmp_path / "s", slow=slow, probe_s=probes)), RUN_IDS)
    assert prof.probe_ttft_s.value == pytest.approx(0.24)
    assert prof.prefill_a1_s_per_token.value == pytest.approx(1.2 * fx.A1, rel=1e-3)
    assert prof.prefill_a2_s_per_token2.value == pytest.approx(1.2 * fx.A2, rel=1e-3)
    for mode, b0 in fx.B0.items():
        assert prof.b0_s[mode].value == pytest.approx(1.2 * b0, rel=1e-3), mode
    assert "put on the median speed probe's speed" in prof.b0_s["pd"].source


def test_cli_repeatability_a_second_recording_as_the_forecast(stores):
    # the fit store's recording (the fixture's formula) as the forecast of the 1.5x-slow one, turn for
    # turn: every error by hand from the two recordings; outcomes recorded alike in both (all match),
    # the failed read included (a recording, not the rules' forecast of it)
    fit, check = stores
    r = CliRunner().invoke(app, ["plan-check", "--rerun-store", str(fit), "--check-store", str(check)],
                           env={"COLUMNS": "4000"})
    assert r.exit_code == 0, r.output
    assert f"Repeatability check (the 5 runs of store {fit}" in r.output
    for mode in ("pd-nocache", "pd-bidir-nocache"):
        turns = ok_turns(mode)
        err = [abs(fx.ttft_s(mode, s, k) - measured(mode, s, k)) / measured(mode, s, k) for s, k in turns]
        p90_f = quantile([fx.ttft_s(mode, s, k) for s, k in turns], 0.9)
        p90_m = quantile([measured(mode, s, k) for s, k in turns], 0.9)
        assert (f"{mode}: 1 runs, {len(turns)} ok turns, outcome {len(turns)}/{len(turns)}; TTFT MARE "
                f"{statistics.median(err):.1%}") in r.output, mode
        assert f"error p90 {quantile(err, 0.9):.1%}" in r.output
        assert f"p90 TTFT {p90_f * 1e3:,.1f} ms forecast vs {p90_m * 1e3:,.1f} ms measured" in r.output
    assert "hit rate 66.7% vs 66.7% recorded (+0.0 pp, pass)" in r.output   # pd-bidir-nocache: 4 of 6
    turns = fx.SESSIONS * fx.TURNS * len(fx.MODES)
    ok = turns - 1                                                          # pd-nocache's timed-out turn
    assert f"{turns} checked turns paired with a forecast turn, {ok} ok on both sides; 0 without a counterpart." in r.output
    assert f"{fx.RUNS['pd']} <- {fx.RUNS['pd']}" in r.output
    # a run id the store does not have is named
    r = CliRunner().invoke(app, ["plan-check", "--rerun-store", str(fit), "--check-store", str(check), "--check-runs",
                                 "nope"], env={"COLUMNS": "4000"})
    assert r.exit_code == 2 and f"store {check} has no run in a planned mode named nope" in r.output
    # the forecast is a recording: no profile to take or write
    r = CliRunner().invoke(app, ["plan-check", "--rerun-store", str(fit), "--check-store", str(check),
                                 "--profile", "embedded-cpu"])
    assert r.exit_code == 2 and "takes no --profile" in r.output
    # one store on both sides, unsplit: nothing is left to check
    r = CliRunner().invoke(app, ["plan-check", "--rerun-store", str(fit), "--check-store", str(fit)])
    assert r.exit_code == 2 and "no checked runs" in r.output
