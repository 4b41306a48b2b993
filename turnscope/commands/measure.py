"""The commands that measure over a range: ``calibrate``, ``sweep``, ``capacity`` (docs/planner/overview.md,
docs/sweep.md, docs/capacity.md)."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Annotated

import typer

from core import resources
from core.modes import MODES
from turnscope.commands.app import (
    LOG_DIR,
    DecodeRoutingOpt,
    ModesOpt,
    PrefillRoutingOpt,
    StoreOpt,
    TopologyOpt,
    app,
    console,
    fail,
    resolve_topology,
    settings,
    shipped,
    split_csv,
)
from turnscope.commands.summaries import (
    compact_quietly,
    print_sweep_summary,
)
from turnscope.conductor import schedule
from turnscope.conductor.calibration import DEFAULT_MODES as CAL_MODES
from turnscope.conductor.evaluation import default_settings
from turnscope.conductor.prefix_sweep import SWEEP_MODES, plan_sweep, run_sweep

SWEEP_MODE_LIST = ",".join(SWEEP_MODES)


VENDOR_SWEEP = resources.shipped("workloads", "vendor-sweep.yaml")


CAPACITY_WORKLOAD = resources.shipped("workloads", "capacity.yaml")


@app.command()
def calibrate(
    modes: Annotated[str, typer.Option(help=f"Comma-separated serving modes whose stacks are kept up together and "
                                            f"alternated, of: {', '.join(MODES)}.")] = ",".join(CAL_MODES),
    repeats: Annotated[int, typer.Option(help="Blocks: every point once per block, in its own shuffled order.")] = 3,
    lengths: Annotated[str | None, typer.Option(
        help="Comma-separated turn-0 prompt tokens. Default: 128 doubling up to the model's max_model_len.")] = None,
    extras: Annotated[str, typer.Option(help="Comma-separated tokens turn 1 adds (computed after a cached or "
                                             "pulled prefix).")] = "128,1024",
    text_lengths: Annotated[str, typer.Option(help="Comma-separated turn-0 lengths also sent as text history "
                                                   "(the chat render's cost); empty: none.")] = "512,2048",
    seed: Annotated[int, typer.Option(help="Seed of the shuffle and of the prompts' text.")] = 0,
    max_tokens: Annotated[int, typer.Option(help="Output tokens per turn (decode per token).")] = 16,
    quick: Annotated[bool, typer.Option("--quick", help="Lengths 128,1024, extra 128, text 512, 2 repeats (a "
                                                        "first look; tests).")] = False,
    topology: TopologyOpt = None,
    store: Annotated[Path | None, typer.Option(help="Store of the calibration runs (a store of its own: "
                                                    "`plan-check --fit-store` takes it).")] = None,
    label: Annotated[str, typer.Option(help="Label and run-id prefix of the runs.")] = "calibrate",
    out: Annotated[Path | None, typer.Option(help="Write the fitted profile (YAML, data/profiles format) here.")
                   ] = None,
    name: Annotated[str | None, typer.Option(help="The profile's name. Default: the topology's name.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the schedule; start nothing.")] = False,
) -> None:
    """Calibration run: measure each cost the planner uses over a wide prompt range (prefill per role
    from 128 tokens to the model's limit, pulls of several sizes, decode, chat render, per-request
    overhead), the modes' stacks kept up together and alternated in a seeded shuffled order, speed
    probes around each block; then fit a profile whose fitted figures carry their residuals and range
    (docs/planner/calibration.md)."""
    from planner.fit import FitError
    from planner.layer_timing import write_profile as write_yaml
    from turnscope.conductor.calibration import (
        QUICK,
        CalibrationSettings,
        calibrated_profile,
        run_calibration,
    )

    s = settings()
    topo = resolve_topology(topology)
    try:
        opts = QUICK if quick else {
            "lengths": [int(v) for v in split_csv(lengths)] if lengths else None,
            "extras": [int(v) for v in split_csv(extras)], "text_lengths": [int(v) for v in split_csv(text_lengths)],
            "repeats": repeats}
        cal = CalibrationSettings(topology=topo, modes=split_csv(modes), seed=seed, max_tokens=max_tokens,
                                  store=store or resources.home() / "calibration", label=label,
                                  turn_timeout_s=max(s.turn_timeout_s, 180.0), operator_config=s.effective(),
                                  kv_bytes_per_token=s.kv_bytes_per_token or default_settings(
                                      Path(topo.model), topology=topo).kv_bytes_per_token, **opts)
        blocks = cal.sends()
    except ValueError as exc:  # a non-integer length, a bad mode list, pydantic's bounds
        raise fail(str(exc)) from exc
    pts = blocks[0]
    console.print(f"calibration: modes {', '.join(cal.modes)} alternated; {len(blocks)} blocks of {len(pts)} "
                  f"two-turn sessions ({len(pts) // len(cal.modes)} points per mode); store {cal.store}", highlight=False)
    if dry_run:
        for b, block in enumerate(blocks):
            console.print(f"# block {b}: " + ", ".join(f"{x.mode}:{x.point.session_id}"
                                                      f"{'(text)' if x.point.history == 'text' else ''}"
                                                      for x in block), highlight=False)
        return
    t0 = time.monotonic()
    try:
        run_ids = run_calibration(cal, console)
    except (ValueError, RuntimeError, OSError) as exc:
        raise fail(str(exc)) from exc
    console.print(f"calibration recorded in {time.monotonic() - t0:.0f} s: {', '.join(run_ids)}", highlight=False)
    try:
        prof = calibrated_profile(cal.store, run_ids, name or topo.name)
    except FitError as exc:
        raise fail(f"the runs were recorded but the fit failed: {exc}") from exc
    for field in ("prefill_a1_s_per_token", "prefill_a2_s_per_token2", "aggregated_prefill_a1_s_per_token",
                  "aggregated_prefill_a2_s_per_token2", "render_s_per_token", "pull_bandwidth_bytes_per_s",
                  "decode_s_per_token", "probe_ttft_s"):
        fig = getattr(prof, field)
        if fig is not None:
            typer.echo(f"{field}: {fig.value:.4g}  ({fig.source})")
    for mode, fig in prof.b0_s.items():
        typer.echo(f"b0 {mode}: {fig.value:.4g} s  ({fig.source})")
    if out is not None:
        write_yaml(prof, out, f"turnscope calibrate: {prof.description}")
        typer.echo(f"Profile {prof.name} written to {out}; check it on runs recorded at another time: turnscope "
                   f"plan-check --profile {out} --check-store STORE")


@app.command()
def sweep(
    workload: Annotated[Path, typer.Option(help="Workload YAML with a `sweep` section.")] = VENDOR_SWEEP,
    modes: ModesOpt = SWEEP_MODE_LIST,
    histories: Annotated[str, typer.Option(
        help="History modes: token_ids (ids match exactly, as a real model's canonical replies would), text "
             "(chat clients, the vendor's benchmark; the embedded model's replies re-tokenize differently).")
                         ] = "token_ids",
    scale: Annotated[str | None, typer.Option(
        help="A scale of the file's `sweep.scales`, e.g. `published` (the vendor's full shape, for GPUs). "
             "Default: the file's own values.")] = None,
    values: Annotated[str | None, typer.Option(help="Comma-separated token counts replacing the points.")] = None,
    topology: TopologyOpt = None,
    prefill_routing: PrefillRoutingOpt = None,
    decode_routing: DecodeRoutingOpt = None,
    store: StoreOpt = None,
    label: Annotated[str, typer.Option(help="Label of the runs.")] = "sweep",
    sweep_id: Annotated[str | None, typer.Option(
        help="Name of the sweep, the prefix of its run ids (default: LABEL-UTCSTAMP). Give the same one to "
             "each invocation when the modes run one at a time (attached GPU workers).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the points and run ids; start nothing.")] = False,
) -> None:
    """Run a prefix-length sweep: each mode's workers start once and play every point, each point
    its own recorded run (default: the vendor's multi-turn benchmark, data/workloads/vendor-sweep.yaml).

    `turnscope sweep` on the embedded default takes about 13 minutes; then open the dashboard's Sweep
    page. On GPU nodes: `turnscope sweep --topology data/topologies/vendor-h200-1p1d.yaml --scale
    published --histories text --modes <the attached mode>` (docs/gpu-runbook.md).
    """
    s = settings(prefill_routing=prefill_routing, decode_routing=decode_routing)
    workload = shipped(workload, "workloads")
    if not workload.exists():
        raise fail(f"workload file {workload} does not exist (the vendor's: data/workloads/vendor-sweep.yaml)")
    try:
        points = [int(v) for v in split_csv(values)] if values else None
    except ValueError as exc:
        raise fail(f"--values takes comma-separated integers (tokens), got {values!r}") from exc
    sweep_id = sweep_id or f"{label}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}"
    try:
        plan = plan_sweep(workload, sweep_id=sweep_id, out_dir=LOG_DIR / "sweeps", scale=scale, values=points)
    except ValueError as exc:  # WorkloadError: the file, its sweep, the scale or the values
        raise fail(str(exc)) from exc
    topo = resolve_topology(topology, prefill_routing, decode_routing)
    if not topo.launch and modes == SWEEP_MODE_LIST:
        modes = topo.attached_mode  # attached workers run one mode: the one they were started in
    store = store or s.store
    ev = default_settings(Path(topo.model), topology=topo, modes=split_csv(modes), histories=split_csv(histories),
                          store=store, label=label, turn_timeout_s=s.turn_timeout_s, operator_config=s.effective())
    if s.kv_bytes_per_token:
        ev.kv_bytes_per_token = s.kv_bytes_per_token
    console.print(f"sweep {plan.sweep_id}: {plan.name}, {plan.field} = {', '.join(map(str, plan.values))} tokens "
                  f"({plan.scale or 'default'} scale), {plan.sessions} sessions x {plan.users} users per point; "
                  f"modes {', '.join(ev.modes)}; history {', '.join(ev.histories)}", highlight=False)
    if dry_run:
        bad = [m for m in ev.modes if m not in topo.modes()]
        if bad:
            raise fail(f"topology {topo.name!r} cannot run mode {bad[0]!r} (it runs: {', '.join(topo.modes())})")
        try:
            runs = plan.runs(ev, ev.modes, ev.histories)
        except ValueError as exc:
            raise fail(str(exc)) from exc
        for mode, rs in runs.items():
            console.print(f"# {mode}: one worker start, then " + ", ".join(r.run_id for r in rs), highlight=False)
        return
    t0 = time.monotonic()
    try:
        run_ids = run_sweep(ev, plan, console)
    except (ValueError, RuntimeError, OSError) as exc:  # bad input, a worker or port, the store
        raise fail(str(exc)) from exc
    compact_quietly(store)  # the finished runs' shards, one file per table (store/compact.py)
    console.print(f"sweep finished in {time.monotonic() - t0:.0f} s; the dashboard's Sweep page draws it")
    print_sweep_summary(store, run_ids)


@app.command()
def capacity(
    workload: Annotated[Path, typer.Option(help="Workload YAML whose sessions the ramp plays.")
                        ] = CAPACITY_WORKLOAD,
    users: Annotated[str, typer.Option(help="Load steps: concurrent sessions, comma-separated, ascending.")
                     ] = "1,2,3,4,6",
    sessions_per_user: Annotated[int, typer.Option(help="Sessions each concurrent user plays per step.")] = 2,
    slo_ttft_s: Annotated[float, typer.Option(help="SLO: TTFT bound (seconds) a turn must meet for goodput.")] = 0.5,
    slo_tpot_s: Annotated[float, typer.Option(help="SLO: TPOT bound (seconds) a turn must meet for goodput.")] = 0.05,
    decode_kv_tokens: Annotated[int, typer.Option(
        help="D's KV space in tokens (x the model's KV bytes per token = --kv-cache-memory-bytes of D; P keeps "
             "the topology's). At least max_model_len.")] = 16_384,
    prefill_kv_tokens: Annotated[int | None, typer.Option(
        help="P's KV space in tokens (--kv-cache-memory-bytes of P; the aggregated worker gets P's plus D's): the "
             "eviction ladder, where P's own prefix cache evicts (docs/eviction.md). At least max_model_len. "
             "Default: P and the aggregated worker keep the topology's.")] = None,
    ttl_s: Annotated[int, typer.Option(help="decoder_kv_blocks_ttl (seconds) D pins a finished turn's blocks; "
                                            "scaled to the workload's session length (docs/capacity.md).")] = 20,
    handle_ttl_margin_s: Annotated[float, typer.Option(help="The proxy offers a handle for TTL minus this (s).")
                                   ] = 5.0,
    settle_s: Annotated[float, typer.Option(help="Seconds between steps (0: back to back, a step-load ramp).")
                        ] = 0.0,
    modes: Annotated[str, typer.Option(help="Modes, baseline first.")] = "pd,pd-bidir",
    history: Annotated[str, typer.Option(help="History mode: token_ids (ids match exactly) or text.")
                       ] = "token_ids",
    topology: TopologyOpt = None,
    prefill_routing: PrefillRoutingOpt = None,
    decode_routing: DecodeRoutingOpt = None,
    store: StoreOpt = None,
    label: Annotated[str, typer.Option(help="Label of the runs.")] = "capacity",
    capacity_id: Annotated[str | None, typer.Option(help="Name of the ramp, prefix of its run ids "
                                                         "(default: LABEL-UTCSTAMP).")] = None,
    schedule_: Annotated[str, typer.Option("--schedule", help=(
        "interleaved: both modes' workers up together (own ports), each load step played by one mode "
        "then the other, the order drawn per step, so the machine's drift falls on both; sequential: one "
        "mode's whole ramp, then the other's."))] = schedule.INTERLEAVED,
    schedule_seed: Annotated[int, typer.Option(help="Interleaved schedule: seeds the modes' order in each step.")
                             ] = 0,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the steps and run ids; start nothing.")] = False,
) -> None:
    """Ramp concurrent sessions step by step against `pd` and `pd-bidir` with the same small D KV
    space: at how many sessions does holding KV on D start to cost capacity, and how much TTFT does
    reuse buy below that point? Each step is its own run; the Memory page draws the curve.

    Takes about 9 minutes on the embedded default (2 modes x 5 steps).
    """
    from turnscope.conductor.capacity import plan_capacity, print_capacity_summary, run_capacity
    from turnscope.conductor.evaluation import Slo

    s = settings(prefill_routing=prefill_routing, decode_routing=decode_routing)
    workload = shipped(workload, "workloads")
    if not workload.exists():
        raise fail(f"workload file {workload} does not exist (the shipped one: data/workloads/capacity.yaml)")
    try:
        steps = [int(v) for v in split_csv(users)]
    except ValueError as exc:
        raise fail(f"--users takes comma-separated integers (concurrent sessions), got {users!r}") from exc
    try:
        slo = Slo(ttft_s=slo_ttft_s, tpot_s=slo_tpot_s)
    except ValueError as exc:
        raise fail(f"--slo-ttft-s and --slo-tpot-s must be > 0 seconds, got {slo_ttft_s} and {slo_tpot_s}") from exc
    if schedule_ not in schedule.SCHEDULES:
        raise fail(f"--schedule takes {' or '.join(schedule.SCHEDULES)}; got {schedule_!r}")
    topo = resolve_topology(topology, prefill_routing, decode_routing)
    store = store or s.store
    ev = default_settings(Path(topo.model), topology=topo, modes=split_csv(modes), histories=[history], store=store,
                          label=label, max_tokens=32, turn_timeout_s=s.turn_timeout_s, operator_config=s.effective(),
                          schedule=schedule_, schedule_seed=schedule_seed)
    if s.kv_bytes_per_token:
        ev.kv_bytes_per_token = s.kv_bytes_per_token
    if prefill_kv_tokens is not None and topo.max_model_len:
        # the eviction ladder's histories grow past eval's 3,500-token cap (data/workloads/eviction.yaml:
        # 4,524): let sessions run to the model's context less the reply, as Locust's own default does
        ev.max_prompt_tokens = max(ev.max_prompt_tokens, topo.max_model_len - ev.max_tokens)
    capacity_id = capacity_id or f"{label}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}"
    try:
        plan = plan_capacity(workload, capacity_id=capacity_id, users=steps, sessions_per_user=sessions_per_user,
                             slo=slo, topology=topo, kv_bytes_per_token=ev.kv_bytes_per_token,
                             decode_kv_tokens=decode_kv_tokens, ttl_s=ttl_s, handle_ttl_margin_s=handle_ttl_margin_s,
                             settle_s=settle_s, prefill_kv_tokens=prefill_kv_tokens)
    except ValueError as exc:  # WorkloadError, the steps, D's or P's size, the TTL
        raise fail(str(exc)) from exc
    _print_capacity_plan(plan, sessions_per_user, slo, ev.modes, history)
    if dry_run:
        _print_capacity_dry_run(plan, ev, history, schedule_, schedule_seed)
        return
    t0 = time.monotonic()
    try:
        run_ids = run_capacity(ev, plan, history, console)
    except (ValueError, RuntimeError, OSError) as exc:  # bad input, a worker or port, the store
        raise fail(str(exc)) from exc
    compact_quietly(store)  # the finished runs' shards, one file per table (store/compact.py)
    console.print(f"capacity ramp finished in {time.monotonic() - t0:.0f} s; the dashboard's Memory page draws it")
    print_capacity_summary(store, run_ids, console)


def _print_capacity_plan(plan, sessions_per_user: int, slo, modes: list[str], history: str) -> None:
    """The ramp's one-line summary: its steps, D's (and P's) KV space, the TTL, the SLO, the modes."""
    console.print(f"capacity {plan.capacity_id}: {plan.workload_name}, concurrent sessions "
                  f"{', '.join(str(st.users) for st in plan.steps)} ({sessions_per_user} sessions each per step); "
                  f"D KV {plan.decode_kv_cache_bytes / 2**20:.0f} MiB ({plan.decode_kv_tokens:,} tokens), "
                  + (f"P KV {plan.prefill_kv_cache_bytes / 2**20:.0f} MiB ({plan.prefill_kv_tokens:,} tokens), "
                     f"aggregated KV {plan.aggregated_kv_cache_bytes / 2**20:.0f} MiB, "
                     if plan.prefill_kv_cache_bytes is not None else "") + f"TTL "
                  f"{plan.ttl_s} s; SLO TTFT <= {slo.ttft_s * 1e3:.0f} ms, TPOT <= {slo.tpot_s * 1e3:.0f} ms; "
                  f"modes {', '.join(modes)}; history {history}", highlight=False)


def _print_capacity_dry_run(plan, ev, history: str, schedule_: str, schedule_seed: int) -> None:
    """`capacity --dry-run`: the run ids of each step, in the order the schedule plays them."""
    runs = plan.runs(ev, ev.modes, history)
    if schedule_ == schedule.INTERLEAVED and len(ev.modes) > 1:
        orders = schedule.step_orders(ev.modes, len(plan.steps), random.Random(schedule_seed))
        console.print(f"# {', '.join(ev.modes)}: workers started together, then step by step:", highlight=False)
        for i, order in enumerate(orders):
            console.print(f"#   step {i + 1}: " + ", ".join(runs[m][i].run_id for m in order), highlight=False)
        return
    for mode, rs in runs.items():
        console.print(f"# {mode}: one worker start, then " + ", ".join(r.run_id for r in rs), highlight=False)
