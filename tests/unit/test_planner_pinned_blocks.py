"""D's pinned KV as distinct blocks (planner/pinned_blocks.py) against hand-computed cases.

Block 128 tokens, 4096 KV bytes/token (one block = 524,288 bytes). A turn of 1000 prompt + 32 output
tokens leaves a handle of 1031 tokens: 9 blocks, 8 of them full; the next turn of 1300 tokens that
shares all 1031 leaves 1331 tokens: 11 blocks, sharing min(1031, 1031, 1331) // 128 = 8 blocks."""

from __future__ import annotations

import pytest

from loadgen.traces.agent_request import AgentRequest
from planner.pinned_blocks import PinnedBlocks
from planner.pinned_kv import Handle
from planner.simulate import PlanSettings, plan
from tests.unit.test_planner_simulate import profile

BLOCK = 128 * 4096


def _h(hid: int, session: int, ordinal: int, blocks: int = 0) -> Handle:
    """A handle as the ledger hands it to the store (times and tokens do not matter here)."""
    return Handle(0.0, blocks * 128, blocks * BLOCK, hid, session, ordinal, blocks)


def test_two_handles_of_a_session_hold_the_prefix_once():
    d = PinnedBlocks(None, 128, BLOCK)
    o0 = d.add_request(1, 1031, 0)
    o1 = d.add_request(1, 1331, 1031)
    assert d.pin(1.0, _h(0, 1, o0, 9), 480) and d.pin(6.0, _h(1, 1, o1, 11), 480)
    assert d.held_blocks == 9 + (11 - 8)          # the prefix once, plus each handle's own suffix
    d.read(7.0, _h(0, 1, o0))                          # the first handle released: the shared 8 blocks stay
    assert d.held_blocks == 11
    d.read(8.0, _h(1, 1, o1))
    assert d.held_blocks == 0
    assert d.b == [0.0, 9 * BLOCK, 12 * BLOCK, 11 * BLOCK, 0.0]


def test_release_of_the_later_handle_keeps_the_earlier_whole():
    d = PinnedBlocks(None, 128, BLOCK)
    o0, o1 = d.add_request(1, 1031, 0), d.add_request(1, 1331, 1031)
    d.pin(1.0, _h(0, 1, o0, 9), 480)
    d.pin(6.0, _h(1, 1, o1, 11), 480)
    d.read(7.0, _h(1, 1, o1))
    assert d.held_blocks == 9


def test_an_edit_cuts_the_shared_prefix_along_the_chain():
    # request 1 keeps only 300 tokens of request 0 (2 blocks); request 2 keeps all of request 1:
    # request 0 and 2 share min(2, 10) = 2 blocks
    d = PinnedBlocks(None, 128, BLOCK)
    o0 = d.add_request(1, 1031, 0)
    d.add_request(1, 1331, 300)
    o2 = d.add_request(1, 1500, 1331)
    d.pin(1.0, _h(0, 1, o0, 9), 480)
    d.pin(9.0, _h(2, 1, o2, 12), 480)
    assert d.held_blocks == 9 + (12 - 2)


def test_sessions_share_the_system_prompt_only():
    # a 512-token system prompt (4 blocks) opens both sessions: 9 + 9 - 4 distinct blocks
    d = PinnedBlocks(None, 128, BLOCK, system_blocks=4)
    a, b = d.add_request(1, 1031, 0), d.add_request(2, 1031, 0)
    d.pin(1.0, _h(0, 1, a, 9), 480)
    d.pin(2.0, _h(1, 2, b, 9), 480)
    assert d.held_blocks == 14
    d.read(3.0, _h(0, 1, a))                           # b still holds the system prompt's blocks
    assert d.held_blocks == 9
    d.release_due(2.0 + 480)
    assert d.held_blocks == 0


def test_capacity_counts_distinct_blocks():
    d = PinnedBlocks(12, 128, BLOCK)
    o0, o1 = d.add_request(1, 1031, 0), d.add_request(1, 1331, 1031)
    assert d.pin(1.0, _h(0, 1, o0, 9), 480)
    assert d.pin(6.0, _h(1, 1, o1, 11), 480)           # adds 3 blocks: 12 of 12
    o2 = d.add_request(2, 1031, 0)
    assert not d.pin(7.0, _h(2, 2, o2, 9), 480)        # another session's 9 do not fit
    assert d.held_blocks == 12


def test_plan_keeps_an_expired_handle_next_to_its_successor():
    # pd-bidir-nocache, proxy TTL 480 - 30 = 450 s: turn 1 comes 455 s after turn 0 ended, so the proxy
    # offers no handle (miss_expired) but D keeps turn 0's (1031 tokens, 9 blocks) to 1 + 480 = 481 s;
    # turn 1's own (1331 tokens, 11 blocks), pinned at 457 s, shares 8 blocks with it. D holds 12
    # blocks: both fit as distinct blocks (9 + 3), where counting each handle's own (9 + 11 = 20)
    # would lose turn 1's handle and make turn 2 (at 482 s, 25 s after turn 1 ended, turn 0's handle
    # gone at 481 s) miss_d_full instead of a hit.
    space = {"decode_kv_space_bytes": {"value": 12 * BLOCK, "source": "test"}}
    reqs = [AgentRequest("t", "a", 0, 0.0, 1000, 32, 0, server_s=1.0),
            AgentRequest("t", "a", 1, 456.0, 1300, 32, 1031, server_s=1.0),
            AgentRequest("t", "a", 2, 482.0, 1400, 32, 1331, server_s=1.0)]
    m = plan(reqs, profile(**space), PlanSettings(modes=("pd-bidir-nocache",))).modes["pd-bidir-nocache"]
    assert list(m.outcome_names()) == ["miss_first_turn", "miss_expired", "hit"]
    assert m.d_full_events == 0
    assert m.peak_held_bytes() == 12 * BLOCK


def test_plan_frees_a_below_threshold_handle_before_its_successor_pins():
    # pd-bidir: P holds the 1024-token prompt, so turn 1 pulls 7 tokens < 64 (miss_below_threshold):
    # P reads nothing and tells D to free turn 0's handle (1031 tokens, 9 blocks) at turn 1's arrival,
    # 5 s (vLLM nixl/pull_scheduler.py update_state_after_alloc, pull_worker.py _read_blocks). Turn 1's
    # own (1331 tokens, 11 blocks) is pinned at 6 s alone; turn 2 (P holds 1280 of 1331: 51 < 64) frees
    # it at 10 s, and its own (1431 tokens, 12 blocks) fits in D's 12 blocks at 11 s, to 11 + 480 s.
    # Before this rule turn 0's handle stayed pinned to 481 s: 9 + 3, then 9 + 3 + 1 = 13 > 12 blocks
    # lost turn 2's handle (one miss_d_full). Handles pinned at the recorded ends (D's admission queue
    # off: with it a handle is pinned at the forecast end of its decode on D).
    space = {"decode_kv_space_bytes": {"value": 12 * BLOCK, "source": "test"}}
    reqs = [AgentRequest("t", "a", 0, 0.0, 1024, 8, 0, server_s=1.0),
            AgentRequest("t", "a", 1, 5.0, 1300, 32, 1031, server_s=1.0),
            AgentRequest("t", "a", 2, 10.0, 1400, 32, 1331, server_s=1.0)]
    p = plan(reqs, profile(**space), PlanSettings(modes=("pd-bidir",), queue_decode=False))
    m = p.modes["pd-bidir"]
    assert list(m.outcome_names()) == ["miss_first_turn", "miss_below_threshold", "miss_below_threshold"]
    assert m.d_full_events == 0
    assert m.peak_held_bytes() == 12 * BLOCK
    # blocks x seconds: 9 x (5 - 1) + 11 x (10 - 6) + 12 x 480
    assert m.held_gib_s() == pytest.approx((9 * 4 + 11 * 4 + 12 * 480) * BLOCK / 2**30)


def test_plan_shares_the_system_prompt_across_sessions_on_d():
    # two sessions open with a 512-token system prompt; D holds 14 blocks: 9 + 9 - 4 fit
    space = {"decode_kv_space_bytes": {"value": 14 * BLOCK, "source": "test"}}
    reqs = [AgentRequest("t", "a", 0, 0.0, 1000, 32, 0, server_s=1.0),
            AgentRequest("t", "b", 0, 0.5, 1000, 32, 0, server_s=1.0),
            AgentRequest("t", "a", 1, 5.0, 1300, 32, 1031, server_s=1.0),
            AgentRequest("t", "b", 1, 5.5, 1300, 32, 1031, server_s=1.0)]
    shared = PlanSettings(modes=("pd-bidir-nocache",), shared_prefix_tokens=512)
    m = plan(reqs, profile(**space), shared).modes["pd-bidir-nocache"]
    assert list(m.outcome_names()) == ["miss_first_turn", "miss_first_turn", "hit", "hit"]
    assert m.peak_held_bytes() == 14 * BLOCK
    # no system prompt: 18 blocks do not fit in 14. Without D's admission queue b's handle is lost
    alone = PlanSettings(modes=("pd-bidir-nocache",), queue_decode=False)
    assert list(plan(reqs, profile(**space), alone).modes["pd-bidir-nocache"].outcome_names())[3] == "miss_d_full"
    # with it, b's first request (on D at 0.5 + 0.11) waits for room until a's next request reads
    # a's handle at 5.0 (4.39 s), so it ends at 5.0 + 0.89 and b's next request, at 5.5, overlaps it
    queued = plan(reqs, profile(**space), alone.model_copy(update={"queue_decode": True})).modes["pd-bidir-nocache"]
    assert queued.decode_wait_s[1] == pytest.approx(4.39)
    assert list(queued.outcome_names()) == ["miss_first_turn", "miss_first_turn", "hit", "miss_consumed"]


@pytest.mark.parametrize("capacity", [None, 100])
def test_timeline_ends_empty(capacity):
    d = PinnedBlocks(capacity, 128, BLOCK)
    o = d.add_request(1, 1031, 0)
    d.pin(0.0, _h(0, 1, o, 9), 10.0)
    d.release_due(float("inf"))
    assert d.t == [0.0, 0.0, 10.0] and d.b[-1] == 0.0
