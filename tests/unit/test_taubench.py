"""The tau-bench reader, on the shipped file (counts checked by an independent traversal) and bad files."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from loadgen.traces.taubench import DEFAULT_TRACE, Conversation, TraceFormatError, load_taubench

ASSISTANT_KEY = re.compile(r'"role":\s*"assistant"')


def _jq(expr: str, path: Path) -> object:
    out = subprocess.run(["jq", "-c", expr, str(path)], check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def _independent_turn_counts(path: Path) -> list[int]:
    """Assistant messages per trajectory, computed without the reader (jq, else a raw-text scan)."""
    if shutil.which("jq"):
        return _jq('[.[] | [.traj[] | select(.role == "assistant")] | length]', path)
    # Fallback: JSON keys are never escaped, while the same text inside a string value would be
    # (\"role\"), so counting the raw key pattern per trajectory is exact for this file.
    text = path.read_text()
    parts = re.split(r'"task_id":', text)[1:]
    return [len(ASSISTANT_KEY.findall(p)) for p in parts]


def test_shipped_file_counts_match_an_independent_count():
    counts = _independent_turn_counts(DEFAULT_TRACE)
    convs = load_taubench()
    # Trajectories with no assistant message would be skipped; the shipped file has none.
    assert len(convs) == len([c for c in counts if c > 0]) == 200
    assert [c.turn_count for c in convs] == counts
    assert sum(c.turn_count for c in convs) == 2454
    assert len({c.id for c in convs}) == 200
    assert convs[0].id == "task0-trial0" and convs[0].source == "gpt-4o-airline:task0-trial0"


def test_max_turns_and_max_conversations():
    counts = _independent_turn_counts(DEFAULT_TRACE)
    convs = load_taubench(DEFAULT_TRACE, max_conversations=7, max_turns=3)
    assert len(convs) == 7
    assert [c.turn_count for c in convs] == [min(3, c) for c in counts[:7]]
    for c in convs:
        assert c.messages[-1]["role"] == "assistant"


def test_turn_plan_matches_the_raw_trajectory():
    raw = json.loads(DEFAULT_TRACE.read_text())
    conv = load_taubench(max_conversations=1)[0]
    traj = raw[0]["traj"]
    assistant_at = [i for i, m in enumerate(traj) if m["role"] == "assistant"]
    turns = conv.turns()
    assert len(turns) == len(assistant_at)
    seen = 0
    for (new, ref), i in zip(turns, assistant_at, strict=True):
        # the request for the call at traj[i] sends exactly traj[:i] (replies being the trace's here)
        assert [m["content"] for m in new] == [m["content"] for m in traj[seen:i]]
        assert ref["content"] == traj[i]["content"]
        assert ref.get("tool_calls") == traj[i].get("tool_calls")
        seen = i + 1
    assert [m["role"] for m in turns[0][0]] == ["system", "user"]
    # messages after the last assistant message start no call and are not kept
    assert len(conv.messages) == assistant_at[-1] + 1
    tool = next(m for m in conv.messages if m["role"] == "tool")
    assert set(tool) == {"role", "content", "tool_call_id", "name"}


def test_every_later_turn_appends_user_or_tool_messages():
    for conv in load_taubench():
        for new, _ in conv.turns()[1:]:
            assert new, conv.id
            assert {m["role"] for m in new} <= {"user", "tool"}


def _write(tmp_path: Path, obj: object, name: str = "t.json") -> Path:
    p = tmp_path / name
    p.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return p


GOOD = {"task_id": 1, "trial": 0, "traj": [
    {"role": "system", "content": "s"}, {"role": "user", "content": "u"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "c1", "name": "f", "content": "r"},
    {"role": "assistant", "content": "done"}, {"role": "user", "content": "bye"}]}


def test_small_good_file(tmp_path):
    convs = load_taubench(_write(tmp_path, [GOOD]))
    assert len(convs) == 1 and convs[0].turn_count == 2
    assert [m["role"] for m in convs[0].messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert isinstance(convs[0], Conversation)


@pytest.mark.parametrize("data, where", [
    ("{not json", r"not valid JSON: line 1 column 2"),
    ({"a": 1}, r"top level: expected a list"),
    ([5], r"\[0\]: expected a trajectory object"),
    ([{**GOOD, "trial": "x"}], r"\[0\]\.trial: expected an integer"),
    ([{**GOOD, "traj": None}], r"\[0\]\.traj: expected a list"),
    ([GOOD, {**GOOD, "trial": 1, "traj": GOOD["traj"][:2] + [{"role": "bot", "content": "x"}]}], r"\[1\]\.traj\[2\]\.role: expected one of"),
    ([{**GOOD, "traj": [{"role": "user", "content": 3}]}], r"\[0\]\.traj\[0\]\.content: expected a string"),
    ([{**GOOD, "traj": [{"role": "assistant", "content": None}]}], r"\[0\]\.traj\[0\]: assistant message has neither"),
    ([{**GOOD, "traj": [{"role": "tool", "content": "r"}]}], r"\[0\]\.traj\[0\]\.tool_call_id"),
    ([{**GOOD, "traj": [{"role": "assistant", "content": None, "tool_calls": [{"function": {}}]}]}],
     r"\[0\]\.traj\[0\]\.tool_calls\[0\]\.function"),
    ([GOOD, GOOD], r"\[1\]: \(task_id, trial\) duplicates trajectory \[0\]"),
])
def test_bad_files_name_file_and_position(tmp_path, data, where):
    p = _write(tmp_path, data)
    with pytest.raises(TraceFormatError, match=re.escape(str(p)) + ".*" + where):
        load_taubench(p)


def test_missing_file_and_bad_options(tmp_path):
    with pytest.raises(TraceFormatError, match="nope.json: cannot read"):
        load_taubench(tmp_path / "nope.json")
    with pytest.raises(ValueError, match="max_turns must be a positive integer"):
        load_taubench(max_turns=0)
    with pytest.raises(ValueError, match="max_conversations"):
        load_taubench(max_conversations=-1)
