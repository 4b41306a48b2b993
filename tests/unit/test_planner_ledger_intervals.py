"""80% intervals of the ledger and the recommendation (planner/ledger.py, recommend.py,
intervals.py) against numbers computed here by hand.

Profile (as tests/unit/test_planner_ledger.py): block 128, 4096 KV bytes/token (a block is 1/2048
GiB), c(x) = 1e-4 x, b0 10 ms, pull 1 GB/s, no queueing; P's GPU space 500 tokens, so P's own cache
holds no prompt and every reuse is D's. Held-out errors: measured / forecast TTFT p10-p90 0.9-1.2
(pd-nocache), 0.8-1.25 (pd), 0.85-1.3 (pd-bidir); recorded minus forecast D hit rate -0.5..+0.25.

Traffic: sessions a and b, 1000-token prompts at 0 s, 32 output tokens, 1 s of server time each
(handles of 1031 tokens = 9 blocks from 1 s). At 5 s a's second turn (1300 tokens, the whole 1031
shared) reads its handle at age 4 s (a hit, 1031 pulled); b's (1300 tokens, nothing shared) takes
its handle and does not read it (miss_mismatch). Both second turns end at 6 s, leaving 1331-token
handles (11 blocks). D's TTL is 480 s.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from loadgen.traces.agent_request import AgentRequest
from planner.ledger import ledger
from planner.profile import CostProfile
from planner.recommend import (
    Limits,
    Setting,
    change_intervals,
    evaluate,
    figure_intervals,
    role_argv,
)
from planner.recommend_topology import topology_diff, topology_for, topology_yaml
from planner.simulate import PlanSettings, Traffic
from serving.topology import load_topology
from serving.workers import mode_workers, worker_command

KV = 4096
BLOCK_GIB = 128 * KV / 2**30          # 1/2048
SRC = {"source": "hand-made for the test"}
NO_QUEUE = PlanSettings(queue_prefills=False)
HELD = {"split": "fitted on A; checked on B", "runs": 2, "turns": 20,
        "ttft_ratio": {"pd-nocache": [0.9, 1.2], "pd": [0.8, 1.25], "pd-bidir": [0.85, 1.3]},
        "hit_rate_error": {"pd-bidir": [-0.5, 0.25]}}


def profile(held_out: dict | None = HELD, **extra) -> CostProfile:
    return CostProfile.model_validate({
        "name": "test", "block_size": 128, "kv_bytes_per_token": {"value": KV} | SRC,
        "prefill_a1_s_per_token": {"value": 1e-4} | SRC, "b0_default_s": {"value": 0.01} | SRC,
        "pull_bandwidth_bytes_per_s": {"value": 1e9} | SRC, "prefill_kv_space_bytes": {"value": 500 * KV} | SRC,
        "held_out": held_out} | extra)


def traffic() -> Traffic:
    return Traffic.of([AgentRequest("t", "a", 0, 0.0, 1000, 32, 0, server_s=1.0),
                       AgentRequest("t", "b", 0, 0.0, 1000, 32, 0, server_s=1.0),
                       AgentRequest("t", "a", 1, 5.0, 1300, 32, 1031, server_s=1.0),
                       AgentRequest("t", "b", 1, 5.0, 1300, 32, 0, server_s=1.0)])


# by hand: TTFTs of the second turns
A1 = 0.01 + 1e-4 * (1300 - 1031) + 1031 * KV / 1e9      # a's: pulls 1031 tokens
B1 = 0.01 + 1e-4 * 1300                                  # b's: computes all
P50_BIDIR = (A1 + B1) / 2
# D pinned, distinct blocks: a0 9 blocks 1-5 s (read), b0 9 blocks 1-481 s (unread), a1 and b1 11
# blocks 6-486 s each
G = (9 * 4 + 9 * 480 + 11 * 480 * 2) * BLOCK_GIB
S = 9 * BLOCK_GIB * (480 - 4)       # b (d_ttl - a) of a0 (read) and of b0 (taken, unread)


def rows(df):
    return {r["strategy"]: r for r in df.to_dict("records")}


def test_ledger_intervals_by_hand():
    r = rows(ledger(traffic(), profile(), NO_QUEUE, strategies=("recompute", "pd", "pd-bidir")))
    b, p, rc = r["pd-bidir"], r["pd"], r["recompute"]
    assert b["ttft_p50_later_s"] == pytest.approx(P50_BIDIR) and b["d_pinned_gib_s"] == pytest.approx(G)
    assert (b["ttft_p50_later_interval_low_s"], b["ttft_p50_later_interval_high_s"]) == pytest.approx(
        (P50_BIDIR * 0.85, P50_BIDIR * 1.3))
    assert (rc["ttft_p50_later_interval_low_s"], rc["ttft_p50_later_interval_high_s"]) == pytest.approx((0.14 * 0.9, 0.14 * 1.2))
    assert (p["ttft_p50_later_interval_low_s"], p["ttft_p50_later_interval_high_s"]) == pytest.approx((0.14 * 0.8, 0.14 * 1.25))
    # speed-up and TTFT saved against recompute: each side at its own extreme
    s = 0.14 / P50_BIDIR
    assert (b["speedup_interval_low"], b["speedup_interval_high"]) == pytest.approx((s * 0.9 / 1.3, s * 1.2 / 0.85))
    assert (b["ttft_saved_interval_low_s"], b["ttft_saved_interval_high_s"]) == pytest.approx(
        (0.14 * 0.9 - P50_BIDIR * 1.3, 0.14 * 1.2 - P50_BIDIR * 0.85))
    # reuse rate 1/2; e10 = -0.5 loses a's read (its only reuse): 0; e90 = +0.25 gains half a read
    # of b's unread handle: 0.75
    assert b["hit_rate"] == 0.5
    assert (b["hit_rate_interval_low"], b["hit_rate_interval_high"]) == pytest.approx((0.0, 0.75))
    # D pinned: e90 = +0.25 of 2 later requests = 0.5 more reads (b0 read at 4 s: 0.5 S less);
    # e10 = -0.5 = 1 read lost (a0 held to its TTL: S more)
    assert (b["d_pinned_interval_low_gib_s"], b["d_pinned_interval_high_gib_s"]) == pytest.approx((G - 0.5 * S, G + S))
    # no interval: pd's hit rate (D hits only are checked), recompute against itself, a one-way D
    assert math.isnan(p["hit_rate_interval_low"]) and "D's hits only" in p["interval_note"]
    assert math.isnan(rc["speedup_interval_low"]) and math.isnan(p["d_pinned_interval_low_gib_s"])
    assert "P cache and host GiB-s: no held-out interval" in b["interval_note"]


def test_no_held_out_errors_no_interval_and_why():
    r = rows(ledger(traffic(), profile(None), NO_QUEUE, strategies=("recompute", "pd", "pd-bidir")))
    for row in r.values():
        assert all(math.isnan(row[k]) for k in ("ttft_p50_later_interval_low_s", "hit_rate_interval_low",
                                                "d_pinned_interval_low_gib_s", "ttft_mean_interval_high_s"))
        assert "profile test was never checked on runs it was not fitted on" in row["interval_note"]


def test_host_strategies_have_no_interval():
    prof = profile(host_kv_space_bytes={"value": 1e9} | SRC, host_read_bandwidth_bytes_per_s={"value": 4.096e9} | SRC)
    r = rows(ledger(traffic(), prof, NO_QUEUE))
    for strategy in ("pd+host", "pd-bidir+host"):
        assert math.isnan(r[strategy]["ttft_p50_later_interval_low_s"])
        assert "no host-tier run was ever checked" in r[strategy]["interval_note"]


def test_recommendation_intervals_by_hand():
    prof, limits = profile(), Limits()
    cur = evaluate(traffic(), prof, NO_QUEUE, Setting("pd-bidir"), limits)
    pd_ = evaluate(traffic(), prof, NO_QUEUE, Setting("pd"), limits)
    # p90 over all 4 TTFTs [A1, 0.11, 0.11, B1] (linear interpolation at 2.7): 0.11 + 0.7 x 0.03
    p90 = 0.11 + 0.7 * (B1 - 0.11)
    iv = figure_intervals(prof, cur)
    assert cur.ttft_p90_s == pytest.approx(p90) and iv["ttft_p90"] == pytest.approx((p90 * 0.85, p90 * 1.3))
    mean_bidir, mean_pd = (0.11 * 2 + A1 + B1) / 4, (0.11 * 2 + 0.14 * 2) / 4
    assert iv["ttft_mean"] == pytest.approx((mean_bidir * 0.85, mean_bidir * 1.3))
    ch = change_intervals(prof, pd_, cur)    # pd against the current pd-bidir
    s = mean_bidir / mean_pd
    assert ch["speedup"] == pytest.approx((s * 0.85 / 1.25, s * 1.3 / 0.8))
    assert ch["ttft_change"] == pytest.approx((mean_pd * 0.8 - mean_bidir * 1.3, mean_pd * 1.25 - mean_bidir * 0.85))
    assert ch["d_pinned_change"] == pytest.approx((-(G + S), -(G - 0.5 * S)))


def test_recommended_topology_loads_with_the_knobs(tmp_path):
    base = load_topology(Path(__file__).resolve().parents[2] / "data/topologies/embedded-cpu.yaml")
    rec = Setting("pd-bidir", ttl_s=120.0, threshold=0, decode_kv_bytes=2**30, prefill_workers=2, routing="round-robin")
    path = tmp_path / "recommended.yaml"
    path.write_text(topology_yaml(topology_for(base, rec), rec, base))
    topo = load_topology(path)
    assert topo.connector.decoder_kv_blocks_ttl == 120 and topo.connector.kv_recompute_threshold == 0
    assert len(topo.prefill) == 2 and len(topo.decode) == 1 and topo.proxy.prefill_routing == "round-robin"
    assert topo.roles["decode"].args[-2:] == ["--kv-cache-memory-bytes", str(2**30)]
    assert {(w.host, w.port) for w in topo.prefill} == {("127.0.0.1", 8100), ("127.0.0.1", 8103)}  # 8101-8102 taken
    # second route: the workers turnscope starts from this file get the flags the diff prints
    specs = {s.name: s for s in mode_workers("pd-bidir", topo)}
    for name, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
        argv, _ = worker_command(specs[name])
        printed = role_argv(rec, role, "m", None, platform="cpu")
        got = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        want = json.loads(printed[printed.index("--kv-transfer-config") + 1])
        assert got == want
    # D's KV space: the last --kv-cache-memory-bytes of D's command line is the recommended one
    argv, _ = worker_command(specs["decode-0"])
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--kv-cache-memory-bytes"][-1] == str(2**30)
    # the diff names exactly the changed knobs
    _, diff = topology_diff(base, Setting("pd-bidir"), rec)
    changed = [ln for ln in diff.splitlines() if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
    assert "-  kv_recompute_threshold: 64" in changed and "+  kv_recompute_threshold: 0" in changed
    assert "+  decoder_kv_blocks_ttl: 120" in changed and "+proxy: {prefill_routing: round-robin}" in changed
    assert not any("backends" in ln or "aggregated" in ln for ln in changed)
    assert yaml.safe_load(path.read_text())["proxy"]["prefill_routing"] == "round-robin"


@pytest.mark.parametrize("strategy", ["pd+host", "pd-bidir+host"])
def test_recommended_topology_carries_the_host_tier_into_vllms_parser(tmp_path, strategy):
    """A host strategy's topology: the workers turnscope starts from it, parsed by vLLM 0.32's own
    parser, get P's MultiConnector (NixlConnector with the topology's backends + OffloadingConnector
    of the host tier), and D the plain NixlConnector."""
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    base = load_topology(Path(__file__).resolve().parents[2] / "data/topologies/vendor-h200-1p1d.yaml")
    setting, host = Setting(strategy, ttl_s=900.0, threshold=256), 8 * 2**30
    path = tmp_path / "recommended.yaml"
    path.write_text(topology_yaml(topology_for(base, setting, host), setting, base))
    specs = {s.role: s for s in mode_workers("pd" if strategy == "pd+host" else "pd-bidir", load_topology(path))}
    pre = parser.parse_args(worker_command(specs["prefill"])[0][3:])   # after python -m serving.vllm_worker
    dec = parser.parse_args(worker_command(specs["decode"])[0][3:])
    assert pre.kv_transfer_config.kv_connector == "MultiConnector"
    nixl, offload = (KVTransferConfig(**c) for c in pre.kv_transfer_config.kv_connector_extra_config["connectors"])
    assert nixl.kv_connector_extra_config["backends"] == ["LIBFABRIC"]
    assert offload.kv_connector == "OffloadingConnector" and offload.kv_connector_extra_config["cpu_bytes_to_use"] == host
    assert dec.kv_transfer_config.kv_connector == "NixlConnector"
    bidir = strategy.startswith("pd-bidir")
    for extra in (nixl.kv_connector_extra_config, dec.kv_transfer_config.kv_connector_extra_config):
        assert extra.get("bidirectional_kv_xfer", False) is bidir
        assert not bidir or (extra["decoder_kv_blocks_ttl"] == 900 and extra["kv_recompute_threshold"] == 256)


def test_an_unread_handle_d_frees_anyway_saves_nothing_when_read():
    """The G interval's s for e > 0 is what reading one more unread handle would save: b (d_ttl - a)
    for a handle D keeps to the TTL (a mismatch), 0 for one it frees anyway (taken below the
    recompute threshold: P told D to free it). Session a: requests of 1000 and 1100 prompt tokens,
    32 out; the second (below threshold, 10 s old handle) and third (mismatch, 20 s old) took the
    previous request's handle: 1031 -> 9 blocks and 1131 -> 9 blocks of 128 tokens."""
    from planner.ledger import handle_reads

    tr = Traffic.of([AgentRequest("t", "a", 0, 0.0, 1000, 32, 0, server_s=1.0),
                     AgentRequest("t", "a", 1, 10.0, 1100, 32, 1031, server_s=1.0),
                     AgentRequest("t", "a", 2, 30.0, 1200, 32, 0, server_s=1.0)])
    outcome = np.array(["miss_first_turn", "miss_below_threshold", "miss_mismatch"], dtype=object)
    reads = handle_reads(tr, profile(), PlanSettings(), outcome, np.array([np.nan, 10.0, 20.0]),
                         np.array([0, 1031, 0]), np.zeros(3, dtype=np.int64))
    assert (reads.later_requests, reads.hits, reads.unread) == (2, 0, 2)
    assert reads.s_unread_gib_s == pytest.approx((0 + 9 * BLOCK_GIB * (480 - 20)) / 2)
