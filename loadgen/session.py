"""A session's plan: the turns an agent session sends, their gaps, kinds and reference replies.

A :class:`SessionPlan` is a list of :class:`TurnPlan` s: the messages appended before each model call
(user text, tool results), the trace's reply for that call, the gap before it and the turn's kind
(:data:`core.contract.TURN_KINDS`, docs/workloads.md). Plans come from traces
(:func:`plan_from_conversation`, ``loadgen.traces``) and from workloads (``loadgen.workload``); the
session player (:mod:`loadgen.session_player`) plays them.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from core.contract import GAP_KINDS, TURN_KINDS

# --------------------------------------------------------------------------------------- plans


EDIT_STYLES = ("compact", "strip_reasoning")
EDIT_TARGETS = ("last", "first")


@dataclass(frozen=True)
class TurnPlan:
    """One planned model call.

    Attributes:
        new_messages: OpenAI messages appended to the history right before this call (turn 0:
            system + first user message; later: a user message or tool results). For a ``retry``:
            empty (the previous request is sent again). For a ``fresh`` request: the whole,
            unrelated conversation it sends.
        reference_reply: the trace's assistant message for this call; it stands in for the reply
            when the call fails, so the history stays well-formed.
        gap_before_s: seconds to wait after the previous request finished (0 for turn 0).
        gap_kind: ``none`` (turn 0, retry) | ``tool`` | ``think`` | ``pause``.
        kind: ``turn`` | ``retry`` (the previous request again, same history) | ``edit`` (the history
            is edited before this call, see ``edit``) | ``fresh`` (an unrelated single request with
            its own session id; the session's history is untouched) | ``resume`` (the session goes on
            after a pause longer than the decode worker's KV TTL).
        max_tokens: output tokens for this call (None: the session's default).
        at_s: trace replay: send no earlier than ``at_s`` seconds after the session's first request
            was sent (the trace's arrival offset, already time-scaled); None: only the gap applies.
        edit: for ``kind="edit"``: ``{"style": "compact"|"strip_reasoning", "target": "last"|"first",
            "keep": fraction}``: the last (or first) assistant message of the history is shortened
            to ``keep`` of its characters (``compact``), or its reasoning is removed
            (``strip_reasoning``: ``reasoning_content``/``reasoning`` fields and ``<think>...</think>``
            spans; a reply without reasoning is compacted instead). See :func:`apply_edit`.
        trace_reusable_tokens: trace replay: the prompt tokens the trace says were a prefix of the
            previous request (scaled), stored as ``turns.trace_reusable_tokens``; None otherwise.
    """

    new_messages: list[dict[str, Any]]
    reference_reply: dict[str, Any]
    gap_before_s: float = 0.0
    gap_kind: str = "none"
    kind: str = "turn"
    max_tokens: int | None = None
    at_s: float | None = None
    edit: dict[str, Any] | None = None
    trace_reusable_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.gap_kind not in GAP_KINDS:
            raise ValueError(f"TurnPlan.gap_kind must be one of {GAP_KINDS}, got {self.gap_kind!r}")
        if self.kind not in TURN_KINDS:
            raise ValueError(f"TurnPlan.kind must be one of {TURN_KINDS}, got {self.kind!r}")
        if not (isinstance(self.gap_before_s, (int, float)) and self.gap_before_s >= 0):
            raise ValueError(f"TurnPlan.gap_before_s must be a number >= 0 seconds, got {self.gap_before_s!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"TurnPlan.max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}")
        if self.at_s is not None and not (isinstance(self.at_s, (int, float)) and self.at_s >= 0):
            raise ValueError(f"TurnPlan.at_s must be a number >= 0 seconds or None, got {self.at_s!r}")
        if self.kind == "retry" and self.new_messages:
            raise ValueError("TurnPlan.new_messages must be empty for a retry (the previous request is resent)")
        if self.kind == "fresh" and not self.new_messages:
            raise ValueError("TurnPlan.new_messages must hold the whole request for a fresh turn")
        if self.kind == "edit":
            e = self.edit or {}
            if e.get("style") not in EDIT_STYLES or e.get("target", "last") not in EDIT_TARGETS:
                raise ValueError(f"TurnPlan.edit must be {{'style': one of {EDIT_STYLES}, 'target': one of "
                                 f"{EDIT_TARGETS}, 'keep': 0..1}} for an edit, got {self.edit!r}")
            keep = e.get("keep", 0.5)
            if not (isinstance(keep, (int, float)) and 0 <= keep <= 1):
                raise ValueError(f"TurnPlan.edit.keep must be a fraction in [0, 1], got {keep!r}")
        elif self.edit is not None:
            raise ValueError(f"TurnPlan.edit is only for kind 'edit', not {self.kind!r}")


@dataclass(frozen=True)
class SessionPlan:
    """A session to play: its id (unique within a run), where it came from, and its turns.

    ``start_at_s``: trace replay: the session's first request is due this many seconds after the
    run started (already time-scaled); None: as soon as a user is free. The first turn that is not
    ``fresh`` must be a ``turn`` (there is nothing to retry, edit or resume yet).
    """

    session_id: str
    source: str
    turns: list[TurnPlan]
    archetype: str | None = None
    start_at_s: float | None = None

    def __post_init__(self) -> None:
        first = next((t for t in self.turns if t.kind != "fresh"), None)
        if first is not None and first.kind != "turn":
            raise ValueError(f"session {self.session_id}: the first turn must be of kind 'turn', got {first.kind!r}")

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON/msgpack-safe), e.g. to send from the Locust master to a worker."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SessionPlan:
        """Inverse of :meth:`to_dict`."""
        return cls(session_id=d["session_id"], source=d["source"], archetype=d.get("archetype"),
                   start_at_s=d.get("start_at_s"), turns=[TurnPlan(**t) for t in d["turns"]])


_THINK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)


def rewrite_reply(message: dict[str, Any], *, strip_reasoning: bool = False, reasoning_share: float = 0.0,
                  rerender_tool_calls: bool = False) -> dict[str, Any]:
    """An assistant reply as a client that rewrites history sends it back in later requests (pure;
    ``message`` is not modified). docs/workloads.md, ``history_rewrite``.

    Args:
        strip_reasoning: drop the ``reasoning_content`` / ``reasoning`` fields and the
            ``<think>...</think>`` spans of the content (Qwen3's chat template drops the reasoning of
            earlier replies; OpenAI-style clients send back ``content`` only). A reply with no
            reasoning marker loses the first ``reasoning_share`` of its characters instead: the
            stand-in for the reasoning of a model served without reasoning markers (the embedded
            model), which, like real reasoning, comes before the answer.
        rerender_tool_calls: re-serialize each tool call's ``arguments`` as a client that parsed
            them does (``json.dumps`` with sorted keys and no spaces; arguments that are not JSON
            are kept), and give the call a new id.
    """
    m = dict(message)
    if strip_reasoning:
        content = m.get("content") if isinstance(m.get("content"), str) else ""
        had = m.pop("reasoning_content", None) is not None
        had = (m.pop("reasoning", None) is not None) or had
        stripped = _THINK.sub("", content)
        if had or stripped != content:
            m["content"] = stripped
        elif reasoning_share > 0:
            m["content"] = content[int(len(content) * reasoning_share):]
    if rerender_tool_calls and m.get("tool_calls"):
        calls = []
        for i, c in enumerate(m["tool_calls"]):
            fn = dict(c.get("function") or {})
            try:
                fn["arguments"] = json.dumps(json.loads(fn.get("arguments") or "{}"), sort_keys=True,
                                             separators=(",", ":"))
            except (TypeError, ValueError):
                pass
            calls.append(dict(c) | {"id": f"call_rerendered_{i}", "function": fn})
        m["tool_calls"] = calls
    return m


def apply_edit(messages: Sequence[dict[str, Any]], edit: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """The history with one assistant message edited (pure; ``messages`` is not modified).

    Args:
        messages: the OpenAI history.
        edit: ``{"style", "target", "keep"}`` as in :class:`TurnPlan`.

    Returns:
        ``(edited, what)``: the new list and the style actually applied (``compact`` when a
        ``strip_reasoning`` edit found no reasoning; ``none`` when there is no assistant message).
        ``compact`` keeps the first ``int(len(content) * keep)`` characters of the content (tool
        calls are kept).
    """
    out = [dict(m) for m in messages]
    idx = [i for i, m in enumerate(out) if m.get("role") == "assistant"]
    if not idx:
        return out, "none"
    m = out[idx[-1] if edit.get("target", "last") == "last" else idx[0]]
    content = m.get("content") if isinstance(m.get("content"), str) else ""
    if edit["style"] == "strip_reasoning":
        had = any(k in m for k in ("reasoning_content", "reasoning"))
        m.pop("reasoning_content", None)
        m.pop("reasoning", None)
        stripped = _THINK.sub("", content)
        if had or stripped != content:
            m["content"] = stripped
            return out, "strip_reasoning"
    m["content"] = content[: int(len(content) * float(edit.get("keep", 0.5)))]
    return out, "compact"


def plan_from_conversation(
    conv: Any,
    *,
    session_id: str | None = None,
    tool_gap_s: float = 0.0,
    think_gap_s: float = 0.0,
    archetype: str = "trace",
) -> SessionPlan:
    """Turn a trace conversation (``loadgen.traces.taubench.Conversation``) into a session plan.

    One turn per assistant message. The gap before turn k >= 1 is ``tool`` (``tool_gap_s``) when
    the messages appended since the previous reply include a tool result, else ``think``
    (``think_gap_s``, a user writing).

    Args:
        conv: has ``id``, ``source`` and ``turns()`` -> ``[(new_messages, reference_reply), ...]``.
        session_id: defaults to ``conv.id``.
        tool_gap_s, think_gap_s: seconds (>= 0).
    """
    turns: list[TurnPlan] = []
    for k, (new, ref) in enumerate(conv.turns()):
        if k == 0:
            turns.append(TurnPlan(new_messages=list(new), reference_reply=ref))
        elif any(m.get("role") == "tool" for m in new):
            turns.append(TurnPlan(list(new), ref, float(tool_gap_s), "tool"))
        else:
            turns.append(TurnPlan(list(new), ref, float(think_gap_s), "think"))
    return SessionPlan(session_id=session_id or conv.id, source=getattr(conv, "source", "") or conv.id,
                       turns=turns, archetype=archetype)
