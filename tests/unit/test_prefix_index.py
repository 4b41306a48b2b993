"""The proxy's per-P prefix index (serving/prefix_index.py): chained block hashes, the chained
lookup, LRU eviction at capacity, and a turn's cost following its new blocks."""

import hashlib
import struct
from pathlib import Path

import numpy as np
import pytest

from serving.prefix_index import ROOT_HASH, BlockChains, PrefixIndex, hash_block
from serving.stack import ModeStack
from serving.topology import embedded_topology


def by_hand(parent: bytes, ids: list[int]) -> bytes:
    """BLAKE2b-128 of the parent hash then the ids as little-endian int64, written out by hand."""
    return hashlib.blake2b(parent + struct.pack(f"<{len(ids)}q", *ids), digest_size=16).digest()


def test_block_hash_is_blake2b_of_parent_and_int64_ids():
    assert hash_block(ROOT_HASH, np.array([1, 2, 3, 4])) == by_hand(ROOT_HASH, [1, 2, 3, 4])
    h0 = by_hand(ROOT_HASH, [0, 1, 2, 3])
    assert BlockChains(4).chain(None, list(range(10))) == [h0, by_hand(h0, [4, 5, 6, 7])]  # 2 full blocks


def test_a_block_hash_covers_every_block_before_it():
    chains = BlockChains(4)
    a = chains.chain(None, [0, 1, 2, 3, 9, 9, 9, 9])
    b = chains.chain(None, [0, 1, 2, 5, 9, 9, 9, 9])  # same second block, different first
    assert a[0] != b[0] and a[1] != b[1]


def test_held_tokens_count_only_leading_blocks_all_held():
    index = PrefixIndex(block_size=4, capacity_blocks=100)
    index.record([b"h0", b"h1", b"h2"])
    assert index.held_tokens([b"h0", b"h1", b"h2", b"h3"]) == 12
    assert index.held_tokens([b"h0", b"hX", b"h2"]) == 4  # h2 held, but not the block before it
    assert index.held_tokens([b"hX", b"h1"]) == 0
    assert index.held_tokens([]) == 0


def test_lru_evicts_the_least_recently_used_tail_blocks_first():
    index = PrefixIndex(block_size=4, capacity_blocks=3)
    a, b = [b"a0", b"a1"], [b"b0", b"b1"]
    index.record(a)
    index.record(b)  # 4 blocks > 3: a's tail block a1 (older than a0) goes
    assert len(index) == 3
    assert index.held_tokens(a) == 4 and index.held_tokens(b) == 8
    index.record(a)  # a used again: now b's tail b1 is the oldest
    assert index.held_tokens(a) == 8 and index.held_tokens(b) == 4


def test_a_session_turn_hashes_only_the_blocks_past_its_previous_prompt():
    chains, fresh = BlockChains(4), BlockChains(4)
    turn0 = list(range(40))  # 10 blocks
    turn1 = turn0 + list(range(100, 113))  # 13 more tokens: 3 more full blocks (13 // 4)
    chains.chain("s", turn0)
    assert chains.hash_calls == 10
    got = chains.chain("s", turn1)
    assert chains.hash_calls == 10 + 3
    assert got == fresh.chain(None, turn1)  # the same chain as hashing everything anew
    diverged = turn1[:21] + [999] + turn1[22:]  # differs in block 5 (tokens 20-23): blocks 5-12 anew
    got = chains.chain("s", diverged)
    assert chains.hash_calls == 13 + 8
    assert got == fresh.chain(None, diverged)
    chains.chain("other", turn0)  # another session has no previous prompt here: all 10 blocks
    assert chains.hash_calls == 21 + 10


def test_sessions_beyond_max_sessions_are_forgotten_oldest_first():
    chains = BlockChains(4, max_sessions=1)
    chains.chain("a", list(range(8)))
    chains.chain("b", list(range(8)))
    chains.chain("a", list(range(8)))  # "a" was forgotten: hashed again
    assert chains.hash_calls == 6


@pytest.mark.parametrize("kw", [{"block_size": 0}, {"block_size": 4, "capacity_blocks": 0}])
def test_bad_sizes_are_refused(kw):
    with pytest.raises(ValueError, match="must be positive"):
        PrefixIndex(**kw)


def test_the_stack_sizes_the_index_from_p_kv_space(tmp_path):
    """512 MiB of KV space / (128 tokens x 4,096 bytes per token) = 1,024 blocks."""
    stack = ModeStack("pd-bidir", embedded_topology(str(tmp_path / "model")), tmp_path, kv_bytes_per_token=4096)
    assert stack.proxy_config().prefill_cache_blocks == 512 * 2**20 // (128 * 4096) == 1024


def test_the_index_follows_p_roles_own_kv_space(tmp_path):
    """`turnscope capacity --prefill-kv-tokens 16384` gives P `--kv-cache-memory-bytes 67108864` in its
    role's args, after the topology's 512 MiB on vLLM's command line (the last one wins): the index
    holds 64 MiB / (128 tokens x 4,096 bytes) = 128 blocks, not the topology's 1,024."""
    from turnscope.conductor.capacity import plan_capacity
    from turnscope.conductor.evaluation import Slo

    base = embedded_topology(str(tmp_path / "model"))
    plan = plan_capacity(Path(__file__).resolve().parents[2] / "data" / "workloads" / "eviction.yaml",
                         capacity_id="c", users=[1], sessions_per_user=1, slo=Slo(ttft_s=1, tpot_s=1), topology=base,
                         kv_bytes_per_token=4096, prefill_kv_tokens=16_384)
    stack = ModeStack("pd-bidir", plan.topology(base), tmp_path, kv_bytes_per_token=4096)
    assert stack.proxy_config().prefill_cache_blocks == 16_384 * 4096 // (128 * 4096) == 128


def test_the_proxy_estimates_from_rendered_ids_given_as_an_array():
    """An in-process chat render gives the request's ids as an int64 array (serving.prompt_render):
    the proxy's local-hit estimate takes them as the same ids given as a list."""
    import numpy as np

    from serving.proxy import ProxyConfig, SessionProxy, Worker
    from serving.proxy_request import ProxiedRequest, RequestFacts

    cfg = ProxyConfig(mode="pd-bidir", prefill=[Worker(name="p0", url="http://127.0.0.1:1")],
                      decode=[Worker(name="d0", url="http://127.0.0.1:2")], block_size=4)
    proxy = SessionProxy(cfg)
    p0, d0 = cfg.prefill[0], cfg.decode[0]
    ids = list(range(10))
    seen = ProxiedRequest("/v1/completions", {}, "a", p0, d0, RequestFacts(request_id="1", mode="pd-bidir", prefill_engine="p0", decode_engine="d0"), 0.0,
                          new_ids=ids)
    proxy.estimate_local_hit(seen)
    proxy.record_prefill(seen, ids)  # P0 now holds 2 whole blocks of these ids
    for given in (ids + [10, 11], np.asarray(ids + [10, 11], dtype=np.int64)):
        req = ProxiedRequest("/v1/chat/completions", {}, "b", p0, d0, RequestFacts(request_id="2", mode="pd-bidir", prefill_engine="p0", decode_engine="d0"),
                             0.0, new_ids=given)
        proxy.estimate_local_hit(req)
        assert req.local_estimate == 8


def test_a_cache_salt_keeps_the_same_prompt_apart():
    """vLLM adds a request's cache_salt to its first block's hash only
    (vllm/v1/core/kv_cache_utils.py: generate_block_hash_extra_keys): the same ids under another
    salt share no block with the unsalted or differently salted ones, and under the same salt
    they do. turnscope's eval replays the same sessions on the same P once per history mode, each
    run with its own salt: P then finds none of the earlier run's blocks."""
    from serving.proxy import ProxyConfig, SessionProxy, Worker
    from serving.proxy_request import ProxiedRequest, RequestFacts

    cfg = ProxyConfig(mode="pd-bidir", prefill=[Worker(name="p0", url="http://127.0.0.1:1")],
                      decode=[Worker(name="d0", url="http://127.0.0.1:2")], block_size=4)
    proxy = SessionProxy(cfg)
    p0, d0 = cfg.prefill[0], cfg.decode[0]
    ids = list(range(10))

    def estimate(session: str, salt: str | None) -> int:
        body = {} if salt is None else {"cache_salt": salt}
        req = ProxiedRequest("/v1/completions", body, session, p0, d0,
                             RequestFacts(request_id=session, mode="pd-bidir", prefill_engine="p0", decode_engine="d0"),
                             0.0, new_ids=ids)
        proxy.estimate_local_hit(req)
        proxy.record_prefill(req, ids)
        return req.local_estimate

    assert estimate("run-1/s0", "run-1") == 0  # nothing on P yet
    assert estimate("run-1/s1", "run-1") == 8  # same salt, another session: 2 whole blocks
    assert estimate("run-2/s0", "run-2") == 0  # the same ids under run 2's salt: none held
    assert estimate("plain/s0", None) == 0  # nor unsalted
    chains = BlockChains(4)
    salted = chains.chain("s", ids, "a")
    assert chains.chain("s", ids, "b") != salted and chains.chain("s", ids, "a") == salted
    assert chains.chain(None, ids) == BlockChains(4).chain(None, ids, "")  # "" is no salt


def test_a_roles_kv_space_read_as_vllm_reads_its_flags():
    """vLLM's argparse keeps the last ``--kv-cache-memory-bytes``, written either way; without one
    the topology's size stands."""
    from serving.workers import WorkerSpec

    base = {"name": "p", "role": "prefill", "host": "h", "port": 1, "model": "m", "kv_cache_bytes": 512}
    args = ("--kv-cache-memory-bytes", "100", "--enforce-eager", "--kv-cache-memory-bytes=200")
    assert WorkerSpec(**base, args=args).effective_kv_cache_bytes == 200
    assert WorkerSpec(**base).effective_kv_cache_bytes == 512


def test_a_prompt_of_whole_blocks_p_holds_whole_still_pulls_its_last_block():
    """vLLM never counts a whole prompt as cached (``max_cache_hit_length = num_tokens - 1``,
    vllm/v1/core/kv_cache_manager.py): a 12-token prompt (3 blocks of 4) that P holds whole finds
    2 blocks (8 tokens) there, and given D's handle for all 12 P pulls the last block. So the
    proxy's estimate is 8, not 12, and P's report of 12 cached tokens is a hit of 4 pulled tokens
    (by hand: 12 - 8), not ``miss_below_threshold`` with none (the real-worker case:
    tests/integration/test_proxy_outcomes_vllm.py, the block-boundary test, P's counter 128)."""
    from serving.proxy import ProxyConfig, SessionProxy, Worker, classify_prefill
    from serving.proxy_request import ProxiedRequest, RequestFacts

    cfg = ProxyConfig(mode="pd-bidir", prefill=[Worker(name="p0", url="http://127.0.0.1:1")],
                      decode=[Worker(name="d0", url="http://127.0.0.1:2")], block_size=4,
                      kv_recompute_threshold=2)
    proxy = SessionProxy(cfg)
    p0, d0 = cfg.prefill[0], cfg.decode[0]
    ids = list(range(12))

    def request(n: str) -> ProxiedRequest:
        return ProxiedRequest("/v1/completions", {}, "s", p0, d0,
                              RequestFacts(request_id=n, mode="pd-bidir", prefill_engine="p0", decode_engine="d0"),
                              0.0, new_ids=ids)

    first = request("1")
    proxy.estimate_local_hit(first)
    proxy.record_prefill(first, ids)  # P now holds the prompt's 3 whole blocks
    again = request("2")
    proxy.estimate_local_hit(again)
    assert again.local_estimate == 8
    assert classify_prefill(12, 12, 12, again.local_estimate, cfg.kv_recompute_threshold) == ("hit", 4)
    # one token short of the boundary nothing changes: 11 tokens, 2 whole blocks, both usable
    assert classify_prefill(8, 11, 8, 8, cfg.kv_recompute_threshold) == ("miss_below_threshold", 0)
