"""Host contention (planner/host_contention.py and its place in the plan): counts of
requests in flight and the term, against hand computations."""

from __future__ import annotations

import numpy as np
import pytest

from loadgen.traces.agent_request import AgentRequest
from planner import host_contention
from planner.profile import CostProfile, Sourced
from planner.simulate import PlanSettings, plan


def test_in_flight_counted_by_hand():
    # a: 0-10, b: 2-5, c: 5-6 (b ends at c's arrival: not in flight), d: 5-7 (arrives with c), e: 20-21
    arrival = np.array([0.0, 2.0, 5.0, 5.0, 20.0])
    end = np.array([10.0, 5.0, 6.0, 7.0, 21.0])
    # a: none before; b: a; c: a and d (same instant, arrived), not b; d: a and c; e: none left
    assert host_contention.in_flight_at_arrival(arrival, end).tolist() == [0, 1, 2, 2, 0]
    # the order given does not matter
    order = np.array([4, 2, 0, 3, 1])
    assert host_contention.in_flight_at_arrival(arrival[order], end[order]).tolist() == [0, 2, 0, 2, 1]


def test_a_request_of_no_duration_is_not_counted_twice():
    # x: 0-0 (no duration), y: 0-5, z: 1-2. x: y arrived with it (in flight); y: x has ended at 0;
    # z: y in flight, x ended
    arrival, end = np.array([0.0, 0.0, 1.0]), np.array([0.0, 5.0, 2.0])
    assert host_contention.in_flight_at_arrival(arrival, end).tolist() == [1, 0, 1]


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="one of each per request"):
        host_contention.in_flight_at_arrival(np.zeros(2), np.ones(3))
    with pytest.raises(ValueError, match="ends before it arrives"):
        host_contention.in_flight_at_arrival(np.array([1.0]), np.array([0.5]))


def test_term_by_hand_and_none_without_beta():
    arrival, end, own = np.array([0.0, 1.0, 1.5]), np.array([3.0, 2.0, 4.0]), np.array([0.2, 0.1, 0.4])
    # in flight: 0, 1 (the first), 2 (the first two)
    assert host_contention.contention_s(0.1, arrival, end, own) == pytest.approx([0.0, 0.01, 0.08])
    assert host_contention.contention_s(None, arrival, end, own).tolist() == [0.0, 0.0, 0.0]


def profile(beta: float | None) -> CostProfile:
    def src(v):
        return Sourced(value=v, source="test")
    return CostProfile(name="t", block_size=16, kv_bytes_per_token=src(1.0), prefill_a1_s_per_token=src(0.001),
                       b0_default_s=src(0.05), pull_bandwidth_bytes_per_s=src(1e9), decode_s_per_token=src(0.01),
                       host_contention_per_request=None if beta is None else src(beta))


def test_the_plan_adds_the_term_to_the_ttft_only():
    """Two sessions of aggregated traffic, token ids, FIFO on one worker (no token budget). Request A:
    1,000 tokens at 0 s, 100 output tokens; B: 500 tokens at 0.5 s, 100 output tokens. Uncontended:
    A's TTFT 0.05 + 1.0 = 1.05 s (ends 1.05 + 1.0 = 2.05 s, in flight at B's arrival); B waits for
    the worker until 1.0 s (0.5 s), then 0.5 s compute + b0: TTFT 1.05 s. With beta 0.1, B's own work
    is 0.55 s and one other is in flight: + 0.055 s. A's is unchanged."""
    reqs = [AgentRequest(session_id="a", request_index=0, arrival_s=0.0, input_tokens=1000, output_tokens=100, source="t"),
            AgentRequest(session_id="b", request_index=0, arrival_s=0.5, input_tokens=500, output_tokens=100, source="t")]
    settings = PlanSettings(modes=("aggregated",))
    base = plan(reqs, profile(None), settings).modes["aggregated"]
    with_term = plan(reqs, profile(0.1), settings).modes["aggregated"]
    assert base.ttft_s == pytest.approx([1.05, 1.05])
    assert with_term.ttft_s == pytest.approx([1.05, 1.105])
    assert with_term.contention_s == pytest.approx([0.0, 0.055])
    assert with_term.queue_wait_s == pytest.approx(base.queue_wait_s)   # the engine's events keep their times
    assert base.contention_s.size == 0


def test_the_split_shows_the_term_and_the_terms_still_sum_to_the_ttft():
    from planner.check import forecast_terms

    reqs = [AgentRequest(session_id="a", request_index=0, arrival_s=0.0, input_tokens=1000, output_tokens=100, source="t"),
            AgentRequest(session_id="b", request_index=0, arrival_s=0.5, input_tokens=500, output_tokens=100, source="t")]
    settings = PlanSettings(modes=("aggregated",))
    p = plan(reqs, profile(0.1), settings)
    terms = forecast_terms(p.traffic, p.modes["aggregated"], p.profile, settings)
    assert terms["contention"].tolist() == pytest.approx([0.0, 0.055])
    parts = terms[["compute", "pull", "queue_p", "wait_d", "fixed", "contention"]].sum(axis=1)
    assert parts.tolist() == pytest.approx(terms["ttft"].tolist())


def test_the_ledger_adds_the_same_term_as_the_plan():
    """The ledger's forecast of a strategy (recommend's and the fleet search's) takes the term as the
    plan does: the same TTFTs by the two routes, and by hand the second request's 0.1 x 1 x its own
    work more than without the term (its own work: the plan's TTFT less its waits, uncontended)."""
    from planner.ledger import forecast_strategy

    reqs = [AgentRequest(session_id="a", request_index=0, arrival_s=0.0, input_tokens=1000, output_tokens=100, source="t"),
            AgentRequest(session_id="b", request_index=0, arrival_s=0.5, input_tokens=500, output_tokens=100, source="t")]
    for strategy, mode in (("pd", "pd"), ("pd-bidir", "pd-bidir")):
        settings = PlanSettings(modes=(mode,))
        tr = plan(reqs, profile(0.1), settings).traffic
        planned = plan(reqs, profile(0.1), settings).modes[mode]
        bare = plan(reqs, profile(None), settings).modes[mode]
        ledger = forecast_strategy(tr, profile(0.1), settings, strategy)
        assert ledger.ttft_s == pytest.approx(planned.ttft_s)
        own = bare.ttft_s - bare.queued_s
        assert ledger.ttft_s == pytest.approx(bare.ttft_s + [0.0, 0.1 * own[1]])
        assert ledger.ttft_s[1] > bare.ttft_s[1]
