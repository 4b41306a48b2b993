"""Forecast intervals from held-out errors (docs/planner.md, "Forecast intervals").

A profile checked on runs it was not fitted on (``turnscope plan-check``) carries
:class:`turnscope.planner.profile.HeldOutErrors`: per mode the 10th and 90th percentiles of
measured / forecast TTFT and of recorded minus forecast hit rate. An interval is the forecast moved
by those percentiles; a profile without held-out errors gives NaN ends, shown as "no held-out
interval" (never an invented one).

* TTFT x of mode m: ``[x r10(m), x r90(m)]``;
* speed-up s = baseline / treatment: ``[s r10(b) / r90(t), s r90(b) / r10(t)]`` (the baseline's
  and treatment's errors taken as independent, each at its own extreme: conservative);
* hit rate h: ``[h + e10(m), h + e90(m)]`` clipped to 0..1.

Every function returns ``(low, high)``; NaN ends where the profile has no held-out errors for the
mode(s).
"""

from __future__ import annotations

import math

from turnscope.planner.profile import CostProfile

NONE = (math.nan, math.nan)


def _ratio(profile: CostProfile, mode: str) -> tuple[float, float] | None:
    return profile.held_out.ttft_ratio.get(mode) if profile.held_out else None


def ttft_interval(profile: CostProfile, mode: str, ttft_s: float) -> tuple[float, float]:
    """The 80% interval of a forecast TTFT (seconds) of ``mode``."""
    r = _ratio(profile, mode)
    return NONE if r is None or math.isnan(ttft_s) else (ttft_s * r[0], ttft_s * r[1])


def speedup_interval(profile: CostProfile, treatment: str, baseline: str, speedup: float) -> tuple[float, float]:
    """The interval of a forecast speed-up (baseline / treatment TTFT, dimensionless)."""
    rt, rb = _ratio(profile, treatment), _ratio(profile, baseline)
    if rt is None or rb is None or math.isnan(speedup):
        return NONE
    return speedup * rb[0] / rt[1], speedup * rb[1] / rt[0]


def hit_rate_interval(profile: CostProfile, mode: str, hit_rate: float) -> tuple[float, float]:
    """The interval of a forecast hit rate (share, 0..1) of ``mode``."""
    e = profile.held_out.hit_rate_error.get(mode) if profile.held_out else None
    if e is None or math.isnan(hit_rate):
        return NONE
    return min(1.0, max(0.0, hit_rate + e[0])), min(1.0, max(0.0, hit_rate + e[1]))
