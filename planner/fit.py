"""A cost profile fitted from recorded runs' own turns (the planner's "measured here" profile).

Formulas and sources in docs/planner/profiles.md:

* c(x) and b0 per mode: one robust joint fit (:func:`fit_costs`) of ``ttft - pull(pulled) =
  b0[mode] + c(n) - c(cached)`` over the ok turns of every mode, with each turn's measured cached
  and pulled tokens; P/D modes share c, the aggregated worker has its own;
* P's pull of D's KV: the Sweep page's ``analysis.sweep_stats.transfer_s_per_token`` (P's NIXL bytes
  over NIXL seconds in the ``pd-bidir*`` runs, vLLM's ``vllm:nixl_*`` metrics), as bandwidth;
* where a run did not record the worker's own prefix-cache hit (aggregated serving: vLLM reports
  ``usage.prompt_tokens_details`` only when asked), the planner's forecast of it for that run;
* KV space of each role: ``num_gpu_blocks x block_size`` of vLLM's ``vllm:cache_config_info``
  gauge on that role's workers, times the model's KV bytes per token;
* decode time per token: the median TPOT of the runs' ok turns;
* the speed probe's TTFT where the costs were measured: the median of the runs' median probe
  TTFTs (``run_probes``), so a forecast of another run can be put on that run's speed; the fit
  puts each run's turns on that speed first (:func:`run_speed_factors`), so runs of different
  modes recorded while the machine ran at different speeds are compared on one;
* the system prompt shared across sessions: :func:`recorded_shared_prefix_tokens`;
* P/D's hand-off, where the runs scraped D's request histograms: D's wait for P's KV and D's first
  step (:func:`handoff_terms`), taken out of the P/D modes' b0;
* P's wait for an async pull beyond its bytes (``pull_latency_s``), where the bidirectional runs
  scraped P's request queue time (:func:`pull_latency_term`), before the cost fit;
* each fitted figure's source ends with its fit's residuals over the turns it rests on and the
  range of computed and prompt tokens it was fitted over (:mod:`planner.fit_residuals`),
  so a profile says where its forecasts extrapolate.

Raises :class:`FitError` when the runs cannot give a figure the planner needs (no turns, no timed
KV transfer, no KV bytes per token, fewer than 3 distinct computed-token counts).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy.optimize import least_squares

from analysis import sweep_stats as sweep
from analysis import ttft_split
from core.contract import (
    CACHED_PROBE_TOKENS,
    COMPUTE_PROBE_TOKENS,
    PROBE_TOKENS,
    ROUND_ROBIN,
    SESSION,
    WORKER_ROLES,
    Role,
)
from core.modes import AGGREGATED, RECOMPUTE_MODE, SERVING_MODES, serving_mode
from loadgen.traces.recorded_runs import read_recorded_runs
from planner.fit_residuals import Residuals, residuals_of
from planner.profile import MODES, CostProfile, Sourced
from planner.queueing import batched_step_waits, engine_token_budget, fifo_waits
from planner.simulate import RENDERS, TOOK_HANDLE, ModePlan, PlanSettings, Traffic, plan
from store.queries.planner_runs import (
    probe_ttft_s,
    recorded_turns,
    run_config_row,
    transfer_rows,
)
from store.queries.worker_cache import labels_by_role
from store.writer import Store


class FitError(ValueError):
    """The recorded runs do not hold what a fitted profile needs; the message says what."""


def topology_settings(topology: dict | None) -> dict:
    """The :class:`PlanSettings` fields a run's recorded workers (``runs.topology``, written by
    ``serving.stack.ModeStack.topology_row``) fix: its workers per role, and which P workers share
    their compute (the same ``cores``: time-shared, :attr:`PlanSettings.prefill_servers`). Empty for a
    run without recorded workers (attached deployments record their proxy only); a role without
    workers keeps the default 1."""
    by_role: dict[str, list[dict]] = {}
    for w in (topology or {}).get("workers") or []:
        by_role.setdefault(w.get("role"), []).append(w)
    out: dict = {f"{role}_workers": len(by_role[role]) for role in WORKER_ROLES
                 if by_role.get(role)}
    prefill = by_role.get(Role.PREFILL) or []
    if len(prefill) > 1 and all(w.get("cores") for w in prefill):
        labels: dict[tuple, int] = {}
        out["prefill_servers"] = tuple(labels.setdefault(tuple(sorted(w["cores"])), len(labels)) for w in prefill)
    return out


def run_settings(store: Store, run_id: str) -> PlanSettings:
    """The connector, proxy and topology settings ``run_id`` ran with (``run_config``: TTL, margin
    and P's routing, when the planner has it: round-robin or session, else its session routing; the
    recompute threshold from ``runs.config.connector.kv_recompute_threshold``, vLLM's 64 when
    absent; ``rendered_prompts`` for a ``text`` history: chat messages the workers render; its
    workers and P's shared compute from ``runs.topology``, :func:`topology_settings`); P's prefix
    cache by blocks, as vLLM keeps it (``p_cache_blocks``: a recorded run's turns extend their history)."""
    ttl, margin, routing, thr, history, topology = run_config_row(store, run_id)
    topo = json.loads(topology) if isinstance(topology, str) else topology
    planned = {"routing": routing} if routing in (ROUND_ROBIN, SESSION) else {}
    return PlanSettings(decoder_kv_blocks_ttl_s=ttl, handle_ttl_margin_s=margin, kv_recompute_threshold=thr,
                        rendered_prompts=history == "text", p_cache_blocks=True, **planned, **topology_settings(topo))


def recorded_shared_prefix_tokens(turns: pd.DataFrame) -> int:
    """Tokens every session's first turn shares with the sessions before it (a system prompt), as P
    found them in its prefix cache: the median ``prefill_cached_tokens`` of the first turns of
    ``pd``/``pd-bidir`` runs, each run's first session left out (nothing before it); 0 when the
    runs have none. The recorder keeps no token ids (only a hash of each prompt), so P's report is
    the one record of what sessions share; the same traffic replayed in every mode shares the same.
    One prompt for every session: side requests (``fresh``) and archetypes with prompts of their own
    count in the median as they share (docs/planner/concurrency.md: what that costs)."""
    p_cache = [m.name for m in SERVING_MODES if m.disaggregated and m.prefill_prefix_cache]
    first = turns[turns["mode"].isin(p_cache) & (turns["turn_index"] == 0)
                  & (turns["status"] == "ok") & turns["local_tokens"].notna()]
    first = first.sort_values("sent_at")
    later = first[first.groupby("run_id").cumcount() > 0]
    return int(later["local_tokens"].median()) if len(later) else 0


def shared_prefix_by_run(turns: pd.DataFrame) -> dict[str, int]:
    """:func:`recorded_shared_prefix_tokens` per workload (``runs.workload``; runs without one are
    one group), given to each run of it: a store holding several workloads (every `turnscope eval`
    of the default store) has one system prompt per workload, not one for all. ``turns``:
    :func:`store.queries.planner_runs.recorded_turns`' rows. Returns {run_id: tokens}."""
    by_workload = turns["workload"].fillna("") if "workload" in turns else pd.Series("", index=turns.index)
    out: dict[str, int] = {}
    for _, g in turns.groupby(by_workload, sort=False):
        shared = recorded_shared_prefix_tokens(g)
        out |= {str(r): shared for r in g["run_id"].unique()}
    return out


def runs_shared_prefix_tokens(store: Store, run_ids: Sequence[str] | None) -> int:
    """The system prompt ``run_ids``' sessions share (:func:`recorded_shared_prefix_tokens` over
    their recorded turns), 0 without runs: what ``turnscope plan --fit-runs`` and ``turnscope
    recommend --run-ids`` take by default."""
    return recorded_shared_prefix_tokens(recorded_turns(store, run_ids)) if run_ids else 0


def plan_recorded_run(store: Store, run_id: str, mode: str, profile: CostProfile,
                      shared_prefix_tokens: int = 0) -> tuple[Traffic, ModePlan]:
    """``run_id``'s own turns (:mod:`loadgen.traces.recorded_runs`) planned in ``mode`` with the
    run's settings (:func:`run_settings`), ``shared_prefix_tokens`` (a system prompt shared across
    sessions, :func:`recorded_shared_prefix_tokens`) and ``profile``: the traffic and the mode's
    forecast."""
    tr = Traffic.of(read_recorded_runs(store.root, [run_id]))
    settings = run_settings(store, run_id).model_copy(
        update={"modes": (mode,), "shared_prefix_tokens": shared_prefix_tokens})
    return tr, plan(tr, profile, settings).modes[mode]


def run_speed_factors(probes: dict[str, float]) -> dict[str, float]:
    """Run id -> its speed probe TTFT over the median of the runs' (:func:`probe_ttft_s`): how many
    times slower than the reference (the profile's ``probe_ttft_s``) its machine ran; empty when
    no run has a probe."""
    if not probes:
        return {}
    ref = float(np.median(list(probes.values())))
    return {r: t / ref for r, t in probes.items()}


def probe_factors(profile: CostProfile, mode: str, run_compute_s: float | None,
                  run_cached_s: float | None, short_factor: float | None = None) -> tuple[float | None, float | None]:
    """(compute factor, context factor) of a run's probes against ``mode``'s curve c(x) = a1 x + a2 x^2.

    The compute probe (``run_compute_s`` = T(2048) - T(256) from scratch) over the curve's
    c(2048) - c(256) is the compute factor, for the curve (a prompt computed from scratch). The
    cached-prefix probe (``run_cached_s`` = T(2048 cached + 256 new) - T(256)) measures a step on a
    prefix: the profile's ``prefix_step_s`` x ``short_factor`` (a fixed engine cost, scaled as the
    short probe's fixed costs are; 1 when None) plus attention over the prefix, ``a2 x 2^20`` of the
    curve (c(2304) - c(2048) - c(256): the linear terms cancel); what is left after the step over
    that is the context factor. (compute factor, None) with the compute probe alone or a context
    factor <= 0 (probe noise); (None, None) without probes."""
    fit = profile.prefill_fit(mode)
    if run_compute_s is None or run_compute_s <= 0:
        return None, None
    ref = float(fit.cost_s(COMPUTE_PROBE_TOKENS) - fit.cost_s(PROBE_TOKENS))
    one = run_compute_s / ref if ref > 0 else None
    if run_cached_s is None or run_cached_s <= 0 or fit.a2_s <= 0:
        return one, None
    step = (profile.prefix_step_s.value if profile.prefix_step_s else 0.0) * (short_factor or 1.0)
    context = (run_cached_s - step) / (fit.a2_s * (CACHED_PROBE_TOKENS**2 - COMPUTE_PROBE_TOKENS**2 - PROBE_TOKENS**2))
    return (one, context) if context > 0 else (one, None)


def on_path_probe(profile: CostProfile, mode: str, run_path_s: float | None) -> CostProfile:
    """``profile`` (already on the run's speed, :func:`on_run_speed`) with ``mode``'s b0 measured on
    the run by its path probe (``run_path_s``: :func:`store.queries.planner_runs.path_probe_s`, the
    median TTFT of :data:`core.contract.PROBE_TOKENS` fresh tokens sent through the run's proxy):
    that TTFT less what ``profile`` forecasts for the rest of the same request, its compute from
    scratch ``c(PROBE_TOKENS)`` and, in a P/D mode, the hand-off (D's wait for P's KV and D's first
    step). So b0 holds the fixed costs of the path as this run's machine and code paid them (the
    proxy's hops, both workers' frontends), where the short probe's ratio, read straight at P, puts
    the calibration's b0 on a speed that does not see the proxy or D. Unchanged without the probe,
    or where the rest would exceed it (probe noise); seconds throughout."""
    if run_path_s is None or not run_path_s > 0:
        return profile
    compute = float(profile.prefill_compute_s(mode, np.array([PROBE_TOKENS]), np.array([0]))[0])
    handoff = sum(profile.handoff_s(mode))
    b0 = run_path_s - compute - handoff
    if b0 <= 0:
        return profile
    why = (f"measured on the run: its path probe's median TTFT {run_path_s * 1e3:.1f} ms less the forecast "
           f"c({PROBE_TOKENS}) {compute * 1e3:.1f} ms" + (f" and hand-off {handoff * 1e3:.1f} ms" if handoff else "")
           + " (planner.fit.on_path_probe)")
    return profile.model_copy(update={"b0_s": {**profile.b0_s, mode: Sourced(value=b0, source=why)}})


def on_run_speed(profile: CostProfile, run_probe_s: float | None, run_compute_s: float | None = None,
                 mode: str = RECOMPUTE_MODE, run_cached_s: float | None = None,
                 run_path_s: float | None = None) -> tuple[CostProfile, float | None]:
    """``profile`` put on a run's machine speed, each term by the probe that measures its kind of
    work (:meth:`CostProfile.at_speed`): the fixed costs (b0, a step on a prefix) by the run's short
    probe TTFT over the profile's (``run_probe_s``, ``probe_ttft_s``) when both exist; with the run's
    compute probe (``run_compute_s``: :func:`store.queries.planner_runs.compute_probe_s`) the
    engines' compute (the prefill curves, the hand-off, renders) by it over what the profile's own
    c(x) gives for the same tokens (``mode``'s curve: the aggregated worker's in ``aggregated``,
    P's else), ``c(COMPUTE_PROBE_TOKENS) - c(PROBE_TOKENS)``, else by the short probe; with the
    run's cached-prefix probe too (``run_cached_s``: :func:`store.queries.planner_runs.cached_probe_s`)
    attention over a prefix by its own factor (:func:`probe_factors`); with the run's path probe
    (``run_path_s``) ``mode``'s b0 measured on the run (:func:`on_path_probe`), in place of the
    short probe's ratio. Unchanged without probes. Returns (profile, the short probe's factor or None)."""
    factor = (run_probe_s / profile.probe_ttft_s.value
              if run_probe_s is not None and profile.probe_ttft_s is not None else None)
    compute, context = probe_factors(profile, mode, run_compute_s, run_cached_s, factor)
    why = None if compute is None else _compute_why(run_compute_s, compute, run_cached_s, context)
    if factor is not None:
        profile = profile.at_speed(factor, f"speed probe {run_probe_s * 1e3:.1f} ms on the run vs "
                                           f"{profile.probe_ttft_s.value * 1e3:.1f} ms where fitted", compute, why, context)
    elif compute is not None:
        profile = profile.at_speed(1.0, "no speed probe", compute, why, context)
    return on_path_probe(profile, mode, run_path_s), factor


def _compute_why(run_compute_s: float, factor: float, run_cached_s: float | None = None,
                 context: float | None = None) -> str:
    if context is None:
        return (f"compute probe: {COMPUTE_PROBE_TOKENS:,} less {PROBE_TOKENS} tokens took {run_compute_s * 1e3:.1f} ms "
                f"on the run, {factor:.3g}x the profile's c(x)")
    return (f"compute probe {run_compute_s * 1e3:.1f} ms and cached-prefix probe {run_cached_s * 1e3:.1f} ms on the "
            f"run: the curve x {factor:.3g}, attention over a prefix x {context:.3g}")


def _kv_space(store: Store, run_ids: Sequence[str]) -> dict[str, int]:
    """Role -> tokens of KV space (num_gpu_blocks x block_size of vllm:cache_config_info)."""
    out = {}
    for role, lab in labels_by_role(store, run_ids).items():
        try:
            out[role] = int(lab["num_gpu_blocks"]) * int(lab["block_size"])
        except (KeyError, TypeError, ValueError):
            continue
    return out


#: Each worker role and the profile field of its KV space (bytes).
KV_SPACE_FIELDS: tuple[tuple[Role, str], ...] = tuple((role, f"{role}_kv_space_bytes") for role in WORKER_ROLES)


def on_run_kv_space(profile: CostProfile, store: Store, run_id: str) -> CostProfile:
    """``profile`` with the KV space each role's workers reported in ``run_id``'s own scrapes
    (``vllm:cache_config_info``: num_gpu_blocks x block_size, times the profile's KV bytes per token)
    where it differs from the profile's, e.g. a capacity step's small D (``turnscope capacity``'s
    ``--kv-cache-memory-bytes`` on the decode role): a recorded run is planned with the workers it
    ran on. Roles the run did not scrape keep the profile's space."""
    kv = profile.kv_bytes_per_token.value
    space = _kv_space(store, [run_id])
    update = {}
    for role, field in KV_SPACE_FIELDS:
        tokens = space.get(role)
        current = getattr(profile, field)
        if tokens is not None and (current is None or current.value != tokens * kv):
            update[field] = Sourced(value=tokens * kv, source=f"run {run_id}'s own {role} workers: "
                                                            "vllm:cache_config_info num_gpu_blocks x block_size")
    return profile.model_copy(update=update) if update else profile


def fit_profile(store: Store, run_ids: Sequence[str], name: str = "fitted") -> CostProfile:
    """The profile of the deployment that recorded ``run_ids`` (see the module doc). Raises FitError."""
    turns = recorded_turns(store, run_ids)
    if turns.empty:
        raise FitError(f"no turns recorded for runs {', '.join(run_ids)}")
    where = f"runs {', '.join(sorted(set(turns['run_id'])))}"
    transfer = transfer_rows(store, run_ids)
    per = sweep.transfer_s_per_token(transfer)
    kv = transfer["kv_bytes_per_token"].dropna()
    if kv.empty:
        raise FitError(f"{where}: KV bytes per token unknown (runs.config.kv_bytes_per_token)")
    kv_bytes = float(kv.iloc[0])
    if per.empty or math.isnan(float(per["bandwidth_bytes_per_s"].iloc[0])):
        raise FitError(f"{where}: no pd-bidir* run recorded a NIXL transfer on P (vllm:nixl_* metrics)")
    bandwidth = float(per["bandwidth_bytes_per_s"].iloc[0])
    src = f"fitted from {where}"
    prof = CostProfile(
        name=name, description=f"Fitted from the recorded runs' own turns ({where}).",
        block_size=_block_size(store, run_ids),
        kv_bytes_per_token=Sourced(value=kv_bytes, source=f"{src} (runs.config.kv_bytes_per_token)"),
        prefill_a1_s_per_token=Sourced(value=0.0, source="placeholder until fitted"),
        b0_default_s=Sourced(value=0.0, source="placeholder until fitted"),
        pull_bandwidth_bytes_per_s=Sourced(value=bandwidth, source=f"{src}: P's vllm:nixl_bytes_transferred "
                                                                   "over vllm:nixl_xfer_time_seconds" + _pulls(turns)),
        left_out=["pull_latency_s: no bidirectional run scraped P's request queue time (0)"])
    space = _kv_space(store, run_ids)
    for role, field in KV_SPACE_FIELDS:
        if role in space:
            setattr(prof, field, Sourced(value=space[role] * kv_bytes,
                                         source=f"{src}: vllm:cache_config_info num_gpu_blocks x block_size"))
    budget = engine_token_budget(store, run_ids)
    if budget is not None:
        prof.max_num_batched_tokens = Sourced(value=budget[0], source=f"{src}: {budget[1]}")
    probes = probe_ttft_s(store, run_ids)
    if probes:
        prof.probe_ttft_s = Sourced(value=float(np.median(list(probes.values()))),
                                    source=f"{src}: median over {len(probes)} runs of each run's median speed probe "
                                           "TTFT (run_probes)")
    tpot = turns.loc[(turns["status"] == "ok"), "tpot_s"].dropna()
    if not tpot.empty:
        lo, hi = np.quantile(tpot, [0.1, 0.9])
        prof.decode_s_per_token = Sourced(value=float(tpot.median()), source=(
            f"{src}: median TPOT of {len(tpot)} ok turns (10th-90th percentile {lo * 1e3:.1f}-{hi * 1e3:.1f} ms)"))
    speed = run_speed_factors(probes)
    latency = pull_latency_term(store, run_ids, prof, speed)
    if latency is not None:   # before the cost fit, whose pull(pulled) then holds it, not the bidirectional b0
        prof.pull_latency_s = latency
        prof.left_out = [x for x in prof.left_out if not x.startswith("pull_latency_s")]
    costs = fit_costs(_with_forecast_local(store, turns, prof), prof, speed=speed)   # the cache model needs no costs
    if costs is None:
        raise FitError(f"{where}: the cost fit needs ok turns with 3 or more distinct computed-token counts")
    how = (f"{src}: {FIT_METHOD} over {costs.turns} ok turns of {len(costs.b0_s)} modes"
           + (f", each run's TTFT put on the median speed probe's speed (factors "
              f"{min(speed.values()):.3g}-{max(speed.values()):.3g})" if speed else "")
           + f" ({costs.rounds} fit/queue rounds)"
           + (f" ({costs.forecast_local} turns' own-cache hit not recorded: the planner's forecast of it)"
              if costs.forecast_local else ""))
    def with_fit(key: str, what: str) -> str:
        r = costs.residuals.get(key)
        return how + (f"; {what} {r.describe()}" if r else "")

    pd_src = with_fit("pd_prefill", "P/D turns:")
    prof.prefill_a1_s_per_token = Sourced(value=costs.a1_s, source=pd_src)
    prof.prefill_a2_s_per_token2 = Sourced(value=costs.a2_s, source=pd_src)
    if costs.render_s is not None:
        prof.render_s_per_token = Sourced(value=costs.render_s, source=with_fit("render", "text-history turns:")
                                          + "; chat render per prompt token and render, from the text-history turns")
    if costs.aggregated_a1_s is not None:
        agg_src = with_fit(AGGREGATED, "aggregated turns:")
        prof.aggregated_prefill_a1_s_per_token = Sourced(value=costs.aggregated_a1_s, source=agg_src)
        prof.aggregated_prefill_a2_s_per_token2 = Sourced(value=costs.aggregated_a2_s, source=agg_src)
    prof.b0_s = {m: Sourced(value=v, source=with_fit(m, f"{m} turns:")) for m, v in costs.b0_s.items()}
    prof.b0_s.update(sibling_b0(prof.b0_s))
    default = costs.b0_s.get(RECOMPUTE_MODE, float(np.median(list(costs.b0_s.values()))))
    prof.b0_default_s = Sourced(value=default, source=f"{how}; {RECOMPUTE_MODE}'s b0 (else the median of the modes')")
    return with_handoff(prof, handoff_terms(store, run_ids, decode_step_factors(turns, prof.decode_s_per_token)))


def decode_step_factors(turns: pd.DataFrame, decode_s: Sourced | None) -> dict[str, float]:
    """Run id -> its median TPOT over ``decode_s`` (the fit's decode step, seconds): how many times
    slower than the fit's reference each run's engine steps ran. The hand-off's terms are engine
    steps on D (D's first step is a forward pass of one token on the prompt's context, as a decode
    step is; D's wait for P's KV is the steps its scheduler runs until the read is done), so
    :func:`handoff_terms` puts each run's on the reference's speed by these, and a forecast scales
    them by the run's compute probe (:meth:`planner.profile.CostProfile.at_speed`), not by the short
    probe, whose fixed HTTP and frontend cost can move the other way (docs/planner/calibration.md).
    ``turns``: :func:`store.queries.planner_runs.recorded_turns` rows (``tpot_s`` of ok turns).
    Empty without ``decode_s`` or TPOTs."""
    if decode_s is None or decode_s.value <= 0:
        return {}
    ok = turns[(turns["status"] == "ok") & turns["tpot_s"].notna()]
    return {str(r): float(g.median()) / decode_s.value for r, g in ok.groupby("run_id")["tpot_s"]}


#: The hand-off's profile fields and the measured term (:func:`analysis.ttft_split.measured_terms`) of each.
HANDOFF_FIELDS = (("handoff_wait_s", "wait_d", "D's vllm:request_queue_time_seconds (D's wait for P's KV)"),
                  ("d_first_step_s", "d_first_step", "D's vllm:request_prefill_time_seconds (D's first step)"))


def handoff_terms(store: Store, run_ids: Sequence[str], speed: dict[str, float] | None = None) -> dict[str, Sourced]:
    """P/D's hand-off measured in ``run_ids``: profile field (:data:`HANDOFF_FIELDS`) -> the median
    over the P/D runs that scraped D of the run's mean per request of D's histogram (the run's
    increase of its sum over that of its count, :func:`analysis.ttft_split.measured_terms`),
    each run's mean divided by its speed factor (``speed``: :func:`decode_step_factors` in a fit; absent: 1),
    seconds. Read from runs of one request at a time (a calibration) D's queue time is the wait for
    P's KV alone; under load it also holds the wait for room on D, which the planner forecasts
    apart. Empty when no P/D run scraped D's histograms."""
    measured = ttft_split.measured_terms(ttft_split.measured_sums(store, list(run_ids)))
    if measured.empty:
        return {}
    speed = speed or {}
    out = {}
    for field, term, what in HANDOFF_FIELDS:
        per_run = {r.run_id: getattr(r, term) / speed.get(r.run_id, 1.0) for r in measured.itertuples()
                   if pd.notna(getattr(r, term))}
        if per_run:
            lo, hi = min(per_run.values()), max(per_run.values())
            out[field] = Sourced(value=float(np.median(list(per_run.values()))), source=(
                f"measured in runs {', '.join(sorted(per_run))}: median over {len(per_run)} P/D runs of the run's "
                f"mean {what} per request (runs' means {lo * 1e3:.1f}-{hi * 1e3:.1f} ms), each divided by "
                "its speed factor (the fit: its median TPOT over the fit's decode step)"))
    return out


def pull_latency_term(store: Store, run_ids: Sequence[str], profile: CostProfile,
                      speed: dict[str, float] | None = None) -> Sourced | None:
    """P's wait for an async pull beyond its bytes, measured in ``run_ids``: per bidirectional run
    that scraped P's ``vllm:request_queue_time_seconds`` (a request waiting for its KV from D is
    queued on P until the read is done, vLLM 0.32 ``WAITING_FOR_REMOTE_KVS``), the run's increase of
    that histogram's sum less ``profile``'s bandwidth term for the tokens its turns pulled
    (``pull_s`` without a latency), over the number of its ok turns that pulled, divided by the run's
    speed factor (``speed``: the short probe's, run id -> factor; absent: 1); the median over those
    runs, seconds. Runs of one session at a time (a demo): P has no other queue. None without such
    a run. The forecast scales it by the short probe (:meth:`CostProfile.at_speed`)."""
    turns = recorded_turns(store, run_ids)
    turns = turns[turns["mode"].map(lambda m: m in MODES and serving_mode(m).bidirectional)]
    if turns.empty:
        return None
    measured = ttft_split.measured_terms(ttft_split.measured_sums(store, sorted(set(turns["run_id"])))
                                         ).set_index("run_id")
    no_latency = profile.model_copy(update={"pull_latency_s": None})
    speed = speed or {}
    per_run = {}
    for run_id, g in turns[(turns["status"] == "ok") & (turns["reused_tokens"] > 0)].groupby("run_id"):
        row = measured.loc[run_id] if run_id in measured.index else None
        if row is None or pd.isna(row["queue_p_pull"]) or not row["p_requests"] > 0:
            continue
        queued = row["queue_p_pull"] * row["p_requests"]
        bytes_s = float(no_latency.pull_s(g["reused_tokens"].to_numpy()).sum())
        per_run[run_id] = (queued - bytes_s) / len(g) / speed.get(run_id, 1.0)
    if not per_run:
        return None
    lo, hi = min(per_run.values()), max(per_run.values())
    return Sourced(value=max(float(np.median(list(per_run.values()))), 0.0), source=(
        f"measured in runs {', '.join(sorted(per_run))}: median over {len(per_run)} bidirectional runs of P's "
        "vllm:request_queue_time_seconds per pulling turn less the bandwidth term for its pulled tokens "
        f"(runs' figures {lo * 1e3:.2f}-{hi * 1e3:.2f} ms), each divided by its short speed probe's factor "
        "(planner.fit.pull_latency_term)"))


def with_handoff(prof: CostProfile, terms: dict[str, Sourced]) -> CostProfile:
    """``prof`` with P/D's hand-off terms (``terms``: :func:`handoff_terms`) and their sum taken out of
    every P/D mode's b0 (and ``b0_default_s``, a P/D mode's): the fit's b0 held them. A b0 the terms
    exceed is kept at 0 (said in its source). Unchanged when ``terms`` is empty."""
    if not terms:
        return prof
    taken = sum(t.value for t in terms.values())

    def less(b: Sourced) -> Sourced:
        v = b.value - taken
        note = (f"; less P/D's hand-off ({taken * 1e3:.1f} ms: handoff_wait_s + d_first_step_s)"
                + ("" if v >= 0 else f", which exceeds it by {-v * 1e3:.1f} ms: kept at 0"))
        return Sourced(value=max(v, 0.0), source=b.source + note)

    b0 = {m: (b if m == AGGREGATED else less(b)) for m, b in prof.b0_s.items()}
    return prof.model_copy(update={**terms, "b0_s": b0, "b0_default_s": less(prof.b0_default_s)})


def sibling_b0(fitted: dict[str, Sourced]) -> dict[str, Sourced]:
    """b0 of each mode the fit had no turns of, taken from its **sibling**: the fitted mode with the
    same workers and connector (``disaggregated`` and ``bidirectional`` alike), which differs only in
    P's prefix cache (``pd`` <- ``pd-nocache``, ``pd-bidir`` <- ``pd-bidir-nocache`` and back).

    b0 is the per-request cost outside prefill and the pull (the proxy's hops, the connector's
    hand-off on each worker); P's prefix cache changes what P computes, which c(n) - c(cached)
    carries, not that. A mode with no fitted sibling keeps ``b0_default_s``. Shape: mode -> Sourced
    (seconds), only modes absent from ``fitted``.
    """
    borrowed: dict[str, Sourced] = {}
    for mode in SERVING_MODES:
        if mode.name in fitted:
            continue
        for other in SERVING_MODES:
            if (other.name in fitted and other.disaggregated == mode.disaggregated
                    and other.bidirectional == mode.bidirectional):
                borrowed[mode.name] = Sourced(value=fitted[other.name].value, source=(
                    f"not fitted (no {mode.name} turns): {other.name}'s b0, the mode with the same workers "
                    f"and connector (only P's prefix cache differs)"))
                break
    return borrowed


def _pulls(turns: pd.DataFrame) -> str:
    """The pulls a bandwidth was measured over: ``; over N pulls of A-B tokens (turns.reused_tokens)``
    ("" when the turns record none)."""
    pulled = turns.loc[(turns["status"] == "ok") & (turns["reused_tokens"] > 0), "reused_tokens"]
    return (f"; over {len(pulled)} pulls of {int(pulled.min()):,}-{int(pulled.max()):,} tokens (turns.reused_tokens)"
            if len(pulled) else "")


#: How :func:`fit_costs` fits (named in every fitted figure's source).
FIT_METHOD = ("robust least squares of relative TTFT error (scipy.optimize.least_squares, soft_l1, "
              "coefficients >= 0), b0 per mode, each turn's FIFO wait for its prefill worker")
#: Rounds of the fit / queue fixed point (the waits depend on the fitted costs); it stops earlier
#: when no wait moves by more than :data:`QUEUE_TOLERANCE_S`.
QUEUE_ROUNDS = 30
QUEUE_TOLERANCE_S = 1e-7


@dataclass(frozen=True)
class CostFit:
    """The fitted costs: ``b0_s`` per mode (s), ``a1_s`` (s/token), ``a2_s`` (s/token^2) of P/D
    modes and the aggregated worker's (None: no aggregated turns), ``render_s`` per prompt token
    and render (None: the runs are not both ``text`` and ``token_ids``), the ``turns`` fitted, how many of them had a forecast
    (not recorded) own-cache hit, and the fit/queue rounds taken."""

    b0_s: dict[str, float]
    a1_s: float
    a2_s: float
    turns: int
    forecast_local: int
    aggregated_a1_s: float | None = None
    aggregated_a2_s: float | None = None
    render_s: float | None = None
    rounds: int = 1
    #: :class:`planner.fit_residuals.Residuals` of the turns each figure rests on: each
    #: mode's (its b0; ``aggregated`` also the aggregated worker's c(x)), ``pd_prefill`` (every P/D
    #: turn: P's c(x)) and ``render`` (the text-history turns)
    residuals: dict[str, Residuals] = dataclasses.field(default_factory=dict)


def _queue_waits(turns: pd.DataFrame, service_s: np.ndarray, steps: StepCosts | None = None) -> np.ndarray:
    """Each turn's wait for its run's prefill (or aggregated) worker, given every turn's worker time
    ``service_s`` (``turns`` in :func:`fit_costs`'s order: run, then sent_at): first come first
    served, or with ``steps`` the engine's scheduler steps
    (:func:`planner.queueing.batched_step_waits`), as the forecast has them. The recorded
    runs have one prefill and one aggregated worker (the embedded topology)."""
    waits = np.zeros(len(turns))
    arrival = turns["arrival_s"].to_numpy(float)
    for idx in turns.groupby("run_id", sort=False).indices.values():
        one = np.zeros(len(idx), dtype=np.int64)
        if steps is None:
            waits[idx] = fifo_waits(arrival[idx], service_s[idx], one)
        else:
            a1, a2 = steps.coefficients(idx[0])
            waits[idx] = batched_step_waits(arrival[idx], steps.cached[idx], steps.prompt[idx], a1, a2,
                                            steps.budget, one)
    return waits


@dataclasses.dataclass
class StepCosts:
    """What :func:`_queue_waits` needs for the engine's scheduler steps: the token budget, every
    turn's prompt and cached tokens, and c(x)'s coefficients per turn in real time (its run's
    speed factor times P's or the aggregated worker's a1, a2)."""

    budget: int
    prompt: np.ndarray
    cached: np.ndarray
    a1: np.ndarray
    a2: np.ndarray

    def coefficients(self, i: int) -> tuple[float, float]:
        return float(self.a1[i]), float(self.a2[i])


def fit_costs(turns: pd.DataFrame, prof: CostProfile, queue: bool = True,
              speed: dict[str, float] | None = None) -> CostFit | None:
    """Fit ``ttft = b0[mode] + wait + c(n) - c(cached) + pull(pulled) + render x n x renders``
    (docs/planner/profiles.md) jointly over the ok turns of every mode, ``c(x) = a1 x + a2 x^2``: the
    computed tokens ``n - cached`` range from a few dozen (a cache hit) to whole prompts
    (``pd-nocache``), which pins the slope down far better than full prefills alone, whose prompt
    lengths a run barely varies. P/D modes share one c (P's prefill plus the hand-off of the new
    tokens' KV to D); the aggregated worker has its own.

    ``wait`` (``queue``): the turn's wait for its worker behind the turns sent before it in its
    run (:mod:`planner.queueing`, the recorded ``sent_at`` as arrivals; first come first
    served, or in the engine's scheduler steps when ``prof`` has ``max_num_batched_tokens``), with every
    turn's worker time ``c(n) - c(cached)`` from the costs being fitted: the fit and the waits are
    iterated to a fixed point (at most :data:`QUEUE_ROUNDS`). The waits use no measured TTFT.

    ``render`` (turns of ``text`` runs only): the chat render per prompt token, times the renders
    on the TTFT path (:data:`planner.simulate.RENDERS`, plus one for a turn that took a
    handle). Fitted only when the runs hold both ``text`` and ``token_ids`` turns: the same work
    sent as token ids renders nothing, which is what separates the render from b0 and c; over text
    turns alone b0 absorbs it (None).

    ``turns``: :data:`store.queries.planner_runs.TURNS_SQL`'s columns with ``local_tokens`` filled and ``local_known``
    (:func:`_with_forecast_local`); ``prof`` gives the pull cost. Residuals are relative to the
    measured TTFT (the check's error), with scipy's robust ``soft_l1`` loss so that a few turns
    slowed by a busy machine do not drag the fit; every coefficient >= 0 (a cost). Turns whose
    cached tokens are a forecast (aggregated runs record none) are fitted from the second turn of a
    session on: a first turn's hit on a system prompt shared across sessions is not forecast (the
    planner does not model sharing across sessions) and would bend c. None when the P/D turns have
    fewer than 3 distinct computed-token counts (a1 and a2 not identifiable).

    ``speed``: run id -> how many times slower than the reference its machine ran (its speed probe
    over the reference's, :func:`run_speed_factors`; absent: 1). A run's turns are fitted as
    ``ttft = f (b0 + c(n) - c(cached) + wait + render) + pull``: its compute put on the reference
    speed, its waits computed from its own (f times longer) worker times; pulls are not scaled."""
    turns = turns[turns["mode"].isin(MODES) & turns["sent_at"].notna()].copy()
    turns["arrival_s"] = (pd.to_datetime(turns["sent_at"]) - pd.to_datetime(turns["sent_at"]).min()).dt.total_seconds()
    turns = turns.sort_values(["run_id", "arrival_s", "session_id", "turn_index"], kind="stable").reset_index(drop=True)
    f_all = turns["run_id"].map(speed or {}).fillna(1.0).to_numpy(float)
    n_all = turns["prompt_tokens"].fillna(0).to_numpy(float)
    pulled_all = turns["reused_tokens"].fillna(0).to_numpy(float)
    cached_all = np.minimum(turns["local_tokens"].fillna(0).to_numpy(float) + pulled_all, n_all)
    agg_all = (turns["mode"] == AGGREGATED).to_numpy()
    fitted = ((turns["status"] == "ok") & turns["ttft_s"].notna() & (turns["ttft_s"] > 0)
              & turns["prompt_tokens"].notna() & (turns["local_known"] | (turns["turn_index"] >= 1))).to_numpy()
    ok = turns[fitted]
    n, pulled, cached = n_all[fitted], pulled_all[fitted], cached_all[fitted]
    ttft = ok["ttft_s"].to_numpy(float)
    f = f_all[fitted]
    mode_col = ok["mode"].to_numpy()
    agg = mode_col == AGGREGATED
    if np.unique((n - cached)[~agg]).size < 3:
        return None
    modes = sorted(set(mode_col))
    lin, quad = (n - cached) / 1e3, (n * n - cached * cached) / 1e6   # scaled to O(1)
    cols = [(mode_col == m).astype(float) for m in modes] + [lin * ~agg, quad * ~agg]
    has_agg = bool(agg.any())
    if has_agg:
        cols += [lin * agg, quad * agg]
    text = (ok["history_mode"] == "text").to_numpy() if "history_mode" in ok else np.zeros(len(ok), bool)
    has_text = bool(text.any()) and not bool(text.all())   # identifiable only against token-id turns
    if has_text:
        renders = np.array([RENDERS[m] for m in mode_col]) + ok["reuse"].isin(TOOK_HANDLE).to_numpy()
        cols.append(text * renders * n / 1e3)
    x = np.column_stack(cols)
    k = len(modes)
    waits = np.zeros(len(turns))
    th = np.r_[np.full(k, 1e-3), np.tile([0.1, 0.01], 2 if has_agg else 1), [0.0] if has_text else []]
    rounds = 0
    for rounds in range(1, QUEUE_ROUNDS + 1):
        y = (ttft - prof.pull_s(pulled)) / f - waits[fitted]
        start = th.copy()
        start[:k] = np.maximum(start[:k], max(float(np.median(y)) / 2, 1e-3)) if rounds == 1 else start[:k]
        th = least_squares(lambda t, y=y: (x @ t - y) / (ttft / f), start, bounds=(0.0, np.inf), loss="soft_l1",
                           f_scale=0.1, xtol=1e-15, ftol=1e-15, gtol=1e-15, max_nfev=10_000).x
        if not queue:
            break
        a1, a2 = th[k] / 1e3, th[k + 1] / 1e6
        service = a1 * (n_all - cached_all) + a2 * (n_all ** 2 - cached_all ** 2)
        if has_agg:
            ga1, ga2 = th[k + 2] / 1e3, th[k + 3] / 1e6
            service = np.where(agg_all, ga1 * (n_all - cached_all) + ga2 * (n_all ** 2 - cached_all ** 2), service)
        steps = None
        if prof.max_num_batched_tokens is not None:
            c1 = np.where(agg_all, ga1, a1) if has_agg else np.full(len(turns), a1)
            c2 = np.where(agg_all, ga2, a2) if has_agg else np.full(len(turns), a2)
            steps = StepCosts(int(prof.max_num_batched_tokens.value), n_all.astype(np.int64),
                              cached_all.astype(np.int64), c1 * f_all, c2 * f_all)
        new = _queue_waits(turns, service * f_all, steps) / f_all   # real-time waits, on the reference speed
        moved = float(np.max(np.abs(new - waits))) if len(new) else 0.0
        waits = new
        if moved <= QUEUE_TOLERANCE_S:
            break
    rel = (x @ th - y) / (ttft / f)   # (fitted - measured) / measured TTFT, the last round's waits
    groups = {m: mode_col == m for m in modes} | {"pd_prefill": ~agg} | ({"render": text} if has_text else {})
    residuals = {key: r for key, sel in groups.items()
                 if (r := residuals_of(rel[sel], (n - cached)[sel], n[sel])) is not None}
    return CostFit({m: float(th[i]) for i, m in enumerate(modes)}, float(th[k] / 1e3), float(th[k + 1] / 1e6),
                   len(ok), int((~ok["local_known"]).sum()),
                   float(th[k + 2] / 1e3) if has_agg else None, float(th[k + 3] / 1e6) if has_agg else None,
                   float(th[-1] / 1e3) if has_text else None, rounds, residuals)


def _block_size(store: Store, run_ids: Sequence[str]) -> int:
    """Tokens per KV block the runs' workers report (vllm:cache_config_info); 128 when none does."""
    for lab in labels_by_role(store, run_ids).values():
        try:
            return int(lab["block_size"])
        except (KeyError, TypeError, ValueError):
            continue
    return 128  # vLLM's CPU backend


def _with_forecast_local(store: Store, turns: pd.DataFrame, prof: CostProfile) -> pd.DataFrame:
    """``turns`` with ``local_known`` (the run recorded the worker's own-cache hit) and, where it did
    not, ``local_tokens`` taken from the planner's own forecast of that run (``prof``'s cache model)."""
    turns = turns.assign(local_known=turns["local_tokens"].notna())
    shared = shared_prefix_by_run(turns)
    for run_id in turns.loc[~turns["local_known"], "run_id"].unique():
        mode = str(turns.loc[turns["run_id"] == run_id, "mode"].iloc[0])
        if mode not in MODES:
            continue
        tr, m = plan_recorded_run(store, str(run_id), mode, prof, shared[str(run_id)])
        forecast = pd.DataFrame({"run_id": run_id, "session_id": tr.session, "turn_index": tr.request_index,
                                 "forecast_local": m.local_tokens})
        turns = turns.merge(forecast, on=["run_id", "session_id", "turn_index"], how="left")
        fill = turns["local_tokens"].isna() & (turns["run_id"] == run_id)
        turns.loc[fill, "local_tokens"] = turns.loc[fill, "forecast_local"]
        turns = turns.drop(columns="forecast_local")
    return turns
