"""How many sessions per side a comparison needs before its confidence interval decides (a forecast).

From the measured spread of a speed-up (its bootstrap interval over whole sessions,
``analysis.headline``), the number of sessions per side at which a new run's 95% CI would
exclude 1 with probability `POWER`, for the observed effect and for a stated smaller one
(`SMALLER_EFFECT`, a 10% speed-up).

Method (the two-sample sample-size formula for a difference of means with equal allocation,
Chow, Shao & Wang, *Sample Size Calculations in Clinical Research*, 2nd ed., 2008, section 3.2.1,
``n = 2 sigma^2 (z_{1-alpha/2} + z_{1-beta})^2 / delta^2`` per group), applied on the log scale,
where a speed-up is a difference ``log TTFT(baseline) - log TTFT(treatment)``:

* the standard error of the log speed-up from the percentile interval,
  ``se = (log ci_high - log ci_low) / (2 z_{1-alpha/2})``;
* the variance one session contributes, ``sigma^2 = se^2 / (1/n_t + 1/n_b)`` with n_t, n_b the
  sessions the bootstrap saw (whole sessions are the independent units), taken at its upper 80%
  confidence limit (`VARIANCE_UCL`, Browne 1995): a run of few sessions measures its spread
  roughly, and the forecast grows with that uncertainty;
* ``delta = |log(speed-up)|`` for the effect to detect.

It assumes the spread per session stays what it was (same workload, same concurrency) and that
the standard error shrinks as ``1/sqrt(n)``; tests/unit/test_sample_size.py checks the count by
simulation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scipy import stats

from analysis.speedup import Speedup

#: Probability that a rerun at the recommended count decides (the CI excludes 1).
POWER = 0.8
#: The stated smaller effect also quoted: a 10% speed-up.
SMALLER_EFFECT = 1.10
#: The measured variance is replaced by its upper one-sided confidence limit at this level
#: (``df s^2 / chi2_{1-VARIANCE_UCL, df}``, df = sessions - 2), so that a spread under-measured by
#: chance does not forecast too few sessions (Browne, "On the use of a pilot sample for sample size
#: determination", Statistics in Medicine 14:1933-1940, 1995).
VARIANCE_UCL = 0.8


def per_session_variance(s: Speedup, sessions_treatment: int, sessions_baseline: int,
                         confidence: float = 0.95) -> float:
    """The variance of the log speed-up one session per side contributes (dimensionless), at its
    upper `VARIANCE_UCL` confidence limit.

    `s` has a CI (percentile bootstrap at `confidence` over whole sessions); the session counts
    are those the bootstrap resampled. Raises ValueError without a CI or with fewer than 2
    sessions on a side.
    """
    if not s.has_ci or min(sessions_treatment, sessions_baseline) < 2:
        raise ValueError("per_session_variance needs a confidence interval and >= 2 sessions per side")
    z = stats.norm.ppf(0.5 + confidence / 2)
    se = (math.log(s.ci_high) - math.log(s.ci_low)) / (2 * z)
    measured = se**2 / (1 / sessions_treatment + 1 / sessions_baseline)
    df = sessions_treatment + sessions_baseline - 2
    return measured * df / stats.chi2.ppf(1 - VARIANCE_UCL, df)


def sessions_for(effect: float, variance: float, confidence: float = 0.95, power: float = POWER) -> int | None:
    """Sessions per side for a 95% CI to exclude 1 with probability `power` when the true
    speed-up is `effect` (dimensionless, > 0) and one session contributes `variance` (log scale).

    ``ceil(2 variance (z_{1-alpha/2} + z_power)^2 / log(effect)^2)``, at least 2; None when
    `effect` is 1 (no difference can be told from none).
    """
    delta = abs(math.log(effect))
    if delta == 0:
        return None
    z = stats.norm.ppf(0.5 + confidence / 2) + stats.norm.ppf(power)
    return max(2, math.ceil(2 * variance * z**2 / delta**2))


@dataclass(frozen=True)
class SessionsNeeded:
    """Forecast sessions per side: for the observed speed-up and for `SMALLER_EFFECT`; None where
    the effect is exactly 1."""

    observed_effect: float
    observed: int | None
    smaller: int | None
    smaller_effect: float = SMALLER_EFFECT

    def sentence(self) -> str:
        """One line for a page or the CLI."""
        # a speed-up that reads 1.00x gets more digits, so a count in the hundreds of thousands says why
        shown = f"{self.observed_effect:.2f}x" if round(self.observed_effect, 2) != 1 else f"{self.observed_effect:.4f}x"
        obs = (
            f"about {self.observed:,} sessions per side would settle the observed {shown}"
            if self.observed is not None
            else "the observed speed-up is exactly 1"
        )
        pct = round((self.smaller_effect - 1) * 100)
        return (
            f"Forecast: {obs}, {self.smaller:,} for a {pct}% speed-up ({self.smaller_effect:.2f}x) "
            f"(the 95% CI excluding 1 in {POWER:.0%} of reruns, at this run's spread)."
        )

    def short(self) -> str:
        """The counts alone, for a table cell: ``need ~N/side (M for 1.10x)``."""
        obs = "n/a" if self.observed is None else f"~{self.observed:,}"
        return f"need {obs}/side ({self.smaller:,} for {self.smaller_effect:.2f}x)"


def sessions_needed(s: Speedup, sessions_treatment: int, sessions_baseline: int,
                    smaller_effect: float = SMALLER_EFFECT) -> SessionsNeeded | None:
    """The forecast for an undecided comparison; None without a CI (fewer than 2 sessions)."""
    if not s.has_ci or min(sessions_treatment, sessions_baseline) < 2:
        return None
    var = per_session_variance(s, sessions_treatment, sessions_baseline)
    return SessionsNeeded(s.value, sessions_for(s.value, var), sessions_for(smaller_effect, var), smaller_effect)
