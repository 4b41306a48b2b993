"""D's pinned KV over time: the handle lifecycle the planner's forecast
(:mod:`turnscope.planner.simulate`) and the Memory page's TTL what-if
(:mod:`turnscope.planner.ttl_whatif`) share, so the rule is written once.

vLLM 0.32's NixlConnector (``nixl/pull_scheduler.py``: ``request_finished`` pins a finished
request's blocks, ``_reap_expired_send_leases`` frees them): when a request finishes on D its KV
stays pinned until P reads it (a handle is single use) or ``decoder_kv_blocks_ttl`` seconds pass.
Pinned blocks are never evicted, so when the blocks already pinned leave no room in D's KV space
for a finishing request's, that request's handle is lost (the planner's ``miss_d_full`` on the
session's next request; in vLLM the same over-subscription makes D queue or preempt requests
instead: either way the reuse is gone). The KV of requests still running on D is not counted
against the space (an upper bound on what handles can use).

Units: seconds on the caller's clock, bytes. Only the standard library and numpy: every part may
import it (docs/design.md).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

GiB = 2**30


class PinnedKV:
    """Bytes D holds pinned, releases due at the TTL, and the timeline of what was held.

    Args:
        capacity_bytes: D's KV space for pinned handles, bytes; None: unbounded.

    ``t``/``b``: the held bytes after each change (starting at ``(0, 0)``), times in seconds.
    """

    def __init__(self, capacity_bytes: float | None):
        self.capacity = capacity_bytes
        self.held = 0.0
        self._due: list[tuple[float, int, float]] = []   # (release time, handle id, bytes)
        self._released: set[int] = set()
        self.t: list[float] = [0.0]
        self.b: list[float] = [0.0]

    def _record(self, t: float) -> None:
        self.t.append(t)
        self.b.append(self.held)

    def release_due(self, now: float) -> None:
        """Free every handle whose TTL passed by ``now``."""
        while self._due and self._due[0][0] <= now:
            t, hid, nbytes = heapq.heappop(self._due)
            if hid in self._released:
                self._released.discard(hid)
                continue
            self.held -= nbytes
            self._record(t)

    def pin(self, t: float, hid: int, nbytes: float, ttl_s: float) -> bool:
        """Pin ``nbytes`` at ``t`` until read or ``t + ttl_s``; False (nothing pinned) when they
        do not fit next to what is pinned."""
        if self.capacity is not None and self.held + nbytes > self.capacity:
            return False
        self.held += nbytes
        heapq.heappush(self._due, (t + ttl_s, hid, nbytes))
        self._record(t)
        return True

    def read(self, t: float, hid: int, nbytes: float) -> None:
        """P read the handle at ``t``: D frees its blocks."""
        self._released.add(hid)
        self.held -= nbytes
        self._record(t)

    def peak_bytes(self) -> float:
        """The most bytes held pinned at once (0 when nothing was)."""
        return float(max(self.b))

    def held_gib_s(self) -> float:
        """The integral of the held bytes over time, GiB x seconds (a step function)."""
        return sum(b * (t1 - t0) for t0, t1, b in zip(self.t, self.t[1:], self.b, strict=False)) / GiB


@dataclass(frozen=True)
class Handle:
    """One session's handle on D: pinned at ``created_s`` (its request's end), ``kv_tokens`` tokens
    of KV (``remote_num_tokens``) in ``nbytes`` bytes (whole blocks), id ``hid``."""

    created_s: float
    kv_tokens: int
    nbytes: float
    hid: int


#: What :meth:`HandleLedger.take` returns when the session's last handle did not fit on D.
LOST = "lost"


class HandleLedger:
    """The handles of one decode worker, per session: pinned when their request finishes (if they
    fit), taken by the session's next request, read or left to expire.

    Args:
        capacity_bytes: D's KV space, bytes (None: unbounded).
        decoder_kv_blocks_ttl_s: how long D pins a handle nobody reads, seconds.

    Call :meth:`finished` when a request will finish (any order), :meth:`take` when a session's
    next request arrives (in arrival order), :meth:`read` when P pulls the taken handle, and
    :meth:`close` after the last request. ``kv`` holds the timeline; ``lost_handles`` counts
    the handles that did not fit.
    """

    def __init__(self, capacity_bytes: float | None, decoder_kv_blocks_ttl_s: float):
        self.kv = PinnedKV(capacity_bytes)
        self.ttl_s = decoder_kv_blocks_ttl_s
        self._finishing: list[tuple[float, int, object, int, float]] = []  # (end, id, session, tokens, bytes)
        self._handles: dict[object, Handle] = {}
        self._lost: set[object] = set()
        self.lost_handles = 0

    def finished(self, end_s: float, hid: int, session: object, kv_tokens: int, nbytes: float) -> None:
        """Request ``hid`` of ``session`` ends at ``end_s``, leaving ``kv_tokens`` (``nbytes``) on D."""
        heapq.heappush(self._finishing, (end_s, hid, session, kv_tokens, nbytes))

    def _settle(self, now: float) -> None:
        """Pin the handles of the requests finished by ``now`` (releasing expired ones first)."""
        while self._finishing and self._finishing[0][0] <= now:
            end, hid, session, tokens, nbytes = heapq.heappop(self._finishing)
            self.kv.release_due(end)
            if self.kv.pin(end, hid, nbytes, self.ttl_s):
                self._handles[session] = Handle(end, tokens, nbytes, hid)
                self._lost.discard(session)
            else:
                self._handles.pop(session, None)
                self._lost.add(session)
                self.lost_handles += 1
        self.kv.release_due(now)

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
        """P pulled ``handle`` at ``now``: D frees its blocks."""
        self.kv.read(now, handle.hid, handle.nbytes)

    def close(self) -> None:
        """Pin every handle still finishing (a session's last requests) and let all expire."""
        self._settle(float("inf"))


def interval_load(start_s: np.ndarray, end_s: np.ndarray, nbytes: np.ndarray) -> tuple[float, float]:
    """``(peak bytes, GiB x s)`` of holds ``[start_s, end_s)`` of ``nbytes`` each, with no limit
    on the space (arrays of one length; at equal times releases count before pins, as in
    :class:`PinnedKV`, whose timeline these are when nothing is lost). (0, 0) for no holds."""
    if len(start_s) == 0:
        return 0.0, 0.0
    t = np.concatenate([end_s, start_s])
    d = np.concatenate([-nbytes, nbytes]).astype(float)
    order = np.lexsort((d, t))   # by time, releases (negative) first
    held = np.cumsum(d[order])
    return float(max(held.max(), 0.0)), float(np.sum(nbytes * (end_s - start_s)) / GiB)
