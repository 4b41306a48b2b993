"""A recorded run's workers as the planner plans them (planner/fit.py, ``topology_settings``):
the rows are the ones ``serving.stack.ModeStack.topology_row`` records for the shipped topology files
(no worker is started), the truths are read off those files by hand. P's routing comes from the
``run_config`` view (tests/integration/test_planner_check.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from planner.fit import topology_settings
from planner.simulate import PlanSettings
from serving.stack import ModeStack
from serving.topology import load_topology

TOPOLOGIES = Path(__file__).resolve().parents[2] / "data" / "topologies"


def row(name: str, mode: str, tmp_path: Path, **proxy) -> dict:
    topo = load_topology(TOPOLOGIES / f"{name}.yaml")
    if proxy:
        topo = topo.model_copy(update={"proxy": topo.proxy.model_copy(update=proxy)})
    return ModeStack(mode, topo, tmp_path, kv_bytes_per_token=4096).topology_row()


def test_2p1d_shares_core_0(tmp_path):
    # embedded-cpu-2p1d.yaml: prefill on cores [0] and [0], decode on [1]: one compute for both P
    got = topology_settings(row("embedded-cpu-2p1d", "pd-bidir", tmp_path, prefill_routing="round-robin"))
    assert got == {"prefill_workers": 2, "decode_workers": 1, "prefill_servers": (0, 0)}
    assert PlanSettings(**got).prefill_servers == (0, 0)


def test_1p1d_and_aggregated(tmp_path):
    # embedded-cpu.yaml: one P, one D; the aggregated stack its one worker
    assert topology_settings(row("embedded-cpu", "pd", tmp_path)) == {"prefill_workers": 1, "decode_workers": 1}
    assert topology_settings(row("embedded-cpu", "aggregated", tmp_path)) == {"aggregated_workers": 1}


@pytest.mark.parametrize("topology", [None, {}, {"proxy": "http://x"}])
def test_nothing_recorded_leaves_the_defaults(topology):
    assert topology_settings(topology) == {}


def test_p_on_their_own_cores():
    topo = {"workers": [
        {"role": "prefill", "cores": [0]}, {"role": "prefill", "cores": [1]}, {"role": "prefill", "cores": [0]},
        {"role": "decode", "cores": [1]}]}
    assert topology_settings(topo) == {"prefill_workers": 3, "decode_workers": 1, "prefill_servers": (0, 1, 0)}
