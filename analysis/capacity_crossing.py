"""The capacity ramp's answer: the load at which holding KV on D starts to cost capacity (the
*crossing*), and the latency reuse buys below it. Pure functions over
``store.queries.capacity.capacity_steps`` rows of one ramp.

A step is *behind* when the treatment (``pd-bidir``, D holds KV between turns) has a goodput
below the baseline's (``pd``) by more than ``tolerance`` (relative), or a TTFT p90 above the
baseline's by more than ``tolerance`` and beyond the p90s' sampling noise: where the step's turns
are known (``ttft_ok_s``), the bootstrap 95% confidence interval of the ratio of the two p90s
(treatment / baseline; :func:`p90_ratio_interval`, ``scipy.stats.bootstrap``, percentile method,
turns resampled within each mode) must lie above 1. A p90 of 32 turns is about their third-slowest:
a 5.6% difference between two such p90s is within noise (docs/capacity.md). The crossing is the smallest load step (concurrent
sessions) from which the treatment is behind at that step and at every larger step measured:
where the curves cross for good. A step behind with a later step not behind is reported as
*transient* (on a shared 2-core machine one step's latency can be inflated by other work; the
first capacity run here had such a step at 1 session, docs/capacity.md). The tolerance keeps noise at
light load, where both modes serve every turn within the SLO, from reading as a crossing; it is
5% by default and stated with the answer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import stats

from core.modes import PD_BIDIR, one_way

#: The ramp's treatment (D holds KV between turns) and its one-way baseline, P's prefix cache on in both.
TREATMENT = PD_BIDIR
BASELINE = one_way(TREATMENT)
#: Relative margin a step must exceed to count as a crossing (0.05: 5%).
DEFAULT_TOLERANCE = 0.05
#: D counts as full at a step whose peak KV in use reaches this fraction of its KV space
#: (``vllm:kv_cache_usage_perc``; the planner's forecast of it: turnscope.conductor.capacity_forecast).
D_FULL_FRACTION = 0.95
#: Confidence of the p90 ratio's interval and its bootstrap resamples (seeded: the same answer on
#: every render).
P90_CONFIDENCE = 0.95
P90_RESAMPLES = 2000


@dataclass(frozen=True)
class StepPair:
    """One load step measured in both modes: ``users`` (concurrent sessions), goodput (turns/s)
    and TTFT p50/p90 (seconds) of the baseline and the treatment, and each mode's ok turns' TTFTs
    (seconds; empty where only the figures are known, e.g. a forecast)."""

    users: int
    goodput_baseline: float
    goodput_treatment: float
    ttft_p50_baseline_s: float
    ttft_p50_treatment_s: float
    ttft_p90_baseline_s: float
    ttft_p90_treatment_s: float
    ttft_baseline_s: tuple[float, ...] = ()
    ttft_treatment_s: tuple[float, ...] = ()


@dataclass(frozen=True)
class Crossing:
    """The answer for one ramp: the compared ``pairs`` (ascending load), the crossing load
    ``users`` (None: none within the steps measured), why (``"goodput"``, ``"ttft_p90"`` or both,
    joined with " and ") at that step, the ``tolerance`` used, the ``transient`` steps (users)
    below the crossing where the treatment was behind but not at every step after, and the
    ``within_noise`` steps whose TTFT p90 was higher by more than the tolerance but within the
    p90s' sampling noise (not counted as behind for that)."""

    pairs: tuple[StepPair, ...]
    users: int | None
    reason: str | None
    tolerance: float
    transient: tuple[int, ...] = ()
    within_noise: tuple[int, ...] = ()

    @property
    def below(self) -> tuple[StepPair, ...]:
        """The steps below the crossing (every step when there is none)."""
        return tuple(p for p in self.pairs if self.users is None or p.users < self.users)


def step_pairs(steps: pd.DataFrame, baseline: str = BASELINE, treatment: str = TREATMENT) -> tuple[StepPair, ...]:
    """The load steps measured in both modes, ascending. ``steps``: rows of one ramp with
    ``mode``, ``users``, ``goodput_per_s``, ``ttft_p50_s``, ``ttft_p90_s``; a step missing in one
    mode, or without goodput or TTFT (no ok turn), is left out. With a ``ttft_ok_s`` column (the
    step's ok TTFTs, seconds: ``store.queries.capacity.capacity_steps``) the pairs carry them."""
    need = ["goodput_per_s", "ttft_p50_s", "ttft_p90_s"]
    b = steps[steps["mode"] == baseline].dropna(subset=need).set_index("users")
    t = steps[steps["mode"] == treatment].dropna(subset=need).set_index("users")

    def turns(frame: pd.DataFrame, u) -> tuple[float, ...]:
        if "ttft_ok_s" not in frame.columns:
            return ()
        values = frame.at[u, "ttft_ok_s"]
        return () if values is None or np.ndim(values) == 0 else tuple(float(x) for x in values)

    return tuple(StepPair(int(u), float(b.at[u, "goodput_per_s"]), float(t.at[u, "goodput_per_s"]),
                          float(b.at[u, "ttft_p50_s"]), float(t.at[u, "ttft_p50_s"]),
                          float(b.at[u, "ttft_p90_s"]), float(t.at[u, "ttft_p90_s"]),
                          turns(b, u), turns(t, u))
                 for u in sorted(set(b.index) & set(t.index)))


def _p90_ratio(treatment: np.ndarray, baseline: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.quantile(treatment, 0.9, axis=axis) / np.quantile(baseline, 0.9, axis=axis)


@functools.lru_cache(maxsize=256)
def p90_ratio_interval(p: StepPair) -> tuple[float, float] | None:
    """The bootstrap :data:`P90_CONFIDENCE` interval of the treatment's TTFT p90 over the
    baseline's at step ``p`` (``scipy.stats.bootstrap``, percentile method, :data:`P90_RESAMPLES`
    resamples of each mode's turns, seeded); None without at least 2 turns in each mode. Cached per
    step (a frozen, hashable pair): :func:`find_crossing` asks twice, for the reason and the noise."""
    if len(p.ttft_baseline_s) < 2 or len(p.ttft_treatment_s) < 2:
        return None
    res = stats.bootstrap((np.asarray(p.ttft_treatment_s), np.asarray(p.ttft_baseline_s)), _p90_ratio,
                          vectorized=True, n_resamples=P90_RESAMPLES, confidence_level=P90_CONFIDENCE,
                          method="percentile", rng=np.random.default_rng(0))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def p90_beyond_noise(p: StepPair) -> bool:
    """Whether the treatment's TTFT p90 is above the baseline's beyond sampling noise at step
    ``p``: the :func:`p90_ratio_interval` lies above 1; True where the turns are not known (only
    the figures: nothing to resample)."""
    interval = p90_ratio_interval(p)
    return interval is None or interval[0] > 1.0


def find_crossing(steps: pd.DataFrame, tolerance: float = DEFAULT_TOLERANCE,
                  baseline: str = BASELINE, treatment: str = TREATMENT) -> Crossing:
    """The smallest step from which the treatment is behind at every larger step (behind: goodput
    < baseline's x (1 - tolerance) or TTFT p90 > baseline's x (1 + tolerance)); see the module doc.
    ``steps`` as for :func:`step_pairs`.

    Raises:
        ValueError: ``tolerance`` outside [0, 1).
    """
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be in [0, 1), got {tolerance}")
    pairs = step_pairs(steps, baseline, treatment)
    why = [behind(p, tolerance) for p in pairs]
    noise = tuple(p.users for p in pairs if _p90_over(p, tolerance) and not p90_beyond_noise(p))
    start = len(pairs)
    while start > 0 and why[start - 1]:
        start -= 1
    transient = tuple(p.users for p, w in zip(pairs[:start], why[:start], strict=True) if w)
    if start == len(pairs):
        return Crossing(pairs, None, None, tolerance, transient, noise)
    return Crossing(pairs, pairs[start].users, why[start], tolerance, transient, noise)


def _p90_over(p: StepPair, tolerance: float) -> bool:
    return p.ttft_p90_treatment_s > p.ttft_p90_baseline_s * (1 + tolerance)


def behind(p: StepPair, tolerance: float = DEFAULT_TOLERANCE) -> str | None:
    """Why the treatment is behind the baseline at step ``p`` (``"goodput"``, ``"ttft_p90"``, or
    both joined with " and "), or None when it is not. TTFT p90: higher by more than ``tolerance``
    and beyond sampling noise (:func:`p90_beyond_noise`)."""
    why = []
    if p.goodput_treatment < p.goodput_baseline * (1 - tolerance):
        why.append("goodput")
    if _p90_over(p, tolerance) and p90_beyond_noise(p):
        why.append("ttft_p90")
    return " and ".join(why) or None


def _ms(s: float) -> str:
    return f"{s * 1e3:,.0f} ms"


def crossing_words(c: Crossing, baseline: str = BASELINE, treatment: str = TREATMENT) -> str:
    """The answer in words (Markdown): where holding KV starts to cost capacity, and what reuse
    buys below that point (median TTFT, baseline vs treatment, per step)."""
    if not c.pairs:
        return f"No load step was measured in both `{baseline}` and `{treatment}`: nothing to compare."
    steps = ", ".join(str(p.users) for p in c.pairs)
    tol = f"{c.tolerance:.0%}"
    if c.users is None and not c.transient:
        head = (f"**No crossing within the steps measured** ({steps} concurrent sessions): `{treatment}`'s goodput "
                f"never fell below `{baseline}`'s, nor its TTFT p90 above it, by more than {tol}.")
    elif c.users is None:
        head = (f"**No crossing within the steps measured** ({steps} concurrent sessions): `{treatment}` did not "
                f"stay behind `{baseline}` (goodput lower or TTFT p90 higher by more than {tol}) up to the last step.")
    else:
        p = next(p for p in c.pairs if p.users == c.users)
        what = []
        if "goodput" in c.reason:
            what.append(f"goodput {p.goodput_treatment:.2f} vs {p.goodput_baseline:.2f} turns/s")
        if "ttft_p90" in c.reason:
            what.append(f"TTFT p90 {_ms(p.ttft_p90_treatment_s)} vs {_ms(p.ttft_p90_baseline_s)}")
        head = (f"**Holding KV starts to cost capacity at {c.users} concurrent sessions**: from there on "
                f"`{treatment}` stays behind `{baseline}` by more than {tol} (at {c.users}: {'; '.join(what)}; "
                f"steps measured: {steps}).")
        if c.users == c.pairs[-1].users:
            head += " That is the last step measured: a larger one would show whether it lasts."
    if c.transient:
        head += (f" It was behind at {', '.join(map(str, c.transient))} concurrent session(s) too, but not at "
                 "every step after (one step's noise, or a cost that did not last).")
    if c.within_noise:
        head += (f" At {', '.join(map(str, c.within_noise))} concurrent session(s) `{treatment}`'s TTFT p90 was "
                 f"higher by more than {tol}, but within the p90s' sampling noise (the {P90_CONFIDENCE:.0%} interval "
                 "of their ratio reaches 1): not counted as behind for it.")
    below = c.below
    if not below:
        return head + " No step below it was measured, so what reuse buys before then is not known."
    parts = [f"{p.users}: {_ms(p.ttft_p50_baseline_s)} → {_ms(p.ttft_p50_treatment_s)}" for p in below]
    where = "Below that point" if c.users is not None else "At every step"
    return (head + f" {where}, median TTFT `{baseline}` → `{treatment}` by concurrent sessions: "
            + "; ".join(parts) + ".")
