"""core.reuse_rules: hand-computed cases, and proof that the proxy, the handle table and the
planner call these very functions (a spy replaced in the module is what each of them runs)."""

from __future__ import annotations

import pytest

from core import reuse_rules as rules
from loadgen.traces.agent_request import AgentRequest
from planner.profile import CostProfile
from planner.simulate import PlanSettings, plan
from serving import handles as h
from serving import proxy


def test_ttl_and_expiry():
    assert rules.proxy_handle_ttl_s(480, 30) == 450
    with pytest.raises(ValueError, match="decoder_kv_blocks_ttl 30 s minus the safety margin 30 s"):
        rules.proxy_handle_ttl_s(30, 30)
    assert not rules.handle_expired(449.999, 450)
    assert rules.handle_expired(450.0, 450)       # expired at exactly the TTL
    # P declines within 5 s of D's 480 s deadline
    assert not rules.p_declines_read(474.9, 480) and rules.p_declines_read(475.0, 480)


def test_blocks_and_handle_tokens():
    assert rules.whole_block_tokens(1031, 128) == 1024
    assert rules.whole_block_tokens(127, 128) == 0
    assert rules.blocks_of(1031, 128) == 9 and rules.blocks_of(1024, 128) == 8
    # D holds KV for the prompt and the output less the last sampled token
    assert rules.handle_kv_tokens(1000, 32) == 1031
    with pytest.raises(ValueError, match="block_size must be positive"):
        rules.whole_block_tokens(10, 0)


def test_usable_tokens_and_pull():
    assert rules.usable_handle_tokens(1031, 1031, 128) == 1031   # the whole handle
    assert rules.usable_handle_tokens(1031, 1000, 128) == 896    # 7 whole blocks before the difference
    assert rules.usable_handle_tokens(1031, 100, 128) == 0       # no whole block: miss_mismatch
    # pull = min(offered, prompt) - local hit, unless below the threshold
    assert rules.tokens_to_pull(1031, 1300, 0, 64) == 1031
    assert rules.tokens_to_pull(1031, 1300, 1024, 64) == 0       # 7 tokens < 64: recompute
    assert rules.tokens_to_pull(1031, 1300, 896, 64) == 135      # 135 >= 64: pull
    assert rules.tokens_to_pull(1031, 1300, 1024, 0) == 7        # threshold 0: always pull
    assert rules.tokens_to_pull(1031, 1000, 0, 64) == 1000       # capped at the prompt
    assert rules.local_prefix_tokens(1000, 1300, 128) == 896
    assert rules.local_prefix_tokens(1300, 1300, 128, prompt_tokens=1280) == 1152  # never the whole prompt


def _spy(monkeypatch, name):
    calls = []
    real = getattr(rules, name)

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(rules, name, spy)
    return calls


def test_proxy_uses_the_shared_rules(monkeypatch):
    ttl_calls = _spy(monkeypatch, "proxy_handle_ttl_s")
    app = proxy.create_app(proxy.ProxyConfig(mode="pd-bidir", decoder_kv_blocks_ttl_s=100, handle_ttl_margin_s=7,
                                             prefill=[proxy.Worker(name="p", url="http://127.0.0.1:9")],
                                             decode=[proxy.Worker(name="d", url="http://127.0.0.1:9")]))
    assert ttl_calls == [(100, 7)] and app.state.table.ttl_s == 93

    reach, below = _spy(monkeypatch, "reachable_tokens"), _spy(monkeypatch, "below_recompute_threshold")
    assert proxy.classify_prefill(1031, 1300, 1000, 0, 64) == (h.MISS_BELOW_THRESHOLD, 0)  # 31 short < 64
    assert reach == [(1031, 1300)] and below == [(31, 64)]

    usable = _spy(monkeypatch, "usable_handle_tokens")
    handle = h.Handle(params={"remote_num_tokens": 4, "remote_block_ids": [[0, 1]]}, decode_engine="d",
                      token_ids=[1, 2, 3, 4, 5], num_tokens=4, created_at=0.0, expires_at=10.0)
    fit = h.fit_handle(handle, [1, 2, 3, 9], block_size=2)
    assert usable == [(4, 3, 2)] and fit.usable_tokens == 2 and fit.params["remote_block_ids"] == [[0]]

    expired = _spy(monkeypatch, "handle_expired")
    clock = [0.0]
    table = h.HandleTable(ttl_s=5.0, clock=lambda: clock[0])
    table.take("s")
    table.put("s", {"remote_num_tokens": 4, "remote_block_ids": [[0]]}, "d", [1, 2, 3, 4])
    clock[0] = 4.0
    assert table.take("s")[1] is None and expired == [(4.0, 5.0)]


def test_planner_uses_the_shared_rules(monkeypatch):
    calls = _spy(monkeypatch, "tokens_to_pull")
    expired = _spy(monkeypatch, "handle_expired")
    reqs = [AgentRequest("t", "s", 0, 0.0, 1000, 32, 0, server_s=1.0),
            AgentRequest("t", "s", 1, 5.0, 1300, 32, 1031, server_s=1.0)]
    profile = CostProfile.model_validate({
        "name": "t", "block_size": 128, "kv_bytes_per_token": {"value": 4096, "source": "test"},
        "prefill_a1_s_per_token": {"value": 1e-4, "source": "test"}, "b0_default_s": {"value": 0.01, "source": "test"},
        "pull_bandwidth_bytes_per_s": {"value": 1e9, "source": "test"}})
    plan(reqs, profile, PlanSettings(modes=("pd-bidir-nocache",)))
    # the second request: handle of 1031 tokens, 4 s old (finished at 1 s), pulled against 1300
    assert calls == [(1031, 1300, 0, 64)] and expired == [(4.0, 450.0)]
