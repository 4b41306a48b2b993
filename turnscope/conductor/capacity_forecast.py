"""The capacity ramp forecast: each recorded load step of ``turnscope capacity`` planned alone
(:func:`planner.check.plan_on_its_own`: its own clock, settings, speed probe and D's KV
space), its step figures computed as the Memory page computes the measured ones, and the crossing
found by the same rule (:func:`analysis.capacity_crossing.find_crossing`), so that forecast and measurement
say "holding KV starts to cost capacity at N sessions" in one language (docs/capacity.md).

Per step and mode (forecast): TTFT p50 and p90 over the step's ok turns (p90 with its 80% interval
from the profile's held-out errors, :func:`planner.intervals.ttft_interval`); D's peak KV in use
(pinned handles plus running requests: ``ModePlan.d_peak_in_use_bytes``) and its peak pinned KV, each
as a fraction of the run's D KV space, and the handles lost to a full D (``miss_d_full``). **Goodput is
not forecast**: a step's turns are sent by a closed loop (each user sends its next turn after the
last reply and a tool gap), so the step's span, the denominator of goodput, follows the very
latencies being forecast, and the recorded span would carry the measured slowdown into the
forecast. The forecast crossing is therefore the TTFT p90 rule alone (``find_crossing`` with
goodput equal on both sides), and "D full" is the first step whose peak KV in use reaches
:data:`D_FULL_FRACTION` of D's KV space, the same quantity on both sides (measured:
``vllm:kv_cache_usage_perc``; forecast: the pinned handles plus the running requests in D's
admission queue).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from analysis.capacity_crossing import BASELINE, D_FULL_FRACTION, TREATMENT, Crossing, find_crossing
from analysis.headline import MIN_TURN_INDEX
from core.modes import AGGREGATED
from planner import intervals
from planner.check import plan_on_its_own
from planner.fit import shared_prefix_by_run
from planner.profile import CostProfile
from store import db
from store.queries import capacity as capacity_queries
from store.queries.planner_runs import recorded_turns, run_probes
from store.writer import Store

#: Columns of :func:`forecast_steps` (``analysis.capacity_crossing.step_pairs`` reads the first five;
#: ``goodput_per_s`` is the same constant on every row: not forecast, see the module doc).
COLUMNS = ("mode", "users", "goodput_per_s", "ttft_p50_s", "ttft_p90_s", "capacity_id", "run_id",
           "d_in_use_peak_fraction", "d_pinned_peak_fraction", "d_full_events", "ttft_p90_interval_low_s",
           "ttft_p90_interval_high_s", "p_hit_rate", "ttft_later_p50_s", "speedup", "p_hit_rate_replay")


#: The eviction ladder's held-out targets (docs/eviction.md): P's hit rate per step within this many
#: percentage points of vLLM's, the window's edges within one step.
P_HIT_RATE_TARGET_PP = 5.0


def measured_turns(store: Store, run_ids: Sequence[str]) -> pd.DataFrame:
    """The capacity steps' turns among ``run_ids`` (``store.queries.capacity.capacity_turns``)."""
    return db.read(db.StoreLocation(store.root), capacity_queries.capacity_turns, list(run_ids))


def measured_steps(store: Store, run_ids: Sequence[str]) -> pd.DataFrame:
    """The capacity steps among ``run_ids`` as the Memory page reads them
    (``store.queries.capacity.capacity_steps``); empty when none is a capacity step."""
    return db.read(db.StoreLocation(store.root), capacity_queries.capacity_steps, list(run_ids))


def forecast_steps(store: Store, steps: pd.DataFrame, profile: CostProfile) -> pd.DataFrame:
    """The planner's forecast of each measured step of ``steps`` (:func:`measured_steps`' rows):
    one row per run, :data:`COLUMNS` (seconds, turns per second, fraction 0-1; see the module doc;
    ``d_in_use_peak_fraction`` NaN where D's KV space is unknown, so its queue is not modelled;
    ``p_hit_rate``: the computing worker's own prefix-cache hits over the step's prompt tokens, 0-1,
    the planner's LRU (:func:`planner.simulate.own_cache_hits`) against vLLM's
    ``prefix_cache_hits`` / ``prefix_cache_queries``; ``ttft_later_p50_s``: median TTFT of the ok
    turns from each session's second on, seconds; ``speedup``: on the treatment's rows, the
    baseline's ``ttft_later_p50_s`` over the treatment's at the same step, NaN elsewhere;
    ``p_hit_rate_replay``: P's hit rate in vLLM's own block-level policy replayed over the recorded
    turns, :func:`_replayed_p_hit_rate`, 0-1, NaN for aggregated)."""
    if steps.empty:
        return pd.DataFrame(columns=list(COLUMNS))
    run_ids = list(steps["run_id"])
    recorded = recorded_turns(store, run_ids)
    shared = shared_prefix_by_run(recorded)
    probes = run_probes(store, run_ids)
    rows = []
    for st in steps.itertuples():
        tr, m, _ = plan_on_its_own(store, st.run_id, st.mode, profile, shared[st.run_id], probes[st.run_id])
        rec = recorded[recorded["run_id"] == st.run_id]
        pred = pd.DataFrame({"session_id": tr.session, "turn_index": tr.request_index, "ttft_s": m.ttft_s})
        ok = rec[rec["status"] == "ok"][["session_id", "turn_index"]].merge(pred, on=["session_id", "turn_index"])
        ttft = ok["ttft_s"].to_numpy(float)
        later = ok.loc[ok["turn_index"] >= MIN_TURN_INDEX, "ttft_s"].to_numpy(float)
        p90 = float(np.quantile(ttft, 0.9)) if ttft.size else np.nan
        prompt = np.asarray(tr.input_tokens, dtype=float)
        low, high = intervals.ttft_interval(profile, st.mode, p90)
        rows.append({"mode": st.mode, "users": int(st.users), "goodput_per_s": 1.0,
                     "ttft_p50_s": float(np.quantile(ttft, 0.5)) if ttft.size else np.nan, "ttft_p90_s": p90,
                     "ttft_p90_interval_low_s": low, "ttft_p90_interval_high_s": high,
                     "capacity_id": st.capacity_id, "run_id": st.run_id,
                     "d_in_use_peak_fraction": (m.d_peak_in_use_bytes / st.decode_kv_cache_bytes
                                                if st.decode_kv_cache_bytes else np.nan),
                     "d_pinned_peak_fraction": (m.peak_held_bytes() / st.decode_kv_cache_bytes
                                                if st.decode_kv_cache_bytes else np.nan),
                     "d_full_events": int(m.d_full_events),
                     "p_hit_rate": float(np.sum(m.local_tokens) / prompt.sum()) if prompt.sum() else np.nan,
                     "ttft_later_p50_s": float(np.median(later)) if later.size else np.nan,
                     "p_hit_rate_replay": _replayed_p_hit_rate(store, st.run_id, st.mode, rec, shared[st.run_id])})
    out = pd.DataFrame(rows, columns=list(COLUMNS))
    base = out[out["mode"] == BASELINE].set_index("users")["ttft_later_p50_s"]
    treat = out["mode"] == TREATMENT
    out.loc[treat, "speedup"] = out.loc[treat, "users"].map(base) / out.loc[treat, "ttft_later_p50_s"]
    return out


def _replayed_p_hit_rate(store: Store, run_id: str, mode: str, rec: pd.DataFrame, shared: int) -> float:
    """P's hit rate (0-1) of ``run_id``'s turns in vLLM's own block-level policy
    (:func:`analysis.p_cache_replay.replay_hits`) on P's blocks as the run's
    ``vllm:cache_config_info`` gives them (less vLLM's null block); NaN for a mode without P or a
    run without that gauge. The yardstick of the planner's session-level LRU (docs/eviction.md)."""
    from analysis.p_cache_replay import fifo_starts, replay_hits
    from store.queries.worker_cache import labels_by_role

    if mode == AGGREGATED or rec.empty:
        return np.nan
    lab = labels_by_role(store, [run_id]).get("prefill")
    try:
        blocks, size = int(lab["num_gpu_blocks"]) - 1, int(lab["block_size"])
    except (KeyError, TypeError, ValueError):
        return np.nan
    legs = capacity_queries.prefill_legs(store, run_id)
    t = rec.dropna(subset=["prompt_tokens"]).merge(legs, on=["session_id", "turn_index"], how="left")
    sent = (pd.to_datetime(t["sent_at"]) - pd.Timestamp("1970-01-01", tz="UTC")).dt.total_seconds().to_numpy()
    end = sent + t["prefill_leg_s"].fillna(t["ttft_s"]).fillna(0).to_numpy(float)
    start = fifo_starts(sent, end)
    hits = replay_hits(t.assign(sent_s=start, hold_s=end - start), blocks, size, shared, hold_until="hold_s")
    total = float(t["prompt_tokens"].sum())
    return float(hits.sum() / total) if total else np.nan


def crossings(measured: pd.DataFrame, forecast: pd.DataFrame) -> list[tuple[str, Crossing, Crossing]]:
    """Per ramp (``capacity_id``, newest first as measured): (ramp, the measured crossing, the
    forecast one), both by :func:`analysis.capacity_crossing.find_crossing`."""
    out = []
    for cid in dict.fromkeys(measured["capacity_id"]):
        out.append((str(cid), find_crossing(measured[measured["capacity_id"] == cid]),
                    find_crossing(forecast[forecast["capacity_id"] == cid])))
    return out


def d_full_step(steps: pd.DataFrame, column: str) -> int | None:
    """The fewest sessions at which the treatment's D peak (``column``: a fraction of D's KV space)
    reaches :data:`D_FULL_FRACTION`; None when no step does."""
    t = steps[(steps["mode"] == TREATMENT) & (steps[column] >= D_FULL_FRACTION)]
    return int(t["users"].min()) if len(t) else None


def within_one_step(users: list[int], measured: int | None, forecast: int | None) -> bool:
    """Whether a forecast step is the measured one or its neighbour in ``users`` (both None: agree)."""
    if measured is None or forecast is None:
        return measured is None and forecast is None
    return abs(users.index(measured) - users.index(forecast)) <= 1


def _at(users: int | None, why: str | None = None) -> str:
    return "none within the steps" if users is None else f"at {users} sessions" + (f" ({why})" if why else "")


def _verdict(ok: bool) -> str:
    return "within one step" if ok else "MISSED"


def eviction_lines(cid: str, measured: pd.DataFrame, forecast: pd.DataFrame, turns: pd.DataFrame) -> list[str]:
    """The eviction ladder's lines for ramp ``cid`` (a ramp with P's KV space set): per step and
    mode P's hit rate measured and forecast (target: within :data:`P_HIT_RATE_TARGET_PP` pp), and
    the window (:func:`analysis.eviction_window.find_window`) measured and forecast, each
    edge within one step or not."""
    from analysis import eviction_window as ew

    m_ramp, f_ramp = measured[measured["capacity_id"] == cid], forecast[forecast["capacity_id"] == cid]
    users = sorted(set(m_ramp["users"]))
    both = m_ramp.merge(f_ramp, on=["mode", "users"], suffixes=("", "_fc"))
    lines = []
    for r in both.sort_values(["users", "mode"]).itertuples():
        if np.isnan(r.p_hit_rate) or np.isnan(r.p_hit_rate_fc):
            continue
        pp = (r.p_hit_rate_fc - r.p_hit_rate) * 100
        replay = ("" if np.isnan(r.p_hit_rate_replay) else
                  f"; vLLM's block-level policy replayed: {r.p_hit_rate_replay:.1%} "
                  f"({(r.p_hit_rate_replay - r.p_hit_rate) * 100:+.1f} pp)")
        lines.append(f"    {r.users} sessions, {r.mode}: P's own prefix-cache hit rate {r.p_hit_rate:.1%} measured, "
                     f"{r.p_hit_rate_fc:.1%} forecast ({pp:+.1f} pp: "
                     f"{'within' if abs(pp) <= P_HIT_RATE_TARGET_PP else 'MISSED'} {P_HIT_RATE_TARGET_PP:g} pp){replay}")
    wm = ew.find_window(m_ramp, turns[turns["capacity_id"] == cid])
    wf = ew.find_window(f_ramp, forecast=True)

    def win(w) -> str:
        return "none" if not w.steps else f"{w.steps[0]}-{w.steps[-1]} sessions"

    lines.insert(0, f"  eviction window {cid}: measured {win(wm)} (pays from {_at(wm.pays_from)}, D full from "
                    f"{_at(wm.d_full_from)}, crossing {_at(wm.ends_at)}), forecast {win(wf)} (pays from "
                    f"{_at(wf.pays_from)}, D full from {_at(wf.d_full_from)}, crossing {_at(wf.ends_at)}); edges: "
                    f"pays from {_verdict(within_one_step(users, wm.pays_from, wf.pays_from))}, D full "
                    f"{_verdict(within_one_step(users, wm.d_full_from, wf.d_full_from))}, crossing "
                    f"{_verdict(within_one_step(users, wm.ends_at, wf.ends_at))}")
    return lines


def describe(measured: pd.DataFrame, forecast: pd.DataFrame, turns: pd.DataFrame | None = None,
             run_errors: pd.DataFrame | None = None) -> str:
    """The capacity lines of ``turnscope plan-check``: per ramp the crossing and the step where D fills,
    measured and forecast (within one step: the held-out target), and per step the forecast next to
    the measured figures, with the step's TTFT MARE where ``run_errors`` (the held-out check's
    :func:`planner.held_out.run_errors`) has its run; for a ramp with P's KV space set and
    ``turns`` given (:func:`measured_turns`), the eviction ladder's lines (:func:`eviction_lines`)."""
    mare = {} if run_errors is None else dict(zip(run_errors["checked_run_id"], run_errors["ttft_mare"], strict=True))
    lines = []
    for cid, meas, fc in crossings(measured, forecast):
        m_ramp, f_ramp = measured[measured["capacity_id"] == cid], forecast[forecast["capacity_id"] == cid]
        users = sorted(set(m_ramp["users"]))

        m_full, f_full = d_full_step(m_ramp, "decode_kv_usage_max"), d_full_step(f_ramp, "d_in_use_peak_fraction")
        crossing_ok = within_one_step(users, meas.users, fc.users)
        if f_ramp["d_in_use_peak_fraction"].isna().all():
            full = "not forecast (D's KV space unknown)"
        else:
            full = f"forecast {_at(f_full)} ({_verdict(within_one_step(users, m_full, f_full))})"
        lines.append(f"  capacity ramp {cid} (steps {', '.join(map(str, users))} sessions): crossing measured "
                     f"{_at(meas.users, meas.reason)}, forecast {_at(fc.users, fc.reason)} (TTFT p90 only: goodput "
                     f"is not forecast) ({_verdict(crossing_ok)}); {TREATMENT}'s D full (>= {D_FULL_FRACTION:.0%}) "
                     f"measured {_at(m_full)}, {full}")
        both = m_ramp.merge(f_ramp, on=["mode", "users"], suffixes=("", "_fc"))
        for r in both.sort_values(["users", "mode"]).itertuples():
            iv = ("no held-out interval" if np.isnan(r.ttft_p90_interval_low_s) else
                  f"80% interval {r.ttft_p90_interval_low_s * 1e3:,.0f}-{r.ttft_p90_interval_high_s * 1e3:,.0f} ms")
            step_mare = f", TTFT MARE {mare[r.run_id]:.1%}" if r.run_id in mare else ""
            lines.append(f"    {r.users} sessions, {r.mode}: TTFT p90 {r.ttft_p90_s * 1e3:,.0f} ms measured, "
                         f"{r.ttft_p90_s_fc * 1e3:,.0f} ms forecast ({iv}{step_mare}); goodput {r.goodput_per_s:.2f} turns/s measured; "
                         f"D peak {r.decode_kv_usage_max:.0%} of its KV in use measured, "
                         + ("not forecast (D's KV space unknown: neither the profile nor the run's scrapes give it)"
                            if np.isnan(r.d_in_use_peak_fraction) else
                            f"{r.d_in_use_peak_fraction:.0%} forecast ({r.d_pinned_peak_fraction:.0%} pinned)")
                         + (f", {r.d_full_events} handles lost to a full D" if r.d_full_events else ""))
        if turns is not None and "prefill_kv_cache_bytes" in m_ramp and m_ramp["prefill_kv_cache_bytes"].notna().any():
            lines.extend(eviction_lines(cid, measured, forecast, turns))
    return "\n".join(lines)
