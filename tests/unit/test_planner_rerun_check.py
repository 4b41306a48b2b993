"""Pairing a second recording with a run, turn for turn (turnscope/planner/rerun_check.py), by hand."""

from __future__ import annotations

import pandas as pd
import pytest

from turnscope.planner.rerun_check import rerun_checks


def turns(rows: list[tuple]) -> pd.DataFrame:
    """Rows (run_id, mode, sent_at, session_id, turn_index, status, ttft_s, reuse, reused_tokens)."""
    df = pd.DataFrame(rows, columns=["run_id", "mode", "sent_at", "session_id", "turn_index", "status", "ttft_s",
                                     "reuse", "reused_tokens"])
    return df.assign(history_mode="token_ids")


def test_runs_pair_by_their_place_and_turns_by_session_and_index():
    # a ramp's two steps of pd in each store: step 1 (sent first) pairs with step 1, whatever its id
    forecast = turns([("f-u2", "pd", 20.0, "s0", 0, "ok", 0.20, None, 0),
                      ("f-u1", "pd", 10.0, "s0", 0, "ok", 0.10, None, 0),
                      ("f-u1", "pd", 10.5, "s0", 1, "ok", 0.12, None, 0)])
    checked = turns([("c-u1", "pd", 100.0, "s0", 0, "ok", 0.08, None, 0),
                     ("c-u1", "pd", 100.5, "s0", 1, "error", None, None, 0),
                     ("c-u1", "pd", 101.0, "s0", 2, "ok", 0.3, None, 0),     # no counterpart
                     ("c-u2", "pd", 200.0, "s0", 0, "ok", 0.25, None, 0)])
    checks, left_out = rerun_checks(forecast, checked)
    checks = checks.set_index(["checked_run_id", "turn_index"])
    assert left_out == 1
    assert checks.loc[("c-u1", 0), "predicted_ttft_s"] == 0.10 and checks.loc[("c-u1", 0), "measured_ttft_s"] == 0.08
    assert checks.loc[("c-u2", 0), "predicted_ttft_s"] == 0.20
    # a turn failed on either side is not checked
    assert checks.loc[("c-u1", 1), "status"] == "failed" and checks.loc[("c-u1", 1), "outcome_match"] is None
    assert checks.loc[("c-u1", 0), "outcome_match"] is True   # no outcome on either side: alike


def test_outcomes_and_pulled_tokens_come_from_each_side():
    forecast = turns([("f", "pd-bidir", 0.0, "s", 1, "ok", 0.1, "hit", 500)])
    checked = turns([("c", "pd-bidir", 0.0, "s", 1, "ok", 0.2, "miss_expired", 0)])
    checks, _ = rerun_checks(forecast, checked)
    row = checks.iloc[0]
    assert (row.recorded_outcome, row.predicted_outcome, row.outcome_match) == ("miss_expired", "hit", False)
    assert (row.recorded_pulled_tokens, row.predicted_pulled_tokens) == (0, 500)


def test_nothing_pairs_up():
    with pytest.raises(ValueError, match="no turn of the checked runs has a counterpart"):
        rerun_checks(turns([("f", "pd", 0.0, "a", 0, "ok", 0.1, None, 0)]),
                     turns([("c", "pd", 0.0, "b", 0, "ok", 0.1, None, 0)]))
