"""The compute probe's place in a forecast (planner/fit.py ``on_run_speed``,
planner/profile.py ``at_speed``): b0 scaled by the short probe, the prefill curves by the
compute probe over what the profile's own c(x) gives for the same tokens. Hand computations.

Profile (tests/unit/test_planner_simulate.py): c(x) = 1e-4 x, b0 10 ms; its probe 44 ms."""

from __future__ import annotations

import pytest

from planner.fit import on_run_speed
from tests.unit.test_planner_simulate import profile

SRC = {"source": "hand-made for the test"}


def with_probe():
    return profile(probe_ttft_s={"value": 0.044} | SRC)


def test_b0_follows_the_short_probe_and_c_the_compute_probe():
    # short probe 66 ms: 1.5x the profile's 44 ms; compute probe 358.4 ms for 2,048 - 256 tokens,
    # where the profile's c gives 1e-4 x 1,792 = 179.2 ms: 2x
    p, factor = on_run_speed(with_probe(), 0.066, 0.3584, "pd")
    assert factor == pytest.approx(1.5)
    assert p.b0("pd") == pytest.approx(0.015)                       # 10 ms x 1.5
    assert p.prefill_a1_s_per_token.value == pytest.approx(2e-4)    # 1e-4 x 2
    assert "compute probe" in p.prefill_a1_s_per_token.source and "speed probe" in p.b0_default_s.source
    # a TTFT of 1,000 fresh tokens: 15 ms + 200 ms
    assert float(p.ttft_s("pd", [1000], [0], [0])[0]) == pytest.approx(0.215)


def test_without_a_compute_probe_both_follow_the_short_probe():
    p, factor = on_run_speed(with_probe(), 0.066)
    assert factor == pytest.approx(1.5)
    assert (p.b0("pd"), p.prefill_a1_s_per_token.value) == (pytest.approx(0.015), pytest.approx(1.5e-4))


def test_the_aggregated_run_is_put_on_the_aggregated_workers_curve():
    # the aggregated worker's c(x) = 5e-5 x: 1,792 tokens give 89.6 ms; a compute probe of 179.2 ms is 2x
    prof = profile(probe_ttft_s={"value": 0.044} | SRC, aggregated_prefill_a1_s_per_token={"value": 5e-5} | SRC)
    p, _ = on_run_speed(prof, 0.044, 0.1792, "aggregated")
    assert p.aggregated_prefill_a1_s_per_token.value == pytest.approx(1e-4)
    assert p.prefill_a1_s_per_token.value == pytest.approx(2e-4)    # the same factor for every curve


def test_no_probe_at_all_leaves_the_profile_and_a_compute_probe_alone_scales_c():
    prof = with_probe()
    assert on_run_speed(prof, None) == (prof, None)
    p, factor = on_run_speed(profile(), None, 0.3584, "pd")           # a profile without a probe reference
    assert factor is None and p.b0("pd") == pytest.approx(0.01) and p.prefill_a1_s_per_token.value == pytest.approx(2e-4)
