"""The share of checked turns inside the profile's 80% TTFT interval (planner/held_out.py,
``ttft_in_interval``): hand-made checks, the shares counted by hand."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from planner import held_out
from planner.profile import CostProfile, HeldOutErrors, Sourced


def profile(held: HeldOutErrors | None) -> CostProfile:
    one = Sourced(value=1.0, source="test")
    return CostProfile(name="t", block_size=16, kv_bytes_per_token=one, prefill_a1_s_per_token=one,
                       b0_default_s=one, pull_bandwidth_bytes_per_s=one, held_out=held)


HELD = HeldOutErrors(split="by hand", runs=1, turns=1, ttft_ratio={"pd": (0.8, 1.25), "aggregated": (0.5, 2.0)})


def checks(mode: str, forecast_s: list[float], measured_s: list[float]) -> pd.DataFrame:
    n = len(forecast_s)
    return pd.DataFrame({"mode": mode, "checked_run_id": "r", "turn_index": range(n), "status": "ok",
                         "predicted_ttft_s": forecast_s, "measured_ttft_s": measured_s,
                         "recorded_outcome": "miss", "predicted_outcome": "miss", "outcome_match": True,
                         "recorded_pulled_tokens": 0, "predicted_pulled_tokens": 0})


def test_share_inside_the_interval_counted_by_hand():
    # pd: forecast 0.1 s -> interval 0.08-0.125 s: 0.085, 0.1, 0.12 inside; 0.07, 0.13 out.
    pd_rows = checks("pd", [0.1] * 5, [0.07, 0.085, 0.1, 0.12, 0.13])
    # aggregated: forecast 0.2 -> 0.1-0.4: 8 of 10 inside -> 80%, within the 70-90% target
    agg_rows = checks("aggregated", [0.2] * 10, [0.05, 0.11, 0.15, 0.2, 0.2, 0.25, 0.3, 0.35, 0.39, 0.5])
    s = held_out.held_out_summary(pd.concat([pd_rows, agg_rows], ignore_index=True), profile(HELD)).set_index("mode")
    assert s.loc["pd", "ttft_in_interval"] == 3 / 5
    assert s.loc["pd", "interval_pass"] == False
    assert s.loc["aggregated", "ttft_in_interval"] == 8 / 10
    assert s.loc["aggregated", "interval_pass"] == True


def test_all_inside_is_too_wide_and_fails():
    s = held_out.held_out_summary(checks("pd", [0.1] * 4, [0.09, 0.1, 0.11, 0.12]), profile(HELD))
    assert s.loc[0, "ttft_in_interval"] == 1.0 and not s.loc[0, "interval_pass"]


def test_no_interval_without_held_out_errors():
    rows = checks("pd", [0.1, 0.1], [0.1, 0.2])
    for prof in (None, profile(None), profile(HeldOutErrors(split="x", runs=1, turns=1, ttft_ratio={"aggregated": (1, 1)}))):
        s = held_out.held_out_summary(rows, prof)
        assert math.isnan(s.loc[0, "ttft_in_interval"]) and s.loc[0, "interval_pass"] is None


def test_describe_says_the_share_or_that_there_is_none():
    split = held_out.Split(None, (), "B", ("r",), profile_path="p.yaml")
    rows = checks("pd", [0.1] * 5, [0.07, 0.085, 0.1, 0.12, 0.13])
    text = held_out.describe(split, held_out.held_out_summary(rows, profile(HELD)))
    assert "the profile's 80% interval held 60.0% of the turns (FAIL)" in text
    assert "the 80% interval holding 70%-90% of the turns" in text
    bare = held_out.describe(split, held_out.held_out_summary(rows, profile(None)))
    assert "no 80% interval (the profile carries no held-out errors)" in bare
    rerun = held_out.Split("A", ("a",), "B", ("r",), rerun=True)
    assert "80% interval" not in held_out.describe(rerun, held_out.held_out_summary(rows)).split("\n", 2)[2]


def test_run_errors_per_run_by_hand():
    a = checks("pd", [0.1, 0.2, 0.3], [0.2, 0.2, 0.2]).assign(checked_run_id="a")   # errors 50%, 0%, 50%
    b = checks("pd", [0.1, 0.1], [0.1, 0.2]).assign(checked_run_id="b")              # errors 0%, 50%
    failed = checks("pd", [0.1], [0.1]).assign(checked_run_id="c", status="failed")
    e = held_out.run_errors(pd.concat([a, b, failed], ignore_index=True)).set_index("checked_run_id")
    assert list(e.index) == ["a", "b"]
    assert e.loc["a", "ttft_mare"] == pytest.approx(0.5) and e.loc["b", "ttft_mare"] == pytest.approx(0.25)
    # p90 forecast (numpy linear): a: 0.28 over 0.2 measured -> +40%; b: 0.1 over 0.19 -> -47.4%
    assert e.loc["a", "p90_ttft_error"] == pytest.approx(0.28 / 0.2 - 1)
    assert e.loc["b", "p90_ttft_error"] == pytest.approx(0.1 / 0.19 - 1)


def test_describe_names_the_runs_without_a_speed_probe():
    split = held_out.Split(None, (), "B", ("a", "b"), profile_path="p.yaml")
    rows = pd.concat([checks("pd", [0.1], [0.1]).assign(checked_run_id="a", speed_factor=1.5),
                      checks("pd", [0.1], [0.1]).assign(checked_run_id="b", speed_factor=float("nan"))],
                     ignore_index=True)
    text = held_out.describe(split, held_out.held_out_summary(rows), rows)
    assert ("1 checked run(s) have no speed probe, so their forecasts are at the profile's own speed, not the "
            "run's (b)") in text
    probed = rows.assign(speed_factor=2.0)
    assert "no speed probe" not in held_out.describe(split, held_out.held_out_summary(probed), probed)
