"""Overload: a deployment whose arrivals outpace one of its roles has no TTFT to forecast, only a
queue that grows for as long as the load lasts (docs/planner/load.md). The planner names it, with
the role and the factor ("overloaded: P at 3.40x its capacity", "overloaded: P saturated: p90 TTFT
past 10x the SLO"), and prints no TTFT and no speed-up for it. This module is the one rule; ``plan``,
the ledger, the fleet search, the load curve, the recommendation, the store and the Plan page all
read its verdict.

The horizon (first to last arrival) is cut into equal **windows sized to the sessions' activity**
(:func:`window_count`: the median multi-turn session's span, first arrival to last recorded end, at least
:data:`WINDOWS` and at most :data:`MAX_WINDOWS` windows): a queue that grows through the time a
session is active is one the session feels, however long the horizon. A role is overloaded when,
over any window, the work its busiest server is asked for exceeds that window's length
(utilisation above 1: its queue grew through a whole window; each request's work counted over the
time from its arrival on, as if it started then), or when a request's forecast wait is longer than
a window (it waited through a whole window):

* **P** (prefill, or the aggregated worker): work = each request's compute on its worker
  (``c(n) - c(cached)``, seconds: :meth:`planner.profile.CostProfile.prefill_compute_s`),
  per compute server (a worker, or the workers that share
  cores: :mod:`planner.queueing`);
* **D** (decode, P/D modes with D's KV space modelled): work = the KV blocks a request holds times
  its decode time, plus (bidirectional modes) the blocks D keeps pinned for sessions' next turns
  over the window, against D's KV space (all D workers' blocks) times the window: KV space is what
  D's admission queue waits for (:mod:`planner.decode_admission`).

With an SLO on p90 TTFT, a deployment whose forecast p90 TTFT is past :data:`SATURATION` times the
SLO is **saturated** (:func:`saturated`): the role its slow requests wait on longer is named and no
TTFT is printed (a p90 ten times the target is a queue, not a latency to tune).

The utilisation test is the textbook stability condition of a queue (rho < 1, e.g. L. Kleinrock,
"Queueing Systems, Vol. 1", 1975, ch. 1), applied per window so that a load ramping up, peaking
and draining (sessions drawn over a finite horizon) is judged at its peak, not on its average.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from core.contract import Role

#: The fewest equal windows the horizon is cut into (a window is at most an eighth of it).
WINDOWS = 8
#: The most windows (a window is at least 1/256 of the horizon: the per-window sums stay small).
MAX_WINDOWS = 256
#: A forecast p90 TTFT past this many times the SLO is saturated (:func:`saturated`).
SATURATION = 10.0
_SHORT = {Role.PREFILL: "P", Role.DECODE: "D", Role.AGGREGATED: "the aggregated worker"}


@dataclass(frozen=True)
class Overload:
    """An overloaded role: ``role``, ``factor`` (work asked for over capacity in its busiest window, >
    1; NaN when the wait-past-a-window test or the saturation test found it) and ``why`` (the words)."""

    role: str
    factor: float
    why: str

    def text(self) -> str:
        """E.g. "overloaded: P at 3.4x its capacity"."""
        return f"overloaded: {self.why}"


def _grows(role: str, window: float) -> str:
    """The words of a wait past a window (no latency printed: the queue has none to give)."""
    return f"{_SHORT[role]}'s queue grows faster than it drains (a request waited past a {_span(window)} window)"


def _span(s: float) -> str:
    return f"{s / 3600:,.3g} h" if s >= 7200 else f"{s / 60:,.3g} min" if s >= 120 else f"{s:,.3g} s"


class QueueGrows(Exception):
    """A forecast stopped because a request waited longer than ``limit_s`` (one window,
    :func:`window_s`) on ``role``: the deployment is overloaded (:func:`never_drains`' test, found
    before the rest of the traffic is forecast). ``wait_s``: that request's wait, seconds."""

    def __init__(self, role: str, wait_s: float, limit_s: float):
        super().__init__(f"{role}: a request waited {wait_s:,.0f} s, longer than {limit_s:,.0f} s")
        self.role, self.wait_s, self.limit_s = role, wait_s, limit_s

    def overload(self) -> Overload:
        """The overload it found, in the words of :func:`never_drains`."""
        return Overload(self.role, float("nan"), _grows(self.role, self.limit_s) + "; the forecast stopped there")


def window_count(arrival_s: np.ndarray, session_code: np.ndarray | None = None,
                 end_s: np.ndarray | None = None) -> int:
    """How many equal windows the horizon (first to last arrival) is cut into: the horizon over the
    median span of the sessions of two or more requests (a session's first arrival to its last
    ``end_s``, seconds; sessions by ``session_code``), rounded up, within [:data:`WINDOWS`,
    :data:`MAX_WINDOWS`]; :data:`WINDOWS` without such sessions or a horizon."""
    if session_code is None or len(arrival_s) < 2:
        return WINDOWS
    horizon = float(arrival_s.max() - arrival_s.min())
    codes, inv, counts = np.unique(session_code, return_inverse=True, return_counts=True)
    first = np.full(len(codes), np.inf)
    last = np.full(len(codes), -np.inf)
    np.minimum.at(first, inv, arrival_s)
    np.maximum.at(last, inv, arrival_s if end_s is None else np.maximum(end_s, arrival_s))
    turns = counts >= 2   # a session of one request has no activity to size a window by
    span = float(np.median((last - first)[turns])) if turns.any() else 0.0
    if horizon <= 0 or span <= 0:
        return WINDOWS
    return int(min(MAX_WINDOWS, max(WINDOWS, math.ceil(horizon / span))))


def window_s(arrival_s: np.ndarray, windows: int = WINDOWS) -> float:
    """The length of one window: the horizon (first to last arrival) over ``windows``, seconds."""
    return float(arrival_s.max() - arrival_s.min()) / windows if len(arrival_s) else 0.0


def _x(factor: float) -> str:
    """A factor as printed: two decimals below 10 (1.02x, 3.40x), one above (15.6x)."""
    return f"{factor:.2f}x" if factor < 10 else f"{factor:,.1f}x"


def _edges(arrival_s: np.ndarray, windows: int) -> np.ndarray | None:
    """The window edges over the traffic's horizon (first to last arrival), or None when it has none."""
    if len(arrival_s) == 0:
        return None
    t0, t1 = float(arrival_s.min()), float(arrival_s.max())
    return None if t1 <= t0 else np.linspace(t0, t1, windows + 1)


def demand_per_window(edges: np.ndarray, start_s: np.ndarray, duration_s: np.ndarray,
                      weight: np.ndarray) -> np.ndarray:
    """Per request and window, ``weight`` x the seconds of ``[start_s, start_s + duration_s]`` that lie
    in the window: an array of shape (requests, windows)."""
    lo, hi = edges[:-1][None, :], edges[1:][None, :]
    s = start_s[:, None]
    e = s + duration_s[:, None]
    return np.clip(np.minimum(e, hi) - np.maximum(s, lo), 0.0, None) * weight[:, None]


def window_utilisation(arrival_s: np.ndarray, work_s: np.ndarray, server: np.ndarray, windows: int = WINDOWS) -> float:
    """The busiest (server, window) utilisation: the compute each request demands (``work_s``
    seconds, from its arrival on, as if it started then) that falls in a window, summed per server,
    over the window's length; 0 for an empty traffic or a horizon of 0 s (a single burst: judged by
    the TTFT test alone). Above 1: the server was asked for more work in that window than it has."""
    edges = _edges(arrival_s, windows)
    if edges is None:
        return 0.0
    demand = demand_per_window(edges, arrival_s, work_s, np.ones(len(arrival_s)))
    labels, srv = np.unique(server, return_inverse=True)
    per = np.zeros((len(labels), windows))
    np.add.at(per, srv, demand)
    return float(per.max() / (edges[1] - edges[0]))


def prefill_overload(arrival_s: np.ndarray, compute_s: np.ndarray, server: np.ndarray,
                     role: str = Role.PREFILL, windows: int = WINDOWS) -> Overload | None:
    """P (or the aggregated worker) overloaded by utilisation above 1 over ``windows`` windows (see
    the module doc), or None."""
    u = window_utilisation(arrival_s, compute_s, server, windows)
    if u <= 1.0 + 1e-9:
        return None
    return Overload(role, u, f"{_SHORT[role]} at {_x(u)} its capacity")


def held_per_window(t0_s: float, t1_s: float, held_t_s: np.ndarray, held_blocks: np.ndarray,
                    windows: int = WINDOWS) -> np.ndarray:
    """Block-seconds a step function (``held_blocks`` from each ``held_t_s`` on, ascending) holds in
    each of ``windows`` equal windows of ``[t0_s, t1_s]``; zeros when it is empty."""
    out = np.zeros(windows)
    if held_t_s.size == 0 or t1_s <= t0_s:
        return out
    edges = np.linspace(t0_s, t1_s, windows + 1)
    t = np.concatenate((held_t_s, [max(t1_s, float(held_t_s[-1]))]))
    area = np.concatenate(([0.0], np.cumsum(held_blocks * np.diff(t))))   # integral up to each t
    cum = np.interp(edges, t, area, left=0.0)
    return np.diff(cum)


def decode_overload(arrival_s: np.ndarray, need_blocks: np.ndarray, hold_s: np.ndarray, capacity_blocks: float,
                    held_t_s: np.ndarray | None = None, held_blocks: np.ndarray | None = None,
                    windows: int = WINDOWS) -> Overload | None:
    """D overloaded by KV space over ``windows`` windows (see the module doc), or None (also when
    D's space is 0 blocks). ``held_t_s``/``held_blocks``: D's pinned blocks over time
    (bidirectional modes: the turns it keeps), counted in each window next to the running requests."""
    edges = _edges(arrival_s, windows)
    if capacity_blocks <= 0 or edges is None:
        return None
    running = demand_per_window(edges, arrival_s, np.asarray(hold_s, dtype=float),
                                np.asarray(need_blocks, dtype=float)).sum(axis=0)
    pinned = np.zeros(windows)
    if held_t_s is not None and held_blocks is not None:
        pinned = held_per_window(float(edges[0]), float(edges[-1]), np.asarray(held_t_s, dtype=float),
                                 np.asarray(held_blocks, dtype=float), windows)
    u = float(((running + pinned) / (capacity_blocks * (edges[1] - edges[0]))).max())
    if u <= 1.0 + 1e-9:
        return None
    what = "its KV space (running requests and pinned turns)" if pinned.any() else "its KV space"
    return Overload(Role.DECODE, u, f"D at {_x(u)} {what}")


def never_drains(arrival_s: np.ndarray, ttft_s: np.ndarray, queue_wait_s: np.ndarray,
                 decode_wait_s: np.ndarray, role: str = Role.PREFILL, windows: int = WINDOWS) -> Overload | None:
    """Overloaded when a request waited (for its prefill worker plus on D) longer than a window (the
    horizon over ``windows``: the queue grew through a whole window); the role it waited on longer
    is named. None otherwise."""
    if len(arrival_s) < 2:
        return None
    window = float(arrival_s.max() - arrival_s.min()) / windows
    d_wait = decode_wait_s if decode_wait_s.size else np.zeros(len(arrival_s))
    waits = queue_wait_s + d_wait
    worst = int(np.argmax(waits))
    if window <= 0 or float(waits[worst]) <= window:
        return None
    on = Role.DECODE if float(d_wait[worst]) > float(queue_wait_s[worst]) else role
    return Overload(on, float("nan"), _grows(on, window))


def saturated(ttft_s: np.ndarray, queue_wait_s: np.ndarray, decode_wait_s: np.ndarray, slo_s: float | None,
              role: str = Role.PREFILL) -> Overload | None:
    """Saturated when the p90 of ``ttft_s`` (seconds) is past :data:`SATURATION` x ``slo_s`` (None:
    no SLO, never); the role named is the one the requests at or above the p90 waited on longer
    (``queue_wait_s``: for P, or ``role``; ``decode_wait_s``: on D). None otherwise."""
    if slo_s is None or len(ttft_s) == 0:
        return None
    p90 = float(np.quantile(ttft_s, 0.9))
    if not p90 > SATURATION * slo_s:
        return None
    tail = ttft_s >= p90
    d_wait = decode_wait_s if decode_wait_s.size else np.zeros(len(ttft_s))
    on = Role.DECODE if float(d_wait[tail].mean()) > float(queue_wait_s[tail].mean()) else role
    return Overload(on, float("nan"), f"{_SHORT[on]} saturated: p90 TTFT past {SATURATION:g}x the SLO")


def first_overload(*found: Overload | None) -> Overload | None:
    """The worst of the overloads found (highest factor; one without a factor last), or None."""
    real = [o for o in found if o is not None]
    if not real:
        return None
    return max(real, key=lambda o: -1.0 if np.isnan(o.factor) else o.factor)
