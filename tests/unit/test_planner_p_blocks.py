"""P's prefix cache by blocks in the planner (planner/simulate.py ``p_cache_blocks``),
against the block replay worked out by hand in tests/unit/test_p_cache_replay.py (the yardstick,
analysis/p_cache_replay.py): blocks of 4 tokens, P's KV space 7 blocks (6 usable: vLLM
keeps one as its null block), two sessions whose prompts extend their last one."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from analysis.p_cache_replay import replay_hits
from loadgen.traces.agent_request import AgentRequest
from planner.profile import CostProfile
from planner.simulate import PlanSettings, plan

SRC = {"source": "hand-made for the test"}
PROFILE = CostProfile.model_validate({
    "name": "test", "block_size": 4, "kv_bytes_per_token": {"value": 4096} | SRC,
    "prefill_a1_s_per_token": {"value": 1e-4} | SRC, "b0_default_s": {"value": 0.01} | SRC,
    "pull_bandwidth_bytes_per_s": {"value": 1e9} | SRC,
    "prefill_kv_space_bytes": {"value": 7 * 4 * 4096} | SRC})
# (session, turn, sent, prompt tokens, tokens shared with the session's previous prompt)
LADDER = [("a", 0, 0.0, 9, 0), ("b", 0, 2.0, 13, 0), ("a", 1, 4.0, 13, 9), ("b", 1, 6.0, 17, 13),
          ("a", 2, 8.0, 21, 13)]
REQS = [AgentRequest("t", s, k, at, n, 0, shared) for s, k, at, n, shared in LADDER]


def test_p_hits_by_blocks_are_the_replays_by_hand():
    m = plan(REQS, PROFILE, PlanSettings(modes=("pd",), p_cache_blocks=True)).modes["pd"]
    # by hand (tests/unit/test_p_cache_replay.py): a/1 finds a0 a1 (8), b/1 b0-b2 (12); b/1's new
    # block evicts a2 (the head of the free queue: a freed prompt's last block goes first), so
    # a/2 finds a0 a1 only (8)
    assert list(m.local_tokens) == [0, 0, 8, 12, 8]
    # the yardstick on the planner's own timings: the same hits, the same hit rate
    turns = pd.DataFrame({"session_id": [s for s, *_ in LADDER], "sent_s": m.arrival_s + m.queue_wait_s,
                          "prompt_tokens": [n for *_, n, _ in LADDER], "hold_s": m.ttft_s - m.queue_wait_s})
    replayed = replay_hits(turns, 6, 4, hold_until="hold_s")
    assert m.local_tokens.sum() / m.prompt_tokens.sum() == pytest.approx(replayed.sum() / 73) == pytest.approx(28 / 73)


def test_the_session_lru_loses_the_whole_session():
    # P's 28 tokens by sessions: after b/1 the LRU holds a (13) and b (17) > 28: a is evicted whole,
    # and a/2 finds nothing where vLLM keeps a's first blocks
    m = plan(REQS, PROFILE, PlanSettings(modes=("pd",))).modes["pd"]
    assert list(m.local_tokens) == [0, 0, 8, 12, 0]


def test_an_edited_history_is_new_blocks():
    # a/1 shares only its first 4 tokens with a/0 (an edit at token 4): block a1 is new content
    reqs = [AgentRequest("t", "a", 0, 0.0, 9, 0, 0), AgentRequest("t", "a", 1, 2.0, 13, 0, 4)]
    m = plan(reqs, PROFILE, PlanSettings(modes=("pd",), p_cache_blocks=True)).modes["pd"]
    assert list(m.local_tokens) == [0, 4]
    assert np.all(m.queue_wait_s == 0)


def test_a_request_is_looked_up_when_p_schedules_it():
    # P computes 1 s per token: a/0 (9 tokens) holds P 0-9 s, c/0 (sent at 1 s) 9-18 s. a/1 (13 tokens,
    # its first 9 a/0's), sent at 2 s, is scheduled at 18 s. P has 2 usable blocks: c/0's two blocks
    # (taken at 9 s) evicted a/0's freed ones, so a/1 finds nothing. Looked up at its send (2 s)
    # it would have found a/0's two blocks, still held by the running a/0: 8 tokens.
    # (b0 0 s: a request's blocks are freed the moment P's compute ends, when the next is scheduled)
    slow = PROFILE.model_copy(update={"prefill_a1_s_per_token": PROFILE.prefill_a1_s_per_token.model_copy(
        update={"value": 1.0}), "prefill_kv_space_bytes": PROFILE.prefill_kv_space_bytes.model_copy(
        update={"value": 3 * 4 * 4096}), "b0_default_s": PROFILE.b0_default_s.model_copy(update={"value": 0.0})})
    reqs = [AgentRequest("t", "a", 0, 0.0, 9, 0, 0), AgentRequest("t", "c", 0, 1.0, 9, 0, 0),
            AgentRequest("t", "a", 1, 2.0, 13, 0, 9)]
    m = plan(reqs, slow, PlanSettings(modes=("pd",), p_cache_blocks=True)).modes["pd"]
    assert list(m.queue_wait_s) == pytest.approx([0.0, 8.0, 16.0])
    assert list(m.local_tokens) == [0, 0, 0]
    at_send = replay_hits(pd.DataFrame({"session_id": ["a", "c", "a"], "sent_s": [0.0, 1.0, 2.0],
                                        "prompt_tokens": [9, 9, 13], "hold_s": [9.0, 17.0, 28.0]}), 2, 4,
                          hold_until="hold_s")
    assert list(at_send) == [0, 0, 8]


def test_p_keeps_a_prefill_s_blocks_while_it_waits_on_d_for_room():
    """NixlConnector's ``request_finished`` on P delays freeing a finished prefill's blocks until D
    has read them, and D reads them once it admits the request. P: 4 usable blocks of 4 tokens; D:
    30 blocks, decode 0.1 s per token. a/0 (8 tokens, 100 output: 27 blocks on D) decodes 0-10 s;
    b/0 (8 tokens at 1 s, 5 blocks on D) waits on D for room until a/0 ends (9 s), P keeping its two
    blocks. c/0 (16 tokens at 2 s) wants 4 blocks and finds a/0's two free (freed when D read them),
    none of b/0's. So b/1 (12 tokens at 20 s, its first 8 b/0's) finds b/0's two blocks: 8 tokens.
    Were b/0's blocks freed before its wait on D (the rule before), c/0 would evict them: 0."""
    prof = PROFILE.model_copy(update={
        "prefill_kv_space_bytes": PROFILE.prefill_kv_space_bytes.model_copy(update={"value": 5 * 4 * 4096}),
        "decode_kv_space_bytes": PROFILE.prefill_kv_space_bytes.model_copy(update={"value": 30 * 4 * 4096}),
        "decode_s_per_token": PROFILE.prefill_a1_s_per_token.model_copy(update={"value": 0.1})})
    reqs = [AgentRequest("t", "a", 0, 0.0, 8, 100, 0), AgentRequest("t", "b", 0, 1.0, 8, 10, 0),
            AgentRequest("t", "c", 0, 2.0, 16, 10, 0), AgentRequest("t", "b", 1, 20.0, 12, 1, 8)]
    m = plan(reqs, prof, PlanSettings(modes=("pd",), p_cache_blocks=True)).modes["pd"]
    assert m.decode_wait_s[1] == pytest.approx(9.0, abs=0.02)
    assert list(m.local_tokens) == [0, 0, 0, 8]
