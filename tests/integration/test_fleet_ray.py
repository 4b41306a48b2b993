"""Fleet sizing on a Ray cluster (planner/executor.py's RayExecutor, a local cluster
started by the test): the same fleets as in this process, and the hand answer of
tests/unit/test_planner_fleet.py (three P keep up, two are overloaded)."""

from __future__ import annotations

import pytest

from planner.executor import LocalExecutor, RayExecutor
from planner.fleet import Fleet, FleetJob, FleetLimits, size_fleets
from planner.simulate import PlanSettings
from tests.unit.test_planner_fleet import prof, steady

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield RayExecutor()
    ray.shutdown()


def test_fleets_sized_on_ray_are_the_local_ones(cluster):
    job = FleetJob(steady(), prof(), PlanSettings(), FleetLimits(3.0))
    on_ray = size_fleets(job, ("recompute", "pd"), cluster)
    here = size_fleets(job, ("recompute", "pd"), LocalExecutor(1))
    assert [s.best.fleet for s in on_ray] == [Fleet(3, 1), Fleet(3, 1)]
    assert [[e.fleet for e in s.searched] for s in on_ray] == [[e.fleet for e in s.searched] for s in here]
    assert [s.best.ttft_p90_s for s in on_ray] == [s.best.ttft_p90_s for s in here]
    assert ray.cluster_resources()["CPU"] == 2   # the tasks ran on the cluster the test started
