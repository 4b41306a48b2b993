"""The repeatability a forecast is judged against: the same workload recorded at another time, used
as the forecast of a run, turn by turn.

Why: the held-out targets (:data:`planner.held_out.TARGETS`) ask single turns and tails
to be forecast within 20-25%. On a shared machine a turn's TTFT varies from one recording to the
next with everything the model has no term for (another process on the core, a collection, the
machine's minute); a second recording of the same sessions, turn for turn, is the best forecast of
the first that no model of costs can beat on average. Its errors, in the held-out check's own
figures (:func:`planner.held_out.held_out_summary`), say how much of a model's miss is
the machine's (docs/log/held-out.md: repeatability).

Pairing: a checked run pairs with a forecast run of the same **recording set-up**
(:func:`setup_key`: mode, history mode, workload, the workload's session shape, a capacity step's
users, and the workers per role) and, where several runs share one, the same place among them
(oldest first by first turn sent); within a pair, turns by session id and turn index (the
workload's, which a ``turnscope eval`` of the same workload and seed repeats). Runs and turns without
a counterpart are left out, named and counted.

Units: seconds, tokens.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd

from planner.fit import topology_settings
from store.queries.planner_runs import run_rows
from store.writer import Store

#: The fields of ``runs.workload_spec`` that shape a workload's sessions (not its schedule, file
#: path or ramp id).
SESSION_FIELDS = ("gap_s", "max_prompt_tokens", "max_tokens", "max_turns", "sessions", "users", "time_scale")
#: The fields of a capacity step (``workload_spec.capacity``) that shape it.
CAPACITY_FIELDS = ("users", "sessions", "decode_kv_cache_bytes", "decoder_kv_blocks_ttl_s")


def setup_key(mode: str, history_mode: str | None, workload: str | None, spec: dict | None,
              topology: dict | None) -> str:
    """What two recordings must share to be paired, as one canonical JSON string: the mode, history
    mode, workload name, :data:`SESSION_FIELDS` of its spec, :data:`CAPACITY_FIELDS` of a capacity
    step, and the workers per role (:func:`planner.fit.topology_settings`)."""
    spec = spec or {}
    capacity = spec.get("capacity") or {}
    return json.dumps({"mode": mode, "history_mode": history_mode, "workload": workload,
                       "spec": {f: spec.get(f) for f in SESSION_FIELDS},
                       "capacity": {f: capacity.get(f) for f in CAPACITY_FIELDS} if capacity else None,
                       "workers": topology_settings(topology)}, sort_keys=True)


def _json(value) -> dict | None:
    return json.loads(value) if isinstance(value, str) else value


def run_setups(store: Store, run_ids: Sequence[str]) -> pd.DataFrame:
    """``run_id``, ``setup`` (:func:`setup_key`) and ``first_sent`` (its first turn, or its start) of
    each of ``run_ids``. Raises ValueError naming the ids the store does not have."""
    rows = run_rows(store, run_ids)
    unknown = [r for r in run_ids if r not in set(rows["run_id"])]
    if unknown:
        raise ValueError(f"store {store.root} has no run {', '.join(unknown)}")
    rows["setup"] = [setup_key(m, h, w, _json(s), _json(t)) for m, h, w, s, t in
                     zip(rows["mode"], rows["history_mode"], rows["workload"], rows["workload_spec"], rows["topology"],
                         strict=True)]
    return rows[["run_id", "setup", "first_sent"]]


def pair_runs(forecast_runs: pd.DataFrame, checked_runs: pd.DataFrame) -> pd.DataFrame:
    """Checked run -> forecast run (frames of :func:`run_setups`): the same setup, the same place
    among that setup's runs (oldest first). Columns: run_id (checked), forecast_run_id (None where
    none pairs)."""
    def placed(runs: pd.DataFrame) -> pd.DataFrame:
        runs = runs.sort_values(["first_sent", "run_id"])
        return runs.assign(place=runs.groupby("setup").cumcount())

    pairs = placed(checked_runs).merge(placed(forecast_runs)[["setup", "place", "run_id"]], on=["setup", "place"],
                                       how="left", suffixes=("", "_forecast"))
    return pairs.rename(columns={"run_id_forecast": "forecast_run_id"})[["run_id", "forecast_run_id"]]


@dataclass(frozen=True)
class RerunChecks:
    """:func:`rerun_checks`' result: ``checks`` (``plan_checks`` columns, see there), ``pairs``
    (:func:`pair_runs`), the checked runs no forecast run pairs with, and the checked turns of
    paired runs without a counterpart turn."""

    checks: pd.DataFrame
    pairs: pd.DataFrame
    unpaired_runs: list[str]
    turns_left_out: int

    def describe(self) -> str:
        """The pairing in words: pairs, turns paired (ok on both sides), what was left out."""
        ok = int((self.checks["status"] == "ok").sum())
        paired = self.pairs.dropna(subset=["forecast_run_id"])
        lines = ["  paired runs (checked <- forecast): "
                 + "; ".join(f"{r.run_id} <- {r.forecast_run_id}" for r in paired.itertuples()),
                 (f"  {len(self.checks)} checked turns paired with a forecast turn, {ok} ok on both sides; "
                  f"{self.turns_left_out} without a counterpart.")]
        if self.unpaired_runs:
            lines.append(f"  checked runs with no forecast run of the same set-up (left out): {', '.join(self.unpaired_runs)}")
        return "\n".join(lines)


def rerun_checks(forecast_turns: pd.DataFrame, checked_turns: pd.DataFrame, pairs: pd.DataFrame) -> RerunChecks:
    """The turns of ``checked_turns`` with those of ``forecast_turns`` as their forecast (both frames
    of :func:`store.queries.planner_runs.recorded_turns`), the runs paired as ``pairs`` says
    (:func:`pair_runs`) and the turns by session id and turn index.

    ``checks`` has the columns :func:`planner.held_out.held_out_summary` reads
    (``plan_checks``' names: checked_run_id, mode, session_id, turn_index, status, recorded_outcome,
    predicted_outcome, outcome_match, measured_ttft_s, predicted_ttft_s, recorded_pulled_tokens,
    predicted_pulled_tokens); status ``ok`` only where both turns are. Raises ValueError when no
    turn pairs up."""
    paired = pairs.dropna(subset=["forecast_run_id"])
    b = checked_turns.merge(paired, on="run_id")
    a = forecast_turns.rename(columns={"run_id": "forecast_run_id"})
    both = b.merge(a, on=["forecast_run_id", "session_id", "turn_index"], suffixes=("", "_f"))
    if both.empty:
        raise ValueError("no turn of the checked runs has a counterpart: no forecast run was recorded with the same "
                         "set-up (mode, history mode, workload and its sessions, workers per role), or their session "
                         "ids and turn indexes differ")
    ok = (both["status"] == "ok") & (both["status_f"] == "ok") & both["ttft_s"].notna() & both["ttft_s_f"].notna()
    recorded = [None if pd.isna(v) else str(v) for v in both["reuse"]]
    predicted = [None if pd.isna(v) else str(v) for v in both["reuse_f"]]
    checks = pd.DataFrame({
        "checked_run_id": both["run_id"], "mode": both["mode"], "session_id": both["session_id"],
        "turn_index": both["turn_index"], "status": ok.map({True: "ok", False: "failed"}),
        "recorded_outcome": recorded, "predicted_outcome": predicted,
        "outcome_match": [(r == p) if k else None for r, p, k in zip(recorded, predicted, ok, strict=True)],
        "measured_ttft_s": both["ttft_s"], "predicted_ttft_s": both["ttft_s_f"],
        "recorded_pulled_tokens": both["reused_tokens"], "predicted_pulled_tokens": both["reused_tokens_f"]})
    unpaired = sorted(pairs.loc[pairs["forecast_run_id"].isna(), "run_id"])
    return RerunChecks(checks, pairs, unpaired, len(b) - len(both))
