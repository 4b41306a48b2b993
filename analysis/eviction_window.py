"""P's eviction ladder's answer (``turnscope capacity --prefill-kv-tokens``, docs/eviction.md): the
window of concurrent sessions in which holding a finished turn on D pays against the real baseline
(``pd``: P's own prefix cache on, now evicting), before D's own KV space runs out.

Per load step: the **speed-up** ``pd`` / ``pd-bidir`` of median TTFT over the ok turns from the
second of each session on (``turn_index >= 1``: the first has nothing to reuse), with its 95%
session-level bootstrap interval (:func:`analysis.headline.ratio_of`, the Overview's
headline ratio; shown as a speed-up, :mod:`analysis.speedup`), next to ``pd``'s P hit rate
(vLLM's ``prefix_cache_hits`` / ``prefix_cache_queries`` on P, view ``capacity_prefill_cache``).

* **Pays from**: the smallest step from which ``pd-bidir`` is faster at that step and at every
  larger one up to the crossing (the speed-up's interval above 1; :class:`Verdict` ``faster``).
* **D full**: the smallest step from which ``pd-bidir``'s D peaks at
  :data:`analysis.capacity_crossing.D_FULL_FRACTION` (95%) of its KV space or more at every
  larger step (``vllm:kv_cache_usage_perc``; a forecast: the planner's peak KV in use).
* **D runs out**: the capacity crossing (:func:`analysis.capacity_crossing.find_crossing`:
  from there on ``pd-bidir``'s goodput or TTFT p90 stays behind ``pd``'s).
* **The window**: the steps from "pays from" to below the crossing; none when it does not pay
  before the crossing (or at all).

A forecast has no interval: there a step pays when its speed-up exceeds 1 by more than the
crossing's tolerance (:data:`analysis.capacity_crossing.DEFAULT_TOLERANCE`, 5%).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from analysis import headline, speedup
from analysis.capacity_crossing import (
    BASELINE,
    D_FULL_FRACTION,
    DEFAULT_TOLERANCE,
    TREATMENT,
    Crossing,
    find_crossing,
)
from analysis.speedup import Verdict

#: Columns of :func:`step_speedups`.
COLUMNS = ("users", "speedup", "ci_low", "ci_high", "verdict", "median_baseline_s", "median_treatment_s",
           "turns_baseline", "turns_treatment", "p_hit_rate_baseline", "p_hit_rate_treatment", "pulled_tokens",
           "decode_kv_usage_max", "decode_preemptions")


def step_speedups(steps: pd.DataFrame, turns: pd.DataFrame, baseline: str = BASELINE,
                  treatment: str = TREATMENT) -> pd.DataFrame:
    """Per load step measured in both modes (ascending): :data:`COLUMNS`. ``steps``: one ramp's
    rows of ``store.queries.capacity.capacity_steps``; ``turns``: its
    ``store.queries.capacity.capacity_turns``. ``speedup`` = baseline median TTFT / treatment
    median TTFT (later ok turns, seconds), ``ci_low``/``ci_high`` its 95% interval (NaN with fewer
    than 2 sessions a side), ``verdict`` (:class:`analysis.speedup.Verdict`'s value);
    ``p_hit_rate_*`` each mode's P hit rate (0-1), ``pulled_tokens`` the treatment's tokens pulled
    from D, ``decode_kv_usage_max`` the treatment's D peak (0-1), ``decode_preemptions`` its D
    preemptions."""
    later = turns[(turns["status"] == "ok") & (turns["turn_index"] >= headline.MIN_TURN_INDEX)]
    rows = []
    by = steps.set_index(["mode", "users"])
    for u in sorted(set(steps.loc[steps["mode"] == baseline, "users"]) & set(steps.loc[steps["mode"] == treatment,
                                                                                      "users"])):
        b = later[(later["mode"] == baseline) & (later["users"] == u)]
        t = later[(later["mode"] == treatment) & (later["users"] == u)]
        r = headline.ratio_of(t, b, treatment_name=treatment, baseline_name=baseline)
        if r is None:
            continue
        s = speedup.of(r)
        tb, tt = by.loc[(baseline, u)], by.loc[(treatment, u)]
        rows.append({"users": int(u), "speedup": s.value, "ci_low": s.ci_low, "ci_high": s.ci_high,
                     "verdict": s.verdict.value, "median_baseline_s": r.median_baseline_s,
                     "median_treatment_s": r.median_treatment_s, "turns_baseline": r.n_baseline,
                     "turns_treatment": r.n_treatment, "p_hit_rate_baseline": _get(tb, "p_hit_rate"),
                     "p_hit_rate_treatment": _get(tt, "p_hit_rate"), "pulled_tokens": _get(tt, "pulled_tokens"),
                     "decode_kv_usage_max": _get(tt, "decode_kv_usage_max"),
                     "decode_preemptions": _get(tt, "decode_preemptions")})
    return pd.DataFrame(rows, columns=list(COLUMNS))


def _get(row: pd.Series, col: str) -> float:
    v = row.get(col) if col in row.index else None
    return math.nan if v is None or pd.isna(v) else float(v)


@dataclass(frozen=True)
class Window:
    """One ramp's window: ``pays_from`` (the smallest step, in concurrent sessions, from which the
    treatment is faster at every step up to the crossing; None: never), ``crossing`` (the capacity
    crossing, :class:`analysis.capacity_crossing.Crossing`), ``steps`` (the window's steps,
    ascending; empty: no window), ``speedups`` (:func:`step_speedups`' rows) and ``d_full_from``
    (the smallest step from which D is full at every larger step; None: not within the steps)."""

    pays_from: int | None
    crossing: Crossing
    steps: tuple[int, ...]
    speedups: pd.DataFrame
    d_full_from: int | None = None

    @property
    def ends_at(self) -> int | None:
        """The step where D's space runs out (the crossing), None when within the steps it does not."""
        return self.crossing.users


def _pays(row, forecast: bool, tolerance: float) -> bool:
    if forecast:
        return bool(row.speedup > 1 + tolerance)
    return row.verdict == Verdict.FASTER.value


def find_window(steps: pd.DataFrame, turns: pd.DataFrame | None = None, *, forecast: bool = False,
                tolerance: float = DEFAULT_TOLERANCE) -> Window:
    """The window of one ramp (see the module doc). Measured: ``turns`` gives the speed-ups and
    their intervals. ``forecast=True``: ``steps`` are forecast rows carrying ``speedup`` per step
    (:func:`turnscope.conductor.capacity_forecast.forecast_steps`' treatment rows with
    ``speedup``); a step pays when its speed-up exceeds ``1 + tolerance``."""
    crossing = find_crossing(steps, tolerance)
    if forecast:
        sp = (steps[steps["mode"] == TREATMENT][["users", "speedup"]].dropna().sort_values("users")
              .reset_index(drop=True))
    else:
        sp = step_speedups(steps, turns if turns is not None else pd.DataFrame(
            columns=["mode", "users", "status", "turn_index", "ttft_s", "run_id", "session_id"]))
    below = sp if crossing.users is None else sp[sp["users"] < crossing.users]
    pays = [_pays(r, forecast, tolerance) for r in below.itertuples()]
    start = len(pays)
    while start > 0 and pays[start - 1]:
        start -= 1
    users = tuple(int(u) for u in below["users"].iloc[start:])
    return Window(users[0] if users else None, crossing, users, sp, d_full_from(steps, forecast))


def d_full_from(steps: pd.DataFrame, forecast: bool = False) -> int | None:
    """The smallest step from which the treatment's D peak reaches
    :data:`analysis.capacity_crossing.D_FULL_FRACTION` of its KV space at every larger step
    (measured: ``decode_kv_usage_max``; forecast: ``d_in_use_peak_fraction``); None when the last
    step's D is not full."""
    col = "d_in_use_peak_fraction" if forecast else "decode_kv_usage_max"
    t = steps[steps["mode"] == TREATMENT].sort_values("users")
    if col not in t.columns or t.empty:
        return None
    full = [bool(v >= D_FULL_FRACTION) for v in t[col].fillna(0)]
    start = len(full)
    while start > 0 and full[start - 1]:
        start -= 1
    return None if start == len(full) else int(t["users"].iloc[start])


def _pct(v: float) -> str:
    return "n/a" if v is None or np.isnan(v) else f"{v:.0%}"


def window_words(w: Window) -> str:
    """The answer in words (Markdown): where holding pays, at which P hit rate, and where D runs out."""
    sp = w.speedups
    if sp.empty:
        return f"No load step was measured in both `{BASELINE}` and `{TREATMENT}`: no window to find."
    hit = dict(zip(sp["users"], sp["p_hit_rate_baseline"], strict=True)) if "p_hit_rate_baseline" in sp else {}
    full = ("" if w.d_full_from is None else
            f"`{TREATMENT}`'s D is full (>= {D_FULL_FRACTION:.0%} of its KV in use) from {w.d_full_from} concurrent "
            "sessions on; ")
    end = full + ("no capacity crossing within the steps measured (`pd-bidir` does not stay behind `pd` up to the "
                  "last step)" if w.ends_at is None else
                  f"D's own KV space runs out at **{w.ends_at} concurrent sessions** (the capacity crossing: from "
                  f"there `{TREATMENT}`'s {w.crossing.reason.replace('_', ' ')} stays behind `{BASELINE}`'s)")
    if w.pays_from is None:
        head = (f"**No window on this ramp**: `{TREATMENT}` was not faster than `{BASELINE}` beyond noise at every "
                f"step up to the crossing. {end[0].upper() + end[1:]}.")
    else:
        last = w.steps[-1]
        head = (f"**Holding the turn on D pays from {w.pays_from} concurrent sessions** (`{BASELINE}`'s P hit rate "
                f"{_pct(hit.get(w.pays_from, math.nan))} there) up to {last}; {end}: the window is "
                f"{', '.join(map(str, w.steps))} concurrent session(s).")
    parts = [f"{int(r.users)}: {speedup.fmt(r.speedup)} ({speedup.fmt_ci(r.ci_low, r.ci_high)}), P hit "
             f"{_pct(r.p_hit_rate_baseline)}" for r in sp.itertuples()]
    return head + f" Speed-up `{BASELINE}` / `{TREATMENT}` by concurrent sessions: " + "; ".join(parts) + "."
