"""analysis.sample_size: the sessions-per-side forecast, checked by simulation and by hand.

Truth here is independent of the forecast's formula: synthetic runs drawn with a known speed-up
and a known per-session spread, their intervals from the headline's real bootstrap
(analysis.headline.median_ratio_ci), and the fraction of them that decide counted.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from analysis import headline, sample_size, speedup
from analysis.headline import Ratio

TURNS = 4  # later turns per session
BASE_S = 0.2  # baseline median TTFT, seconds
SESSION_SD = 0.25  # log-scale spread between sessions (a session's prompts are long or short)
TURN_SD = 0.15  # log-scale spread between turns of one session


def synthetic_side(rng: np.random.Generator, sessions: int, median_s: float) -> tuple[np.ndarray, np.ndarray]:
    """TTFTs (seconds) and session labels of `sessions` sessions of `TURNS` turns each."""
    session_effect = np.repeat(rng.normal(0, SESSION_SD, sessions), TURNS)
    ttft = median_s * np.exp(session_effect + rng.normal(0, TURN_SD, sessions * TURNS))
    return ttft, np.repeat(np.arange(sessions), TURNS)


def ci_of(rng: np.random.Generator, sessions: int, true_speedup: float, seed: int,
          n_resamples: int = 600) -> speedup.Speedup:
    """The headline's speed-up and CI of one synthetic pair of runs."""
    t, tg = synthetic_side(rng, sessions, BASE_S / true_speedup)
    b, bg = synthetic_side(rng, sessions, BASE_S)
    ratio, lo, hi = headline.median_ratio_ci(t, b, treatment_groups=tg, baseline_groups=bg,
                                             n_resamples=n_resamples, seed=seed)
    return speedup.from_ratio(ratio, lo, hi)


@pytest.mark.parametrize("true_speedup", [1.25, sample_size.SMALLER_EFFECT])
def test_recommended_count_decides_in_at_least_80_percent_of_reruns(true_speedup):
    rng = np.random.default_rng(7)
    # Pilot runs measure the spread (decided or not, it does not matter), each as the Overview
    # would (its bootstrap CI). One run's bootstrap of a median measures it roughly (the forecast
    # of a single small run is rough too, which sample_size.VARIANCE_UCL widens); the mean over 8
    # pilots of 50 sessions per side stands for the spread measured well, so this checks the
    # formula: its constants, the log scale and the 1/n scaling.
    pilots = [ci_of(rng, 50, true_speedup, seed=i, n_resamples=2000) for i in range(8)]
    var = float(np.mean([sample_size.per_session_variance(p, 50, 50) for p in pilots]))
    n = sample_size.sessions_for(true_speedup, var)
    assert n is not None and 4 <= n <= 400, n
    reruns = 200
    decided = sum(ci_of(rng, n, true_speedup, seed=i).ci_low > 1 for i in range(reruns))
    assert decided / reruns >= 0.80, (n, decided)
    # ... and it is not padded for safety: at a third of the count, most reruns stay undecided.
    fewer = max(2, n // 3)
    decided_fewer = sum(ci_of(rng, fewer, true_speedup, seed=i).ci_low > 1 for i in range(100))
    assert decided_fewer / 100 < 0.6, (fewer, decided_fewer)


def test_sessions_for_by_hand():
    # 2 var (z_0.975 + z_0.8)^2 / log(1.2)^2 with var 0.05: 2 * 0.05 * 7.849 / 0.03324 = 23.6 -> 24
    z = 1.959964 + 0.841621
    assert sample_size.sessions_for(1.2, 0.05) == math.ceil(2 * 0.05 * z**2 / math.log(1.2) ** 2) == 24
    assert sample_size.sessions_for(1 / 1.2, 0.05) == 24  # a slow-down is as hard to tell
    assert sample_size.sessions_for(1.0, 0.05) is None


def test_per_session_variance_from_a_known_interval():
    # A CI of exp(+-1.96 * 0.1) around 1 at 8 vs 8 sessions: se 0.1, variance 0.01 / (2/8) = 0.04,
    # at its upper 80% limit with 14 degrees of freedom: 0.04 * 14 / 9.4673 (chi2 table, 0.2 quantile).
    z = stats.norm.ppf(0.975)
    s = speedup.Speedup(1.0, math.exp(-z * 0.1), math.exp(z * 0.1))
    assert sample_size.per_session_variance(s, 8, 8) == pytest.approx(0.04 * 14 / 9.4673, rel=1e-4)
    with pytest.raises(ValueError):
        sample_size.per_session_variance(speedup.Speedup(1.0, math.nan, math.nan), 8, 8)


def test_forecast_only_for_undecided_headlines():
    def ratio(r, lo, hi):
        return Ratio("pd-bidir", "pd", "w", "text", 12, 12, r * 0.2, 0.2, r, lo, hi, 3, 3, 3, 3)

    assert headline.sessions_needed(ratio(0.5, 0.4, 0.6)) is None  # decided: faster
    undecided = ratio(0.85, 0.6, 1.2)
    need = headline.sessions_needed(undecided)
    assert need is not None and need.observed > 3 and need.smaller > need.observed  # 10% < 1/0.85 - 1
    assert need.sentence() in headline.verdict(undecided)
    assert "Forecast:" in need.sentence() and f"{need.observed:,} sessions per side" in need.sentence()


def test_a_forecast_of_an_effect_that_reads_one_shows_why_its_count_is_large():
    from analysis.sample_size import SessionsNeeded

    need = SessionsNeeded(observed_effect=1.003, observed=330011, smaller=588)
    assert need.sentence().startswith("Forecast: about 330,011 sessions per side would settle the observed 1.0030x, "
                                      "588 for a 10% speed-up (1.10x)")
    assert need.short() == "need ~330,011/side (588 for 1.10x)"
    assert "observed 0.85x" in SessionsNeeded(observed_effect=0.85, observed=66, smaller=205).sentence()


def test_cli_bottom_line_carries_the_forecast_of_an_undecided_comparison():
    from turnscope.commands.summaries import bottom_line_blocks

    undecided = Ratio("pd-bidir", "pd", "w", "text", 12, 12, 0.17, 0.2, 0.85, 0.6, 1.2, 3, 3, 3, 3)
    decided = Ratio("pd-bidir", "aggregated", "w", "text", 12, 12, 0.1, 0.2, 0.5, 0.4, 0.6, 3, 3, 3, 3)
    (u, d) = bottom_line_blocks([undecided, decided])
    need = headline.sessions_needed(undecided)
    # 1 / 0.85 = 1.18x; the CI 0.6-1.2 inverted is 0.83-1.67x.
    assert u[1] == "  speed-up 1.18x, 95% CI 0.83-1.67x: no clear difference"
    assert u[-1] == "  " + need.sentence()
    assert d[1] == "  speed-up 2.00x, 95% CI 1.67-2.50x: faster" and len(d) == 3  # no forecast once decided
