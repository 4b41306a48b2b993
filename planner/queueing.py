"""Queueing of prefills on a worker: each prefill (or aggregated) worker is one server that computes
the prompts routed to it one after another, first come first served.

Why: a vLLM engine schedules waiting requests FIFO (``vllm/v1/core/sched/scheduler.py``, the
``waiting`` queue under the default ``fcfs`` policy) and, on the embedded CPU default, one prefill
fills a step (prompts of 1-4k tokens against ``max_num_batched_tokens``), so a request that arrives
while another prompt is being computed waits for it. Decode steps of running requests are batched
with the new prompt's tokens (continuous batching) and do not hold it back here
(docs/planner/simulation.md says what that leaves out).

The recursion is Lindley's (D. V. Lindley, "The theory of queues with a single server", 1952):
``start_i = max(arrival_i, start_{i-1} + service_{i-1})``, solved without a loop per worker as
``finish_i = S_i + max_{j <= i}(arrival_j - S_{j-1})`` with ``S`` the running sum of service times.

Workers pinned to the same cores (``embedded-cpu-2p1d``'s two P on core 0) are separate engines on
one compute server: :func:`shared_core_waits` keeps each worker's queue FIFO and lets the busy ones
share the server equally (processor sharing).
"""

from __future__ import annotations

import itertools
import json
from collections import deque
from collections.abc import Sequence

import numpy as np

from store.queries import planner_runs
from store.writer import Store

#: vLLM 0.32's ``max_num_batched_tokens`` for an API server on the CPU platform
#: (``vllm/engine/arg_utils.py``, ``EngineArgs.get_batch_defaults``: 2,048 x world size), with
#: chunked prefill on: the token budget of the embedded workers' scheduler steps.
VLLM_CPU_MAX_NUM_BATCHED_TOKENS = 2048


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


def shared_core_waits(arrival_s: np.ndarray, service_s: np.ndarray, worker: np.ndarray,
                      server: np.ndarray) -> np.ndarray:
    """Seconds each request's prefill takes beyond its own compute when several workers share one
    compute server (CPU cores): each worker takes its requests first come first served (its own
    engine, as :func:`fifo_waits`), and the workers of one server that are computing at the same
    time share it equally (the operating system time-slices their processes: processor sharing,
    L. Kleinrock, "Time-shared systems: a theoretical treatment", J. ACM 14(2), 1967). A server with
    one worker gives :func:`fifo_waits`' waits.

    Args:
        arrival_s: when each request reaches its worker's queue, seconds, sorted ascending (ties:
            the order given is the service order).
        service_s: seconds of the server's time each request takes alone (>= 0).
        worker: the worker (any integer label) each request is routed to.
        server: the server (any integer label) of each request's worker; one worker has one server.

    Returns: an array (>= 0, one per request, in the input order) of ``finish - arrival -
    service``: the wait for the requests before it on its worker plus the slowdown of sharing.

    Raises ValueError for arrays of different lengths, arrivals out of order, or a worker on two
    servers."""
    arrival = np.asarray(arrival_s, dtype=float)
    service = np.asarray(service_s, dtype=float)
    worker, server = np.asarray(worker), np.asarray(server)
    if not (len(arrival) == len(service) == len(worker) == len(server)):
        raise ValueError(f"arrival_s, service_s, worker and server differ in length ({len(arrival)}, "
                         f"{len(service)}, {len(worker)}, {len(server)})")
    if len(arrival) > 1 and bool(np.any(np.diff(arrival) < 0)):
        raise ValueError("arrival_s must be sorted ascending")
    pairs = {(w, s) for w, s in zip(worker.tolist(), server.tolist())}
    if len({w for w, _ in pairs}) != len(pairs):
        raise ValueError("a worker is on more than one server")
    waits = np.zeros(len(arrival))
    for label in np.unique(server):
        idx = np.flatnonzero(server == label)
        if len(np.unique(worker[idx])) == 1:
            waits[idx] = fifo_waits(arrival[idx], service[idx], worker[idx])
        else:
            finish = _processor_sharing_finish(arrival[idx], service[idx], worker[idx])
            waits[idx] = np.maximum(finish - arrival[idx] - service[idx], 0.0)
    return waits


def _processor_sharing_finish(arrival: np.ndarray, service: np.ndarray, worker: np.ndarray) -> np.ndarray:
    """Finish times of one server's requests: per worker FIFO, the heads of the busy workers
    sharing the server equally (an event simulation: at each arrival or completion)."""
    finish = np.zeros(len(arrival))
    remaining = service.astype(float).copy()
    queues: dict[int, deque] = {}
    t, nxt, n = 0.0, 0, len(arrival)
    while nxt < n or any(queues.values()):
        heads = [q[0] for q in queues.values() if q]
        if not heads:
            t = arrival[nxt]
        else:
            share = len(heads)
            step = min(remaining[h] for h in heads) * share
            if nxt < n and arrival[nxt] < t + step:
                step = arrival[nxt] - t
            for h in heads:
                remaining[h] -= step / share
            t += step
        while nxt < n and arrival[nxt] <= t:
            queues.setdefault(int(worker[nxt]), deque()).append(nxt)
            nxt += 1
        for q in queues.values():    # the heads done by now (those of no compute at once) end at t
            while q and remaining[q[0]] <= 1e-12:
                finish[q.popleft()] = t
    return finish


def batched_step_waits(arrival_s: np.ndarray, start_tokens: np.ndarray, end_tokens: np.ndarray, a1_s: float,
                       a2_s: float, budget_tokens: int, worker: np.ndarray) -> np.ndarray:
    """Seconds each request's first token comes later than its own compute alone would give, on a
    worker whose engine runs prompts in **scheduler steps** of at most ``budget_tokens`` tokens.

    vLLM's scheduler (``vllm/v1/core/sched/scheduler.py``, ``Scheduler.schedule``) builds each step
    from its running requests first (a prompt partly computed in earlier steps takes what is left of
    it, up to the budget: chunked prefill), then from its ``waiting`` queue first come first served,
    each taking what the budget leaves (``max_num_batched_tokens``: vLLM 0.32's default for an API
    server is 2,048 on CPU and 8,192 on GPUs of 70 GiB or more, ``EngineArgs.get_batch_defaults``;
    ``long_prefill_token_threshold`` 0 by default: no cap per request). A step is not interrupted: a
    request that arrives during one joins the next. A step costs what its chunks cost, a chunk of
    tokens ``[p, p + k)`` of a prompt ``c(p + k) - c(p)`` with ``c(x) = a1 x + a2 x^2`` (the
    planner's cost model), and every prompt the step completes gets its first token at the step's
    end. So requests that arrive together all wait for the whole step, where a FIFO server
    (:func:`fifo_waits`) ends the first at its own cost. Decode steps of running requests (the
    aggregated worker) and ``max_num_seqs`` are not modelled.

    The server works whenever work is waiting in both models, so a request that finds its worker
    idle and is alone until it ends has no wait in either; only the busy periods of two or more
    requests are stepped through.

    Args:
        arrival_s: when each request reaches its worker's queue, seconds, sorted ascending.
        start_tokens, end_tokens: each request computes its prompt's tokens ``[start, end)`` (start:
            its cached tokens), tokens.
        a1_s, a2_s: c(x)'s coefficients, seconds per token and per token squared.
        budget_tokens: ``max_num_batched_tokens`` (> 0).
        worker: the worker (any integer label) each request is routed to.

    Returns: ``finish - arrival - c(end) + c(start)`` per request (>= 0), seconds, in the input order.

    Raises ValueError for arrays of different lengths, arrivals out of order or a budget below 1."""
    arrival = np.asarray(arrival_s, dtype=float)
    start = np.asarray(start_tokens, dtype=np.int64)
    end = np.maximum(np.asarray(end_tokens, dtype=np.int64), start)
    worker = np.asarray(worker)
    if not (len(arrival) == len(start) == len(end) == len(worker)):
        raise ValueError(f"arrival_s, start_tokens, end_tokens and worker differ in length ({len(arrival)}, "
                         f"{len(start)}, {len(end)}, {len(worker)})")
    if len(arrival) > 1 and bool(np.any(np.diff(arrival) < 0)):
        raise ValueError("arrival_s must be sorted ascending")
    if budget_tokens < 1:
        raise ValueError(f"budget_tokens must be at least 1, got {budget_tokens}")
    own = a1_s * (end - start) + a2_s * (end.astype(float) ** 2 - start.astype(float) ** 2)
    waits = fifo_waits(arrival, own, worker)
    labels = np.unique(worker)
    groups = [np.arange(len(arrival))] if len(labels) <= 1 else [np.flatnonzero(worker == w) for w in labels]
    for idx in groups:
        a = arrival[idx]
        finish_fifo = a + waits[idx] + own[idx]
        # a busy period starts at a request that finds the worker idle (FIFO and steps alike)
        new = np.ones(len(idx), dtype=bool)
        new[1:] = a[1:] >= finish_fifo[:-1]
        bounds = np.append(np.flatnonzero(new), len(idx))
        for lo, hi in itertools.pairwise(bounds):
            if hi - lo < 2:
                continue
            rows = idx[lo:hi]
            finish = _stepped_finish(arrival[rows].tolist(), start[rows].tolist(), end[rows].tolist(),
                                     a1_s, a2_s, int(budget_tokens))
            waits[rows] = np.maximum(np.asarray(finish) - arrival[rows] - own[rows], 0.0)
    return waits


def _stepped_finish(arrival: list[float], start: list[int], end: list[int], a1: float, a2: float,
                    budget: int) -> list[float]:
    """Finish times of one busy period's requests (arrival order) under :func:`batched_step_waits`'
    steps."""
    n = len(arrival)
    finish = [0.0] * n
    pos = list(start)
    running: list[int] = []
    waiting: deque[int] = deque()
    t, nxt = arrival[0], 0
    while nxt < n or running or waiting:
        while nxt < n and arrival[nxt] <= t:
            waiting.append(nxt)
            nxt += 1
        if not running and not waiting:
            t = arrival[nxt]
            continue
        left, step = budget, 0.0
        chunks: list[tuple[int, int]] = []
        for r in running:
            if left <= 0:
                break
            k = min(end[r] - pos[r], left)
            chunks.append((r, k))
            left -= k
        while waiting and left > 0:
            r = waiting.popleft()
            running.append(r)
            k = min(end[r] - pos[r], left)
            chunks.append((r, k))
            left -= k
        for r, k in chunks:
            p = pos[r]
            step += a1 * k + a2 * ((p + k) * (p + k) - p * p)
            pos[r] = p + k
        t += step
        still = []
        for r in running:
            if pos[r] >= end[r]:
                finish[r] = t
            else:
                still.append(r)
        running = still
    return finish


def engine_token_budget(store: Store, run_ids: Sequence[str]) -> tuple[int, str] | None:
    """The prefill workers' ``max_num_batched_tokens`` in ``run_ids`` and how it is known, from
    ``runs.config.topology``: the prefill role's ``--max-num-batched-tokens`` argument, else vLLM's
    default on the CPU platform (:data:`VLLM_CPU_MAX_NUM_BATCHED_TOKENS`);
    None when the runs disagree or ran on GPUs without the argument (vLLM's default there depends on
    the GPU's memory, which the store does not record)."""
    rows = planner_runs.prefill_args(store, run_ids)
    found = set()
    for platform, args in zip(rows["platform"], rows["args"], strict=True):
        argv = [str(a) for a in (json.loads(args) if isinstance(args, str) else args or [])]
        given = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--max-num-batched-tokens"), None)
        given = next((a.split("=", 1)[1] for a in argv if a.startswith("--max-num-batched-tokens=")), given)
        if given is not None:
            found.add((int(given), "the prefill role's --max-num-batched-tokens (runs.config.topology)"))
        elif platform == "cpu":
            found.add((VLLM_CPU_MAX_NUM_BATCHED_TOKENS, ("vLLM 0.32's default on the CPU platform "
                       "(engine/arg_utils.py get_batch_defaults); the runs' topology sets none")))
        else:
            return None
    return found.pop() if len(found) == 1 else None
