"""Readers of real agent traffic: kv-cache-tester and TraceLab (loadgen/traces/, AgentRequest).

Truths are computed here by another route than the readers': plain ``json`` and hand logic that
walks the files (gaps from ``t`` and ``api_time``, shared prefixes by a naive
element-by-element comparison), plus a few hand-read literal values from the files (named in each
test) and hand-made files for the error cases.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from loadgen.traces.errors import TraceFormatError
from loadgen.traces.kv_cache_tester import (
    DEFAULT_DIR,
    common_leading,
    read_kv_cache_tester,
    read_kv_cache_tester_file,
)
from loadgen.traces.tracelab import DEFAULT_TRACE as TRACELAB
from loadgen.traces.tracelab import read_tracelab

TTL_S = 480.0
TRACES = sorted(DEFAULT_DIR.glob("*.json"))


def walk(items: list[dict], out: list[list[dict]]) -> None:
    """Append each session's request list (the parent's, then each sub-agent's) to ``out``."""
    mine: list[dict] = []
    out.append(mine)
    for r in items:
        if r.get("type") == "subagent":
            walk(r["requests"], out)
        else:
            mine.append(r)


def truth(path: Path) -> dict[str, int]:
    """Sessions, requests, follow-ups within 480 s and estimated gaps of one file, by hand.

    A follow-up's gap is ``t - t_prev - api_time_prev`` when the previous request has an
    ``api_time`` (0 if rounding makes it negative); otherwise the trace does not say when the
    previous request ended and the gap is bounded by start to start, ``t - t_prev`` (estimated).
    ``think_time`` is not the gap then: it counts from the last request that had an ``api_time``.
    """
    sessions: list[list[dict]] = []
    walk(json.loads(path.read_text())["requests"], sessions)
    within = estimated = 0
    for s in sessions:
        for prev, r in itertools.pairwise(s):
            if "api_time" in prev:
                within += max(0.0, r["t"] - prev["t"] - prev["api_time"]) <= TTL_S
            else:
                estimated += 1
                within += r["t"] - prev["t"] <= TTL_S
    return {"sessions": len(sessions), "requests": sum(len(s) for s in sessions), "within_ttl": within,
            "estimated": estimated}


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.stem)
def test_kv_cache_tester_counts_per_trace(path):
    got = read_kv_cache_tester_file(path)
    t = truth(path)
    assert len({r.session_id for r in got}) == t["sessions"]
    assert len(got) == t["requests"]
    follow = [r for r in got if r.request_index > 0]
    assert all(r.gap_s is not None for r in follow)
    assert sum(1 for r in follow if r.gap_s <= TTL_S) == t["within_ttl"]
    assert sum(1 for r in got if r.gap_estimated) == t["estimated"]


def test_kv_cache_tester_corpus_totals():
    """24 files, 740 requests, 11 sub-agents (data/traces/SOURCES.md)."""
    got = read_kv_cache_tester()
    assert len(TRACES) == 24
    assert len(got) == 740
    subs = {r.session_id for r in got if r.parent_session_id is not None}
    assert len(subs) == 11
    assert len({r.session_id for r in got}) == 24 + 11


def naive_common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.stem)
def test_shared_prefix_by_naive_comparison(path):
    sessions: list[list[dict]] = []
    walk(json.loads(path.read_text())["requests"], sessions)
    want = []
    for s in sessions:
        want += [0] + [min(r["in"], 64 * naive_common(p["hash_ids"], r["hash_ids"])) for p, r in itertools.pairwise(s)]
    got = read_kv_cache_tester_file(path)
    by_session: dict[str, list] = {}
    for r in got:
        by_session.setdefault(r.session_id, []).append(r)
    got_in_file_order = [r.shared_prefix_tokens for sid in by_session for r in
                         sorted(by_session[sid], key=lambda r: r.request_index)]
    assert sorted(got_in_file_order) == sorted(want)
    assert sum(got_in_file_order) == sum(want)


def named(path: Path, session: str, index: int):
    (r,) = [r for r in read_kv_cache_tester_file(path) if r.session_id == session and r.request_index == index]
    return r


def test_named_requests_hand_read():
    # trace_0036 request 1 (t=3360, in=72,464): its first 256 ids are request 0's first 256 of 259
    # (the prompt was rewritten after block 256): 256 x 64 = 16,384 tokens shared. Request 0 ended
    # at 0 + 4.05 s; request 1 arrived at 3360 s: a 3,355.95 s gap (the trace's think_time: 3356).
    r = named(DEFAULT_DIR / "trace_0036.json", "trace_0036", 1)
    assert r.shared_prefix_tokens == 16_384
    assert r.gap_s == pytest.approx(3355.95)
    assert r.server_s == pytest.approx(8.06)
    assert r.gap_kind == "tool"
    # trace_0043 request 17: a compaction; only 237 of the previous 683 ids survive: 15,168 tokens.
    assert named(DEFAULT_DIR / "trace_0043.json", "trace_0043", 17).shared_prefix_tokens == 15_168
    # trace_0277: the parent's request 1 (t=228) follows request 0 (305 ids) across three
    # sub-agents: 305 x 64 = 19,520 shared; sub-agent agent_002 starts at 183.906 s and its second
    # request (t=13 on its own clock) arrives at 196.906 s, concurrent with the parent.
    p = DEFAULT_DIR / "trace_0277.json"
    assert named(p, "trace_0277", 1).shared_prefix_tokens == 19_520
    s = named(p, "trace_0277/agent_002", 1)
    assert s.arrival_s == pytest.approx(196.906)
    assert s.parent_session_id == "trace_0277"


def test_common_leading_matches_naive():
    cases = [([], []), ([1, 2, 3], [1, 2, 3, 4]), ([1, 2, 3], [1, 2, 9]), ([5], [6]),
             (list(range(100)), list(range(57)) + [-1] * 10), (list(range(10)), list(range(10)))]
    for a, b in cases:
        assert common_leading(a, b) == naive_common(a, b)


def iso(s: str) -> float:
    return dt.datetime.strptime(s, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=dt.UTC).timestamp()


def test_tracelab_against_plain_json():
    rows = [json.loads(line) for line in TRACELAB.read_text().splitlines() if line.strip()]
    got = read_tracelab()
    assert len(got) == len(rows) == 19
    assert {r.session_id for r in got} == {r["session_id"] for r in rows}
    by_key = {(r.session_id, r.request_index): r for r in got}
    for d in rows:
        a = by_key[(d["session_id"], d["round_index"])]
        assert a.input_tokens == d["prefix_tokens"] + d["newly_append_tokens"]
        assert a.shared_prefix_tokens == d["prefix_tokens"]
        assert a.output_tokens == d["output_tokens"]
    # Hand-read: Claude round 0 ends with its tool_call at 05:40:31.647; round 1's last input event
    # (the WebSearch result) is at 05:40:50.938: a 19.291 s gap, all of it covered by the WebSearch
    # tool (emitted 05:40:31.647, 19,291 ms). Round 5 follows a user message: no tool time.
    c1 = by_key[("claude:claude-public-example", 1)]
    assert c1.gap_s == pytest.approx(iso("2026-06-01T05:40:50.938Z") - iso("2026-06-01T05:40:31.647Z"), abs=1e-3)
    assert c1.tool_s == pytest.approx(19.291, abs=1e-3)
    assert c1.gap_kind == "tool"
    c5 = by_key[("claude:claude-public-example", 5)]
    assert c5.gap_kind == "think" and c5.tool_s == 0.0 and c5.gap_s > 0
    # every gap is within 480 s in these two sessions (the longest is seconds); count by hand route
    follow = [r for r in got if r.request_index > 0]
    assert len(follow) == 19 - 2
    assert all(r.gap_s is not None and r.gap_s <= TTL_S for r in follow)


def test_kv_cache_tester_errors_name_file_position_field(tmp_path):
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"id": "x", "requests": [
        {"t": 0, "in": 130, "out": 5, "hash_ids": [1, 2], "api_time": 1.0},
        {"type": "subagent", "t": 3, "requests": [{"t": 0, "in": None, "out": 1, "hash_ids": []}]}]}))
    with pytest.raises(TraceFormatError, match=r"t\.json: requests\[1\]\.requests\[0\]: in: expected an integer >= 0, got None"):
        read_kv_cache_tester_file(p)
    p.write_text(json.dumps({"id": "x", "requests": [{"t": 0, "in": 130, "out": 5, "hash_ids": [1]}]}))
    with pytest.raises(TraceFormatError, match=r"requests\[0\]: hash_ids: expected 2 ids"):
        read_kv_cache_tester_file(p)
    p.write_text('{"id": "x",\n "requests": [\n  {"t": 0,, }]}')
    with pytest.raises(TraceFormatError, match=r"t\.json:3: not valid JSON"):
        read_kv_cache_tester_file(p)


def test_tracelab_errors_name_file_line_field(tmp_path):
    lines = TRACELAB.read_text().splitlines()
    bad = json.loads(lines[2])
    bad["prefix_tokens"] = None
    p = tmp_path / "r.jsonl"
    p.write_text("\n".join([lines[0], lines[1], json.dumps(bad)]) + "\n")
    with pytest.raises(TraceFormatError, match=r"r\.jsonl:3: prefix_tokens: expected an integer >= 0, got None"):
        read_tracelab(p)


def test_recorded_runs_adapter(tmp_path):
    """Turns written to a store come back as requests: times from sent_at/e2e_s by hand."""
    from loadgen.traces.recorded_runs import read_recorded_runs
    from store.writer import Store

    s = Store(tmp_path / "store")
    s.init()
    t0 = dt.datetime(2026, 11, 1, tzinfo=dt.UTC)
    sec = dt.timedelta(seconds=1)
    with s.writer("r1", "w") as w:
        w.append("runs_log", {"run_id": "r1", "status": "complete", "updated_at": t0})
        # session a: turn 0 at 0 s (2 s long), turn 1 at 7 s after a tool gap, turn 2 at 20 s
        for i, (at, e2e, gk, exp) in enumerate([(0, 2.0, "none", None), (7, 1.5, "tool", 900), (20, 1.0, "think", 1200)]):
            w.append("turns", {"session_id": "a", "turn_index": i, "sent_at": t0 + at * sec, "e2e_s": e2e,
                               "prompt_tokens": 1000 + 300 * i, "completion_tokens": 40, "gap_kind": gk,
                               "gap_before_s": 5.0, "expected_reusable_tokens": exp, "status": "ok"})
        w.append("turns", {"session_id": "b", "turn_index": 0, "sent_at": t0 + 3 * sec, "e2e_s": 0.5,
                           "prompt_tokens": 50, "completion_tokens": 5, "gap_kind": "none", "status": "ok"})
    got = read_recorded_runs(s.root)
    assert [(r.session_id, r.request_index, r.arrival_s) for r in got] == [("a", 0, 0.0), ("b", 0, 3.0), ("a", 1, 7.0), ("a", 2, 20.0)]
    a1, a2 = got[2], got[3]
    assert a1.gap_s == pytest.approx(7 - 2.0) and a1.tool_s == pytest.approx(5.0) and a1.gap_kind == "tool"
    assert a2.gap_s == pytest.approx(20 - 7 - 1.5) and a2.tool_s is None and a2.gap_kind == "think"
    assert (a1.shared_prefix_tokens, a2.shared_prefix_tokens, got[0].shared_prefix_tokens) == (900, 1200, 0)
    assert {r.source for r in got} == {"run:r1"}
    assert read_recorded_runs(s.root, ["nope"]) == []


def test_kv_cache_tester_replay_plan_keeps_the_split(tmp_path):
    """trace_0277 planned at token_scale 0.02 and time_scale 0.05: sessions, sub-agent starts, the
    trace's reusable tokens and the new message sizes, from the plain-json walk."""
    from loadgen.synth_text import LocalTokenizer, TextSynth
    from loadgen.workload import describe, load_workload, plan_workload
    from tests.embedded_tokenizer import tokenizer_json

    path = DEFAULT_DIR / "trace_0277.json"
    wf = tmp_path / "w.yaml"
    wf.write_text(f"name: kv\nsessions: 0\ntraces:\n  - {{format: kv_cache_tester, path: {path}, "
                  f"token_scale: 0.02, time_scale: 0.05, min_new_tokens: 1}}\n")
    tok = LocalTokenizer(tokenizer_json())
    plans = plan_workload(load_workload(wf), TextSynth(tok, 0))
    doc = json.loads(path.read_text())
    sessions: list[list[dict]] = []
    walk(doc["requests"], sessions)
    assert len(plans) == 5 and sorted(len(p.turns) for p in plans) == sorted(len(s) for s in sessions)
    subs = [r for r in doc["requests"] if r.get("type") == "subagent"]
    starts = sorted(p.start_at_s for p in plans)
    assert starts == pytest.approx(sorted([0.0] + [r["t"] * 0.05 for r in subs]))
    parent = next(p for p in plans if "agent" not in p.session_id)
    truth_parent = sessions[0]
    for k in range(1, len(truth_parent)):
        a, b = truth_parent[k - 1], truth_parent[k]
        shared = min(b["in"], 64 * naive_common(a["hash_ids"], b["hash_ids"]))
        tp = parent.turns[k]
        assert tp.trace_reusable_tokens == round(shared * 0.02)
        want_new = max(1, round((b["in"] - shared) * 0.02) - max(1, round(a["out"] * 0.02)))
        (n,) = tok.count([tp.new_messages[0]["content"]])
        assert abs(n - want_new) <= 2  # synthesized text hits its token count to within a token or two
        assert tp.at_s == pytest.approx((b["t"] - truth_parent[0]["t"]) * 0.05)
    # the longest gap of the plan: the parent's 378 s wait for agent_004 (t 347 + 37.63 -> 763),
    # scaled by 0.05, is among the arrival-to-arrival gaps the summary now reports
    longest = max(b["t"] - a["t"] for s in sessions for a, b in itertools.pairwise(s)) * 0.05
    assert f"longest gap {longest:.1f} s" in describe(plans)


def test_workload_summary_longest_gap_of_a_mooncake_replay(tmp_path):
    """Mooncake replays carry arrival times (at_s), not gaps: the summary reports the real gap."""
    from loadgen.synth_text import LocalTokenizer, TextSynth
    from loadgen.workload import describe, load_workload, plan_workload
    from tests.embedded_tokenizer import tokenizer_json

    # one chain of full 512-token blocks (arrivals 0, 7 and 95.5 s) and four unrelated requests,
    # so the trace-wide common prefix is block 0 alone
    chain = [(0, [0, 1]), (7_000, [0, 1, 2]), (95_500, [0, 1, 2, 3])]
    other = [(1_000 * (i + 1), [0, 10 + i]) for i in range(4)]
    rows = sorted(({"timestamp": ts, "input_length": 512 * len(ids), "output_length": 10, "hash_ids": ids}
                   for ts, ids in chain + other), key=lambda r: r["timestamp"])
    trace = tmp_path / "m.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    wf = tmp_path / "w.yaml"
    wf.write_text(f"name: m\nsessions: 0\ntraces:\n  - {{format: mooncake, path: {trace}, token_scale: 0.1}}\n")
    plans = plan_workload(load_workload(wf), TextSynth(LocalTokenizer(tokenizer_json()), 0))
    assert "longest gap 88.5 s" in describe(plans)  # 95.5 s - 7.0 s, by hand


def test_a_recorded_run_whose_client_stripped_its_history_is_planned_with_less_to_pull(tmp_path):
    """The planner's reuse of a recorded run is each turn's ``expected_reusable_tokens``. Truth by
    hand (vLLM's CPU blocks of 128, threshold 64): turn 0 of 1,000 prompt tokens + 32 generated
    leaves D holding 1,031; P holds the prompt's whole blocks, 896. The client that sends the
    reply back shares all 1,031 tokens: P pulls 1,031 - 896 = 135. The one that strips the reply's
    reasoning shares only the 1,000 of the prompt: the handle is cut to 896, which P holds, and
    nothing is pulled."""
    from loadgen.traces.recorded_runs import read_recorded_runs
    from planner.simulate import Traffic, pull_if_hit
    from store.writer import Store

    s = Store(tmp_path / "store")
    s.init()
    t0 = dt.datetime(2026, 11, 1, tzinfo=dt.UTC)
    for run_id, shared in (("as-returned", 1032), ("stripped", 1000)):
        with s.writer(run_id, "w") as w:
            w.append("runs_log", {"run_id": run_id, "status": "complete", "updated_at": t0})
            for i, (prompt, exp) in enumerate([(1000, 0), (1100, shared)]):
                w.append("turns", {"session_id": "a", "turn_index": i, "sent_at": t0 + dt.timedelta(seconds=10 * i),
                                   "e2e_s": 1.0, "prompt_tokens": prompt, "completion_tokens": 32, "gap_kind": "tool",
                                   "expected_reusable_tokens": exp, "status": "ok"})
    local = np.array([0, 896])  # P's own-cache hit of each turn: the previous prompt's whole blocks
    pulls = {run_id: pull_if_hit(Traffic.of(read_recorded_runs(s.root, [run_id])), local, 128, 64).tolist()
             for run_id in ("as-returned", "stripped")}
    assert pulls == {"as-returned": [0, 135], "stripped": [0, 0]}
