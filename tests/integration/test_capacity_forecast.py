"""The capacity ramp's crossing forecast (turnscope.conductor.capacity_forecast) over the hand-made ramp
of tests/capacity_store.py, with a profile whose forecast is known by hand: no prefill cost (a1 = 0,
so no queueing either), a pull that costs nothing (bandwidth 1e18 B/s), b0 0.2 s for ``pd`` and 0.6 s
for ``pd-bidir``, TPOT 0.02 s. So every forecast TTFT is its mode's b0: ``pd`` meets the SLO (TTFT
<= 0.5 s) and ``pd-bidir`` does not, but goodput is not forecast (a closed loop's span follows the
latencies): the forecast crossing is by TTFT p90 alone, 0.6 s > 0.2 s x 1.05 at every step, so the
first step (1 session), two steps below the measured one (4 sessions): MISSED. D is never full: the
ramp's D peaks at 60% measured, and its handles (at most a 10-turn session's KV) pin far less than
its 64 MiB (the pinned fraction; what is in use on D is not forecast: neither the profile nor the
fixture's scrapes give D's KV space, so D's queue is not modelled)."""

from __future__ import annotations

import pandas as pd
import pytest

from planner.profile import CostProfile
from store.writer import Store
from tests import capacity_store as cs
from turnscope.conductor import capacity_forecast as cf

SRC = {"source": "hand-made for the test"}


def profile() -> CostProfile:
    return CostProfile.model_validate({
        "name": "test", "block_size": 128, "kv_bytes_per_token": {"value": 4096} | SRC,
        "prefill_a1_s_per_token": {"value": 0.0} | SRC, "b0_default_s": {"value": 0.2} | SRC,
        "b0_s": {"pd": {"value": 0.2} | SRC, "pd-bidir": {"value": 0.6} | SRC},
        "pull_bandwidth_bytes_per_s": {"value": 1e18} | SRC, "decode_s_per_token": {"value": 0.02} | SRC})


@pytest.fixture(scope="module")
def ramp(tmp_path_factory):
    store = Store(cs.build(tmp_path_factory.mktemp("capstore")))
    ids = [cs.PLAIN] + [cs.run_id(m, u) for m in cs.MODES for u in cs.USERS]
    measured = cf.measured_steps(store, ids)
    return measured, cf.forecast_steps(store, measured, profile()), store


def test_each_step_is_forecast_from_its_own_turns(ramp):
    _, forecast, _ = ramp
    assert sorted(zip(forecast["mode"], forecast["users"], strict=True)) == sorted(
        (m, u) for m in cs.MODES for u in cs.USERS)   # the plain run is not a step
    for r in forecast.itertuples():
        b0 = 0.2 if r.mode == "pd" else 0.6
        assert (r.ttft_p50_s, r.ttft_p90_s) == (pytest.approx(b0), pytest.approx(b0)), (r.mode, r.users)
        assert r.goodput_per_s == 1.0   # not forecast: equal on both sides
        assert r.d_full_events == 0 and r.d_pinned_peak_fraction < cf.D_FULL_FRACTION
        # neither the profile nor the fixture's scrapes give D's KV space: its queue (and so what is in
        # use on D) is not modelled, and D full is not forecast
        assert r.d_in_use_peak_fraction != r.d_in_use_peak_fraction   # NaN


def test_crossing_forecast_and_measured_in_one_language(ramp):
    measured, forecast, _ = ramp
    [(cid, meas, fc)] = cf.crossings(measured, forecast)
    assert cid == cs.CAP_ID
    assert (meas.users, fc.users, fc.reason) == (cs.EXPECTED_CROSSING_USERS, 1, "ttft_p90")
    text = cf.describe(measured, forecast)
    # measured: goodput alone, the p90 within its noise (test_capacity_store.py works it out by hand)
    assert (f"capacity ramp {cs.CAP_ID} (steps 1, 2, 4 sessions): crossing measured at 4 sessions (goodput), "
            "forecast at 1 sessions (ttft_p90) (TTFT p90 only: goodput is not forecast) (MISSED); "
            "pd-bidir's D full (>= 95%) measured none within the steps, not forecast (D's KV space unknown)") in text
    assert ("4 sessions, pd-bidir: TTFT p90 900 ms measured, 600 ms forecast (no held-out interval); goodput "
            "0.60 turns/s measured") in text


def test_the_forecast_p90_carries_the_held_out_interval(ramp):
    """With held-out TTFT ratios (measured / forecast, 10th-90th percentile) of 0.9-1.5 for pd-bidir,
    its 600 ms p90 forecast reads 540-900 ms."""
    from planner.profile import HeldOutErrors

    measured, _, store = ramp
    held = HeldOutErrors(split="by hand", runs=1, turns=1, ttft_ratio={"pd-bidir": (0.9, 1.5), "pd": (1.0, 1.0)})
    prof = profile().model_copy(update={"held_out": held})
    text = cf.describe(measured, cf.forecast_steps(store, measured, prof))
    assert "4 sessions, pd-bidir: TTFT p90 900 ms measured, 600 ms forecast (80% interval 540-900 ms)" in text
    assert "4 sessions, pd: TTFT p90 400 ms measured, 200 ms forecast (80% interval 200-200 ms)" in text


@pytest.mark.parametrize("measured, forecast, ok", [(4, 4, True), (4, 2, True), (4, 1, False), (None, None, True),
                                                     (None, 4, False), (2, None, False)])
def test_within_one_step(measured, forecast, ok):
    assert cf.within_one_step([1, 2, 4, 6], measured, forecast) is ok


def test_plan_check_takes_the_ramps_intervals_from_the_profile_not_from_this_check(ramp, tmp_path):
    """``turnscope plan-check --profile``: the capacity lines' intervals are the profile file's held-out
    errors (pd-bidir 0.9-1.5: 540-900 ms around 600 ms), not the errors this check measures on the
    very steps it forecasts (measured / forecast 0.25-1.5 here, which would read 150-900 ms or so)."""
    import yaml
    from typer.testing import CliRunner

    from planner.profile import HeldOutErrors
    from turnscope.commands import app

    _, _, store = ramp
    held = HeldOutErrors(split="by hand", runs=1, turns=1, ttft_ratio={"pd-bidir": (0.9, 1.5), "pd": (1.0, 1.0)})
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(profile().model_copy(update={"held_out": held}).model_dump(mode="json",
                                                                                             exclude_none=True)))
    r = CliRunner().invoke(app, ["plan-check", "--profile", str(path), "--check-store", str(store.root)])
    assert r.exit_code == 0, r.output
    # the step's own MARE: 6 turns measured 0.15 s (error |0.6 - 0.15| / 0.15 = 300%), 4 at 0.9 s (33%): median 300%
    assert ("4 sessions, pd-bidir: TTFT p90 900 ms measured, 600 ms forecast (80% interval 540-900 ms, "
            "TTFT MARE 300.0%)") in r.output


def test_each_step_line_carries_its_own_mare(ramp):
    """A step's TTFT MARE is its own run's (the held-out check's per-run errors): two turns off by
    20% and 100% of the measured give a median of 60%."""
    from planner import held_out

    measured, forecast, _ = ramp
    step = measured[(measured["mode"] == "pd-bidir") & (measured["users"] == 4)]["run_id"].item()
    checks = pd.DataFrame({"checked_run_id": step, "mode": "pd-bidir", "turn_index": [0, 1], "status": "ok",
                           "predicted_ttft_s": [0.1, 0.2], "measured_ttft_s": [0.125, 0.1],
                           "recorded_outcome": "miss", "predicted_outcome": "miss", "outcome_match": True,
                           "recorded_pulled_tokens": 0, "predicted_pulled_tokens": 0})
    text = cf.describe(measured, forecast, run_errors=held_out.run_errors(checks))
    assert "4 sessions, pd-bidir: TTFT p90 900 ms measured, 600 ms forecast (no held-out interval, TTFT MARE 60.0%)" in text
    assert text.count("TTFT MARE") == 1   # the other steps were not checked
