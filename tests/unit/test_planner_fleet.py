"""Fleet sizing (planner/fleet.py) on a traffic whose answer is known by hand.

Profile: tests/unit/test_planner_ledger.py's (c(x) = 1e-4 x, b0 10 ms, 2 GPUs per worker), D's KV
space not in it (D never limits). Traffic: one request a second for 240 s (windows of 30 s: whole cycles), each its own session of
25,000 tokens: 2.5 s of prefill each, nothing shared. Sessions go to P workers by session (the
proxy's default), so with P workers each gets every P-th request: one every P seconds, 2.5 s of work.
Two P are asked for 2.5 / 2 = 1.25x what they have (overloaded); three keep up with no wait at all
(a request every 3 s, 2.5 s each), so every TTFT is 0.01 + 2.5 = 2.51 s."""

from __future__ import annotations

import pytest

from loadgen.traces.agent_request import AgentRequest
from planner.fleet import Fleet, FleetLimits, cheapest, evaluate_fleet, size_fleet
from planner.simulate import PlanSettings, Traffic
from tests.unit.test_planner_ledger import profile


def steady() -> Traffic:
    return Traffic.of([AgentRequest("t", f"s{i:03d}", 0, float(i), 25_000, 0, 0, server_s=3.0) for i in range(241)])


def prof():
    return profile().model_copy(update={"host_kv_space_bytes": None, "prefill_kv_space_bytes": None})


def test_two_p_are_overloaded_three_keep_up_without_waiting():
    two = evaluate_fleet(steady(), prof(), PlanSettings(), "recompute", Fleet(2, 1), FleetLimits(3.0))
    assert two.overload is not None and two.overload.role == "prefill"
    assert two.overload.factor == pytest.approx(1.25, rel=0.02) and not two.meets_slo
    assert two.ttft_text().startswith("overloaded: P at 1.25x its capacity")
    three = evaluate_fleet(steady(), prof(), PlanSettings(), "recompute", Fleet(3, 1), FleetLimits(3.0))
    assert three.overload is None and three.meets_slo
    assert three.ttft_p90_s == pytest.approx(2.51) and three.ttft_p50_s == pytest.approx(2.51)
    assert three.gpus == 8   # (3 P + 1 D) x 2 GPUs per worker


def test_the_smallest_fleet_is_three_p():
    s = size_fleet(steady(), prof(), PlanSettings(), "pd", FleetLimits(3.0))
    assert s.best is not None and s.best.fleet == Fleet(3, 1)
    tried = [e.fleet.label() for e in s.searched]
    # out of 2.5x overload: ceil(2.5) = 3; then the fleets of 3 workers (1P 2D known to miss: 1 P is
    # overloaded by its work, which D does not change for pd; 2P 1D at 1.25x), none meets; of 4
    # workers none but 3P 1D is left to forecast (2P 2D: 2 P overloaded, as 1P 3D)
    assert tried == ["1P 1D", "3P 1D", "2P 1D"]
    assert cheapest([s], priced=False) is s.best


def test_an_slo_below_the_prompts_own_compute_has_no_fleet():
    s = size_fleet(steady(), prof(), PlanSettings(), "recompute", FleetLimits(2.0))
    # the bound by hand: 10 ms + 25,000 x 1e-4 s, nothing cached for recompute, on any fleet
    assert s.best is None and s.why_none.startswith("proven:") and "2,510.0 ms, over the SLO" in s.why_none
    assert s.bound_s == pytest.approx(2.51) and [e.fleet.label() for e in s.searched] == ["16P 16D"]


def test_the_limits_bound_the_search():
    s = size_fleet(steady(), prof(), PlanSettings(), "recompute", FleetLimits(3.0, max_prefill_workers=2))
    assert s.best is None and "overloaded: P at 1.25x its capacity at 2P 1D, the largest fleet allowed" in s.why_none


def test_a_bidirectional_forecast_stops_at_the_overload():
    """One P asked for 2.5x what it has: from the first request each waits 1.5 s longer than the one
    before, so the 22nd (index 21) is the first to wait more than an eighth of the 240 s horizon
    (30 s: 21 x 1.5 = 31.5 s); the sizing's forecast stops there, the full one names the same role."""
    from planner.ledger import forecast_strategy

    quick = evaluate_fleet(steady(), prof(), PlanSettings(), "pd-bidir", Fleet(1, 1), FleetLimits(3.0))
    assert quick.overload.role == "prefill" and "waited past a 30 s window" in quick.overload.why
    assert "the forecast stopped there" in quick.overload.why and not quick.meets_slo
    full = forecast_strategy(steady(), prof(), PlanSettings(), "pd-bidir")
    assert full.overload is not None and full.overload.role == "prefill" and not full.stopped
