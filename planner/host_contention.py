"""Host contention: a request's own work slowed by the other requests in flight on the same host
(docs/planner/simulation.md).

On a machine whose proxy, load generator and engine frontends share the cores with the workers'
compute (the embedded default: two cores), every other request streaming its reply takes host time
that a new request's prefill, hand-off and first token wait for. ``bench/host_contention.py``
measures it apart: one request's TTFT alone and beside k requests streaming, interleaved
(2026-12-05: 1.16x at k = 1, 1.22x at k = 2; P's own leg flat once the proxy and the client are
pinned to the other core, so it is the host relaying the other streams). The term:

    contention_i = beta x s_i x own_i

* ``beta``: :attr:`planner.profile.CostProfile.host_contention_per_request`, the bench's
  least-squares slope through the origin of (TTFT at k / TTFT alone - 1) on k (dimensionless);
* ``s_i``: the other requests of the traffic in flight when request i arrives (arrived, not yet
  ended: :func:`in_flight_at_arrival`), by the traffic's own ends, as the handles' pins take them
  (:func:`planner.simulate.finish_times`: a recorded request's server time, E2E for a
  recorded run; else the profile's full-prompt TTFT plus its decode);
* ``own_i``: request i's own work on the TTFT path, seconds: its compute, pull, b0 and renders, the
  part the bench measured (its requests never waited), not its waits for P or for room on D.

The term is added to the TTFT the client sees; the engine's events (P's queue, D's admission, the
handles) keep the uncontended times, so no outcome changes with it. A profile without ``beta`` (a
GPU serving host whose proxy has cores of its own, a fitted profile) gets no term.
"""

from __future__ import annotations

import numpy as np


def in_flight_at_arrival(arrival_s: np.ndarray, end_s: np.ndarray) -> np.ndarray:
    """For each request, how many others are in flight when it arrives: ``arrival_j <= arrival_i
    < end_j``, j != i (a request ending at the very arrival is no longer in flight).

    Args:
        arrival_s: arrival of each request, seconds (any order).
        end_s: end of each request, seconds, ``>= arrival_s``.

    Returns: counts (int64), one per request, in the input order.

    Raises ValueError for arrays of different lengths or an end before its arrival."""
    arrival = np.asarray(arrival_s, dtype=float)
    end = np.asarray(end_s, dtype=float)
    if arrival.shape != end.shape:
        raise ValueError(f"arrival_s has {arrival.size} entries and end_s {end.size}: one of each per request")
    if (end < arrival).any():
        raise ValueError("a request ends before it arrives (end_s < arrival_s)")
    arrived = np.searchsorted(np.sort(arrival), arrival, side="right") - 1   # others arrived by then
    # others ended by then (each arrived no later); a request of no duration has ended at its own arrival
    ended = np.searchsorted(np.sort(end), arrival, side="right") - (end <= arrival)
    return (arrived - ended).astype(np.int64)


def contention_s(beta: float | None, arrival_s: np.ndarray, end_s: np.ndarray, own_s: np.ndarray) -> np.ndarray:
    """``beta x s_i x own_i`` seconds per request (the module doc); zeros when ``beta`` is None.

    Args:
        beta: the profile's growth of a request's own work per other request in flight, or None.
        arrival_s, end_s: each request's arrival and forecast end, seconds.
        own_s: each request's own work on the TTFT path, seconds (>= 0)."""
    own = np.asarray(own_s, dtype=float)
    if beta is None:
        return np.zeros(own.size)
    return beta * in_flight_at_arrival(arrival_s, end_s) * own
