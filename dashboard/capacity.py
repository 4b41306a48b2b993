"""The capacity ramp's answer: the load at which holding KV on D starts to cost capacity (the
*crossing*), and the latency reuse buys below it. Pure functions over
``dashboard.capacity_queries.capacity_steps`` rows of one ramp.

Crossing: the smallest load step (concurrent sessions) at which the treatment (``pd-bidir``,
D holds KV between turns) has a goodput below the baseline's (``pd``) by more than ``tolerance``
(relative), or a TTFT p90 above the baseline's by more than ``tolerance``. The tolerance keeps
noise at light load (where both modes serve every turn within the SLO) from reading as a
crossing; it is 5% by default and stated with the answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

BASELINE = "pd"
TREATMENT = "pd-bidir"
#: Relative margin a step must exceed to count as a crossing (0.05: 5%).
DEFAULT_TOLERANCE = 0.05


@dataclass(frozen=True)
class StepPair:
    """One load step measured in both modes: ``users`` (concurrent sessions), goodput (turns/s)
    and TTFT p50/p90 (seconds) of the baseline and the treatment."""

    users: int
    goodput_baseline: float
    goodput_treatment: float
    ttft_p50_baseline_s: float
    ttft_p50_treatment_s: float
    ttft_p90_baseline_s: float
    ttft_p90_treatment_s: float


@dataclass(frozen=True)
class Crossing:
    """The answer for one ramp: the compared ``pairs`` (ascending load), the crossing load
    ``users`` (None: none within the steps measured), why (``"goodput"``, ``"ttft_p90"`` or both,
    joined with " and "), and the ``tolerance`` used."""

    pairs: tuple[StepPair, ...]
    users: int | None
    reason: str | None
    tolerance: float

    @property
    def below(self) -> tuple[StepPair, ...]:
        """The steps below the crossing (every step when there is none)."""
        return tuple(p for p in self.pairs if self.users is None or p.users < self.users)


def step_pairs(steps: pd.DataFrame, baseline: str = BASELINE, treatment: str = TREATMENT) -> tuple[StepPair, ...]:
    """The load steps measured in both modes, ascending. ``steps``: rows of one ramp with
    ``mode``, ``users``, ``goodput_per_s``, ``ttft_p50_s``, ``ttft_p90_s``; a step missing in one
    mode, or without goodput or TTFT (no ok turn), is left out."""
    need = ["goodput_per_s", "ttft_p50_s", "ttft_p90_s"]
    b = steps[steps["mode"] == baseline].dropna(subset=need).set_index("users")
    t = steps[steps["mode"] == treatment].dropna(subset=need).set_index("users")
    return tuple(StepPair(int(u), float(b.at[u, "goodput_per_s"]), float(t.at[u, "goodput_per_s"]),
                          float(b.at[u, "ttft_p50_s"]), float(t.at[u, "ttft_p50_s"]),
                          float(b.at[u, "ttft_p90_s"]), float(t.at[u, "ttft_p90_s"]))
                 for u in sorted(set(b.index) & set(t.index)))


def find_crossing(steps: pd.DataFrame, tolerance: float = DEFAULT_TOLERANCE,
                  baseline: str = BASELINE, treatment: str = TREATMENT) -> Crossing:
    """The smallest step where the treatment's goodput < baseline's x (1 - tolerance) or its TTFT
    p90 > baseline's x (1 + tolerance); see the module doc. ``steps`` as for :func:`step_pairs`.

    Raises:
        ValueError: ``tolerance`` outside [0, 1).
    """
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be in [0, 1), got {tolerance}")
    pairs = step_pairs(steps, baseline, treatment)
    for p in pairs:
        why = []
        if p.goodput_treatment < p.goodput_baseline * (1 - tolerance):
            why.append("goodput")
        if p.ttft_p90_treatment_s > p.ttft_p90_baseline_s * (1 + tolerance):
            why.append("ttft_p90")
        if why:
            return Crossing(pairs, p.users, " and ".join(why), tolerance)
    return Crossing(pairs, None, None, tolerance)


def _ms(s: float) -> str:
    return f"{s * 1e3:,.0f} ms"


def crossing_words(c: Crossing, baseline: str = BASELINE, treatment: str = TREATMENT) -> str:
    """The answer in words (Markdown): where holding KV starts to cost capacity, and what reuse
    buys below that point (median TTFT, baseline vs treatment, per step)."""
    if not c.pairs:
        return f"No load step was measured in both `{baseline}` and `{treatment}`: nothing to compare."
    steps = ", ".join(str(p.users) for p in c.pairs)
    tol = f"{c.tolerance:.0%}"
    if c.users is None:
        head = (f"**No crossing within the steps measured** ({steps} concurrent sessions): `{treatment}`'s goodput "
                f"never fell below `{baseline}`'s, nor its TTFT p90 above it, by more than {tol}.")
    else:
        p = next(p for p in c.pairs if p.users == c.users)
        what = []
        if "goodput" in c.reason:
            what.append(f"goodput {p.goodput_treatment:.2f} vs {p.goodput_baseline:.2f} turns/s")
        if "ttft_p90" in c.reason:
            what.append(f"TTFT p90 {_ms(p.ttft_p90_treatment_s)} vs {_ms(p.ttft_p90_baseline_s)}")
        head = (f"**Holding KV starts to cost capacity at {c.users} concurrent sessions**: there `{treatment}` "
                f"falls behind `{baseline}` by more than {tol} ({'; '.join(what)}; steps measured: {steps}).")
    below = c.below
    if not below:
        return head + " No step below it was measured, so what reuse buys before then is not known."
    parts = [f"{p.users}: {_ms(p.ttft_p50_baseline_s)} → {_ms(p.ttft_p50_treatment_s)}" for p in below]
    where = "Below that point" if c.users is not None else "At every step"
    return (head + f" {where}, median TTFT `{baseline}` → `{treatment}` by concurrent sessions: "
            + "; ".join(parts) + ".")
