"""``turnscope recommend``: what to deploy for a traffic (a FORECAST), as a config diff.

From a traffic, a cost profile and the user's limits (:class:`Limits`: an SLO on TTFT, D's KV
space, prices), every setting of a small grid (:class:`Grid`: retention strategy of
:mod:`planner.ledger`, ``decoder_kv_blocks_ttl``, ``kv_recompute_threshold``, D's KV
space, prefill workers, routing) is forecast with the ledger's model, and one is recommended:

1. feasible settings: keeps up with the load (:mod:`planner.overload`), p90 TTFT over all
   requests within the SLO (when given) and D's KV space within the limit (the grid never goes past
   it); of those, the fewest workers (the cheapest fleet, :mod:`planner.fleet`);
2. without prices: the lowest mean TTFT; a setting that holds KV on D (``pd-bidir*``) or in host
   memory must beat the best setting without that hold by more than :data:`MIN_GAIN` of mean TTFT,
   else the simpler setting is recommended (holding memory for a gain inside the planner's error is
   not a recommendation);
3. with prices (``gpu_hour_usd`` given): among feasible settings within :data:`MIN_GAIN` of the best
   mean TTFT, the lowest cost: priced memory held (:mod:`planner.ledger`) less the saved
   prefill, plus the GPU-hours of prefill workers beyond one over the traffic's span;
4. every knob (but the strategy) is then put back to its current value where that costs no held
   memory and no money and at most :data:`MIN_GAIN` of mean TTFT: a knob changed for TTFT alone
   must gain more than that. Replayed on real workers, a threshold of 0 forecast 2% faster was 9%
   slower (docs/log/recommend.md).

The recommendation is printed as the ``vllm serve`` flags and ``--kv-transfer-config`` JSON of each
role (rendered by :func:`serving.workers.worker_command`, the command turnscope itself starts
workers with) and the proxy's routing, current next to recommended, with each changed knob's
forecast gain (that knob alone changed from the current setting), and as the diff of the topology
file (:mod:`planner.recommend_topology`).

Every forecast figure it prints carries its 80% interval from the profile's held-out errors
(:mod:`planner.intervals`; :func:`figure_intervals`), or "no held-out interval" and why.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, replace
from functools import partial

import numpy as np

from core.connector import Connector
from core.contract import Role
from planner import intervals
from planner.executor import Executor, LocalExecutor
from planner.ledger import Prices, forecast_strategy, ledger_row
from planner.ledger import with_iv as _with_iv
from planner.overload import Overload
from planner.profile import CostProfile, GiB, Sourced, with_decode_kv
from planner.serve_flags import role_argv
from planner.simulate import PlanSettings, Traffic
from planner.strategies import (
    BIDIR_STRATEGIES,
    HOST_STRATEGIES,
    MIN_GAIN,
    RECOMPUTE,
    STRATEGIES,
    Strategy,
    pick_paying_memory,
)
from planner.units import memory_hours

BIDIR = BIDIR_STRATEGIES


@dataclass(frozen=True)
class Setting:
    """One deployable setting: ``strategy`` (:data:`planner.ledger.STRATEGIES`),
    ``ttl_s`` (``decoder_kv_blocks_ttl``, s), ``threshold`` (``kv_recompute_threshold``, tokens),
    ``decode_kv_bytes`` (one D's KV space, bytes; None: the profile's, unbounded), P and D counts,
    ``routing`` (the proxy's prefill routing)."""

    strategy: str
    ttl_s: float = 480.0
    threshold: int = 64
    decode_kv_bytes: float | None = None
    prefill_workers: int = 1
    decode_workers: int = 1
    routing: str = "session"

    def label(self) -> str:
        """The setting in one line (TTL, threshold and D space only where they matter)."""
        text = f"{self.strategy}, {self.prefill_workers}P{self.decode_workers}D, routing {self.routing}"
        if self.strategy in BIDIR:
            space = "profile's" if self.decode_kv_bytes is None else f"{self.decode_kv_bytes / GiB:,.1f} GiB"
            text += f", TTL {self.ttl_s:g} s, threshold {self.threshold}, D KV {space}"
        return text


@dataclass(frozen=True)
class Limits:
    """The user's limits: ``ttft_slo_s`` (p90 TTFT, s; None: none), ``decode_kv_bytes`` (the most
    KV space one D may have, bytes; None: the profile's), ``prices``, ``max_prefill_workers``."""

    ttft_slo_s: float | None = None
    decode_kv_bytes: float | None = None
    prices: Prices = field(default_factory=Prices)
    max_prefill_workers: int = 1


@dataclass(frozen=True)
class Grid:
    """The values searched (seconds, tokens, fractions of D's KV space limit)."""

    ttls_s: tuple[float, ...] = (120.0, 480.0, 1800.0, 3600.0)
    thresholds: tuple[int, ...] = (0, 64, 512)
    space_factors: tuple[float, ...] = (0.25, 0.5, 1.0)
    routings: tuple[str, ...] = ("session", "round-robin")


@dataclass
class Evaluated:
    """A setting and its forecast: ``row`` (a ledger row), ``ttft_p90_s``, ``cost_usd`` (None
    without prices), ``feasible`` (keeps up and meets the SLO), ``overload`` (None: it keeps up;
    :mod:`planner.overload`)."""

    setting: Setting
    row: dict
    ttft_p90_s: float
    cost_usd: float | None
    feasible: bool
    overload: Overload | None = None

    @property
    def ttft_mean_s(self) -> float:
        return float(self.row["ttft_mean_s"])

    @property
    def keeps_up(self) -> bool:
        return self.overload is None


def settings_for(base: PlanSettings, s: Setting) -> PlanSettings:
    """``base`` with the setting's TTL, threshold, worker counts and routing."""
    return base.model_copy(update={"decoder_kv_blocks_ttl_s": s.ttl_s, "kv_recompute_threshold": s.threshold,
                                   "prefill_workers": s.prefill_workers, "decode_workers": s.decode_workers,
                                   "routing": s.routing})


def baseline_key(s: Setting) -> tuple:
    """What the ``recompute`` forecast a setting's row is measured against depends on: its workers,
    routing and D space (not its strategy, TTL or threshold: recompute pulls nothing and pins nothing;
    nor ``stop_on_overload``, which stops only a bidirectional forecast)."""
    return (s.prefill_workers, s.decode_workers, s.routing, s.decode_kv_bytes)


def _baseline_one(job: RecommendJob, s: Setting):
    prof = with_decode_kv(job.profile, s.decode_kv_bytes)
    return forecast_strategy(job.traffic, prof, settings_for(job.base, s), RECOMPUTE)


def with_baselines(job: RecommendJob, settings: list[Setting], executor: Executor) -> RecommendJob:
    """``job`` with the ``recompute`` baselines of ``settings`` forecast once each (on ``executor``),
    for every later evaluation to look up rather than each process re-making them."""
    todo = {baseline_key(s): s for s in settings if baseline_key(s) not in job.baselines}
    done = executor.map(_baseline_one, job, list(todo.values()), "recompute baselines") if todo else []
    job.baselines.update(zip(todo, done, strict=True))
    return job


def evaluate(tr: Traffic, profile: CostProfile, base: PlanSettings, s: Setting, limits: Limits,
             baselines: dict | None = None) -> Evaluated:
    """Forecast ``s`` on ``tr`` (see the module doc for the cost). ``baselines``: a memo of the
    ``recompute`` forecasts the rows are measured against (:func:`baseline_key`)."""
    prof, ps = with_decode_kv(profile, s.decode_kv_bytes), settings_for(base, s)
    f = forecast_strategy(tr, prof, ps, s.strategy)
    key = baseline_key(s)
    recompute = None if baselines is None else baselines.get(key)
    if recompute is None:
        recompute = forecast_strategy(tr, prof, ps, RECOMPUTE)
        if baselines is not None:
            baselines[key] = recompute
    row = ledger_row(f, recompute, tr, prof, limits.prices)
    p90 = float(np.quantile(f.ttft_s, 0.9)) if f.overload is None else float("nan")
    cost = None
    if limits.prices.gpu_hour_usd is not None:
        gpus = profile.gpus_per_worker.value if profile.gpus_per_worker else 1.0
        span_h = tr.horizon_s / 3600
        memory = (row["gpu_memory_usd"] or 0.0) + (row["host_memory_usd"] or 0.0)
        cost = memory - row["saved_prefill_usd"] + (s.prefill_workers - 1) * gpus * span_h * limits.prices.gpu_hour_usd
    feasible = f.overload is None and (limits.ttft_slo_s is None or p90 <= limits.ttft_slo_s)
    return Evaluated(s, row, p90, cost, feasible, f.overload)


@dataclass(frozen=True)
class RecommendJob:
    """What every task of a recommendation's search shares (:mod:`planner.executor`)."""

    traffic: Traffic
    profile: CostProfile
    base: PlanSettings
    limits: Limits
    baselines: dict = field(default_factory=dict, compare=False)


def _evaluate_one(job: RecommendJob, s: Setting) -> Evaluated:
    return evaluate(job.traffic, job.profile, job.base, s, job.limits, job.baselines)


def _search_one(job: RecommendJob, s: Setting) -> Evaluated:
    """A setting of the search: an overloaded one is only named so (its forecast stops there)."""
    quick = job.base.model_copy(update={"stop_on_overload": True})
    return evaluate(job.traffic, job.profile, quick, s, job.limits, job.baselines)


def candidates(profile: CostProfile, current: Setting, limits: Limits, grid: Grid,
               fleets: dict[str, list[tuple[int, int]]] | None = None) -> list[Setting]:
    """The settings searched: every strategy the profile can forecast, P counts up to the limit,
    the grid's routings; bidirectional ones over TTL x threshold x D space (within the limit).
    ``fleets`` (strategy -> fleets as (P, D) workers, from :mod:`planner.fleet`): only those
    strategies, each at its fleet, instead of P counts, with D's KV space the limit's and the
    bidirectional ones at the current routing (the fleet was sized with it)."""
    has_host = profile.host_kv_space_bytes is not None and profile.host_read_bandwidth_bytes_per_s is not None
    space_max = limits.decode_kv_bytes or (profile.decode_kv_space_bytes.value if profile.decode_kv_space_bytes
                                           else None)
    spaces = [None] if space_max is None else [space_max * f for f in grid.space_factors]
    if fleets is not None:
        spaces = [limits.decode_kv_bytes]
    out = []
    for strategy in STRATEGIES:
        if strategy in HOST_STRATEGIES and not has_host or (fleets is not None and strategy not in fleets):
            continue
        sizes = ([(p, current.decode_workers) for p in range(1, limits.max_prefill_workers + 1)] if fleets is None
                 else list(dict.fromkeys(fleets[strategy])))
        routings = (current.routing,) if fleets is not None and strategy in BIDIR else grid.routings
        for (p, d) in sizes:
            for routing in routings:
                one = replace(current, strategy=strategy, prefill_workers=p, decode_workers=d, routing=routing)
                if strategy in BIDIR:
                    out += [replace(one, ttl_s=t, threshold=k, decode_kv_bytes=d) for t in grid.ttls_s
                            for k in grid.thresholds for d in spaces]
                else:
                    out.append(one)
    return out


def _held(e: Evaluated) -> float:
    """GiB-seconds a setting holds out of other requests' reach (D pinned plus host)."""
    return float(e.row["d_pinned_gib_s"] + e.row["host_gib_s"])


def choose(evaluated: list[Evaluated], priced: bool) -> Evaluated:
    """The recommended setting of ``evaluated`` (rules in the module doc); when none is feasible,
    the lowest p90 TTFT of those that keep up (the least overloaded when none does)."""
    feasible = [e for e in evaluated if e.feasible]
    if feasible:   # the cheapest fleet first (fleet sizing: the fewest workers that meet the SLO)
        fewest = min(e.setting.prefill_workers + e.setting.decode_workers for e in feasible)
        feasible = [e for e in feasible if e.setting.prefill_workers + e.setting.decode_workers == fewest]
    if not feasible:
        keep = [e for e in evaluated if e.keeps_up]
        if keep:
            return min(keep, key=lambda e: e.ttft_p90_s)
        return min(evaluated, key=lambda e: np.inf if np.isnan(e.overload.factor) else e.overload.factor)
    best = min(e.ttft_mean_s for e in feasible)
    if priced:
        near = [e for e in feasible if e.ttft_mean_s <= best * (1 + MIN_GAIN)]
        return min(near, key=lambda e: (e.cost_usd, e.ttft_mean_s))
    return pick_paying_memory(feasible, lambda e: e.setting.strategy, lambda e: e.ttft_mean_s, _held)


# -- rendering ------------------------------------------------------------------------------------

def _lines(s: Setting, model: str, host_kv_bytes: float | None, platform: str,
           connector: Connector | None = None) -> list[str]:
    out = [f"# proxy: prefill routing {s.routing}; {s.prefill_workers} prefill, {s.decode_workers} decode worker(s)"]
    for role in (Role.PREFILL, Role.DECODE):
        argv = role_argv(s, role, model, host_kv_bytes, platform, connector)
        out.append(f"# {role}: vllm serve")
        flags, i = [], 0
        while i < len(argv):
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                flags.append(f"  {argv[i]} {argv[i + 1]}")
                i += 2
            else:
                flags.append(f"  {argv[i]}")
                i += 1
        out += [f"{role}{f}" for f in flags]
    return out


def config_diff(current: Setting, recommended: Setting, model: str, host_kv_bytes: float | None,
                platform: str = "gpu", connector: Connector | None = None) -> str:
    """A unified diff of the two settings' flags, one flag per line, prefixed by role."""
    return "\n".join(difflib.unified_diff(_lines(current, model, host_kv_bytes, platform, connector),
                                          _lines(recommended, model, host_kv_bytes, platform, connector),
                                          "current", "recommended", lineterm="", n=50))


KNOBS = ("strategy", "ttl_s", "threshold", "decode_kv_bytes", "prefill_workers", "decode_workers", "routing")


@dataclass
class Recommendation:
    """What :func:`recommend` found: the current and recommended :class:`Evaluated`, each changed
    knob's forecast alone (``knob_effects``: knob -> Evaluated), every setting searched, and the
    ``what_would_change`` lines (bidirectional transfer against ``pd`` under other conditions)."""

    current: Evaluated
    recommended: Evaluated
    knob_effects: dict[str, Evaluated]
    searched: list[Evaluated]
    what_would_change: list[str]

    @property
    def enables_bidir(self) -> bool:
        return self.recommended.setting.strategy in BIDIR


@dataclass(frozen=True)
class WhatIf:
    """One case of :func:`what_would_change`: its label, profile, setting (``pd`` and ``pd-bidir`` are
    forecast at it) and traffic."""

    label: str
    profile: CostProfile
    setting: Setting
    traffic: Traffic


def _what_if_one(job: RecommendJob, item: tuple[WhatIf, str, object]) -> Evaluated:
    case, strategy, baseline = item
    return evaluate(case.traffic, case.profile, job.base, replace(case.setting, strategy=strategy), job.limits,
                    {baseline_key(case.setting): baseline})


def _what_if_baseline(job: RecommendJob, case: WhatIf):
    prof = with_decode_kv(case.profile, case.setting.decode_kv_bytes)
    return forecast_strategy(case.traffic, prof, settings_for(job.base, case.setting), RECOMPUTE)


def what_would_change(tr: Traffic, profile: CostProfile, base: PlanSettings, current: Setting,
                      limits: Limits, executor: Executor | None = None) -> list[str]:
    """Mean TTFT of ``pd-bidir`` against ``pd`` (the current TTL and threshold) when sessions
    outgrow P's cache (an eighth of P's KV space), with two P workers round-robin, and with the
    traffic's gaps halved (arrivals at half the time); each figure with its 80% interval
    (:func:`figure_intervals`) or "no held-out interval". The six forecasts run on ``executor``
    (None: here, one after another)."""
    cases = []
    if profile.prefill_kv_space_bytes is not None:
        small = profile.model_copy(update={"prefill_kv_space_bytes": Sourced(
            value=profile.prefill_kv_space_bytes.value / 8, source="what-if: an eighth of P's KV space")})
        cases.append(WhatIf("P's KV space an eighth of the profile's (sessions per P past P's cache)", small, current,
                            tr))
    cases.append(WhatIf("two P workers, round-robin routing", profile,
                        replace(current, prefill_workers=2, routing="round-robin"), tr))
    half = Traffic(**{**tr.__dict__, "arrival_s": tr.arrival_s / 2, "gap_s": tr.gap_s / 2})   # paced sends too
    cases.append(WhatIf("gaps halved (arrivals at half the time)", profile, current, half))
    run, job = executor or LocalExecutor(1), RecommendJob(tr, profile, base, limits)
    baselines = run.map(_what_if_baseline, job, cases, "what would change it: recompute")   # once per case
    items = [(c, st, b) for c, b in zip(cases, baselines, strict=True) for st in (Strategy.PD, Strategy.PD_BIDIR)]
    done = run.map(_what_if_one, job, items, "what would change it")
    with_iv = partial(_with_iv, quiet=profile.held_out is None)
    out = []
    for k, case in enumerate(cases):
        pd_, bd = done[2 * k], done[2 * k + 1]
        prof, label = case.profile, case.label
        if not (bd.keeps_up and pd_.keeps_up):
            out.append(f"{label}: " + "; ".join(f"{e.setting.strategy} {e.overload.text()}" for e in (bd, pd_)
                                                if not e.keeps_up) + " (no TTFT to compare)")
            continue
        gain = 1 - bd.ttft_mean_s / pd_.ttft_mean_s
        ib, ip = figure_intervals(prof, bd), figure_intervals(prof, pd_)
        bd_t = with_iv(f"{bd.ttft_mean_s * 1e3:,.1f} ms", *ib["ttft_mean"], _ms, " ms")
        pd_t = with_iv(f"{pd_.ttft_mean_s * 1e3:,.1f} ms", *ip["ttft_mean"], _ms, " ms")
        pinned = with_iv(memory_hours(bd.row['d_pinned_gib_s']), *ib["d_pinned"], memory_hours)
        out.append(f"{label}: {Strategy.PD_BIDIR} mean TTFT {bd_t} vs {Strategy.PD} {pd_t} ({gain:+.1%}; D pinned {pinned})")
    return out


def _fewer_changes(tr: Traffic, profile: CostProfile, base: PlanSettings, current: Setting, rec: Evaluated,
                   limits: Limits, baselines: dict | None = None) -> Evaluated:
    """``rec`` with every knob put back to its current value where that costs at most :data:`MIN_GAIN`
    of mean TTFT, no held memory and no money (0.1% slack): a diff lists only the knobs that buy
    memory, money or more TTFT than the planner's margin."""
    for knob in KNOBS[1:]:
        value = getattr(current, knob)
        if getattr(rec.setting, knob) == value:
            continue
        back = evaluate(tr, profile, base, replace(rec.setting, **{knob: value}), limits, baselines)
        same_cost = back.cost_usd is None or rec.cost_usd is None or back.cost_usd <= rec.cost_usd + 1e-3 * abs(rec.cost_usd)
        if (back.feasible and back.ttft_mean_s <= rec.ttft_mean_s * (1 + MIN_GAIN)
                and _held(back) <= _held(rec) * 1.001 + 1e-9 and same_cost):
            rec = back
    return rec


def recommend(tr: Traffic, profile: CostProfile, base: PlanSettings, current: Setting, limits: Limits,
              grid: Grid = Grid(), fleets: dict[str, list[tuple[int, int]]] | None = None,
              executor: Executor | None = None) -> Recommendation:
    """Search :func:`candidates` (``fleets``: each strategy at its sized fleet) on ``executor``
    (default: in this process) and pick with :func:`choose` (see the module doc)."""
    settings = candidates(profile, current, limits, grid, fleets)
    run = executor or LocalExecutor(1)
    # each recompute baseline once (the search's processes would each re-make those they meet)
    job = with_baselines(RecommendJob(tr, profile, base, limits), [*settings, current], run)
    searched = run.map(_search_one, job, settings, "searching settings")
    cur = evaluate(tr, profile, base.model_copy(update={"stop_on_overload": True}), current, limits, job.baselines)
    rec = choose(searched, limits.prices.gpu_hour_usd is not None)
    rec = _fewer_changes(tr, profile, base, current, rec, limits, job.baselines)
    alone = {}
    for knob in KNOBS:
        value = getattr(rec.setting, knob)
        if value != getattr(current, knob):
            one = replace(current, **{knob: value})
            if knob != "strategy" and current.strategy not in BIDIR and knob in ("ttl_s", "threshold", "decode_kv_bytes"):
                one = replace(one, strategy=rec.setting.strategy)
            alone[knob] = one
    job = with_baselines(job, list(alone.values()), run)
    effects = dict(zip(alone, run.map(_evaluate_one, job, list(alone.values()), "each knob alone"), strict=True))
    at_fleet = replace(current, prefill_workers=rec.setting.prefill_workers, decode_workers=rec.setting.decode_workers)
    changes = [] if rec.setting.strategy in BIDIR else what_would_change(tr, profile, base, at_fleet, limits, executor)
    return Recommendation(cur, rec, effects, searched, changes)


def _fmt(knob: str, v) -> str:
    if knob == "decode_kv_bytes":
        return "profile's" if v is None else f"{v / GiB:,.1f} GiB"
    return str(v)


def figure_intervals(profile: CostProfile, e: Evaluated) -> dict:
    """The 80% intervals of an :class:`Evaluated`'s printed figures (NaN ends: none): ``ttft_mean``,
    ``ttft_p90`` (seconds), ``hit_rate``, ``d_pinned`` (GiB-s; (0, 0) for a strategy that pins nothing
    on D, where the TTFTs have intervals). The row's own intervals (:func:`planner.ledger.ledger_intervals`) where it has
    them; p90 from the same TTFT ratios."""
    row = e.row
    has = not np.isnan(row["ttft_mean_interval_low_s"])
    pinned = (((0.0, 0.0) if has else intervals.NONE) if e.setting.strategy not in BIDIR else
              (row["d_pinned_interval_low_gib_s"], row["d_pinned_interval_high_gib_s"]))
    return {"ttft_mean": (row["ttft_mean_interval_low_s"], row["ttft_mean_interval_high_s"]),
            "ttft_p90": intervals.ttft_interval(profile, row["mode"], e.ttft_p90_s) if has else intervals.NONE,
            "hit_rate": (row["hit_rate_interval_low"], row["hit_rate_interval_high"]), "d_pinned": pinned}


def change_intervals(profile: CostProfile, e: Evaluated, cur: Evaluated) -> dict:
    """Intervals of ``e`` against ``cur``: ``speedup`` (cur / e mean TTFT), ``ttft_change`` (e - cur
    mean TTFT, s: minus :func:`intervals.ttft_saved_interval`), ``d_pinned_change`` (GiB-s: each side
    at its own extreme). NaN ends where either side has none."""
    fe, fc = figure_intervals(profile, e), figure_intervals(profile, cur)
    both = not (np.isnan(fe["ttft_mean"][0]) or np.isnan(fc["ttft_mean"][0]))
    speed = (intervals.speedup_interval(profile, e.row["mode"], cur.row["mode"], cur.ttft_mean_s / e.ttft_mean_s)
             if both and e.ttft_mean_s > 0 else intervals.NONE)
    saved = (intervals.ttft_saved_interval(profile, e.row["mode"], cur.row["mode"], cur.ttft_mean_s, e.ttft_mean_s)
             if both else intervals.NONE)
    pe, pc = fe["d_pinned"], fc["d_pinned"]
    return {"speedup": speed, "ttft_change": (-saved[1], -saved[0]), "d_pinned_change": (pe[0] - pc[1], pe[1] - pc[0])}


def _ms(x: float) -> str:
    return f"{x * 1e3:,.1f}"


def _signed_ms(x: float) -> str:
    return f"{x * 1e3:+,.1f}"


def _signed_hours(gib_s: float) -> str:
    return ("+" if gib_s >= 0 else "-") + memory_hours(abs(gib_s))


def describe(r: Recommendation, profile: CostProfile, base: PlanSettings, limits: Limits, model: str,
             platform: str = "gpu", topology=None) -> str:
    """The recommendation in plain text: a FORECAST with its inputs, each figure with its 80% interval
    (or "no held-out interval" and why), the knobs, the config diff of the ``vllm serve`` flags and
    of the topology file (``topology``: the current deployment's
    :class:`serving.topology.Topology`; None: :func:`recommend_topology.default_topology`)."""
    from planner import recommend_topology as rt

    tag = profile.label()
    cur, rec = r.current, r.recommended
    slo = "none" if limits.ttft_slo_s is None else f"p90 TTFT <= {limits.ttft_slo_s:g} s"
    gpu_price = "none" if limits.prices.gpu_hour_usd is None else f"GPU-hour ${limits.prices.gpu_hour_usd:g}"
    host_price = ("" if limits.prices.host_gib_hour_usd is None
                  else f", host GiB-hour ${limits.prices.host_gib_hour_usd:g}")

    with_iv = partial(_with_iv, quiet=profile.held_out is None)   # the intervals line says it once

    def line(name: str, e: Evaluated) -> str:
        iv = figure_intervals(profile, e)
        hit = ("not forecast" if np.isnan(e.row["hit_rate"]) else
               with_iv(f"{e.row['hit_rate']:.1%}", *iv["hit_rate"], lambda x: f"{x * 100:.1f}", "%"))
        ttft = (f"{e.overload.text()} (no TTFT)" if e.overload is not None else
                f"mean TTFT {with_iv(_ms(e.ttft_mean_s) + ' ms', *iv['ttft_mean'], _ms, ' ms')}, "
                f"p90 {with_iv(_ms(e.ttft_p90_s) + ' ms', *iv['ttft_p90'], _ms, ' ms')}")
        pinned = ("not forecast" if np.isnan(e.row["d_pinned_gib_s"]) else
                  with_iv(memory_hours(e.row['d_pinned_gib_s']), *iv['d_pinned'], memory_hours))
        return (f"  {name:<11} {e.setting.label()}: {ttft}, hit rate {hit}, D pinned {pinned}, host "
                f"{memory_hours(e.row['host_gib_s'])}")

    ch = change_intervals(profile, rec, cur)
    if cur.keeps_up and rec.keeps_up:
        speed = "mean-TTFT speed-up " + with_iv(f"{cur.ttft_mean_s / rec.ttft_mean_s:.2f}x", *ch["speedup"],
                                                lambda x: f"{x:.2f}", "x")
    else:
        speed = "no speed-up: " + ("the current setting" if not cur.keeps_up else "the recommended one") + \
                " cannot keep up with this load"
    lines = [(f"Recommendation ({tag}; {len(r.searched)} settings searched; SLO {slo}; D KV space at most "
              f"{_fmt('decode_kv_bytes', limits.decode_kv_bytes)}; prices: {gpu_price}{host_price})."),
             line("current", cur),
             line("recommended", rec) + ("" if rec.feasible else " (NO setting meets the SLO: the one closest to it)"),
             f"  recommended vs current: {speed}"]
    for knob, e in r.knob_effects.items():
        ke = change_intervals(profile, e, cur)
        cost = "" if e.cost_usd is None or cur.cost_usd is None else f", cost {e.cost_usd - cur.cost_usd:+,.2f} USD"
        if not (e.keeps_up and cur.keeps_up):
            lines.append(f"  knob {knob}: {_fmt(knob, getattr(cur.setting, knob))} -> {_fmt(knob, getattr(rec.setting, knob))} "
                         f"alone: {'keeps up' if e.keeps_up else e.overload.text()} (no TTFT change: "
                         f"{'the current setting' if not cur.keeps_up else 'it'} cannot keep up)")
            continue
        dp = with_iv(_signed_hours(e.row['d_pinned_gib_s'] - cur.row['d_pinned_gib_s']), *ke["d_pinned_change"],
                     _signed_hours)
        lines.append(f"  knob {knob}: {_fmt(knob, getattr(cur.setting, knob))} -> "
                     f"{_fmt(knob, getattr(rec.setting, knob))} alone: mean TTFT "
                     f"{with_iv(_signed_ms(e.ttft_mean_s - cur.ttft_mean_s) + ' ms', *ke['ttft_change'], _signed_ms, ' ms')}"
                     f", D pinned {dp}"
                     f", host {_signed_hours(e.row['host_gib_s'] - cur.row['host_gib_s'])}{cost}")
    notes = sorted({n for e in (cur, rec) for n in str(e.row["interval_note"]).split("; ")
                    if n and not n.startswith("80% intervals from") and "never checked" not in n})
    lines += [f"  note: {n}" for n in notes]
    if not r.enables_bidir:
        lines.append("  Do not enable bidirectional transfer for this traffic: holding the previous turn on D does "
                     f"not beat the best setting without it by more than {MIN_GAIN:.0%} of mean TTFT. What would change it:")
        lines += [f"    {w}" for w in r.what_would_change]
    host_kv = profile.host_kv_space_bytes.value if profile.host_kv_space_bytes else None
    lines.append("\nConfig diff (current -> recommended; one flag per line, by role):")
    conn = topology.connector if topology is not None else None
    lines.append(config_diff(cur.setting, rec.setting, model, host_kv, platform, conn) or "  (no change)")
    base_topo = topology if topology is not None else rt.default_topology(model, platform)
    _, tdiff = rt.topology_diff(base_topo, cur.setting, rec.setting, host_kv)
    lines.append(f"\nTopology file diff (current -> recommended; base: topology {base_topo.name}):")
    lines.append(tdiff or "  (no change)")
    return "\n".join(lines)


def recommendation_row(r: Recommendation, profile: CostProfile, model: str, platform: str = "gpu",
                       topology=None) -> dict:
    """The ``plan_recommendations`` row of ``r`` (docs/schema/plans.md): both settings, their figures with
    80% intervals (NaN: none), the speed-up, the knob effects, the flags and topology diffs."""
    from dataclasses import asdict

    from planner import recommend_topology as rt

    cur, rec = r.current, r.recommended
    row: dict = {"current_setting": asdict(cur.setting), "recommended_setting": asdict(rec.setting),
                 "current_label": cur.setting.label(), "recommended_label": rec.setting.label(),
                 "settings_searched": len(r.searched), "feasible": rec.feasible, "enables_bidir": r.enables_bidir}
    for side, e in (("current", cur), ("recommended", rec)):
        iv = figure_intervals(profile, e)
        for name, value, key, unit in (("ttft_mean", e.ttft_mean_s, "ttft_mean", "_s"),
                                       ("ttft_p90", e.ttft_p90_s, "ttft_p90", "_s"),
                                       ("hit_rate", e.row["hit_rate"], "hit_rate", ""),
                                       ("d_pinned", e.row["d_pinned_gib_s"], "d_pinned", "_gib_s")):
            row[f"{side}_{name}{unit}"] = value
            row[f"{side}_{name}_interval_low{unit}"], row[f"{side}_{name}_interval_high{unit}"] = iv[key]
        row[f"{side}_host_gib_s"] = e.row["host_gib_s"]
    ch = change_intervals(profile, rec, cur)
    row["speedup"] = cur.ttft_mean_s / rec.ttft_mean_s if rec.ttft_mean_s > 0 else None
    row["speedup_interval_low"], row["speedup_interval_high"] = ch["speedup"]
    row["cost_change_usd"] = (None if rec.cost_usd is None or cur.cost_usd is None else rec.cost_usd - cur.cost_usd)
    def finite(x: float) -> float | None:   # JSON has no NaN: a change against an overloaded setting is None
        return None if x is None or not np.isfinite(x) else float(x)

    row["knob_effects"] = {k: {"from": getattr(cur.setting, k), "to": getattr(rec.setting, k),
                               "ttft_mean_change_s": finite(e.ttft_mean_s - cur.ttft_mean_s),
                               "d_pinned_change_gib_s": finite(e.row["d_pinned_gib_s"] - cur.row["d_pinned_gib_s"]),
                               "overload": None if e.overload is None else e.overload.text()}
                           for k, e in r.knob_effects.items()}
    row["current_overload"] = None if cur.overload is None else cur.overload.text()
    row["recommended_overload"] = None if rec.overload is None else rec.overload.text()
    row["what_would_change"] = list(r.what_would_change)
    host_kv = profile.host_kv_space_bytes.value if profile.host_kv_space_bytes else None
    row["flags_diff"] = config_diff(cur.setting, rec.setting, model, host_kv, platform,
                                    topology.connector if topology is not None else None)
    base_topo = topology if topology is not None else rt.default_topology(model, platform)
    row["recommended_topology"], row["topology_diff"] = rt.topology_diff(base_topo, cur.setting, rec.setting, host_kv)
    row["interval_note"] = "; ".join(dict.fromkeys(n for e in (cur, rec) for n in str(e.row["interval_note"]).split("; ")
                                                   if n))
    return row
