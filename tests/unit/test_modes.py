"""The serving modes (core.modes) against the flags docs/design.md states by hand, and
the workers each mode launches on the embedded topology (serving.workers.mode_workers)."""

from __future__ import annotations

import pytest

from core import modes
from serving.topology import embedded_topology
from serving.workers import kv_transfer_config, mode_workers

#: name -> (P/D, bidirectional_kv_xfer, P's prefix cache), from docs/design.md.
TABLE = {
    "aggregated": (False, False, True),
    "pd": (True, False, True),
    "pd-bidir": (True, True, True),
    "pd-nocache": (True, False, False),
    "pd-bidir-nocache": (True, True, False),
}


def test_every_mode_has_the_documented_flags():
    assert modes.MODES == tuple(TABLE)
    for name, (pd, bidir, cache) in TABLE.items():
        m = modes.serving_mode(name)
        assert (m.disaggregated, m.bidirectional, m.prefill_prefix_cache) == (pd, bidir, cache), name
    assert modes.BIDIRECTIONAL_MODES == ("pd-bidir", "pd-bidir-nocache")


@pytest.mark.parametrize("name", list(TABLE))
def test_mode_workers_carry_the_mode_flags(name):
    pd, bidir, cache = TABLE[name]
    specs = mode_workers(name, embedded_topology("/models/x"))
    assert sorted(s.role for s in specs) == (["decode", "prefill"] if pd else ["aggregated"])
    for s in specs:
        assert s.bidirectional is bidir
        assert s.prefix_caching is (cache or s.role != "prefill")
        if s.nixl:
            extra = kv_transfer_config(s)["kv_connector_extra_config"]
            assert extra.get("bidirectional_kv_xfer", False) is bidir


def test_pairs_and_orders():
    assert [(t, b) for t, b, _ in modes.pairs()] == [("pd-bidir", "pd"), ("pd-bidir", "aggregated"),
                                                    ("pd-bidir-nocache", "pd-nocache")]
    assert [(t, b) for t, b, _ in modes.pairs(measured_only=False, order=modes.SWEEP_ORDER)] == [
        ("pd-bidir-nocache", "pd-nocache"), ("pd-bidir", "pd"), ("pd-bidir", "aggregated"),
        ("pd-bidir", "pd-bidir-nocache")]
    assert modes.SWEEP_ORDER == ("pd-nocache", "pd-bidir-nocache", "pd", "pd-bidir", "aggregated")
    assert modes.PLAN_TABLE_ORDER == ("aggregated", "pd-nocache", "pd", "pd-bidir-nocache", "pd-bidir")
    assert modes.PLAN_ORDER == ("aggregated", "pd", "pd-nocache", "pd-bidir", "pd-bidir-nocache")


def test_unknown_mode_names_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown mode 'pd-fast'; expected one of aggregated, pd, pd-bidir"):
        modes.serving_mode("pd-fast")
    assert len({m.colour.lower() for m in modes.SERVING_MODES} | {modes.ATTACH_COLOUR}) == len(TABLE) + 1


def test_one_way_counterpart_and_recompute_mode():
    assert modes.one_way("pd-bidir") == "pd" and modes.one_way("pd-bidir-nocache") == "pd-nocache"
    assert modes.RECOMPUTE_MODE == "pd-nocache"  # P/D, one-way, P's cache off: every prompt computed
