"""Pairing a second recording with a run, turn for turn (planner/rerun_check.py), by hand."""

from __future__ import annotations

import pandas as pd
import pytest

from planner.rerun_check import pair_runs, rerun_checks, setup_key


def turns(rows: list[tuple]) -> pd.DataFrame:
    """Rows (run_id, mode, session_id, turn_index, status, ttft_s, reuse, reused_tokens)."""
    return pd.DataFrame(rows, columns=["run_id", "mode", "session_id", "turn_index", "status", "ttft_s", "reuse",
                                       "reused_tokens"])


def runs(rows: list[tuple]) -> pd.DataFrame:
    """Rows (run_id, setup, first_sent)."""
    return pd.DataFrame(rows, columns=["run_id", "setup", "first_sent"])


SPEC = {"gap_s": 1.0, "max_prompt_tokens": 3500, "max_tokens": 32, "max_turns": 6, "sessions": 4, "users": 2,
        "time_scale": 1.0, "schedule": {"orders": [["pd", "pd-bidir"]]}}
ONE_P = {"workers": [{"role": "prefill", "cores": [0]}, {"role": "decode", "cores": [1]}]}
TWO_P = {"workers": [{"role": "prefill", "cores": [0]}, {"role": "prefill", "cores": [0]}, {"role": "decode", "cores": [1]}]}


def test_the_setup_ignores_the_schedule_and_ramp_id_but_not_the_sessions_or_workers():
    base = setup_key("pd", "token_ids", "w", SPEC, ONE_P)
    # another A/B order, another ramp id and file path: the same recording set-up
    assert setup_key("pd", "token_ids", "w", SPEC | {"schedule": {"orders": [["pd-bidir", "pd"]]}, "file": "/x"},
                     ONE_P) == base
    assert setup_key("pd", "token_ids", "w", SPEC | {"gap_s": 0.5}, ONE_P) != base
    assert setup_key("pd", "token_ids", "w", SPEC, TWO_P) != base                 # 2P1D is another set-up
    assert setup_key("pd", "text", "w", SPEC, ONE_P) != base
    step = {"capacity": {"id": "a", "users": 4, "sessions": 8, "step": 2}}
    assert (setup_key("pd", "token_ids", "w", SPEC | step, ONE_P)
            == setup_key("pd", "token_ids", "w", SPEC | {"capacity": {"id": "b", "users": 4, "sessions": 8, "step": 2}},
                         ONE_P))
    assert (setup_key("pd", "token_ids", "w", SPEC | step, ONE_P)
            != setup_key("pd", "token_ids", "w", SPEC | {"capacity": {"id": "a", "users": 6, "sessions": 12}}, ONE_P))


def test_runs_pair_by_setup_then_place():
    # two recordings of one set-up in each store pair oldest with oldest; a ramp's steps (other
    # set-ups) pair with their own step whatever else is passed; a set-up with no forecast run is left
    forecast = runs([("f-late", "x", 20.0), ("f-early", "x", 10.0), ("f-u4", "u4", 5.0)])
    checked = runs([("c-early", "x", 100.0), ("c-late", "x", 200.0), ("c-u4", "u4", 50.0), ("c-u8", "u8", 60.0)])
    pairs = pair_runs(forecast, checked).set_index("run_id")["forecast_run_id"]
    assert pairs.loc[["c-early", "c-late", "c-u4"]].tolist() == ["f-early", "f-late", "f-u4"]
    assert pd.isna(pairs["c-u8"])


def test_turns_pair_by_session_and_index():
    forecast = turns([("f", "pd", "s0", 0, "ok", 0.10, None, 0), ("f", "pd", "s0", 1, "ok", 0.12, None, 0)])
    checked = turns([("c", "pd", "s0", 0, "ok", 0.08, None, 0), ("c", "pd", "s0", 1, "error", None, None, 0),
                     ("c", "pd", "s0", 2, "ok", 0.3, None, 0),      # no counterpart
                     ("u", "pd", "s0", 0, "ok", 0.3, None, 0)])     # its run has none
    pairs = pd.DataFrame({"run_id": ["c", "u"], "forecast_run_id": ["f", None]})
    r = rerun_checks(forecast, checked, pairs)
    checks = r.checks.set_index(["checked_run_id", "turn_index"])
    assert r.turns_left_out == 1 and r.unpaired_runs == ["u"] and len(checks) == 2
    assert checks.loc[("c", 0), "predicted_ttft_s"] == 0.10 and checks.loc[("c", 0), "measured_ttft_s"] == 0.08
    # a turn failed on either side is not checked, and the count says so
    assert checks.loc[("c", 1), "status"] == "failed" and checks.loc[("c", 1), "outcome_match"] is None
    assert "2 checked turns paired with a forecast turn, 1 ok on both sides; 1 without a counterpart" in r.describe()
    assert "c <- f" in r.describe() and "(left out): u" in r.describe()


def test_outcomes_and_pulled_tokens_come_from_each_side():
    forecast = turns([("f", "pd-bidir", "s", 1, "ok", 0.1, "hit", 500)])
    checked = turns([("c", "pd-bidir", "s", 1, "ok", 0.2, "miss_expired", 0)])
    row = rerun_checks(forecast, checked, pd.DataFrame({"run_id": ["c"], "forecast_run_id": ["f"]})).checks.iloc[0]
    assert (row.recorded_outcome, row.predicted_outcome, row.outcome_match) == ("miss_expired", "hit", False)
    assert (row.recorded_pulled_tokens, row.predicted_pulled_tokens) == (0, 500)


def test_nothing_pairs_up():
    with pytest.raises(ValueError, match="no turn of the checked runs has a counterpart"):
        rerun_checks(turns([("f", "pd", "a", 0, "ok", 0.1, None, 0)]), turns([("c", "pd", "b", 0, "ok", 0.1, None, 0)]),
                     pd.DataFrame({"run_id": ["c"], "forecast_run_id": ["f"]}))
