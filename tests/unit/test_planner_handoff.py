"""P/D's hand-off as terms of their own (planner/profile.py ``handoff_wait_s`` and
``d_first_step_s``; planner/fit.py :func:`with_handoff`), checked by hand.

Profile: block 128, 4096 KV bytes/token, c(x) = 1e-4 x, b0 10 ms, pull 1 GB/s; hand-off: D waits
7 ms for P's KV and takes 15 ms for its first step."""

from __future__ import annotations

import numpy as np
import pytest

from loadgen.traces.agent_request import AgentRequest
from planner.check import forecast_terms
from planner.fit import with_handoff
from planner.profile import CostProfile, Sourced
from planner.simulate import PlanSettings, plan

SRC = {"source": "hand-made for the test"}


def profile(**extra) -> CostProfile:
    return CostProfile.model_validate({
        "name": "test", "block_size": 128, "kv_bytes_per_token": {"value": 4096} | SRC,
        "prefill_a1_s_per_token": {"value": 1e-4} | SRC, "b0_default_s": {"value": 0.01} | SRC,
        "pull_bandwidth_bytes_per_s": {"value": 1e9} | SRC} | extra)


HANDOFF = {"handoff_wait_s": {"value": 0.007} | SRC, "d_first_step_s": {"value": 0.015} | SRC}


def test_ttft_holds_the_handoff_in_pd_modes_only():
    p = profile(**HANDOFF)
    n, zero = np.array([1000]), np.zeros(1)
    # P/D: 10 ms b0 + 1e-4 x 1000 + 7 ms + 15 ms
    for mode in ("pd", "pd-nocache", "pd-bidir", "pd-bidir-nocache"):
        assert p.ttft_s(mode, n, zero, zero)[0] == pytest.approx(0.01 + 0.1 + 0.007 + 0.015)
    # aggregated: no hand-off
    assert p.ttft_s("aggregated", n, zero, zero)[0] == pytest.approx(0.01 + 0.1)
    # without the figures the hand-off is inside b0: nothing added
    assert profile().ttft_s("pd", n, zero, zero)[0] == pytest.approx(0.11)


def test_at_speed_scales_the_handoff_with_b0():
    p = profile(**HANDOFF).at_speed(2.0, "twice as slow")
    assert p.handoff_s("pd-bidir") == pytest.approx((0.014, 0.030))
    assert p.b0("pd-bidir") == pytest.approx(0.02)


def test_a_plan_and_its_split_carry_the_terms():
    reqs = [AgentRequest("t", "a", 0, 0.0, 1000, 32, 0, server_s=1.0),
            AgentRequest("t", "a", 1, 5.0, 1300, 32, 1031, server_s=1.0)]
    prof = profile(**HANDOFF)
    pl = plan(reqs, prof, PlanSettings(modes=("pd-bidir-nocache", "aggregated")))
    m = pl.modes["pd-bidir-nocache"]
    # second turn: 10 ms + 1e-4 x 269 + 1031 x 4096 / 1e9 + 7 ms + 15 ms
    assert m.ttft_s[1] == pytest.approx(0.01 + 0.0269 + 0.004222976 + 0.022)
    terms = forecast_terms(pl.traffic, m, prof, pl.settings)
    assert list(terms["handoff_wait"]) == pytest.approx([0.007, 0.007])
    assert list(terms["d_first_step"]) == pytest.approx([0.015, 0.015])
    parts = terms[["compute", "pull", "queue_p", "wait_d", "handoff_wait", "d_first_step", "fixed", "contention"]]
    assert list(parts.sum(axis=1)) == pytest.approx(list(terms["ttft"]))
    agg = forecast_terms(pl.traffic, pl.modes["aggregated"], prof, pl.settings)
    assert list(agg["handoff_wait"]) == [0, 0] and list(agg["d_first_step"]) == [0, 0]
    # a profile that keeps the hand-off in b0: the terms are not known apart (NaN), the TTFT the same
    plain = profile()
    pl0 = plan(reqs, plain, PlanSettings(modes=("pd-bidir-nocache",)))
    t0 = forecast_terms(pl0.traffic, pl0.modes["pd-bidir-nocache"], plain, pl0.settings)
    assert t0["handoff_wait"].isna().all() and t0["d_first_step"].isna().all()


def test_with_handoff_takes_the_terms_out_of_pd_b0_only():
    prof = profile(b0_s={"aggregated": {"value": 0.012} | SRC, "pd-nocache": {"value": 0.026} | SRC,
                         "pd-bidir-nocache": {"value": 0.018} | SRC},
                   b0_default_s={"value": 0.026} | SRC)
    terms = {"handoff_wait_s": Sourced(value=0.008, source="measured"),
             "d_first_step_s": Sourced(value=0.012, source="measured")}
    out = with_handoff(prof, terms)
    assert out.b0("aggregated") == pytest.approx(0.012)
    assert out.b0("pd-nocache") == pytest.approx(0.006)          # 26 - 8 - 12 ms
    assert out.b0("pd-bidir-nocache") == 0.0                      # 18 - 20 < 0: kept at 0, said so
    assert "kept at 0" in out.b0_s["pd-bidir-nocache"].source
    assert out.b0_default_s.value == pytest.approx(0.006)
    # the P/D TTFT of a b0 the terms did not exceed is unchanged by the split
    n, z = np.array([500]), np.zeros(1)
    assert out.ttft_s("pd-nocache", n, z, z)[0] == pytest.approx(prof.ttft_s("pd-nocache", n, z, z)[0])
    assert with_handoff(prof, {}) is prof


def test_probe_factors_scale_the_curve_and_attention_over_a_prefix():
    from planner.fit import on_run_speed, probe_factors
    prof = profile(prefill_a2_s_per_token2={"value": 1e-8} | SRC, probe_ttft_s={"value": 0.05} | SRC, **HANDOFF)
    # the curve's c(2048) - c(256) = 1e-4 x 1792 + 1e-8 x (2048^2 - 256^2) = 0.1792 + 0.04128768;
    # a run 1.5x slower there; its cached-prefix probe (2048 cached + 256 new, less 256 from scratch)
    # 2x the curve's attention over the prefix, 1e-8 x (2304^2 - 2048^2 - 256^2) = 1e-8 x 2^20
    compute, cached = 1.5 * (0.1792 + 0.04128768), 2 * 1e-8 * 2**20
    assert probe_factors(prof, "pd", compute, cached) == pytest.approx((1.5, 2.0))
    assert probe_factors(prof, "pd", compute, None) == pytest.approx((1.5, None))
    run, factor = on_run_speed(prof, 0.1, compute, "pd", cached)
    assert factor == pytest.approx(2.0)                                   # the short probe: b0
    assert run.prefill_a1_s_per_token.value == pytest.approx(1.5e-4)
    assert run.prefill_a2_s_per_token2.value == pytest.approx(1.5e-8)
    assert run.b0("pd") == pytest.approx(0.02)
    # the hand-off is engine steps on D: by the compute factor, 7 and 15 ms x 1.5
    assert run.handoff_s("pd") == pytest.approx((0.0105, 0.0225))
    # 300 new tokens on 1,000 cached: 1.5 x (1e-4 x 300 + 1e-8 x 300^2) + 2 x 1e-8 x 2 x 1000 x 300
    assert run.prefill_compute_s("pd", np.array([1300]), np.array([1000]))[0] == pytest.approx(
        1.5 * (0.03 + 0.0009) + 0.012)
    # from scratch: the curve alone, 1.5 x c(1300)
    assert run.prefill_compute_s("pd", np.array([1300]), np.array([0]))[0] == pytest.approx(1.5 * (0.13 + 0.0169))


def test_a_step_on_a_prefix_costs_its_own_term():
    from planner.fit import on_run_speed, probe_factors
    prof = profile(prefill_a2_s_per_token2={"value": 1e-8} | SRC, probe_ttft_s={"value": 0.05} | SRC,
                   prefix_step_s={"value": 0.01} | SRC, render_s_per_token={"value": 2e-6} | SRC, **HANDOFF)
    # 300 new tokens on 1,000 cached: 1e-4 x 300 + 1e-8 x (1300^2 - 1000^2) + 10 ms = 0.03 + 0.0069 + 0.01;
    # from scratch (cached 0) or nothing new (cached = n): no prefix step
    n, cached = np.array([1300, 1300, 1300]), np.array([1000, 0, 1300])
    assert list(prof.prefill_compute_s("pd", n, cached)) == pytest.approx([0.0469, 0.13 + 0.0169, 0.0])
    z = np.zeros(3)
    assert prof.ttft_s("pd", n, cached, z)[0] == pytest.approx(0.01 + 0.022 + 0.0469)
    # a run 2x slower on the short probe (fixed costs), 1.5x on the compute probe; its cached-prefix
    # probe holds the prefix step at the short probe's factor: 2 x 0.01 + 3 x 1e-8 x 2^20
    compute = 1.5 * (0.1792 + 0.04128768)
    cached_probe = 2 * 0.01 + 3 * 1e-8 * 2**20
    assert probe_factors(prof, "pd", compute, cached_probe, 2.0) == pytest.approx((1.5, 3.0))
    run, factor = on_run_speed(prof, 0.1, compute, "pd", cached_probe)
    assert factor == pytest.approx(2.0)
    assert run.prefix_step_s.value == pytest.approx(0.02)
    assert run.render_s_per_token.value == pytest.approx(3e-6)            # tokenizer work: the compute factor
    # 300 new on 1,000 cached on that run: 1.5 x (0.03 + 0.0009) + 3 x 2 x 1e-8 x 1000 x 300 + 20 ms
    assert run.prefill_compute_s("pd", np.array([1300]), np.array([1000]))[0] == pytest.approx(
        0.04635 + 0.018 + 0.02)


def test_decode_step_factors_put_each_run_on_the_fits_decode_step():
    import pandas as pd

    from planner.fit import decode_step_factors
    turns = pd.DataFrame({"run_id": ["a", "a", "a", "b", "b"], "status": ["ok", "ok", "failed", "ok", "ok"],
                          "tpot_s": [0.010, 0.014, 0.100, 0.005, np.nan]})
    # run a: median TPOT of its ok turns 12 ms over a 6 ms step; run b: 5 ms (its NaN left out)
    got = decode_step_factors(turns, Sourced(value=0.006, source="test"))
    assert got == pytest.approx({"a": 2.0, "b": 5 / 6})
    assert decode_step_factors(turns, None) == {}


def test_the_path_probe_measures_b0_on_the_run():
    """The path probe (256 fresh tokens through the run's proxy) less the forecast of the rest of that
    request (its compute from scratch and the hand-off, on the run's speed) is the mode's b0 there."""
    from planner.fit import on_run_speed
    prof = profile(prefill_a2_s_per_token2={"value": 1e-8} | SRC, probe_ttft_s={"value": 0.05} | SRC, **HANDOFF)
    compute = 1.5 * (0.1792 + 0.04128768)            # the curve 1.5x slower (the test above)
    # on that run c(256) = 1.5 x (1e-4 x 256 + 1e-8 x 256^2) = 0.03938304 and the hand-off
    # 1.5 x (7 + 15) ms = 0.033; a path probe of 0.1 s leaves 0.1 - 0.03938304 - 0.033 for b0
    run, factor = on_run_speed(prof, 0.1, compute, "pd", None, 0.1)
    assert factor == pytest.approx(2.0)                                   # the short probe still scales the rest
    assert run.b0("pd") == pytest.approx(0.1 - 0.03938304 - 0.033)
    assert "path probe" in run.b0_s["pd"].source
    assert run.b0("pd-nocache") == pytest.approx(0.02)                    # other modes: the short probe's ratio
    # the forecast of the probe's own request is the probe: b0 + c(256) + hand-off
    assert run.ttft_s("pd", np.array([256]), np.zeros(1), np.zeros(1))[0] == pytest.approx(0.1)
    # aggregated: no hand-off to take out; the aggregated worker's curve (here P's: the profile has no own)
    agg, _ = on_run_speed(prof, 0.1, compute, "aggregated", None, 0.06)
    assert agg.b0("aggregated") == pytest.approx(0.06 - 0.03938304)
    # a probe the rest exceeds (noise) leaves the short probe's ratio; no probe, the same
    for path in (0.05, None):
        run, _ = on_run_speed(prof, 0.1, compute, "pd", None, path)
        assert run.b0("pd") == pytest.approx(0.02)


def test_the_pull_latency_is_a_fixed_cost_of_each_pull():
    """``pull_latency_s`` (P's wait for an async pull beyond its bytes) on every request that pulls,
    nothing on one that does not, and put on a run's speed by the short probe, as b0 is."""
    from planner.fit import on_run_speed
    prof = profile(probe_ttft_s={"value": 0.05} | SRC, pull_latency_s={"value": 0.006} | SRC)
    # 1,000 tokens of 4,096 bytes at 1e9 bytes/s: 4.096 ms, plus the 6 ms latency; no pull, nothing
    assert list(prof.pull_s(np.array([1000, 0]))) == pytest.approx([0.010096, 0.0])
    run, factor = on_run_speed(prof, 0.1, None, "pd-bidir")              # the short probe reads 2x
    assert factor == pytest.approx(2.0)
    assert list(run.pull_s(np.array([1000, 0]))) == pytest.approx([0.016096, 0.0])   # the bytes' term unchanged
