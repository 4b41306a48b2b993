"""Read tau-bench trajectories into replayable OpenAI-format conversations (docs/workloads.md).

File format (``historical_trajectories/*.json`` of sierra-research/tau-bench, e.g. the shipped
``data/traces/gpt-4o-airline.json``): a JSON list of trajectories, each an object with

* ``task_id`` (int), ``trial`` (int): together unique within a file;
* ``reward`` (float), ``info`` (dict): the task and its grading (not used here);
* ``traj``: the messages, OpenAI chat format. ``system`` / ``user`` / ``tool`` messages carry a
  string ``content``; ``assistant`` messages carry a string ``content`` and/or ``tool_calls``
  (content is ``null`` on a pure tool call); ``tool`` messages carry ``tool_call_id`` and ``name``.

Turn plan: a model call happens wherever the trajectory has an assistant message; the request for
turn ``k`` sends every message before the k-th assistant message (in a replay, the earlier
assistant messages are the ones the server actually returned; see ``loadgen.session``). Messages
after the last assistant message (the simulated user's closing line, or a last tool result) start
no call and are dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core import resources
from loadgen.session import SessionPlan
from loadgen.synth_text import TextSynth
from loadgen.traces.errors import TraceFormatError
from loadgen.traces.replay import ReplaySource, ReplayWorkload, plan_conversations

#: The trace shipped with turnscope (MIT, see data/traces/SOURCES.md).
DEFAULT_TRACE = resources.shipped("traces", "gpt-4o-airline.json")

_ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Conversation:
    """One trajectory as an OpenAI-format message list.

    Attributes:
        id: unique within its file, ``"task<task_id>-trial<trial>"``.
        messages: the messages in order (dicts with ``role`` and ``content``, plus ``tool_calls``
            on assistant tool calls and ``tool_call_id`` / ``name`` on tool results), ending with
            the last assistant message (``max_turns`` may cut it earlier).
        source: ``"<trace file stem>:<id>"``, what the store's ``sessions.source`` records.
    """

    id: str
    messages: list[dict[str, Any]]
    source: str = ""

    @property
    def turn_count(self) -> int:
        """Number of model calls the conversation plans (= its assistant messages)."""
        return sum(1 for m in self.messages if m["role"] == "assistant")

    def turns(self) -> list[tuple[list[dict[str, Any]], dict[str, Any]]]:
        """Split into turns: ``[(new_messages, reference_reply), ...]``, one per model call.

        ``new_messages`` are the non-assistant messages appended since the previous assistant
        message (for turn 0, everything before the first one); ``reference_reply`` is the trace's
        assistant message for that call.
        """
        out: list[tuple[list[dict[str, Any]], dict[str, Any]]] = []
        pending: list[dict[str, Any]] = []
        for m in self.messages:
            if m["role"] == "assistant":
                out.append((pending, m))
                pending = []
            else:
                pending.append(m)
        return out


def _fail(path: Path, where: str, what: str) -> TraceFormatError:
    return TraceFormatError(f"{path}: {where}: {what}")


def _check_message(path: Path, where: str, m: Any) -> dict[str, Any]:
    """Validate one message and return a clean OpenAI-format copy."""
    if not isinstance(m, dict):
        raise _fail(path, where, f"expected a message object, got {type(m).__name__}")
    role = m.get("role")
    if role not in _ROLES:
        raise _fail(path, f"{where}.role", f"expected one of {', '.join(_ROLES)}, got {role!r}")
    content = m.get("content")
    out: dict[str, Any] = {"role": role, "content": content}
    if role == "assistant":
        calls = m.get("tool_calls")
        if content is not None and not isinstance(content, str):
            raise _fail(path, f"{where}.content", f"expected a string or null, got {type(content).__name__}")
        if calls is not None:
            if not isinstance(calls, list):
                raise _fail(path, f"{where}.tool_calls", f"expected a list, got {type(calls).__name__}")
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise _fail(path, f"{where}.tool_calls[{j}].function", "expected an object with a string 'name'")
                if not isinstance(fn.get("arguments", ""), str):
                    raise _fail(path, f"{where}.tool_calls[{j}].function.arguments", "expected a JSON string")
            if calls:
                out["tool_calls"] = calls
        if content is None and not calls:
            raise _fail(path, where, "assistant message has neither content nor tool_calls")
        return out
    if not isinstance(content, str):
        raise _fail(path, f"{where}.content", f"expected a string, got {type(content).__name__}")
    if role == "tool":
        tcid = m.get("tool_call_id")
        if not isinstance(tcid, str):
            raise _fail(path, f"{where}.tool_call_id", f"expected a string, got {tcid!r}")
        out["tool_call_id"] = tcid
        if isinstance(m.get("name"), str):
            out["name"] = m["name"]
    return out


def load_taubench(
    path: Path | str = DEFAULT_TRACE,
    *,
    max_conversations: int | None = None,
    max_turns: int | None = None,
) -> list[Conversation]:
    """Read a tau-bench trajectory file into conversations, in file order.

    Args:
        path: the JSON file (default: the shipped airline trace).
        max_conversations: keep at most this many (the first ones); None keeps all.
        max_turns: cut each conversation after its ``max_turns``-th assistant message (so it plans
            at most that many model calls); None keeps all turns.

    Returns:
        Conversations whose messages end with an assistant message; trajectories with no
        assistant message at all are skipped.

    Raises:
        TraceFormatError: unreadable file, invalid JSON, or a trajectory/message that does not
            match the format; the message names the file and the position, e.g.
            ``.../x.json: [3].traj[5].role: expected one of ..., got 'bot'``.
        ValueError: ``max_conversations`` or ``max_turns`` is not a positive integer.
    """
    path = Path(path)
    for name, v in (("max_conversations", max_conversations), ("max_turns", max_turns)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name} must be a positive integer or None, got {v!r}")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise TraceFormatError(f"{path}: cannot read the trace: {e}") from e
    except json.JSONDecodeError as e:
        raise TraceFormatError(f"{path}: not valid JSON: line {e.lineno} column {e.colno}: {e.msg}") from e
    if not isinstance(raw, list):
        raise _fail(path, "top level", f"expected a list of trajectories, got {type(raw).__name__}")

    out: list[Conversation] = []
    seen: dict[str, int] = {}
    for i, t in enumerate(raw):
        if max_conversations is not None and len(out) >= max_conversations:
            break
        if not isinstance(t, dict):
            raise _fail(path, f"[{i}]", f"expected a trajectory object, got {type(t).__name__}")
        for key in ("task_id", "trial"):
            if isinstance(t.get(key), bool) or not isinstance(t.get(key), int):
                raise _fail(path, f"[{i}].{key}", f"expected an integer, got {t.get(key)!r}")
        traj = t.get("traj")
        if not isinstance(traj, list):
            raise _fail(path, f"[{i}].traj", f"expected a list of messages, got {type(traj).__name__}")
        conv_id = f"task{t['task_id']}-trial{t['trial']}"
        if conv_id in seen:
            raise _fail(path, f"[{i}]", f"(task_id, trial) duplicates trajectory [{seen[conv_id]}] ({conv_id})")
        seen[conv_id] = i
        messages: list[dict[str, Any]] = []
        last_assistant = -1
        turns = 0
        for j, m in enumerate(traj):
            msg = _check_message(path, f"[{i}].traj[{j}]", m)
            messages.append(msg)
            if msg["role"] == "assistant":
                last_assistant = len(messages) - 1
                turns += 1
                if max_turns is not None and turns >= max_turns:
                    break
        if last_assistant < 0:
            continue
        out.append(Conversation(id=conv_id, messages=messages[: last_assistant + 1],
                                source=f"{path.stem}:{conv_id}"))
    return out


def plan_taubench(src: ReplaySource, si: int, w: ReplayWorkload, synth: TextSynth, time_scale: float) -> list[SessionPlan]:
    """Plans of a tau-bench source: its conversations' text, gaps from ``src.gaps``."""

    convs = load_taubench(src.path or DEFAULT_TRACE, max_turns=src.max_turns)
    return plan_conversations(convs, src, si, "t", w, synth, time_scale, reply_tokens=False)
