"""The TTFT split of ``turnscope plan-check`` (analysis/ttft_split.py, check.forecast_terms)
and view ``engine_prefill_speed``, over the planner's hand-made store (tests/planner_store.py) with
vLLM request histograms written here by hand: every figure is a hand computation from the
fixture's formulas or from the numbers typed below, never the code's output.
"""

from __future__ import annotations

import datetime as dt
import statistics

import pytest
from typer.testing import CliRunner

from analysis import ttft_split
from planner.check import check_runs_with_terms
from planner.profile import CostProfile, Sourced
from store.writer import Store
from tests import planner_store as fx
from turnscope.commands import app

BIDIR = fx.RUNS["pd-bidir"]
P, D = "http://127.0.0.1:8100", "http://127.0.0.1:8200"
#: Cumulative values at the fixture's three scrapes (T0, T0 + 100 s, T0 + 200 s), per (endpoint, name).
HIST = {
    (P, "vllm:request_prefill_time_seconds_sum"): (0.0, 1.2, 2.0),
    (P, "vllm:request_prefill_time_seconds_count"): (0, 3, 8),
    (P, "vllm:request_prefill_kv_computed_tokens_sum"): (0, 3000, 4000),
    (P, "vllm:request_queue_time_seconds_sum"): (0.0, 0.1, 0.4),
    (P, "vllm:request_queue_time_seconds_count"): (0, 3, 8),
    (D, "vllm:request_queue_time_seconds_sum"): (0.0, 0.06, 0.16),
    (D, "vllm:request_queue_time_seconds_count"): (0, 3, 8),
    (D, "vllm:request_prefill_time_seconds_sum"): (0.0, 0.03, 0.08),
    (D, "vllm:request_prefill_time_seconds_count"): (0, 3, 8),
}


def _profile() -> CostProfile:
    """The fixture's deployment typed in (no fit): c(x) = A1 x + A2 x^2, its b0s, its pull cost."""
    src = "tests/planner_store.py"
    s = lambda v: Sourced(value=v, source=src)
    return CostProfile(name="fixture", block_size=fx.BLOCK, kv_bytes_per_token=s(fx.KV_BYTES),
                       prefill_a1_s_per_token=s(fx.A1), prefill_a2_s_per_token2=s(fx.A2),
                       b0_default_s=s(fx.B0["pd-nocache"]), b0_s={m: s(v) for m, v in fx.B0.items()},
                       pull_bandwidth_bytes_per_s=s(fx.BANDWIDTH))


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    st = Store(fx.build(tmp_path_factory.mktemp("split-store"), overlap_s=0.1))
    with st.writer(BIDIR, "hist") as w:
        for (url, name), values in HIST.items():
            role = "prefill" if url == P else "decode"
            for i, v in enumerate(values):
                w.append("metric_samples", {"run_id": BIDIR, "scraped_at": fx.T0 + dt.timedelta(seconds=100 * i),
                                            "endpoint": url, "role": role, "name": name,
                                            "labels": {"engine": "0"}, "value": float(v)})
    return st


def _bidir_ok_turns():
    return [(s, k) for s in range(fx.SESSIONS) for k in range(fx.TURNS) if not fx.failed("pd-bidir", s, k)]


def test_measured_terms_are_the_histograms_means(store):
    m = ttft_split.measured_terms(ttft_split.measured_sums(store, [BIDIR])).set_index("run_id").loc[BIDIR]
    # each mean is the run's increase of the sum over that of the count: 8 requests on each worker
    assert m["compute"] == pytest.approx(2.0 / 8)
    assert m["queue_p_pull"] == pytest.approx(0.4 / 8)
    assert m["wait_d"] == pytest.approx(0.16 / 8)
    assert m["d_first_step"] == pytest.approx(0.08 / 8)
    # the fixture's P NIXL time rises by 0.5 s over the run (tests/planner_store.py _metrics)
    assert m["pull"] == pytest.approx(0.5 / 8)
    # the client's mean TTFT: the fixture's formula plus each turn's wait for the worker (WAITS)
    ttft = statistics.mean(fx.ttft_s("pd-bidir", s, k) + fx.WAITS[("pd-bidir", s, k)] for s, k in _bidir_ok_turns())
    assert m["ttft"] == pytest.approx(ttft)
    assert m["fixed"] == pytest.approx(ttft - 0.25 - 0.05 - 0.02 - 0.01)


def test_forecast_terms_are_the_profiles_costs(store):
    _, terms = check_runs_with_terms(store, [BIDIR], _profile())
    got = terms.set_index(["session_id", "turn_index"])
    for s, k in _bidir_ok_turns():
        _, local, pulled = fx.recorded("pd-bidir", s, k)
        row = got.loc[(f"s{s}", k)]
        n = fx.prompt(s, k)
        assert row["compute"] == pytest.approx(fx.c(n) - fx.c(local + pulled))
        assert row["pull"] == pytest.approx(pulled * fx.PULL_S_PER_TOKEN)
        assert row["fixed"] == pytest.approx(fx.B0["pd-bidir"])   # token ids: nothing rendered
        # one worker, first come first served: the wait the fixture's event loop recorded
        assert row["queue_p"] == pytest.approx(fx.WAITS[("pd-bidir", s, k)], abs=1e-5)  # sent_at: microseconds
        assert row["wait_d"] == 0 and row["contention"] == 0
        assert row["ttft"] == pytest.approx(fx.ttft_s("pd-bidir", s, k) + fx.WAITS[("pd-bidir", s, k)], abs=1e-5)
    assert sum(fx.WAITS[("pd-bidir", s, k)] for s, k in _bidir_ok_turns()) > 0   # the sessions did overlap


def test_engine_speed_windows_and_slow_stretch(store):
    con = store.connect()
    try:
        rows = con.execute("SELECT interval_s, prefills, prefill_s, computed_tokens, queue_s, prefill_s_per_token "
                           "FROM engine_prefill_speed WHERE run_id = ? AND interval_s IS NOT NULL "
                           "ORDER BY interval_end", [BIDIR]).fetchall()
    finally:
        con.close()
    # two 100 s intervals: 3 prefills of 1.2 s over 3,000 tokens, then 5 of 0.8 s over 1,000
    assert [r[:5] for r in rows] == [pytest.approx((100.0, 3, 1.2, 3000, 0.1)), pytest.approx((100.0, 5, 0.8, 1000, 0.3))]
    assert [r[5] for r in rows] == [pytest.approx(4e-4), pytest.approx(8e-4)]
    st = ttft_split.slow_stretch(ttft_split.speed_windows(store, [BIDIR])).set_index("run_id").loc[BIDIR]
    assert st["windows"] == 2
    assert st["median_s_per_token"] == pytest.approx(6e-4)            # median of 4e-4 and 8e-4
    assert st["slowest_over_median"] == pytest.approx(8e-4 / 6e-4)


def test_plan_check_prints_the_split(store, tmp_path):
    prof = tmp_path / "fixture.yaml"
    from planner.layer_timing import write_profile
    write_profile(_profile(), prof, "test")
    res = CliRunner().invoke(app, ["plan-check", "--check-store", str(store.root), "--profile", str(prof),
                                   "--check-runs", BIDIR])
    assert res.exit_code == 0, res.output
    out = res.output
    assert f"{BIDIR} (pd-bidir):" in out
    # measured compute 2.0 s / 8 = 250.0 ms; D's first step 80 ms / 8 = 10.0 ms (forecast: in b0, unknown)
    assert "250.0   P's vllm:request_prefill_time_seconds" in out
    assert "        ? |      10.0   D's vllm:request_prefill_time_seconds" in out
    assert "1.33x the median" in out
    # a run without histograms: every measured term is unknown, said so
    res = CliRunner().invoke(app, ["plan-check", "--check-store", str(store.root), "--profile", str(prof),
                                   "--check-runs", fx.RUNS["pd"]])
    assert res.exit_code == 0, res.output
    assert "engine speed: not known (no prefill in the run's scrapes)" in res.output
    assert "--no-split" not in res.output
    res = CliRunner().invoke(app, ["plan-check", "--check-store", str(store.root), "--profile", str(prof),
                                   "--check-runs", BIDIR, "--no-split"])
    assert "TTFT split" not in res.output


def test_split_shows_the_handoff_terms_beside_ds_histograms(store):
    # a profile with the hand-off apart: D waits 12 ms for P's KV, its first step takes 9 ms
    prof = _profile().model_copy(update={"handoff_wait_s": Sourced(value=0.012, source="typed"),
                                         "d_first_step_s": Sourced(value=0.009, source="typed")})
    _, terms = check_runs_with_terms(store, [BIDIR], prof)
    measured = ttft_split.measured_terms(ttft_split.measured_sums(store, [BIDIR]))
    table = ttft_split.split_table(ttft_split.forecast_means(terms), measured).set_index("term")
    # no room wait on D in the fixture: the wait on D is the hand-off alone; measured 0.16 s / 8
    assert table.loc["wait on D", "forecast_s"] == pytest.approx(0.012)
    assert table.loc["wait on D", "measured_s"] == pytest.approx(0.02)
    assert table.loc["D's first step", "forecast_s"] == pytest.approx(0.009)
    assert table.loc["D's first step", "measured_s"] == pytest.approx(0.01)
    # each turn's forecast TTFT holds both terms: b0 + the terms over the fixture's TTFT formula
    ok = terms[terms["status"] == "ok"].set_index(["session_id", "turn_index"])
    s, k = _bidir_ok_turns()[0]
    assert ok.loc[(f"s{s}", k), "ttft"] == pytest.approx(
        fx.ttft_s("pd-bidir", s, k) + fx.WAITS[("pd-bidir", s, k)] + 0.021, abs=1e-5)


def test_the_fit_measures_the_handoff_from_ds_histograms(store):
    from planner.fit import handoff_terms
    # one P/D run with D's histograms: D's queue 0.16 s over 8 requests, D's prefill 0.08 s over 8
    got = handoff_terms(store, [BIDIR])
    assert got["handoff_wait_s"].value == pytest.approx(0.02)
    assert got["d_first_step_s"].value == pytest.approx(0.01)
    # on a run twice as slow as the reference, the terms at the reference's speed are half
    half = handoff_terms(store, [BIDIR], {BIDIR: 2.0})
    assert half["handoff_wait_s"].value == pytest.approx(0.01)
    # runs without D's histograms give nothing
    assert handoff_terms(store, [fx.RUNS["pd"]]) == {}


def test_the_fit_measures_ps_pull_latency_from_ps_queue_time(store):
    from planner.fit import pull_latency_term
    # P's queue 0.4 s over the run; less the bytes' term of the tokens its ok turns pulled (read
    # here with SQL of their own), over the number of those turns
    con = store.connect()
    try:
        pulled = [n for (n,) in con.execute("SELECT reused_tokens FROM turns WHERE run_id = ? AND status = 'ok' "
                                            "AND reused_tokens > 0", [BIDIR]).fetchall()]
    finally:
        con.close()
    assert pulled
    per_turn = (0.4 - sum(n * fx.KV_BYTES / fx.BANDWIDTH for n in pulled)) / len(pulled)
    got = pull_latency_term(store, [BIDIR, fx.RUNS["pd"]], _profile())
    assert got.value == pytest.approx(per_turn)
    # on a run twice as slow as the reference (its short probe), half at the reference's speed
    assert pull_latency_term(store, [BIDIR], _profile(), {BIDIR: 2.0}).value == pytest.approx(per_turn / 2)
    # a run that cannot pull gives nothing
    assert pull_latency_term(store, [fx.RUNS["pd"]], _profile()) is None


def test_a_fit_measures_the_pull_latency_before_its_costs(store):
    from planner.fit import fit_profile
    con = store.connect()
    try:
        runs = [r for (r,) in con.execute("SELECT DISTINCT run_id FROM turns").fetchall()]
        probes = con.execute("SELECT count(*) FROM run_probes").fetchone()[0]
        pulled = [n for (n,) in con.execute("SELECT reused_tokens FROM turns WHERE run_id = ? AND status = 'ok' "
                                            "AND reused_tokens > 0", [BIDIR]).fetchall()]
    finally:
        con.close()
    assert probes == 0                        # no speed probes in the fixture: every run at factor 1
    prof = fit_profile(store, runs)
    # the bytes' term at the fit's own bandwidth (P's NIXL bytes over its seconds), typed in the fixture
    per_turn = (0.4 - sum(n * fx.KV_BYTES / prof.pull_bandwidth_bytes_per_s.value for n in pulled)) / len(pulled)
    assert prof.pull_latency_s.value == pytest.approx(per_turn)
    assert not any(x.startswith("pull_latency_s") for x in prof.left_out)
