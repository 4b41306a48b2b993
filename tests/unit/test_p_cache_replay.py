"""analysis.p_cache_replay against a replay worked out by hand: blocks of 4 tokens, 6 of
them, two sessions whose prompts extend their last one."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from analysis.p_cache_replay import fifo_starts, replay_hits


def test_a_replay_by_hand():
    # t=0 a/0: 9 tokens, blocks a0 a1 (the 9th token is in no whole block); freed at t=1 in reverse:
    #   free queue a1, a0 (a1 evicted first). t=2 b/0: 13 tokens, b0 b1 b2; freed t=3: a1 a0 b2 b1 b0.
    # t=4 a/1: 13 tokens, a0 a1 a2, at most (13-1)//4 = 3 blocks: a0 a1 found, a2 new (the last
    #   never-used block): hit 8; freed t=5: b2 b1 b0 a2 a1 a0.
    # t=6 b/1: 17 tokens, b0-b3: b0 b1 b2 found (12), b3 new: no never-used block left, the free
    #   queue's head a2 is evicted; freed t=7: a1 a0 b3 b2 b1 b0.
    # t=8 a/2: 21 tokens: a0 a1 found, a2 evicted: hit 8 (a session-level LRU of 24 tokens would
    #   have evicted session a whole: 13 + 17 > 24, so 0).
    turns = pd.DataFrame({"session_id": ["a", "b", "a", "b", "a"], "turn_index": [0, 0, 1, 1, 2],
                          "sent_s": [0.0, 2.0, 4.0, 6.0, 8.0], "prompt_tokens": [9, 13, 13, 17, 21],
                          "ttft_s": [1.0] * 5})
    assert list(replay_hits(turns, capacity_blocks=6, block_size=4)) == [0, 0, 8, 12, 8]


def test_the_shared_system_prompt_is_one_block_for_every_session_and_running_blocks_are_not_evicted():
    # 2 blocks of 4 tokens; a and b share their first 4 tokens (one block). a/0 (8 tokens: s0, a1)
    # runs until t=10; b/0 at t=1 finds the shared block (4 tokens, in use by a: shared, not
    # evicted), and b1 takes the last free block; c/0 at t=2 finds s0 too, and no block is free for
    # c1 (all in use): vLLM would make it wait, the replay takes what it found.
    turns = pd.DataFrame({"session_id": ["a", "b", "c"], "turn_index": [0, 0, 0], "sent_s": [0.0, 1.0, 2.0],
                          "prompt_tokens": [9, 9, 9], "ttft_s": [10.0, 10.0, 10.0]})
    assert list(replay_hits(turns, capacity_blocks=3, block_size=4, shared_prefix_tokens=4)) == [0, 4, 4]


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="capacity_blocks and block_size must be >= 1"):
        replay_hits(pd.DataFrame(columns=["session_id", "sent_s", "prompt_tokens", "ttft_s"]), 0, 4)


def test_fifo_starts():
    # sent 0, 0.5, 1, 5; ended 2, 3, 4, 6 (in that order): the second starts when the first ends (2),
    # the third at 3, the fourth at its send (5: the worker was idle from 4)
    assert list(fifo_starts(np.array([0.0, 0.5, 1.0, 5.0]), np.array([2.0, 3.0, 4.0, 6.0]))) == [0.0, 2.0, 3.0, 5.0]
