"""Forecast intervals from held-out errors (planner/intervals.py), the frontier's rows that
matter and the interval wording (analysis/plan_check.py): hand-made inputs, hand-computed outputs."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from analysis.plan_check import frontier_highlights, with_interval
from planner import intervals
from planner.profile import CostProfile, HeldOutErrors, Sourced


def profile(held_out: HeldOutErrors | None) -> CostProfile:
    one = Sourced(value=1.0, source="test")
    return CostProfile(name="t", block_size=16, kv_bytes_per_token=one, prefill_a1_s_per_token=one,
                       b0_default_s=one, pull_bandwidth_bytes_per_s=one, held_out=held_out)


HELD = HeldOutErrors(split="fitted on A; checked on B", runs=2, turns=10,
                     ttft_ratio={"pd": (0.9, 1.2), "pd-bidir": (0.8, 1.1)},
                     hit_rate_error={"pd-bidir": (-0.05, 0.02)})


def test_ttft_and_speedup_intervals():
    p = profile(HELD)
    assert intervals.ttft_interval(p, "pd", 0.5) == pytest.approx((0.45, 0.6))
    # 2.0 x 0.9 / 1.1 and 2.0 x 1.2 / 0.8
    assert intervals.speedup_interval(p, "pd-bidir", "pd", 2.0) == pytest.approx((1.636363, 3.0), rel=1e-5)


def test_hit_rate_interval_is_clipped():
    p = profile(HELD)
    assert intervals.hit_rate_interval(p, "pd-bidir", 0.5) == pytest.approx((0.45, 0.52))
    assert intervals.hit_rate_interval(p, "pd-bidir", 0.99) == pytest.approx((0.94, 1.0))


def test_no_held_out_errors_no_interval():
    for p, mode in ((profile(None), "pd"), (profile(HELD), "aggregated")):
        assert all(math.isnan(x) for x in intervals.ttft_interval(p, mode, 0.5))
        assert all(math.isnan(x) for x in intervals.hit_rate_interval(p, mode, 0.5))
    assert all(math.isnan(x) for x in intervals.speedup_interval(profile(HELD), "pd-bidir", "aggregated", 2.0))
    assert with_interval("1.80x", math.nan, math.nan, str, "x") == "1.80x (no held-out interval)"
    assert with_interval("1.80x", 1.5, 2.2, lambda x: f"{x:.2f}", "x") == "1.80x (80% interval 1.50-2.20x)"


def test_frontier_highlights_keep_current_best_and_changes():
    # TTLs 60 / 120 / 240 at spaces 1 and 2 (current: 120 s, space 1); hit rate rises with TTL at space 1
    fr = pd.DataFrame({"mode": "pd-bidir", "decoder_kv_blocks_ttl_s": [60.0, 120.0, 240.0, 60.0, 120.0, 240.0],
                       "decode_kv_space_bytes": [1.0, 1.0, 1.0, 2.0, 2.0, 2.0],
                       "current": [False, True, False, False, False, False],
                       "hit_rate": [0.5, 0.6, 0.6, 0.5, 0.7, 0.7], "held_gib_s": [1.0, 2.0, 3.0, 1.0, 2.5, 4.0]})
    hl = frontier_highlights(fr)
    got = {(r.decoder_kv_blocks_ttl_s, r.decode_kv_space_bytes): r.why for r in hl.itertuples()}
    # 120 s / space 1: current and where the hit rate changes along the TTL (0.5 -> 0.6); 240 s adds
    # nothing; 120 s / space 2: the best (0.7, fewer GiB-s than 240 s) and the change along the space
    assert got == {(120.0, 1.0): "current; hit rate changes (TTL)",
                   (120.0, 2.0): "best hit rate; hit rate changes (D space)"}
    assert len(fr) == 6 and np.isclose(hl["hit_rate"], [0.6, 0.7]).all()
