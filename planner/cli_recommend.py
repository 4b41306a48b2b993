"""``turnscope recommend``: read the traffic and profile, print the ledger of retention strategies at
the current setting (:mod:`planner.ledger`) and the recommended setting as a config diff
(:mod:`planner.recommend`). Every figure is a FORECAST labelled with its profile and inputs
(docs/planner/ledger.md). With ``store_root``, both are written to the store
(``plan_ledger``, ``plan_recommendations``; the Plan page shows them)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from loadgen.traces.formats import RECORDED_RUNS
from planner import intervals
from planner.cli_plan import read_traffic
from planner.executor import Executor, LocalExecutor
from planner.fit import runs_shared_prefix_tokens
from planner.fleet import (
    CurveJob,
    FleetJob,
    FleetLimits,
    cheapest,
    curve_row,
    describe_curve,
    describe_fleets,
    fleet_row,
    knees,
    load_curve,
    size_fleets,
)
from planner.ledger import Prices, describe_ledger, ledger
from planner.load import Load, at_load, tree_of_formats
from planner.plan_store import new_plan_id, write_recommendation
from planner.profile import GiB, Sourced, load_profile
from planner.recommend import Grid, Limits, Setting, describe, recommend, recommendation_row
from planner.recommend_topology import read_base
from planner.simulate import PlanSettings
from planner.strategies import HOST_STRATEGIES, STRATEGIES
from store.writer import Store


def run_recommend(paths: Sequence[Path], *, profile_path: Path, format: str | None, current: Setting,
                  margin_s: float, ttft_slo_s: float | None, d_kv_gib: float | None, gpu_hour_usd: float | None,
                  host_gib_hour_usd: float | None, max_prefill_workers: int, serve_model: str,
                  shared_prefix_tokens: int | None = None, grid: Grid | None = None, platform: str = "gpu",
                  topology_path: Path | None = None, store_root: Path | None = None, label: str | None = None,
                  run_ids: Sequence[str] | None = None, write_topology: Path | None = None, load: Load | None = None,
                  max_decode_workers: int = 16, executor: Executor | None = None, curve: bool = True) -> str:
    """The whole command. ``topology_path``: the current deployment's topology file, the base of the
    topology diff (None: :func:`planner.recommend_topology.default_topology`);
    ``store_root``: write the ledger and recommendation there; ``run_ids``: of a store directory read
    as traffic, only these runs; ``shared_prefix_tokens``: the system prompt sessions share (None:
    from ``run_ids``' recorded first turns, as ``turnscope plan`` takes it from its fitted runs,
    :func:`planner.fit.runs_shared_prefix_tokens`; 0 for trace files);
    ``write_topology``: write the recommended topology file there; ``load``: the load every figure is
    forecast at (:mod:`planner.load`; None: the recorded clock, refused for own-clock traces);
    ``max_prefill_workers``/``max_decode_workers``: the fleet sizes searched
    (:mod:`planner.fleet`); ``executor``: where the forecasts run (default: this machine's
    cores); ``curve``: forecast each strategy's fleet at a range of loads (drawn loads only). Raises
    ValueError/OSError with a clear message (an unknown strategy, a negative price, an unreadable
    traffic, profile or topology, no load for own-clock traces)."""
    if platform not in ("cpu", "gpu"):
        raise ValueError(f"--platform {platform!r}: expected cpu or gpu")
    if current.strategy not in STRATEGIES:
        raise ValueError(f"--current-strategy {current.strategy!r}: expected one of {', '.join(STRATEGIES)}")
    for name, v in (("--max-prefill-workers", max_prefill_workers), ("--max-decode-workers", max_decode_workers)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    for name, v in (("--gpu-hour-usd", gpu_hour_usd), ("--host-gib-hour-usd", host_gib_hour_usd),
                    ("--d-kv-gib", d_kv_gib), ("--ttft-slo-s", ttft_slo_s),
                    ("--current-d-kv-gib", current.decode_kv_bytes)):
        if v is not None and v < 0:
            raise ValueError(f"{name} must not be negative, got {v}")
    prof = load_profile(profile_path)
    topology = read_base(topology_path) if topology_path is not None else None
    mix, inputs = read_traffic(paths, format, run_ids)
    formats = [i["format"] for i in inputs]
    loaded = at_load(mix, formats, load)
    traffic = loaded.traffic
    if shared_prefix_tokens is None:   # as `turnscope plan` takes it: from recorded runs, P's first-turn hits
        stores = [Store(Path(i["path"])) for i in inputs if i["format"] == RECORDED_RUNS]
        shared_prefix_tokens = runs_shared_prefix_tokens(stores[0], run_ids) if len(stores) == 1 else 0
    prices = Prices(gpu_hour_usd, host_gib_hour_usd)
    limits = Limits(ttft_slo_s, None if d_kv_gib is None else d_kv_gib * GiB, prices, max_prefill_workers)
    base = PlanSettings(handle_ttl_margin_s=margin_s, shared_prefix_tokens=shared_prefix_tokens,
                        ttft_slo_s=ttft_slo_s or None)   # every forecast is judged by the one overload rule
    if current.decode_kv_bytes is not None:
        prof = prof.model_copy(update={"decode_kv_space_bytes": Sourced(value=current.decode_kv_bytes,
                                                                        source="the current setting")})
    at = base.model_copy(update={"decoder_kv_blocks_ttl_s": current.ttl_s, "kv_recompute_threshold": current.threshold,
                                 "prefill_workers": current.prefill_workers, "decode_workers": current.decode_workers,
                                 "routing": current.routing})
    executor = executor or LocalExecutor()
    head = (f"{prof.label()} of {', '.join(i['path'] + ' (' + i['format'] + ')' for i in inputs)} at a load of "
            f"{loaded.label()}.\n  intervals: {intervals.source_line(prof)}")
    fleet_limits = FleetLimits(ttft_slo_s, max_prefill_workers, max_decode_workers, limits.decode_kv_bytes, prices)
    strategies = tuple(s for s in STRATEGIES if s not in HOST_STRATEGIES
                       or (prof.host_kv_space_bytes is not None and prof.host_read_bandwidth_bytes_per_s is not None))
    searches = size_fleets(FleetJob(traffic, prof, base, fleet_limits), strategies, executor)
    chosen = cheapest(searches, prices.gpu_hour_usd is not None)
    fleets_text = describe_fleets(searches, chosen, loaded, prof, fleet_limits)
    # an overloaded strategy's row says so and no more (its forecast stops at the growing queue)
    led = ledger(traffic, prof, at.model_copy(update={"stop_on_overload": True}), prices, executor=executor)
    table = describe_ledger(led, prof, at, prices)
    # the knobs are searched on the cheapest fleet (a shorter TTL may fit a strategy into it; each
    # strategy at its own fleet was forecast by the sizing, at the current knobs); with none meeting
    # the SLO, on the largest fleet tried
    knob_fleet = chosen.fleet if chosen is not None else max(
        (s.closest.fleet for s in searches), key=lambda f: f.prefill_workers + f.decode_workers)
    sized = {s.strategy: [(knob_fleet.prefill_workers, knob_fleet.decode_workers)] for s in searches}
    rec = recommend(traffic, prof, base, current, limits, grid or Grid(), sized, executor)
    picked = rec.recommended.setting
    if chosen is not None and picked.strategy != chosen.strategy:
        fleets_text += (f"\n  On that fleet the knob search below found {picked.label()} better than {chosen.strategy} "
                        "at the current knobs: the recommendation below.")
    points = []
    if curve and loaded.load.drawn:
        job = CurveJob(mix, tree_of_formats(formats), prof, base, fleet_limits)
        points = load_curve(job, {s.strategy: s.closest.fleet for s in searches}, loaded.load, executor,
                            known={s.strategy: s.closest for s in searches})
    parts = [head, fleets_text]
    if points:
        parts.append(describe_curve(points, loaded.load, fleet_limits))
    parts += [f"At the current setting ({current.label()}), at {loaded.label()}:\n" + table,
              f"At {loaded.label()}:\n" + describe(rec, prof, base, limits, serve_model, platform, topology)]
    text = "\n\n".join(parts)
    if write_topology is not None:
        from planner.recommend_topology import default_topology, model_seen_from, topology_diff

        host_kv = prof.host_kv_space_bytes.value if prof.host_kv_space_bytes else None
        written = topology or default_topology(serve_model, platform)
        if topology_path is not None:  # a relative model path still names the same model from the new file
            written = written.model_copy(update={"model": model_seen_from(topology_path, write_topology)})
        rec_text, _ = topology_diff(written, rec.current.setting, rec.recommended.setting, host_kv)
        Path(write_topology).write_text(rec_text)
        text += f"\n\nRecommended topology written to {write_topology}."
    if store_root is not None:
        knee = knees(points, fleet_limits)
        store, plan_id = Store(Path(store_root)), new_plan_id()
        notes = [(f"a recommendation (`turnscope recommend`, its load in the note above): the smallest fleet per "
                  f"strategy, the ledger at the current setting ({current.strategy}, {current.prefill_workers}P"
                  f"{current.decode_workers}D) and {len(rec.searched)} settings searched; no per-request forecast")]
        write_recommendation(store, plan_id=plan_id, label=label, inputs=inputs, profile=prof, settings=at,
                             notes=notes, requests=len(traffic), ledger=led,
                             recommendation=recommendation_row(rec, prof, serve_model, platform, topology),
                             fleets=[fleet_row(s.closest, loaded, fleet_limits, s.best is not None and s.best is chosen,
                                               len(s.searched), None if s.best is not None else s.largest)
                                     for s in searches],
                             curve=[curve_row(p, fleet_limits, knee[(p.strategy, p.fleet)]) for p in points])
        text += f"\n\nWritten to {store.root} as plan {plan_id}."
    return text
