"""The interleaved schedule's plan (turnscope/conductor/schedule.py), the slice a Locust process plays
(loadgen.session_dispenser.slice_plans), the ports of the modes kept up together
(serving.topology.shifted) and where run_eval interleaves (turnscope.conductor.evaluation.schedule_groups).
Truths: hand-written groups, ranges and port sets, and plans built here."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from core.modes import MODES
from loadgen.session import SessionPlan, TurnPlan
from loadgen.session_dispenser import slice_plans
from serving.topology import disjoint_offsets, embedded_topology, ports_of, shifted
from turnscope.conductor import schedule
from turnscope.conductor.evaluation import default_settings, schedule_groups

GIB = 2**30


def test_groups_join_the_compared_modes():
    # pd-bidir is compared with pd and with aggregated; pd-bidir-nocache with pd-nocache
    assert schedule.comparison_groups(list(MODES)) == [["aggregated", "pd", "pd-bidir"],
                                                       ["pd-nocache", "pd-bidir-nocache"]]
    assert schedule.comparison_groups(["pd-bidir-nocache", "pd", "pd-nocache"]) == [
        ["pd-bidir-nocache", "pd-nocache"], ["pd"]]
    assert schedule.comparison_groups(["a", "b", "c", "d"], pairs=[("a", "c"), ("c", "d")]) == [["a", "c", "d"], ["b"]]


@pytest.mark.parametrize("sessions, rounds, expected", [
    (3, 3, [(0, 1), (1, 2), (2, 3)]),
    (11, 3, [(0, 4), (4, 8), (8, 11)]),
    (2, 5, [(0, 1), (1, 2)]),
    (4, 1, [(0, 4)]),
])
def test_session_slices_cover_every_session_once(sessions, rounds, expected):
    assert schedule.session_slices(sessions, rounds) == expected


def test_session_slices_refuse_nothing_to_cut():
    with pytest.raises(ValueError):
        schedule.session_slices(0, 2)
    with pytest.raises(ValueError):
        schedule.session_slices(3, 0)


def test_default_rounds():
    assert schedule.default_rounds(3, 1) == 3          # the demo: one session per round
    assert schedule.default_rounds(4, 2) == 2          # eval's defaults
    assert schedule.default_rounds(100, 2) == schedule.MAX_AUTO_ROUNDS
    assert schedule.default_rounds(1, 4) == 1


def test_interleave_gives_each_mode_each_slice_once_in_a_seeded_order():
    group = ["aggregated", "pd", "pd-bidir"]
    slots = schedule.interleave(group, 6, 3, random.Random(7))
    assert len(slots) == 9
    for r in range(3):
        in_round = [s for s in slots if s.round == r]
        assert sorted(s.mode for s in in_round) == sorted(group)
        assert [s.position for s in in_round] == [0, 1, 2]
        assert {(s.first, s.stop) for s in in_round} == {(2 * r, 2 * r + 2)}
    # the order is the one random.shuffle draws from the seed, round after round
    rng = random.Random(7)
    orders = []
    for _ in range(3):
        o = list(group)
        rng.shuffle(o)
        orders.append(o)
    assert [[s.mode for s in slots if s.round == r] for r in range(3)] == orders
    assert slots == schedule.interleave(group, 6, 3, random.Random(7))
    # over many rounds every mode comes first about equally often (the drift falls on every side)
    many = schedule.interleave(group, 3000, 3000, random.Random(1))
    firsts = Counter(s.mode for s in many if s.position == 0)
    assert all(900 < n < 1100 for n in firsts.values())


def test_spec_and_sentence():
    slots = schedule.interleave(["pd", "pd-bidir"], 3, 3, random.Random(0))
    spec = schedule.spec_of("pd", slots, 0, ["pd", "pd-bidir"])
    assert spec["kind"] == "interleaved" and spec["rounds"] == 3 and spec["seed"] == 0
    assert spec["slices"] == [[0, 1], [1, 2], [2, 3]]
    assert [sorted(o) for o in spec["orders"]] == [["pd", "pd-bidir"]] * 3
    other = schedule.spec_of("pd-bidir", slots, 0, ["pd", "pd-bidir"])
    assert schedule.describe([spec, other, None]) == [
        ("Interleaved: pd, pd-bidir up together, sessions in 3 round(s) per history mode, the order shuffled "
         "each round (seed 0)."), "One mode after another (sequential schedule)."]
    assert schedule.describe_json(['{"kind": "sequential", "reason": "no room"}']) == [
        "One mode after another (sequential schedule): no room."]


def _plans(n, offsets=None):
    return [SessionPlan(session_id=f"s{i}", source="t", turns=[TurnPlan(new_messages=[{"role": "user", "content": "hi"}],
                                                                   reference_reply={"role": "assistant", "content": "ok"})],
                        start_at_s=None if offsets is None else offsets[i]) for i in range(n)]


def test_slice_plans_keeps_the_same_sessions_and_rebases_arrivals():
    plans = _plans(5)
    assert slice_plans(plans, "") is plans
    assert [p.session_id for p in slice_plans(plans, "1:3")] == ["s1", "s2"]
    timed = slice_plans(_plans(4, [0.0, 5.0, 7.5, 9.0]), "1:3")
    assert [(p.session_id, p.start_at_s) for p in timed] == [("s1", 0.0), ("s2", 2.5)]
    for bad in ("3", "a:b", "2:2", "0:6", "-1:2"):
        with pytest.raises(ValueError):
            slice_plans(plans, bad)


def test_shifted_topologies_use_disjoint_ports():
    topo = embedded_topology("/m")
    offsets = disjoint_offsets(topo, 3)
    sets = [ports_of(shifted(topo, o)) for o in offsets]
    assert offsets[0] == 0 and sets[0] == {8100, 8101, 8102, 5600, 5601, 8200}
    assert sets[1] == {8103, 8104, 8105, 5603, 5604, 8203}
    assert not (sets[0] & sets[1] or sets[0] & sets[2] or sets[1] & sets[2])
    moved = shifted(topo, 3)
    assert (moved.prefill[0].cores, moved.decode[0].cores, moved.aggregated[0].cores) == ([0], [1], [0])
    assert topo.proxy.port == 8200  # the original is untouched
    with pytest.raises(ValueError):
        shifted(topo, 60000)


def test_where_run_eval_interleaves(tmp_path):
    s = default_settings(Path("/m"), store=tmp_path, log_dir=tmp_path)
    plenty = 64 * GIB
    assert schedule_groups(s, None, plenty) == [(["aggregated", "pd", "pd-bidir"], None),
                                                (["pd-nocache", "pd-bidir-nocache"], None)]
    # 5 workers x (1.5 GiB + 512 MiB KV) + 2 GiB spare = 12 GiB: the first group falls back; the
    # second, 4 x 2 + 2 = 10 GiB, fits
    groups = schedule_groups(s, None, 11 * GIB)
    assert [g for g, _ in groups] == [["aggregated"], ["pd"], ["pd-bidir"], ["pd-nocache", "pd-bidir-nocache"]]
    assert "do not fit" in groups[0][1] and groups[3][1] is None
    seq = s.model_copy(update={"schedule": "sequential"})
    assert schedule_groups(seq, None, plenty) == [([m], None) for m in MODES]
    assert all(why for _, why in schedule_groups(s, {"pd": []}, plenty))  # sweep runs
    # capacity: runs given per mode, played step by step when every mode has as many
    cap = s.model_copy(update={"modes": ["pd", "pd-bidir"]})
    assert schedule_groups(cap, {"pd": [1, 2], "pd-bidir": [3, 4]}, plenty, interleave_runs=True) == [
        (["pd", "pd-bidir"], None)]
    uneven = schedule_groups(cap, {"pd": [1, 2], "pd-bidir": [3]}, plenty, interleave_runs=True)
    assert [g for g, _ in uneven] == [["pd"], ["pd-bidir"]] and all("different numbers of runs" in w for _, w in uneven)
    assert all(why for _, why in schedule_groups(s.model_copy(update={"sessions": 0}), None, plenty))


def test_step_orders_put_every_mode_once_in_each_step_and_say_so():
    orders = schedule.step_orders(["pd", "pd-bidir"], 5, random.Random(3))
    assert len(orders) == 5 and all(sorted(o) == ["pd", "pd-bidir"] for o in orders)
    assert orders == schedule.step_orders(["pd", "pd-bidir"], 5, random.Random(3))   # seeded
    assert len({tuple(o) for o in schedule.step_orders(["pd", "pd-bidir"], 20, random.Random(0))}) == 2  # both orders
    spec = schedule.steps_spec(orders, 3, ["pd", "pd-bidir"])
    assert spec["orders"] == orders and spec["rounds"] == 5 and spec["by"] == "run"
    assert schedule.describe([spec]) == [("Interleaved: pd, pd-bidir up together, their runs played step by step "
                                          "(5 steps), the order shuffled each step (seed 3).")]
