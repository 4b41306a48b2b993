"""What a prefill worker's prefix cache holds, as far as the proxy knows: chained hashes of the
full KV blocks of the prompts that worker computed.

vLLM's prefix cache keys a full block of ``block_size`` tokens by a hash of its parent block's hash
and its own token ids (``vllm/v1/core/kv_cache_utils.py: hash_block_tokens``), so a block is a hit
only when every block before it is one too, and a partly filled last block is never cached. The
proxy mirrors that structure (not vLLM's bytes: vLLM seeds its hashes per process) to answer
"how many leading whole-block tokens of these ids does this P hold" for any session, so a prefix
another session left on P (a shared system prompt under ``round-robin`` routing) counts as P's own
cache hit and not as KV pulled from D (docs/configuration.md).

* :class:`BlockChains`: the block hashes of each session's last prompt, so a turn hashes only the
  blocks past the part it shares with the session's previous prompt (cost follows the new tokens,
  docs/reliability.md).
* :class:`PrefixIndex`: one per P worker, a bounded LRU set of block hashes.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

#: Default capacity of a :class:`PrefixIndex`, in KV blocks: the embedded default topology's P
#: (512 MiB of ``--kv-cache-memory-bytes``, 131,072 tokens of the embedded model, in blocks of 128;
#: ``serving.topology.embedded_topology``). ``serving.stack`` sets it from the topology's
#: ``kv_cache_bytes`` and the model's KV bytes per token when both are known.
DEFAULT_CAPACITY_BLOCKS = 1024

#: Parent hash of a prompt's first block (vLLM uses a seeded ``NONE_HASH`` the same way).
ROOT_HASH = b"\0" * 16


def root_hash(cache_salt: str | None) -> bytes:
    """The parent hash of a prompt's first block for a request with ``cache_salt`` (None or "":
    :data:`ROOT_HASH`). vLLM adds a request's ``cache_salt`` to its first block's hash only
    (``vllm/v1/core/kv_cache_utils.py: generate_block_hash_extra_keys``), so prompts with
    different salts share no block: turnscope's runs each send their own (``--turnscope-cache-salt``,
    the run id) and replay the same sessions on the same workers."""
    if not cache_salt:
        return ROOT_HASH
    return hashlib.blake2b(b"cache_salt\0" + cache_salt.encode("utf-8"), digest_size=16).digest()


def hash_block(parent: bytes, block_ids: np.ndarray) -> bytes:
    """The hash of one full block: 16 bytes of BLAKE2b over the parent block's hash and the
    block's token ids as little-endian int64 (``block_ids``: shape ``(block_size,)``)."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(np.ascontiguousarray(block_ids, dtype="<i8").tobytes())
    return h.digest()


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Number of leading positions where the int arrays ``a`` and ``b`` agree."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class BlockChains:
    """The chained block hashes of each session's last prompt (least recently used session out
    beyond ``max_sessions``).

    Args:
        block_size: tokens per KV block (positive).
        max_sessions: sessions remembered.

    Raises:
        ValueError: a non-positive ``block_size``.

    ``hash_calls`` counts the blocks hashed so far (the cost of :meth:`chain`).
    """

    def __init__(self, block_size: int, max_sessions: int = 100_000):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.max_sessions = max_sessions
        self.hash_calls = 0
        self._last: OrderedDict[str, tuple[np.ndarray, list[bytes], str | None]] = OrderedDict()

    def chain(self, session: str | None, ids: Sequence[int] | np.ndarray, cache_salt: str | None = None) -> list[bytes]:
        """The hashes of the full blocks of ``ids`` (``len(ids) // block_size`` of them), in order,
        the first block's parent being :func:`root_hash` of the request's ``cache_salt``.

        Blocks within the whole-block prefix ``ids`` shares with the session's previous prompt (of
        the same salt) are taken from that prompt's chain; only the rest are hashed. The chain is
        kept as the session's last (``session`` None: nothing kept, every block hashed)."""
        arr = np.asarray(ids, dtype=np.int64)
        n_blocks = len(arr) // self.block_size
        hashes: list[bytes] = []
        salt = cache_salt or None
        prev = self._last.get(session) if session else None
        if prev is not None and prev[2] == salt:
            reuse = min(common_prefix_len(prev[0], arr) // self.block_size, n_blocks)
            hashes = prev[1][:reuse]
        parent = hashes[-1] if hashes else root_hash(salt)
        for b in range(len(hashes), n_blocks):
            parent = hash_block(parent, arr[b * self.block_size:(b + 1) * self.block_size])
            hashes.append(parent)
            self.hash_calls += 1
        if session:
            self._last[session] = (arr, hashes, salt)
            self._last.move_to_end(session)
            while len(self._last) > self.max_sessions:
                self._last.popitem(last=False)
        return hashes


class PrefixIndex:
    """The block hashes one prefill worker's prefix cache holds, as far as the proxy knows: a
    bounded LRU set of at most ``capacity_blocks`` hashes.

    Args:
        block_size: tokens per KV block (positive).
        capacity_blocks: blocks kept (positive; :data:`DEFAULT_CAPACITY_BLOCKS` is the embedded
            default's P).

    Raises:
        ValueError: a non-positive ``block_size`` or ``capacity_blocks``.

    The proxy knows only what it sent P: blocks P evicts under other load, or that a P restart
    lost, are still counted until they leave the LRU here.
    """

    def __init__(self, block_size: int, capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be positive, got {capacity_blocks}")
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def held_tokens(self, chain: Sequence[bytes]) -> int:
        """Tokens of the leading whole blocks of ``chain`` (:meth:`BlockChains.chain`) this P
        holds: a block counts only when every block before it is held (vLLM's chained lookup).
        Does not change the LRU order (vLLM touches blocks when a request uses them, which
        :meth:`record` does after P answers)."""
        held = 0
        for block in chain:
            if block not in self._blocks:
                break
            held += 1
        return held * self.block_size

    def record(self, chain: Sequence[bytes]) -> None:
        """P computed (or pulled) the blocks of ``chain``: keep them as the most recently used,
        the first block last, so a prompt's tail blocks leave first (vLLM frees a request's blocks
        in reverse order "so that the tail blocks are evicted first",
        ``vllm/v1/core/kv_cache_manager.py: free``); the least recently used beyond
        ``capacity_blocks`` are dropped."""
        for block in reversed(chain):
            self._blocks[block] = None
            self._blocks.move_to_end(block)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)
