"""Figures as a person reads them: three significant figures, memory held over time in GiB-hours
or TiB-hours, compute in GPU-hours (the planner computes in seconds, GiB-seconds and GPU-seconds)."""

from __future__ import annotations

import math


def sig3(x: float) -> str:
    """``x`` to three significant figures with thousands separators (1,230; 45.6; 0.0123); "n/a"
    for NaN."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if x == 0:
        return "0"
    digits = 3 - 1 - math.floor(math.log10(abs(x)))
    r = round(x, digits)
    return f"{r:,.{max(digits, 0)}f}"


def memory_hours(gib_s: float) -> str:
    """GiB-seconds held as GiB-hours, or TiB-hours from 1,000 GiB-hours on (3 significant figures)."""
    gib_h = gib_s / 3600
    if abs(gib_h) >= 1000:
        return f"{sig3(gib_h / 1024)} TiB-h"
    return f"{sig3(gib_h)} GiB-h"


def gpu_hours(gpu_s: float) -> str:
    """GPU-seconds as GPU-hours (3 significant figures)."""
    return f"{sig3(gpu_s / 3600)} GPU-h"
