"""The calibration's schedule (turnscope/conductor/calibration_schedule.py): lengths up to the model's limit, the
points of a block, and the order: each block a seeded permutation of its points, every point sent to
every mode with the modes strictly alternated and the first mode rotating from block to block. The
expected orders are written out by hand from numpy's permutation of the same seed."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from serving.topology import embedded_topology
from turnscope.conductor.calibration import QUICK, CalibrationSettings, mode_topology
from turnscope.conductor.calibration_schedule import CalPoint, default_lengths, points, schedule


def test_lengths_double_up_to_the_models_limit():
    # 8192 - 2 x 16 (replies) - 128 (extra) - 64 (template) = 7968, down to a whole 128: 7936
    assert default_lengths(8192, 16) == [128, 256, 512, 1024, 2048, 4096, 7936]
    # 2048 - 64 - 128 - 64 = 1792: 128 ... 1024, then 1792
    assert default_lengths(2048, 32) == [128, 256, 512, 1024, 1792]


def test_points_leave_out_sessions_past_the_limit():
    pts = points([128, 7936], [128, 1024], [512], repeat=2, max_model_len=8192, max_tokens=16)
    # 7936 + 1024 + 32 + 64 = 9056 > 8192: left out; 7936 + 128 + 32 + 64 = 8160 fits
    assert pts == [CalPoint(128, 128, "token_ids", 2), CalPoint(128, 1024, "token_ids", 2),
                   CalPoint(7936, 128, "token_ids", 2), CalPoint(512, 128, "text", 2)]
    assert pts[3].session_id == "cal-p512-e128-r2"


def test_schedule_shuffles_each_block_and_alternates_the_modes():
    blocks_pts = [[CalPoint(p, 128, "token_ids", r) for p in (128, 256, 512)] for r in range(2)]
    rng = np.random.default_rng(7)   # the schedule's one generator, drawn block after block
    first, second = rng.permutation(3), rng.permutation(3)
    got = schedule(["A", "B"], blocks_pts, seed=7)
    # block 0: modes A then B for each point, in the permutation's order
    assert [(x.mode, x.point.prefix_tokens) for x in got[0]] == [
        (m, (128, 256, 512)[i]) for i in first for m in ("A", "B")]
    # block 1 starts with B
    assert [(x.mode, x.point.prefix_tokens) for x in got[1]] == [
        (m, (128, 256, 512)[i]) for i in second for m in ("B", "A")]
    assert [x.block for b in got for x in b] == [0] * 6 + [1] * 6


def test_no_two_consecutive_sends_go_to_one_mode_and_every_send_is_there_once():
    s = CalibrationSettings(topology=embedded_topology("/nonexistent"))
    blocks = s.sends()
    assert len(blocks) == 3
    for b, block in enumerate(blocks):
        modes = [x.mode for x in block]
        assert all(a != c for a, c in itertools.pairwise(modes))
        assert modes[0] == s.modes[b % 3]
        # 7 lengths x 2 extras - (7936, 1024) + 2 text lengths = 15 points, each to 3 modes once
        sent = [(x.mode, x.point) for x in block]
        assert len(set(sent)) == len(sent) and set(sent) == {(m, p) for p in s.block_points()[b] for m in s.modes}
        assert len(block) == 45
    # each block its own order, the same for the same seed, another for another seed
    order = [[x.point.session_id.rsplit("-", 1)[0] for x in b[::3]] for b in blocks]
    assert order[0] != order[1] != order[2]
    assert [[x for x in b] for b in s.sends()] == blocks
    other = CalibrationSettings(topology=embedded_topology("/nonexistent"), seed=1).sends()
    assert [[x.point for x in b] for b in other] != [[x.point for x in b] for b in blocks]


def test_quick_is_small():
    blocks = CalibrationSettings(topology=embedded_topology("/nonexistent"), **QUICK).sends()
    # (128, 1024) x extra 128 + text 512 = 3 points x 3 modes, 2 blocks
    assert [len(b) for b in blocks] == [9, 9]


def test_schedule_refuses_a_mode_twice():
    with pytest.raises(ValueError, match="distinct"):
        schedule(["A", "A"], [[CalPoint(128, 128, "token_ids", 0)]], seed=0)


def test_each_modes_stack_gets_its_own_ports():
    topo = embedded_topology("/m")   # P 8100 (side channel 5600), D 8101 (5601), aggregated 8102, proxy 8200
    t2 = mode_topology(topo, 2)
    assert (t2.prefill[0].port, t2.prefill[0].side_channel_port, t2.decode[0].port, t2.decode[0].side_channel_port,
            t2.aggregated[0].port, t2.proxy.port) == (8120, 5620, 8121, 5621, 8122, 8220)
    assert mode_topology(topo, 0) is topo and topo.proxy.port == 8200
