"""The load a forecast is made at (planner/load.py), against hand-made mixes: where every
copy of a session tree lands, the closed loop's starts by hand, the Poisson rate against the rate
asked for, and the errors that name the options."""

from __future__ import annotations

import numpy as np
import pytest

from loadgen.traces.agent_request import AgentRequest
from planner.load import Load, LoadKind, apply_load, at_load, closed_loop_starts
from planner.simulate import Traffic


def mix() -> Traffic:
    """Two own-clock files: tree A (a root session and a sub-agent; requests at 0, 5 and 7 s, the last
    one's server time 3 s: it ends at 10 s) and tree B (one request at 0 s, no server time)."""
    return Traffic.of([AgentRequest("A", "a", 0, 0.0, 100, 10, 0, server_s=1.0),
                       AgentRequest("A", "a/sub", 0, 5.0, 50, 10, 0, server_s=1.0),
                       AgentRequest("A", "a", 1, 7.0, 150, 10, 100, server_s=3.0, gap_s=6.0),
                       AgentRequest("B", "b", 0, 0.0, 80, 10, 0)])


def test_closed_loop_starts_by_hand():
    # two slots: the 10 s session on slot 1 (0-10), 5 s on slot 2 (0-5), 3 s on slot 2 (5-8), 4 s on slot 2 (8-12)
    assert closed_loop_starts(2, np.array([10.0, 5.0, 3.0, 4.0])).tolist() == [0.0, 0.0, 5.0, 8.0]


def test_concurrent_sessions_play_each_tree_after_the_previous_one_ends():
    lt = apply_load(mix(), Load(kind=LoadKind.CONCURRENT_SESSIONS, value=1, sessions=3, seed=1), "source")
    tr = lt.traffic
    trees = np.random.default_rng(1).integers(0, 2, size=3)   # the draw: the same generator, first call
    # one slot: each tree starts when the previous ends (A lasts 10 s, B 0 s: its request has no server time)
    starts, t = [], 0.0
    for k in trees:
        starts.append(t)
        t += 10.0 if k == 0 else 0.0
    expected = sorted((s + a, str(k)) for s, k in zip(starts, trees) for a in ((0.0, 5.0, 7.0) if k == 0 else (0.0,)))
    assert sorted(tr.arrival_s.tolist()) == [a for a, _ in expected]
    assert len(set(tr.session_code)) == sum(2 if k == 0 else 1 for k in trees)   # a copy's sessions are its own
    assert all("#" in s for s in tr.session)
    assert lt.trees == 2


def test_sessions_per_hour_start_at_the_rate_asked_for():
    lt = apply_load(mix(), Load(kind=LoadKind.SESSIONS_PER_HOUR, value=360, sessions=2000, seed=3), "source")
    firsts = np.sort(lt.traffic.arrival_s[lt.traffic.request_index == 0])
    # 360 per hour: one start every 10 s on average; sub-agents also have a request 0, so take the roots
    roots = np.sort(lt.traffic.arrival_s[[not s.split("#")[0].endswith("/sub") and r == 0
                                          for s, r in zip(lt.traffic.session, lt.traffic.request_index)]])
    gaps = np.diff(roots)
    assert len(roots) == 2000 and len(firsts) > len(roots)
    assert gaps.mean() == pytest.approx(10.0, rel=0.06)        # 2,000 exponential gaps: 3 standard errors
    assert np.std(gaps) == pytest.approx(10.0, rel=0.1)         # exponential: the sd equals the mean
    assert "360 new sessions per hour (Poisson starts, seed 3; 2,000 sessions drawn from 2 session trees)" in lt.label()


def test_recorded_clock_scaled():
    tr = Traffic.of([AgentRequest("run", "s1", 0, 0.0, 100, 10, 0), AgentRequest("run", "s1", 1, 8.0, 150, 10, 100,
                                                                                    gap_s=4.0)])
    lt = at_load(tr, ["tracelab"], Load(kind=LoadKind.RECORDED, value=2.0))
    assert lt.traffic.arrival_s.tolist() == [0.0, 4.0] and lt.traffic.gap_s[1] == 2.0
    assert at_load(tr, ["tracelab"], None).traffic.arrival_s.tolist() == [0.0, 8.0]


def test_own_clock_traces_need_a_load():
    with pytest.raises(ValueError, match="record no load.*--sessions-per-hour R.*--concurrent-sessions N"):
        at_load(mix(), ["kv_cache_tester"], None)
    with pytest.raises(ValueError, match="no shared clock"):
        at_load(mix(), ["kv_cache_tester"], Load(kind=LoadKind.RECORDED, value=1.0))
    with pytest.raises(ValueError, match="mix formats with a shared clock"):
        at_load(mix(), ["kv_cache_tester", "tracelab"], None)
    one = Traffic.of([AgentRequest("A", "a", 0, 0.0, 100, 10, 0)])
    assert len(at_load(one, ["kv_cache_tester"], None).traffic) == 1   # one tree as recorded is its own load


def test_bad_loads_are_refused():
    with pytest.raises(ValueError, match="whole number"):
        Load(kind=LoadKind.CONCURRENT_SESSIONS, value=2.5)
    with pytest.raises(ValueError):
        Load(kind=LoadKind.SESSIONS_PER_HOUR, value=0)
