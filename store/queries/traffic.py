"""Queries of the Traffic page and of ``turnscope traffic``'s report (:func:`report`): the store's
traffic views (docs/schema/traffic.md).

Each function takes a DuckDB connection and returns a DataFrame; the page calls them through
``dashboard.loader.load`` (cached). Not re-exported by ``store.queries``: the page names them
``traffic.<function>``, since several (``summary``, ``sessions``) would clash there.
"""

from __future__ import annotations

from typing import Any

import duckdb
import pandas as pd


def reports(con: duckdb.DuckDBPyConnection) -> pd.DataFrame:
    """Every traffic report, newest first: id, label, created_at, inputs, ttl_s, threshold."""
    return con.execute("SELECT * FROM traffic_log ORDER BY created_at DESC").df()


def summary(con: duckdb.DuckDBPyConnection, traffic_id: str) -> pd.DataFrame:
    """One row: sources, sessions, sub-agents, requests, context medians and overlap."""
    return con.execute("""
        SELECT count(DISTINCT source) AS sources, count(*) AS sessions,
               count(*) FILTER (WHERE parent_session_id IS NOT NULL) AS sub_agents,
               sum(requests) AS requests, quantile_cont(max_input_tokens, 0.5) AS max_context_p50_tokens,
               max(max_input_tokens) AS max_context_tokens,
               (SELECT sum(overlapping_sessions) FROM traffic_overlap WHERE traffic_id = $1) AS overlapping_sessions,
               (SELECT max(max_active_sessions) FROM traffic_overlap WHERE traffic_id = $1) AS max_active_sessions
        FROM traffic_sessions WHERE traffic_id = $1""", [traffic_id]).df()


def reuse(con: duckdb.DuckDBPyConnection, traffic_id: str) -> pd.DataFrame:
    """``traffic_reuse`` rows of the report (format NULL: all formats)."""
    return con.execute("SELECT * FROM traffic_reuse WHERE traffic_id = ? ORDER BY format NULLS FIRST",
                       [traffic_id]).df()


def ttl(con: duckdb.DuckDBPyConnection, traffic_id: str) -> pd.DataFrame:
    """``traffic_ttl`` rows of the report: share of follow-ups within each TTL, per gap kind."""
    return con.execute("SELECT * FROM traffic_ttl WHERE traffic_id = ? ORDER BY gap_kind, ttl_s", [traffic_id]).df()


def gaps(con: duckdb.DuckDBPyConnection, traffic_id: str) -> pd.DataFrame:
    """Every follow-up's gap and kind (for the distribution), seconds, and whether it is estimated."""
    return con.execute("SELECT gap_kind, gap_s, gap_estimated FROM traffic_followups WHERE traffic_id = ?",
                       [traffic_id]).df()


def sessions(con: duckdb.DuckDBPyConnection, traffic_id: str, limit: int = 2000) -> pd.DataFrame:
    """Sessions of the report, most requests first (at most ``limit``): span and context growth."""
    return con.execute("SELECT * FROM traffic_sessions WHERE traffic_id = ? ORDER BY requests DESC, session_id "
                       "LIMIT ?", [traffic_id, limit]).df()


def context_growth(con: duckdb.DuckDBPyConnection, traffic_id: str, limit: int = 40) -> pd.DataFrame:
    """Prompt tokens by request index of the ``limit`` sessions with the most requests."""
    return con.execute("""
        SELECT r.session_id, r.request_index, r.input_tokens, r.shared_prefix_tokens
        FROM traffic_requests r
        JOIN (SELECT source, session_id FROM traffic_sessions WHERE traffic_id = $1
              ORDER BY requests DESC, session_id LIMIT $2) s USING (source, session_id)
        WHERE r.traffic_id = $1 ORDER BY r.session_id, r.request_index""", [traffic_id, limit]).df()


def timeline(con: duckdb.DuckDBPyConnection, traffic_id: str, source: str, session_id: str) -> pd.DataFrame:
    """``traffic_timeline`` of one session and of its sub-agents (their parent is the session)."""
    return con.execute("""
        SELECT * FROM traffic_timeline
        WHERE traffic_id = ? AND source = ? AND (session_id = ? OR parent_session_id = ?)
        ORDER BY parent_session_id NULLS FIRST, session_id, start_s""",
                       [traffic_id, source, session_id, session_id]).df()


def trace_reuse(con: duckdb.DuckDBPyConnection, run_ids: tuple[str, ...]) -> pd.DataFrame:
    """Turns of replayed traces (``trace_reusable_tokens`` set, after the first) of ``run_ids``: the
    trace's reusable tokens (scaled), the client's expected and the engine's measured reuse."""
    if not run_ids:
        return pd.DataFrame()
    return con.execute("""
        SELECT run_id, run_label, mode, session_id, turn_index, reuse, prompt_tokens, trace_reusable_tokens,
               expected_reusable_tokens, measured_reused_tokens
        FROM turn_breakdown
        WHERE run_id IN (SELECT unnest(?)) AND trace_reusable_tokens IS NOT NULL AND turn_index > 0
          AND status = 'ok'
        ORDER BY run_id, session_id, turn_index""", [list(run_ids)]).df()


def input_paths(inputs: object) -> list[str]:
    """The paths (with their format) a report read, from ``traffic_log.inputs`` (JSON text or a
    list of {"path", "format"}); a value it cannot read comes back as its text."""
    import json

    items = json.loads(inputs) if isinstance(inputs, str) else inputs
    if not isinstance(items, list):
        return [str(inputs)]
    return [f"{i.get('path')} ({i.get('format')})" if isinstance(i, dict) else str(i) for i in items]


def report_name(label: object, inputs: object, created_at: object, traffic_id: str) -> str:
    """A report as listed: its label (else its id), its sources (the last part of each input path)
    and its time, e.g. ``kv-cache-tester · kv-cache-tester · 2026-12-01 09:00 UTC``."""
    from pathlib import PurePath

    paths = input_paths(inputs)
    sources = ", ".join(PurePath(p.rsplit(" (", 1)[0]).name for p in paths[:3]) + (
        f" +{len(paths) - 3} more" if len(paths) > 3 else "")
    when = pd.Timestamp(created_at).strftime("%Y-%m-%d %H:%M UTC") if created_at is not None else "?"
    return f"{label if isinstance(label, str) and label else traffic_id} · {sources} · {when}"


def report(con: duckdb.DuckDBPyConnection, traffic_id: str) -> dict[str, Any]:
    """The traffic views of one report as ``turnscope traffic`` prints it (``loadgen.traffic.TrafficReport``),
    rows as dicts: ``summary`` (sessions, requests, context and input-token medians, the TTL and
    threshold), ``overlap``, ``inputs`` (the ``traffic_log.inputs`` JSON text), ``recorded_load``
    (sessions started and the arrivals' span, s) and the rows of ``reuse``, ``gaps`` and ``ttl``.
    """
    def rows(sql: str) -> list[dict[str, Any]]:
        cur = con.execute(sql, [traffic_id])
        names = [d[0] for d in cur.description]
        return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]

    summary = rows("""
        SELECT count(DISTINCT source) AS sources, count(*) AS sessions,
               count(*) FILTER (WHERE parent_session_id IS NOT NULL) AS sub_agents,
               sum(requests) AS requests,
               quantile_cont(requests, 0.5) AS requests_per_session_p50,
               quantile_cont(max_input_tokens, 0.5) AS max_context_p50_tokens,
               max(max_input_tokens) AS max_context_tokens,
               quantile_cont(growth_tokens_per_request, 0.5) AS growth_p50_tokens_per_request
        FROM traffic_sessions WHERE traffic_id = ?""")[0]
    summary |= rows("""
        SELECT quantile_cont(input_tokens, 0.5) AS input_p50_tokens,
               quantile_cont(input_tokens, 0.9) AS input_p90_tokens
        FROM traffic_requests WHERE traffic_id = ?""")[0]
    summary |= rows("SELECT ttl_s, recompute_threshold_tokens FROM traffic_log WHERE traffic_id = ?")[0]
    overlap = rows("""
        SELECT max(max_active_sessions) AS max_active_sessions,
               sum(overlapping_sessions) AS overlapping_sessions, sum(sessions) AS sessions
        FROM traffic_overlap WHERE traffic_id = ?""")[0]
    inputs = rows("SELECT inputs FROM traffic_log WHERE traffic_id = ?")[0]["inputs"]
    # the load a shared-clock trace recorded: its sessions' starts over the span of its arrivals
    recorded = rows("""
        SELECT count(*) FILTER (WHERE request_index = 0 AND parent_session_id IS NULL) AS sessions_started,
               max(arrival_s) - min(arrival_s) AS span_s
        FROM traffic_requests WHERE traffic_id = ?""")[0]
    return {"summary": summary, "overlap": overlap, "inputs": inputs, "recorded_load": recorded,
            "reuse": rows("SELECT * FROM traffic_reuse WHERE traffic_id = ? ORDER BY format NULLS FIRST"),
            "gaps": rows("SELECT * FROM traffic_gaps WHERE traffic_id = ? ORDER BY gap_kind"),
            "ttl": rows("SELECT * FROM traffic_ttl WHERE traffic_id = ? ORDER BY gap_kind, ttl_s")}
