"""The ledger of KV retention strategies on one traffic (a FORECAST): where each strategy holds a
session's KV between its turns, for how long, what it saves and what it costs.

Five strategies, forecast with the planner's rules and profile (:mod:`planner.simulate`):

* ``recompute`` (``pd-nocache``): P's prefix cache off; every prompt computed in full;
* ``pd``: P's prefix cache in GPU memory (an LRU of sessions' last prompts per P worker);
* ``pd+host``: P's prefix cache backed by a host-memory tier (vLLM's ``OffloadingConnector``, CPU
  offload: KV written to host DRAM, read back over the host link). The tier is inclusive: every
  prompt P computed is also stored there, an LRU of ``host_kv_space_bytes`` per P worker. A request
  whose prefix is in P's GPU cache reads nothing; one whose prefix was evicted from GPU but is
  still in host memory reads the tokens beyond its GPU hit back, ``host_read_latency_s +
  tokens x kv_bytes_per_token / host_read_bandwidth_bytes_per_s`` seconds on the TTFT path (vLLM
  loads them whatever their cost: there is no recompute threshold on that path);
* ``pd-bidir``: D keeps each finished turn's KV pinned for the next turn (bidirectional transfer),
  P's prefix cache on;
* ``pd-bidir+host``: ``pd-bidir`` with P's prefix cache backed by the host tier (NixlConnector and
  OffloadingConnector under vLLM's ``MultiConnector``): P's hit counts GPU and host, D's handle
  covers the rest.

Per strategy (one row of :func:`ledger`): hit rate (later requests, ``request_index`` >= 1, that
reuse any tokens), TTFT p50 of the later requests (the planner's :class:`~planner.simulate.PrefillTtft` terms:
the profile's cost, the FIFO wait for P, chat renders, the wait on D for room in its KV space; plus the
host read), held GiB-seconds per tier (P's GPU prefix cache,
D's pinned KV, host memory), prefill GPU-seconds saved against ``recompute`` (the prefill worker's
time ``c(n) - c(cached)`` summed, times the profile's ``gpus_per_worker``), and, only with prices
the caller gives, the cost of the memory held per million saved prefill tokens. The host-tier
strategies are forecasts only: upstream's OffloadingConnector is GPU-only (CUDA streams and
kernels), so nothing here can measure it on the CPU default.

Costs (docs/planner/ledger.md); only what a strategy holds out of other
requests' reach is priced: D's pinned KV (never evicted) and the host tier. P's GPU prefix cache is
reported but not priced: vLLM evicts it whenever a running request needs the space::

    GPU memory $ = D pinned GiB-s / (gpu_memory_bytes / GiB) / 3600 x gpu_hour_usd
    host memory $ = host GiB-s / 3600 x host_gib_hour_usd
    saved prefill $ = prefill GPU-s saved / 3600 x gpu_hour_usd
    per M saved tokens = $ / (saved prefill tokens / 1e6)

Intervals (80%, :mod:`planner.intervals`, from the profile's held-out errors): the TTFTs
and the speed-up and TTFT saved against ``recompute`` from the TTFT ratios of the mode each strategy
is costed as; the reuse rate of the bidirectional strategies from the mode's D hit-rate error, as
far as D's reads can move it (:func:`~planner.intervals.reuse_rate_interval`); D's pinned
GiB-s from the same error moved into handles read or not read
(:func:`~planner.intervals.pinned_gib_s_interval`). No interval, and the reason in
``interval_note``, for the host-tier strategies (no host-tier run was ever checked), for ``pd``'s hit
rate (the held-out check measures D's hits only), and for the P-cache and host GiB-s (they follow
the traffic's prompts and the LRU's space, which no held-out check measures).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from functools import partial

import numpy as np
import pandas as pd

from core import reuse_rules as rules
from core.contract import HIT, Role
from planner import intervals
from planner.intervals import HandleReads
from planner.overload import Overload, QueueGrows
from planner.profile import CostProfile, GiB
from planner.simulate import (
    OUTCOMES,
    TOOK_HANDLE,
    ModeCost,
    ModePlan,
    PlanSettings,
    PrefillTtft,
    Traffic,
    finish_times,
    host_contention_s,
    mode_overload,
    one_way_decode,
    own_cache_hits,
    plan,
    simulate_bidir,
    workers_of,
)
from planner.strategies import BIDIR_STRATEGIES, HOST_STRATEGIES, RECOMPUTE, STRATEGIES
from planner.units import gpu_hours, memory_hours

#: Columns of :func:`ledger`.
LEDGER_COLUMNS = ("strategy", "mode", "later_requests", "hit_rate", "hit_rate_interval_low", "hit_rate_interval_high",
                  "reused_tokens", "host_read_tokens", "ttft_p50_later_s", "ttft_p50_later_interval_low_s",
                  "ttft_p50_later_interval_high_s", "ttft_mean_s", "ttft_mean_interval_low_s",
                  "ttft_mean_interval_high_s", "speedup_vs_recompute", "speedup_interval_low", "speedup_interval_high",
                  "ttft_saved_s", "ttft_saved_interval_low_s", "ttft_saved_interval_high_s", "p_cache_gib_s",
                  "d_pinned_gib_s", "d_pinned_interval_low_gib_s", "d_pinned_interval_high_gib_s", "host_gib_s",
                  "d_full_events", "prefill_gpu_s_saved", "gpu_memory_usd", "host_memory_usd",
                  "saved_prefill_usd", "memory_usd_per_m_saved_tokens", "net_usd_per_m_saved_tokens",
                  "interval_note", "overload", "overload_factor")


@dataclass(frozen=True)
class Prices:
    """What the user pays: ``gpu_hour_usd`` per GPU-hour, ``host_gib_hour_usd`` per GiB-hour of host
    memory. Either may be None (not given): the figures it prices are left out, never guessed."""

    gpu_hour_usd: float | None = None
    host_gib_hour_usd: float | None = None


@dataclass
class LruTier:
    """One worker-set's prefix cache as the planner models it (:func:`own_cache_hits`): hits per
    request and the bytes held after each request (``t`` seconds, ``b`` bytes, summed over workers)."""

    hits: np.ndarray
    t: np.ndarray
    b: np.ndarray

    def held_gib_s(self, end_s: float) -> float:
        """The integral of the held bytes up to ``end_s`` (the last held level lasts until then)."""
        if self.t.size == 0:
            return 0.0
        dt = np.diff(np.append(self.t, max(end_s, float(self.t[-1]))))
        return float(np.sum(self.b * dt) / GiB)


def lru_tier(tr: Traffic, capacity_tokens: int | None, block_size: int, workers: int, routing: str,
             kv_bytes_per_token: float, shared_prefix_tokens: int = 0) -> LruTier:
    """P's prefix cache of ``capacity_tokens`` per worker (None: unbounded) over ``tr``: its hits are
    :func:`planner.simulate.own_cache_hits`'s (the same call), and the bytes it holds are
    the same LRU's contents replayed (the sessions' last prompts, whole tokens, times
    ``kv_bytes_per_token``) after each request, at the request's arrival."""
    hits = own_cache_hits(tr, capacity_tokens, block_size, workers, routing, with_output=False,
                          shared_prefix_tokens=shared_prefix_tokens)
    caches = [OrderedDict() for _ in range(workers)]
    totals = np.zeros(workers, dtype=np.int64)
    held = np.zeros(len(tr))
    for i, w in enumerate(workers_of(tr, workers, routing)):
        s = int(tr.session_code[i])
        cache = caches[w]
        totals[w] -= cache.pop(s, 0)
        cache[s] = int(tr.input_tokens[i])
        totals[w] += cache[s]
        if capacity_tokens is not None:
            while totals[w] > capacity_tokens and cache:
                totals[w] -= cache.popitem(last=False)[1]
        held[i] = totals.sum() * kv_bytes_per_token
    return LruTier(hits, tr.arrival_s.astype(float), held)


def host_read_s(profile: CostProfile, tokens: np.ndarray) -> np.ndarray:
    """Seconds to read ``tokens`` tokens of KV back from the host tier (0 where tokens is 0).

    Raises ValueError when the profile has no host read bandwidth."""
    if profile.host_read_bandwidth_bytes_per_s is None:
        raise ValueError(f"profile {profile.name!r} has no host_read_bandwidth_bytes_per_s: the host-tier "
                         "strategies cannot be forecast")
    t = np.asarray(tokens, dtype=float)
    latency = profile.host_read_latency_s.value if profile.host_read_latency_s else 0.0
    return np.where(t > 0, latency + t * profile.kv_bytes_per_token.value
                    / profile.host_read_bandwidth_bytes_per_s.value, 0.0)


@dataclass
class StrategyForecast:
    """One strategy over the traffic: per request ``local`` (P's hit, GPU and host), ``host_read``
    (of which read from host memory), ``pulled`` (from D), ``ttft_s``; the tiers' GiB-seconds;
    ``reads``: what D's pinned GiB-s depend on (bidirectional strategies; else None); ``overload``
    (None: keeps up); ``stopped``: the forecast stopped at a queue found growing
    (``PlanSettings.stop_on_overload``): its TTFTs, pulls, D's GiB-s and compute are NaN or 0, only
    the overload and P's own cache are known."""

    strategy: str
    mode: str
    local: np.ndarray
    host_read: np.ndarray
    pulled: np.ndarray
    ttft_s: np.ndarray
    compute_s: np.ndarray
    p_cache_gib_s: float
    d_pinned_gib_s: float
    host_gib_s: float
    d_full_events: int
    reads: HandleReads | None = None
    queue_wait_s: np.ndarray | None = None
    decode_wait_s: np.ndarray | None = None
    overload: Overload | None = None
    stopped: bool = False


def handle_reads(tr: Traffic, profile: CostProfile, settings: PlanSettings, outcome: np.ndarray,
                 ages: np.ndarray, local: np.ndarray, pulled: np.ndarray) -> HandleReads:
    """The handles a bidirectional forecast read and took without reading (``outcome``: outcome
    names per request; ``ages``: a taken handle's age, s), each with b (d_ttl - a) GiB-s (0 for an
    unread handle D frees anyway, below the threshold), b the GiB of the handle it took: the session's previous request's (prompt + output - 1 tokens, whole
    blocks; the one a request can take, since an overlapping request takes none); ``local`` and
    ``pulled``: tokens per request from P's cache and from D."""
    block = settings.block_size or profile.block_size
    kv = rules.handle_kv_tokens(tr.input_tokens.astype(np.int64), tr.output_tokens.astype(np.int64))
    gib = rules.blocks_of(kv, block) * block * profile.kv_bytes_per_token.value / GiB
    prev = np.full(len(tr), -1)
    last: dict[int, int] = {}
    for i, s in enumerate(tr.session_code):
        prev[i] = last.get(int(s), -1)
        last[int(s)] = i
    hit = outcome == HIT
    unread = np.isin(outcome, TOOK_HANDLE) & ~hit
    s_gib_s = np.where(prev >= 0, gib[np.maximum(prev, 0)], 0.0) * (settings.decoder_kv_blocks_ttl_s
                                                                     - np.nan_to_num(ages))
    # an unread handle D frees anyway (below the threshold: rules.d_frees_taken_handle) holds nothing a
    # read would save
    freed_unread = unread & np.array([rules.d_frees_taken_handle(o) for o in outcome], dtype=bool)
    s_gib_s = np.where(freed_unread, 0.0, s_gib_s)

    def mean(mask: np.ndarray) -> float:
        return float(s_gib_s[mask].mean()) if mask.any() else 0.0

    later = tr.request_index >= 1
    d_only = int((later & (pulled > 0) & (local == 0)).sum())
    return HandleReads(int(later.sum()), int(hit.sum()), int(unread.sum()), mean(hit), mean(unread), d_only)


def _with_host(tr: Traffic, profile: CostProfile, settings: PlanSettings, gpu: LruTier) -> tuple[np.ndarray, np.ndarray, LruTier]:
    """P's hits with the host tier: (local hit, tokens of it read from host, the host LRU)."""
    if profile.host_kv_space_bytes is None:
        raise ValueError(f"profile {profile.name!r} has no host_kv_space_bytes: the host-tier strategies "
                         "cannot be forecast")
    block = settings.block_size or profile.block_size
    cap = int(profile.host_kv_space_bytes.value // profile.kv_bytes_per_token.value)
    host = lru_tier(tr, cap, block, settings.prefill_workers, settings.routing, profile.kv_bytes_per_token.value,
                    settings.shared_prefix_tokens)
    local = np.maximum(gpu.hits, host.hits)
    return local, local - gpu.hits, host


def forecast_strategy(tr: Traffic, profile: CostProfile, settings: PlanSettings, strategy: str,
                      gpu: LruTier | None = None) -> StrategyForecast:
    """Forecast one of :data:`STRATEGIES` (see the module doc). ``gpu``: P's GPU prefix cache when
    already computed. Raises ValueError for an unknown strategy or a host strategy on a profile
    without a host tier."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; strategies are {', '.join(STRATEGIES)}")
    mode = STRATEGIES[strategy]
    block = settings.block_size or profile.block_size
    finish = finish_times(tr, profile)
    end_s = float(finish.max())
    zeros = np.zeros(len(tr), dtype=np.int64)
    if strategy == RECOMPUTE:
        m: ModePlan = plan(tr, profile, settings.model_copy(update={"modes": (mode,)})).modes[mode]
        d_wait = m.decode_wait_s if m.decode_wait_s.size else np.zeros(len(tr))
        return StrategyForecast(strategy, mode, zeros, zeros, zeros, m.ttft_s,
                                profile.prefill_compute_s(mode, tr.input_tokens, zeros), 0.0, 0.0, 0.0, 0,
                                queue_wait_s=m.queue_wait_s, decode_wait_s=d_wait, overload=m.overload)
    if gpu is None:
        gpu = lru_tier(tr, profile.capacity_tokens(Role.PREFILL), block, settings.prefill_workers, settings.routing,
                       profile.kv_bytes_per_token.value, settings.shared_prefix_tokens)
    local, host_read, host = gpu.hits, zeros, None
    if strategy in HOST_STRATEGIES:
        local, host_read, host = _with_host(tr, profile, settings, gpu)
    pulled, d_gib_s, d_full, reads, held_t, held_b = zeros, 0.0, 0, None, None, None
    prefill = PrefillTtft(tr, settings, mode, StrategyCost(tr, profile, settings, mode,
                                                           None if host is None else host_read))
    if strategy in BIDIR_STRATEGIES:
        try:
            r = simulate_bidir(tr, profile, settings, local, finish, prefill)
        except QueueGrows as stop:   # settings.stop_on_overload: the rest would only say how long the queue grew
            nan = np.full(len(tr), np.nan)
            return StrategyForecast(strategy, mode, local, host_read, pulled, nan, nan, gpu.held_gib_s(end_s),
                                    float("nan"), 0.0 if host is None else host.held_gib_s(end_s), 0, None, nan, nan,
                                    stop.overload(), stopped=True)
        pulled, local, d_full, ttft = r.pulled, r.local, r.d_full, r.ttft_s
        p_wait, d_wait = r.queue_wait_s, r.decode_wait_s
        d_gib_s = r.pinned.held_gib_s()
        held_t, held_b = np.asarray(r.pinned.t), np.asarray(r.pinned.b)
        reads = handle_reads(tr, profile, settings, np.asarray(OUTCOMES, dtype=object)[r.outcome], r.ages, local,
                             pulled)
    else:
        ttft, p_wait = prefill.all(local, pulled, np.zeros(len(tr), dtype=bool))
        d_wait = one_way_decode(tr, profile, settings, ttft).wait_s
        ttft = ttft + d_wait
    contention = host_contention_s(tr, profile, finish, ttft, p_wait, d_wait)
    if contention.size:
        ttft = ttft + contention
    compute = profile.prefill_compute_s(mode, tr.input_tokens, local + pulled)
    overload = mode_overload(tr, profile, settings, mode, compute, prefill.server, ttft, p_wait, d_wait, held_t,
                             held_b)
    return StrategyForecast(strategy, mode, local, host_read, pulled, ttft, compute, gpu.held_gib_s(end_s), d_gib_s,
                            0.0 if host is None else host.held_gib_s(end_s), d_full, reads, p_wait, d_wait, overload)


@dataclass
class StrategyCost(ModeCost):
    """:class:`planner.simulate.ModeCost` plus the host tier's reads (``host_read``:
    tokens of each request read back from host memory, :func:`host_read_s`; None: no host tier)."""

    host_read: np.ndarray | None = None

    def __call__(self, rows: np.ndarray, local: np.ndarray, pulled: np.ndarray,
                 took: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ttft, compute = super().__call__(rows, local, pulled, took)
        if self.host_read is not None:
            ttft = ttft + host_read_s(self.profile, self.host_read[rows])
        return ttft, compute


def _usd_per_m(usd: float | None, tokens: int) -> float | None:
    return None if usd is None or tokens <= 0 else usd / (tokens / 1e6)


def ledger_row(f: StrategyForecast, base: StrategyForecast, tr: Traffic, profile: CostProfile,
               prices: Prices) -> dict:
    """One row of :func:`ledger` (columns :data:`LEDGER_COLUMNS`; money None where no price)."""
    later = tr.request_index >= 1
    reused = f.local + f.pulled
    gpus = profile.gpus_per_worker.value if profile.gpus_per_worker else 1.0
    saved_gpu_s = float((base.compute_s - f.compute_s).sum()) * gpus
    saved_tokens = int(reused.sum())
    gpu_gib_s = f.d_pinned_gib_s   # P's prefix cache is evictable: reported, not priced
    gpu_mem_usd = host_usd = saved_usd = None
    if prices.gpu_hour_usd is not None:
        saved_usd = saved_gpu_s / 3600 * prices.gpu_hour_usd
        if profile.gpu_memory_bytes is not None:
            gpu_mem_usd = gpu_gib_s / (profile.gpu_memory_bytes.value / GiB) / 3600 * prices.gpu_hour_usd
    if prices.host_gib_hour_usd is not None:
        host_usd = f.host_gib_s / 3600 * prices.host_gib_hour_usd
    memory_usd = None
    if gpu_mem_usd is not None and (host_usd is not None or f.host_gib_s == 0):
        memory_usd = gpu_mem_usd + (host_usd or 0.0)
    net = None if memory_usd is None or saved_usd is None else memory_usd - saved_usd
    hit_rate = float((reused[later] > 0).mean()) if later.any() and not f.stopped else np.nan
    # an overloaded deployment has no TTFT, and no speed-up is taken against one
    p50 = float(np.median(f.ttft_s[later])) if later.any() and f.overload is None else np.nan
    base_p50 = float(np.median(base.ttft_s[later])) if later.any() and base.overload is None else np.nan
    row = {"strategy": f.strategy, "mode": f.mode, "later_requests": int(later.sum()), "hit_rate": hit_rate,
           "reused_tokens": saved_tokens, "host_read_tokens": int(f.host_read.sum()), "ttft_p50_later_s": p50,
           "ttft_mean_s": float(f.ttft_s.mean()) if f.overload is None else np.nan,
           "speedup_vs_recompute": base_p50 / p50 if p50 > 0 else np.nan, "ttft_saved_s": base_p50 - p50,
           "p_cache_gib_s": f.p_cache_gib_s, "d_pinned_gib_s": f.d_pinned_gib_s, "host_gib_s": f.host_gib_s,
           "d_full_events": f.d_full_events, "prefill_gpu_s_saved": saved_gpu_s, "gpu_memory_usd": gpu_mem_usd,
           "host_memory_usd": host_usd, "saved_prefill_usd": saved_usd,
           "memory_usd_per_m_saved_tokens": _usd_per_m(memory_usd, saved_tokens),
           "net_usd_per_m_saved_tokens": _usd_per_m(net, saved_tokens),
           "overload": None if f.overload is None else f.overload.text(),
           "overload_factor": None if f.overload is None else f.overload.factor}
    return row | ledger_intervals(f, base, row, profile)


def ledger_intervals(f: StrategyForecast, base: StrategyForecast, row: dict, profile: CostProfile) -> dict:
    """The 80% intervals of a :func:`ledger_row` (NaN ends where there is none) and ``interval_note``:
    where they come from, or why there are none (see the module doc)."""
    nan = intervals.NONE
    host = f.strategy in HOST_STRATEGIES
    why = intervals.no_interval_reason(profile, f.mode) or intervals.no_interval_reason(profile, base.mode)
    if host and why is None:
        why = intervals.NOT_CHECKED["host"]
    ttft = (lambda x: intervals.ttft_interval(profile, f.mode, x)) if why is None else (lambda x: nan)
    p50, mean = ttft(row["ttft_p50_later_s"]), ttft(row["ttft_mean_s"])
    base_p50 = row["ttft_saved_s"] + row["ttft_p50_later_s"]
    vs = why or f.strategy == RECOMPUTE   # recompute against itself: 1x and 0 s by construction
    speed = nan if vs else intervals.speedup_interval(profile, f.mode, base.mode, row["speedup_vs_recompute"])
    saved = nan if vs else intervals.ttft_saved_interval(profile, f.mode, base.mode, base_p50, row["ttft_p50_later_s"])
    hit = pinned = nan     # recompute's hit rate and a one-way strategy's D pinned are 0 by construction
    notes = []
    if f.strategy == RECOMPUTE:
        pass
    elif why is None and f.reads is not None:
        hit = intervals.reuse_rate_interval(profile, f.mode, row["hit_rate"], f.reads)
        pinned = intervals.pinned_gib_s_interval(profile, f.mode, row["d_pinned_gib_s"], f.reads)
        if np.isnan(hit[0]):
            notes.append(f"hit rate and D pinned: {intervals.no_interval_reason(profile, f.mode, 'hit_rate')}")
    elif why is None:
        notes.append("hit rate: no held-out interval: the held-out check measures D's hits only, not P's own cache")
    if why is None:
        held = profile.held_out
        head = f"80% intervals from the held-out errors of profile {profile.name} ({held.runs} runs, {held.turns:,} turns)"
        notes = [head] + notes + [f"P cache and host GiB-s: {intervals.NOT_CHECKED['p_cache']}"]
    else:
        notes = [why]
    return {"hit_rate_interval_low": hit[0], "hit_rate_interval_high": hit[1],
            "ttft_p50_later_interval_low_s": p50[0], "ttft_p50_later_interval_high_s": p50[1],
            "ttft_mean_interval_low_s": mean[0], "ttft_mean_interval_high_s": mean[1],
            "speedup_interval_low": speed[0], "speedup_interval_high": speed[1],
            "ttft_saved_interval_low_s": saved[0], "ttft_saved_interval_high_s": saved[1],
            "d_pinned_interval_low_gib_s": pinned[0], "d_pinned_interval_high_gib_s": pinned[1],
            "interval_note": "; ".join(notes)}


@dataclass(frozen=True)
class LedgerJob:
    """What every strategy of one ledger shares (:mod:`planner.executor`)."""

    traffic: Traffic
    profile: CostProfile
    settings: PlanSettings


def _forecast_one(job: LedgerJob, strategy: str) -> StrategyForecast:
    return forecast_strategy(job.traffic, job.profile, job.settings, strategy)


def ledger(tr: Traffic, profile: CostProfile, settings: PlanSettings, prices: Prices = Prices(),
           strategies: tuple[str, ...] | None = None, executor=None) -> pd.DataFrame:
    """Every strategy of ``strategies`` (default: all of :data:`STRATEGIES`, the host ones only when
    the profile has a host tier) over ``tr``: a frame with :data:`LEDGER_COLUMNS` (seconds, GiB-s,
    tokens, USD). Every figure is a FORECAST of ``profile``. ``executor``: where the strategies are
    forecast (:mod:`planner.executor`; None: one after another here)."""
    if strategies is None:
        has_host = profile.host_kv_space_bytes is not None and profile.host_read_bandwidth_bytes_per_s is not None
        strategies = tuple(s for s in STRATEGIES if has_host or s not in HOST_STRATEGIES)
    wanted = tuple(dict.fromkeys((RECOMPUTE, *strategies)))
    if executor is None:
        block = settings.block_size or profile.block_size
        gpu = lru_tier(tr, profile.capacity_tokens(Role.PREFILL), block, settings.prefill_workers, settings.routing,
                       profile.kv_bytes_per_token.value, settings.shared_prefix_tokens)
        found = {s: forecast_strategy(tr, profile, settings, s, gpu if s != RECOMPUTE else None) for s in wanted}
    else:
        found = dict(zip(wanted, executor.map(_forecast_one, LedgerJob(tr, profile, settings), list(wanted),
                                              "the ledger"), strict=True))
    base = found[RECOMPUTE]
    rows = [ledger_row(found[s], base, tr, profile, prices) for s in strategies]
    return pd.DataFrame(rows, columns=list(LEDGER_COLUMNS))


def _money(v: float | None) -> str:
    if v is None or pd.isna(v):
        return "n/a (no price)"
    return f"-${-v:,.4f}" if v < 0 else f"${v:,.4f}"


def with_iv(text: str, low: float | None, high: float | None, fmt, unit: str = "", quiet: bool = False) -> str:
    """``text`` with its 80% interval, ``"83.5 ms (80% interval 75.2-100.2 ms)"`` (" to " between
    the ends when one is negative), or ``"(no held-out interval)"`` where an end is NaN/None
    (``quiet``: ``text`` alone, where the report says once that no figure has one)."""
    if low is None or high is None or pd.isna(low) or pd.isna(high):
        return text if quiet else f"{text} (no held-out interval)"
    sep = " to " if min(low, high) < 0 else "-"
    return f"{text} (80% interval {fmt(low)}{sep}{fmt(high)}{unit})"


def _ms(x: float) -> str:
    return f"{x * 1e3:,.1f}"


def ledger_lines(r, quiet: bool = False) -> list[str]:
    """One ledger row (a :data:`LEDGER_COLUMNS` record) in words, every forecast with its interval
    (recompute's hit rate and a one-way strategy's D pinned KV are 0 by construction: no interval);
    ``quiet``: no "(no held-out interval)" per figure (the report says it once). A strategy whose
    deployment cannot keep up (``overload``, text) gets no TTFT and no speed-up, only its overload."""
    _iv = partial(with_iv, quiet=quiet)
    hit = (f"{r.hit_rate:.1%} (none reused, by construction)" if r.strategy == RECOMPUTE else
           "not forecast (the forecast stopped at the overload)" if pd.isna(r.hit_rate) else
           _iv(f"{r.hit_rate:.1%}", r.hit_rate_interval_low, r.hit_rate_interval_high,
                   lambda x: f"{x * 100:.1f}", "%"))
    p50 = _iv(f"{_ms(r.ttft_p50_later_s)} ms", r.ttft_p50_later_interval_low_s, r.ttft_p50_later_interval_high_s,
                  _ms, " ms")
    over = getattr(r, "overload", None)
    if isinstance(over, str) and over:
        first = f"  {r.strategy:<14} hit rate {hit}; {over} (no TTFT, no speed-up)"
    else:
        first = f"  {r.strategy:<14} hit rate {hit}; TTFT p50 (turn 2 on) {p50}"
    if r.strategy != RECOMPUTE and not (isinstance(over, str) and over) and not pd.isna(r.speedup_vs_recompute):
        speed = _iv(f"{r.speedup_vs_recompute:.2f}x", r.speedup_interval_low, r.speedup_interval_high,
                        lambda x: f"{x:.2f}", "x")
        saved = _iv(f"{_ms(r.ttft_saved_s)} ms", r.ttft_saved_interval_low_s, r.ttft_saved_interval_high_s,
                        _ms, " ms")
        first += f"; vs recompute: speed-up {speed}, TTFT saved {saved}"
    elif r.strategy != RECOMPUTE and not (isinstance(over, str) and over):
        first += "; vs recompute: no speed-up (recompute cannot keep up)"
    if pd.isna(r.d_pinned_gib_s):   # the forecast stopped at the overload
        return [first, (f"  {'':<14} held P cache {memory_hours(r.p_cache_gib_s)}, host {memory_hours(r.host_gib_s)}; "
                        "D pinned and prefill GPU-hours saved not forecast")]
    pinned = (memory_hours(r.d_pinned_gib_s) if r.strategy not in BIDIR_STRATEGIES else
              _iv(memory_hours(r.d_pinned_gib_s), r.d_pinned_interval_low_gib_s, r.d_pinned_interval_high_gib_s,
                  memory_hours))
    second = (f"  {'':<14} held GPU {memory_hours(r.p_cache_gib_s + r.d_pinned_gib_s)} (P cache "
              f"{memory_hours(r.p_cache_gib_s)}, D pinned {pinned}), host {memory_hours(r.host_gib_s)}; prefill saved "
              f"{gpu_hours(r.prefill_gpu_s_saved)}; memory per M saved tokens {_money(r.memory_usd_per_m_saved_tokens)}, "
              f"net of saved prefill {_money(r.net_usd_per_m_saved_tokens)}")
    return [first, second]


def describe_ledger(df: pd.DataFrame, profile: CostProfile, settings: PlanSettings, prices: Prices) -> str:
    """The ledger in plain text, labelled as a forecast with its inputs, each figure with its 80%
    interval or "no held-out interval" and why."""
    tag = profile.label()
    host = ("host tier " + (f"{profile.host_kv_space_bytes.value / GiB:,.0f} GiB per P worker, read at "
            f"{profile.host_read_bandwidth_bytes_per_s.value / 1e9:,.1f} GB/s"
            if profile.host_kv_space_bytes and profile.host_read_bandwidth_bytes_per_s else "not in the profile"))
    gpu_price = "not given" if prices.gpu_hour_usd is None else f"${prices.gpu_hour_usd:g}"
    host_price = "not given" if prices.host_gib_hour_usd is None else f"${prices.host_gib_hour_usd:g}"
    lines = [(f"Ledger of retention strategies ({tag}; TTL {settings.decoder_kv_blocks_ttl_s:.0f} s, threshold "
              f"{settings.kv_recompute_threshold}, {settings.prefill_workers}P{settings.decode_workers}D, routing "
              f"{settings.routing}; {host}; prices: GPU-hour {gpu_price}, host GiB-hour {host_price})."),
             f"  intervals: {intervals.source_line(profile)}"]
    notes = []
    for r in df.itertuples():
        lines += ledger_lines(r, quiet=profile.held_out is None)
        for note in str(r.interval_note).split("; "):
            if note and not note.startswith("80% intervals from") and note not in notes and "never checked" not in note:
                notes.append(note)
    lines += [f"  note ({', '.join(df.loc[df['interval_note'].str.contains(n, regex=False), 'strategy'])}): {n}"
              for n in notes]
    return "\n".join(lines)
