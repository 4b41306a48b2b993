"""Recording a played session: one ``turns`` row per request, one ``sessions`` row per session.

The columns are those of ``data/schema.sql`` (docs/schema/overview.md). :func:`turn_row` builds a turn's row
from what the client measured (:class:`loadgen.stream_client.TurnResult`) and what the proxy said
(the wire contract's headers and facts, :mod:`core.contract`); :class:`SessionRecorder` appends
the rows to a store writer and keeps what the session player returns (:class:`SessionResult`).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from core.contract import GAP_KINDS, PublicFacts, response_facts
from loadgen.session import SessionPlan, TurnPlan
from loadgen.stream_client import TurnResult

log = logging.getLogger(__name__)


class RowWriter(Protocol):
    """What the session recorder needs of a store writer (``store.writer.ShardWriter``)."""

    def append(self, table: str, row: dict[str, Any]) -> None: ...


def prompt_sha256(ids: Sequence[int]) -> str:
    """sha256 hex digest of the prompt ids written as ASCII decimals joined by ``,``.

    E.g. ids ``[1, 20, 300]`` hash the bytes ``b"1,20,300"`` (in DuckDB:
    ``sha256(array_to_string(ids, ','))``). Prompt text is never stored.
    """
    return hashlib.sha256(",".join(str(int(i)) for i in ids).encode("ascii")).hexdigest()


def _int_fact(facts: dict[str, Any], name: str) -> int | None:
    v = facts.get(name)
    if v is None or isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    log.warning("proxy fact %s=%r is not an integer; stored as NULL", name, v)
    return None


def _float_fact(facts: dict[str, Any], name: str) -> float | None:
    v = facts.get(name)
    if v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
        if v is not None:
            log.warning("proxy fact %s=%r is not a number; stored as NULL", name, v)
        return None
    return float(v)


#: Each fact the proxy sends (:class:`core.contract.PublicFacts`) -> its ``turns`` column: every
#: one is stored (tests/unit/test_session_recorder_facts.py). The proxy's divergence position is
#: ``proxy_divergence_position`` (``divergence_position`` is the client's own).
FACT_COLUMNS: dict[str, str] = {
    "reuse": "reuse", "prefill_cached_tokens": "prefill_cached_tokens", "remote_tokens": "remote_tokens",
    "reused_tokens": "reused_tokens", "recomputed_tokens": "recomputed_tokens", "handle_age_s": "handle_age_s",
    "divergence_position": "proxy_divergence_position", "prefill_leg_s": "prefill_leg_s",
    "prefill_attempts": "prefill_attempts", "handle_tokens": "handle_tokens",
}


#: Each fact's type as :class:`core.contract.PublicFacts` declares it (``int | None``, ...).
_FACT_TYPES = {k: set(typing.get_args(t)) | {t} for k, t in typing.get_type_hints(PublicFacts).items()}


def _fact(facts: dict[str, Any], key: str) -> Any:
    """Fact ``key`` typed as :class:`core.contract.PublicFacts` declares it (a value of another
    type is stored as NULL, with a warning)."""
    kind = _FACT_TYPES[key]
    if str in kind:
        v = facts.get(key)
        if v is None or isinstance(v, str):
            return v
        log.warning("proxy fact %s=%r is not a string; stored as NULL", key, v)
        return None
    return _float_fact(facts, key) if float in kind else _int_fact(facts, key)


def turn_row(
    *,
    run_id: str,
    session_id: str,
    turn_index: int,
    plan: TurnPlan,
    result: TurnResult,
    gap_before_s: float,
    prompt_ids: Sequence[int] | None,
    expected_reusable_tokens: int | None,
    divergence_position: int | None,
) -> dict[str, Any]:
    """The ``turns`` row for one finished request (all times seconds, counts tokens).

    ITL percentiles are numpy's linear-interpolation percentiles of ``result.itl_s``. The proxy's
    facts come from one place, :func:`core.contract.response_facts` (the ``turnscope`` field of
    the stream, ``result.proxy_facts``, as numbers; the headers only for what a stream that ended
    early did not carry, and for the engines' names), each stored in its column of
    :data:`FACT_COLUMNS`.
    """
    itl = np.asarray(result.itl_s, dtype=float)
    p50, p90 = (np.percentile(itl, [50, 90]).tolist() if itl.size else (None, None))
    facts = response_facts(result.headers or {}, result.proxy_facts or {})
    return {
        "run_id": run_id,
        "session_id": session_id,
        "turn_index": turn_index,
        "request_id": result.request_id,
        "kind": plan.kind,
        "gap_before_s": float(gap_before_s),
        "gap_kind": plan.gap_kind,
        "sent_at": result.sent_at,
        "ttft_s": result.ttft_s,
        "ttfc_s": result.ttfc_s,
        "last_token_s": result.last_token_s,
        "e2e_s": result.e2e_s,
        "tpot_s": result.tpot_s,
        "itl_p50_s": p50,
        "itl_p90_s": p90,
        "itl_samples": int(itl.size),
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "cached_tokens": result.cached_tokens,
        "expected_reusable_tokens": expected_reusable_tokens,
        "trace_reusable_tokens": plan.trace_reusable_tokens,
        "divergence_position": divergence_position,
        "status": result.status,
        "error": result.error,
        "http_status": result.http_status,
        "finish_reason": result.finish_reason,
        "tool_calls": len(result.tool_calls),
        "prefill_engine": facts["prefill_engine"],
        "decode_engine": facts["decode_engine"],
        **{column: _fact(facts, key) for key, column in FACT_COLUMNS.items()},
        "prompt_sha256": prompt_sha256(prompt_ids) if prompt_ids is not None else None,
    }


@dataclass
class TurnRecord:
    """What one played turn produced: the stored row, the raw result and the prompt ids sent."""

    row: dict[str, Any]
    result: TurnResult
    prompt_ids: list[int] | None


@dataclass
class SessionResult:
    """What :func:`run_session` played: the turn records and the stored ``sessions`` row.

    ``stopped`` says why the session ended: ``complete`` (all planned turns), ``max_prompt_tokens``
    (the next prompt would have exceeded it), ``tokenize_error`` (a reply could not be
    re-tokenized for the next prompt) or ``cancelled``; it is stored as ``sessions.stop_reason``.
    """

    turns: list[TurnRecord] = field(default_factory=list)
    session_row: dict[str, Any] | None = None
    stopped: str = "complete"


class SessionRecorder:
    """Appends a session's rows to the store and keeps what the player returns.

    Args:
        writer: store writer (``store.writer.ShardWriter``).
        run_id: the run the rows belong to.
        plan: the session played (its id, source and archetype go into the ``sessions`` rows).
        keep_turns: keep every :class:`TurnRecord` in :attr:`result` (False: only the session row).
        on_turn: called after each turn is recorded (e.g. to fire Locust events).

    The ``sessions`` row: ``turns`` = the session's own turns (fresh requests have rows of their
    own); ``task_latency_s`` = first send -> last finish; ``llm_s`` = sum of E2E of its own turns;
    ``tool_wait_s``/``think_s``/``pause_s`` = sums of the measured gaps by kind (see :meth:`gap`);
    ``status`` ``ok`` when every sent request was ok, ``error`` otherwise, ``cancelled`` when
    interrupted.
    """

    def __init__(self, writer: RowWriter, run_id: str, plan: SessionPlan, *, keep_turns: bool = True,
                 on_turn: Callable[[TurnRecord], None] | None = None):
        self.writer = writer
        self.run_id = run_id
        self.plan = plan
        self.keep_turns = keep_turns
        self.on_turn = on_turn
        self.result = SessionResult()
        self.gaps = dict.fromkeys(GAP_KINDS, 0.0)   # measured gap seconds by kind
        self.own_e2e: list[float] = []             # E2E of the session's own turns (fresh excluded)
        self.all_ok = True

    def gap(self, kind: str, seconds: float) -> None:
        """Count a measured gap (previous finish -> send) towards the session's ``kind`` sum."""
        self.gaps[kind] += seconds

    def failed(self) -> None:
        """Mark the session ``error`` (a request failed, or the session could not go on)."""
        self.all_ok = False

    def own_turn(self, row: dict[str, Any], result: TurnResult, prompt_ids: list[int] | None) -> None:
        """Record one of the session's own turns (its ``turns`` row, already built)."""
        self.writer.append("turns", row)
        rec = self._keep(row, result, prompt_ids)
        self.own_e2e.append(result.e2e_s or 0.0)
        if result.status != "ok":
            self.all_ok = False
        if self.on_turn is not None:
            self.on_turn(rec)

    def fresh_turn(self, k: int, session_id: str, row: dict[str, Any], result: TurnResult,
                   prompt_ids: list[int] | None) -> None:
        """Record a fresh side request: its ``turns`` row and a ``sessions`` row of its own."""
        self.writer.append("turns", row)
        rec = self._keep(row, result, prompt_ids)
        e2e = result.e2e_s or 0.0
        self.writer.append("sessions", self._session_row(session_id, f"{self.plan.source}#fresh{k}", [e2e], e2e,
                                                         result.sent_at, dict.fromkeys(GAP_KINDS, 0.0),
                                                         "ok" if result.status == "ok" else "error",
                                                         planned_turns=1, stop_reason="complete"))
        if result.status != "ok":
            self.all_ok = False
        if self.on_turn is not None:
            self.on_turn(rec)

    def finish(self, task_latency_s: float, started: dt.datetime | None, status: str | None = None) -> SessionResult:
        """Append the session's ``sessions`` row (status ``ok``/``error`` unless given) and return the result."""
        status = status or ("ok" if self.all_ok else "error")
        row = self._session_row(self.plan.session_id, self.plan.source, self.own_e2e, task_latency_s, started,
                                self.gaps, status,
                                planned_turns=sum(1 for t in self.plan.turns if t.kind != "fresh"),
                                stop_reason=self.result.stopped)
        self.writer.append("sessions", row)
        self.result.session_row = row
        return self.result

    def _keep(self, row: dict[str, Any], result: TurnResult, prompt_ids: list[int] | None) -> TurnRecord:
        rec = TurnRecord(row=row, result=result, prompt_ids=prompt_ids)
        if self.keep_turns:
            self.result.turns.append(rec)
        return rec

    def _session_row(self, session_id: str, source: str, e2e: list[float], task: float,
                     started: dt.datetime | None, gap_sums: dict[str, float], status: str, *,
                     planned_turns: int, stop_reason: str) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "session_id": session_id,
            "archetype": self.plan.archetype,
            "source": source,
            "started_at": started,
            "finished_at": started + dt.timedelta(seconds=task) if started else None,
            "turns": len(e2e),
            "task_latency_s": task,
            "llm_s": float(sum(e2e)),
            "tool_wait_s": gap_sums["tool"],
            "think_s": gap_sums["think"],
            "pause_s": gap_sums["pause"],
            "status": status,
            "planned_turns": planned_turns,
            "stop_reason": stop_reason,
        }
