"""D's admission queue (planner/decode_admission.py) and its place in the TTFT forecast,
against hand-computed cases and an independent loop over time steps.

Profile (tests/unit/test_planner_simulate.py): c(x) = 1e-4 x, b0 10 ms, 128-token blocks of
4096 bytes per token (512 KiB), pull 1 GB/s; here D holds 6 blocks (3 MiB) and decodes at
10 ms per token."""

from __future__ import annotations

import numpy as np
import pytest

from loadgen.traces.agent_request import AgentRequest
from planner.decode_admission import DecodeAdmission, one_way_admission
from planner.simulate import PlanSettings, plan
from tests.unit.test_planner_simulate import profile

BLOCK_BYTES = 128 * 4096


class ScriptedHolds:
    """What D holds besides its running requests, as a fixed script of (time, blocks held after)."""

    def __init__(self, changes):
        self.changes = sorted(changes)
        self.now = 0.0
        self.admits = []

    def held_blocks(self):
        return next((b for t, b in reversed(self.changes) if t <= self.now), 0.0)

    def next_change_s(self):
        return next((t for t, _ in self.changes if t > self.now), float("inf"))

    def settle(self, t):
        self.now = max(self.now, t)

    def admitted(self, key, admit_s, hold_s):   # None: the request's blocks run for its own hold
        self.admits.append((key, admit_s))


class HandOverAfterOneSecond(ScriptedHolds):
    """Scripted holds that take over each admitted request's blocks 1 s after its admission."""

    def admitted(self, key, admit_s, hold_s):
        super().admitted(key, admit_s, hold_s)
        return admit_s + 1.0


def waits(arrivals, needs, holds, cap, script=None):
    if script is None:
        q = one_way_admission(np.array(arrivals), np.array(needs), np.array(holds), cap)
        return [q.wait_s[j] for j in range(len(arrivals))]
    q = DecodeAdmission(cap, script)
    for j, (a, k, h) in enumerate(zip(arrivals, needs, holds, strict=True)):
        q.arrive(j, a, k, h)
    q.close()
    return [q.wait_s[j] for j in range(len(arrivals))]


def test_waits_by_hand():
    # 10 blocks: the first runs 0-5; the second (6 blocks) waits until 5 (4 s) and runs 5-10; the
    # third waits behind it (first come first served) and then for its end: 10 - 2 = 8 s
    assert waits([0.0, 1.0, 2.0], [6, 6, 6], [5.0, 5.0, 5.0], 10) == pytest.approx([0.0, 4.0, 8.0])
    # a small request behind a blocked one waits too (vLLM's scheduler stops at the first that
    # does not fit), though it would fit at once
    assert waits([0.0, 1.0, 1.5], [6, 6, 1], [5.0, 5.0, 5.0], 10) == pytest.approx([0.0, 4.0, 3.5])


def test_peak_in_use_counts_running_and_held_blocks():
    # never two 6-block requests at once on 10 blocks: 6 at most; then the 6- and 1-block requests
    # admitted together at 5: 7
    assert one_way_admission(np.zeros(3) + [0.0, 1.0, 2.0], np.full(3, 6), np.full(3, 5.0), 10).peak_in_use_blocks == 6
    assert one_way_admission(np.array([0.0, 1.0, 1.5]), np.array([6, 6, 1]), np.full(3, 5.0), 10).peak_in_use_blocks == 7
    # 8 blocks held from 0 to 3, then a 4-block request alone: the held 8 are the peak
    q = DecodeAdmission(10, ScriptedHolds([(0.0, 8.0), (3.0, 0.0)]))
    q.arrive(0, 1.0, 4, 1.0)
    q.close()
    assert q.peak_in_use_blocks == 8
    # 5 held for good, a 4-block request admitted beside them: 9
    q = DecodeAdmission(10, ScriptedHolds([(0.0, 5.0)]))
    q.arrive(0, 1.0, 4, 1.0)
    q.close()
    assert q.peak_in_use_blocks == 9


def test_held_blocks_take_room_until_they_are_freed():
    # 8 blocks held from 0 to 3: a 4-block request at 1 waits until 3
    assert waits([1.0], [4], [1.0], 10, ScriptedHolds([(0.0, 8.0), (3.0, 0.0)])) == pytest.approx([2.0])
    # held for good (never freed): admitted when nothing is left to change rather than never
    assert waits([1.0], [4], [1.0], 10, ScriptedHolds([(0.0, 9.0)])) == [0.0]


def test_the_holds_say_when_running_blocks_are_handed_over():
    # the holds end each admitted request's running blocks 1 s after its admission (then they are
    # the holds' to count): the second request (6 of 10) waits for that, 1 s, not for its 5 s hold
    script = HandOverAfterOneSecond([])
    assert waits([0.0, 0.0], [6, 6], [5.0, 5.0], 10, script) == pytest.approx([0.0, 1.0])
    assert script.admits == [(0, 0.0), (1, 1.0)]


def test_a_request_larger_than_d_is_admitted_when_d_is_empty():
    assert waits([0.0, 1.0], [4, 20], [3.0, 1.0], 10) == pytest.approx([0.0, 2.0])


def test_waits_match_a_time_step_loop():
    # the same rule, checked by stepping time in 1 ms ticks (no event logic shared)
    rng = np.random.default_rng(5)
    n = 60
    arrival = np.round(np.sort(rng.uniform(0, 6, n)), 3)
    need = rng.integers(1, 5, n)
    hold = np.round(rng.uniform(0.05, 0.6, n), 3)
    changes = list(zip(np.round(np.sort(rng.uniform(0, 6, 12)), 3), rng.integers(0, 6, 12).astype(float),
                       strict=True))
    cap = 10

    def held(t):
        return next((b for c, b in reversed(changes) if c <= t + 1e-9), 0.0)

    expected, ends, head = [], [], 0
    for a, k, h in zip(arrival, need, hold, strict=True):
        tick = max(round(a * 1000), head)
        while held(tick / 1000) + sum(b for e, b in ends if e > tick / 1000 + 1e-9) + k > cap:
            tick += 1
        expected.append(tick / 1000 - a)
        ends.append((tick / 1000 + h, k))
        head = tick
    q = DecodeAdmission(cap, ScriptedHolds(changes))
    for j in range(n):
        q.arrive(j, arrival[j], need[j], hold[j])
    q.close()
    assert [q.wait_s[j] for j in range(n)] == pytest.approx(expected, abs=1.5e-3)


def test_bad_input():
    with pytest.raises(ValueError, match="length"):
        one_way_admission(np.zeros(2), np.ones(3), np.ones(2), 10)


def small_d(**extra):
    return profile(decode_kv_space_bytes={"value": 6 * BLOCK_BYTES, "source": "test"},
                   decode_s_per_token={"value": 0.01, "source": "test"}, **extra)


def req(session: str, k: int, at: float, n: int, shared: int) -> AgentRequest:
    return AgentRequest("t", session, k, at, n, 32, shared)   # no server time: the profile's decode


SETTINGS = PlanSettings(modes=("pd-bidir-nocache",), decoder_kv_blocks_ttl_s=20.0, handle_ttl_margin_s=5.0)


def test_a_full_d_makes_the_next_request_wait_for_a_ttl():
    # a and b each pin 3 blocks (331 tokens of KV) when they end at 0.36 and 2.36 (TTFT 0.04 s,
    # 32 tokens x 10 ms); c reaches D at 3.04 and finds all 6 taken until a's TTL passes at
    # 0.36 + 20: it waits 17.32 s
    m = plan([req("a", 0, 0.0, 300, 0), req("b", 0, 2.0, 300, 0), req("c", 0, 3.0, 300, 0)],
             small_d(), SETTINGS).modes["pd-bidir-nocache"]
    assert list(m.decode_wait_s) == pytest.approx([0.0, 0.0, 17.32])
    assert m.ttft_s[2] == pytest.approx(0.04 + 17.32)
    assert m.d_full_events == 0   # c's handle is pinned when it ends, after a's TTL
    off = plan([req("a", 0, 0.0, 300, 0), req("b", 0, 2.0, 300, 0), req("c", 0, 3.0, 300, 0)],
               small_d(), SETTINGS.model_copy(update={"queue_decode": False})).modes["pd-bidir-nocache"]
    assert off.ttft_s[2] == pytest.approx(0.04)


def test_a_read_frees_room_and_the_reader_queues_behind():
    # a's next turn at 10 pulls a's handle (D frees its 3 blocks): c, waiting since 3.04, is
    # admitted at 10.0 (6.96 s) and runs to 10.32. a's turn reaches D at 10 + 0.012255776 (b0 +
    # 9 tokens computed + 331 pulled), needs 3 blocks (371 tokens) and finds b's 3 pinned and c's
    # 3 running, then pinned: it waits for b's TTL at 2.36 + 20 = 22.36
    m = plan([req("a", 0, 0.0, 300, 0), req("b", 0, 2.0, 300, 0), req("c", 0, 3.0, 300, 0),
              req("a", 1, 10.0, 340, 331)], small_d(), SETTINGS).modes["pd-bidir-nocache"]
    assert list(m.outcome_names()) == ["miss_first_turn"] * 3 + ["hit"]
    assert list(m.decode_wait_s) == pytest.approx([0.0, 0.0, 6.96, 22.36 - 10.012255776])


def test_one_way_pd_waits_only_for_running_requests():
    # pd-nocache pins nothing: three 3-block requests 0.1 s apart, each running 0.32 s on a
    # 6-block D: the third waits for the first to end (0.36 - 0.24 = 0.12 s)
    r = [req("a", 0, 0.0, 300, 0), req("b", 0, 0.1, 300, 0), req("c", 0, 0.2, 300, 0)]
    m = plan(r, small_d(), PlanSettings(modes=("pd-nocache",), queue_prefills=False)).modes["pd-nocache"]
    assert list(m.decode_wait_s) == pytest.approx([0.0, 0.0, 0.12])
    # nothing pinned, but a and b run together: D's 6 blocks all in use at its peak
    assert m.peak_held_bytes() == 0 and m.d_peak_in_use_bytes == 6 * BLOCK_BYTES


def test_a_handle_is_pinned_when_its_request_ends_on_d_not_at_its_recorded_end():
    # one P, 0.3 s per 3,000-token prompt: prompts at 0, 0.01 and 0.02 s wait 0, 0.29 and 0.58 s on
    # P and reach D at 0.31, 0.61 and 0.91 s (b0 10 ms); each decodes 32 tokens x 10 ms there, so its
    # handle is pinned at 0.63, 0.93 and 1.23 s, not at the 0.5 s end the trace records (a recorded
    # end is another system's); D's pinned KV is a timeline (its times never go back)
    r = [AgentRequest("t", s, 0, at, 3000, 32, 0, server_s=0.5) for s, at in (("a", 0.0), ("b", 0.01), ("c", 0.02))]
    prof = profile(decode_kv_space_bytes={"value": 1000 * BLOCK_BYTES, "source": "test"},
                   decode_s_per_token={"value": 0.01, "source": "test"})
    m = plan(r, prof, PlanSettings(modes=("pd-bidir-nocache",))).modes["pd-bidir-nocache"]
    assert list(m.queue_wait_s) == pytest.approx([0.0, 0.29, 0.58])
    assert list(m.held_t_s[1:4]) == pytest.approx([0.63, 0.93, 1.23])
    assert (np.diff(m.held_t_s) >= 0).all()
    assert m.peak_held_bytes() == 3 * 24 * BLOCK_BYTES   # 3,031 tokens of KV each: 24 blocks
    # in use at 0.91 s: a pinned, b still decoding (to 0.93), c admitted: 3 x 24 blocks as well
    assert m.d_peak_in_use_bytes == 3 * 24 * BLOCK_BYTES


def test_two_decode_workers_hold_twice_one():
    # the case above that waits for a's TTL on one D (6 blocks): two D workers are 12 blocks, room
    # for all three handles, and nothing waits (before, D's space was divided by the workers: 3 blocks)
    r = [req("a", 0, 0.0, 300, 0), req("b", 0, 2.0, 300, 0), req("c", 0, 3.0, 300, 0)]
    two = plan(r, small_d(), SETTINGS.model_copy(update={"decode_workers": 2})).modes["pd-bidir-nocache"]
    assert list(two.decode_wait_s) == [0.0, 0.0, 0.0]
    assert two.peak_held_bytes() == 9 * BLOCK_BYTES


def test_a_closed_loop_record_keeps_its_order_on_d():
    # a's first turn reaches D at 0.04 s (TTFT 0.04) and decodes 32 x 10 ms: its forecast end is
    # 0.36 s. The record has a's next turn at 0.30 s. With the gap recorded (the client sent it
    # after the reply: closed loop), the first turn ended by 0.30 s and its handle is there (hit);
    # without (an open-loop trace) the forecast end stands and the next turn finds none
    def second_turn(gap_s):
        return AgentRequest("t", "a", 1, 0.30, 340, 32, 331, gap_s=gap_s)

    at_recorded = SETTINGS.model_copy(update={"pace_by_replies": False})
    closed = plan([req("a", 0, 0.0, 300, 0), second_turn(0.02)], small_d(), at_recorded).modes["pd-bidir-nocache"]
    assert list(closed.outcome_names()) == ["miss_first_turn", "hit"]
    assert closed.held_t_s[1] == pytest.approx(0.30)   # pinned at the next arrival, not 0.36
    # paced by the forecast reply (the default): the next turn is sent its 0.02 s gap after the
    # forecast end, 0.36 + 0.02 = 0.38 s, and finds the handle pinned at 0.36 s
    paced = plan([req("a", 0, 0.0, 300, 0), second_turn(0.02)], small_d(), SETTINGS).modes["pd-bidir-nocache"]
    assert list(paced.outcome_names()) == ["miss_first_turn", "hit"]
    assert list(paced.arrival_s) == pytest.approx([0.0, 0.38])
    assert paced.held_t_s[1] == pytest.approx(0.36)
    open_loop = plan([req("a", 0, 0.0, 300, 0), second_turn(None)], small_d(), SETTINGS).modes["pd-bidir-nocache"]
    assert list(open_loop.outcome_names()) == ["miss_first_turn", "miss_consumed"]


def test_the_closed_loop_bound_never_ends_a_request_before_its_admission():
    # as in the full-D case above: c waits on D from 3.04 to a's TTL at 20.36 s; its next turn is
    # recorded at 3.5 s (closed loop), before c could start on D: c ends at its admission (20.36),
    # not at 3.5, and the next turn finds no handle
    r = [req("a", 0, 0.0, 300, 0), req("b", 0, 2.0, 300, 0), req("c", 0, 3.0, 300, 0),
         AgentRequest("t", "c", 1, 3.5, 340, 32, 331, gap_s=0.1)]
    m = plan(r, small_d(), SETTINGS.model_copy(update={"pace_by_replies": False})).modes["pd-bidir-nocache"]
    assert m.decode_wait_s[2] == pytest.approx(17.32)
    assert list(m.outcome_names()) == ["miss_first_turn"] * 3 + ["miss_consumed"]
    # a client that waits for c's reply (the default): c's first token at 3.0 + 0.04 + 17.32, its
    # reply ends 0.32 s later (32 x 10 ms) at 20.68 s, the next turn is sent 0.1 s after: 20.78 s,
    # and finds c's handle pinned (a hit) where the recorded send found none
    paced = plan(r, small_d(), SETTINGS).modes["pd-bidir-nocache"]
    assert paced.arrival_s[3] == pytest.approx(20.78)
    assert list(paced.outcome_names()) == ["miss_first_turn"] * 3 + ["hit"]


def test_latest_end_is_the_sessions_next_recorded_arrival():
    from planner.simulate import Traffic
    tr = Traffic.of([AgentRequest("t", "a", 0, 0.0, 10, 1, 0), AgentRequest("t", "b", 0, 0.5, 10, 1, 0),
                     AgentRequest("t", "a", 1, 2.0, 10, 1, 0, gap_s=1.0), AgentRequest("t", "b", 1, 3.0, 10, 1, 0),
                     AgentRequest("t", "a", 2, 4.0, 10, 1, 0, gap_s=0.5)])
    # rows by arrival: a0 b0 a1 b1 a2; b1 has no gap (open loop): b0 unbounded; last turns unbounded
    assert list(tr.latest_end_s()) == [2.0, np.inf, 4.0, np.inf, np.inf]
