"""The planner checked against reality: recorded runs planned each alone, from their own records,
with a profile (fitted from them, from other runs, or a file; put on each run's machine speed by
its speed probe where both have one), compared turn by turn with what was measured.

Two checks (issue "The planner"): the predicted outcome is the recorded one for every turn that did
not fail (differences listed with why), and the predicted TTFT is within 25% median absolute
relative error (MARE, |predicted - measured| / measured) of the measured TTFT, per mode
(docs/planner/held-out.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from core.modes import AGGREGATED
from planner.fit import (
    on_run_kv_space,
    on_run_speed,
    plan_recorded_run,
    run_settings,
    shared_prefix_by_run,
)
from planner.profile import MODES, CostProfile
from planner.simulate import RENDERS, TOOK_HANDLE, ModePlan, PlanSettings, Traffic
from store.queries.planner_runs import RunProbes, recorded_turns, run_probes
from store.writer import Store

#: The TTFT check's bound: median absolute relative error per mode.


def _text(v) -> str | None:
    """An outcome as text; None for NULL/NaN (aggregated serving has none)."""
    return None if v is None or (isinstance(v, float) and np.isnan(v)) else str(v)


def _count(v) -> str:
    return "?" if v is None or pd.isna(v) else f"{int(v)}"


def on_run(store: Store, run_id: str, mode: str, profile: CostProfile,
           probes: RunProbes) -> tuple[CostProfile, float | None]:
    """``profile`` put on ``run_id``'s machine: on its probes (:func:`planner.fit.on_run_speed`) and
    on the KV spaces its workers reported (:func:`planner.fit.on_run_kv_space`). Returns the
    profile and the short probe's speed factor (None: not scaled)."""
    run_profile, factor = on_run_speed(profile, probes.short_s, probes.compute_s, mode, probes.cached_s,
                                       probes.path_s)
    return on_run_kv_space(run_profile, store, run_id), factor


def plan_on_its_own(store: Store, run_id: str, mode: str, profile: CostProfile, shared_prefix_tokens: int,
                    probes: RunProbes) -> tuple[Traffic, ModePlan, float | None]:
    """``run_id`` planned alone, on its own clock, with its own settings and workers, ``profile`` put on
    the run's machine (:func:`on_run`; ``probes``: :func:`store.queries.planner_runs.run_probes`).
    Returns the traffic, the forecast and the speed factor (None: not scaled)."""
    run_profile, factor = on_run(store, run_id, mode, profile, probes)
    tr, m = plan_recorded_run(store, run_id, mode, run_profile, shared_prefix_tokens)
    return tr, m, factor


def forecast_terms(tr: Traffic, m: ModePlan, profile: CostProfile, settings: PlanSettings) -> pd.DataFrame:
    """Each request's forecast TTFT split into the planner's terms, seconds (``profile``: the one
    the request was planned with, on its run's speed; ``settings``: the run's): ``compute``
    (``c(n) - c(cached)``, :meth:`CostProfile.prefill_compute_s`), ``pull``
    (:meth:`CostProfile.pull_s`), ``queue_p`` (``m.queue_wait_s``), ``wait_d`` (``m.decode_wait_s``),
    ``handoff_wait`` and ``d_first_step`` (P/D's hand-off, :meth:`CostProfile.handoff_s`; NaN where the
    profile has no such figure and keeps it inside b0, 0 in ``aggregated``), ``fixed`` (b0 of the mode plus the chat renders, :meth:`CostProfile.render_s` x
    :data:`planner.simulate.RENDERS`, one more for a handle taken), ``contention``
    (``m.contention_s``, :mod:`planner.host_contention`; 0 where the profile has no such
    term) and ``ttft`` (``m.ttft_s``), which the terms (NaN read as 0) sum to
    (the cost model: docs/planner/simulation.md). Columns also: session_id, turn_index."""
    n = tr.input_tokens
    took = np.isin(m.outcome_names(), TOOK_HANDLE)
    render = (profile.render_s(n, RENDERS[m.mode] + took) if settings.rendered_prompts else np.zeros(len(tr)))
    wait_d = m.decode_wait_s if m.decode_wait_s.size else np.zeros(len(tr))
    handoff_wait, d_first_step = profile.handoff_s(m.mode)
    if m.mode != AGGREGATED:   # a figure the profile lacks is inside b0: not known apart
        handoff_wait = handoff_wait if profile.handoff_wait_s is not None else np.nan
        d_first_step = d_first_step if profile.d_first_step_s is not None else np.nan
    return pd.DataFrame({"session_id": tr.session, "turn_index": tr.request_index,
                         "compute": profile.prefill_compute_s(m.mode, n, m.local_tokens + m.pulled_tokens),
                         "pull": profile.pull_s(m.pulled_tokens), "queue_p": m.queue_wait_s, "wait_d": wait_d,
                         "handoff_wait": handoff_wait, "d_first_step": d_first_step,
                         "fixed": profile.b0(m.mode) + render,
                         "contention": m.contention_s if m.contention_s.size else np.zeros(len(tr)), "ttft": m.ttft_s})


def check_runs(store: Store, run_ids: Sequence[str], profile: CostProfile) -> pd.DataFrame:
    """:func:`check_runs_with_terms`' checks (the store's ``plan_checks`` columns)."""
    return check_runs_with_terms(store, run_ids, profile)[0]


def check_runs_with_terms(store: Store, run_ids: Sequence[str], profile: CostProfile
                          ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Every turn of ``run_ids``, recorded next to predicted (each run planned in its own mode).

    Columns (the store's ``plan_checks``, docs/schema/plans.md): checked_run_id, mode, session_id,
    turn_index, status, recorded_outcome, predicted_outcome, outcome_match (None for failed turns),
    measured_ttft_s, predicted_ttft_s, recorded_pulled_tokens, predicted_pulled_tokens,
    recorded_local_tokens, predicted_local_tokens, why (for a difference: what each side saw),
    speed_factor (the run's speed probe TTFT over the profile's, by which b0 and c(x) were scaled
    for this run: :func:`planner.fit.on_run_speed`; NaN: not scaled); and each turn's
    forecast split (:func:`forecast_terms` with checked_run_id, mode and status)."""
    recorded = recorded_turns(store, run_ids)
    shared = shared_prefix_by_run(recorded)
    probes = run_probes(store, run_ids)
    frames, split = [], []
    for run_id, rec in recorded.groupby("run_id", sort=False):
        mode = str(rec["mode"].iloc[0])
        if mode not in MODES:
            continue
        run_profile, factor = on_run(store, str(run_id), mode, profile, probes[str(run_id)])
        tr, m = plan_recorded_run(store, str(run_id), mode, run_profile, shared[str(run_id)])
        terms = forecast_terms(tr, m, run_profile, run_settings(store, str(run_id)))
        split.append(terms.merge(rec[["session_id", "turn_index", "status"]], on=["session_id", "turn_index"])
                     .assign(checked_run_id=str(run_id), mode=mode))
        pred = pd.DataFrame({"session_id": tr.session, "turn_index": tr.request_index,
                             "predicted_outcome": m.outcome_names(), "predicted_ttft_s": m.ttft_s,
                             "predicted_age_s": m.handle_age_s, "predicted_pulled": m.pulled_tokens,
                             "predicted_local": m.local_tokens})
        both = rec.merge(pred, on=["session_id", "turn_index"], how="left").assign(speed_factor=factor)
        frames.append(both)
    if not frames:
        return pd.DataFrame(), pd.DataFrame()
    df = pd.concat(frames, ignore_index=True)
    ok = df["status"] == "ok"
    rec_o = [_text(v) for v in df["reuse"]]
    pred_o = [_text(v) for v in df["predicted_outcome"]]
    match = [(a == b) if s else None for a, b, s in zip(rec_o, pred_o, ok, strict=True)]

    def why(r) -> str | None:
        if r.outcome_match is None or bool(r.outcome_match):   # a match, or a failed turn (not checked)
            return None
        return (f"recorded {r.recorded_outcome} ({int(r.recorded_pulled_tokens)} tokens pulled, "
                f"{_count(r.recorded_local_tokens)} from P's cache), predicted {r.predicted_outcome} "
                f"({int(r.predicted_pulled_tokens)} pulled, {int(r.predicted_local_tokens)} from P's cache"
                + (f", handle {r.predicted_age_s:.1f} s old" if not np.isnan(r.predicted_age_s) else "") + ")")

    out = pd.DataFrame({"checked_run_id": df["run_id"], "mode": df["mode"], "session_id": df["session_id"],
                        "turn_index": df["turn_index"], "status": df["status"], "recorded_outcome": rec_o,
                        "predicted_outcome": pred_o, "outcome_match": match, "measured_ttft_s": df["ttft_s"],
                        "predicted_ttft_s": df["predicted_ttft_s"], "recorded_pulled_tokens": df["reused_tokens"],
                        "predicted_pulled_tokens": df["predicted_pulled"],
                        "recorded_local_tokens": df["local_tokens"], "predicted_local_tokens": df["predicted_local"],
                        "predicted_age_s": df["predicted_age_s"], "speed_factor": df["speed_factor"]})
    out["why"] = [why(r) for r in out.itertuples()]
    return out.drop(columns=["predicted_age_s"]), pd.concat(split, ignore_index=True)
