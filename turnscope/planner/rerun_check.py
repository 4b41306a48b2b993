"""The repeatability a forecast is judged against: the same workload recorded at another time, used
as the forecast of a run, turn by turn.

Why: the held-out targets (:data:`turnscope.planner.held_out.TARGETS`) ask single turns and tails
to be forecast within 20-25%. On a shared machine a turn's TTFT varies from one recording to the
next with everything the model has no term for (another process on the core, a collection, the
machine's minute); a second recording of the same sessions, turn for turn, is the best forecast of
the first that no model of costs can beat on average. Its errors, in the held-out check's own
figures (:func:`turnscope.planner.held_out.held_out_summary`), say how much of a model's miss is
the machine's (docs/planner.md, "Held-out check of the shipped profile": repeatability).

Pairing: a run of the checked store with the run of the forecast store in the same mode and
history mode (``runs.history_mode``) at the same place among those (oldest first: a capacity ramp's
steps pair up in order); within a pair, turns by session id and turn index (the workload's, which a
``turnscope eval`` of the same workload and seed repeats). Turns without a counterpart are left
out, and counted.

Units: seconds, tokens.
"""

from __future__ import annotations

import pandas as pd

#: The columns a pair of turns is matched on.
PAIR_KEYS = ["mode", "history_mode", "place", "session_id", "turn_index"]


def _placed(turns: pd.DataFrame) -> pd.DataFrame:
    """``turns`` (:data:`turnscope.planner.fit.TURNS_SQL` columns) with ``place``: the run's rank
    among the runs of its mode and history mode, by its first turn sent (0: oldest)."""
    first = turns.groupby("run_id", as_index=False).agg(mode=("mode", "first"), history_mode=("history_mode", "first"),
                                                        first_sent=("sent_at", "min"))
    first["place"] = first.sort_values(["first_sent", "run_id"]).groupby(["mode", "history_mode"]).cumcount()
    return turns.merge(first[["run_id", "place"]], on="run_id")


def rerun_checks(forecast_turns: pd.DataFrame, checked_turns: pd.DataFrame) -> tuple[pd.DataFrame, int]:
    """The turns of ``checked_turns`` with those of ``forecast_turns`` as their forecast (both frames
    of :func:`turnscope.planner.fit.recorded_turns`; pairing in the module doc).

    Returns (the checks, in the columns :func:`turnscope.planner.held_out.held_out_summary` reads
    (``plan_checks``' names: checked_run_id, mode, session_id, turn_index, status, recorded_outcome,
    predicted_outcome, outcome_match, measured_ttft_s, predicted_ttft_s, recorded_pulled_tokens,
    predicted_pulled_tokens; status ``ok`` only where both turns are), the number of checked turns
    left out for want of a counterpart). Raises ValueError when no turn pairs up."""
    a, b = _placed(forecast_turns), _placed(checked_turns)
    both = b.merge(a, on=PAIR_KEYS, suffixes=("", "_f"))
    if both.empty:
        raise ValueError("no turn of the checked runs has a counterpart in the forecast runs (same mode, history "
                         "mode, place among those runs, session id and turn index)")
    ok = (both["status"] == "ok") & (both["status_f"] == "ok")
    recorded = [None if pd.isna(v) else str(v) for v in both["reuse"]]
    predicted = [None if pd.isna(v) else str(v) for v in both["reuse_f"]]
    checks = pd.DataFrame({
        "checked_run_id": both["run_id"], "mode": both["mode"], "session_id": both["session_id"],
        "turn_index": both["turn_index"], "status": ok.map({True: "ok", False: "failed"}),
        "recorded_outcome": recorded, "predicted_outcome": predicted,
        "outcome_match": [(r == p) if k else None for r, p, k in zip(recorded, predicted, ok, strict=True)],
        "measured_ttft_s": both["ttft_s"], "predicted_ttft_s": both["ttft_s_f"],
        "recorded_pulled_tokens": both["reused_tokens"], "predicted_pulled_tokens": both["reused_tokens_f"]})
    return checks, len(b) - len(both)
