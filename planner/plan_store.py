"""Writes a plan (a FORECAST) to the store: tables plan_log, plan_requests, plan_speedups,
plan_frontier, plan_sessions and plan_checks (docs/schema/plans.md), under ``runs/<plan_id>/``; and a
recommendation (``turnscope recommend --store``): plan_log, plan_ledger and plan_recommendations; and a
fleet plan (the fleet search): plan_log, plan_fleets and plan_load_curve."""

from __future__ import annotations

import datetime as dt
import math
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

import pandas as pd

from core.contract import Role
from store.writer import Store

if TYPE_CHECKING:  # the dashboard reads this module's load units without the simulator (and its loadgen)
    from planner.simulate import Plan


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
    :func:`planner.ledger.ledger`), the ``plan_recommendations`` row
    (:func:`planner.recommend.recommendation_row`), and the ``plan_fleets`` and
    ``plan_load_curve`` rows (:func:`planner.fleet.fleet_row`, :func:`~planner.fleet.curve_row`;
    checked as :func:`write_fleet_plan` checks them, and their load stated in ``plan_log`` as it states it).

    Raises ValueError as :func:`write_fleet_plan` for fleet or curve rows off the contract."""
    store.init()
    forecast_label = profile.label()
    if fleets:
        kind, value, load_label = check_fleet_rows(store, list(fleets), list(curve))
        notes = [f"Load: {(load_label or load_words(kind, value)).rstrip('.')}.", *notes]
        forecast_label = f"{profile.label()} at {load_words(kind, value)}"
    with store.writer(plan_id, "planner") as w:
        w.append("plan_log", {"plan_id": plan_id, "label": label, "created_at": dt.datetime.now(dt.UTC),
                              "inputs": inputs, "profile_name": profile.name,
                              "profile": profile.model_dump(mode="json"),
                              "settings": settings.model_dump(mode="json"), "notes": notes,
                              "requests": requests, "forecast_label": forecast_label})
        for row in _rows(ledger, ("later_requests", "reused_tokens", "host_read_tokens", "d_full_events")):
            w.append("plan_ledger", {"plan_id": plan_id} | row)
        w.append("plan_recommendations", {"plan_id": plan_id} | {k: _clean(v) for k, v in recommendation.items()})
        for table, rows in (("plan_fleets", fleets), ("plan_load_curve", curve)):
            for row in rows:
                w.append(table, {"plan_id": plan_id} | {k: _clean(v) for k, v in row.items()})


#: ``plan_fleets.load_kind`` values: new sessions per hour, concurrent sessions, or the recorded
#: clock sped up by a factor.
SESSIONS_PER_HOUR, CONCURRENT_SESSIONS, RECORDED_CLOCK = "sessions_per_hour", "concurrent_sessions", "recorded"
#: ``plan_fleets.load_kind`` -> the load's unit in words (the Plan page's load axis).
LOAD_UNITS: dict[str, str] = {
    SESSIONS_PER_HOUR: "new sessions per hour",
    CONCURRENT_SESSIONS: "concurrent sessions",
    RECORDED_CLOCK: "x the recorded rate",
}
#: The roles a fleet can be overloaded in (``overload_role``).
OVERLOAD_ROLES: tuple[str, ...] = (Role.PREFILL, Role.DECODE)
#: Columns every fleet and every curve row has in common with its plan (one load and SLO per plan).
_PLAN_WIDE = ("load_kind", "load_value", "load_label", "slo_ttft_p90_s")


def _columns(store: Store, table: str) -> tuple[str, ...]:
    """``table``'s columns in data/schema.sql, ``plan_id`` aside."""
    return tuple(c.name for c in store.schema.tables[table].columns if c.name != "plan_id")


def _check_rows(rows: list[dict], columns: tuple[str, ...], what: str) -> None:
    """Each row has exactly ``columns``; its load kind and overload are coherent. Raises ValueError
    naming the row and what is wrong."""
    for i, row in enumerate(rows):
        missing = [c for c in columns if c not in row]
        unknown = [c for c in row if c not in columns]
        if missing or unknown:
            raise ValueError(f"{what} row {i}: " + "; ".join(
                part for part in (f"missing column(s) {', '.join(missing)}" if missing else "",
                                  f"unknown column(s) {', '.join(unknown)}" if unknown else "") if part)
                + f" (the columns: {', '.join(columns)})")
        if row["load_kind"] not in LOAD_UNITS:
            raise ValueError(f"{what} row {i}: load_kind {row['load_kind']!r} is none of {', '.join(LOAD_UNITS)}")
        role = _clean(row["overload_role"])
        if role is not None and role not in OVERLOAD_ROLES:
            raise ValueError(f"{what} row {i}: overload_role {role!r} is none of {', '.join(OVERLOAD_ROLES)}")
        if bool(row["overloaded"]):
            if role is None:   # the factor may be None: an overload found by a queue that never drains
                raise ValueError(f"{what} row {i}: overloaded without its overload_role")
            if _clean(row["ttft_p50_s"]) is not None or _clean(row["ttft_p90_s"]) is not None:
                raise ValueError(f"{what} row {i}: overloaded, so its TTFTs must be None (no queue settles)")
            if bool(row.get("meets_slo")):
                raise ValueError(f"{what} row {i}: overloaded, so it cannot meet the SLO")
        elif role is not None or _clean(row["overload_factor"]) is not None:
            raise ValueError(f"{what} row {i}: not overloaded, so overload_role and overload_factor must be None")


def load_words(kind: str, value: float) -> str:
    """The load in a few words: ``100 new sessions per hour``, ``64 concurrent sessions``, ``the
    recorded clock sped up 2x``."""
    if kind == RECORDED_CLOCK:
        return "the recorded clock" if value == 1 else f"the recorded clock sped up {value:,.4g}x"
    return f"{value:,.4g} {LOAD_UNITS.get(kind, kind)}"


def check_fleet_rows(store: Store, fleets: list[dict], curve: list[dict]) -> tuple[str, float, str | None]:
    """The checks of :func:`write_fleet_plan` on its rows; returns the plan's load (kind, value, label).
    Raises ValueError as it documents."""
    fleet_cols, curve_cols = _columns(store, "plan_fleets"), _columns(store, "plan_load_curve")
    if not fleets:
        raise ValueError("a fleet plan needs at least one plan_fleets row (it states the load)")
    _check_rows(fleets, fleet_cols, "plan_fleets")
    _check_rows(curve, curve_cols, "plan_load_curve")
    wide = {tuple(_clean(f[c]) for c in _PLAN_WIDE) for f in fleets}
    if len(wide) != 1:
        raise ValueError(f"plan_fleets rows of more than one load or SLO ({', '.join(_PLAN_WIDE)}): {sorted(wide, key=str)}")
    if sum(bool(f["recommended"]) for f in fleets) > 1:
        raise ValueError("more than one plan_fleets row is recommended (at most one per plan)")
    kind, value, load_label, _ = next(iter(wide))
    return kind, value, load_label


def write_fleet_plan(store: Store, *, plan_id: str, label: str | None, inputs: list[dict], profile, settings,
                     notes: list[str], requests: int, fleets: list[dict], curve: list[dict]) -> None:
    """Append one fleet plan: its ``plan_log`` row (``profile``: a CostProfile, ``settings``: the
    PlanSettings searched from; ``requests``: requests planned at the load), the ``plan_fleets``
    rows (one per strategy) and the ``plan_load_curve`` rows (docs/schema/plans.md: seconds, bytes,
    GiB x s, USD per million tokens).

    Every row of ``fleets`` and ``curve`` is a dict with exactly its table's columns but
    ``plan_id``; the fleets share one load (``load_kind``, ``load_value``, ``load_label``) and one
    SLO (``slo_ttft_p90_s``, seconds; None: none, the smallest fleet that keeps up). An overloaded
    row has no TTFT and names its ``overload_role``; its ``overload_factor`` may be None (an overload
    found by a queue that never drains has no factor). The load is stated in the plan's ``forecast_label``
    (``FORECAST (profile <name>) at 100 new sessions per hour``) and, in words
    (``load_label``), as the first of its notes.

    Raises:
        ValueError: a row with a missing or unknown column (named), a load kind or overload role
            not in the contract, an overloaded row with a TTFT, without its role or meeting the SLO, fleets
            of more than one load or SLO, none, or more than one recommended.
    """
    store.init()
    kind, value, load_label = check_fleet_rows(store, fleets, curve)
    with store.writer(plan_id, "planner") as w:
        w.append("plan_log", {"plan_id": plan_id, "label": label, "created_at": dt.datetime.now(dt.UTC),
                              "inputs": inputs, "profile_name": profile.name,
                              "profile": profile.model_dump(mode="json"),
                              "settings": settings.model_dump(mode="json"),
                              "notes": [f"Load: {(load_label or load_words(kind, value)).rstrip('.')}.", *notes],
                              "requests": requests,
                              "forecast_label": f"{profile.label()} at {load_words(kind, value)}"})
        for table, rows in (("plan_fleets", fleets), ("plan_load_curve", curve)):
            for row in rows:
                w.append(table, {"plan_id": plan_id} | {k: _clean(v) for k, v in row.items()})
