"""FIFO waits for the prefill worker (planner/queueing.py) and their place in the TTFT
forecast, against hand-computed cases and an independent event-by-event loop.

Profile (tests/unit/test_planner_simulate.py): c(x) = 1e-4 x, b0 10 ms, pull 1 GB/s, 4096 bytes/token."""

from __future__ import annotations

import numpy as np
import pytest

from loadgen.traces.agent_request import AgentRequest
from planner.queueing import fifo_waits, shared_core_waits
from planner.simulate import PlanSettings, plan
from tests.unit.test_planner_simulate import profile


def test_waits_by_hand():
    # one worker: the second waits until 1.0 (0.9 s), the third finds it idle (1.5 < 5)
    assert list(fifo_waits(np.array([0.0, 0.1, 5.0]), np.array([1.0, 0.5, 0.2]), np.zeros(3))) == \
        pytest.approx([0.0, 0.9, 0.0])
    # a queue of three at once: 0, 1, 1 + 0.5
    assert list(fifo_waits(np.zeros(3), np.array([1.0, 0.5, 0.2]), np.zeros(3))) == pytest.approx([0, 1.0, 1.5])
    # two workers: each request alone on its worker
    assert list(fifo_waits(np.array([0.0, 0.1]), np.array([1.0, 0.5]), np.array([0, 1]))) == [0.0, 0.0]


def test_waits_match_an_event_loop():
    rng = np.random.default_rng(3)
    arrival = np.sort(rng.uniform(0, 20, 300))
    service = rng.exponential(0.2, 300)
    worker = rng.integers(0, 3, 300)
    free = {0: 0.0, 1: 0.0, 2: 0.0}
    expected = []
    for a, s, w in zip(arrival, service, worker, strict=True):
        start = max(a, free[w])
        expected.append(start - a)
        free[w] = start + s
    assert fifo_waits(arrival, service, worker) == pytest.approx(expected, abs=1e-12)


def test_bad_input():
    with pytest.raises(ValueError, match="sorted"):
        fifo_waits(np.array([1.0, 0.0]), np.ones(2), np.zeros(2))
    with pytest.raises(ValueError, match="length"):
        fifo_waits(np.zeros(2), np.ones(3), np.zeros(2))


def test_shared_core_waits_by_hand():
    # two workers on one core, both at 0 for 1 s: half speed each, both end at 2 s
    assert list(shared_core_waits([0.0, 0.0], [1.0, 1.0], [0, 1], [0, 0])) == pytest.approx([1.0, 1.0])
    # the same two on one worker: its engine takes them in turn (FIFO)
    assert list(shared_core_waits([0.0, 0.0], [1.0, 1.0], [0, 0], [0, 0])) == pytest.approx([0.0, 1.0])
    # a (2 s at 0) and b (1 s at 1) on two workers of one core: from 1 s each has 1 s left at half
    # speed, both end at 3 s; c (1 s at 0.5) queues behind a on a's worker: it starts at 3, alone, ends at 4
    assert list(shared_core_waits([0.0, 0.5, 1.0], [2.0, 1.0, 1.0], [0, 0, 1], [0, 0, 0])) == \
        pytest.approx([1.0, 2.5, 1.0])
    # three workers, two cores: workers 0 and 1 share core 0, worker 2 has core 1 alone
    assert list(shared_core_waits([0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0, 1, 2], [0, 0, 1])) == \
        pytest.approx([1.0, 1.0, 0.0])


def test_shared_core_waits_match_a_time_stepped_loop():
    """Processor sharing against a plain loop in steps of 1 ms (another route to the same finish
    times: each busy worker's head gets 1/k of the core, k the busy workers of its core)."""
    rng = np.random.default_rng(5)
    arrival = np.round(np.sort(rng.uniform(0, 4, 40)), 3)
    service = np.round(rng.uniform(0.01, 0.3, 40), 3)
    worker = rng.integers(0, 3, 40)
    core_of = np.array([0, 0, 1])                # workers 0 and 1 share core 0
    server = core_of[worker]
    dt, t = 1e-3, 0.0
    left = service.copy()
    finish = np.full(40, np.nan)
    while np.isnan(finish).any():
        heads = []
        for w in range(3):
            queued = [i for i in range(40) if worker[i] == w and arrival[i] <= t + 1e-9 and np.isnan(finish[i])]
            if queued:
                heads.append(queued[0])
        for h in heads:
            k = sum(1 for g in heads if core_of[worker[g]] == core_of[worker[h]])
            left[h] -= dt / k
        t += dt
        for h in heads:
            if left[h] <= 1e-9:
                finish[h] = t
    expected = finish - arrival - service
    assert shared_core_waits(arrival, service, worker, server) == pytest.approx(expected, abs=5e-3)
    assert expected.max() > 0.1   # sharing and queueing both mattered


def test_shared_core_bad_input():
    with pytest.raises(ValueError, match="more than one server"):
        shared_core_waits([0.0, 1.0], [1.0, 1.0], [0, 0], [0, 1])
    with pytest.raises(ValueError, match="sorted"):
        shared_core_waits([1.0, 0.0], [1.0, 1.0], [0, 1], [0, 0])
    with pytest.raises(ValueError, match="length"):
        shared_core_waits([0.0], [1.0, 1.0], [0, 1], [0, 0])


def reqs():
    return [AgentRequest("t", "a", 0, 0.0, 1000, 32, 0, server_s=1.0),
            AgentRequest("t", "b", 0, 0.01, 1000, 32, 0, server_s=1.0)]


def test_second_arrival_waits_for_the_first_prefill():
    # both computed from scratch (0.1 s each): b waits 0.1 - 0.01 = 0.09 s on the one worker
    p = plan(reqs(), profile())
    for mode in ("aggregated", "pd", "pd-nocache"):
        assert list(p.modes[mode].queue_wait_s) == pytest.approx([0.0, 0.09])
        assert p.modes[mode].ttft_s[1] == pytest.approx(0.01 + 0.09 + 0.1)
    off = plan(reqs(), profile(), PlanSettings(queue_prefills=False))
    assert off.modes["aggregated"].ttft_s[1] == pytest.approx(0.01 + 0.1)
    two = plan(reqs(), profile(), PlanSettings(prefill_workers=2, aggregated_workers=2))
    assert two.modes["pd"].queue_wait_s[1] == 0.0
    # two P workers pinned to one core (embedded-cpu-2p1d), round robin: from b's arrival at 0.01
    # both compute at half speed; a's last 0.09 s of work ends at 0.01 + 0.18 = 0.19, b's last
    # 0.01 s alone at 0.20: each ends 0.09 s later than alone
    shared = plan(reqs(), profile(), PlanSettings(prefill_workers=2, routing="round-robin", prefill_servers=(0, 0)))
    assert list(shared.modes["pd"].queue_wait_s) == pytest.approx([0.09, 0.09])
    assert list(shared.modes["pd-bidir"].queue_wait_s) == pytest.approx([0.09, 0.09])   # settled after the handles
    apart = plan(reqs(), profile(), PlanSettings(prefill_workers=2, routing="round-robin", prefill_servers=(0, 1)))
    assert list(apart.modes["pd"].queue_wait_s) == [0.0, 0.0]


def test_prefill_servers_one_per_worker():
    with pytest.raises(ValueError, match="prefill_servers: 1 labels for 2 prefill workers"):
        PlanSettings(prefill_workers=2, prefill_servers=(0,))


def test_a_hit_holds_the_worker_for_its_new_tokens_only():
    # a's second request pulls 1031 tokens and computes 269 (0.0269 s); b arrives 5 ms later and
    # waits 0.0219 s: the pull (4.2 ms) does not hold P
    r = [AgentRequest("t", "a", 0, 0.0, 1000, 32, 0, server_s=1.0),
         AgentRequest("t", "a", 1, 5.0, 1300, 32, 1031, server_s=1.0),
         AgentRequest("t", "b", 0, 5.005, 1000, 32, 0, server_s=1.0)]
    m = plan(r, profile(), PlanSettings(modes=("pd-bidir-nocache",))).modes["pd-bidir-nocache"]
    assert m.queue_wait_s[2] == pytest.approx(0.0269 - 0.005)
    assert m.ttft_s[1] == pytest.approx(0.01 + 0.0269 + 1031 * 4096 / 1e9)


def test_chat_renders_on_the_ttft_path():
    # 1e-5 s per prompt token and render: aggregated renders once, P/D twice (P and D), and a
    # request that takes a handle once more (the proxy matches it against D's ids)
    prof = profile(render_s_per_token={"value": 1e-5, "source": "test"})
    r = [AgentRequest("t", "a", 0, 0.0, 1000, 32, 0, server_s=1.0),
         AgentRequest("t", "a", 1, 5.0, 1300, 32, 1031, server_s=1.0)]
    chat = plan(r, prof, PlanSettings(rendered_prompts=True))
    ids = plan(r, prof)
    for mode, renders in (("aggregated", [1, 1]), ("pd", [2, 2]), ("pd-bidir-nocache", [2, 3])):
        extra = chat.modes[mode].ttft_s - ids.modes[mode].ttft_s
        assert list(extra) == pytest.approx([1e-5 * 1000 * renders[0], 1e-5 * 1300 * renders[1]])


def test_the_wait_is_stored_with_the_request(tmp_path):
    import duckdb
    import pandas as pd

    from planner.plan_store import write_plan
    from store.writer import Store

    p = plan(reqs(), profile(), PlanSettings(modes=("aggregated",)))
    empty = pd.DataFrame()
    write_plan(Store(tmp_path), p, plan_id="plan-q", label=None, inputs=[], speedups=empty, frontiers=empty,
               sessions=empty)
    rows = duckdb.connect().execute(
        f"SELECT session_id, queue_wait_s, ttft_s FROM read_parquet('{tmp_path}/runs/plan-*/plan_requests/*.parquet') "
        "ORDER BY session_id").fetchall()
    assert [(s, pytest.approx(w), pytest.approx(t)) for s, w, t in rows] == [("a", 0.0, 0.11), ("b", 0.09, 0.2)]


def test_request_by_request_ttft_equals_the_whole_traffic_at_once():
    """PrefillTtft.next (one request at a time, as the handle simulation calls it) and .all (the
    vectorized Lindley recursion) are two routes to the same TTFT and wait."""
    from planner.simulate import ModeCost, PrefillTtft, Traffic

    rng = np.random.default_rng(11)
    r = [AgentRequest("t", f"s{k % 7}", k // 7, float(t), int(n), 32, 0, server_s=1.0)
         for k, (t, n) in enumerate(zip(np.sort(rng.uniform(0, 30, 120)), rng.integers(200, 4000, 120), strict=True))]
    tr = Traffic.of(r)
    local = rng.integers(0, 200, len(tr))
    pulled = rng.integers(0, 100, len(tr))
    took = rng.random(len(tr)) < 0.3
    settings = PlanSettings(prefill_workers=2, rendered_prompts=True)
    prof = profile(render_s_per_token={"value": 1e-5, "source": "test"})
    whole = PrefillTtft(tr, settings, "pd-bidir", ModeCost(tr, prof, settings, "pd-bidir")).all(local, pulled, took)
    one = PrefillTtft(tr, settings, "pd-bidir", ModeCost(tr, prof, settings, "pd-bidir"))
    each = [one.next(i, int(local[i]), int(pulled[i]), bool(took[i])) for i in range(len(tr))]
    assert [t for t, _ in each] == pytest.approx(list(whole[0]), abs=1e-12)
    assert [w for _, w in each] == pytest.approx(list(whole[1]), abs=1e-12)
    assert whole[1].max() > 0   # the queue mattered
