"""The commands that read traces and forecast: ``traffic``, ``plan``, ``plan-check``, ``recommend``,
``profile-from-timing`` (docs/traffic.md, docs/planner/overview.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import duckdb
import typer

from core.contract import (
    DECODER_KV_BLOCKS_TTL_S,
    KV_RECOMPUTE_THRESHOLD_TOKENS,
)
from loadgen.traces.formats import REQUEST_FORMATS
from planner.strategies import STRATEGIES, Strategy
from turnscope.commands.app import (
    StoreOpt,
    app,
    fail,
    settings,
    shipped,
    split_csv,
)

SessionsPerHourOpt = Annotated[float | None, typer.Option(
    help="The load: new sessions per hour, Poisson starts, each a session tree drawn from the traffic's mix "
         "(docs/planner/load.md). Needed for traces whose files each run on their own clock (kv-cache-tester).")]
ConcurrentSessionsOpt = Annotated[int | None, typer.Option(
    help="The load: this many sessions at once, a closed loop at the recorded pace (each slot starts its next "
         "drawn session when its previous one ends).")]
LoadScaleOpt = Annotated[float | None, typer.Option(
    help="The load: the trace's own shared clock sped up by this factor (2: twice the recorded rate). Default "
         "for shared-clock traces: 1.")]
SessionsOpt = Annotated[int, typer.Option(help="Session trees drawn for --sessions-per-hour / --concurrent-sessions.")]
LoadSeedOpt = Annotated[int, typer.Option(help="Seed of the sessions drawn and of the Poisson starts.")]


def load_of(sessions_per_hour: float | None, concurrent_sessions: int | None, load_scale: float | None,
            sessions: int, load_seed: int):
    """The :class:`planner.load.Load` the options name (None: none given). Exits with a
    clear message when more than one load is given or a value is out of range."""
    from pydantic import ValidationError

    from planner.load import Load, LoadKind

    given = [(k, v) for k, v in ((LoadKind.SESSIONS_PER_HOUR, sessions_per_hour),
                                 (LoadKind.CONCURRENT_SESSIONS, concurrent_sessions),
                                 (LoadKind.RECORDED, load_scale)) if v is not None]
    if len(given) > 1:
        raise fail("give one load: --sessions-per-hour, --concurrent-sessions or --load-scale")
    if not given:
        return None
    kind, value = given[0]
    try:
        return Load(kind=kind, value=value, sessions=sessions, seed=load_seed)
    except ValidationError as exc:
        flag = {LoadKind.SESSIONS_PER_HOUR: "--sessions-per-hour", LoadKind.CONCURRENT_SESSIONS:
                "--concurrent-sessions", LoadKind.RECORDED: "--load-scale"}[kind]
        what = exc.errors()[0]
        where = "--sessions" if what["loc"] and what["loc"][0] == "sessions" else flag
        raise fail(f"{where}: expected a load > 0 and at least one session drawn, got {flag} {value}, --sessions "
                   f"{sessions} ({what['msg']})") from exc


@app.command()
def traffic(
    paths: Annotated[list[Path], typer.Argument(
        help="Trace files or directories: kv-cache-tester (a file or a directory of trace_*.json), TraceLab "
             "round_trace.jsonl, Mooncake jsonl, Azure csv, or a store directory (its recorded runs); a shipped "
             "trace also by its name (kv-cache-tester, tracelab_round_trace.jsonl).")],
    format: Annotated[str | None, typer.Option(
        "--format", help=f"Read every path as this format ({', '.join(REQUEST_FORMATS)}). "
                         "Default: detected per path.")] = None,
    store: StoreOpt = None,
    label: Annotated[str | None, typer.Option(help="Label of this report.")] = None,
    ttl_s: Annotated[float | None, typer.Option(
        help="The decoder KV TTL to mark (seconds). Default: settings connector.decoder_kv_blocks_ttl.")] = None,
) -> None:
    """Read traces without serving them and print what they say about KV reuse across turns.

    Sessions and requests, context growth, gaps by kind against TTLs of 30 s to 1 h, the share of
    input tokens reusable from the session's previous request, and overlapping sessions. The rows
    go to the store (tables traffic_log, traffic_requests; views traffic_*; docs/schema/traffic.md), shown
    by the dashboard's Traffic page.
    """
    from loadgen.traces.errors import TraceFormatError
    from loadgen.traffic import build_report
    from store.writer import Store

    s = settings()
    try:
        rep = build_report(Store(store or s.store), [shipped(p, "traces") for p in paths], format=format, label=label,
                           ttl_s=ttl_s if ttl_s is not None else float(s.connector.decoder_kv_blocks_ttl),
                           recompute_threshold_tokens=int(s.connector.kv_recompute_threshold))
    except (TraceFormatError, ValueError, OSError, RuntimeError) as exc:
        raise fail(str(exc)) from exc
    typer.echo(rep.text())


@app.command()
def plan(
    paths: Annotated[list[Path], typer.Argument(
        help="Traffic: trace files or directories (as `turnscope traffic` reads them), or a store directory "
             "(its recorded runs).")],
    profile: Annotated[Path | None, typer.Option(
        help="Cost profile YAML, or a shipped one's name (embedded-cpu, vendor-h200). Default: fitted from the "
             "recorded runs given by --fit-runs.")
                       ] = None,
    fit_runs: Annotated[str | None, typer.Option(
        help="Comma-separated run ids of the store (--store) to fit the profile from, and to check the forecast "
             "against (each run planned from its own records, turn by turn).")] = None,
    format: Annotated[str | None, typer.Option("--format", help="Read every path as this format.")] = None,
    ttl_s: Annotated[float | None, typer.Option(help="decoder_kv_blocks_ttl, seconds. Default: settings.")] = None,
    margin_s: Annotated[float, typer.Option(help="The proxy's handle TTL margin, seconds.")] = 30.0,
    threshold: Annotated[int | None, typer.Option(help="kv_recompute_threshold, tokens. Default: settings.")] = None,
    prefill_workers: Annotated[int, typer.Option(help="Prefill workers.")] = 1,
    decode_workers: Annotated[int, typer.Option(help="Decode workers.")] = 1,
    routing: Annotated[str, typer.Option(help="How requests go to P (and aggregated) workers: session (sticky, the proxy's default) or round-robin (prefix-aware is not modelled).")] = "session",
    store: StoreOpt = None,
    label: Annotated[str | None, typer.Option(help="Label of this plan.")] = None,
    model: Annotated[Path | None, typer.Option(
        help="The model's directory or config.json: its KV bytes per token replace the profile's "
             "(serving/kv_size.py; sliding-window layouts are refused).")] = None,
    shared_prefix_tokens: Annotated[int | None, typer.Option(
        help="Tokens every session's first request shares with earlier sessions (a system prompt), found in "
             "a worker's prefix cache. Default: with --fit-runs, P's first-turn hits in those runs; else 0.")] = None,
    queue: Annotated[bool, typer.Option(
        "--queue/--no-queue", help="Requests wait for the prompts before them on their prefill (or aggregated) "
                                   "worker, and on D for room in its KV space, first come first served "
                                   "(docs/planner/simulation.md).")] = True,
    sessions_per_hour: SessionsPerHourOpt = None,
    concurrent_sessions: ConcurrentSessionsOpt = None,
    load_scale: LoadScaleOpt = None,
    sessions: SessionsOpt = 400,
    load_seed: LoadSeedOpt = 0,
) -> None:
    """Forecast what KV reuse across turns would do on a traffic, model and hardware, without serving it.

    Per request: the proxy's outcome (with `miss_d_full` when D's KV space is full), tokens pulled / from
    P's own cache / recomputed, D's pinned KV over time, TTFT per mode. Prints the speed-up per mode
    pair, the TTL x D-memory frontier and the sessions whose pauses or edits defeat reuse; writes them to
    the store (plan_* tables, docs/schema/plans.md). Every figure is a FORECAST labelled with its profile.
    """
    from planner.cli_plan import run_plan

    s = settings()
    load = load_of(sessions_per_hour, concurrent_sessions, load_scale, sessions, load_seed)
    try:
        text = run_plan([shipped(p, "traces") for p in paths], profile_path=shipped(profile, "profiles"),
                        fit_runs=split_csv(fit_runs) if fit_runs else None,
                        format=format, store_root=store or s.store,
                        ttl_s=ttl_s if ttl_s is not None else float(s.connector.decoder_kv_blocks_ttl),
                        margin_s=margin_s,
                        threshold=threshold if threshold is not None else int(s.connector.kv_recompute_threshold),
                        prefill_workers=prefill_workers, decode_workers=decode_workers, routing=routing,
                        label=label, model=model, shared_prefix_tokens=shared_prefix_tokens, queue=queue,
                        load=load)
    except (ValueError, OSError, RuntimeError) as exc:
        raise fail(str(exc)) from exc
    typer.echo(text)


@app.command("plan-check")
def plan_check(
    check_store: Annotated[Path, typer.Option(help="The store whose runs are checked (forecast and compared).")],
    fit_store: Annotated[Path | None, typer.Option(
        help="The store whose runs the profile is fitted on. Default: --check-store (then the checked runs "
             "are its other runs).")] = None,
    fit_runs: Annotated[str | None, typer.Option(help="Comma-separated run ids to fit on. Default: every run "
                                                      "of --fit-store in a planned mode.")] = None,
    check_runs: Annotated[str | None, typer.Option(help="Comma-separated run ids to check. Default: every run "
                                                        "of --check-store in a planned mode not fitted on.")] = None,
    profile: Annotated[Path | None, typer.Option(
        help="Check this profile file instead of fitting one (e.g. data/profiles/embedded-cpu.yaml).")] = None,
    write_profile: Annotated[Path | None, typer.Option(
        help="Write the profile with its held-out errors (the source of every forecast interval) to this "
             "YAML file.")] = None,
    rerun_store: Annotated[Path | None, typer.Option(
        help="Repeatability instead of a profile: this store's runs (the same workload recorded at another "
             "time; --fit-runs picks them) are the forecast of the checked runs, turn for turn.")] = None,
    split_terms: Annotated[bool, typer.Option(
        "--split/--no-split", help="Print each checked run's TTFT split: the forecast's terms (compute, queue for "
                                   "P, pull, wait on D, b0 and renders, contention) beside what the run's workers "
                                   "measured of them, and the engine's speed through the run "
                                   "(docs/planner/concurrency.md).")] = True,
) -> None:
    """Held-out check: fit a profile on one store or set of runs, forecast others it was not fitted on
    (each run planned alone, on its own clock), and print per mode the TTFT median absolute relative
    error and its p90, the forecast p90 TTFT against the measured one, the hit-rate error (pp) and the
    pulled-token error, with the split named
    (docs/planner/held-out.md). Checked runs that are steps of a capacity ramp also get the
    ramp's crossing forecast next to the measured one (docs/capacity.md). With ``--rerun-store`` the
    same figures for a second recording of the same workload as the forecast: what the machine's own
    repeatability allows (planner/rerun_check.py)."""
    from planner import held_out
    from planner.layer_timing import write_profile as write_yaml
    from planner.profile import load_profile
    from store.db import StoreInvalid
    from store.writer import Store
    from turnscope.conductor import capacity_forecast

    if rerun_store is not None:
        if profile is not None or write_profile is not None or fit_store is not None:
            raise fail("--rerun-store is the forecast itself: it takes no --profile, --write-profile or --fit-store")
        try:
            split = held_out.check_split(str(rerun_store), split_csv(fit_runs) if fit_runs else None, str(check_store),
                                         split_csv(check_runs) if check_runs else None, rerun=True)
            result, summ = held_out.rerun_check(split)
        except (ValueError, OSError, duckdb.Error, StoreInvalid) as exc:
            raise fail(str(exc)) from exc
        typer.echo(held_out.describe(split, summ, result.checks))
        typer.echo(result.describe())
        return
    fit_root = fit_store or check_store
    profile = shipped(profile, "profiles")
    try:
        split = held_out.check_split(str(fit_root), split_csv(fit_runs) if fit_runs else None, str(check_store),
                                     split_csv(check_runs) if check_runs else None,
                                     str(profile) if profile else None)
        given = load_profile(profile) if profile else None
        prof, checks, summ, terms = held_out.held_out_check_terms(split, given)
        if write_profile is not None:
            write_yaml(prof, write_profile, f"turnscope plan-check: {split.describe()}")
        ramps = capacity_forecast.measured_steps(Store(check_store), split.check_runs)
        # the ramp's intervals come from the profile's errors before this check (a fitted profile has
        # none yet): this check's errors are measured on the very steps being forecast
        before = prof.model_copy(update={"held_out": given.held_out if given else None})
        ramp_forecast = capacity_forecast.forecast_steps(Store(check_store), ramps, before)
        ramp_turns = capacity_forecast.measured_turns(Store(check_store), split.check_runs) if not ramps.empty else None
    except (ValueError, OSError, duckdb.Error, StoreInvalid) as exc:
        raise fail(str(exc)) from exc
    typer.echo(held_out.describe(split, summ, checks))
    if split_terms:
        typer.echo(run_split(Store(check_store), terms, split.check_runs))
    if not ramps.empty:
        typer.echo(capacity_forecast.describe(ramps, ramp_forecast, ramp_turns, held_out.run_errors(checks)))
    if write_profile is not None:
        typer.echo(f"Profile {prof.name} with its held-out errors written to {write_profile}.")


def run_split(store, terms, run_ids) -> str:
    """The TTFT split of the checked runs (:mod:`analysis.ttft_split`) as text."""
    from analysis import ttft_split

    measured = ttft_split.measured_terms(ttft_split.measured_sums(store, list(run_ids)))
    table = ttft_split.split_table(ttft_split.forecast_means(terms), measured)
    windows, why = ttft_split.read_speed(store, list(run_ids))
    return ttft_split.describe(table, ttft_split.slow_stretch(windows) if why is None else None,
                               speed_note=why or "no prefill in the run's scrapes")


@app.command()
def recommend(
    paths: Annotated[list[Path], typer.Argument(
        help="Traffic: trace files or directories (as `turnscope plan` reads them).")],
    profile: Annotated[Path, typer.Option(help="Cost profile YAML, or a shipped one's name (embedded-cpu, vendor-h200).")],
    format: Annotated[str | None, typer.Option("--format", help="Read every path as this format.")] = None,
    current_strategy: Annotated[str, typer.Option(
        help=f"The current setting's strategy: {', '.join(STRATEGIES)}.")] = Strategy.PD_BIDIR.value,
    ttl_s: Annotated[float, typer.Option(help="Current decoder_kv_blocks_ttl, seconds.")] = float(DECODER_KV_BLOCKS_TTL_S),
    threshold: Annotated[int, typer.Option(help="Current kv_recompute_threshold, tokens.")] = KV_RECOMPUTE_THRESHOLD_TOKENS,
    prefill_workers: Annotated[int, typer.Option(help="Current prefill workers.")] = 1,
    routing: Annotated[str, typer.Option(help="Current prefill routing: session or round-robin.")] = "session",
    current_d_kv_gib: Annotated[float | None, typer.Option(
        help="Current KV space of one decode worker, GiB (default: the profile's), e.g. 0.0625 for "
             "`turnscope capacity`'s 64 MiB D.")] = None,
    margin_s: Annotated[float, typer.Option(help="The proxy's handle TTL margin, seconds.")] = 30.0,
    ttft_slo_s: Annotated[float | None, typer.Option(help="SLO on p90 TTFT, seconds (default: none).")] = None,
    d_kv_gib: Annotated[float | None, typer.Option(
        help="The most KV space one decode worker may have, GiB (default: the profile's).")] = None,
    gpu_hour_usd: Annotated[float | None, typer.Option(
        help="Price of one GPU-hour, USD (no default: without it, physical figures only).")] = None,
    host_gib_hour_usd: Annotated[float | None, typer.Option(
        help="Price of one GiB-hour of host memory, USD (no default).")] = None,
    max_prefill_workers: Annotated[int, typer.Option(help="Fleet sizing: at most this many prefill workers.")] = 16,
    max_decode_workers: Annotated[int, typer.Option(help="Fleet sizing: at most this many decode workers.")] = 16,
    sessions_per_hour: SessionsPerHourOpt = None,
    concurrent_sessions: ConcurrentSessionsOpt = None,
    load_scale: LoadScaleOpt = None,
    sessions: SessionsOpt = 400,
    load_seed: LoadSeedOpt = 0,
    curve: Annotated[bool, typer.Option("--curve/--no-curve", help="Also forecast each strategy's fleet at 1/8 to "
                                                                   "8x the load (drawn loads).")] = True,
    executor: Annotated[str, typer.Option(help="Where the forecasts run: local (this machine's cores) or ray "
                                               "(a Ray cluster: pip install 'turnscope[ray]').")] = "local",
    workers: Annotated[int | None, typer.Option(help="local: processes (default: the machine's cores).")] = None,
    ray_address: Annotated[str | None, typer.Option(help="ray: the cluster's address (default: a local one).")
                           ] = None,
    serve_model: Annotated[str, typer.Option(help="The model argument to print in the vllm serve flags.")] = "MODEL",
    platform: Annotated[str, typer.Option(help="Render the flags for this platform: gpu or cpu.")] = "gpu",
    topology: Annotated[Path | None, typer.Option(
        help="The current deployment's topology file, the base of the printed topology diff (default: the "
             "embedded layout with --platform cpu, a generic 1P1D GPU layout with gpu).")] = None,
    store: Annotated[Path | None, typer.Option(
        help="Write the ledger and the recommendation to this store (plan_ledger, plan_recommendations; the "
             "dashboard's Plan page shows them). Default: print only.")] = None,
    label: Annotated[str | None, typer.Option(help="Label of the stored recommendation.")] = None,
    run_ids: Annotated[str | None, typer.Option(
        help="Comma-separated run ids: of a store directory given as traffic, read only these runs (recorded runs "
             "read together share one clock).")] = None,
    write_topology: Annotated[Path | None, typer.Option(
        help="Write the recommended topology file (data/topologies/*.yaml format) here.")] = None,
) -> None:
    """Recommend what to deploy for a traffic at a load (a FORECAST): the smallest fleet (P and D
    workers, GPUs) per KV retention strategy that meets the SLO, the cheapest of them, the ledger at
    the current setting, and the best TTL, threshold, D KV space and routing on that fleet as a diff
    of each role's `vllm serve` flags (docs/planner/fleet.md, docs/planner/ledger.md). A setting that
    cannot keep up with the load is named overloaded, with no TTFT."""
    from planner.cli_recommend import run_recommend
    from planner.executor import executor_for
    from planner.recommend import Setting

    load = load_of(sessions_per_hour, concurrent_sessions, load_scale, sessions, load_seed)
    try:
        runner = executor_for(executor, workers, ray_address)
    except (ValueError, RuntimeError) as exc:
        raise fail(f"--executor {executor}: {exc}") from exc
    try:
        text = run_recommend(
            [shipped(p, "traces") for p in paths], profile_path=shipped(profile, "profiles"), format=format,
            current=Setting(current_strategy, ttl_s, threshold,
                            None if current_d_kv_gib is None else current_d_kv_gib * 2**30, prefill_workers, 1,
                            routing),
            margin_s=margin_s, ttft_slo_s=ttft_slo_s, d_kv_gib=d_kv_gib, gpu_hour_usd=gpu_hour_usd,
            host_gib_hour_usd=host_gib_hour_usd, max_prefill_workers=max_prefill_workers, serve_model=serve_model,
            platform=platform, topology_path=topology, store_root=store, label=label,
            run_ids=split_csv(run_ids) if run_ids else None, write_topology=write_topology, load=load,
            max_decode_workers=max_decode_workers, executor=runner, curve=curve)
    except (ValueError, OSError, RuntimeError) as exc:
        raise fail(str(exc)) from exc
    typer.echo(text)


@app.command("profile-from-timing")
def profile_from_timing(
    timing: Annotated[Path, typer.Argument(help="bench/layer_prefill.py's JSON output (one layer timed on a GPU).")],
    base: Annotated[Path, typer.Option(help="The profile whose other figures are kept (e.g. "
                                             "data/profiles/vendor-h200.yaml).")],
    out: Annotated[Path, typer.Option(help="Where to write the new profile YAML.")],
    name: Annotated[str | None, typer.Option(help="The new profile's name (default: BASE's name + -measured).")
                    ] = None,
    anchor_tokens: Annotated[int | None, typer.Option(
        help="Prompt tokens of a published TTFT computed from scratch: b0 is re-derived so that the profile "
             "meets it (b0 = TTFT - c(tokens)). With --anchor-ttft-s.")] = None,
    anchor_ttft_s: Annotated[float | None, typer.Option(help="The published TTFT at --anchor-tokens, seconds.")] = None,
    anchor_source: Annotated[str, typer.Option(help="Where the anchor was published.")] = "published",
    check_tokens: Annotated[int | None, typer.Option(
        help="Prompt tokens of a second published TTFT to check the measured curve against.")] = None,
    check_ttft_s: Annotated[float | None, typer.Option(help="The published TTFT at --check-tokens, seconds.")] = None,
) -> None:
    """Write a cost profile whose prefill curve c(x) was measured: one decoder layer's timings fitted
    as a1 x + a2 x^2 and scaled by the layer count; every other figure from BASE
    (docs/planner/profiles.md)."""
    from planner.layer_timing import PublishedTTFT, write_measured_profile

    for flag, pair in (("--anchor-tokens/--anchor-ttft-s", (anchor_tokens, anchor_ttft_s)),
                       ("--check-tokens/--check-ttft-s", (check_tokens, check_ttft_s))):
        if (pair[0] is None) != (pair[1] is None):
            raise fail(f"{flag}: give both or neither")
    try:
        anchor = PublishedTTFT(anchor_tokens, anchor_ttft_s, anchor_source) if anchor_tokens is not None else None
        check = PublishedTTFT(check_tokens, check_ttft_s, "published check") if check_tokens is not None else None
        text = write_measured_profile(timing, shipped(base, "profiles"), out, name=name, anchor=anchor, check=check)
    except (ValueError, OSError) as exc:
        raise fail(str(exc)) from exc
    typer.echo(text)
