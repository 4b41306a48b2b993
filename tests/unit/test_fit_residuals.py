"""The cost fit on synthetic calibration points with known coefficients (planner/fit.py,
``fit_costs``): the coefficients come back, the residuals are 0 and the fitted range is the points'
range; and the residual summary (planner/fit_residuals.py) against hand computation."""

from __future__ import annotations

import datetime as dt

import numpy as np
import pandas as pd
import pytest

from planner.fit import fit_costs
from planner.fit_residuals import residuals_of
from planner.profile import CostProfile, Sourced

A1, A2 = 5e-4, 4e-8                  # P/D c(x)
G1, G2 = 1.5e-4, 2e-8                # the aggregated worker's c(x)
B0 = {"aggregated": 0.02, "pd-nocache": 0.2, "pd-bidir-nocache": 0.25}
KV, BW = 4096, 4.096e8               # pull: 1e-5 s per token
T0 = dt.datetime(2026, 12, 2, 10, 0, tzinfo=dt.UTC)


def c(x, a1=A1, a2=A2):
    return a1 * x + a2 * x * x


def test_hand_computed_points():
    # pd-nocache, 1,000 tokens from scratch: 0.2 + 0.5 + 0.04 = 0.74 s
    assert B0["pd-nocache"] + c(1000) == pytest.approx(0.74)
    # pd-bidir-nocache, turn 1 of a 4,096-token session (_turns): 4,096 + 16 + 128 = 4,240 tokens, 4,112
    # pulled (0.04112 s), 128 computed after them: c(4240) - c(4112) = 0.064 + 4e-8 (4240^2 - 4112^2) s
    assert c(4240) - c(4112) == pytest.approx(0.064 + 4e-8 * (4240 ** 2 - 4112 ** 2))


def _turns() -> pd.DataFrame:
    """Two-turn calibration sessions (16-token replies) at 128 ... 7,936 tokens in three modes, one
    request a minute (no queueing), TTFT exactly the model's: turn 0 a full prefill; turn 1 adds 128
    tokens after turn 0's prompt and reply, which pd-bidir-nocache pulls, the aggregated worker finds
    in its own cache (whole 128-token blocks) and pd-nocache computes again."""
    rows, t = [], 0
    for mode, b0 in B0.items():
        for p in (128, 256, 512, 1024, 2048, 4096, 7936):
            n1 = p + 16 + 128
            local1 = {"aggregated": (p + 16) // 128 * 128, "pd-nocache": 0, "pd-bidir-nocache": 0}[mode]
            pulled1 = p + 16 if mode == "pd-bidir-nocache" else 0
            for k, (n, local, pulled) in enumerate(((p, 0, 0), (n1, local1, pulled1))):
                a1, a2 = (G1, G2) if mode == "aggregated" else (A1, A2)
                ttft = b0 + c(n, a1, a2) - c(local + pulled, a1, a2) + pulled * KV / BW
                rows.append({"run_id": f"cal-{mode}", "mode": mode, "history_mode": "token_ids",
                             "session_id": f"s{p}", "turn_index": k, "sent_at": T0 + dt.timedelta(minutes=t),
                             "status": "ok", "ttft_s": ttft, "prompt_tokens": n, "reuse": None,
                             "reused_tokens": pulled, "local_tokens": local, "local_known": True})
                t += 1
    return pd.DataFrame(rows)


def test_fit_recovers_known_coefficients_with_zero_residuals_and_the_points_range():
    prof = CostProfile(name="t", block_size=128, kv_bytes_per_token=Sourced(value=KV, source="t"),
                       prefill_a1_s_per_token=Sourced(value=0, source="t"), b0_default_s=Sourced(value=0, source="t"),
                       pull_bandwidth_bytes_per_s=Sourced(value=BW, source="t"))
    fit = fit_costs(_turns(), prof)
    assert fit.a1_s == pytest.approx(A1, rel=1e-6) and fit.a2_s == pytest.approx(A2, rel=1e-5)
    assert fit.aggregated_a1_s == pytest.approx(G1, rel=1e-6) and fit.aggregated_a2_s == pytest.approx(G2, rel=1e-5)
    assert fit.b0_s == {m: pytest.approx(v, abs=1e-9) for m, v in B0.items()}
    r = fit.residuals
    assert set(r) == {"aggregated", "pd-nocache", "pd-bidir-nocache", "pd_prefill"}
    assert all(x.median_abs < 1e-6 and x.p90_abs < 1e-6 for x in r.values())
    # P/D turns: computed tokens from 128 (a pd-bidir-nocache turn 1: 128 after the pull) to 8,080
    # (pd-nocache's turn 1 at 7,936: 7,936 + 16 + 128); prompts 128 to 8,080; 28 turns
    assert (r["pd_prefill"].turns, r["pd_prefill"].computed_min, r["pd_prefill"].computed_max,
            r["pd_prefill"].prompt_min, r["pd_prefill"].prompt_max) == (28, 128, 8080, 128, 8080)
    # aggregated: turn 0 computes p (128 ... 7,936); turn 1 computes n1 - whole blocks of p + 16, 144 at
    # every p (p = 128: 272 - 128; p = 7,936: 8,080 - 7,936): 128 to 7,936
    assert (r["aggregated"].computed_min, r["aggregated"].computed_max) == (128, 7936)


def test_residual_summary_by_hand():
    r = residuals_of(np.array([0.1, -0.2, 0.05, 0.0]), np.array([10, 400, 30, 20]), np.array([50, 500, 60, 70]))
    # |r| sorted 0, 0.05, 0.1, 0.2: median 0.075; p90 at position 2.7: 0.1 + 0.7 x 0.1 = 0.17
    # signed sorted -0.2, 0, 0.05, 0.1: median 0.025
    assert (r.turns, r.median_abs, r.p90_abs, r.median_signed) == (4, pytest.approx(0.075), pytest.approx(0.17),
                                                                  pytest.approx(0.025))
    assert (r.computed_min, r.computed_max, r.prompt_min, r.prompt_max) == (10, 400, 50, 500)
    assert r.describe() == ("residuals over 4 turns: |relative TTFT error| median 7.5%, p90 17.0%, bias +2.5%; "
                            "fitted over 10-400 computed tokens (prompts 50-500): extrapolated outside")
    assert residuals_of(np.array([]), np.array([]), np.array([])) is None
