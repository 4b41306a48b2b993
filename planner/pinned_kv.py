"""D's pinned KV over time: the handle lifecycle the planner's forecast
(:mod:`planner.simulate`) and the Memory page's TTL what-if
(:mod:`planner.ttl_whatif`) share, so the rule is written once.

vLLM 0.32's NixlConnector (``nixl/pull_scheduler.py``: ``request_finished`` pins a finished
request's blocks, ``_reap_expired_send_leases`` frees them): when a request finishes on D its KV
stays pinned until P reads it (a handle is single use), or tells D it needs none of it (the
session's next turn ``miss_below_threshold``: :func:`core.reuse_rules.d_frees_taken_handle`),
or ``decoder_kv_blocks_ttl`` seconds pass. The callers decide which turn frees its handle
(:meth:`HandleLedger.read`) with that one rule.
Pinned blocks are never evicted, so when the blocks already pinned leave no room in D's KV space
for a finishing request's, that request's handle is lost (the planner's ``miss_d_full`` on the
session's next request). The KV of requests still running on D is not counted here: the planner's
D admission queue (:mod:`planner.decode_admission`) admits a request only where its blocks
fit next to the pinned ones and the running ones, as vLLM does, so there a handle always fits when
its request ends; the Memory page's what-if replays recorded runs without it (an upper bound on
what handles can use).

Units: seconds on the caller's clock, bytes. Only the standard library and numpy: every part may
import it (docs/design.md).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Protocol

import numpy as np

GiB = 2**30


class HeldTimeline:
    """The bytes pinned on D after each change: ``t`` (seconds) and ``b`` (bytes), starting at
    ``(0, 0)``; the base of both ways of counting them (:class:`PinnedKV`, per handle, and
    :class:`planner.pinned_blocks.PinnedBlocks`, distinct blocks)."""

    def __init__(self) -> None:
        self.t: list[float] = [0.0]
        self.b: list[float] = [0.0]

    def _record_bytes(self, t: float, held: float) -> None:
        self.t.append(t)
        self.b.append(held)

    def peak_bytes(self) -> float:
        """The most bytes held pinned at once (0 when nothing was)."""
        return float(max(self.b))

    def held_gib_s(self) -> float:
        """The integral of the held bytes over time, GiB x seconds (a step function)."""
        return sum(b * (t1 - t0) for t0, t1, b in zip(self.t, self.t[1:], self.b, strict=False)) / GiB


class PinnedKV(HeldTimeline):
    """Bytes D holds pinned, each handle counted in full (what the proxy's handle table and the
    Memory page count), releases due at the TTL, and the timeline of what was held.

    Args:
        capacity_bytes: D's KV space for pinned handles, bytes; None: unbounded.
    """

    def __init__(self, capacity_bytes: float | None):
        super().__init__()
        self.capacity = capacity_bytes
        self.held = 0.0
        self._due: list[tuple[float, int, float]] = []   # (release time, handle id, bytes)
        self._released: set[int] = set()

    def _record(self, t: float) -> None:
        self._record_bytes(t, self.held)

    def release_due(self, now: float) -> None:
        """Free every handle whose TTL passed by ``now``."""
        while self._due and self._due[0][0] <= now:
            t, hid, nbytes = heapq.heappop(self._due)
            if hid in self._released:
                self._released.discard(hid)
                continue
            self.held -= nbytes
            self._record(t)

    def next_due_s(self) -> float:
        """The next TTL due (a handle already read may still be listed), seconds; ``inf``: none."""
        return self._due[0][0] if self._due else float("inf")

    def pin(self, t: float, handle: Handle, ttl_s: float) -> bool:
        """Pin ``handle.nbytes`` at ``t`` until read or ``t + ttl_s``; False (nothing pinned) when
        they do not fit next to what is pinned."""
        if self.capacity is not None and self.held + handle.nbytes > self.capacity:
            return False
        self.held += handle.nbytes
        heapq.heappush(self._due, (t + ttl_s, handle.hid, handle.nbytes))
        self._record(t)
        return True

    def read(self, t: float, handle: Handle) -> None:
        """P read the handle at ``t`` (or told D it needs none of it): D frees its blocks."""
        self._released.add(handle.hid)
        self.held -= handle.nbytes
        self._record(t)


@dataclass(frozen=True)
class Handle:
    """One session's handle on D: pinned at ``created_s`` (its request's end), ``kv_tokens`` tokens
    of KV (``remote_num_tokens``) in ``nbytes`` bytes (whole blocks), id ``hid``; ``session``,
    ``ordinal`` (its request's place in the session) and ``blocks`` (whole KV blocks) for a store
    that counts shared blocks once (:class:`planner.pinned_blocks.PinnedBlocks`)."""

    created_s: float
    kv_tokens: int
    nbytes: float
    hid: int
    session: object = None
    ordinal: int = 0
    blocks: int = 0


class PinnedStore(Protocol):
    """What :class:`HandleLedger` pins handles in: :class:`PinnedKV` or
    :class:`planner.pinned_blocks.PinnedBlocks` (both :class:`HeldTimeline`)."""

    t: list[float]
    b: list[float]

    def pin(self, t: float, handle: Handle, ttl_s: float) -> bool: ...
    def read(self, t: float, handle: Handle) -> None: ...
    def release_due(self, now: float) -> None: ...
    def next_due_s(self) -> float: ...
    def peak_bytes(self) -> float: ...
    def held_gib_s(self) -> float: ...


#: What :meth:`HandleLedger.take` returns when the session's last handle did not fit on D.
LOST = "lost"


class HandleLedger:
    """The handles of one decode worker, per session: pinned when their request finishes (if they
    fit), taken by the session's next request, then freed (read, or a turn below the recompute
    threshold: :func:`core.reuse_rules.d_frees_taken_handle`) or left to expire.

    Args:
        pinned: where handles are pinned (:class:`PinnedKV` per handle, or
            :class:`planner.pinned_blocks.PinnedBlocks` for distinct blocks), or D's KV
            space in bytes (a :class:`PinnedKV` of that capacity; None: unbounded).
        decoder_kv_blocks_ttl_s: how long D pins a handle nobody reads, seconds.

    Call :meth:`finished` when a request will finish (any order), :meth:`take` when a session's
    next request arrives (in arrival order), :meth:`read` when D frees the taken handle (P pulled
    it, or pulled nothing and told D so: :func:`core.reuse_rules.d_frees_taken_handle`), and
    :meth:`close` after the last request. ``kv`` holds the timeline; ``lost_handles`` counts
    the handles that did not fit.
    """

    def __init__(self, pinned: PinnedStore | float | None, decoder_kv_blocks_ttl_s: float):
        self.kv: PinnedStore = pinned if hasattr(pinned, "pin") else PinnedKV(pinned)
        self.ttl_s = decoder_kv_blocks_ttl_s
        self._finishing: list[tuple[float, int, Handle]] = []  # (end, id, the handle it leaves)
        self._handles: dict[object, Handle] = {}
        self._lost: set[object] = set()
        self.lost_handles = 0

    def finished(self, end_s: float, hid: int, session: object, kv_tokens: int, nbytes: float, *,
                 ordinal: int = 0, blocks: int = 0) -> None:
        """Request ``hid`` of ``session`` ends at ``end_s``, leaving ``kv_tokens`` (``nbytes``, whole
        ``blocks``) on D; ``ordinal``: its place in the session (for distinct-block counting)."""
        heapq.heappush(self._finishing, (end_s, hid, Handle(end_s, kv_tokens, nbytes, hid, session, ordinal, blocks)))

    def _settle(self, now: float) -> None:
        """Pin the handles of the requests finished by ``now`` (releasing expired ones first)."""
        while self._finishing and self._finishing[0][0] <= now:
            end, _, handle = heapq.heappop(self._finishing)
            session = handle.session
            self.kv.release_due(end)
            if self.kv.pin(end, handle, self.ttl_s):
                self._handles[session] = handle
                self._lost.discard(session)
            else:
                self._handles.pop(session, None)
                self._lost.add(session)
                self.lost_handles += 1
        self.kv.release_due(now)

    def settle(self, now: float) -> None:
        """Pin every handle whose request ended by ``now`` and free those whose TTL passed."""
        self._settle(now)

    def next_change_s(self) -> float:
        """When what is pinned may change next (a request's end or a TTL due), seconds; ``inf``: never."""
        end = self._finishing[0][0] if self._finishing else float("inf")
        return min(end, self.kv.next_due_s())

    def take(self, now: float, session: object) -> Handle | str | None:
        """The session's handle at ``now`` (a request arrives): the :class:`Handle` (removed from
        the table: single use; still pinned until :meth:`read` or its TTL), :data:`LOST` when its
        last handle did not fit on D, or None (no handle: first request, or already taken)."""
        self._settle(now)
        handle = self._handles.pop(session, None)
        if handle is not None:
            return handle
        if session in self._lost:
            self._lost.discard(session)
            return LOST
        return None

    def read(self, now: float, handle: Handle) -> None:
        """D frees ``handle`` at ``now``: P pulled it, or found fewer than ``kv_recompute_threshold``
        tokens to pull and sent D the completion notification anyway
        (:func:`core.reuse_rules.d_frees_taken_handle`)."""
        self.kv.read(now, handle)

    def close(self) -> None:
        """Pin every handle still finishing (a session's last requests) and let all expire."""
        self._settle(float("inf"))


def interval_load(start_s: np.ndarray, end_s: np.ndarray, nbytes: np.ndarray) -> tuple[float, float]:
    """``(peak bytes, GiB x s)`` of holds ``[start_s, end_s)`` of ``nbytes`` each, with no limit
    on the space (arrays of one length; at equal times releases count before pins, as in
    :class:`PinnedKV`, whose timeline these are when nothing is lost). (0, 0) for no holds."""
    if len(start_s) == 0:
        return 0.0, 0.0
    w = np.asarray(nbytes, dtype=float)
    # The peak is reached just after a pin: pins so far less the releases at or before that time
    # (releases first at equal times). Both sorts are stable (timsort), near-linear on the nearly
    # sorted times a run's turns give.
    by_start = np.argsort(start_s, kind="stable")
    by_end = np.argsort(end_s, kind="stable")
    pinned = np.cumsum(w[by_start])
    released = np.concatenate([[0.0], np.cumsum(w[by_end])])
    before = np.searchsorted(end_s[by_end], start_s[by_start], side="right")
    held = pinned - released[before]
    return float(max(held.max(), 0.0)), float(np.sum(w * (end_s - start_s)) / GiB)
