"""The store's own recorded runs as :class:`AgentRequest` records (turns rows -> requests).

A run recorded by turnscope (docs/schema/tables.md, tables ``turns`` and ``sessions``) is traffic too:
this adapter reads its turns back so the traffic report and the planner treat it like any trace.

Per turn row (one run = one source ``run:<run_id>``, one clock: seconds since the run's first
``sent_at``):

* ``session_id``, ``request_index`` = ``turn_index``, ``arrival_s`` from ``sent_at``;
* ``input_tokens`` / ``output_tokens`` = ``prompt_tokens`` / ``completion_tokens`` (NULL -> 0:
  a failed turn may have none);
* ``shared_prefix_tokens`` = ``expected_reusable_tokens`` (the longest common prefix of the previous
  request's prompt + output ids and this prompt's ids, computed by the client for every turn: a
  client that rewrites its history, e.g. strips the reasoning of earlier replies, shares only the
  previous prompt, and the planner's pulls are cut to it), else 0 (ids unknown);
* ``server_s`` = ``e2e_s``, ``ttft_s`` = ``turns.ttft_s``; ``gap_s`` = this ``sent_at`` minus the previous turn's ``sent_at`` +
  ``e2e_s`` (the measured client time), clipped to ``[0, start to start]``
  (:func:`~loadgen.traces.agent_request.bounded_gap`). When the previous turn has no ``e2e_s`` (it
  failed or timed out) its end is not recorded: ``gap_s`` is the planned ``gap_before_s`` (what the
  client waits after a turn ends, failed or not), else the start-to-start bound, clipped the same
  way, with ``gap_estimated`` True;
* ``gap_kind`` = ``turns.gap_kind`` (``none`` -> None), ``tool_s`` = ``gap_s`` for ``tool`` gaps.

Reads through the store's DuckDB views (read-only, :func:`store.queries.recorded_runs.turn_batches`),
so it works on a store other writers are appending to.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

from loadgen.traces.agent_request import AgentRequest, bounded_gap
from store.queries import recorded_runs
from store.writer import Store

FORMAT = "run"

def _gap(arrival_s: float, prev_arrival_s: float, measured_s: float | None,
         planned_s: float | None) -> tuple[float, bool]:
    """(gap_s, gap_estimated) of a follow-up turn, seconds (see the module doc)."""
    start_to_start = arrival_s - prev_arrival_s
    if measured_s is not None:
        return bounded_gap(measured_s, start_to_start), False
    return bounded_gap(start_to_start if planned_s is None else planned_s, start_to_start), True


def iter_recorded_runs(store_root: Path | str, run_ids: Sequence[str] | None = None) -> Iterator[AgentRequest]:
    """Stream the turns of ``run_ids`` (default: every run in the store) as AgentRequests.

    Args:
        store_root: the store directory (``turnscope.duckdb`` and ``runs/``), e.g. ``data/``.
        run_ids: the runs to read; an unknown id yields nothing.

    Raises:
        FileNotFoundError: the store has no ``turnscope.duckdb`` (run ``turnscope init`` or any run
            first); the message names the path.
    """
    store = Store(Path(store_root))
    if not store.db_path.exists():
        raise FileNotFoundError(f"{store.db_path}: no turnscope store here (expected turnscope.duckdb "
                                f"with the views; any turnscope run creates it)")
    con = store.connect(read_only=True)
    try:
        for batch in recorded_runs.turn_batches(con, run_ids):
            for (run_id, sid, ti, arr, n_in, n_out, shared, e2e, mgap, planned, gkind, prev_arr, ttft) in batch:
                first = prev_arr is None
                gap, estimated = (None, False) if first else _gap(float(arr), float(prev_arr), mgap, planned)
                kind = None if first or gkind in (None, "none") else gkind
                yield AgentRequest(
                    source=f"run:{run_id}", session_id=sid, request_index=int(ti), arrival_s=float(arr),
                    input_tokens=int(n_in), output_tokens=int(n_out), shared_prefix_tokens=int(shared),
                    server_s=e2e, gap_s=gap, tool_s=gap if kind == "tool" else None, gap_kind=kind,
                    gap_estimated=estimated, ttft_s=ttft,
                )
    finally:
        con.close()


def read_recorded_runs(store_root: Path | str, run_ids: Sequence[str] | None = None) -> list[AgentRequest]:
    """All requests of ``run_ids`` (default: every run), per run in arrival order. Raises as
    :func:`iter_recorded_runs`."""
    return list(iter_recorded_runs(store_root, run_ids))
