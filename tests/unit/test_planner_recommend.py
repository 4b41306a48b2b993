"""``turnscope recommend`` (planner/recommend.py): its choice on small traffics whose best
setting is known by hand, and its config diff read back by vLLM 0.32's own argument parser.

Profile and traffics: tests/unit/test_planner_ledger.py (c(x) = 1e-4 x, b0 10 ms, no queueing)."""

from __future__ import annotations

import json

import pytest

from loadgen.traces.agent_request import AgentRequest
from planner.ledger import STRATEGIES
from planner.recommend import Grid, Limits, Setting, config_diff, describe, recommend, role_argv
from planner.simulate import Traffic
from tests.unit.test_planner_ledger import KV, NO_QUEUE, SRC, alternating, profile

SMALL = Grid(ttls_s=(480.0,), thresholds=(64,), space_factors=(1.0,), routings=("session",))


def test_fast_host_tier_is_recommended():
    # alternating(): mean TTFT recompute/pd (0.11 + 0.11 + 0.14) / 3 = 0.12 s; pd+host
    # (0.11 + 0.11 + 0.052296) / 3 = 0.0908 s: 24% better, past the 5% a memory hold must win by
    r = recommend(alternating(), profile(), NO_QUEUE, Setting("pd"), Limits(), SMALL)
    assert r.recommended.setting.strategy in ("pd+host", "pd-bidir+host")
    assert r.recommended.ttft_mean_s == pytest.approx((0.11 + 0.11 + 0.052296) / 3)


def test_slow_host_tier_is_not_recommended():
    # reading back is 2e-4 s per token, twice computing it: no host strategy (pd-bidir, pulling a's
    # 896 whole-block tokens from D at 1 GB/s, is the fastest)
    r = recommend(alternating(), profile(host_bw=2.048e7), NO_QUEUE, Setting("pd"), Limits(), SMALL)
    assert r.recommended.setting.strategy not in ("pd+host", "pd-bidir+host")


def covered_traffic() -> Traffic:
    # turn 0: 10,000 tokens, 200 out (D's handle: 10,199 tokens); turn 1: 10,500 tokens sharing those.
    # P's cache holds whole blocks of min(10,000, 10,499) = 9,984; D's handle adds 215 tokens.
    # Later TTFT pd 0.01 + 1e-4 x 516 = 61.6 ms; pd-bidir 0.01 + 1e-4 x 301 + 215 x 4096 / 1e9 = 41.0 ms;
    # first turns 1.01 s: means 535.8 ms vs 525.5 ms, 1.9% better, under the 5% a hold must win by
    return Traffic.of([AgentRequest("t", "a", 0, 0.0, 10_000, 200, 0, server_s=1.0),
                       AgentRequest("t", "a", 1, 5.0, 10_500, 32, 10_199, server_s=1.0)])


def test_do_not_enable_bidir_when_ps_cache_covers_the_traffic():
    prof = profile(prefill_kv_space_bytes={"value": 1e6 * KV} | SRC).model_copy(update={"host_kv_space_bytes": None})
    r = recommend(covered_traffic(), prof, NO_QUEUE, Setting("pd-bidir"), Limits(), SMALL)
    assert r.recommended.setting.strategy == "pd" and not r.enables_bidir
    text = describe(r, prof, NO_QUEUE, Limits(), "m")
    assert "Do not enable bidirectional transfer for this traffic" in text
    assert "P's KV space an eighth of the profile's" in text
    assert '-prefill  --kv-transfer-config {"kv_connector": "NixlConnector"' in text


def test_bidir_recommended_when_ps_cache_holds_nothing():
    # P's space 500 tokens holds no prompt: only D's handle reuses (10,199 tokens pulled): later TTFT
    # 0.01 + 1e-4 x 301 + 10,199 x 4096 / 1e9 = 81.9 ms against pd's 1.06 s
    prof = profile(prefill_kv_space_bytes={"value": 500 * KV} | SRC).model_copy(update={"host_kv_space_bytes": None})
    r = recommend(covered_traffic(), prof, NO_QUEUE, Setting("pd"), Limits(), SMALL)
    assert r.recommended.setting.strategy == "pd-bidir"
    assert "strategy" in r.knob_effects


def test_slo_excludes_settings():
    # p90 of recompute's TTFTs (0.11, 0.11, 0.14) is 0.134 s: an SLO of 0.1 s leaves only the host ones
    r = recommend(alternating(), profile(), NO_QUEUE, Setting("pd"), Limits(ttft_slo_s=0.1), SMALL)
    assert not r.current.feasible


@pytest.fixture(scope="module")
def vllm_parser():
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_config_diff_parses_as_vllm_flags(vllm_parser, strategy):
    from vllm.config.kv_transfer import KVTransferConfig

    s = Setting(strategy, ttl_s=900, threshold=256, decode_kv_bytes=3 * 2**30)
    host = 8 * 2**30
    pre = vllm_parser.parse_args(role_argv(s, "prefill", "Qwen/Qwen3-32B", host))
    dec = vllm_parser.parse_args(role_argv(s, "decode", "Qwen/Qwen3-32B", host))
    assert pre.model == dec.model == "Qwen/Qwen3-32B"
    assert pre.enable_prefix_caching is (strategy != "recompute")
    assert dec.kv_cache_memory_bytes == 3 * 2**30
    nixl = dec.kv_transfer_config
    assert nixl.kv_connector == "NixlConnector"
    extra = nixl.kv_connector_extra_config
    assert extra.get("bidirectional_kv_xfer", False) is ("bidir" in strategy)
    if "bidir" in strategy:
        assert extra["decoder_kv_blocks_ttl"] == 900 and extra["kv_recompute_threshold"] == 256
    p = pre.kv_transfer_config
    if strategy.endswith("+host"):
        assert p.kv_connector == "MultiConnector"
        children = [KVTransferConfig(**c) for c in p.kv_connector_extra_config["connectors"]]
        assert [c.kv_connector for c in children] == ["NixlConnector", "OffloadingConnector"]
        assert children[1].kv_connector_extra_config["cpu_bytes_to_use"] == host
    else:
        assert p.kv_connector == "NixlConnector"


def test_vllm_parser_refuses_a_wrong_flag(vllm_parser):
    # the check above can fail: a flag vLLM does not know is refused
    with pytest.raises(SystemExit):
        vllm_parser.parse_args(["--model", "m", "--decoder-kv-blocks-ttl", "480"])


def test_config_diff_changes_only_the_knobs():
    d = config_diff(Setting("pd-bidir"), Setting("pd-bidir", ttl_s=1800), "m", None)
    changed = [line for line in d.splitlines() if line.startswith(("-", "+")) and not line.startswith(("---", "+++"))]
    assert len(changed) == 4   # the kv-transfer-config of each role, old and new
    assert all(json.loads(line.split(" ", 3)[-1])["kv_connector_extra_config"]["decoder_kv_blocks_ttl"]
               in (480, 1800) for line in changed)


def test_knobs_that_buy_nothing_stay_as_they_are():
    # D's space does not bind (one 10,199-token handle in 1e9 bytes or half of it): the grid's first
    # tie (half the space) is put back to the current (the profile's space), so the diff omits it
    prof = profile(prefill_kv_space_bytes={"value": 500 * KV} | SRC,
                   decode_kv_space_bytes={"value": 1e9} | SRC).model_copy(update={"host_kv_space_bytes": None})
    grid = Grid(ttls_s=(480.0,), thresholds=(64,), space_factors=(0.5, 1.0), routings=("session",))
    r = recommend(covered_traffic(), prof, NO_QUEUE, Setting("pd"), Limits(), grid)
    assert r.recommended.setting == Setting("pd-bidir")
    assert set(r.knob_effects) == {"strategy"}


def test_a_knob_that_gains_under_the_margin_stays_as_it_is():
    # P's cache holds 10,500 tokens. a0 (10,000 tokens, 200 out) at 0 s, then b0 (2,048, 24 out) at 1 s
    # evicts it; b1 (2,548) at 4 s finds b0's 16 blocks in P and 2,071 - 2,048 = 23 more on D, under a
    # threshold of 64; a1 (10,500) at 5 s finds nothing of a in P and pulls D's 10,199. pd-bidir wins
    # by a1's pull (0.01 + 1e-4 x 301 + 10,199 x 4096 / 1e9 = 81.9 ms against pd's 1.06 s). The
    # threshold changes b1 only: 64 recomputes 500 tokens (60.0 ms), 0 pulls the 23 and computes 477
    # (0.01 + 0.0477 + 23 x 4096 / 1e9 = 57.79 ms): 0.55 ms of a 342 ms mean, under the 5% margin, and
    # D frees b0's handle either way: the threshold stays at 64.
    tr = Traffic.of([AgentRequest("t", "a", 0, 0.0, 10_000, 200, 0, server_s=0.5),
                     AgentRequest("t", "b", 0, 1.0, 2_048, 24, 0, server_s=0.5),
                     AgentRequest("t", "b", 1, 4.0, 2_548, 32, 2_071, server_s=0.5),
                     AgentRequest("t", "a", 1, 5.0, 10_500, 32, 10_199, server_s=0.5)])
    prof = profile(prefill_kv_space_bytes={"value": 10_500 * KV} | SRC).model_copy(update={"host_kv_space_bytes": None})
    grid = Grid(ttls_s=(480.0,), thresholds=(0, 64), space_factors=(1.0,), routings=("session",))
    r = recommend(tr, prof, NO_QUEUE, Setting("pd"), Limits(), grid)
    firsts = 0.01 + 1e-4 * 10_000 + 0.01 + 1e-4 * 2_048
    a1 = 0.01 + 1e-4 * 301 + 10_199 * KV / 1e9
    by_threshold = {s.setting.threshold: s.ttft_mean_s for s in r.searched if s.setting.strategy == "pd-bidir"}
    assert by_threshold[64] == pytest.approx((firsts + 0.01 + 1e-4 * 500 + a1) / 4)
    assert by_threshold[0] == pytest.approx((firsts + 0.01 + 1e-4 * 477 + 23 * KV / 1e9 + a1) / 4)
    assert r.recommended.setting.strategy == "pd-bidir"
    assert r.recommended.setting.threshold == 64 and "threshold" not in r.knob_effects
