"""Gaps within physical bounds, for every reader of agent traffic (loadgen/traces/).

A session's requests are sequential, so the client's time between two of them (``gap_s``: end of
the previous request to this arrival) lies within ``[0, start to start]``. The property, checked
over every shipped trace, the handed originals where present (``../shared/data``) and recorded
runs written with the store's real writer: every follow-up has a gap, 0 <= gap <= this
``arrival_s`` minus the previous one's, and a first request has none.

tau-bench and vLLM multi-turn files carry no times (their gaps are the workload's, not a
trace's), so they have no gap to bound and are not read here.

Truths: the bounds come from the records' own arrival times; the estimated gaps and the old rule's
violations are hand-read from the files (trace_0183, trace_0324, trace_0043, ... named per test).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import itertools
import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest

from loadgen.traces.agent_request import AgentRequest, bounded_gap
from loadgen.traces.errors import TraceFormatError
from loadgen.traces.formats import iter_agent_requests
from loadgen.traces.kv_cache_tester import DEFAULT_DIR, read_kv_cache_tester_file
from loadgen.traces.recorded_runs import read_recorded_runs
from store.writer import Store

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "data" / "traces"
HANDED = REPO.parent / "shared" / "data"  # the originals, where this checkout sits next to them


def gap_violations(requests: Iterable[AgentRequest]) -> list[str]:
    """Every breach of the property, one line each (empty: none)."""
    sessions: dict[tuple[str, str], list[AgentRequest]] = {}
    for r in requests:
        sessions.setdefault((r.source, r.session_id), []).append(r)
    bad = []
    for (source, sid), rs in sessions.items():
        rs.sort(key=lambda r: r.request_index)
        first = rs[0]
        if first.gap_s is not None or first.gap_estimated:
            bad.append(f"{source} {sid}[{first.request_index}]: a first request with gap {first.gap_s}")
        for prev, r in itertools.pairwise(rs):
            bound = r.arrival_s - prev.arrival_s
            where = f"{source} {sid}[{r.request_index}]"
            if r.gap_s is None:
                bad.append(f"{where}: no gap")
            elif not 0.0 <= r.gap_s <= bound:
                bad.append(f"{where}: gap {r.gap_s} outside [0, {bound}]")
    return bad


def _traces() -> list[tuple[str, Path]]:
    """(format, path) of every trace file shipped, and of the handed originals that exist."""
    out = [("kv_cache_tester", p) for p in sorted((SHIPPED / "kv-cache-tester").glob("*.json"))]
    out += [("tracelab", SHIPPED / "tracelab_round_trace.jsonl"), ("mooncake", SHIPPED / "conversation_trace.jsonl"),
            ("azure", SHIPPED / "AzureLLMInferenceTrace_conv.csv")]
    if HANDED.is_dir():
        out += [("kv_cache_tester", p) for p in sorted((HANDED / "kv-cache-tester").glob("*.json"))]
        out += [(f, HANDED / n) for f, n in (("tracelab", "tracelab_round_trace.jsonl"),
                                             ("mooncake", "conversation_trace.jsonl"),
                                             ("azure", "AzureLLMInferenceTrace_conv.csv")) if (HANDED / n).exists()]
    return out


def _id(case: tuple[str, Path]) -> str:
    fmt, p = case
    return f"{fmt}-{'handed' if HANDED in p.parents else 'shipped'}-{p.stem}"


@pytest.mark.parametrize("case", _traces(), ids=_id)
def test_every_gap_within_start_to_start(case):
    fmt, path = case
    got = list(iter_agent_requests(path, fmt))
    assert got
    assert gap_violations(got) == []


def test_handed_originals_are_checked_where_present():
    """The handed data, when next to this checkout, adds 24 kv-cache-tester files and 3 traces."""
    if not HANDED.is_dir():
        pytest.skip("../shared/data is not next to this checkout")
    assert sum(1 for c in _traces() if HANDED in c[1].parents) == 24 + 3


# ----------------------------------------------------------------------- kv-cache-tester, by hand


def _session(path: Path, session: str) -> dict[int, AgentRequest]:
    return {r.request_index: r for r in read_kv_cache_tester_file(path) if r.session_id == session}


def test_kv_cache_tester_estimates_start_to_start_after_a_streamed_request():
    """trace_0183 requests 44-46 have no api_time; 45, 46, 47 arrive 31, 27 and 14 s after them
    (t = 7903, 7934, 7961, 7975 in the file) and carry think_time 445, 472, 486: the gap is the
    start-to-start bound, estimated. Request 44 follows 43, which has api_time: measured."""
    s = _session(DEFAULT_DIR / "trace_0183.json", "trace_0183")
    assert [(s[k].gap_s, s[k].gap_estimated) for k in (45, 46, 47)] == [(31.0, True), (27.0, True), (14.0, True)]
    assert s[44].gap_estimated is False and s[44].gap_s <= s[44].arrival_s - s[43].arrival_s
    # trace_0324 request 19 (t 2624) comes 7 s after request 18 (t 2617, no api_time), think_time 1,526 s
    r19 = _session(DEFAULT_DIR / "trace_0324.json", "trace_0324")[19]
    assert (r19.gap_s, r19.gap_estimated) == (7.0, True)


@pytest.mark.parametrize(("trace", "start_to_start"), [("trace_0043", 10.0), ("trace_0052", 12.0),
                                                       ("trace_0074", 18.0)])
def test_kv_cache_tester_second_request_after_a_streamed_first_has_a_gap(trace, start_to_start):
    """Request 0 has no api_time and request 1 no think_time (hand-read: t 0 and 10, 12, 18)."""
    r1 = _session(DEFAULT_DIR / f"{trace}.json", trace)[1]
    assert (r1.gap_s, r1.gap_estimated) == (start_to_start, True)


def test_kv_cache_tester_rounding_below_zero_is_zero(tmp_path):
    """``t`` is whole seconds, ``api_time`` hundredths: a request at t=5 after one at t=0 with
    api_time 5.4 s has a gap of 0 (measured, clipped), not -0.4 s."""
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"id": "x", "block_size": 64, "requests": [
        {"t": 0, "in": 64, "out": 5, "hash_ids": [1], "api_time": 5.4},
        {"t": 5, "in": 128, "out": 5, "hash_ids": [1, 2], "api_time": 1.0, "think_time": 0},
        {"t": 9, "in": 128, "out": 5, "hash_ids": [1, 2], "think_time": 3}]}))
    got = read_kv_cache_tester_file(p)
    assert [(r.gap_s, r.gap_estimated) for r in got] == [(None, False), (0.0, False), (3.0, False)]


def _random_requests(rng: np.random.Generator, n: int, depth: int) -> list[dict]:
    """``n`` requests at whole-second times, api_time missing on about a third, think_time
    anything (up to 10,000 s), a sub-agent now and then (nested up to ``depth``)."""
    out, t, ids = [], 0, []
    for _ in range(n):
        t += int(rng.integers(0, 40))
        ids = ids + [int(x) for x in rng.integers(0, 10**6, int(rng.integers(0, 3)))]
        r = {"t": t, "in": 64 * len(ids) + int(rng.integers(0, 64)), "out": int(rng.integers(1, 500)),
             "hash_ids": ids, "think_time": float(rng.uniform(0, 10_000))}
        if rng.random() > 0.35:
            r["api_time"] = round(float(rng.exponential(15.0)), 2)  # may exceed the time to the next
        out.append(r)
        if depth and rng.random() < 0.1:
            out.append({"type": "subagent", "t": t, "requests": _random_requests(rng, int(rng.integers(1, 6)),
                                                                                 depth - 1)})
    return out


@pytest.mark.parametrize("seed", range(20))
def test_random_kv_cache_tester_traces(tmp_path, seed):
    """Seeded random traces: every follow-up within its bounds, estimated exactly after a request
    without api_time (counted here from the generated requests)."""
    rng = np.random.default_rng(seed)
    doc = {"id": f"r{seed}", "block_size": 64, "requests": _random_requests(rng, 60, 2)}
    p = tmp_path / "t.json"
    p.write_text(json.dumps(doc))
    got = read_kv_cache_tester_file(p)
    assert gap_violations(got) == []
    sessions: list[list[dict]] = []
    _walk(doc["requests"], sessions)
    want = sum(1 for s in sessions for prev, _ in itertools.pairwise(s) if "api_time" not in prev)
    assert sum(r.gap_estimated for r in got) == want


def _walk(items: list[dict], out: list[list[dict]]) -> None:
    mine: list[dict] = []
    out.append(mine)
    for r in items:
        if r.get("type") == "subagent":
            _walk(r["requests"], out)
        else:
            mine.append(r)


def test_old_think_time_rule_breaks_the_bound():
    """The check has teeth: the rule this reader had (a request after one without api_time takes
    its own think_time as the gap, or none) breaks the property on the shipped traces, in the
    requests named above among others; the current rule does not."""
    old = []
    for p in sorted(DEFAULT_DIR.glob("*.json")):
        doc = {(r.session_id, r.request_index): r for r in read_kv_cache_tester_file(p)}
        think = _think_times(json.loads(p.read_text()), doc)
        old += [dataclasses.replace(r, gap_s=think[key]) if r.gap_estimated else r for key, r in doc.items()]
    bad = gap_violations(old)
    assert "kv-cache-tester:trace_0183 trace_0183[45]: gap 445.0 outside [0, 31.0]" in bad
    assert "kv-cache-tester:trace_0324 trace_0324[19]: gap 1526.0 outside [0, 7.0]" in bad
    assert {b for b in bad if b.endswith("no gap")} == {
        f"kv-cache-tester:{t} {t}[1]: no gap" for t in ("trace_0043", "trace_0052", "trace_0074")}
    # every request after a streamed one breaks it: 101 with a think_time, 3 without
    assert len(bad) == sum(1 for r in old if r.gap_estimated) == 104


def _think_times(doc: dict, records: dict) -> dict[tuple[str, int], float | None]:
    """(session id, request index) -> the file's think_time, walking the file like the reader."""
    out: dict[tuple[str, int], float | None] = {}

    def walk(items: list[dict], sid: str) -> None:
        k = 0
        for r in items:
            if r.get("type") == "subagent":
                walk(r["requests"], f"{sid}/{r['agent_id']}")
                continue
            out[(sid, k)] = r.get("think_time")
            k += 1

    walk(doc["requests"], doc["id"])
    assert out.keys() == records.keys()
    return out


# ----------------------------------------------------------------------- TraceLab, Mooncake, recorded runs


def _tracelab_lines() -> list[dict]:
    return [json.loads(x) for x in (SHIPPED / "tracelab_round_trace.jsonl").read_text().splitlines()[:2]]


def test_tracelab_round_ending_after_the_next_arrival_has_gap_zero(tmp_path):
    """Round 0's last event moved to 05:41:00, after round 1's last tool result (05:40:50.938):
    the measured gap is 0 (not -9.06 s), and so is its tool part."""
    r0, r1 = _tracelab_lines()
    r0["timing_events"].append({"event_type": "text", "timestamp": "2026-06-01T05:41:00.000Z"})
    p = tmp_path / "r.jsonl"
    p.write_text("".join(json.dumps(x) + "\n" for x in (r0, r1)))
    got = list(iter_agent_requests(p, "tracelab"))
    assert [(r.request_index, r.gap_s, r.tool_s, r.gap_estimated) for r in got] == [
        (0, None, None, False), (1, 0.0, 0.0, False)]


def test_tracelab_rounds_out_of_order_name_the_line(tmp_path):
    """Lines 1 and 2 with their round_index swapped: round 1 (line 1) arrives before round 0."""
    r0, r1 = _tracelab_lines()
    r0["round_index"], r1["round_index"] = 1, 0
    p = tmp_path / "r.jsonl"
    p.write_text("".join(json.dumps(x) + "\n" for x in (r0, r1)))
    with pytest.raises(TraceFormatError, match=r"r\.jsonl:1: timing_events: round 1 of session "
                                                r"claude:claude-public-example arrives before round 0 \(line 2\)"):
        list(iter_agent_requests(p, "tracelab"))


def test_mooncake_gap_is_start_to_start_estimated(tmp_path):
    """r4 fills r0's partial last block 61 s later (a re-hashed link; block 0 is the common
    prefix, block 1 is in 2 of 5 requests): gap 61 s, estimated; the rest are one-request sessions."""
    p = tmp_path / "m.jsonl"
    rows = [(0, 1100, [0, 1, 2]), (1000, 700, [0, 7]), (2000, 700, [0, 8]), (3000, 700, [0, 9]),
            (61000, 1900, [0, 1, 3, 4])]
    p.write_text("".join(json.dumps({"timestamp": ts, "input_length": n, "output_length": 5, "hash_ids": ids}) + "\n"
                         for ts, n, ids in rows))
    got = list(iter_agent_requests(p, "mooncake"))
    follow = [(r.arrival_s, r.gap_s, r.gap_estimated) for r in got if r.request_index > 0]
    assert follow == [(61.0, 61.0, True)]
    assert [(r.gap_s, r.gap_estimated) for r in got if r.request_index == 0] == [(None, False)] * 4


def test_recorded_runs_gaps(tmp_path):
    """Turns written with the store's writer: a measured gap; one that clock skew would make
    negative (the next turn sent 0.2 s before the previous one's recorded end): 0; after a failed
    turn without E2E, the planned gap (4 s) when it fits, else the start-to-start bound (3 s)."""
    s = Store(tmp_path / "store")
    s.init()
    t0 = dt.datetime(2026, 11, 1, tzinfo=dt.UTC)
    sec = dt.timedelta(seconds=1)
    # (sent at s, e2e s, planned gap s)
    plan = [(0, 2.0, None), (7, 3.2, 5.0), (10, None, 1.0), (15, 1.0, 4.0), (16, None, 0.5), (19, 1.0, 9.0)]
    with s.writer("r1", "w") as w:
        w.append("runs_log", {"run_id": "r1", "status": "complete", "updated_at": t0})
        for i, (at, e2e, gap) in enumerate(plan):
            w.append("turns", {"session_id": "a", "turn_index": i, "sent_at": t0 + at * sec, "e2e_s": e2e,
                               "prompt_tokens": 100, "completion_tokens": 5, "gap_kind": "tool" if i else "none",
                               "gap_before_s": gap, "status": "ok" if e2e else "error"})
    got = read_recorded_runs(s.root)
    assert [(r.gap_s, r.gap_estimated) for r in got] == [
        (None, False), (5.0, False), (0.0, False), (4.0, True), (0.0, False), (3.0, True)]
    assert gap_violations(got) == []


def test_recorded_runs_of_the_dashboard_store(tmp_path):
    """The dashboard tests' store (four runs, timeouts and a pause past the TTL) reads within bounds."""
    from tests import dashboard_store

    got = read_recorded_runs(dashboard_store.build(tmp_path / "store"))
    assert len(got) == 4 * 3 * 4
    assert gap_violations(got) == []


def test_bounded_gap():
    assert (bounded_gap(-0.4, 5.0), bounded_gap(2.5, 5.0), bounded_gap(9.0, 5.0)) == (0.0, 2.5, 5.0)
    with pytest.raises(ValueError, match="start_to_start_s must be >= 0"):
        bounded_gap(1.0, -1.0)
