"""analysis.compare and analysis.headline's sampling cap: pure functions on hand-made samples."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from analysis import compare as compare_stats
from analysis import headline
from analysis.headline import Ratio


def _samples() -> pd.DataFrame:
    rows = []
    # Side A (reuse): later favourable turns fast, one resumed turn slow; side B uniform.
    for s in range(4):
        for t, kind, fav in ((0, "turn", False), (1, "turn", True), (2, "turn", True), (3, "resume", False)):
            a = {0: 0.30, 1: 0.10, 2: 0.12, 3: 0.40}[t] + 0.01 * s
            b = {0: 0.30, 1: 0.35, 2: 0.40, 3: 0.45}[t] + 0.01 * s
            case = "continued within TTL" if fav else ("continued after TTL" if kind == "turn" else kind)
            rows.append(("A", "ra", f"s{s}", t, kind, a, fav, case))
            rows.append(("B", "rb", f"s{s}", t, kind, b, fav, case))
    return pd.DataFrame(
        rows, columns=["side", "run_id", "session_id", "turn_index", "kind", "ttft_s", "favourable", "case_name"]
    )


def test_ratio_by_turn_medians_by_hand():
    out = compare_stats.ratio_by_turn(_samples()).set_index("turn_index")
    # turn 1: A = 0.10..0.13 (median 0.115), B = 0.35..0.38 (median 0.365)
    assert out.loc[1, "median_a_s"] == pytest.approx(0.115)
    assert out.loc[1, "ratio"] == pytest.approx(0.115 / 0.365)
    assert out.loc[0, "ratio"] == pytest.approx(1.0)
    assert (out["ci_low"] <= out["ratio"] + 1e-12).all() and (out["ratio"] <= out["ci_high"] + 1e-12).all()
    assert not out["ci_subsampled"].any()


def test_side_ratios_and_cases_by_hand():
    r = compare_stats.side_ratios(_samples(), "bidir", "agg")
    # favourable: turns 1 and 2 of 4 sessions each side
    fav_a = np.median([0.10 + 0.01 * s for s in range(4)] + [0.12 + 0.01 * s for s in range(4)])
    fav_b = np.median([0.35 + 0.01 * s for s in range(4)] + [0.40 + 0.01 * s for s in range(4)])
    assert r["favourable"].ratio == pytest.approx(fav_a / fav_b)
    assert r["favourable"].n_treatment == 8 and r["favourable"].sessions_treatment == 4
    assert r["unfavourable"].ratio == pytest.approx(np.median([0.40 + 0.01 * s for s in range(4)]) / 0.465)
    assert r["all"].n_baseline == 12
    cases = compare_stats.case_table(_samples())
    assert list(cases["case"].drop_duplicates()) == ["continued within TTL", "resume"]
    assert cases.set_index(["case", "side"]).loc[("resume", "A"), "turns"] == 4


def test_exact_stats_override_the_sample():
    stats = pd.DataFrame(
        [
            ("A", "later", "all", 1000, 100, 0.2),
            ("B", "later", "all", 900, 90, 0.4),
            ("A", "later", "favourable", 500, 100, 0.1),
            ("B", "later", "favourable", 450, 90, 0.4),
            ("A", "later", "unfavourable", 500, 100, 0.3),
            ("B", "later", "unfavourable", 450, 90, 0.4),
            ("A", "turn_index", "1", 100, 0, 0.05),
            ("B", "turn_index", "1", 100, 0, 0.50),
        ],
        columns=["side", "scope", "key", "turns", "sessions", "ttft_p50_s"],
    )
    r = compare_stats.side_ratios(_samples(), "a", "b", stats)
    assert r["all"].ratio == pytest.approx(0.5) and r["all"].n_treatment == 1000 and r["all"].sessions_baseline == 90
    assert r["all"].ci_subsampled  # the CI saw 4 sessions of 100
    by_turn = compare_stats.ratio_by_turn(_samples(), stats).set_index("turn_index")
    assert by_turn.loc[1, "ratio"] == pytest.approx(0.1) and by_turn.loc[1, "ci_subsampled"]


def _r(lo: float, hi: float, ratio: float = 0.5) -> Ratio:
    return Ratio("a", "b", None, None, 10, 10, 0.1, 0.2, ratio, lo, hi, 5, 5, 5, 5)


@pytest.mark.parametrize(
    "fav, unfav, bottom",
    [
        (_r(0.4, 0.6), _r(0.9, 1.1), "pays off against b on this traffic: faster where KV can be reused, no worse"),
        (_r(0.4, 0.6), _r(1.1, 1.3, 1.2), "helps continued turns but costs on the others"),
        (_r(1.1, 1.3, 1.2), _r(0.9, 1.1), "is slower than b even where KV could be reused"),
        (_r(0.9, 1.1, 1.0), _r(0.9, 1.1), "no clear gain from a over b"),
        (None, _r(0.9, 1.1), "no favourable turns on both sides"),
    ],
)
def test_verdict_bottom_lines(fav, unfav, bottom):
    lines = compare_stats.verdict({"all": _r(0.4, 0.6), "favourable": fav, "unfavourable": unfav}, 0.8)
    assert lines[-1].startswith("Bottom line:") and bottom in lines[-1], lines[-1]
    if "costs on the others" in bottom:
        assert "80% of a's later turns were favourable" in lines[-1]


def test_verdict_without_turns():
    assert compare_stats.verdict({"all": None, "favourable": None, "unfavourable": None}) == [
        "No turns after the first on both sides: nothing to compare yet."
    ]


def test_ci_groups_cap_by_hand():
    assert headline.ci_groups(100, 1000, None) == 100
    assert headline.ci_groups(100, 1000, 2000) == 100
    assert headline.ci_groups(100, 1000, 250) == 25  # 10 turns per session: 25 sessions hold 250
    assert headline.ci_groups(100, 1000, 5) == 2  # never fewer than 2


def test_capped_bootstrap_keeps_the_exact_ratio_and_widens_the_interval():
    rng = np.random.default_rng(3)
    a, b = rng.lognormal(np.log(0.1), 0.3, 4000), rng.lognormal(np.log(0.3), 0.3, 4000)
    full = headline.median_ratio_ci(a, b, n_resamples=500)
    capped = headline.median_ratio_ci(a, b, n_resamples=500, max_values=400)
    assert capped[0] == full[0] == pytest.approx(np.median(a) / np.median(b))
    assert capped[2] - capped[1] > full[2] - full[1]  # a tenth of the data: a wider interval
    assert capped == headline.median_ratio_ci(a, b, n_resamples=500, max_values=400)  # seeded
    assert not math.isnan(capped[1])


def test_compare_arms_split_a_mode_only_when_its_runs_differ_in_routing():
    runs = pd.DataFrame({
        "mode": ["pd", "pd", "pd-bidir", "pd-bidir", "aggregated"],
        "prefill_routing": ["round-robin", "session", "session", "session", None],
        "decode_routing": ["session", "session", "session", "session", None],
    })
    assert compare_stats.compare_arms(runs).tolist() == [
        "pd · P round-robin · D session", "pd · P session · D session", "pd-bidir", "pd-bidir", "aggregated"]
    # a run that recorded no routing next to one that did: kept apart, and said so
    mixed = pd.DataFrame({"mode": ["pd", "pd"], "prefill_routing": [None, "session"], "decode_routing": [None, "session"]})
    assert compare_stats.compare_arms(mixed).tolist() == ["pd · routing unknown", "pd · P session · D session"]
    assert compare_stats.routing_text(None, float("nan")) is None
    assert compare_stats.routing_text("prefix-aware", None) == "P prefix-aware · D ?"
