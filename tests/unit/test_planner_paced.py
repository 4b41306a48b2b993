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


# --- one pass (planner/paced_sends.py) against hand-made cases and a second route -----------------

STEPPED = CostProfile.model_validate(PROFILE.model_dump() | {
    "max_num_batched_tokens": {"value": 800} | SRC})


def test_scheduler_steps_with_a_paced_turn_by_hand():
    # steps of at most 800 tokens, 1e-4 s a token. Session a's turn 1 (1,300 tokens) is sent at 1.56 s
    # (as above), while b (2,000 tokens, sent at 1.55 s) runs: steps [1.55, 1.63) b 800, [1.63, 1.71)
    # b 800, [1.71, 1.79) b 400 + a 400 (b done at 1.79: it waited 1.79 - 1.55 - 0.2 = 0.04 s),
    # [1.79, 1.87) a 800, [1.87, 1.88) a 100: a done at 1.88, a wait of 1.88 - 1.56 - 0.13 = 0.19 s,
    # TTFT 10 ms + 0.13 + 0.19 = 0.33 s; a's turn 2 goes 0.5 s after that reply's end (0.95 s of
    # decode): 1.56 + 0.33 + 0.95 + 0.5 = 3.34 s, alone on P (TTFT 10 ms + 0.1 s)
    b = AgentRequest("t", "b", 0, 1.55, 2000, 32, 0, server_s=1.0, ttft_s=0.21)
    third = AgentRequest("t", "a", 2, 3.0, 1000, 32, 0, server_s=1.0, ttft_s=0.05, gap_s=0.5)
    m = plan([first_turn(), second_turn(), b, third], STEPPED, NOCACHE).modes["pd-nocache"]
    order = sorted(range(4), key=lambda i: (m.prompt_tokens[i], m.arrival_s[i]))   # 1000 a0, 1000 a2, 1300, 2000
    assert [m.arrival_s[i] for i in order] == pytest.approx([0.0, 3.34, 1.56, 1.55])
    assert [m.queue_wait_s[i] for i in order] == pytest.approx([0.0, 0.0, 0.19, 0.04])
    assert [m.ttft_s[i] for i in order] == pytest.approx([0.11, 0.11, 0.33, 0.25])


def _two_long_sessions(turns: int) -> list[AgentRequest]:
    # two sessions of 1,000-token turns (0.1 s on P, TTFT 0.11 s alone) that start 0.05 s apart and
    # send each turn 0.01 s after the previous reply (0.15 s of decode): they queue behind each other
    # at every turn, each wait moving every later send of both
    return [AgentRequest("t", s, k, start + 0.26 * k, 1000, 32, 0, server_s=0.2, ttft_s=0.05,
                         gap_s=None if k == 0 else 0.01)
            for s, start in (("a", 0.0), ("b", 0.05)) for k in range(turns)]


def _by_hand_fifo(turns: int) -> dict[tuple[str, int], tuple[float, float]]:
    """The second route: the two sessions played turn by turn in time order on one FIFO worker."""
    nxt = {"a": (0.0, 0), "b": (0.05, 0)}
    free, out = float("-inf"), {}
    while nxt:
        s = min(nxt, key=lambda k: (nxt[k][0], k))
        send, k = nxt.pop(s)
        start = max(send, free)
        free = start + 0.1
        ttft = 0.11 + (start - send)
        out[(s, k)] = (send, ttft)
        if k + 1 < turns:
            nxt[s] = (send + ttft + 0.15 + 0.01, k + 1)
    return out


def test_long_sessions_settle_in_one_pass_where_rounds_do_not(monkeypatch):
    from planner import paced_sends

    turns = 40
    reqs = _two_long_sessions(turns)
    want = _by_hand_fifo(turns)
    p = plan(reqs, PROFILE, NOCACHE)
    m = p.modes["pd-nocache"]
    got = {(str(s), int(k)): (a, t) for s, k, a, t in zip(p.traffic.session, p.traffic.request_index, m.arrival_s,
                                                           m.ttft_s)}
    assert got.keys() == want.keys()
    for key, (send, ttft) in want.items():
        assert got[key][0] == pytest.approx(send, abs=1e-9), key
        assert got[key][1] == pytest.approx(ttft, abs=1e-9), key
    assert not any("still moved" in n for n in p.notes)
    # the forecast re-made round by round (the route before the one pass) stops at its round limit
    # still moving, its last sends off by more than the tolerance
    monkeypatch.setattr(paced_sends, "applies", lambda *a: False)
    rounds = plan(reqs, PROFILE, NOCACHE)
    assert any("still moved" in n for n in rounds.notes)
    off = max(abs(a - want[(str(s), int(k))][0]) for s, k, a in
              zip(rounds.traffic.session, rounds.traffic.request_index, rounds.modes["pd-nocache"].arrival_s))
    assert off > 1e-3


def test_a_wait_on_d_moves_the_next_send_by_hand():
    # D holds 3 blocks of 128 tokens; a request of 200 prompt + 32 output tokens takes 2 (231 tokens of
    # KV) for its decode, 32 x 10 ms = 0.32 s: one request on D at a time. a (sent at 0) reaches D at
    # its TTFT on P, 10 ms + 1e-4 x 200 = 0.03 s, and holds D to 0.35 s; b (sent at 0.05 s) reaches
    # D at 0.08 s and waits 0.27 s for a's blocks: TTFT 0.30 s. b's next turn goes 0.1 s after b's
    # reply (0.32 s of decode): 0.05 + 0.30 + 0.32 + 0.1 = 0.77 s, when D is free again (b left at 0.67 s)
    on_d = CostProfile.model_validate(PROFILE.model_dump() | {
        "decode_kv_space_bytes": {"value": 3 * 128 * 4096} | SRC, "decode_s_per_token": {"value": 0.01} | SRC})
    reqs = [AgentRequest("t", "a", 0, 0.0, 200, 32, 0), AgentRequest("t", "b", 0, 0.05, 200, 32, 0),
            AgentRequest("t", "b", 1, 1.0, 200, 32, 0, gap_s=0.1)]
    m = plan(reqs, on_d, NOCACHE).modes["pd-nocache"]
    assert list(m.arrival_s) == pytest.approx([0.0, 0.05, 0.77])
    assert list(m.decode_wait_s) == pytest.approx([0.0, 0.27, 0.0])
    assert list(m.ttft_s) == pytest.approx([0.03, 0.30, 0.03])
