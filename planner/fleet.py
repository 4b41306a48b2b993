"""Fleet sizing (a FORECAST): for each retention strategy of the ledger, the smallest fleet (P
workers, D workers, D's KV space per worker) whose forecast p90 TTFT meets the SLO at a stated
load, and for a fleet, TTFT against load (docs/planner/fleet.md).

A fleet is judged with the ledger's model (:func:`planner.ledger.forecast_strategy`) at
the load (:mod:`planner.load`). One that cannot keep up is overloaded
(:mod:`planner.overload`, the one rule, the SLO included) and has no TTFT. The search,
per strategy (:func:`size_fleet`; docs/planner/fleet.md):

0. **the bound** (:func:`best_case_p90_s`): a p90 TTFT no fleet can beat; over the SLO, the
   strategy is ruled out without a search (proven), and only the largest fleet is forecast;
1. **out of overload**, from 1P1D: while a role is overloaded, grow it to its factor times its
   workers (rounded up, at least one more; twice as many without a factor), then the other role;
2. **into the SLO**: while the p90 TTFT misses the SLO, double the role whose queue holds the slow
   requests longer (the mean wait on P against on D over the requests at or above the p90; P first
   when the TTFT without any wait misses by itself: more P hold more prefixes), then the other;
   none meets only when the largest fleet in the limits misses;
3. **the smallest**: the fleets of one worker fewer, then fewer still, while any meets the SLO; of
   the smallest size, the lowest p90, then the fewest P (:func:`smallest_order`). Fleets known to miss
   (:meth:`FleetSizer.known_to_miss`) are not forecast.

Steps 2 and 3 rest on more workers never making a forecast worse (tested on hand-counted
traffics in tests/unit/test_planner_fleet_properties.py, with a brute-force grid).

The sizes are bounded by ``max_prefill_workers`` and ``max_decode_workers``; D's KV space per worker
is the limit's (or the profile's). GPUs = (P + D) x the profile's ``gpus_per_worker``. The
recommended fleet is the cheapest that meets the SLO: fewest GPUs, then (priced) the lowest cost,
then the lowest mean TTFT; a strategy that holds KV out of other requests' reach (D's pins, the host
tier) must beat the best one that does not at the same GPUs by more than ``planner.strategies.MIN_GAIN`` of mean
TTFT (the recommendation's own rule: :func:`planner.strategies.pick_paying_memory`).

Cost per million tokens (with a GPU-hour price): the fleet's GPUs for the traffic's horizon plus
the host tier's GiB-hours at their price, over the input and output tokens served, USD.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from core.contract import Role
from core.modes import RECOMPUTE_MODE
from planner.executor import Executor, LocalExecutor
from planner.ledger import Prices, forecast_strategy
from planner.load import Load, LoadedTraffic
from planner.overload import SATURATION, Overload
from planner.profile import CostProfile, GiB, with_decode_kv
from planner.simulate import PlanSettings, Traffic
from planner.strategies import BIDIR_STRATEGIES, RECOMPUTE, STRATEGIES, pick_paying_memory
from planner.units import gpu_hours, memory_hours, sig3


@dataclass(frozen=True)
class Fleet:
    """``prefill_workers``, ``decode_workers`` and ``decode_kv_bytes`` (one D's KV space, bytes;
    None: the profile's)."""

    prefill_workers: int = 1
    decode_workers: int = 1
    decode_kv_bytes: float | None = None

    def label(self) -> str:
        """E.g. "2P 3D"."""
        return f"{self.prefill_workers}P {self.decode_workers}D"

    def gpus(self, profile: CostProfile) -> float:
        """GPUs of the fleet: workers x the profile's ``gpus_per_worker`` (1 when it has none)."""
        per = profile.gpus_per_worker.value if profile.gpus_per_worker else 1.0
        return (self.prefill_workers + self.decode_workers) * per


@dataclass(frozen=True)
class FleetLimits:
    """The operator's limits: ``ttft_slo_s`` (p90 TTFT, seconds; None: none, the smallest fleet that
    keeps up), the most P and D workers, ``decode_kv_bytes`` (one D's KV space, bytes; None: the
    profile's) and ``prices``."""

    ttft_slo_s: float | None = None
    max_prefill_workers: int = 16
    max_decode_workers: int = 16
    decode_kv_bytes: float | None = None
    prices: Prices = field(default_factory=Prices)


@dataclass
class FleetForecast:
    """One strategy on one fleet at one load. Seconds, GiB-seconds, USD; ``ttft_p50_s`` and
    ``ttft_p90_s`` NaN when ``overload`` is set (a deployment that cannot keep up has no TTFT);
    ``hit_rate``: later requests (``request_index`` >= 1) reusing any token; ``no_wait_p90_s``: the
    p90 of the TTFT less every wait (what no added worker removes); ``p_tail_wait_s`` /
    ``d_tail_wait_s``: the mean wait on P / on D of the requests at or above the p90."""

    strategy: str
    fleet: Fleet
    gpus: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_mean_s: float
    hit_rate: float
    p_cache_gib_s: float
    d_pinned_gib_s: float
    host_gib_s: float
    prefill_gpu_s_saved: float
    usd_per_m_tokens: float | None
    overload: Overload | None
    meets_slo: bool
    no_wait_p90_s: float
    p_tail_wait_s: float
    d_tail_wait_s: float

    @property
    def keeps_up(self) -> bool:
        return self.overload is None

    def ttft_text(self) -> str:
        """"p90 1,234.5 ms, p50 321.0 ms", or the overload in words."""
        if self.overload is not None:
            return self.overload.text()
        return f"p90 {self.ttft_p90_s * 1e3:,.1f} ms, p50 {self.ttft_p50_s * 1e3:,.1f} ms"

    def margin(self, slo_s: float | None) -> float:
        """p90 TTFT over the SLO (below 1: meets it); NaN without an SLO or a TTFT."""
        return float("nan") if slo_s is None or self.overload is not None else self.ttft_p90_s / slo_s

    def margin_text(self, slo_s: float | None) -> str:
        """"p90/SLO 0.48", with ", close" when within :data:`CLOSE` of the SLO; "" without either."""
        m = self.margin(slo_s)
        if math.isnan(m):
            return ""
        return f"p90/SLO {m:.2f}" + (", close: within the planner's known error of the SLO" if is_close(m) else "")


#: A forecast p90 TTFT within this fraction of the SLO (either side) is "close": the planner's
#: known error on the p90 TTFT of runs it was not fitted on is 25% (met in 31 of 40 mode-runs,
#: docs/planner/held-out.md), and the vendor profile has no held-out interval of its own.
CLOSE = 0.25


def is_close(margin: float) -> bool:
    """Whether a p90/SLO ``margin`` is within :data:`CLOSE` of 1."""
    return not math.isnan(margin) and abs(margin - 1.0) <= CLOSE


def evaluate_fleet(tr: Traffic, profile: CostProfile, base: PlanSettings, strategy: str, fleet: Fleet,
                   limits: FleetLimits) -> FleetForecast:
    """Forecast ``strategy`` on ``fleet`` over ``tr`` (see the module doc for the figures)."""
    prof = with_decode_kv(profile, fleet.decode_kv_bytes)
    ps = base.model_copy(update={"prefill_workers": fleet.prefill_workers, "decode_workers": fleet.decode_workers,
                                 "stop_on_overload": True,   # an overloaded fleet needs no more than that
                                 "ttft_slo_s": limits.ttft_slo_s})   # the one overload rule judges it
    f = forecast_strategy(tr, prof, ps, strategy)
    later = tr.request_index >= 1
    hit = float(((f.local + f.pulled)[later] > 0).mean()) if later.any() and not f.stopped else float("nan")
    gpus_per = prof.gpus_per_worker.value if prof.gpus_per_worker else 1.0
    recompute = prof.prefill_compute_s(RECOMPUTE_MODE, tr.input_tokens, np.zeros(len(tr)))
    saved = float((recompute - f.compute_s).sum()) * gpus_per
    gpus = fleet.gpus(prof)
    usd = None
    if limits.prices.gpu_hour_usd is not None:
        horizon_h = tr.horizon_s / 3600
        host = 0.0 if f.host_gib_s == 0 else (None if limits.prices.host_gib_hour_usd is None
                                                else f.host_gib_s / 3600 * limits.prices.host_gib_hour_usd)
        tokens = float(tr.input_tokens.sum() + tr.output_tokens.sum())
        if host is not None and tokens > 0:
            usd = (gpus * horizon_h * limits.prices.gpu_hour_usd + host) / (tokens / 1e6)
    nan = float("nan")
    if f.stopped:   # the forecast stopped at the overload: nothing else is known of it
        return FleetForecast(strategy, fleet, gpus, nan, nan, nan, hit, f.p_cache_gib_s, nan, f.host_gib_s, nan, usd,
                             f.overload, False, nan, nan, nan)
    waits = f.queue_wait_s + f.decode_wait_s
    no_wait = float(np.quantile(f.ttft_s - waits, 0.9))
    p90 = float(np.quantile(f.ttft_s, 0.9))
    tail = f.ttft_s >= p90
    keeps_up = f.overload is None
    meets = keeps_up and (limits.ttft_slo_s is None or p90 <= limits.ttft_slo_s)
    return FleetForecast(strategy, fleet, gpus, float(np.median(f.ttft_s)) if keeps_up else nan,
                         p90 if keeps_up else nan, float(f.ttft_s.mean()) if keeps_up else nan, hit, f.p_cache_gib_s,
                         f.d_pinned_gib_s, f.host_gib_s, saved, usd, f.overload, meets, no_wait,
                         float(f.queue_wait_s[tail].mean()), float(f.decode_wait_s[tail].mean()))


def best_case_p90_s(tr: Traffic, profile: CostProfile, base: PlanSettings, strategy: str) -> float:
    """A p90 TTFT no fleet of ``strategy`` can beat on ``tr``, seconds: each request's TTFT with no
    wait (on P, on D, for the host) and every token it could find cached found on its P, nothing
    pulled or read from the host (a session's later requests: the whole prompt; its first: the
    shared system prompt; ``recompute``: nothing), no render of a taken handle. Each of those
    only adds time in the model (:class:`planner.simulate.ModeCost`, the ledger's host
    reads, D's admission queue, host contention), so every request's forecast TTFT on any fleet is
    at least its figure here, and so is the p90 (order statistics keep the order)."""
    from planner.simulate import ModeCost

    mode = STRATEGIES[strategy]
    n = tr.input_tokens
    if strategy == RECOMPUTE:
        cached = np.zeros(len(tr), dtype=np.int64)
    else:
        first = np.zeros(len(tr), dtype=bool)
        first[np.unique(tr.session_code, return_index=True)[1]] = True
        shared = np.maximum(tr.shared_prefix_tokens, base.shared_prefix_tokens)
        cached = np.where(first, np.minimum(shared, n), n)
    rows = np.arange(len(tr))
    ttft, _ = ModeCost(tr, profile, base, mode)(rows, cached, np.zeros(len(tr), dtype=np.int64),
                                                np.zeros(len(tr), dtype=bool))
    return float(np.quantile(ttft, 0.9))


@dataclass
class FleetSearch:
    """:func:`size_fleet`'s answer for one strategy: ``best`` (the smallest fleet that meets the SLO;
    None: none within the limits), ``searched`` (every fleet forecast, in order), ``why_none``,
    ``bound_s`` (:func:`best_case_p90_s`), ``largest`` (the largest fleet in the limits, forecast
    when no fleet meets the SLO: the lowest p90 TTFT within the limits, since more workers never
    raise it; None when not forecast)."""

    strategy: str
    best: FleetForecast | None
    searched: list[FleetForecast]
    why_none: str = ""
    bound_s: float = float("nan")
    largest: FleetForecast | None = None

    @property
    def closest(self) -> FleetForecast:
        """The best fleet, else the largest one (the lowest p90 within the limits), else the last searched."""
        return self.best or self.largest or self.searched[-1]


def smallest_order(e: FleetForecast) -> tuple:
    """The order of the smallest fleet among those that meet the SLO: fewest workers, then the
    lowest p90 TTFT (the most margin), then fewest P."""
    return (e.fleet.prefill_workers + e.fleet.decode_workers, e.ttft_p90_s, e.fleet.prefill_workers)


class FleetSizer:
    """The search of the module doc for one strategy, its forecasts memoised by fleet."""

    def __init__(self, tr: Traffic, profile: CostProfile, base: PlanSettings, strategy: str, limits: FleetLimits):
        self.tr, self.profile, self.base, self.strategy, self.limits = tr, profile, base, strategy, limits
        self.searched: list[FleetForecast] = []
        self._memo: dict[Fleet, FleetForecast] = {}

    def at(self, p: int, d: int) -> FleetForecast:
        fleet = Fleet(p, d, self.limits.decode_kv_bytes)
        if fleet not in self._memo:
            self._memo[fleet] = evaluate_fleet(self.tr, self.profile, self.base, self.strategy, fleet, self.limits)
            self.searched.append(self._memo[fleet])
        return self._memo[fleet]

    def known_to_miss(self, p: int, d: int) -> bool:
        """Whether (P, D) misses by what is already forecast: it has no more workers of either role
        than a fleet that misses (more workers never make a forecast worse), or, for a strategy
        without D's pins, no more P than a fleet whose P is overloaded by its work (P's work does not
        depend on D then)."""
        for e in self.searched:
            if e.meets_slo:
                continue
            q, r = e.fleet.prefill_workers, e.fleet.decode_workers
            if p <= q and d <= r:
                return True
            o = e.overload
            if (o is not None and o.role == Role.PREFILL and not math.isnan(o.factor) and p <= q
                    and self.strategy not in BIDIR_STRATEGIES):
                return True
        return False

    def _grown(self, e: FleetForecast) -> tuple[int, int] | None:
        """The next (P, D) out of ``e``'s overload (its role grown by its factor), or None at the limits."""
        p, d = e.fleet.prefill_workers, e.fleet.decode_workers
        o = e.overload
        mult = 2.0 if math.isnan(o.factor) else o.factor
        if o.role == Role.DECODE:
            nd = min(self.limits.max_decode_workers, max(d + 1, math.ceil(d * mult)))
            return None if nd == d else (p, nd)
        np_ = min(self.limits.max_prefill_workers, max(p + 1, math.ceil(p * mult)))
        return None if np_ == p else (np_, d)

    def _options(self, e: FleetForecast) -> list[tuple[int, int]]:
        """The fleets to try after ``e`` (which misses), best first: out of its overload (its role by
        its factor), else double the role whose queue holds the slow requests longer (P first when
        the TTFT without any wait misses by itself: more P hold more of the sessions' prefixes);
        then the other role doubled. None beyond the limits."""
        lim, p, d = self.limits, e.fleet.prefill_workers, e.fleet.decode_workers
        double_p, double_d = (min(2 * p, lim.max_prefill_workers), d), (p, min(2 * d, lim.max_decode_workers))
        if not e.keeps_up:
            first = [self._grown(e)] if self._grown(e) else []
            rest = [double_d, double_p] if e.overload.role == Role.DECODE else [double_p, double_d]
            if (e.overload.role == Role.PREFILL and not math.isnan(e.overload.factor) and not first
                    and self.strategy not in BIDIR_STRATEGIES):
                return []   # P's work at its most workers: without D's pins no D count changes it
        elif lim.ttft_slo_s is not None and e.no_wait_p90_s > lim.ttft_slo_s:
            first, rest = [double_p], [double_d]
        else:
            first, rest = ([double_d], [double_p]) if e.d_tail_wait_s > e.p_tail_wait_s else ([double_p], [double_d])
        return [o for o in dict.fromkeys(first + rest) if o is not None and o != (p, d)]

    def search(self) -> FleetSearch:
        lim = self.limits
        bound = best_case_p90_s(self.tr, self.profile, self.base, self.strategy)
        largest = (lim.max_prefill_workers, lim.max_decode_workers)
        if lim.ttft_slo_s is not None and bound > lim.ttft_slo_s:   # proven for every fleet: no search
            shown = (f"{bound * 1e3:,.1f} ms" if bound <= SATURATION * lim.ttft_slo_s
                     else f"past {SATURATION:g}x the SLO")
            e = self.at(*largest)
            return FleetSearch(self.strategy, None, self.searched,
                               f"proven: with no wait and every prefix it could find cached, the p90 TTFT is {shown}, "
                               "over the SLO, on any fleet", bound, e)
        e = self.at(1, 1)
        while not e.meets_slo:
            options = self._options(e)
            if not options:   # the largest fleet misses: more workers never help (module doc), so none does
                why = e.overload.text() if e.overload else f"p90 TTFT {e.ttft_p90_s * 1e3:,.1f} ms"
                return FleetSearch(self.strategy, None, self.searched,
                                   f"{why} at {e.fleet.label()}, the largest fleet allowed", bound, e)
            e = self.at(*options[0])
        return FleetSearch(self.strategy, self._smallest(e), self.searched, bound_s=bound)

    def _diagonal(self, t: int, first_only: bool = False) -> list[FleetForecast]:
        """The fleets of ``t`` workers within the limits that may meet the SLO, forecast (those
        :meth:`known_to_miss` left out), fewest P first; ``first_only``: up to the first that meets."""
        lim, out = self.limits, []
        for p in range(max(1, t - lim.max_decode_workers), min(lim.max_prefill_workers, t - 1) + 1):
            if not self.known_to_miss(p, t - p):
                out.append(self.at(p, t - p))
                if first_only and out[-1].meets_slo:
                    break
        return out

    def _smallest(self, e: FleetForecast) -> FleetForecast:
        """The smallest fleet that meets the SLO (:func:`smallest_order`), given ``e`` meets it: a fleet of
        one worker fewer, then fewer still, while one meets (more workers never make a forecast
        worse, so none smaller meets once a whole size misses); every fleet of the smallest size
        that meets then compared."""
        t = e.fleet.prefill_workers + e.fleet.decode_workers
        while t > 2 and any(f.meets_slo for f in self._diagonal(t - 1, first_only=True)):
            t -= 1
        return min((f for f in self._diagonal(t) if f.meets_slo), key=smallest_order)


def size_fleet(tr: Traffic, profile: CostProfile, base: PlanSettings, strategy: str,
               limits: FleetLimits) -> FleetSearch:
    """The smallest fleet for ``strategy`` (see the module doc). Raises ValueError for an unknown strategy."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; strategies are {', '.join(STRATEGIES)}")
    return FleetSizer(tr, profile, base, strategy, limits).search()


@dataclass(frozen=True)
class FleetJob:
    """What every fleet task shares: the traffic, profile, base settings and limits."""

    traffic: Traffic
    profile: CostProfile
    base: PlanSettings
    limits: FleetLimits


def _size_one(job: FleetJob, strategy: str) -> FleetSearch:
    return size_fleet(job.traffic, job.profile, job.base, strategy, job.limits)


def size_fleets(job: FleetJob, strategies: tuple[str, ...], executor: Executor | None = None) -> list[FleetSearch]:
    """:func:`size_fleet` for each of ``strategies`` (in parallel on ``executor``; default: this
    machine's cores)."""
    return (executor or LocalExecutor()).map(_size_one, job, list(strategies), "sizing fleets")


def cheapest(searches: list[FleetSearch], priced: bool) -> FleetForecast | None:
    """The recommended fleet (the module doc's rule), or None when no strategy meets the SLO."""
    found = [s.best for s in searches if s.best is not None]
    if not found:
        return None
    fewest = min(f.gpus for f in found)
    same = [f for f in found if f.gpus == fewest]
    if priced and all(f.usd_per_m_tokens is not None for f in same):
        low = min(f.usd_per_m_tokens for f in same)
        same = [f for f in same if f.usd_per_m_tokens <= low * (1 + 1e-9)]
    return pick_paying_memory(same, lambda f: f.strategy, lambda f: f.ttft_mean_s,
                              lambda f: f.d_pinned_gib_s + f.host_gib_s)


@dataclass(frozen=True)
class CurvePoint:
    """One point of a load curve: ``strategy`` on ``fleet`` at ``load`` (its forecast)."""

    strategy: str
    fleet: Fleet
    load: Load
    forecast: FleetForecast


@dataclass(frozen=True)
class CurveJob:
    """What every load-curve task shares: the traffic (the mix), its formats' tree unit, the profile,
    base settings and limits."""

    mix: Traffic
    tree_of: str
    profile: CostProfile
    base: PlanSettings
    limits: FleetLimits


def _curve_point(job: CurveJob, item: tuple[str, Fleet, Load]) -> CurvePoint:
    from planner.load import apply_load

    strategy, fleet, load = item
    tr = apply_load(job.mix, load, job.tree_of).traffic
    return CurvePoint(strategy, fleet, load, evaluate_fleet(tr, job.profile, job.base, strategy, fleet, job.limits))


#: The loads of a curve, as multiples of the load asked for.
CURVE_FACTORS = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)


def load_curve(job: CurveJob, fleets: dict[str, Fleet], load: Load, executor: Executor | None = None,
               factors: tuple[float, ...] = CURVE_FACTORS,
               known: dict[str, FleetForecast] | None = None) -> list[CurvePoint]:
    """Each strategy's fleet at ``load``'s value times each of ``factors`` (concurrent sessions
    rounded, at least 1): its p90 TTFT, or its overload. ``known``: strategy -> its fleet's forecast
    at ``load`` itself (the sizing's), not forecast again."""
    loads = []
    for f in factors:
        v = load.value * f
        if load.kind == "concurrent_sessions":
            v = max(1.0, float(round(v)))
        loads.append(load.at(v))
    loads = list({ld.value: ld for ld in loads}.values())
    known = known or {}
    items = [(s, fleet, ld) for s, fleet in fleets.items() for ld in loads
             if not (ld.value == load.value and s in known and known[s].fleet == fleet)]
    done = (executor or LocalExecutor()).map(_curve_point, job, items, "load curve")
    again = [CurvePoint(s, known[s].fleet, load, known[s]) for s, fleet in fleets.items()
             if s in known and known[s].fleet == fleet and any(ld.value == load.value for ld in loads)]
    return sorted(done + again, key=lambda p: (list(fleets).index(p.strategy), p.load.value))


def fleet_row(e: FleetForecast, loaded: LoadedTraffic, limits: FleetLimits, recommended: bool,
              searched: int, largest: FleetForecast | None = None) -> dict:
    """The ``plan_fleets`` row of ``e`` (docs/schema/plans.md); ``largest``: where no fleet meets the
    SLO, the largest fleet's forecast (its p90 is the lowest SLO the strategy reaches)."""
    o = e.overload
    lowest = None if largest is None or largest.overload is not None else largest.ttft_p90_s
    return {"load_kind": str(loaded.load.kind), "load_value": loaded.load.value, "load_label": loaded.label(),
            "slo_ttft_p90_s": limits.ttft_slo_s, "strategy": e.strategy, "prefill_workers": e.fleet.prefill_workers,
            "decode_workers": e.fleet.decode_workers, "decode_kv_bytes_per_worker": e.fleet.decode_kv_bytes,
            "gpus": e.gpus, "ttft_p50_s": None if o else e.ttft_p50_s, "ttft_p90_s": None if o else e.ttft_p90_s,
            "hit_rate": e.hit_rate, "p_cache_gib_s": e.p_cache_gib_s, "d_pinned_gib_s": e.d_pinned_gib_s,
            "host_gib_s": e.host_gib_s, "prefill_gpu_s_saved": e.prefill_gpu_s_saved,
            "usd_per_m_tokens": e.usd_per_m_tokens, "meets_slo": e.meets_slo, "overloaded": o is not None,
            "overload_role": None if o is None else str(o.role),
            "overload_factor": None if o is None or math.isnan(o.factor) else o.factor,
            "recommended": recommended, "fleets_searched": searched,
            "overload": None if o is None else o.text(), "ttft_p90_over_slo": _finite(e.margin(limits.ttft_slo_s)),
            "close_to_slo": is_close(e.margin(limits.ttft_slo_s)), "lowest_ttft_p90_s": lowest}


def _finite(x: float) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def curve_row(p: CurvePoint, limits: FleetLimits, knee: Load | None = None) -> dict:
    """The ``plan_load_curve`` row of ``p`` (docs/schema/plans.md); ``knee``: its fleet's knee
    (:func:`knees`), marking the point at that load."""
    e, o = p.forecast, p.forecast.overload
    return {"strategy": p.strategy, "prefill_workers": p.fleet.prefill_workers, "decode_workers": p.fleet.decode_workers,
            "decode_kv_bytes_per_worker": p.fleet.decode_kv_bytes, "load_kind": str(p.load.kind),
            "load_value": p.load.value, "ttft_p50_s": None if o else e.ttft_p50_s,
            "ttft_p90_s": None if o else e.ttft_p90_s, "overloaded": o is not None,
            "overload_role": None if o is None else str(o.role),
            "overload_factor": None if o is None or math.isnan(o.factor) else o.factor,
            "slo_ttft_p90_s": limits.ttft_slo_s, "overload": None if o is None else o.text(),
            "knee": knee is not None and knee.value == p.load.value}


def _memory_line(e: FleetForecast) -> str:
    return (f"held P cache {memory_hours(e.p_cache_gib_s)}, D pinned {memory_hours(e.d_pinned_gib_s)}, host "
            f"{memory_hours(e.host_gib_s)}; prefill saved {gpu_hours(e.prefill_gpu_s_saved)}")


def lowest_slo_text(s: FleetSearch) -> str:
    """The next question where ``s`` has no fleet: the lowest p90 TTFT its largest fleet reaches (the
    lowest SLO it meets within the limits), or why even that one has none."""
    e = s.largest
    if e is None:
        return "the largest fleet was not forecast"
    if e.overload is not None:
        return f"none within the limits: {e.fleet.label()} is {e.overload.text()}"
    return f"p90 {e.ttft_p90_s * 1e3:,.0f} ms on {e.fleet.label()} ({e.gpus:,.0f} GPUs)"


def describe_fleets(searches: list[FleetSearch], chosen: FleetForecast | None, loaded: LoadedTraffic,
                    profile: CostProfile, limits: FleetLimits) -> str:
    """The fleet table in plain text: one line per strategy (its fleet, p90 TTFT and margin to the
    SLO, or why none meets it and the lowest SLO it reaches within the limits), the load and SLO above it."""
    slo = "none (the smallest fleet that keeps up)" if limits.ttft_slo_s is None else \
        f"p90 TTFT <= {limits.ttft_slo_s:g} s"
    space = ("the profile's" if limits.decode_kv_bytes is None and profile.decode_kv_space_bytes is None else
             f"{sig3((limits.decode_kv_bytes or profile.decode_kv_space_bytes.value) / GiB)} GiB")
    lines = [(f"Fleet per strategy ({profile.label()}; load: {loaded.label()}; SLO {slo}; at most "
             f"{limits.max_prefill_workers} P and {limits.max_decode_workers} D, D KV {space} per worker):")]
    for s in searches:
        e = s.closest
        goal = "meets the SLO" if limits.ttft_slo_s is not None else "keeps up"
        mark = f"  <- recommended (the cheapest that {goal})" if chosen is not None and e is chosen else ""
        if s.best is None:
            lines.append(f"  {s.strategy:<14} no fleet meets the SLO: {s.why_none} ({len(s.searched)} fleets tried); "
                         f"the lowest SLO it reaches: {lowest_slo_text(s)}")
            continue
        money = "" if e.usd_per_m_tokens is None else f", ${sig3(e.usd_per_m_tokens)} per M tokens"
        margin = e.margin_text(limits.ttft_slo_s)
        lines.append(f"  {s.strategy:<14} {e.fleet.label():<7} {e.gpus:,.0f} GPUs: {e.ttft_text()}"
                     f"{'; ' + margin if margin else ''}; hit rate {e.hit_rate:.1%}; {_memory_line(e)}{money} "
                     f"({len(s.searched)} fleets tried){mark}")
    if chosen is None:
        lines.append("  No strategy meets the SLO within the limits at this load: the lowest SLO each reaches is "
                     "above.")
    return "\n".join(lines)


def knees(points: list[CurvePoint], limits: FleetLimits) -> dict[tuple[str, Fleet], Load | None]:
    """Each (strategy, fleet) of a load curve: the highest load it serves (keeps up and, with an
    SLO, meets it) with every lower load of the curve served too: its knee; None when it serves
    not even the lowest."""
    out: dict[tuple[str, Fleet], Load | None] = {}
    by: dict[tuple[str, Fleet], list[CurvePoint]] = {}
    for p in points:
        by.setdefault((p.strategy, p.fleet), []).append(p)
    for key, ps in by.items():
        knee = None
        for p in sorted(ps, key=lambda p: p.load.value):
            e = p.forecast
            if not (e.keeps_up and (limits.ttft_slo_s is None or e.meets_slo)):
                break
            knee = p.load
        out[key] = knee
    return out


def describe_curve(points: list[CurvePoint], load: Load, limits: FleetLimits) -> str:
    """Each strategy's fleet against load in plain text: its p90 TTFT at each load, or its overload,
    and its knee (:func:`knees`), marked ``*`` on the curve."""
    from planner.load import LOAD_UNITS

    unit = LOAD_UNITS[load.kind]
    serves = "keeps up and meets the SLO" if limits.ttft_slo_s is not None else "keeps up"
    lines = [(f"Each strategy's fleet at other loads ({unit}; p90 TTFT, or the overload; SLO "
             f"{'none' if limits.ttft_slo_s is None else f'{limits.ttft_slo_s:g} s'}; * the knee: the highest "
             f"load it {serves} at, every lower one too):")]
    by: dict[tuple[str, Fleet], list[CurvePoint]] = {}
    for p in points:
        by.setdefault((p.strategy, p.fleet), []).append(p)
    knee = knees(points, limits)
    for (strategy, fleet), ps in by.items():
        cells = []
        k = knee[(strategy, fleet)]
        for p in sorted(ps, key=lambda p: p.load.value):
            e = p.forecast
            star = "*" if k is not None and p.load.value == k.value else ""
            cells.append(f"{p.load.value:,.4g}{star}: " + (e.overload.text() if e.overload else
                                                            f"{e.ttft_p90_s * 1e3:,.0f} ms"))
        at = (f"knee {k.value:,.4g}" if k is not None else f"knee below {min(p.load.value for p in ps):,.4g}")
        lines.append(f"  {strategy:<14} {fleet.label():<7} {at}: " + "; ".join(cells))
    return "\n".join(lines)
