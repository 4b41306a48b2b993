"""Sessions that wait for their replies (planner/simulate.py :func:`paced_mode_plan`):
a follow-up the client sent its recorded gap after the previous reply is sent that gap after the
forecast reply. Every figure by hand.

Profile: block 128, 4096 KV bytes/token, c(x) = 1e-4 x, b0 10 ms, pull 1 GB/s, no token budget (one
prompt at a time per worker, first come first served), no host contention."""

from __future__ import annotations

import pytest

from loadgen.traces.agent_request import AgentRequest
from planner.profile import CostProfile
from planner.simulate import PlanSettings, plan

SRC = {"source": "hand-made for the test"}
PROFILE = CostProfile.model_validate({
    "name": "test", "block_size": 128, "kv_bytes_per_token": {"value": 4096} | SRC,
    "prefill_a1_s_per_token": {"value": 1e-4} | SRC, "b0_default_s": {"value": 0.01} | SRC,
    "pull_bandwidth_bytes_per_s": {"value": 1e9} | SRC})
NOCACHE = PlanSettings(modes=("pd-nocache",))


def first_turn() -> AgentRequest:
    # recorded: TTFT 50 ms, reply over at 1.0 s (0.95 s of decode after the first token)
    return AgentRequest("t", "a", 0, 0.0, 1000, 32, 0, server_s=1.0, ttft_s=0.05)


def second_turn(gap_s: float | None = 0.5, estimated: bool = False) -> AgentRequest:
    # sent 0.5 s after the recorded reply's end
    return AgentRequest("t", "a", 1, 1.5, 1300, 32, 1031, server_s=1.0, ttft_s=0.05, gap_s=gap_s,
                        gap_estimated=estimated)


def test_a_late_first_reply_moves_the_second_send_by_as_much():
    m = plan([first_turn(), second_turn()], PROFILE, NOCACHE).modes["pd-nocache"]
    # forecast TTFT of the first turn: 10 ms + 1e-4 x 1000 = 110 ms, 60 ms later than recorded;
    # its reply ends at 0.11 + 0.95 = 1.06 s and the next turn goes 0.5 s after: 1.56 s = 1.5 + 0.06
    assert m.ttft_s[0] == pytest.approx(0.11)
    assert list(m.arrival_s) == pytest.approx([0.0, 1.56])


def test_open_loop_and_estimated_gaps_keep_their_recorded_sends():
    for second in (second_turn(None), second_turn(0.5, estimated=True)):
        m = plan([first_turn(), second], PROFILE, NOCACHE).modes["pd-nocache"]
        assert list(m.arrival_s) == pytest.approx([0.0, 1.5])
    off = plan([first_turn(), second_turn()], PROFILE, NOCACHE.model_copy(update={"pace_by_replies": False}))
    assert list(off.modes["pd-nocache"].arrival_s) == pytest.approx([0.0, 1.5])


def test_a_late_turn_queues_behind_a_session_that_started_meanwhile():
    # session b starts at 1.55 s (a first request: its recorded start) with 2,000 tokens: 0.2 s on P
    b = AgentRequest("t", "b", 0, 1.55, 2000, 32, 0, server_s=1.0, ttft_s=0.21)
    reqs = [first_turn(), second_turn(), b]
    at_recorded = plan(reqs, PROFILE, NOCACHE.model_copy(update={"pace_by_replies": False})).modes["pd-nocache"]
    # at the recorded sends a's turn (1.5 s, 0.13 s of compute to 1.63) goes first: b waits 0.08 s
    assert list(at_recorded.queue_wait_s) == pytest.approx([0.0, 0.0, 0.08])
    paced = plan(reqs, PROFILE, NOCACHE).modes["pd-nocache"]
    # paced, a's turn is sent at 1.56 s, after b: it waits for b's compute to 1.75 s (0.19 s) and
    # its TTFT is 10 ms + 1e-4 x 1300 + 0.19 = 0.33 s; b waits nothing
    assert list(paced.arrival_s) == pytest.approx([0.0, 1.56, 1.55])
    assert list(paced.queue_wait_s) == pytest.approx([0.0, 0.19, 0.0])
    assert paced.ttft_s[1] == pytest.approx(0.33)


def test_three_turns_chain_the_delays():
    # every reply forecast 60 ms late (1,000-token prompts): the third send moves 120 ms
    reqs = [AgentRequest("t", "a", k, 1.5 * k, 1000, 32, 0, server_s=1.0, ttft_s=0.05,
                         gap_s=None if k == 0 else 0.5) for k in range(3)]
    m = plan(reqs, PROFILE, NOCACHE).modes["pd-nocache"]
    assert list(m.arrival_s) == pytest.approx([0.0, 1.56, 3.12])
