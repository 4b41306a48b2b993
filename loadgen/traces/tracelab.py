"""Read TraceLab's normalised coding-agent rounds as :class:`AgentRequest` records.

File format (``example_sessions/derived/round_trace.jsonl`` of uw-syfi/TraceLab, shipped as
``data/traces/tracelab_round_trace.jsonl``, CC-BY-4.0, see data/traces/SOURCES.md): one LLM call
("round") per JSON line with

* ``session_id``, ``round_index`` (0-based within the session), ``provider``, ``model``;
* ``input_tokens_total = prefix_tokens + newly_append_tokens``: ``prefix_tokens`` is the
  provider's cached prefix, ``newly_append_tokens`` the rest; ``output_tokens``;
* ``timing_events``: ``[{event_type, timestamp}]`` with ISO-8601 timestamps; the input events
  (``user_message``, ``tool_result``) come first, then the call's own events (``reasoning``,
  ``text``, ``tool_call``);
* ``tools``: ``[{tool_call_id, emitted_at, tool_wall_latency_ms, result_at}]``, the tools the
  round's reply called.

What is read (docs/workloads.md):

* sessions by ``session_id``, requests by ``round_index``;
* ``arrival_s``: the last input event (the request goes out once every tool result is in), seconds
  since the earliest arrival in the file (one clock per file: sessions recorded months apart stay
  months apart); ``server_s``: arrival to the round's last event (the call's end);
* ``gap_s``: the previous round's end to this arrival, clipped to ``[0, start to start]``
  (:func:`~loadgen.traces.agent_request.bounded_gap`; every round's events say when it ended, so
  no gap is estimated); ``tool_s``: the part of it
  covered by the previous round's tools (the union of ``[emitted_at, emitted_at +
  tool_wall_latency_ms]`` clipped to the gap), the rest being the client's and the human's time;
* ``shared_prefix_tokens`` = ``prefix_tokens`` (what the provider's cache held: a lower bound of
  what the previous request shared, since a provider may miss); ``gap_kind`` ``tool`` when the
  round's first input event is a ``tool_result``, ``think`` when it is a ``user_message``.

Errors (:class:`TraceFormatError`) name the file, line and field. Timestamps are parsed by
``datetime.fromisoformat``.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core import resources
from loadgen.traces.agent_request import AgentRequest, bounded_gap
from loadgen.traces.errors import TraceFormatError
from loadgen.traces.jsonl import iter_json_objects

#: The shipped copy (CC-BY-4.0, see data/traces/SOURCES.md).
DEFAULT_TRACE = resources.shipped("traces", "tracelab_round_trace.jsonl")
FORMAT = "tracelab"
_INPUT_EVENTS = ("user_message", "tool_result")


@dataclass(frozen=True)
class _Round:
    """One line, validated: times in seconds since the epoch."""

    lineno: int
    session_id: str
    round_index: int
    input_tokens: int
    prefix_tokens: int
    output_tokens: int
    arrival: float
    end: float
    first_input: str | None
    tools: tuple[tuple[float, float], ...]  # (start, end) of each tool with a known latency


def _ts(where: str, field: str, v: Any) -> float:
    if not isinstance(v, str):
        raise TraceFormatError(f"{where}: {field}: expected an ISO-8601 timestamp, got {v!r:.60}")
    try:
        t = dt.datetime.fromisoformat(v)
    except ValueError as e:
        raise TraceFormatError(f"{where}: {field}: expected an ISO-8601 timestamp, got {v!r:.60}") from e
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.UTC)
    return t.timestamp()


def _int(where: str, d: dict[str, Any], key: str) -> int:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise TraceFormatError(f"{where}: {key}: expected an integer >= 0, got {v!r:.60}")
    return v


def _round(where: str, lineno: int, d: dict[str, Any]) -> _Round:
    sid = d.get("session_id")
    if not isinstance(sid, str) or not sid:
        raise TraceFormatError(f"{where}: session_id: expected a non-empty string, got {sid!r:.60}")
    ri = _int(where, d, "round_index")
    total = _int(where, d, "input_tokens_total")
    prefix = _int(where, d, "prefix_tokens")
    new = _int(where, d, "newly_append_tokens")
    if prefix + new != total:
        raise TraceFormatError(f"{where}: input_tokens_total: expected prefix_tokens + newly_append_tokens "
                               f"= {prefix + new}, got {total}")
    out = _int(where, d, "output_tokens")
    events = d.get("timing_events")
    if not isinstance(events, list) or not events:
        raise TraceFormatError(f"{where}: timing_events: expected a non-empty list, got {events!r:.60}")
    times: list[float] = []
    inputs: list[float] = []
    first_input = None
    for j, e in enumerate(events):
        if not isinstance(e, dict):
            raise TraceFormatError(f"{where}: timing_events[{j}]: expected an object, got {e!r:.60}")
        t = _ts(where, f"timing_events[{j}].timestamp", e.get("timestamp"))
        times.append(t)
        if e.get("event_type") in _INPUT_EVENTS:
            inputs.append(t)
            if first_input is None:
                first_input = e["event_type"]
    tools_raw = d.get("tools") or []
    if not isinstance(tools_raw, list):
        raise TraceFormatError(f"{where}: tools: expected a list, got {tools_raw!r:.60}")
    tools = []
    for j, tl in enumerate(tools_raw):
        if not isinstance(tl, dict):
            raise TraceFormatError(f"{where}: tools[{j}]: expected an object, got {tl!r:.60}")
        lat = tl.get("tool_wall_latency_ms")
        if lat is None:
            continue
        if isinstance(lat, bool) or not isinstance(lat, (int, float)) or lat < 0:
            raise TraceFormatError(f"{where}: tools[{j}].tool_wall_latency_ms: expected a number >= 0 "
                                   f"(milliseconds) or null, got {lat!r:.60}")
        start = _ts(where, f"tools[{j}].emitted_at", tl.get("emitted_at"))
        tools.append((start, start + lat / 1000.0))
    arrival = max(inputs) if inputs else min(times)
    return _Round(lineno, sid, ri, total, prefix, out, arrival, max(times), first_input, tuple(tools))


def _covered(intervals: tuple[tuple[float, float], ...], lo: float, hi: float) -> float:
    """Seconds of ``[lo, hi]`` covered by the union of ``intervals``."""
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in intervals if min(b, hi) > max(a, lo))
    total = 0.0
    cur_a = cur_b = None
    for a, b in clipped:
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        total += cur_b - cur_a
    return total


def read_tracelab(path: Path | str = DEFAULT_TRACE) -> list[AgentRequest]:
    """Every round of the file as an AgentRequest (see the module doc), ordered by arrival.

    Raises:
        TraceFormatError: unreadable file, a line that is not a JSON object, a missing or mistyped
            field, inconsistent token totals, or a ``round_index`` repeated within a session; the
            message names the file, line and field (e.g. ``x.jsonl:4: prefix_tokens: expected an
            integer >= 0, got None``).
    """
    path = Path(path)
    rounds: dict[str, dict[int, _Round]] = {}
    for where, lineno, d in iter_json_objects(path, "a JSON object (one TraceLab round)"):
        r = _round(where, lineno, d)
        sess = rounds.setdefault(r.session_id, {})
        if r.round_index in sess:
            raise TraceFormatError(f"{where}: round_index: {r.round_index} repeats line "
                                   f"{sess[r.round_index].lineno} of session {r.session_id}")
        sess[r.round_index] = r
    if not rounds:
        return []
    t0 = min(r.arrival for s in rounds.values() for r in s.values())
    out: list[AgentRequest] = []
    for sid, sess in rounds.items():
        prev: _Round | None = None
        prev_arrival = 0.0
        for k, ri in enumerate(sorted(sess)):
            r = sess[ri]
            arrival = round(r.arrival - t0, 3)
            gap = tool = None
            if prev is not None:
                if arrival < prev_arrival:
                    raise TraceFormatError(f"{path}:{r.lineno}: timing_events: round {ri} of session {sid} "
                                           f"arrives before round {prev.round_index} (line {prev.lineno}); "
                                           f"expected arrivals in round_index order")
                gap = bounded_gap(round(r.arrival - prev.end, 3), arrival - prev_arrival)
                tool = min(round(_covered(prev.tools, prev.end, r.arrival), 3), gap) if gap > 0 else 0.0
            out.append(AgentRequest(
                source=f"tracelab:{path.stem}", session_id=sid, request_index=k, arrival_s=arrival,
                input_tokens=r.input_tokens, output_tokens=r.output_tokens,
                shared_prefix_tokens=r.prefix_tokens, server_s=round(r.end - r.arrival, 3), gap_s=gap, tool_s=tool,
                gap_kind=None if prev is None else ("tool" if r.first_input == "tool_result" else "think"),
            ))
            prev = r
            prev_arrival = arrival
    out.sort(key=lambda a: (a.arrival_s, a.session_id, a.request_index))
    return out
