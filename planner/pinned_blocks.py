"""D's pinned KV counted as distinct KV blocks, the way vLLM's prefix caching on D shares them.

When D pins a finished turn's blocks (bidirectional P/D, ``decoder_kv_blocks_ttl``), a block
another pinned handle already holds is not held twice: vLLM's ``KVCacheManager`` finds a prompt's
full blocks by their hash (``vllm/v1/core/kv_cache_utils.py``: ``hash_block_tokens`` chains each
block's hash to its parent's) and reuses the cached block, counting a reference
(``vllm/v1/core/block_pool.py``: ``touch``); the block is free only when no request or pinned
handle refers to it. So pinned occupancy is the number of distinct blocks held.

Token ids are unknown to the planner (traces give counts), so a block's identity is approximated
from what :class:`loadgen.traces.agent_request.AgentRequest` records (docs/planner/simulation.md):

* within a session, request k's handle shares with request k-1's its first
  ``m_k = min(shared_prefix_tokens_k, kv_k-1, kv_k) // block`` blocks (whole blocks of the prefix
  request k shares with the previous request's prompt and output); two handles j < k share
  ``min(m_j+1 .. m_k)`` blocks (a chain of prefixes: what an edit cut is not shared again);
* across sessions, the first ``shared_prefix_tokens // block`` blocks (the system prompt of
  :class:`planner.simulate.PlanSettings`) are one set of blocks for every handle whose
  session kept that prefix intact since its first request;
* nothing else is shared (two sessions' own histories never are); a handle's partial last block is
  its own (vLLM hashes full blocks only).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from planner.pinned_kv import Handle, HeldTimeline


@dataclass
class _SessionChain:
    """One session's requests as a chain of prefixes, and its handles D holds now."""

    shared: list[int] = field(default_factory=list)        # m_k: whole blocks shared with request k-1
    system: list[int] = field(default_factory=list)        # system-prompt blocks request k holds (0: none)
    kv_tokens: int = 0                                      # the last request's handle tokens
    live: dict[int, int] = field(default_factory=dict)     # ordinal -> blocks of a pinned handle
    own: int = 0                                            # distinct blocks held, system prompt excluded
    sys: int = 0                                            # system-prompt blocks held


class PinnedBlocks(HeldTimeline):
    """Distinct KV blocks D holds pinned, over time (blocks of ``block_size`` tokens,
    ``block_bytes`` bytes each; ``capacity_blocks`` None: unbounded; ``system_blocks``: whole
    blocks of a system prompt every session starts with).

    Use: :meth:`add_request` for each request in arrival order (its place in its session's chain),
    :meth:`pin` when it finishes, :meth:`read` when D frees the handle, :meth:`release_due` as
    time passes. ``t``/``b``: the timeline (seconds, bytes held after each change)."""

    def __init__(self, capacity_blocks: int | None, block_size: int, block_bytes: float, system_blocks: int = 0):
        super().__init__()
        self.capacity = capacity_blocks
        self.block_size = block_size
        self.block_bytes = block_bytes
        self.system_blocks = system_blocks
        self.sessions: dict[int, _SessionChain] = {}
        self.own_total = 0
        self._sys_holders: dict[int, int] = {}            # system blocks held by a session -> sessions
        self._due: list[tuple[float, int, int, int]] = []  # (release time, handle id, session, ordinal)
        self._released: set[int] = set()

    # -- the chain ----------------------------------------------------------------------------

    def add_request(self, session: int, kv_tokens: int, shared_prefix_tokens: int) -> int:
        """Place a request (its handle would cover ``kv_tokens``; it shares ``shared_prefix_tokens``
        with the session's previous request) in its session's chain; returns its ordinal."""
        st = self.sessions.get(session)
        if st is None:
            st = self.sessions[session] = _SessionChain()
        full = kv_tokens // self.block_size
        if not st.shared:
            m = 0
            sys = min(self.system_blocks, full)
        else:
            m = min(shared_prefix_tokens, st.kv_tokens, kv_tokens) // self.block_size
            sys = min(self.system_blocks, full) if st.system[-1] and m >= self.system_blocks else 0
        st.shared.append(m)
        st.system.append(sys)
        st.kv_tokens = kv_tokens
        return len(st.shared) - 1

    def _held_by(self, st: _SessionChain, live: dict[int, int]) -> tuple[int, int]:
        """(own distinct blocks, system-prompt blocks) of ``live`` handles of one session."""
        total, sys, prev = 0, 0, None
        for o in sorted(live):
            blocks = live[o]
            total += blocks if prev is None else blocks - min(blocks, min(st.shared[prev + 1:o + 1]))
            sys = max(sys, st.system[o])
            prev = o
        return total - sys, sys

    @property
    def held_blocks(self) -> int:
        """Distinct blocks pinned now."""
        return self.own_total + (max(self._sys_holders) if self._sys_holders else 0)

    @property
    def held_bytes(self) -> float:
        """Bytes pinned now."""
        return self.held_blocks * self.block_bytes

    def _set(self, st: _SessionChain, live: dict[int, int], own: int, sys: int) -> None:
        self.own_total += own - st.own
        if st.sys:
            self._sys_holders[st.sys] -= 1
            if not self._sys_holders[st.sys]:
                del self._sys_holders[st.sys]
        if sys:
            self._sys_holders[sys] = self._sys_holders.get(sys, 0) + 1
        st.live, st.own, st.sys = live, own, sys

    def _record(self, t: float) -> None:
        self._record_bytes(t, self.held_bytes)

    # -- pinning ------------------------------------------------------------------------------

    def pin(self, t: float, handle: Handle, ttl_s: float) -> bool:
        """Pin request ``handle.ordinal``'s ``handle.blocks`` at ``t`` until read or ``t + ttl_s``;
        False (nothing pinned) when the blocks it adds do not fit next to what is pinned."""
        hid, session, ordinal, blocks = handle.hid, handle.session, handle.ordinal, handle.blocks
        st = self.sessions[session]
        live = dict(st.live)
        live[ordinal] = blocks
        own, sys = self._held_by(st, live)
        if self.capacity is not None:
            holders = dict(self._sys_holders)
            if st.sys:
                holders[st.sys] -= 1
                if not holders[st.sys]:
                    del holders[st.sys]
            top = max([sys, *holders]) if (sys or holders) else 0
            if self.own_total - st.own + own + top > self.capacity:
                return False
        self._set(st, live, own, sys)
        heapq.heappush(self._due, (t + ttl_s, hid, session, ordinal))
        self._record(t)
        return True

    def _release(self, session: int, ordinal: int) -> None:
        st = self.sessions[session]
        live = dict(st.live)
        live.pop(ordinal, None)
        self._set(st, live, *self._held_by(st, live))

    def read(self, t: float, handle: Handle) -> None:
        """P read the handle at ``t`` (or told D it needs none of it): D frees its references
        (blocks another handle holds stay)."""
        self._released.add(handle.hid)
        self._release(handle.session, handle.ordinal)
        self._record(t)

    def next_due_s(self) -> float:
        """The next TTL due (a handle already read may still be listed), seconds; ``inf``: none."""
        return self._due[0][0] if self._due else float("inf")

    def release_due(self, now: float) -> None:
        """Free every handle whose TTL passed by ``now``."""
        while self._due and self._due[0][0] <= now:
            t, hid, session, ordinal = heapq.heappop(self._due)
            if hid in self._released:
                self._released.discard(hid)
                continue
            self._release(session, ordinal)
            self._record(t)
