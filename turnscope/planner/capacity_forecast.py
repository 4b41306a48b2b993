"""The capacity ramp forecast: each recorded load step of ``turnscope capacity`` planned alone
(:func:`turnscope.planner.check.plan_on_its_own`: its own clock, settings, speed probe and D's KV
space), its step figures computed as the Memory page computes the measured ones, and the crossing
found by the same rule (:func:`dashboard.capacity.find_crossing`), so that forecast and measurement
say "holding KV starts to cost capacity at N sessions" in one language (docs/capacity.md, "The
crossing, forecast and measured").

Per step and mode (forecast): TTFT p50 and p90 over the step's ok turns; goodput = ok turns whose
forecast TTFT meets the SLO's TTFT bound and whose forecast TPOT (the profile's
``decode_s_per_token``) meets its TPOT bound, per second of the step's **recorded** span (the
planner keeps the recorded arrivals, so the span is not forecast); D's peak pinned KV as a fraction
of the run's D KV space, and the handles lost to a full D (``miss_d_full``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from dashboard import db
from dashboard.capacity import Crossing, find_crossing
from dashboard.queries import capacity as capacity_queries
from turnscope.planner.check import plan_on_its_own
from turnscope.planner.fit import probe_ttft_s, recorded_shared_prefix_tokens, recorded_turns
from turnscope.planner.profile import CostProfile
from turnscope.store import Store

#: Columns of :func:`forecast_steps` (``dashboard.capacity.step_pairs`` reads the first five).
COLUMNS = ("mode", "users", "goodput_per_s", "ttft_p50_s", "ttft_p90_s", "capacity_id", "run_id",
           "d_pinned_peak_fraction", "d_full_events")


def measured_steps(store: Store, run_ids: Sequence[str]) -> pd.DataFrame:
    """The capacity steps among ``run_ids`` as the Memory page reads them
    (``dashboard.queries.capacity.capacity_steps``); empty when none is a capacity step."""
    return db.read(db.StoreLocation(store.root), capacity_queries.capacity_steps, list(run_ids))


def forecast_steps(store: Store, steps: pd.DataFrame, profile: CostProfile) -> pd.DataFrame:
    """The planner's forecast of each measured step of ``steps`` (:func:`measured_steps`' rows):
    one row per run, :data:`COLUMNS` (seconds, turns per second, fraction 0-1; see the module doc)."""
    if steps.empty:
        return pd.DataFrame(columns=list(COLUMNS))
    run_ids = list(steps["run_id"])
    recorded = recorded_turns(store, run_ids)
    shared = recorded_shared_prefix_tokens(recorded)
    probes = probe_ttft_s(store, run_ids)
    tpot = profile.decode_s_per_token.value if profile.decode_s_per_token else 0.0
    rows = []
    for st in steps.itertuples():
        tr, m, _ = plan_on_its_own(store, st.run_id, st.mode, profile, shared, probes.get(st.run_id))
        rec = recorded[recorded["run_id"] == st.run_id]
        pred = pd.DataFrame({"session_id": tr.session, "turn_index": tr.request_index, "ttft_s": m.ttft_s})
        ok = rec[rec["status"] == "ok"][["session_id", "turn_index"]].merge(pred, on=["session_id", "turn_index"])
        ttft = ok["ttft_s"].to_numpy(float)
        met = int(np.sum(ttft <= st.slo_ttft_s)) if tpot <= st.slo_tpot_s else 0
        rows.append({"mode": st.mode, "users": int(st.users),
                     "goodput_per_s": met / st.span_s if st.span_s and st.span_s > 0 else np.nan,
                     "ttft_p50_s": float(np.quantile(ttft, 0.5)) if ttft.size else np.nan,
                     "ttft_p90_s": float(np.quantile(ttft, 0.9)) if ttft.size else np.nan,
                     "capacity_id": st.capacity_id, "run_id": st.run_id,
                     "d_pinned_peak_fraction": (m.peak_held_bytes() / st.decode_kv_cache_bytes
                                                if st.decode_kv_cache_bytes else np.nan),
                     "d_full_events": int(m.d_full_events)})
    return pd.DataFrame(rows, columns=list(COLUMNS))


def crossings(measured: pd.DataFrame, forecast: pd.DataFrame) -> list[tuple[str, Crossing, Crossing]]:
    """Per ramp (``capacity_id``, newest first as measured): (ramp, the measured crossing, the
    forecast one), both by :func:`dashboard.capacity.find_crossing`."""
    out = []
    for cid in dict.fromkeys(measured["capacity_id"]):
        out.append((str(cid), find_crossing(measured[measured["capacity_id"] == cid]),
                    find_crossing(forecast[forecast["capacity_id"] == cid])))
    return out


def describe(measured: pd.DataFrame, forecast: pd.DataFrame) -> str:
    """The capacity lines of ``turnscope plan-check``: per ramp the crossing measured and forecast
    (within one step: the held-out target), and per step the forecast next to the measured figures."""
    lines = []
    for cid, meas, fc in crossings(measured, forecast):
        users = sorted(set(measured.loc[measured["capacity_id"] == cid, "users"]))

        def step_text(c: Crossing) -> str:
            return f"at {c.users} sessions ({c.reason})" if c.users is not None else "none within the steps"

        within = (meas.users is None and fc.users is None) or (
            meas.users is not None and fc.users is not None and abs(users.index(meas.users) - users.index(fc.users)) <= 1)
        lines.append(f"  capacity ramp {cid} (steps {', '.join(map(str, users))} sessions): crossing measured "
                     f"{step_text(meas)}, forecast {step_text(fc)} ({'within one step' if within else 'MISSED'})")
        both = measured[measured["capacity_id"] == cid].merge(
            forecast[forecast["capacity_id"] == cid], on=["mode", "users"], suffixes=("", "_fc"))
        for r in both.sort_values(["users", "mode"]).itertuples():
            lines.append(f"    {r.users} sessions, {r.mode}: TTFT p90 {r.ttft_p90_s * 1e3:,.0f} ms measured, "
                         f"{r.ttft_p90_s_fc * 1e3:,.0f} ms forecast; goodput {r.goodput_per_s:.2f} vs "
                         f"{r.goodput_per_s_fc:.2f} turns/s; D peak {r.decode_kv_usage_max:.0%} of its KV in use "
                         f"measured, pinned {r.d_pinned_peak_fraction:.0%} forecast"
                         + (f", {r.d_full_events} handles lost to a full D" if r.d_full_events else ""))
    return "\n".join(lines)
