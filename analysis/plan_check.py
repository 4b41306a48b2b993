"""How far to trust a forecast, and what of a plan to show: the planner's forecast of recorded runs
against what they measured (``plan_checks`` rows, docs/planner/held-out.md),
summed up per mode; the Overview's speed-up of those runs, measured and forecast; forecast intervals
in words; the frontier's rows that matter.

Pure pandas, shared by the Plan page and ``turnscope plan`` (so the page imports no planner code).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from analysis import headline, speedup

#: The bound on the median absolute relative error of forecast TTFT, per mode (25%).
MARE_BOUND = 0.25
#: What the check calculates, in words (the CLI's and the Plan page's caption).
CHECK_MEANING = ("each recorded run planned alone, in its own mode, from its own turns and on its own clock, with "
                 "this plan's profile, and compared turn by turn with what it measured; per mode over ok turns: the "
                 "forecast outcome must be the recorded one, and TTFT MARE, the median of |forecast - measured| / "
                 "measured, at most 25%. Unlike the speed-ups above (every run planned in every mode), each run "
                 "is compared with its own measurement")


def check_summary(checks: pd.DataFrame) -> pd.DataFrame:
    """Per mode: ok turns, outcome matches, MARE of TTFT and whether both checks pass.

    Columns: mode, ok_turns, outcome_matches, outcome_check (all match), ttft_mare, ttft_check
    (MARE <= 25%)."""
    rows = []
    for mode, g in checks[checks["status"] == "ok"].groupby("mode", sort=False):
        g = g[g["measured_ttft_s"].notna()]
        rel = (g["predicted_ttft_s"] - g["measured_ttft_s"]).abs() / g["measured_ttft_s"]
        matches = int(g["outcome_match"].astype(bool).sum())
        mare = float(rel.median()) if len(rel) else np.nan
        rows.append({"mode": mode, "ok_turns": len(g), "outcome_matches": matches,
                     "outcome_check": matches == len(g), "ttft_mare": mare, "ttft_check": bool(mare <= MARE_BOUND)})
    return pd.DataFrame(rows)


def with_interval(text: str, low: float, high: float, fmt, unit: str = "") -> str:
    """``text`` followed by its forecast interval, ``"1.80x (80% interval 1.50-2.20x)"``, or by
    ``"(no held-out interval)"`` when either end is NaN/None (the profile was never checked on
    runs it was not fitted on; docs/planner/held-out.md). ``fmt`` formats one end (a
    number), ``unit`` follows the second (``"x"``, ``" ms"``, ``"%"``)."""
    if low is None or high is None or pd.isna(low) or pd.isna(high):
        return f"{text} (no held-out interval)"
    return f"{text} (80% interval {fmt(low)}-{fmt(high)}{unit})"


def headline_check(checks: pd.DataFrame) -> pd.DataFrame:
    """The Overview's speed-up (:func:`analysis.headline.ratio_of`: baseline / treatment median TTFT
    of ok turns from the second on) of the checked runs, once over the measured TTFTs (with its
    session-level bootstrap 95% CI, as the Overview shows it) and once over the forecast ones, for
    each pair of :data:`analysis.headline.PAIRS` whose two modes were checked. Columns: treatment,
    baseline, measured_speedup, measured_ci_low, measured_ci_high (NaN with fewer than 2 sessions a
    side), forecast_speedup, forecast_error (forecast / measured - 1), within_ci (the forecast inside
    the measured CI; None without one)."""
    ok = checks[(checks["status"] == "ok") & (checks["turn_index"] >= headline.MIN_TURN_INDEX)
                & checks["measured_ttft_s"].notna() & checks["predicted_ttft_s"].notna()]
    ok = ok.rename(columns={"checked_run_id": "run_id"})
    rows = []
    for t, b in headline.PAIRS:
        tt, bb = ok[ok["mode"] == t], ok[ok["mode"] == b]
        if tt.empty or bb.empty:
            continue
        got = {}
        for col, resamples in (("measured_ttft_s", None), ("predicted_ttft_s", 9)):
            r = headline.ratio_of(tt.assign(ttft_s=tt[col]), bb.assign(ttft_s=bb[col]), treatment_name=t,
                                  baseline_name=b, n_resamples=resamples)
            got[col] = speedup.of(r)
        m, f = got["measured_ttft_s"], got["predicted_ttft_s"].value
        has_ci = not (math.isnan(m.ci_low) or math.isnan(m.ci_high))
        rows.append({"treatment": t, "baseline": b, "measured_speedup": m.value, "measured_ci_low": m.ci_low,
                     "measured_ci_high": m.ci_high, "forecast_speedup": f, "forecast_error": f / m.value - 1,
                     "within_ci": (m.ci_low <= f <= m.ci_high) if has_ci else None})
    return pd.DataFrame(rows)


#: The smallest change of hit rate (share) the frontier's rows that matter show: 1 percentage point.
HIT_RATE_STEP = 0.01


def frontier_highlights(fr: pd.DataFrame) -> pd.DataFrame:
    """The few rows of a frontier (``plan_frontier`` rows: :func:`planner.summary.frontier`'s, with a ``mode`` column) that matter, per
    mode: the current point; the best (the highest hit rate, then the fewest GiB-s pinned); and
    each point where the hit rate changes, along the TTL at the current D space and along the D
    space at the current TTL (the smallest TTL or space whose hit rate differs by at least
    :data:`HIT_RATE_STEP` from the last point kept on that line, starting from its first). Same columns
    plus ``why`` (every reason the row is kept, "; "-joined), in frontier order."""
    keep: dict[int, list[str]] = {}
    for _mode, g in fr.groupby("mode", sort=False):
        cur = g[g["current"]]
        if cur.empty:
            continue
        c = cur.iloc[0]
        keep.setdefault(cur.index[0], []).append("current")
        best = g.sort_values(["hit_rate", "held_gib_s"], ascending=[False, True], kind="stable").index[0]
        keep.setdefault(best, []).append("best hit rate")
        same_space = g[g["decode_kv_space_bytes"].fillna(-1) == (-1 if pd.isna(c.decode_kv_space_bytes)
                                                                    else c.decode_kv_space_bytes)]
        same_ttl = g[g["decoder_kv_blocks_ttl_s"] == c.decoder_kv_blocks_ttl_s]
        for line, axis, what in ((same_space, "decoder_kv_blocks_ttl_s", "TTL"),
                                 (same_ttl, "decode_kv_space_bytes", "D space")):
            line = line.sort_values(axis, kind="stable")
            last = float(line["hit_rate"].iloc[0])
            for ix, rate in zip(line.index[1:], line["hit_rate"].iloc[1:], strict=True):
                if abs(float(rate) - last) >= HIT_RATE_STEP:
                    keep.setdefault(ix, []).append(f"hit rate changes ({what})")
                    last = float(rate)
    out = fr.loc[sorted(keep)].copy()
    out["why"] = ["; ".join(keep[ix]) for ix in out.index]
    return out.reset_index(drop=True)
