"""The traffic report: what a trace says about KV reuse across turns, before anything is served.

``turnscope traffic PATH...`` (and :func:`build_report`) streams every request of the given traces
(:mod:`loadgen.traces.formats`: kv-cache-tester, TraceLab, Mooncake, Azure, or the store's
own recorded runs) into the store as one ``traffic_requests`` Parquet shard per report (row groups
of :data:`BATCH_ROWS`, so memory holds one batch, not the trace) plus a ``traffic_log`` row; the
statistics are the store's SQL views (data/schema.sql, docs/schema/traffic.md), computed by
DuckDB: sessions and requests, context growth per session, the gap distribution by kind against
TTLs of 30 s ... 1 h (the configured one marked), reusable vs new input tokens, sessions
overlapping in time, and one session's timeline. :class:`TrafficReport` reads them back and prints
them.

Defaults: ``ttl_s`` 480 s is vLLM's ``decoder_kv_blocks_ttl`` and ``recompute_threshold_tokens`` 64
is its ``kv_recompute_threshold`` (``core.contract``, docs/configuration.md); the CLI
passes the operator's settings.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import tempfile
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from core.contract import DECODER_KV_BLOCKS_TTL_S, KV_RECOMPUTE_THRESHOLD_TOKENS
from loadgen.traces.agent_request import AgentRequest
from loadgen.traces.errors import TraceFormatError
from loadgen.traces.formats import FORMATS, OWN_CLOCK, detect_format, iter_agent_requests, trace_format
from store import db
from store.queries import traffic as traffic_queries
from store.writer import Store

#: vLLM's decoder_kv_blocks_ttl default (seconds) and kv_recompute_threshold default (tokens), as
#: core.contract defines them (one definition, also core.connector.Connector's defaults).
DEFAULT_TTL_S = float(DECODER_KV_BLOCKS_TTL_S)
DEFAULT_RECOMPUTE_THRESHOLD_TOKENS = KV_RECOMPUTE_THRESHOLD_TOKENS
#: Rows per Parquet row group written (and held in memory) at a time.
BATCH_ROWS = 65_536
#: DuckDB's memory limit for the report's queries (it spills to disk past it).
QUERY_MEMORY_LIMIT = "256MB"
_FIELDS = ("source", "session_id", "parent_session_id", "request_index", "arrival_s", "input_tokens",
           "output_tokens", "shared_prefix_tokens", "server_s", "gap_s", "gap_kind", "tool_s", "gap_estimated")


def new_traffic_id() -> str:
    """A fresh report id, ``traffic-<UTC time>-<6 hex>`` (a safe store path component)."""
    return f"traffic-{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:6]}"


class TrafficWriter:
    """Streams AgentRequests into one ``traffic_requests`` shard of a store (see the module doc).

    The shard is written to ``runs/<traffic_id>/traffic_requests/<name>.parquet.tmp`` and renamed
    into place by :meth:`close`, so readers never see a partial file. Memory: one batch of rows.
    """

    def __init__(self, store: Store, traffic_id: str):
        self.store = store
        self.traffic_id = traffic_id
        self.schema = store.schema.tables["traffic_requests"].arrow_schema()
        d = store.root / "runs" / traffic_id / "traffic_requests"
        d.mkdir(parents=True, exist_ok=True)
        self.path = d / f"traffic-{uuid.uuid4().hex[:8]}-0.parquet"
        self._tmp = self.path.with_name(self.path.name + ".tmp")
        self._writer = pq.ParquetWriter(self._tmp, self.schema)
        self._cols: dict[str, list[Any]] = {f: [] for f in _FIELDS}
        self._formats: list[str] = []
        self.rows = 0

    def write(self, requests: Iterable[AgentRequest], format: str) -> int:
        """Append ``requests`` (tagged with ``format``); returns how many were written."""
        n = 0
        cols = self._cols
        appenders = [(cols[f].append, f) for f in _FIELDS]
        formats = self._formats
        for r in requests:
            for app, f in appenders:
                app(getattr(r, f))
            formats.append(format)
            n += 1
            if len(formats) >= BATCH_ROWS:
                self._flush()
        self.rows += n
        return n

    def _flush(self) -> None:
        if not self._formats:
            return
        n = len(self._formats)
        data = {"traffic_id": pa.array([self.traffic_id] * n, pa.string()),
                "format": pa.array(self._formats, pa.string())}
        for f in _FIELDS:
            data[f] = pa.array(self._cols[f], self.schema.field(f).type)
            self._cols[f].clear()  # in place: write() holds these lists' append methods
        self._formats.clear()
        self._writer.write_table(pa.table(data).select(self.schema.names).cast(self.schema))

    def discard(self) -> None:
        """Drop the partial shard (nothing of this report stays in the store)."""
        self._writer.close()
        self._tmp.unlink(missing_ok=True)

    def close(self) -> None:
        """Write the last batch and move the shard into place."""
        self._flush()
        self._writer.close()
        os.replace(self._tmp, self.path)


@dataclass
class TrafficReport:
    """The views of one report, read back (rows as dicts; see docs/schema/traffic.md)."""

    traffic_id: str
    summary: dict[str, Any]
    reuse: list[dict[str, Any]]
    gaps: list[dict[str, Any]]
    ttl: list[dict[str, Any]]
    overlap: dict[str, Any]
    formats: tuple[str, ...] = ()
    recorded_load: dict[str, Any] | None = None

    @classmethod
    def read(cls, con: duckdb.DuckDBPyConnection, traffic_id: str) -> TrafficReport:
        """Query the traffic views for ``traffic_id`` on an open store connection."""
        r = traffic_queries.report(con, traffic_id)
        inputs = json.loads(r["inputs"] or "[]")
        return cls(traffic_id, r["summary"], r["reuse"], r["gaps"], r["ttl"], r["overlap"],
                   tuple(i["format"] for i in inputs), r["recorded_load"])

    def load_line(self) -> str:
        """What load the traces recorded: none for own-clock formats (every file one session tree from
        t = 0: a forecast needs one given), else the sessions started per hour over the arrivals' span."""
        fmts = [trace_format(f) for f in self.formats if f in FORMATS]
        if any(f.clock == OWN_CLOCK for f in fmts):
            return ("  load: none recorded (each file is one session tree on its own clock from t = 0); a forecast "
                    "takes it as an input: --sessions-per-hour or --concurrent-sessions (docs/planner/load.md)")
        r = self.recorded_load or {}
        span, started = r.get("span_s") or 0.0, r.get("sessions_started") or 0
        if not fmts or span <= 0:
            return "  load: recorded clock, too short to give a rate"
        what = "requests" if any(not f.sessions for f in fmts) else "new sessions"
        count = self.summary["requests"] if what == "requests" else started
        return (f"  load: recorded on one clock: {count:,} {what} over {span / 3600:,.2f} h = "
                f"{_rate(count / span * 3600)} {what} per hour (forecasts keep it, or speed it up: --load-scale)")

    @property
    def sessions_known(self) -> bool:
        """Whether every format read says which requests belong to one session (Azure does not)."""
        return all(trace_format(f).sessions for f in self.formats if f in FORMATS)

    def text(self) -> str:
        """The report as plain lines for a terminal."""
        s, o = self.summary, self.overlap
        out = [f"traffic report {self.traffic_id}",
               (f"  {s['sources']} sources, {s['sessions']} sessions ({s['sub_agents']} sub-agents), "
               f"{s['requests']} requests (median {_n(s['requests_per_session_p50'])} per session)"),
               (f"  input tokens per request: median {_n(s['input_p50_tokens'])}, p90 {_n(s['input_p90_tokens'])}; "
               f"largest context per session: median {_n(s['max_context_p50_tokens'])}, max "
               f"{_n(s['max_context_tokens'])}; context growth median {_n(s['growth_p50_tokens_per_request'])} "
               f"tokens per request"),
               (f"  sessions overlapping another of the same source: {o['overlapping_sessions']} of "
               f"{o['sessions']}; most active at once: {o['max_active_sessions']}" if self.sessions_known else
                "  sessions: unknown (the trace has no session ids: every row is read as its own one-request "
                "session, so sessions at once and reuse across turns cannot be told)"),
               self.load_line()]
        # one format: its row would repeat the "all" row, so only "all" is printed
        reuse = self.reuse if len(self.reuse) > 2 else [r for r in self.reuse if r["format"] is None]
        if not self.sessions_known:
            reuse = []
            out.append("  reuse: unknown (no session ids, no prefix data: the share of a prompt that is a prefix of "
                       "its session's previous request cannot be read from this trace)")
        for r in reuse:
            what = "all" if r["format"] is None else r["format"]
            out.append(f"  reuse ({what}): {_pct(r['reusable_share'])} of {_n(r['input_tokens'])} input tokens "
                       f"were a prefix of the session's previous request ({_n(r['new_tokens'])} new); "
                       f"{_pct(r['reusable_in_ttl_share'])} also within the {s['ttl_s']:g} s TTL and "
                       f">= {s['recompute_threshold_tokens']} tokens")
        every = [g for g in self.gaps if g["gap_kind"] == "all"]
        estimated = every[0]["estimated_gaps"] if every else 0
        out.append(f"  gaps (end of one request -> next of the session), seconds; {estimated} gaps estimated "
                   f"(the trace does not say when the previous request ended: docs/workloads.md):")
        for g in self.gaps:
            tool = (f", in tools {_pct(g['tool_s'] / g['tool_known_gap_s'])} (where the trace says)"
                    if g["tool_s"] is not None and g["tool_known_gap_s"] else "")
            est = f" ({g['estimated_gaps']} estimated)" if g["estimated_gaps"] else ""
            out.append(f"    {g['gap_kind']:8s} {g['follow_ups']:7d} follow-ups{est}: p50 {g['gap_p50_s']:.1f}, "
                       f"p90 {g['gap_p90_s']:.1f}, p99 {g['gap_p99_s']:.1f}, max {g['gap_max_s']:.1f}{tool}")
        kinds = sorted({t["gap_kind"] for t in self.ttl})
        ttls = sorted({(t["ttl_s"], t["configured"]) for t in self.ttl})
        out.append("  follow-ups within TTL:  " + " ".join(
            f"{_ttl(v)}{'*' if c else ''}".rjust(7) for v, c in ttls) + "   (* configured)")
        by = {(t["gap_kind"], t["ttl_s"]): t for t in self.ttl}
        for k in kinds:
            out.append(f"    {k:8s}              " + " ".join(
                _pct(by[(k, v)]["share_within_ttl"]).rjust(7) for v, _ in ttls))
        return "\n".join(out)


def _rate(v: float) -> str:
    """A rate with three significant figures, in plain digits (19,900; 3.41; 0.00116)."""
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def _n(v: Any) -> str:
    return "-" if v is None else f"{v:,.0f}"


def _pct(v: Any) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _ttl(s: float) -> str:
    return f"{s / 3600:g}h" if s >= 3600 else (f"{s / 60:g}m" if s >= 60 else f"{s:g}s")


def _format_hint(err: TraceFormatError, format: str | None, paths: Sequence[Path | str]) -> str:
    """' (this file looks like <format>; ...)' when a path named with ``format`` detects as another."""
    if format is None:
        return ""
    for p in paths:
        if str(p) in str(err):
            try:
                found = detect_format(p)
            except TraceFormatError:
                return ""
            if found != format:
                return f" (the file looks like {found}, not {format}: drop --format or name {found})"
    return ""


def build_report(store: Store, paths: Sequence[Path | str], *, format: str | None = None,
                 label: str | None = None, ttl_s: float = DEFAULT_TTL_S,
                 recompute_threshold_tokens: int = DEFAULT_RECOMPUTE_THRESHOLD_TOKENS,
                 traffic_id: str | None = None) -> TrafficReport:
    """Read ``paths`` (each as ``format``, default detected per path), write the report's rows to
    ``store`` and return it read back from the views.

    Raises:
        TraceFormatError: a path that cannot be read as its format (one line naming file, line,
            field). Nothing is left in the store then (the partial shard is removed).
        ValueError: ``ttl_s`` <= 0 or ``recompute_threshold_tokens`` < 0.
    """
    if not ttl_s > 0:
        raise ValueError(f"ttl_s must be > 0 seconds, got {ttl_s}")
    if recompute_threshold_tokens < 0:
        raise ValueError(f"recompute_threshold_tokens must be >= 0, got {recompute_threshold_tokens}")
    store.init()
    tid = traffic_id or new_traffic_id()
    w = TrafficWriter(store, tid)
    inputs = []
    try:
        for p in paths:
            fmt = format or detect_format(p)
            w.write(iter_agent_requests(p, fmt), fmt)
            inputs.append({"path": str(p), "format": fmt})
        w.close()
    except TraceFormatError as e:
        w.discard()
        raise TraceFormatError(f"{e}{_format_hint(e, format, paths)}") from None
    except BaseException:
        w.discard()
        raise
    with store.writer(tid, "traffic") as sw:
        sw.append("traffic_log", {"traffic_id": tid, "label": label, "created_at": dt.datetime.now(dt.UTC),
                                  "inputs": json.dumps(inputs), "ttl_s": float(ttl_s),
                                  "recompute_threshold_tokens": int(recompute_threshold_tokens)})
    con = store.connect(read_only=True)
    try:
        # Bound DuckDB's working memory (its default is 80% of RAM), spilling to a temporary
        # directory instead, so the report's memory does not grow with the trace.
        db.bound_memory(con, QUERY_MEMORY_LIMIT, Path(tempfile.gettempdir()) / f"turnscope-duckdb-{os.getpid()}")
        return TrafficReport.read(con, tid)
    finally:
        con.close()
