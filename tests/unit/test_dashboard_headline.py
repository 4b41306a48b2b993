"""analysis.headline: the ratio, its bootstrap CI, and the sentences the Overview prints."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from analysis import headline
from analysis.headline import Ratio


def test_median_ratio_and_ci():
    rng = np.random.default_rng(1)
    a = rng.lognormal(np.log(0.1), 0.2, 200)
    b = rng.lognormal(np.log(0.3), 0.2, 150)
    ratio, lo, hi = headline.median_ratio_ci(a, b)
    assert ratio == pytest.approx(np.median(a) / np.median(b))
    assert lo < ratio < hi < 1
    assert headline.median_ratio_ci(a, b) == (ratio, lo, hi)  # fixed seed: reproducible


def test_ci_needs_two_values_per_sample():
    ratio, lo, hi = headline.median_ratio_ci(np.array([0.2]), np.array([0.1, 0.3]))
    assert ratio == pytest.approx(1.0) and math.isnan(lo) and math.isnan(hi)
    with pytest.raises(ValueError):
        headline.median_ratio_ci(np.array([]), np.array([0.1]))


def _samples(rows):
    return pd.DataFrame(rows, columns=["mode", "workload", "history_mode", "ttft_s"])


def test_ratios_per_pair_and_workload():
    rows = []
    for wl in ("w1", "w2"):
        rows += [("pd-bidir", wl, "text", x) for x in (0.1, 0.2, 0.3)]
        rows += [("aggregated", wl, "text", x) for x in (0.4, 0.5, 0.6)]
    rows += [("pd-bidir-nocache", "w1", "text", 0.2)]  # no pd-nocache anywhere: no ratio
    rows += [("aggregated", "w3", "text", 0.2)]  # w3 has no pd-bidir: no ratio
    out = headline.headline_ratios(_samples(rows))
    assert [(r.treatment, r.baseline, r.workload) for r in out] == [
        ("pd-bidir", "aggregated", "w1"),
        ("pd-bidir", "aggregated", "w2"),
    ]
    assert out[0].ratio == pytest.approx(0.2 / 0.5)
    assert (out[0].n_treatment, out[0].n_baseline) == (3, 3)
    assert headline.headline_ratios(_samples([])) == []


def test_missing_workload_is_a_group_of_its_own():
    rows = [("pd-bidir", None, None, 0.1), ("aggregated", None, None, 0.2)]
    (r,) = headline.headline_ratios(_samples(rows))
    assert r.workload is None and r.ratio == pytest.approx(0.5)


def _ratio(ratio, lo, hi):
    return Ratio("pd-bidir", "aggregated", "w", "text", 10, 10, ratio * 0.2, 0.2, ratio, lo, hi)


@pytest.mark.parametrize(
    ("r", "phrase"),
    [
        (_ratio(0.5, 0.4, 0.6), "it pays off against this baseline"),
        (_ratio(1.5, 1.2, 1.8), "does not pay off against this baseline"),
        (_ratio(0.9, 0.7, 1.1), "No clear difference"),
        (_ratio(0.5, math.nan, math.nan), "no verdict yet"),
    ],
)
def test_verdict(r, phrase):
    text = headline.verdict(r)
    assert phrase in text and "pd-bidir" in text and "aggregated" in text


def test_missing_pairs():
    lines = headline.missing_pairs({"pd-bidir", "aggregated", "pd-bidir-nocache"})
    assert lines == [
        "pd-bidir vs pd: no ok turns after the first in `pd` among the selected runs.",
        "pd-bidir-nocache vs pd-nocache: no ok turns after the first in `pd-nocache` among the selected runs.",
    ]


def test_all_miss_warning_only_for_bidir_modes_without_hits():
    outcomes = pd.DataFrame(
        [
            ("pd-bidir", "hit", 5, 5),
            ("pd-bidir", "miss_first_turn", 2, 0),
            ("pd-bidir-nocache", "miss_first_turn", 2, 0),
            ("pd-bidir-nocache", "miss_no_handle_returned", 4, 4),
            ("pd", "miss_first_turn", 6, 4),  # one-way P/D never hits: not a warning
        ],
        columns=["mode", "reuse", "turns", "later_turns"],
    )
    (line,) = headline.all_miss_warnings(outcomes)
    assert "`pd-bidir-nocache`" in line and "miss_no_handle_returned (4)" in line


def test_session_bootstrap_is_wider_than_turn_bootstrap_for_correlated_turns():
    # 8 sessions per mode, 10 turns each; turns of a session share a session-level offset.
    rng = np.random.default_rng(7)
    sess_a = np.repeat(np.arange(8), 10)
    sess_b = np.repeat(np.arange(8), 10)
    a = 0.1 * np.exp(rng.normal(0, 0.4, 8))[sess_a] * np.exp(rng.normal(0, 0.02, 80))
    b = 0.3 * np.exp(rng.normal(0, 0.4, 8))[sess_b] * np.exp(rng.normal(0, 0.02, 80))
    r1, lo1, hi1 = headline.median_ratio_ci(a, b)
    r2, lo2, hi2 = headline.median_ratio_ci(a, b, treatment_groups=sess_a, baseline_groups=sess_b)
    assert r1 == r2 == pytest.approx(np.median(a) / np.median(b))
    assert hi2 - lo2 > 2 * (hi1 - lo1)
    assert lo2 <= r2 <= hi2


def test_session_bootstrap_needs_two_sessions():
    ratio, lo, hi = headline.median_ratio_ci(
        np.array([0.1, 0.2, 0.3]),
        np.array([0.2, 0.4]),
        treatment_groups=np.array(["s", "s", "s"]),
        baseline_groups=np.array(["x", "y"]),
    )
    assert ratio == pytest.approx(0.2 / 0.3) and math.isnan(lo) and math.isnan(hi)


def test_row_medians_match_numpys_nanmedian():
    """headline.row_medians against numpy's own nanmedian (rows longer and shorter than 600, odd and
    even counts of valid values, NaN padding anywhere)."""
    rng = np.random.default_rng(3)
    for shape in ((40, 7), (30, 1200)):
        x = rng.lognormal(size=shape)
        x[rng.random(shape) < 0.4] = np.nan
        x[:, 0] = 1.0  # at least one value per row
        assert np.allclose(headline.row_medians(x), np.nanmedian(x, axis=-1))
    assert headline.row_medians(np.array([[1.0, np.nan, 3.0, np.nan], [4.0, 2.0, 8.0, 6.0]])).tolist() == [2.0, 5.0]
