"""Overload (planner/overload.py) against hand-computed windows."""

from __future__ import annotations

import math

import numpy as np
import pytest

from planner.overload import (
    decode_overload,
    demand_per_window,
    held_per_window,
    never_drains,
    prefill_overload,
    window_utilisation,
)


def test_demand_spreads_a_request_over_the_windows_it_runs_in():
    # windows [0, 2], [2, 4]; a request from 1 s for 2 s: 1 s in each; one from 3 s for 5 s, weight 2: 0 and 2 x 1 s
    d = demand_per_window(np.array([0.0, 2.0, 4.0]), np.array([1.0, 3.0]), np.array([2.0, 5.0]), np.array([1.0, 2.0]))
    assert d.tolist() == [[1.0, 1.0], [0.0, 2.0]]


def test_a_prefill_server_asked_for_more_than_it_has():
    # one request a second for 80 s, 2.5 s of compute each, all on one server: 2.5x its capacity in the
    # windows past the first (the first lacks the work carried in from before t = 0)
    a = np.arange(81, dtype=float)
    u = window_utilisation(a, np.full(81, 2.5), np.zeros(81))
    assert u == pytest.approx(2.5, rel=1e-9)
    o = prefill_overload(a, np.full(81, 2.5), np.zeros(81))
    assert o is not None and o.text() == "overloaded: P at 2.50x its capacity"
    # three servers in turn: each gets one request every 3 s, 2.5 s each: 0.83, keeps up
    assert prefill_overload(a, np.full(81, 2.5), np.arange(81) % 3) is None
    assert window_utilisation(a, np.full(81, 2.5), np.arange(81) % 3) == pytest.approx(2.5 / 3, rel=0.05)


def test_pinned_turns_count_against_d_space():
    # horizon 0-80 s, 8 windows of 10 s; 10 blocks of space; running: nothing; pinned: 6 blocks from 0 s,
    # 12 from 40 s (more than the space: the step function is what the ledger recorded)
    a = np.array([0.0, 80.0])
    held = held_per_window(0.0, 80.0, np.array([0.0, 40.0]), np.array([6.0, 12.0]))
    assert held.tolist() == [60.0] * 4 + [120.0] * 4
    o = decode_overload(a, np.zeros(2), np.zeros(2), 10, np.array([0.0, 40.0]), np.array([6.0, 12.0]))
    assert o is not None and o.factor == pytest.approx(1.2) and "pinned turns" in o.text()
    assert decode_overload(a, np.zeros(2), np.zeros(2), 10, np.array([0.0]), np.array([6.0])) is None
    # running requests: 4 blocks each for 10 s, one every 5 s: 8 blocks in use on average, next to 6 pinned
    a = np.arange(0, 85, 5.0)
    o = decode_overload(a, np.full(len(a), 4.0), np.full(len(a), 10.0), 10, np.array([0.0]), np.array([6.0]))
    assert o.factor == pytest.approx((8 + 6) / 10)


def test_a_wait_longer_than_a_window_is_overload():
    a = np.arange(0, 81, 10.0)           # windows of 10 s
    ttft = np.ones(len(a))
    wait = np.zeros(len(a))
    assert never_drains(a, ttft, wait, np.zeros(0)) is None
    wait[-1], ttft[-1] = 12.0, 13.0
    o = never_drains(a, ttft, wait, np.zeros(0))
    assert o is not None and math.isnan(o.factor) and "waited past a 10 s window" in o.why and o.role == "prefill"
    d = np.zeros(len(a))
    d[-1] = 30.0
    assert never_drains(a, ttft + 30, wait, d).role == "decode"
