"""Paced sends in one pass: each session's next request is placed after its forecast reply while the
forecast runs, in time order, instead of re-running whole forecasts until the sends stop moving.

Why: a client that waits for its reply sends its next turn ``gap_s`` after the reply ends
(:meth:`planner.simulate.Traffic.paced`), so the send depends on the forecast TTFT, and the TTFT
on the sends before it. :func:`planner.simulate.paced_mode_plan` settles that by re-making the
whole forecast on its own sends; each round moves the answer one more link down the chains of
turns that queue behind each other, so on long agent sessions it stops at its round limit still
moving (on the 24 shipped kv-cache-tester traces drawn to 49,334 requests every ``pd-nocache``
fleet stopped at 12 rounds). Here one pass over time gives the sends those rounds tend to:

* events in time order: a send (the request joins its prefill worker's queue), the end of a
  prefill worker's scheduler step, a request reaching D, D's own events (a running request's end);
  at one instant the sends go first (a request that arrives at a step's end joins the next step, as
  :func:`planner.queueing.batched_step_waits` has it);
* a prefill worker is first come first served (:func:`planner.queueing.fifo_waits`; ``fifo``) or
  runs scheduler steps of ``max_num_batched_tokens`` (:func:`planner.queueing.batched_step_waits`:
  running prompts first, then the waiting ones, a step not interrupted); a request alone on its
  worker is stepped in one event, split only when another arrives;
* D is :class:`planner.decode_admission.DecodeAdmission` (one-way P/D: running requests only);
* when request ``j``'s first token is known (P's finish plus its wait on D), its session's next
  paced request is sent at ``send_j + TTFT_j + decode_j + gap`` (the sum
  :meth:`planner.simulate.Traffic.paced_arrivals` makes).

Causality makes it exact: a send, a step and an admission depend only on what was sent before
them, and a reply ends after its send. It covers the modes whose cost does not depend on the
order of the sends (:func:`applies`: one-way P/D without P's prefix cache, the ledger's
``recompute``; no host contention, no prefill workers sharing cores); the caller checks the sends
against a whole forecast made at them (:func:`planner.simulate.paced_mode_plan`).

Units: seconds, tokens.
"""

from __future__ import annotations

import heapq
import math
from collections import deque

import numpy as np

from core.modes import serving_mode
from planner.decode_admission import DecodeAdmission


def applies(tr, profile, settings, mode: str) -> bool:
    """Whether :func:`paced_sends` covers ``mode`` on ``tr``: a one-way P/D mode without P's prefix
    cache (its costs do not depend on the order of the sends), no host contention in the profile,
    no prefill workers sharing compute (``settings.prefill_servers`` with a repeated label), no
    chat renders of a taken handle (none in a one-way mode)."""
    kind = serving_mode(mode)
    shared_cores = settings.prefill_servers is not None and len(set(settings.prefill_servers)) < len(
        settings.prefill_servers)
    return (kind.disaggregated and not kind.bidirectional and not kind.prefill_prefix_cache
            and profile.host_contention_per_request is None and not shared_cores)


class _Worker:
    """One prefill worker's scheduler steps (:func:`planner.queueing.batched_step_waits`' rules)."""

    __slots__ = ("chunks", "lone", "pos", "running", "step_end", "version", "waiting")

    def __init__(self):
        self.running: list[int] = []
        self.waiting: deque[int] = deque()
        self.chunks: list[tuple[int, int]] = []   # the current step's (request, tokens)
        self.step_end = -math.inf
        self.version = 0
        self.lone: tuple[int, float, list[float]] | None = None   # (request, start, step ends) alone
        self.pos: dict[int, int] = {}


def paced_sends(tr, settings, ttft0_s: np.ndarray, compute_s: np.ndarray, fifo: bool, a1_s: float, a2_s: float,
                budget_tokens: int | None, decode_s: np.ndarray, space) -> tuple[np.ndarray, np.ndarray]:
    """Each request's send and TTFT with paced sends, in one pass (see the module doc).

    Args:
        tr: the traffic (:class:`planner.simulate.Traffic`; ``arrival_s``: the recorded sends).
        settings: the plan's settings (workers, routing, ``queue_prefills``).
        ttft0_s: each request's TTFT before any wait, seconds (:class:`planner.simulate.ModeCost`).
        compute_s: each request's prefill worker time, seconds (FIFO's service time).
        fifo: first come first served on P (else scheduler steps of ``budget_tokens``).
        a1_s, a2_s: c(x)'s coefficients (the steps' cost), seconds per token and per token squared.
        budget_tokens: the engine's token budget per step (used when not ``fifo``).
        decode_s: the part of each reply after its first token, seconds
            (:meth:`planner.simulate.Traffic.reply_decode_s`).
        space: D's KV space (:class:`planner.decode_admission.DecodeSpace`) or None (no wait on D).

    Returns: (sends, TTFTs), seconds, in ``tr``'s order."""
    n = len(tr)
    prev, paced = tr.previous(), tr.paced()
    nxt = np.full(n, -1)
    nxt[prev[prev >= 0]] = np.flatnonzero(prev >= 0)
    nxt_l, paced_l = nxt.tolist(), paced.tolist()
    gap, dec = tr.gap_s.tolist(), np.asarray(decode_s, float).tolist()
    ttft0, comp = np.asarray(ttft0_s, float).tolist(), np.asarray(compute_s, float).tolist()
    tokens, codes = tr.input_tokens.tolist(), tr.session_code.tolist()
    session, index = tr.session.tolist(), tr.request_index.tolist()
    send = tr.arrival_s.astype(float).tolist()
    ttft = [math.nan] * n
    own = [a1_s * k + a2_s * (k * k) for k in tokens]
    workers = settings.prefill_workers
    by_session = settings.routing == "session"
    queue = settings.queue_prefills
    sends = [(send[i], session[i], index[i], i) for i in range(n) if not paced_l[i]]
    heapq.heapify(sends)
    steps: list[tuple[float, int, int]] = []      # (step end, worker, version)
    at_d: list[tuple[float, int]] = []            # (arrival at D, request)
    free_at = [-math.inf] * workers
    ws = [_Worker() for _ in range(workers)]
    d = None if space is None else DecodeAdmission(space.capacity_blocks)
    pending: deque[int] = deque()                 # reached D, not yet admitted (in order of arrival at D)
    code_of: dict[int, int] = {}
    count = 0
    inf = math.inf

    def first_token(j: int, p_ttft: float, d_wait: float) -> None:
        t = p_ttft + d_wait
        ttft[j] = t
        k = nxt_l[j]
        if k >= 0 and paced_l[k]:
            send[k] = send[j] + (t + dec[j]) + gap[k]
            heapq.heappush(sends, (send[k], session[k], index[k], k))

    p_ttft = [0.0] * n

    def reached_p_end(j: int, wait: float) -> None:
        p_ttft[j] = ttft0[j] + wait
        if d is None:
            first_token(j, p_ttft[j], 0.0)
        else:
            heapq.heappush(at_d, (send[j] + p_ttft[j], j))

    def form_step(w: int, t: float) -> None:
        wk = ws[w]
        left, step, chunks = budget_tokens, 0.0, []
        for r in wk.running:
            if left <= 0:
                break
            k = min(tokens[r] - wk.pos[r], left)
            chunks.append((r, k))
            left -= k
        while wk.waiting and left > 0:
            r = wk.waiting.popleft()
            wk.running.append(r)
            k = min(tokens[r] - wk.pos[r], left)
            chunks.append((r, k))
            left -= k
        if not chunks:
            return
        if len(wk.running) == 1 and not wk.waiting:   # alone: its steps in one event, split if another comes
            r = wk.running[0]
            ends, p, tt = [], wk.pos[r], t
            while p < tokens[r]:
                k = min(tokens[r] - p, budget_tokens)
                tt += a1_s * k + a2_s * ((p + k) * (p + k) - p * p)
                p += k
                ends.append(tt)
            wk.lone = (r, t, ends)
            wk.chunks = []
            wk.step_end = ends[-1]
        else:
            for r, k in chunks:
                p = wk.pos[r]
                step += a1_s * k + a2_s * ((p + k) * (p + k) - p * p)
            wk.chunks = chunks
            wk.lone = None
            wk.step_end = t + step
        wk.version += 1
        heapq.heappush(steps, (wk.step_end, w, wk.version))

    def split_lone(w: int, t: float) -> None:
        """A request joins worker ``w`` at ``t`` while one runs alone: that one's steps up to the
        first step end at or after ``t`` are done; the next step is formed there."""
        wk = ws[w]
        r, _start, ends = wk.lone
        k = next(x for x, e in enumerate(ends) if e >= t)
        wk.pos[r] = min(wk.pos[r] + (k + 1) * budget_tokens, tokens[r])
        wk.lone, wk.chunks = None, []
        wk.step_end = ends[k]
        wk.version += 1
        if wk.pos[r] >= tokens[r]:
            wk.running.remove(r)
            del wk.pos[r]
            finished_on_p(r, ends[k])
        heapq.heappush(steps, (ends[k], w, wk.version))

    def finished_on_p(r: int, t: float) -> None:
        reached_p_end(r, max(t - send[r] - own[r], 0.0))

    while True:
        t_send = sends[0][0] if sends else inf
        t_step = steps[0][0] if steps else inf
        t_d = at_d[0][0] if at_d else inf
        t_tick = d.next_event_s() if d is not None and pending else inf
        t = min(t_send, t_step, t_d, t_tick)
        if t == inf:
            if d is None or not pending:
                break
            d.close()   # a head nothing will make room for is admitted when nothing else can change
            _admitted(d, pending, p_ttft, first_token)
            continue
        if t_send <= t:
            _, _, _, i = heapq.heappop(sends)
            code = code_of.setdefault(codes[i], len(code_of))
            w = code % workers if by_session else count % workers
            count += 1
            if not queue:
                reached_p_end(i, 0.0)
            elif fifo:
                start = max(t, free_at[w])
                free_at[w] = start + comp[i]
                reached_p_end(i, start - t)
            else:
                wk = ws[w]
                wk.pos[i] = 0
                wk.waiting.append(i)
                if wk.lone is not None:
                    split_lone(w, t)
                elif not wk.running and len(wk.waiting) == 1 and wk.step_end <= t:
                    wk.version += 1   # idle: a step starts now, after every send of this instant
                    wk.step_end = t
                    heapq.heappush(steps, (t, w, wk.version))
        elif t_step <= t:
            end, w, version = heapq.heappop(steps)
            wk = ws[w]
            if version != wk.version:
                continue
            if wk.lone is not None:   # the request alone ran to its end
                r = wk.lone[0]
                wk.lone = None
                wk.running.remove(r)
                del wk.pos[r]
                finished_on_p(r, end)
            else:
                for r, k in wk.chunks:
                    wk.pos[r] += k
                still = []
                for r in wk.running:
                    if wk.pos[r] >= tokens[r]:
                        del wk.pos[r]
                        finished_on_p(r, end)
                    else:
                        still.append(r)
                wk.running = still
                wk.chunks = []
            form_step(w, end)
        elif t_d <= t:
            _, j = heapq.heappop(at_d)
            d.arrive(j, t, space.need_blocks[j], space.hold_s[j])
            pending.append(j)
            d.advance(t)
            _admitted(d, pending, p_ttft, first_token)
        else:
            d.advance(t)
            _admitted(d, pending, p_ttft, first_token)
    return np.asarray(send), np.asarray(ttft)


def _admitted(d: DecodeAdmission, pending: deque, p_ttft: list[float], first_token) -> None:
    while pending and pending[0] in d.wait_s:
        j = pending.popleft()
        first_token(j, p_ttft[j], d.wait_s[j])
