"""Fleet plans in the store: ``planner.plan_store.write_fleet_plan`` (what it refuses, what
it writes to plan_log) and the Plan page's queries of plan_fleets and plan_load_curve
(store/queries/plan.py), on the hand-made fleet plan of tests/planner_store.py. Truths: its
hand-typed figures."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from planner.strategies import STRATEGIES
from store import db
from store.queries import plan as plan_queries
from tests import planner_store as fx

GiB = 2**30


@pytest.fixture(scope="module")
def two_plans(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fleet plan, and a second one (only pd-bidir, no curve) the queries must leave out."""
    root = fx.build_fleet_plan(tmp_path_factory.mktemp("fleets"))
    other = [r for r in fx.fleet_rows() if r["strategy"] == "pd-bidir"]
    fx.build_fleet_plan(root, plan_id="plan-20261201T100000-0be7e5", fleets=other, curve=[])
    return root


def _read(root: Path, query, *args):
    return db.read(db.StoreLocation(root), query, *args)


def test_fleets_query_reads_one_plan_in_the_ledgers_order(two_plans):
    fl = _read(two_plans, plan_queries.fleets, fx.FLEET_PLAN_ID, STRATEGIES)
    assert list(fl["strategy"]) == ["recompute", "pd", "pd+host", "pd-bidir", "pd-bidir+host"]
    assert list(fl["recommended"]) == [False, False, False, True, False]
    assert list(fl["prefill_workers"]) == [2, 3, 3, 2, 2] and list(fl["decode_workers"]) == [2, 3, 2, 2, 2]
    assert list(fl["ttft_p90_s"].fillna(-1)) == [-1, 0.93, 0.88, 0.74, 1.12]
    assert list(fl["decode_kv_bytes_per_worker"].fillna(-1)) == [-1, -1, -1, 512 * GiB, 256 * GiB]
    over = fl.iloc[0]
    assert over["overloaded"] and over["overload_role"] == "prefill" and over["overload_factor"] == 3.4
    assert not over["meets_slo"] and fl["load_value"].eq(100.0).all() and fl["slo_ttft_p90_s"].eq(1.0).all()
    assert list(fl["fleets_searched"]) == [9, 12, 12, 10, 16]
    assert list(_read(two_plans, plan_queries.fleets, "plan-20261201T100000-0be7e5", STRATEGIES)["strategy"]) == ["pd-bidir"]


def test_load_curve_query_orders_by_strategy_then_load(two_plans):
    cu = _read(two_plans, plan_queries.load_curve, fx.FLEET_PLAN_ID, STRATEGIES)
    assert len(cu) == 25
    assert list(cu["strategy"].drop_duplicates()) == ["recompute", "pd", "pd+host", "pd-bidir", "pd-bidir+host"]
    bidir = cu[cu["strategy"] == "pd-bidir"]
    assert list(bidir["load_value"]) == [25.0, 50.0, 100.0, 200.0, 400.0]
    assert list(bidir["ttft_p90_s"].fillna(-1)) == [0.41, 0.48, 0.74, -1, -1]
    assert list(bidir["overload_role"].fillna("")) == ["", "", "", "decode", "decode"]
    assert list(bidir["overload_factor"].fillna(-1)) == [-1, -1, -1, 1.05, 2.10]
    assert int(cu["overloaded"].sum()) == 4 + 2 + 1 + 2 + 1
    assert _read(two_plans, plan_queries.load_curve, "plan-20261201T100000-0be7e5", STRATEGIES).empty


def test_fleet_knees_query_reads_each_fleets_knee(two_plans):
    kn = _read(two_plans, plan_queries.fleet_knees, fx.FLEET_PLAN_ID).set_index("strategy")
    assert sorted(kn.index) == sorted(fx.CURVE_KNEES)
    for strategy, knee in fx.CURVE_KNEES.items():   # the hand-typed knees; recompute serves none of the curve
        r = kn.loc[strategy]
        assert (None if pd.isna(r["knee_load_value"]) else r["knee_load_value"]) == knee, strategy
        assert r["curve_points"] == 5
    assert (kn.loc["pd", "prefill_workers"], kn.loc["pd", "decode_workers"]) == (3, 3)
    assert _read(two_plans, plan_queries.fleet_knees, "plan-20261201T100000-0be7e5").empty


def test_the_plan_log_states_the_load(two_plans):
    (row,) = _read(two_plans, lambda con: con.execute(
        "SELECT forecast_label, notes, requests, label FROM plan_log WHERE plan_id = ?", [fx.FLEET_PLAN_ID]).df()
    ).itertuples(index=False)
    assert row.forecast_label == "FORECAST (profile vendor-h200) at 100 new sessions per hour"
    load = "Load: 100 new sessions per hour (Poisson starts, seed 0), 800 sessions drawn from 24 session trees."
    assert json.loads(row.notes) == [load, "Sessions drawn with replacement."]
    assert row.requests == 9600 and row.label == "fleet"


@pytest.mark.parametrize(("change", "message"), [
    (lambda f, c: f[0].pop("gpus"), "plan_fleets row 0: missing column(s) gpus"),
    (lambda f, c: f[1].update(gpu_count=4), "plan_fleets row 1: unknown column(s) gpu_count"),
    (lambda f, c: c[3].pop("slo_ttft_p90_s"), "plan_load_curve row 3: missing column(s) slo_ttft_p90_s"),
    (lambda f, c: f[0].update(load_kind="users"), "load_kind 'users' is none of"),
    (lambda f, c: f[0].update(overload_role="proxy"), "overload_role 'proxy' is none of prefill, decode"),
    (lambda f, c: f[0].update(ttft_p90_s=2.0), "overloaded, so its TTFTs must be None"),
    (lambda f, c: f[1].update(overload_factor=0.5), "not overloaded, so overload_role and overload_factor"),
    (lambda f, c: f[1].update(recommended=True), "more than one plan_fleets row is recommended"),
    (lambda f, c: f[2].update(load_value=200.0), "more than one load or SLO"),
    (lambda f, c: f.clear(), "at least one plan_fleets row"),
])
def test_write_fleet_plan_refuses_bad_rows(tmp_path, change, message):
    fleets, curve = fx.fleet_rows(), fx.curve_rows()
    change(fleets, curve)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        fx.build_fleet_plan(tmp_path, fleets=fleets, curve=curve)
    assert not list(tmp_path.glob("runs/plan-*"))   # nothing written
