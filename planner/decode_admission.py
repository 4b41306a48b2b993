"""D's admission queue: a request reaches the decode worker and waits there until D's KV space has room
for it.

Why: on D, vLLM allocates a request's KV blocks when its scheduler takes it from the ``waiting``
queue (``vllm/v1/core/sched/scheduler.py``: ``allocate_slots``, which with
``scheduler_reserve_full_isl`` on by default needs room for the whole prompt, and later one block
per ``block_size`` decoded tokens). When the free blocks are too few, ``allocate_slots`` returns None
and the scheduler stops taking waiting requests (``break``: first come, first served, the head of
the queue blocks those behind it). With ``bidirectional_kv_xfer`` the blocks of every finished
request stay pinned until P reads them or ``decoder_kv_blocks_ttl`` passes
(:mod:`planner.pinned_kv`), and pinned blocks are never evicted, so a D full of handles
makes new requests wait for a read or a TTL. Measured on the capacity ramp (docs/capacity.md): at 6
concurrent sessions on a 64 MiB D, ``pd-bidir``'s TTFT p90 went from ~0.15 s to 1.3-1.8 s while P's
prefill leg stayed at ~0.05 s: the wait was on D.

The model (docs/planner/simulation.md): one pool of ``capacity_blocks`` on D. A request
arrives at D at ``at_s`` (when its first token is due), needs ``need_blocks`` and, once admitted,
holds them ``hold_s`` seconds as a running request; what D holds besides (the pinned handles) is
the caller's (:class:`DecodeHolds`), which the queue advances in time with itself, so an admission
can pin a handle that a later admission must find room next to. A request is admitted at the first
event (an arrival at D, the end of a running request's hold, a change of what is held: a pin, a
read, a TTL) at which the held blocks plus the running ones leave room for it, and never before
the request ahead of it. Left out: preemption of running requests when a decode step finds no free
block (vLLM's ``_preempt_request``; measured: 4 at 8 sessions), the blocks a request adds while it
decodes (it is charged its whole KV from its admission) and the reservation vLLM keeps for requests
still loading KV (``_inflight_prefill_reserved_blocks``).

Units: seconds, KV blocks.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from core import reuse_rules as rules
from core.contract import Role
from planner.overload import QueueGrows
from planner.pinned_blocks import PinnedBlocks
from planner.pinned_kv import HandleLedger


class DecodeHolds(Protocol):
    """What D holds besides its running requests (the pinned handles), as the queue sees it."""

    def held_blocks(self) -> float:
        """Blocks held now (after :meth:`settle`)."""

    def next_change_s(self) -> float:
        """When what is held may change next (a pin or a TTL due); ``inf`` when nothing is due."""

    def settle(self, t: float) -> None:
        """Apply every change due by ``t``."""

    def admitted(self, key: int, admit_s: float, hold_s: float) -> float | None:
        """Request ``key`` was admitted at ``admit_s`` to run ``hold_s`` seconds (the caller
        schedules what it leaves behind); returns when its blocks stop counting as running (then
        they are held, or freed), or None: at the end of that hold."""


class DecodeAdmission:
    """D's KV space and its first-come-first-served admission queue, advanced in time by the caller.

    Args:
        capacity_blocks: D's KV space, blocks.
        holds: what D holds besides running requests (None: nothing, one-way P/D).

    Use: :meth:`arrive` for each request reaching D (``at_s`` not before the time already advanced
    to), :meth:`advance` to a time (events up to it are processed, admitting what fits), and
    :meth:`close` at the end; after a change the caller makes at the current time (a read that
    frees a handle), :meth:`advance` to that same time admits what now fits. ``wait_s``: request
    key -> seconds it waited (from its arrival at D to its admission); ``peak_in_use_blocks``: the
    most blocks in use at once, held (pinned handles) plus running, the quantity vLLM's
    ``vllm:kv_cache_usage_perc`` reports as a fraction of the space (less the system prompt's
    blocks, which :class:`DecodeSpace` charges no request)."""

    def __init__(self, capacity_blocks: float, holds: DecodeHolds | None = None):
        self.capacity = capacity_blocks
        self.holds = holds
        self.now = -math.inf
        self.wait_s: dict[int, float] = {}
        self._waiting: list[tuple[float, int, float, float]] = []   # (at, key, need, hold), by arrival
        self._running: list[tuple[float, float]] = []               # (end of hold, blocks)
        self._in_use = 0.0
        self.peak_in_use_blocks = 0.0
        #: When set (seconds), admitting a request that waited longer raises
        #: :class:`planner.overload.QueueGrows` (the forecast stops: D is overloaded).
        self.stop_after_s: float | None = None

    def arrive(self, key: int, at_s: float, need_blocks: float, hold_s: float) -> None:
        """Request ``key`` reaches D at ``at_s``, needing ``need_blocks`` for ``hold_s`` seconds."""
        heapq.heappush(self._waiting, (float(at_s), key, float(need_blocks), float(hold_s)))

    def _held(self) -> float:
        return self.holds.held_blocks() if self.holds else 0.0

    def _note_in_use(self) -> None:
        self.peak_in_use_blocks = max(self.peak_in_use_blocks, self._held() + self._in_use)

    def _fits(self, need: float) -> bool:
        held = self._held() + self._in_use
        # a request larger than the whole space goes in when D is empty (vLLM would reject it at the door)
        return held + need <= self.capacity or (need > self.capacity and held == 0)

    def _admit(self, key: int, at: float, need: float, hold: float) -> None:
        if self.stop_after_s is not None and self.now - at > self.stop_after_s:
            raise QueueGrows(Role.DECODE, self.now - at, self.stop_after_s)
        heapq.heappop(self._waiting)
        self.wait_s[key] = self.now - at
        end = self.holds.admitted(key, self.now, hold) if self.holds else None
        heapq.heappush(self._running, (self.now + hold if end is None else end, need))
        self._in_use += need
        self._note_in_use()

    def _admit_what_fits(self) -> None:
        waiting = self._waiting
        while waiting and waiting[0][0] <= self.now and self._fits(waiting[0][2]):
            at, key, need, hold = waiting[0]
            self._admit(key, at, need, hold)

    def _next_event(self) -> float:
        head = self._waiting[0][0] if self._waiting and self._waiting[0][0] > self.now else math.inf
        end = self._running[0][0] if self._running else math.inf
        return min(head, end, self.holds.next_change_s() if self.holds else math.inf)

    def next_event_s(self) -> float:
        """When D's next event is due (a waiting request's arrival, a running one's end, a change of
        what it holds), seconds; ``inf`` when none."""
        return self._next_event()

    def advance(self, t: float) -> None:
        """Process D's events up to ``t`` (inclusive) in time order, admitting at each what fits."""
        waiting, running, holds = self._waiting, self._running, self.holds
        inf, heappop = math.inf, heapq.heappop
        while True:
            if waiting and waiting[0][0] <= self.now:
                self._admit_what_fits()
            # the next event: a waiting request's arrival, a running one's end, a change of what D holds
            nxt = waiting[0][0] if waiting and waiting[0][0] > self.now else inf
            if running and running[0][0] < nxt:
                nxt = running[0][0]
            if holds is not None:
                change = holds.next_change_s()
                nxt = min(nxt, change)
            if nxt > t or nxt == inf:
                break
            self.now = max(self.now, nxt)
            now = self.now
            while running and running[0][0] <= now:
                self._in_use -= heappop(running)[1]
            if holds is not None:
                holds.settle(now)
                self._note_in_use()
        if t != inf and t > self.now:
            self.now = t
        if waiting:
            self._admit_what_fits()

    def close(self) -> None:
        """Admit every request still waiting. One that nothing will ever make room for (what D holds
        never freed) is admitted when nothing else can change, rather than never."""
        while self._waiting:
            self.advance(math.inf)
            if self._waiting:   # the head is blocked and nothing is left to change
                at, key, need, hold = self._waiting[0]
                self.now = max(self.now, at)
                self._admit(key, at, need, hold)


def one_way_admission(at_s: np.ndarray, need_blocks: np.ndarray, hold_s: np.ndarray,
                      capacity_blocks: float) -> DecodeAdmission:
    """A D that holds nothing but its running requests (one-way P/D), every request admitted:
    :class:`DecodeAdmission` with no holds, closed. Arrays of one length, any order (served in
    order of arrival at D, ties in the order given); request ``j`` is key ``j``.

    Raises ValueError for arrays of different lengths."""
    at = np.asarray(at_s, dtype=float)
    need = np.asarray(need_blocks, dtype=float)
    hold = np.asarray(hold_s, dtype=float)
    if not (len(at) == len(need) == len(hold)):
        raise ValueError(f"at_s, need_blocks and hold_s differ in length ({len(at)}, {len(need)}, {len(hold)})")
    queue = DecodeAdmission(capacity_blocks)
    for j in range(len(at)):
        queue.arrive(j, at[j], need[j], hold[j])
    queue.close()
    return queue


@dataclass(frozen=True)
class DecodeSpace:
    """D's KV space and what each request takes of it: ``capacity_blocks``; ``need_blocks`` per
    request, the whole blocks of its KV (prompt + output - 1 tokens, :func:`core.reuse_rules.handle_kv_tokens`)
    less the system prompt's whole blocks (other sessions' handles hold them pinned and D's prefix
    cache shares a pinned block for free; a cached but unreferenced block costs a free one, as
    vLLM's ``get_num_blocks_to_allocate`` counts it); ``hold_s`` per request: how long it holds
    them once admitted (its decode, seconds)."""

    capacity_blocks: int
    need_blocks: np.ndarray
    hold_s: np.ndarray

    @classmethod
    def of(cls, capacity_blocks: int, block_size: int, prompt_tokens: np.ndarray, output_tokens: np.ndarray,
           system_prompt_tokens: int, decode_s: np.ndarray) -> DecodeSpace:
        need = rules.blocks_of(rules.handle_kv_tokens(prompt_tokens, output_tokens), block_size)
        return cls(capacity_blocks, np.maximum(need - system_prompt_tokens // block_size, 0),
                   np.asarray(decode_s, dtype=float))


class HandlesOnD:
    """:class:`DecodeHolds` over a bidirectional D's handles: the blocks
    :class:`planner.pinned_blocks.PinnedBlocks` holds pinned, changed in time by
    :class:`planner.pinned_kv.HandleLedger` (pins due, TTLs). An admitted request's
    handle is given to the ledger to pin where the forecast ends the request on D: its admission
    plus its decode. Not where the traffic records its end: a recorded end holds whatever the
    request waited where it was recorded, and pinning there would leave its blocks counted nowhere
    between the end of its forecast decode and that end (and a recorded run's own measured wait
    would shape the forecast of it).

    ``latest_end_s`` (request key -> seconds; absent: no bound) keeps a closed-loop record's order:
    a request whose session sent its next request after this one's reply (the traffic records the
    gap between them, :meth:`planner.simulate.Traffic.latest_end_s`) ends on D no later
    than that next arrival, though not before its admission. Without it a forecast a few ms long
    ends a turn after the recorded arrival of the next, which then finds no handle
    (``miss_consumed``), an order the recorded client could not have produced."""

    def __init__(self, ledger: HandleLedger, pinned: PinnedBlocks, latest_end_s: np.ndarray | None = None):
        self.ledger, self.pinned = ledger, pinned
        self.latest_end_s = latest_end_s
        self._expected: dict[int, dict] = {}

    def expect(self, key: int, handle: dict) -> None:
        """Request ``key`` will leave ``handle`` when it ends on D: the keyword arguments of
        :meth:`HandleLedger.finished` (session, kv_tokens, nbytes, ordinal, blocks)."""
        self._expected[key] = handle

    def held_blocks(self) -> float:
        return float(self.pinned.held_blocks)

    def next_change_s(self) -> float:
        return self.ledger.next_change_s()

    def settle(self, t: float) -> None:
        self.ledger.settle(t)

    def admitted(self, key: int, admit_s: float, hold_s: float) -> float:
        end = admit_s + hold_s
        if self.latest_end_s is not None:
            end = min(end, max(admit_s, float(self.latest_end_s[key])))
        self.ledger.finished(end, key, **self._expected.pop(key))
        return end
