"""Writes a plan (a FORECAST) to the store: tables plan_log, plan_requests, plan_speedups,
plan_frontier, plan_sessions and plan_checks (docs/schema/plans.md), under ``runs/<plan_id>/``; and a
recommendation (``turnscope recommend --store``): plan_log, plan_ledger and plan_recommendations."""

from __future__ import annotations

import datetime as dt
import math
import uuid
from collections.abc import Sequence

import pandas as pd

from turnscope.core.store import Store
from turnscope.planner.simulate import Plan


def new_plan_id() -> str:
    """``plan-<UTC time>-<hex>``."""
    return f"plan-{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:6]}"


def _clean(v):
    if v is None:
        return None
    if isinstance(v, float) and math.isnan(v):
        return None
    if hasattr(v, "item"):
        v = v.item()
        if isinstance(v, float) and math.isnan(v):
            return None
    return v


def _rows(df: pd.DataFrame, ints: Sequence[str] = ()) -> list[dict]:
    out = []
    for rec in df.to_dict("records"):
        row = {k: _clean(v) for k, v in rec.items()}
        for k in ints:
            if row.get(k) is not None:
                row[k] = int(row[k])
        out.append(row)
    return out


def write_plan(store: Store, p: Plan, *, plan_id: str, label: str | None, inputs: list[dict],
               speedups: pd.DataFrame, frontiers: pd.DataFrame, sessions: pd.DataFrame,
               checks: pd.DataFrame | None = None) -> None:
    """Append every row of one plan. ``frontiers``/``sessions`` carry a ``mode`` column."""
    store.init()
    tr = p.traffic
    with store.writer(plan_id, "planner") as w:
        w.append("plan_log", {"plan_id": plan_id, "label": label, "created_at": dt.datetime.now(dt.UTC),
                              "inputs": inputs, "profile_name": p.profile.name,
                              "profile": p.profile.model_dump(mode="json"),
                              "settings": p.settings.model_dump(mode="json"), "notes": p.notes,
                              "requests": len(tr), "forecast_label": p.profile.label()})
        for mode, m in p.modes.items():
            names = m.outcome_names()
            rec = m.recomputed_tokens
            for i in range(len(tr)):
                age = float(m.handle_age_s[i])
                w.append("plan_requests", {
                    "plan_id": plan_id, "mode": mode, "source": str(tr.source[i]), "session_id": str(tr.session[i]),
                    "request_index": int(tr.request_index[i]), "arrival_s": float(tr.arrival_s[i]),
                    "input_tokens": int(tr.input_tokens[i]), "shared_prefix_tokens": int(tr.shared_prefix_tokens[i]),
                    "outcome": names[i], "pulled_tokens": int(m.pulled_tokens[i]),
                    "local_tokens": int(m.local_tokens[i]), "recomputed_tokens": int(rec[i]),
                    "handle_age_s": None if math.isnan(age) else age, "ttft_s": float(m.ttft_s[i]),
                    "queue_wait_s": float(m.queue_wait_s[i]),
                    "decode_wait_s": float(m.decode_wait_s[i]) if m.decode_wait_s.size else 0.0})
        for row in _rows(speedups, ("requests", "later_requests", "treatment_hits")):
            w.append("plan_speedups", {"plan_id": plan_id} | row)
        for row in _rows(frontiers, ("d_full_events",)):
            w.append("plan_frontier", {"plan_id": plan_id} | row)
        for row in _rows(sessions, ("requests", "expired", "mismatched", "d_full", "consumed", "lost_tokens")):
            w.append("plan_sessions", {"plan_id": plan_id} | row)
        if checks is not None and not checks.empty:
            for row in _rows(checks, ("turn_index", "recorded_pulled_tokens", "predicted_pulled_tokens",
                                      "recorded_local_tokens", "predicted_local_tokens")):
                row["outcome_match"] = None if row["outcome_match"] is None else bool(row["outcome_match"])
                w.append("plan_checks", {"plan_id": plan_id} | row)


def write_recommendation(store: Store, *, plan_id: str, label: str | None, inputs: list[dict], profile, settings,
                         notes: list[str], requests: int, ledger: pd.DataFrame, recommendation: dict,
                         fleets: Sequence[dict] = (), curve: Sequence[dict] = ()) -> None:
    """Append one recommendation: its ``plan_log`` row (``profile``: a CostProfile, ``settings``:
    the PlanSettings of the current setting), the ``plan_ledger`` rows (``ledger``:
    :func:`turnscope.planner.ledger.ledger`), the ``plan_recommendations`` row
    (:func:`turnscope.planner.recommend.recommendation_row`), and the ``plan_fleets`` and
    ``plan_load_curve`` rows (:func:`turnscope.planner.fleet.fleet_row`, :func:`~turnscope.planner.fleet.curve_row`)."""
    store.init()
    with store.writer(plan_id, "planner") as w:
        w.append("plan_log", {"plan_id": plan_id, "label": label, "created_at": dt.datetime.now(dt.UTC),
                              "inputs": inputs, "profile_name": profile.name,
                              "profile": profile.model_dump(mode="json"),
                              "settings": settings.model_dump(mode="json"), "notes": notes,
                              "requests": requests, "forecast_label": profile.label()})
        for row in _rows(ledger, ("later_requests", "reused_tokens", "host_read_tokens", "d_full_events")):
            w.append("plan_ledger", {"plan_id": plan_id} | row)
        w.append("plan_recommendations", {"plan_id": plan_id} | {k: _clean(v) for k, v in recommendation.items()})
        for table, rows in (("plan_fleets", fleets), ("plan_load_curve", curve)):
            for row in rows:
                w.append(table, {"plan_id": plan_id} | {k: _clean(v) for k, v in row.items()})
