"""The engine's scheduler steps (planner/queueing.py ``batched_step_waits``) against
hand-computed steps of vLLM's scheduler (running requests first, then the waiting queue in order,
each taking what the token budget leaves; a step costs its chunks, ``c(p + k) - c(p)``), an
independent token-by-token loop, and their place in the forecast.

c(x) = 1e-3 x (+ 1e-7 x^2 where said), seconds."""

from __future__ import annotations

import numpy as np
import pytest

from loadgen.traces.agent_request import AgentRequest
from planner.queueing import batched_step_waits, fifo_waits
from planner.simulate import PlanSettings, plan
from tests.unit.test_planner_simulate import profile

A1 = 1e-3


def waits(arrival, start, end, budget=2048, a2=0.0, worker=None):
    n = len(arrival)
    return list(batched_step_waits(np.array(arrival, dtype=float), np.array(start), np.array(end), A1, a2, budget,
                                   np.zeros(n) if worker is None else np.array(worker)))


def test_two_prompts_arriving_together_share_one_step():
    # one step of 200 tokens, 0.2 s: both first tokens at 0.2, each 0.1 s after its own compute;
    # FIFO would end the first at 0.1 (wait 0) and the second at 0.2 (wait 0.1)
    assert waits([0.0, 0.0], [0, 0], [100, 100]) == pytest.approx([0.1, 0.1])
    assert list(fifo_waits(np.zeros(2), np.array([0.1, 0.1]), np.zeros(2))) == pytest.approx([0.0, 0.1])


def test_a_request_arriving_mid_step_waits_for_the_next():
    # r0 (1000 tokens, 1.0 s) runs alone from 0; r1 (100) arrives at 0.5 and joins the step from
    # 1.0: ends 1.1, wait 1.1 - 0.5 - 0.1 = 0.5; r0 no wait
    assert waits([0.0, 0.5], [0, 0], [1000, 100]) == pytest.approx([0.0, 0.5])


def test_a_long_prompt_is_chunked_and_a_short_one_shares_its_last_chunk():
    # budget 2048: step 1 = r0's first 2048 tokens (2.048 s); r1 (arrived 0.5) waits; step 2 =
    # r0's other 952 + r1's 100 (1.052 s): both end at 3.1. r0: 3.1 - 3.0 = 0.1; r1: 3.1 - 0.5 - 0.1
    assert waits([0.0, 0.5], [0, 0], [3000, 100]) == pytest.approx([0.1, 2.5])


def test_cached_tokens_are_not_computed_and_chunks_pay_their_context():
    a2 = 1e-7
    def c(x):
        return A1 * x + a2 * x * x
    # r0 computes [0, 3000), r1 computes [500, 510) of its prompt (500 cached), both at 0.
    # step 1: r0's [0, 2048) = c(2048); budget spent, r1 waits. step 2: r0's [2048, 3000) =
    # c(3000) - c(2048), then r1's [500, 510) = c(510) - c(500). Both end at c(3000) + c(510) - c(500).
    end = c(3000) + c(510) - c(500)
    assert waits([0.0, 0.0], [0, 500], [3000, 510], a2=a2) == pytest.approx(
        [end - c(3000), end - (c(510) - c(500))])


def test_idle_workers_and_separate_workers_do_not_wait():
    assert waits([0.0, 5.0], [0, 0], [1000, 1000]) == [0.0, 0.0]          # the first ended at 1.0
    assert waits([0.0, 0.0], [0, 0], [1000, 1000], worker=[0, 1]) == [0.0, 0.0]


def test_matches_a_token_by_token_loop():
    # an independent route: replay vLLM's step rule with lists, every request in one loop (no
    # busy-period split, no FIFO pre-pass)
    rng = np.random.default_rng(7)
    n = 150
    arrival = np.sort(rng.uniform(0, 30, n))
    end = rng.integers(50, 5000, n)
    start = (end * rng.uniform(0, 0.9, n)).astype(int)
    budget, a2 = 2048, 2e-8
    pos, finish, running, t, nxt, waiting = start.astype(int).tolist(), [0.0] * n, [], 0.0, 0, []
    while nxt < n or running or waiting:
        while nxt < n and arrival[nxt] <= t:
            waiting.append(nxt)
            nxt += 1
        if not running and not waiting:
            t = arrival[nxt]
            continue
        left, cost = budget, 0.0
        for r in running + waiting:                      # running first, then the queue in order
            if left == 0:
                break
            k = min(int(end[r]) - pos[r], left)
            cost += A1 * k + a2 * ((pos[r] + k) ** 2 - pos[r] ** 2)
            pos[r] += k
            left -= k
            if r in waiting:
                waiting.remove(r)
                running.append(r)
        t += cost
        for r in [r for r in running if pos[r] >= end[r]]:
            finish[r] = t
            running.remove(r)
    own = A1 * (end - start) + a2 * (end.astype(float) ** 2 - start.astype(float) ** 2)
    expected = np.asarray(finish) - arrival - own
    assert waits(arrival, start, end, budget=budget, a2=a2) == pytest.approx(list(expected), abs=1e-9)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="sorted"):
        waits([1.0, 0.0], [0, 0], [10, 10])
    with pytest.raises(ValueError, match="budget"):
        waits([0.0], [0], [10], budget=0)
    with pytest.raises(ValueError, match="length"):
        batched_step_waits(np.zeros(2), np.zeros(1), np.zeros(2), A1, 0.0, 10, np.zeros(2))


def test_the_forecast_uses_the_profiles_budget_and_the_settings_win():
    # two sessions' first prompts of 1000 tokens at once on one P (c = 1e-4 x: 0.1 s each, b0 10 ms)
    reqs = [AgentRequest("t", "a", 0, 0.0, 1000, 32, 0, server_s=1.0),
            AgentRequest("t", "b", 0, 0.0, 1000, 32, 0, server_s=1.0)]
    src = {"source": "hand-made for the test"}
    fifo = plan(reqs, profile(), PlanSettings(modes=("pd",))).modes["pd"]
    assert list(fifo.ttft_s) == pytest.approx([0.11, 0.21])
    stepped = plan(reqs, profile(max_num_batched_tokens={"value": 4096} | src), PlanSettings(modes=("pd",)))
    assert list(stepped.modes["pd"].ttft_s) == pytest.approx([0.21, 0.21])           # one step of 2,000 tokens
    assert list(stepped.modes["pd"].queue_wait_s) == pytest.approx([0.1, 0.1])
    # a budget of 1,000 tokens: a's prompt fills step 1, b's step 2: FIFO's figures again
    small = plan(reqs, profile(max_num_batched_tokens={"value": 4096} | src),
                 PlanSettings(modes=("pd", "pd-bidir"), max_num_batched_tokens=1000))
    assert list(small.modes["pd"].ttft_s) == pytest.approx([0.11, 0.21])
    # the bidirectional pass (request by request) settles the same waits
    assert list(small.modes["pd-bidir"].queue_wait_s) == pytest.approx([0.0, 0.1])
    both = plan(reqs, profile(max_num_batched_tokens={"value": 4096} | src), PlanSettings(modes=("pd-bidir",)))
    assert list(both.modes["pd-bidir"].queue_wait_s) == pytest.approx([0.1, 0.1])


def _store_with_runs(tmp_path, configs: dict):
    import datetime as dt

    from store.writer import Store
    store = Store(tmp_path)
    store.init()
    t0 = dt.datetime(2026, 12, 6, 12, 0, tzinfo=dt.UTC)
    for run_id, config in configs.items():
        with store.writer(run_id, "test") as w:
            w.append("runs_log", {"run_id": run_id, "label": "eval", "mode": "pd", "workload": "w",
                                  "history_mode": "token_ids", "model": "m", "config": config, "started_at": t0,
                                  "finished_at": t0, "updated_at": t0, "status": "complete"})
    return store


def test_the_budget_of_recorded_runs_comes_from_their_topology(tmp_path):
    from planner.queueing import engine_token_budget

    def topo(platform, args=()):
        return {"topology": {"platform": platform, "roles": {"prefill": {"args": list(args)}}}}
    store = _store_with_runs(tmp_path, {
        "cpu-default": topo("cpu"), "cpu-set": topo("cpu", ["--enforce-eager", "--max-num-batched-tokens", "512"]),
        "cpu-eq": topo("cpu", ["--max-num-batched-tokens=512"]), "gpu": topo("gpu"), "none": {}})
    assert engine_token_budget(store, ["cpu-default"])[0] == 2048            # vLLM's CPU default
    assert engine_token_budget(store, ["cpu-set"])[0] == 512
    assert engine_token_budget(store, ["cpu-set", "cpu-eq"])[0] == 512
    assert engine_token_budget(store, ["cpu-default", "cpu-set"]) is None    # the runs disagree
    assert engine_token_budget(store, ["gpu"]) is None                       # GPU default: memory-dependent
    assert engine_token_budget(store, ["none"]) is None


def test_an_overloaded_prefill_keeps_first_come_waits():
    # 40 prompts of 1,000 tokens every 0.05 s on one P of c = 0.1 s each: twice what P can compute,
    # overloaded by the overload module's rules, so its waits stay first come first served (no
    # latency is reported for it) rather than being stepped through
    reqs = [AgentRequest("t", f"s{i}", 0, 0.05 * i, 1000, 32, 0, server_s=1.0) for i in range(40)]
    src = {"source": "hand-made for the test"}
    m = plan(reqs, profile(max_num_batched_tokens={"value": 4096} | src), PlanSettings(modes=("pd",))).modes["pd"]
    assert m.overload is not None
    assert list(m.queue_wait_s) == pytest.approx([0.05 * i for i in range(40)])    # FIFO: i x (0.1 - 0.05)
