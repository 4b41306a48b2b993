"""One LLM request of a recorded agent session, whatever trace format it came from.

This is the single record that every real-traffic reader (kv-cache-tester, TraceLab, the store's own
recorded runs) yields and that the traffic report and the planner consume. Readers fill what their
format knows and leave the rest ``None``; consumers say which fields they need.

Units: seconds and tokens throughout. Times are on one clock per trace file: ``arrival_s`` is
seconds since the earliest request of that file, so sessions of one file (a conversation and its
sub-agents) can overlap in time.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AgentRequest:
    """One request (one prefill + decode) of one session.

    Fields:

    * ``source``: the trace's identity (e.g. ``kv-cache-tester:trace_0036``), for reports and for
      the run record of a replay.
    * ``session_id``: the session the request belongs to. A sub-agent is its own session (its own
      id, e.g. ``trace_0036/sub1``), with ``parent_session_id`` naming the session that spawned it.
    * ``request_index``: 0-based position within its session.
    * ``arrival_s``: when the request was sent, seconds since the file's first request.
    * ``input_tokens`` / ``output_tokens``: prompt and completion tokens.
    * ``shared_prefix_tokens``: tokens of this prompt that are a prefix of the *previous request of
      the same session* (its prompt, plus its output where the trace says the output was appended);
      0 for a session's first request. This is what bidirectional P/D can pull back from D instead
      of recomputing (before the recompute threshold and block rounding are applied).
    * ``server_s``: the server's time for the request (prefill + decode) if the trace records it.
    * ``ttft_s``: the request's recorded time to its first token, if the trace records it (the
      store's own runs): with ``server_s`` it gives the decode part of the reply, which the planner
      keeps when it places a session's next request after the forecast reply.
    * ``gap_s``: seconds from the end of the session's previous request to this arrival (the
      client's time: tool calls, the human, pauses); ``None`` for a first request only. Every
      reader keeps it within ``[0, arrival_s - previous arrival_s]`` (:func:`bounded_gap`): the
      previous request ended no earlier than it started and no later than this one arrived.
    * ``gap_estimated``: True when the trace does not say when the previous request ended, so
      ``gap_s`` is an estimate within those bounds (the rule per format: docs/workloads.md); False
      for a measured gap and for a first request.
    * ``tool_s``: the part of ``gap_s`` spent in tools, when the trace says; ``None`` otherwise.
    * ``gap_kind``: what ended the gap, in the vocabulary of ``turns.gap_kind`` (docs/schema/tables.md):
      ``tool`` (the prompt ends with tool results: the gap was a tool's run plus the client's
      overhead), ``think`` (a user message: the human's time), ``pause`` (a recorded run's planned
      long pause); ``None`` for a first request or when the trace does not say.

    Readers: :mod:`loadgen.traces.kv_cache_tester`, :mod:`loadgen.traces.tracelab`,
    :mod:`loadgen.traces.recorded_runs` (the store's own runs), and
    :mod:`loadgen.traces.agent_sources` for Mooncake / Azure (all registered in :mod:`loadgen.traces.formats`).
    """

    source: str
    session_id: str
    request_index: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    shared_prefix_tokens: int = 0
    parent_session_id: str | None = None
    server_s: float | None = None
    gap_s: float | None = None
    tool_s: float | None = None
    gap_kind: str | None = None
    gap_estimated: bool = False
    ttft_s: float | None = None

    @property
    def new_tokens(self) -> int:
        """Prompt tokens not shared with the session's previous request (what must be prefilled
        even when the whole shared prefix is reused)."""
        return self.input_tokens - self.shared_prefix_tokens


def bounded_gap(gap_s: float, start_to_start_s: float) -> float:
    """``gap_s`` clipped to ``[0, start_to_start_s]``, seconds.

    A session's requests are sequential: the previous request ended after it started and before
    this one arrived, so the client's time between them lies within ``[0, start_to_start_s]``,
    where ``start_to_start_s`` is this request's ``arrival_s`` minus the previous one's (computed
    from those two floats, so the bound holds exactly on the records). A measured gap leaves it
    only by rounding of the trace's times (integer seconds against a server time in hundredths).

    Raises:
        ValueError: ``start_to_start_s`` < 0 (the requests are out of order).
    """
    if start_to_start_s < 0:
        raise ValueError(f"start_to_start_s must be >= 0 (requests in arrival order), got {start_to_start_s}")
    return min(max(gap_s, 0.0), start_to_start_s)
