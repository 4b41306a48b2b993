"""Queueing of prefills on a worker: each prefill (or aggregated) worker is one server that computes
the prompts routed to it one after another, first come first served.

Why: a vLLM engine schedules waiting requests FIFO (``vllm/v1/core/sched/scheduler.py``, the
``waiting`` queue under the default ``fcfs`` policy) and, on the embedded CPU default, one prefill
fills a step (prompts of 1-4k tokens against ``max_num_batched_tokens``), so a request that arrives
while another prompt is being computed waits for it. Decode steps of running requests are batched
with the new prompt's tokens (continuous batching) and do not hold it back here (docs/planner.md,
"Queueing", says what that leaves out).

The recursion is Lindley's (D. V. Lindley, "The theory of queues with a single server", 1952):
``start_i = max(arrival_i, start_{i-1} + service_{i-1})``, solved without a loop per worker as
``finish_i = S_i + max_{j <= i}(arrival_j - S_{j-1})`` with ``S`` the running sum of service times.
"""

from __future__ import annotations

import numpy as np


def fifo_waits(arrival_s: np.ndarray, service_s: np.ndarray, worker: np.ndarray) -> np.ndarray:
    """Seconds each request waits before its worker starts it, FIFO per worker.

    Args:
        arrival_s: when each request reaches its worker's queue, seconds, sorted ascending (ties:
            the order given is the service order).
        service_s: seconds of the worker's time each request takes (>= 0).
        worker: the worker (any integer label) each request is routed to.

    Returns: an array of waits (>= 0), one per request, in the input order.

    Raises ValueError for arrays of different lengths or arrivals out of order."""
    arrival = np.asarray(arrival_s, dtype=float)
    service = np.asarray(service_s, dtype=float)
    worker = np.asarray(worker)
    if not (len(arrival) == len(service) == len(worker)):
        raise ValueError(f"arrival_s, service_s and worker differ in length ({len(arrival)}, {len(service)}, "
                         f"{len(worker)})")
    if len(arrival) > 1 and bool(np.any(np.diff(arrival) < 0)):
        raise ValueError("arrival_s must be sorted ascending")
    waits = np.zeros(len(arrival))
    labels = np.unique(worker)
    groups = [np.arange(len(arrival))] if len(labels) <= 1 else [np.flatnonzero(worker == w) for w in labels]
    for idx in groups:
        a, s = arrival[idx], service[idx]
        done = np.cumsum(s)
        before = done - s                            # S_{i-1}
        start = before + np.maximum.accumulate(a - before)
        waits[idx] = np.maximum(start - a, 0.0)      # rounding can leave -1e-16
    return waits
