"""What a plan says (a FORECAST): the speed-up per mode pair with the requests it comes from, the
frontier of TTL and D's KV space, and the sessions whose pauses or edits defeat reuse.

Inputs are :class:`planner.simulate.Plan` objects; outputs are DataFrames whose columns
are the store's ``plan_speedups``, ``plan_frontier`` and ``plan_sessions`` tables (docs/schema/plans.md;
what they mean: docs/planner/overview.md).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis import headline, speedup
from core import modes
from core.contract import HIT, MISS_CONSUMED, MISS_EXPIRED, MISS_MISMATCH
from planner import intervals
from planner.profile import CostProfile, Sourced
from planner.simulate import MISS_D_FULL, Plan, PlanSettings, Traffic, plan

#: Mode pairs: the Sweep page's three, and bidirectional transfer with P's cache on against off
#: (every ``ServingMode.baselines``, treatments in the sweep's order).
PLAN_PAIRS = tuple((t, b) for t, b, _ in modes.pairs(measured_only=False, order=modes.SWEEP_ORDER))
#: Frontier grid: decoder_kv_blocks_ttl values (seconds) and multiples of the profile's D KV space.
FRONTIER_TTLS_S = (30.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1800.0, 3600.0)
FRONTIER_SPACE_FACTORS = (0.125, 0.25, 0.5, 1.0, 2.0)


def speedups(p: Plan) -> pd.DataFrame:
    """Each pair of :data:`PLAN_PAIRS` whose two modes were planned, on the Overview's convention
    (:func:`analysis.headline.ratio_of`, the one definition): ``speedup`` = median forecast TTFT of
    the baseline / of the treatment over later requests (``request_index >= 1``: the second turn
    on), with the headline's session bootstrap 95% CI; > 1: the treatment is faster. Means and the
    queue's share are secondary figures, labelled as such wherever shown.

    Columns: treatment, baseline, requests, later_requests, treatment_hits, treatment_ttft_median_s,
    baseline_ttft_median_s (later requests, s), speedup, speedup_ci_low, speedup_ci_high,
    treatment_ttft_mean_s, baseline_ttft_mean_s (every request, s), mean_speedup (baseline /
    treatment mean TTFT, every request), later_mean_speedup (later requests), treatment_queue_share,
    baseline_queue_share (mean wait for the prefill worker and on D / mean TTFT, every request),
    speedup_interval_low/high, treatment_ttft_interval_low_s/high_s, baseline_ttft_interval_low_s/high_s
    (the 80% forecast intervals of the speed-up and the medians from the profile's held-out errors,
    :mod:`planner.intervals`; NaN: the profile has none)."""
    later = p.traffic.request_index >= 1
    rows = []
    for t, b in PLAN_PAIRS:
        if t not in p.modes or b not in p.modes:
            continue
        tm, bm = p.modes[t], p.modes[b]
        tt, bb = tm.ttft_s, bm.ttft_s
        row = {"treatment": t, "baseline": b, "requests": len(tt), "later_requests": int(later.sum()),
               "treatment_hits": int((tm.outcome_names() == HIT).sum()),
               "treatment_ttft_median_s": np.nan, "baseline_ttft_median_s": np.nan,
               "speedup": np.nan, "speedup_ci_low": np.nan, "speedup_ci_high": np.nan}
        if later.any():
            r = headline.ratio_of(_later_frame(p, tt, later), _later_frame(p, bb, later),
                                  treatment_name=t, baseline_name=b)
            s = speedup.of(r)
            row |= {"treatment_ttft_median_s": r.median_treatment_s, "baseline_ttft_median_s": r.median_baseline_s,
                    "speedup": s.value, "speedup_ci_low": s.ci_low, "speedup_ci_high": s.ci_high}
        row |= {"treatment_ttft_mean_s": float(tt.mean()), "baseline_ttft_mean_s": float(bb.mean()),
                "mean_speedup": float(bb.mean() / tt.mean()),
                "later_mean_speedup": float(bb[later].mean() / tt[later].mean()) if later.any() else np.nan,
                "treatment_queue_share": float(tm.queued_s.sum() / tt.sum()) if tt.sum() else np.nan,
                "baseline_queue_share": float(bm.queued_s.sum() / bb.sum()) if bb.sum() else np.nan}
        lo, hi = intervals.speedup_interval(p.profile, t, b, row["speedup"])
        tlo, thi = intervals.ttft_interval(p.profile, t, row["treatment_ttft_median_s"])
        blo, bhi = intervals.ttft_interval(p.profile, b, row["baseline_ttft_median_s"])
        row |= {"speedup_interval_low": lo, "speedup_interval_high": hi, "treatment_ttft_interval_low_s": tlo,
                "treatment_ttft_interval_high_s": thi, "baseline_ttft_interval_low_s": blo,
                "baseline_ttft_interval_high_s": bhi}
        rows.append(row)
    return pd.DataFrame(rows)


def _later_frame(p: Plan, ttft_s: np.ndarray, later: np.ndarray) -> pd.DataFrame:
    """The later requests' forecast TTFT with their session (source as ``run_id``), the frame
    :func:`analysis.headline.ratio_of` takes."""
    tr = p.traffic
    return pd.DataFrame({"ttft_s": ttft_s[later], "run_id": tr.source[later], "session_id": tr.session[later]})


def frontier(traffic: Traffic, profile: CostProfile, settings: PlanSettings, mode: str = modes.PD_BIDIR,
             ttls_s: tuple[float, ...] = FRONTIER_TTLS_S,
             space_factors: tuple[float, ...] = FRONTIER_SPACE_FACTORS) -> pd.DataFrame:
    """``mode`` re-planned over a grid of ``decoder_kv_blocks_ttl`` (the proxy margin kept; TTLs
    not above it skipped) and D KV spaces (multiples of the profile's; just the profile's own
    -- unbounded -- when it has none), plus the current point.

    Columns: decoder_kv_blocks_ttl_s, decode_kv_space_bytes (NaN: unbounded), current (the
    settings' TTL and the profile's space), hit_rate (hits over later requests),
    hit_rate_interval_low/high (its 80% forecast interval, :mod:`planner.intervals`; NaN:
    none), ttft_saved_s (sum
    over requests of the ``pd`` forecast minus ``mode``'s, seconds; for ``pd-bidir-nocache`` against
    ``pd-nocache``; NaN where either is overloaded, :mod:`planner.overload`),
    peak_held_bytes, held_gib_s, d_full_events."""
    base_mode = modes.one_way(mode)
    base = plan(traffic, profile, settings.model_copy(update={"modes": (base_mode,)})).modes[base_mode]
    later = traffic.request_index >= 1
    space = profile.decode_kv_space_bytes
    spaces = [None] if space is None else [space.value * f for f in space_factors]
    points = {(float(ttl), s) for ttl in ttls_s if ttl > settings.handle_ttl_margin_s for s in spaces}
    current = (float(settings.decoder_kv_blocks_ttl_s), None if space is None else space.value)
    points.add(current)
    rows = []
    for ttl, s in sorted(points, key=lambda x: (x[0], x[1] or 0)):
        prof = profile if s is None else profile.model_copy(
            update={"decode_kv_space_bytes": Sourced(value=s, source="frontier grid point")})
        m = plan(traffic, prof, settings.model_copy(update={"decoder_kv_blocks_ttl_s": ttl, "modes": (mode,)})).modes[mode]
        names = m.outcome_names()
        rate = float((names[later] == HIT).mean()) if later.any() else np.nan
        lo, hi = intervals.hit_rate_interval(profile, mode, rate)
        rows.append({"decoder_kv_blocks_ttl_s": ttl, "decode_kv_space_bytes": np.nan if s is None else s,
                     "current": (ttl, s) == current, "hit_rate": rate,
                     "hit_rate_interval_low": lo, "hit_rate_interval_high": hi,
                     # no TTFT is taken from, or against, a deployment that cannot keep up
                     "ttft_saved_s": (np.nan if m.overload is not None or base.overload is not None
                                      else float((base.ttft_s - m.ttft_s).sum())),
                     "peak_held_bytes": m.peak_held_bytes(),
                     "held_gib_s": m.held_gib_s(), "d_full_events": m.d_full_events})
    return pd.DataFrame(rows)


def defeated_sessions(p: Plan, mode: str = modes.PD_BIDIR_NOCACHE) -> pd.DataFrame:
    """Sessions of ``mode`` where reuse was possible but did not happen, worst first: pauses past
    the TTL (``miss_expired``, the longest gap given), edits that leave less than a block of the
    previous turn (``miss_mismatch``), a full D (``miss_d_full``), concurrent requests
    (``miss_consumed``). Columns: source, session_id, requests, expired, mismatched, d_full,
    consumed, lost_tokens (the shared-prefix tokens of those requests: what reuse could have
    covered), longest_gap_s, reason."""
    m = p.modes[mode]
    names = m.outcome_names()
    tr = p.traffic
    df = pd.DataFrame({"source": tr.source, "session_id": tr.session, "outcome": names,
                       "shared": tr.shared_prefix_tokens, "gap": tr.gap_s})
    df["lost"] = df["outcome"].isin([MISS_EXPIRED, MISS_MISMATCH, MISS_D_FULL, MISS_CONSUMED])
    g = df.groupby(["source", "session_id"], sort=False)
    out = pd.DataFrame({
        "requests": g.size(),
        "expired": g["outcome"].agg(lambda s: int((s == MISS_EXPIRED).sum())),
        "mismatched": g["outcome"].agg(lambda s: int((s == MISS_MISMATCH).sum())),
        "d_full": g["outcome"].agg(lambda s: int((s == MISS_D_FULL).sum())),
        "consumed": g["outcome"].agg(lambda s: int((s == MISS_CONSUMED).sum())),
        "lost_tokens": df.assign(v=df["shared"].where(df["lost"], 0)).groupby(["source", "session_id"], sort=False)["v"].sum(),
        "longest_gap_s": g["gap"].max(),
    }).reset_index()
    out = out[out[["expired", "mismatched", "d_full", "consumed"]].sum(axis=1) > 0]

    def reason(r) -> str:
        parts = []
        if r.expired:
            parts.append(f"{r.expired} pause(s) past the {p.settings.proxy_ttl_s:.0f} s handle TTL "
                         f"(longest gap {r.longest_gap_s:,.0f} s)")
        if r.mismatched:
            parts.append(f"{r.mismatched} edit(s) leaving less than one KV block of the previous turn")
        if r.d_full:
            parts.append(f"{r.d_full} handle(s) lost to a full D")
        if r.consumed:
            parts.append(f"{r.consumed} request(s) overlapping the previous one (handle already used)")
        return "; ".join(parts)

    out["reason"] = [reason(r) for r in out.itertuples()]
    return out.sort_values("lost_tokens", ascending=False).reset_index(drop=True)


def outcome_counts(p: Plan) -> pd.DataFrame:
    """Requests per mode and outcome. Columns: mode, outcome ('none' for aggregated), requests."""
    rows = []
    for mode in modes.ordered(lambda m: (not m.bidirectional, not m.disaggregated)):
        if mode in p.modes:
            s = pd.Series(p.modes[mode].outcome_names()).fillna("none").value_counts()
            rows += [{"mode": mode, "outcome": k, "requests": int(v)} for k, v in s.items()]
    return pd.DataFrame(rows)
