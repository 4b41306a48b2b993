"""The planner's simulation against hand-computed cases: expiry at the margin, single use, the
recompute threshold, D full, P's cache eviction, D's pinned KV over time and the TTFT formula.

Profile: block 128, 4096 KV bytes/token, c(x) = 1e-4 x, b0 10 ms, pull 1 GB/s, no latency. A turn
of 1000 prompt + 32 output tokens leaves a handle of 1031 tokens (9 blocks = 4,718,592 bytes)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from loadgen.traces.agent_request import AgentRequest
from planner.profile import CostProfile
from planner.simulate import PlanSettings, plan

HANDLE_BYTES = 9 * 128 * 4096  # 4,718,592


def profile(**extra) -> CostProfile:
    src = {"source": "hand-made for the test"}
    return CostProfile.model_validate({
        "name": "test", "block_size": 128, "kv_bytes_per_token": {"value": 4096} | src,
        "prefill_a1_s_per_token": {"value": 1e-4} | src, "b0_default_s": {"value": 0.01} | src,
        "pull_bandwidth_bytes_per_s": {"value": 1e9} | src} | extra)


def req(session: str, k: int, at: float, n: int, shared: int, out: int = 32, server: float = 1.0) -> AgentRequest:
    return AgentRequest("test", session, k, at, n, out, shared, server_s=server)


def outcomes(p, mode: str) -> list:
    return list(p.modes[mode].outcome_names())


def test_hit_and_ttft_by_hand():
    p = plan([req("a", 0, 0.0, 1000, 0), req("a", 1, 5.0, 1300, 1031)], profile())
    m = p.modes["pd-bidir-nocache"]
    assert outcomes(p, "pd-bidir-nocache") == ["miss_first_turn", "hit"]
    assert list(m.pulled_tokens) == [0, 1031] and list(m.recomputed_tokens) == [1000, 269]
    # 0.01 + 1e-4 x (1300 - 1031) + 1031 x 4096 / 1e9
    assert m.ttft_s[1] == pytest.approx(0.01 + 0.0269 + 0.004222976)
    assert p.modes["pd-nocache"].ttft_s[1] == pytest.approx(0.01 + 0.13)
    assert outcomes(p, "pd-nocache") == ["miss_first_turn", "miss_no_handle_returned"]
    assert outcomes(p, "aggregated") == [None, None]
    # aggregated keeps prompt + output: whole blocks of min(1032, 1031, 1299) = 1024
    assert p.modes["aggregated"].local_tokens[1] == 1024
    # D pinned the handle from 1 s (first turn finished) to 5 s (read): 4 s x 4.5 MiB; then the
    # second turn's (1300 + 32 - 1 = 1331 tokens, 11 blocks) from 6 s until D's TTL, 480 s later
    assert m.peak_held_bytes() == 11 * 128 * 4096
    assert m.held_gib_s() == pytest.approx((HANDLE_BYTES * 4 + 11 * 128 * 4096 * 480) / 2**30)


@pytest.mark.parametrize(("gap", "expected"), [(449.999, "hit"), (450.0, "miss_expired")])
def test_expiry_at_the_margin(gap, expected):
    # first turn finishes at 1 s; proxy TTL = 480 - 30 = 450 s
    p = plan([req("a", 0, 0.0, 1000, 0), req("a", 1, 1.0 + gap, 1300, 1031)], profile())
    assert outcomes(p, "pd-bidir-nocache")[1] == expected
    assert p.modes["pd-bidir-nocache"].handle_age_s[1] == pytest.approx(gap)


def test_p_declines_within_five_seconds_of_d_deadline():
    # margin 2 s: proxy TTL 478 s, but P declines from 475 s (vLLM's 5 s safety margin)
    s = PlanSettings(handle_ttl_margin_s=2)
    p = plan([req("a", 0, 0.0, 1000, 0), req("a", 1, 1.0 + 476, 1300, 1031)], profile(), s)
    assert outcomes(p, "pd-bidir-nocache")[1] == "miss_transfer_failed"


def test_single_use():
    # turn 1 arrives at 5 s (hit) and runs to 6 s; turn 2 arrives at 5.5 s: the handle is gone
    p = plan([req("a", 0, 0.0, 1000, 0), req("a", 1, 5.0, 1300, 1031), req("a", 2, 5.5, 1400, 1031)], profile())
    assert outcomes(p, "pd-bidir-nocache") == ["miss_first_turn", "hit", "miss_consumed"]


def test_threshold_with_p_own_cache():
    # P holds the previous prompt: 1024 tokens -> local hit 1024; the handle has 1024 + 8 - 1 = 1031:
    # 7 tokens to pull < 64 -> recompute (miss_below_threshold) in pd-bidir; a hit without P's cache
    reqs = [req("a", 0, 0.0, 1024, 0, out=8), req("a", 1, 5.0, 1300, 1031)]
    p = plan(reqs, profile())
    assert outcomes(p, "pd-bidir") == ["miss_first_turn", "miss_below_threshold"]
    assert p.modes["pd-bidir"].local_tokens[1] == 1024 and p.modes["pd-bidir"].pulled_tokens[1] == 0
    assert outcomes(p, "pd-bidir-nocache")[1] == "hit"
    # with a 1000-token previous prompt: local 896, pull 1031 - 896 = 135 >= 64
    p = plan([req("a", 0, 0.0, 1000, 0), req("a", 1, 5.0, 1300, 1031)], profile())
    assert p.modes["pd-bidir"].local_tokens[1] == 896 and p.modes["pd-bidir"].pulled_tokens[1] == 135
    # a threshold of 200 makes that 135 a recompute
    p = plan([req("a", 0, 0.0, 1000, 0), req("a", 1, 5.0, 1300, 1031)], profile(),
             PlanSettings(kv_recompute_threshold=200))
    assert outcomes(p, "pd-bidir")[1] == "miss_below_threshold"


def test_below_threshold_frees_the_taken_handle_a_mismatch_keeps_it():
    # pd-bidir, P holds the 1024-token prompt: 7 tokens to pull < 64. vLLM's P pulls nothing but
    # still notifies D (nixl/pull_scheduler.py update_state_after_alloc, pull_worker.py _read_blocks),
    # which frees turn 0's handle (1031 tokens, 9 blocks) at turn 1's arrival: held 1 -> 5 s. Turn 1's
    # (1331 tokens, 11 blocks) is pinned from 6 s to D's TTL, 480 s later.
    blk = 128 * 4096
    reqs = [req("a", 0, 0.0, 1024, 0, out=8), req("a", 1, 5.0, 1300, 1031)]
    m = plan(reqs, profile(), PlanSettings(modes=("pd-bidir",))).modes["pd-bidir"]
    assert list(m.outcome_names()) == ["miss_first_turn", "miss_below_threshold"]
    assert m.peak_held_bytes() == 11 * blk
    assert m.held_gib_s() == pytest.approx((9 * 4 + 11 * 480) * blk / 2**30)
    # a mismatch (100 shared tokens: not one whole block) forwards no handle: D keeps turn 0's 9 blocks
    # to 1 + 480 s next to turn 1's 11 (nothing shared), 6 -> 486 s
    reqs = [req("a", 0, 0.0, 1024, 0, out=8), req("a", 1, 5.0, 1300, 100)]
    m = plan(reqs, profile(), PlanSettings(modes=("pd-bidir",))).modes["pd-bidir"]
    assert list(m.outcome_names()) == ["miss_first_turn", "miss_mismatch"]
    assert m.peak_held_bytes() == 20 * blk
    assert m.held_gib_s() == pytest.approx((9 * 480 + 11 * 480) * blk / 2**30)


def test_edit_below_one_block_is_a_mismatch():
    p = plan([req("a", 0, 0.0, 1000, 0), req("a", 1, 5.0, 1300, 100)], profile())
    assert outcomes(p, "pd-bidir-nocache")[1] == "miss_mismatch"
    p = plan([req("a", 0, 0.0, 1000, 0), req("a", 1, 5.0, 1300, 1000)], profile())
    assert p.modes["pd-bidir-nocache"].pulled_tokens[1] == 896   # trimmed to 7 whole blocks


def test_d_full_loses_the_second_handle():
    # D holds 5e6 bytes: one handle of 4,718,592 fits, a second does not (without D's admission
    # queue, which would make b wait instead: tests/unit/test_planner_decode_admission.py)
    space = {"decode_kv_space_bytes": {"value": 5e6, "source": "test"}}
    reqs = [req("a", 0, 0.0, 1000, 0), req("b", 0, 0.5, 1000, 0),
            req("a", 1, 5.0, 1300, 1031), req("b", 1, 5.5, 1300, 1031)]
    p = plan(reqs, profile(**space), PlanSettings(queue_decode=False))
    m = p.modes["pd-bidir-nocache"]
    assert outcomes(p, "pd-bidir-nocache") == ["miss_first_turn", "miss_first_turn", "hit", "miss_d_full"]
    assert m.peak_held_bytes() == HANDLE_BYTES and m.d_full_events >= 1
    assert "unbounded" in " ".join(plan(reqs, profile()).notes)


def test_p_cache_eviction():
    # P's KV space holds 1500 tokens: session b's 1000-token prompt evicts a's
    space = {"prefill_kv_space_bytes": {"value": 1500 * 4096, "source": "test"}}
    reqs = [req("a", 0, 0.0, 1000, 0), req("b", 0, 0.5, 1000, 0), req("a", 1, 5.0, 1300, 1031)]
    assert plan(reqs, profile()).modes["pd"].local_tokens[2] == 896
    assert plan(reqs, profile(**space)).modes["pd"].local_tokens[2] == 0


def test_round_robin_routing_splits_p_caches():
    reqs = [req("a", 0, 0.0, 1000, 0), req("a", 1, 5.0, 1300, 1031)]
    two = PlanSettings(prefill_workers=2, routing="round-robin")
    assert plan(reqs, profile(), two).modes["pd"].local_tokens[1] == 0       # the other P
    sticky = PlanSettings(prefill_workers=2, routing="session")
    assert plan(reqs, profile(), sticky).modes["pd"].local_tokens[1] == 896


def test_finish_without_server_time_uses_forecast():
    # no server time, no decode figure: the turn ends at its pd-nocache TTFT, 0.01 + 0.1 = 0.11 s
    reqs = [AgentRequest("t", "a", 0, 0.0, 1000, 32, 0), AgentRequest("t", "a", 1, 450.10, 1300, 32, 1031)]
    p = plan(reqs, profile())
    assert p.modes["pd-bidir-nocache"].handle_age_s[1] == pytest.approx(449.99)
    assert math.isclose(float(np.nanmax(p.modes["pd-bidir-nocache"].handle_age_s)), 449.99)


def test_same_session_id_in_two_sources_are_two_sessions():
    # two recorded runs both name their session "s0": planned together, each keeps its own handle
    a = [AgentRequest("run:a", "s0", 0, 0.0, 1000, 32, 0, server_s=1.0),
         AgentRequest("run:a", "s0", 1, 5.0, 1300, 32, 1031, server_s=1.0)]
    b = [AgentRequest("run:b", "s0", 0, 0.0, 1000, 32, 0, server_s=1.0),
         AgentRequest("run:b", "s0", 1, 5.0, 1300, 32, 1031, server_s=1.0)]
    p = plan(a + b, profile())
    assert sorted(outcomes(p, "pd-bidir-nocache")) == ["hit", "hit", "miss_first_turn", "miss_first_turn"]


def test_system_prompt_shared_across_sessions():
    # 1,300 shared tokens (10 whole blocks = 1,280): session b's first request finds them in P's
    # cache (P served session a before); session a's first request does not (nothing before it)
    reqs = [req("a", 0, 0.0, 1400, 0), req("b", 0, 10.0, 1500, 0), req("b", 1, 20.0, 1800, 1531)]
    p = plan(reqs, profile(), PlanSettings(shared_prefix_tokens=1300))
    assert list(p.modes["pd"].local_tokens) == [0, 1280, 1408]          # 1,500 prompt -> 11 blocks
    assert list(p.modes["aggregated"].local_tokens) == [0, 1280, 1408]  # min(1532, 1531, 1799) -> 11 blocks
    assert list(p.modes["pd-nocache"].local_tokens) == [0, 0, 0]        # P's prefix cache off
    # pd TTFT of b's first request: 0.01 + 1e-4 x (1500 - 1280)
    assert p.modes["pd"].ttft_s[1] == pytest.approx(0.01 + 0.022)


def test_recorded_shared_prefix_is_p_s_first_turn_hit():
    """P's prefix-cache hit on the first turns of pd/pd-bidir runs, each run's first session left out."""
    import datetime as dt

    import pandas as pd

    from planner.fit import recorded_shared_prefix_tokens

    t0 = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)
    rows = []
    for run, mode, locals_ in (("r1", "pd", [0, 1280, 1280]), ("r2", "pd-bidir", [0, 1280, 1152]),
                               ("r3", "pd-nocache", [0, 0, 0])):
        for s, local in enumerate(locals_):
            rows.append({"run_id": run, "mode": mode, "session_id": f"s{s}", "turn_index": 0, "status": "ok",
                         "sent_at": t0 + dt.timedelta(seconds=10 * s), "local_tokens": local})
    # r1 and r2 without their first sessions: 1280, 1280, 1280, 1152 -> median 1280
    assert recorded_shared_prefix_tokens(pd.DataFrame(rows)) == 1280
    assert recorded_shared_prefix_tokens(pd.DataFrame(rows[6:])) == 0   # pd-nocache only: P's cache off



def test_shared_prefix_is_per_workload():
    """Two workloads in one store: each run gets its own workload's system prompt, not one for all."""
    import datetime as dt

    import pandas as pd

    from planner.fit import shared_prefix_by_run

    t0 = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)
    rows = []
    for run, mode, workload, locals_ in (("a1", "pd", "support-agent", [0, 1152, 1152]),
                                         ("a2", "aggregated", "support-agent", [0, 1152, 1152]),
                                         ("b1", "pd-bidir", "coding-agent", [0, 256, 256]),
                                         ("c1", "pd", None, [0, 512, 512])):
        for s, local in enumerate(locals_):
            rows.append({"run_id": run, "mode": mode, "workload": workload, "session_id": f"s{s}", "turn_index": 0,
                         "status": "ok", "sent_at": t0 + dt.timedelta(seconds=s),
                         "local_tokens": local})
    # pooled: 1152, 1152, 256, 256, 512, 512 -> median 512 for every run; per workload each its own
    # (the aggregated run takes its workload's P/D estimate)
    assert shared_prefix_by_run(pd.DataFrame(rows)) == {"a1": 1152, "a2": 1152, "b1": 256, "c1": 512}


def test_sources_planned_alone_do_not_queue_or_share_d():
    """Two recorded runs of the same session at the same clock times: planned alone each is the
    hand-computed case above (no wait, the same pinned KV); their pinned KV is two runs' worth, the
    peak one run's. Planned together, the second run's prompts wait behind the first's."""
    def run(src: str) -> list[AgentRequest]:
        return [AgentRequest(src, "a", 0, 0.0, 1000, 32, 0, server_s=1.0),
                AgentRequest(src, "a", 1, 5.0, 1300, 32, 1031, server_s=1.0)]

    alone = plan(run("run:x") + run("run:y"), profile(), PlanSettings(separate_sources=True))
    m = alone.modes["pd-bidir-nocache"]
    assert list(m.queue_wait_s) == [0, 0, 0, 0]
    assert list(m.ttft_s) == pytest.approx([0.01 + 0.1, 0.01 + 0.1, 0.01 + 0.0269 + 0.004222976,
                                            0.01 + 0.0269 + 0.004222976])
    assert m.peak_held_bytes() == 11 * 128 * 4096
    assert m.held_gib_s() == pytest.approx(2 * (HANDLE_BYTES * 4 + 11 * 128 * 4096 * 480) / 2**30)
    stacked = plan(run("run:x") + run("run:y"), profile()).modes["pd-nocache"]
    assert stacked.queue_wait_s[1] == pytest.approx(0.1)   # waits for the other run's first prompt
