"""The planner's fitted profile and its check against recorded runs, over a store written by the real
recorder (tests/planner_store.py), and ``turnscope plan --fit-runs`` through typer's CliRunner.

Truths are the fixture's own constants and formulas (hand computations), never the planner's output;
the store's plan_* tables are read back with hand-written SQL over the raw Parquet shards.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import duckdb
import pandas as pd
import pytest
from typer.testing import CliRunner

from analysis.plan_check import check_summary
from planner.check import check_runs, run_settings
from planner.fit import FitError, fit_profile
from store.writer import Store
from tests import planner_store as fx
from turnscope.commands import app

RUN_IDS = list(fx.RUNS.values())


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    return Store(fx.build(tmp_path_factory.mktemp("planner-store")))


@pytest.fixture(scope="module")
def checks(store):
    return check_runs(store, RUN_IDS, fit_profile(store, RUN_IDS))


def test_fit_recovers_the_recorded_deployment(store):
    prof = fit_profile(store, RUN_IDS)
    # the joint fit over every mode's turns (P/D modes share c; the aggregated worker has its own)
    assert prof.prefill_a1_s_per_token.value == pytest.approx(fx.A1, rel=1e-6)
    assert prof.prefill_a2_s_per_token2.value == pytest.approx(fx.A2, rel=1e-5)
    assert prof.aggregated_prefill_a1_s_per_token.value == pytest.approx(fx.A1, rel=1e-6)
    assert prof.aggregated_prefill_a2_s_per_token2.value == pytest.approx(fx.A2, rel=1e-5)
    assert prof.b0_default_s.value == pytest.approx(fx.B0["pd-nocache"], abs=1e-9)
    assert {m: pytest.approx(b.value, abs=1e-9) for m, b in prof.b0_s.items()} == fx.B0
    assert prof.pull_bandwidth_bytes_per_s.value == pytest.approx(fx.BANDWIDTH)
    assert prof.kv_bytes_per_token.value == fx.KV_BYTES and prof.block_size == fx.BLOCK
    space = fx.NUM_BLOCKS * fx.BLOCK * fx.KV_BYTES  # 524,288,000 bytes per worker
    assert (prof.prefill_kv_space_bytes.value, prof.decode_kv_space_bytes.value,
            prof.aggregated_kv_space_bytes.value) == (space, space, space)
    assert prof.decode_s_per_token.value == pytest.approx(fx.TPOT_S)
    # every figure says where it comes from: the runs it was fitted from
    assert all(fx.RUNS["pd-nocache"] in f.source for f in (prof.prefill_a1_s_per_token, prof.b0_default_s))
    # and how well each fitted figure fits its turns, and over which range: the fixture's TTFTs are the
    # model's own, so every residual is 0; P/D prompts run from 1,000 (session 0's first turn) to
    # 1,000 + 300 x 3 + 100 = 2,000 (session 1's last)
    assert "P/D turns: residuals over" in prof.prefill_a1_s_per_token.source
    assert "median 0.0%, p90 0.0%" in prof.prefill_a2_s_per_token2.source
    assert "(prompts 1,000-2,000)" in prof.prefill_a1_s_per_token.source
    assert "aggregated turns: residuals over" in prof.aggregated_prefill_a1_s_per_token.source
    assert all("turns: residuals over" in b.source for b in prof.b0_s.values())


def test_fit_forecasts_an_unrecorded_own_cache_hit(tmp_path):
    """Aggregated turns without cached_tokens: b0 is fitted with the planner's own-cache forecast,
    whole blocks of the previous prompt + output (the fixture's truth), so it is still exact."""
    store = Store(fx.build(tmp_path, aggregated_cached=False))
    prof = fit_profile(store, RUN_IDS)
    assert prof.b0_s["aggregated"].value == pytest.approx(fx.B0["aggregated"], abs=1e-9)
    assert prof.aggregated_prefill_a1_s_per_token.value == pytest.approx(fx.A1, rel=1e-6)
    # 2 sessions x 3 later turns: first turns with a forecast hit are left out of the fit
    assert "(6 turns' own-cache hit not recorded" in prof.b0_s["aggregated"].source
    # taken as 0 instead, b0 would absorb c(local) of the later turns: the median of 8 residuals
    wrong = statistics.median(fx.B0["aggregated"] - (fx.c(fx.recorded("aggregated", s, k)[1]))
                              for s in range(fx.SESSIONS) for k in range(fx.TURNS))
    assert abs(wrong - fx.B0["aggregated"]) > 0.1


def test_a_mode_not_fitted_takes_its_siblings_b0(store):
    """Fitted without ``pd`` and ``pd-bidir`` turns (the calibration's default modes), each takes the
    fixture's b0 of the mode with its workers and connector: ``pd`` <- ``pd-nocache`` (0.050 s),
    ``pd-bidir`` <- ``pd-bidir-nocache`` (0.080 s), not the default (``pd-nocache``'s) for both."""
    prof = fit_profile(store, [fx.RUNS[m] for m in ("aggregated", "pd-nocache", "pd-bidir-nocache")])
    assert prof.b0("pd") == pytest.approx(fx.B0["pd-nocache"], abs=1e-9)
    assert prof.b0("pd-bidir") == pytest.approx(fx.B0["pd-bidir-nocache"], abs=1e-9)
    assert "pd-bidir-nocache's b0" in prof.b0_s["pd-bidir"].source
    assert prof.b0_default_s.value == pytest.approx(fx.B0["pd-nocache"], abs=1e-9)


def test_fit_needs_a_timed_transfer(store):
    with pytest.raises(FitError, match="no pd-bidir\\* run recorded a NIXL transfer on P"):
        fit_profile(store, [fx.RUNS["pd-nocache"], fx.RUNS["pd"]])


def test_fit_needs_turns(store):
    with pytest.raises(FitError, match="no turns recorded for runs nope"):
        fit_profile(store, ["nope"])


def test_run_settings_are_the_runs_own(store):
    s = run_settings(store, fx.RUNS["pd-bidir"])
    assert (s.decoder_kv_blocks_ttl_s, s.handle_ttl_margin_s, s.kv_recompute_threshold) == (
        fx.TTL_S, fx.MARGIN_S, fx.THRESHOLD)
    assert s.proxy_ttl_s == 15.0
    # no topology recorded: the planner's defaults (one P, one D, session routing)
    assert (s.prefill_workers, s.decode_workers, s.routing, s.prefill_servers) == (1, 1, "session", None)


@pytest.mark.parametrize("routing, planned", [("round-robin", "round-robin"), ("prefix-aware", "session")])
def test_run_settings_take_the_recorded_topology(tmp_path, routing, planned):
    """A 2P1D run as `turnscope eval` records it (its config's topology and the stack's topology row,
    both P on core 0): planned with two P sharing one queue, one D, and P's routing from the
    run_config view where the planner has that policy (prefix-aware: the planner's session routing)."""
    import datetime as dt

    store = Store(tmp_path)
    store.init()
    row = {"name": "embedded-cpu-2p1d", "mode": "pd-bidir", "prefill_routing": routing, "workers": [
        {"name": "prefill-0", "role": "prefill", "cores": [0]}, {"name": "prefill-1", "role": "prefill", "cores": [0]},
        {"name": "decode-0", "role": "decode", "cores": [1]}]}
    now = dt.datetime(2026, 12, 5, tzinfo=dt.UTC)
    with store.writer("rr", "test") as w:
        w.append("runs_log", {"run_id": "rr", "label": "rr", "mode": "pd-bidir", "workload": "x",
                              "history_mode": "token_ids", "model": "m", "topology": row,
                              "config": {"topology": {"proxy": {"prefill_routing": routing}}},
                              "started_at": now, "updated_at": now, "status": "complete"})
    s = run_settings(store, "rr")
    assert (s.prefill_workers, s.decode_workers, s.routing, s.prefill_servers) == (2, 1, planned, (0, 0))


def test_every_outcome_but_the_failed_read_matches(checks):
    ok = checks[checks["status"] == "ok"]
    # 5 runs x 8 turns, less the timed-out one
    assert len(ok) == 39 and len(checks) == 40
    timed_out = checks[checks["status"] != "ok"]
    assert list(timed_out["outcome_match"]) == [None] and timed_out["why"].isna().all()
    diff = checks[checks["why"].notna()]
    mode, s, k = fx.TRANSFER_FAILED
    assert [(r.mode, r.session_id, r.turn_index) for r in diff.itertuples()] == [(mode, f"s{s}", k)]
    why = diff["why"].iloc[0]
    # the handle of turn 1 (1,300 prompt + 32 output - 1 = 1,331 tokens), 2 s old: the rules say hit
    assert "recorded miss_transfer_failed" in why and "predicted hit (1331 pulled" in why and "2.0 s old" in why
    # the hand-derived outcomes: below threshold, expired, hits
    by = {(r.mode, r.session_id, r.turn_index): r.predicted_outcome for r in checks.itertuples()}
    assert by[("pd-bidir", "s0", 2)] == "miss_below_threshold"
    assert by[("pd-bidir", "s1", 3)] == by[("pd-bidir-nocache", "s1", 3)] == "miss_expired"
    assert by[("pd-bidir", "s0", 1)] == "hit" and pd.isna(by[("aggregated", "s0", 1)])


def test_pulled_and_own_cache_tokens_are_the_recorded_ones(checks):
    ok = checks[(checks["status"] == "ok") & (checks["why"].isna()) & (checks["mode"] != "pd")]
    assert (ok["predicted_pulled_tokens"] == ok["recorded_pulled_tokens"]).all()
    assert (ok["predicted_local_tokens"] == ok["recorded_local_tokens"]).all()
    # e.g. pd-bidir session 0 turn 1: P holds 896 of 1,000 tokens, pulls 1,031 - 896 = 135
    r = checks[(checks["mode"] == "pd-bidir") & (checks["session_id"] == "s0") & (checks["turn_index"] == 1)].iloc[0]
    assert (r.predicted_local_tokens, r.predicted_pulled_tokens) == (896, 135)


def test_summary_against_hand_computed_errors(checks):
    summ = check_summary(checks).set_index("mode")
    assert summ.loc["pd-nocache", "ok_turns"] == 7
    for mode in ("pd-nocache", "pd-bidir", "aggregated"):
        assert summ.loc[mode, "ttft_mare"] == pytest.approx(0, abs=1e-9)
        assert summ.loc[mode, "outcome_check"] and summ.loc[mode, "ttft_check"]
    # pd-bidir-nocache: 7 of 8 outcomes; its TTFT MARE is the median of 7 zeros and one error
    assert summ.loc["pd-bidir-nocache", "outcome_matches"] == 7
    assert not summ.loc["pd-bidir-nocache", "outcome_check"] and summ.loc["pd-bidir-nocache", "ttft_check"]
    # pd: the forecast's P cache holds what the recording says P lost: MARE by hand, above the bound
    expected = statistics.median(fx.pd_relative_errors())
    assert expected == pytest.approx(0.6039, abs=1e-4)
    assert summ.loc["pd", "ttft_mare"] == pytest.approx(expected, rel=1e-9)
    assert summ.loc["pd", "outcome_check"] and not summ.loc["pd", "ttft_check"]


def test_cli_plan_fit_runs_writes_the_check(store, tmp_path):
    r = CliRunner().invoke(app, ["plan", str(store.root), "--store", str(store.root), "--fit-runs", ",".join(RUN_IDS)],
                           env={"COLUMNS": "4000"})
    assert r.exit_code == 0, r.output
    out = r.output
    assert "FORECAST (profile fitted)" in out
    assert "pd: outcome 8/8 ok turns (pass), TTFT MARE 60.4% (FAIL, bound 25%)" in out
    assert "pd-bidir-nocache: outcome 7/8 ok turns (FAIL), TTFT MARE 0.0% (pass, bound 25%)" in out
    # read back from the raw shards, not through the planner's code
    con = duckdb.connect()
    try:
        rows = con.execute(f"SELECT checked_run_id, session_id, turn_index, predicted_outcome, outcome_match "
                           f"FROM read_parquet('{store.root}/runs/plan-*/plan_checks/*.parquet') "
                           f"WHERE outcome_match = false").fetchall()
        n = con.execute(f"SELECT count(*) FROM read_parquet('{store.root}/runs/plan-*/plan_checks/*.parquet')").fetchone()
    finally:
        con.close()
    assert rows == [(fx.RUNS["pd-bidir-nocache"], "s0", 2, "hit", False)]
    assert n == (40,)


def test_cli_plan_refuses_without_a_profile(tmp_path):
    r = CliRunner().invoke(app, ["plan", str(tmp_path), "--store", str(tmp_path)], env={"COLUMNS": "4000"})
    assert r.exit_code != 0
    assert "give --profile FILE" in r.output and "Traceback" not in r.output


def test_cli_plan_with_a_yaml_profile_over_a_trace(tmp_path):
    """The shipped vendor profile over one shipped trace: every line labelled as a forecast."""
    repo = Path(__file__).resolve().parents[2]
    trace = min((repo / "data" / "traces" / "kv-cache-tester").glob("*.json"))
    r = CliRunner().invoke(app, ["plan", str(trace), "--profile", str(repo / "data/profiles/vendor-h200.yaml"),
                                 "--store", str(tmp_path)], env={"COLUMNS": "4000"})
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[0].startswith("FORECAST (profile vendor-h200)")
    assert "pd-bidir-nocache vs pd-nocache" in r.output


def test_cli_plan_takes_the_models_kv_size(tmp_path):
    """--model: DeepSeek-V3's published config (MLA): 61 layers x (512 + 64) x 2 bytes = 70,272 per token."""
    repo = Path(__file__).resolve().parents[2]
    trace = repo / "data" / "traces" / "kv-cache-tester" / "trace_0036.json"
    r = CliRunner().invoke(app, ["plan", str(trace), "--profile", str(repo / "data/profiles/vendor-h200.yaml"),
                                 "--model", str(repo / "tests/data/model_configs/DeepSeek-V3.json"),
                                 "--store", str(tmp_path)], env={"COLUMNS": "4000"})
    assert r.exit_code == 0, r.output
    con = duckdb.connect()
    try:
        kv = con.execute(f"SELECT json_extract(profile, '$.kv_bytes_per_token.value')::DOUBLE "
                         f"FROM read_parquet('{tmp_path}/runs/plan-*/plan_log/*.parquet')").fetchone()[0]
    finally:
        con.close()
    assert kv == 61 * (512 + 64) * 2


def test_cli_plan_refuses_a_sliding_window_model(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text('{"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, '
                   '"sliding_window": 4096, "torch_dtype": "bfloat16"}')
    repo = Path(__file__).resolve().parents[2]
    trace = repo / "data" / "traces" / "kv-cache-tester" / "trace_0036.json"
    r = CliRunner().invoke(app, ["plan", str(trace), "--profile", str(repo / "data/profiles/vendor-h200.yaml"),
                                 "--model", str(cfg), "--store", str(tmp_path / "s")], env={"COLUMNS": "4000"})
    assert r.exit_code != 0 and "Traceback" not in r.output
    assert f"{cfg}: field 'sliding_window' = 4096" in r.output


def test_overlapping_sessions_wait_for_the_worker(tmp_path):
    """Session 1 starts 10 ms after session 0: its turns wait for session 0's prompt on the one
    worker (the fixture's event loop). The fit recovers the costs and the check forecasts each
    turn's measured TTFT, wait included, from recorded arrivals and forecast worker times."""
    store = Store(fx.build(tmp_path, overlap_s=0.01))
    waited = {key: w for key, w in fx.WAITS.items() if w > 0}
    assert len(waited) >= 5                     # the case is one of queueing
    prof = fit_profile(store, RUN_IDS)
    assert prof.prefill_a1_s_per_token.value == pytest.approx(fx.A1, rel=1e-4)
    assert {m: pytest.approx(b.value, abs=1e-6) for m, b in prof.b0_s.items()} == fx.B0
    ok = check_runs(store, RUN_IDS, prof)
    ok = ok[ok["status"] == "ok"]
    for r in ok.itertuples():
        mode, s, k = r.mode, int(r.session_id[1:]), int(r.turn_index)
        # the fixture's planned differences: pd (P's cache lost what the forecast keeps) and the failed
        # read (a full prefill where the forecast pulls), and session 1's turn 2 queued behind that read
        if mode == "pd" or (mode, s, k) in (fx.TRANSFER_FAILED, ("pd-bidir-nocache", 1, 2)):
            continue
        assert r.predicted_ttft_s == pytest.approx(r.measured_ttft_s, abs=1e-6), (mode, s, k)
    # the waits are in it: without them the forecast of a waiting turn is short by the wait
    m, s, k = next((m, s, k) for (m, s, k) in waited if m == "aggregated")
    row = ok[(ok["mode"] == m) & (ok["session_id"] == f"s{s}") & (ok["turn_index"] == k)].iloc[0]
    assert row.measured_ttft_s - fx.ttft_s(m, s, k) == pytest.approx(fx.WAITS[(m, s, k)])


def test_each_recorded_run_is_planned_on_its_own_clock(store):
    """The five runs overlap in wall time (started a minute apart, each over 100 s long) and each run's
    clock starts at its first turn, so planned as one traffic the five copies of each turn would
    arrive together and queue for one prefill worker. Planned each on its own, no request waits:
    every pd-nocache forecast is B0 + c(n), and the headline is the Overview's median ratio over the
    30 later requests, both by hand from the fixture's formulas."""
    r = CliRunner().invoke(app, ["plan", str(store.root), "--store", str(store.root), "--fit-runs", ",".join(RUN_IDS),
                                 "--label", "own-clock"], env={"COLUMNS": "4000"})
    assert r.exit_code == 0, r.output
    con = duckdb.connect()
    try:
        pid = con.execute(f"SELECT plan_id FROM read_parquet('{store.root}/runs/plan-*/plan_log/*.parquet') "
                          f"WHERE label = 'own-clock'").fetchone()[0]
        rows = con.execute(f"SELECT mode, source, session_id, request_index, input_tokens, ttft_s, queue_wait_s "
                           f"FROM read_parquet('{store.root}/runs/{pid}/plan_requests/*.parquet')").fetchall()
        sp = con.execute(f"SELECT speedup, treatment_ttft_median_s, baseline_ttft_median_s, treatment_queue_share "
                         f"FROM read_parquet('{store.root}/runs/{pid}/plan_speedups/*.parquet') "
                         f"WHERE treatment = 'pd-bidir-nocache' AND baseline = 'pd-nocache'").fetchone()
        checks = con.execute(f"SELECT checked_run_id, session_id, turn_index, predicted_ttft_s "
                             f"FROM read_parquet('{store.root}/runs/{pid}/plan_checks/*.parquet') "
                             f"WHERE mode = 'pd-nocache' AND status = 'ok'").fetchall()
    finally:
        con.close()
    assert len(rows) == 5 * 5 * fx.SESSIONS * fx.TURNS          # 5 modes x 5 runs x 8 turns
    assert all(abs(w) < 1e-9 for *_, w in rows)   # sends paced by the forecast replies: float rounding only

    def n_of(source: str, session: str, k: int) -> int:
        s = int(session[1:])
        return 0 if source == f"run:{fx.RUNS[fx.TIMED_OUT[0]]}" and (s, k) == fx.TIMED_OUT[1:] else fx.prompt(s, k)

    for mode, source, session, k, n, ttft, _ in rows:
        assert n == n_of(source, session, k)
        if mode == "pd-nocache":
            assert ttft == pytest.approx(fx.B0["pd-nocache"] + fx.c(n), rel=1e-5)
    # each checked run's own forecast: no wait either
    assert len(checks) == 7 and all(t == pytest.approx(fx.B0["pd-nocache"] + fx.c(fx.prompt(int(s[1:]), k)), rel=1e-5)
                                    for _, s, k, t in checks)
    # the headline: medians over the later requests of the 5 runs (a handle of prompt + 32 - 1 pulled;
    # the timed-out turn, 0 tokens, pulls nothing and costs b0)
    base, bidir = [], []
    for mode in fx.MODES:
        for s in range(fx.SESSIONS):
            for k in range(1, fx.TURNS):
                n = n_of(f"run:{fx.RUNS[mode]}", f"s{s}", k)
                base.append(fx.B0["pd-nocache"] + fx.c(n))
                pull = fx.prompt(s, k - 1) + fx.OUT - 1 if n else 0
                bidir.append(fx.B0["pd-bidir-nocache"] + fx.c(n) - fx.c(pull) + pull * fx.PULL_S_PER_TOKEN)
    assert sp[1] == pytest.approx(statistics.median(bidir), rel=1e-5)
    assert sp[2] == pytest.approx(statistics.median(base), rel=1e-5)
    assert sp[0] == pytest.approx(statistics.median(base) / statistics.median(bidir), rel=1e-5)
    assert sp[3] == 0
    assert "speed-up 1.63x" in r.output and "queueing 0% vs 0% of mean TTFT" in r.output
