"""Read the conversation file of vLLM's multi-turn benchmark (docs/workloads.md).

File format (the input of ``benchmarks/multi_turn/benchmark_serving_multi_turn.py`` in
vllm-project/vllm, as written by its ``convert_sharegpt_to_openai.py``): a JSON list of
conversations ``{"id": str, "messages": [{"role": "system"|"user"|"assistant", "content": str},
...]}``; ids are unique, messages alternate user/assistant after an optional system message.

Like the benchmark, a model call is made for each user message, and the dataset's assistant reply
that follows gives the output length (the planner counts its tokens and sends that as
``max_tokens``); in a replay the history holds the replies the server actually returned. Messages
after the last assistant message start no call and are dropped (as for tau-bench). The
conversations come back as :class:`loadgen.traces.taubench.Conversation`.
"""

from __future__ import annotations

import json
from pathlib import Path

from loadgen.session import SessionPlan
from loadgen.synth_text import TextSynth
from loadgen.traces.replay import ReplaySource, ReplayWorkload, plan_conversations
from loadgen.traces.taubench import Conversation, TraceFormatError

_ROLES = ("system", "user", "assistant")


def _fail(path: Path, where: str, what: str) -> TraceFormatError:
    return TraceFormatError(f"{path}: {where}: {what}")


def load_vllm_multiturn(path: Path | str, *, max_conversations: int | None = None,
                        max_turns: int | None = None) -> list[Conversation]:
    """Read the file into conversations, in file order (``source`` = ``"<file stem>:<id>"``).

    Args:
        path: the JSON file.
        max_conversations: keep at most this many (the first ones).
        max_turns: cut each conversation after its ``max_turns``-th assistant message.

    Raises:
        TraceFormatError: unreadable file, invalid JSON, or an item/message that does not match the
            format, e.g. ``.../x.json: [2].messages[3].role: expected one of system, user,
            assistant, got 'gpt'``; duplicate ids; a conversation that does not alternate.
        ValueError: ``max_conversations`` or ``max_turns`` is not a positive integer.
    """
    path = Path(path)
    for name, v in (("max_conversations", max_conversations), ("max_turns", max_turns)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name} must be a positive integer or None, got {v!r}")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise TraceFormatError(f"{path}: cannot read the file: {e}") from e
    except json.JSONDecodeError as e:
        raise TraceFormatError(f"{path}: not valid JSON: line {e.lineno} column {e.colno}: {e.msg}") from e
    if not isinstance(raw, list):
        raise _fail(path, "top level", f"expected a list of conversations, got {type(raw).__name__}")
    out: list[Conversation] = []
    seen: dict[str, int] = {}
    for i, item in enumerate(raw):
        if max_conversations is not None and len(out) >= max_conversations:
            break
        if not isinstance(item, dict):
            raise _fail(path, f"[{i}]", f"expected an object, got {type(item).__name__}")
        cid = item.get("id")
        if not isinstance(cid, str) or not cid:
            raise _fail(path, f"[{i}].id", f"expected a non-empty string, got {cid!r}")
        if cid in seen:
            raise _fail(path, f"[{i}].id", f"{cid!r} duplicates conversation [{seen[cid]}]")
        seen[cid] = i
        msgs = item.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise _fail(path, f"[{i}].messages", "expected a non-empty list of messages")
        clean: list[dict] = []
        turns = 0
        for j, m in enumerate(msgs):
            where = f"[{i}].messages[{j}]"
            if not isinstance(m, dict):
                raise _fail(path, where, f"expected a message object, got {type(m).__name__}")
            role, content = m.get("role"), m.get("content")
            if role not in _ROLES:
                raise _fail(path, f"{where}.role", f"expected one of {', '.join(_ROLES)}, got {role!r}")
            if not isinstance(content, str):
                raise _fail(path, f"{where}.content", f"expected a string, got {type(content).__name__}")
            body = [x for x in clean if x["role"] != "system"]
            if role == "system" and clean:
                raise _fail(path, f"{where}.role", "a system message may only come first")
            if role != "system":
                want = "user" if len(body) % 2 == 0 else "assistant"
                if role != want:
                    raise _fail(path, f"{where}.role", f"expected {want} (messages alternate user/assistant), "
                                                       f"got {role}")
            clean.append({"role": role, "content": content})
            if role == "assistant":
                turns += 1
                if max_turns is not None and turns >= max_turns:
                    break
        last = max((k for k, x in enumerate(clean) if x["role"] == "assistant"), default=-1)
        if last < 0:
            continue
        out.append(Conversation(id=cid, messages=clean[: last + 1], source=f"{path.stem}:{cid}"))
    return out


def plan_vllm_multiturn(src: ReplaySource, si: int, w: ReplayWorkload, synth: TextSynth,
                        time_scale: float) -> list[SessionPlan]:
    """Plans of a vLLM ``benchmarks/multi_turn`` source: its conversations, the replies' tokens as output."""

    convs = load_vllm_multiturn(src.path, max_turns=src.max_turns)
    return plan_conversations(convs, src, si, "v", w, synth, time_scale, reply_tokens=True)
