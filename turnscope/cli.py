"""The ``turnscope`` command: build the embedded model, run the evaluation matrix, show results.

Settings (store, model, ports, connector, timeouts) come from options, ``TURNSCOPE_*`` environment
variables and a config file (``--config`` or ``TURNSCOPE_CONFIG``), in that order
(``turnscope.settings``, docs/configuration.md); the effective configuration is saved with
every run.
"""

from __future__ import annotations

import importlib.util
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated

import duckdb
import typer
from rich.console import Console
from rich.table import Table

from loadgen import eval_report as report
from loadgen.traces.formats import REQUEST_FORMATS
from serving import kubernetes as kube
from serving.embedded_model import DEFAULT_MODEL_DIR, ensure_model
from serving.prometheus_config import render_prometheus_config
from serving.stack import ModeStack
from serving.topology import ProxySettings, Topology, TopologyError, embedded_topology, load_topology
from serving.workers import key_env_shell, mode_workers, port_in_use, worker_command
from turnscope import console_text, resources, schedule
from turnscope.analysis import pd_check
from turnscope.calibration import DEFAULT_MODES as CAL_MODES
from turnscope.contract import (
    DECODER_KV_BLOCKS_TTL_S,
    KV_RECOMPUTE_THRESHOLD_TOKENS,
    ROUTING_POLICIES,
    RoutingPolicy,
)
from turnscope.evaluation import default_log_dir, default_settings, run_eval
from turnscope.modes import MODES
from turnscope.prefix_sweep import SWEEP_MODES, plan_sweep, run_sweep
from turnscope.settings import SettingsError, TurnscopeSettings

EPILOG = """Examples:

  turnscope demo                                        # the main job on the embedded default

  turnscope eval --modes pd-nocache,pd-bidir-nocache --sessions 8

  turnscope eval --workload data/workloads/mixed.yaml --time-scale 0.05

  turnscope sweep                                       # the vendor's prefix sweep, 5 modes x 4 points (~13 min)

  turnscope traffic data/traces/kv-cache-tester          # what the shipped Claude Code traces say about reuse

  turnscope plan data/traces/kv-cache-tester --profile data/profiles/vendor-h200.yaml   # a FORECAST

  turnscope plan-check --fit-store OLD --check-store NEW --write-profile p.yaml   # forecast runs not fitted on

  turnscope calibrate --out cal.yaml                    # measure every planner cost, 128 tokens to the model's limit

  turnscope serve --mode pd-bidir                       # then: locust -f loadgen/locustfile.py --host http://127.0.0.1:8200

  turnscope serve --topology data/topologies/vendor-h200-1p1d.yaml --mode pd-bidir --dry-run
"""

app = typer.Typer(help="Does reusing KV cache across the turns of agent sessions pay off on your traffic?",
                  epilog=EPILOG, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode="markdown")
console = Console()
_state: dict = {}
ALL_MODES = ",".join(MODES)
LOG_DIR = default_log_dir()
#: The DuckDB shell beside this Python (the duckdb-cli dependency), as an operator types it.
DUCKDB = ".venv/bin/duckdb" if resources.in_checkout() else str(Path(sys.executable).with_name("duckdb"))

ModesOpt = Annotated[str, typer.Option(help=f"Comma-separated serving modes, of: {', '.join(MODES)}.")]
StoreOpt = Annotated[Path | None, typer.Option(help="Store directory (Parquet shards + turnscope.duckdb "
                                                    "views). Default: settings `store` (data/ of the checkout, "
                                                    "./turnscope-data installed).")]
TopologyOpt = Annotated[Path | None, typer.Option(
    help="Topology YAML (workers, model, connector settings), or a shipped one's name (embedded-cpu-2p1d). "
         "Default: the embedded CPU layout from settings.")]
_ROUTING_HELP = (f"How the proxy picks the {{role}} worker of a request: {', '.join(ROUTING_POLICIES)} "
                 "(docs/configuration.md, \"Routing\"). Default: settings `{role}_routing` (session); "
                 "wins over a topology file's `proxy.{role}_routing`. Recorded with each run.")
PrefillRoutingOpt = Annotated[RoutingPolicy | None, typer.Option(help=_ROUTING_HELP.format(role="prefill"))]
DecodeRoutingOpt = Annotated[RoutingPolicy | None, typer.Option(help=_ROUTING_HELP.format(role="decode"))]


def shipped(path: Path | None, kind: str) -> Path | None:
    """``path`` as given, or the shipped file of that name when it does not exist (``--profile
    embedded-cpu``, ``data/workloads/mixed.yaml`` from any directory; turnscope.resources.find)."""
    return None if path is None else resources.find(path, kind)


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print an actionable error and return the Exit to raise."""
    console.print(f"[red]error:[/red] {message}", highlight=False)
    return typer.Exit(code)


@app.callback()
def main(config: Annotated[Path | None, typer.Option(
        "--config", envvar="TURNSCOPE_CONFIG", help="TOML or YAML settings file (docs/configuration.md).")] = None
         ) -> None:
    """turnscope: does bidirectional KV transfer between vLLM prefill and decode workers pay off on
    your agent sessions, against your real baseline?"""
    # systemd, docker and `kill` stop turnscope the way Ctrl-C does: the workers it started stop too
    signal.signal(signal.SIGTERM, _interrupt)
    _state["config"] = config
    try:
        _state["settings"] = TurnscopeSettings.load(config)
    except SettingsError as exc:
        raise fail(str(exc)) from exc


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def settings(**options: object) -> TurnscopeSettings:
    """The settings of this invocation; ``options`` are command-line options that override them
    (None: not given), so ``effective()`` records what the run used."""
    given = {k: v for k, v in options.items() if v is not None}
    if not given:
        return _state.get("settings") or TurnscopeSettings.load()
    try:
        return TurnscopeSettings.load(_state.get("config"), **given)
    except SettingsError as exc:
        raise fail(str(exc)) from exc


def _topology(path: Path | None, prefill_routing: str | None = None, decode_routing: str | None = None) -> Topology:
    """The topology at ``path``, or the embedded layout built from the settings (model built if
    missing). The routing options, when given, replace the topology's (a file's ``proxy`` section);
    the embedded layout takes the settings' ``prefill_routing``/``decode_routing``."""
    s = settings(prefill_routing=prefill_routing, decode_routing=decode_routing)
    if path is None:
        if s.model == DEFAULT_MODEL_DIR:
            with console.status("building the embedded model"):
                ensure_model(s.model)
        topo = embedded_topology(str(s.model), worker_port=s.ports.worker_base,
                                 side_channel_port=s.ports.side_channel_base, proxy_port=s.ports.proxy,
                                 connector=s.topology_connector())
        topo.proxy = ProxySettings(host=s.host, port=s.ports.proxy, prefill_timeout_s=s.prefill_timeout_s,
                                   decode_timeout_s=s.decode_timeout_s, handle_ttl_margin_s=s.handle_ttl_margin_s,
                                   prefill_routing=s.prefill_routing, decode_routing=s.decode_routing)
        return topo
    try:
        topo = load_topology(shipped(path, "topologies"))
    except TopologyError as exc:
        raise fail(str(exc)) from exc
    if prefill_routing is not None:
        topo.proxy.prefill_routing = prefill_routing
    if decode_routing is not None:
        topo.proxy.decode_routing = decode_routing
    return topo


def _split(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


@app.command()
def model(out: Annotated[Path, typer.Option(help="Where to write the model.")] = DEFAULT_MODEL_DIR) -> None:
    """Build the embedded tiny model (tokenizer + random-weight Llama, float32) if missing."""
    t0 = time.monotonic()
    with console.status("building the embedded model"):
        path = ensure_model(out)
    console.print(f"model ready at {path} ({time.monotonic() - t0:.1f} s)")


SCHEDULE_HELP = ("interleaved: the workers of the modes compared with one another up together (own ports), "
                 "their sessions played in rounds, the modes' order shuffled each round, so the machine's "
                 "drift falls on every side; sequential: one mode after another (docs/results.md, "
                 "\"Schedule\").")


@app.command("eval")
def evaluate(
    modes: ModesOpt = ALL_MODES,
    histories: Annotated[str, typer.Option(help="History modes: text (chat clients), token_ids (RL clients).")
                         ] = "text,token_ids",
    workload: Annotated[Path | None, typer.Option(
        help="Workload YAML, or a shipped one's name (mixed, claude-code-pair, ...). Default: replay of the "
             "tau-bench airline conversations.")] = None,
    time_scale: Annotated[float, typer.Option(help="Multiplies a workload's gaps (0.05 compresses 10 min to 30 s).")
                          ] = 1.0,
    sessions: Annotated[int, typer.Option(help="Sessions per run.")] = 4,
    users: Annotated[int, typer.Option(help="Concurrent sessions (Locust users).")] = 2,
    max_turns: Annotated[int, typer.Option(help="Turns per session at most.")] = 6,
    max_tokens: Annotated[int, typer.Option(help="Output tokens per turn.")] = 32,
    gap_s: Annotated[float, typer.Option(help="Seconds between replayed turns (tool/think gap).")] = 1.0,
    topology: TopologyOpt = None,
    prefill_routing: Annotated[str | None, typer.Option(help=_ROUTING_HELP.format(role="prefill") + " Several, "
                               "comma-separated (round-robin,session): each mode's workers start once and every "
                               "history mode is run once per policy, the proxy restarted between them.")] = None,
    decode_routing: DecodeRoutingOpt = None,
    store: StoreOpt = None,
    label: Annotated[str, typer.Option(help="Label of these runs.")] = "eval",
    schedule_: Annotated[str, typer.Option("--schedule", help=SCHEDULE_HELP)] = schedule.INTERLEAVED,
    rounds: Annotated[int, typer.Option(help="Interleaved schedule: rounds per history mode (each plays a "
                                        "slice of every run's sessions); 0: one per --users sessions, at most "
                                        f"{schedule.MAX_AUTO_ROUNDS}.")] = 0,
    schedule_seed: Annotated[int, typer.Option(help="Interleaved schedule: seeds the order of the modes in "
                                               "each round (recorded with the runs).")] = 0,
) -> None:
    """Run the same agent sessions against each serving mode; print TTFT and reuse per mode.

    Each mode's workers start, warm up, serve every history mode as its own run (own cold prefix
    cache), and stop. By default the modes compared with one another are up together and their
    sessions interleaved in shuffled rounds (--schedule sequential: one mode after another).
    Rows go to the store; `turnscope dashboard` shows them.
    """
    if schedule_ not in schedule.SCHEDULES:
        raise fail(f"--schedule takes {' or '.join(schedule.SCHEDULES)}; got {schedule_!r}")
    if rounds < 0:
        raise fail(f"--rounds must be >= 0, got {rounds}")
    p_routings = _split(prefill_routing) if prefill_routing else []
    bad = [p for p in p_routings if p not in ROUTING_POLICIES]
    if bad or (prefill_routing is not None and not p_routings):
        raise fail(f"--prefill-routing takes policies of {', '.join(ROUTING_POLICIES)}, comma-separated; "
                   f"got {prefill_routing!r}")
    first = p_routings[0] if p_routings else None
    s = settings(prefill_routing=first, decode_routing=decode_routing)
    topo = _topology(topology, first, decode_routing)
    if not topo.launch and modes == ALL_MODES:
        modes = topo.attached_mode  # attached workers run one mode: the one they were started in
    store = store or s.store
    workload = shipped(workload, "workloads")
    if workload is not None and not workload.exists():
        raise fail(f"workload file {workload} does not exist (shipped: {', '.join(resources.names('workloads'))})")
    ev = default_settings(Path(topo.model), topology=topo, modes=_split(modes), histories=_split(histories),
                          sessions=sessions, users=users, max_turns=max_turns, max_tokens=max_tokens, gap_s=gap_s,
                          store=store, label=label, workload=workload, time_scale=time_scale,
                          turn_timeout_s=s.turn_timeout_s, operator_config=s.effective(),
                          prefill_routings=p_routings if len(p_routings) > 1 else None,
                          schedule=schedule_, rounds=rounds, schedule_seed=schedule_seed)
    if s.kv_bytes_per_token:
        ev.kv_bytes_per_token = s.kv_bytes_per_token
    t0 = time.monotonic()
    try:
        run_ids = run_eval(ev, console)
    except (ValueError, RuntimeError, OSError) as exc:  # bad input, a worker or port, the store
        raise fail(str(exc)) from exc
    console.print(f"evaluation finished in {time.monotonic() - t0:.0f} s")
    roll_up_quietly(store)
    print_summary(store, run_ids)


def print_summary(store: Path, run_ids: list[str]) -> None:
    """Print TTFT p50/p90 by turn index, reuse outcomes, P's external KV tokens and the sessions
    that stopped before their last planned turn (e.g. at ``max_prompt_tokens``) per run, then
    the bottom line; every line fits the console's width (80 in a log file) without cutting a name."""
    ttft = report.ttft_by_turn(store, run_ids)
    outs = report.outcomes(store, run_ids)
    ext = report.external_kv_tokens(store, run_ids).set_index("run_id")["external_kv_tokens"].to_dict()
    stopped = report.stopped_early(store, run_ids)
    pd_failed = pd_check.pd_check_failures(store, run_ids)
    from dashboard import db, queries

    runs = db.read(db.StoreLocation(store), queries.runs).set_index("run_id")
    for run_id in run_ids:
        rows = ttft[ttft.run_id == run_id]
        what = (f": {runs.at[run_id, 'mode']}, history {runs.at[run_id, 'history_mode']}"
                if run_id in runs.index else "")
        console_text.print_text(console, f"{run_id}{what}")
        table = Table(show_lines=False)
        for col in ("turn", "turns", "TTFT p50 (ms)", "TTFT p90 (ms)"):
            table.add_column(col, justify="right", overflow="fold")
        for r in rows.itertuples():
            table.add_row(str(r.turn_index), str(r.turns), f"{r.ttft_p50_s * 1000:.0f}", f"{r.ttft_p90_s * 1000:.0f}")
        console_text.print_table(console, table)
        o = outs[outs.run_id == run_id]
        console_text.print_list(console, "  reuse: ", [f"{r.reuse}={r.turns}" for r in o.itertuples()])
        console_text.print_text(console, f"prefill external_kv_transfer tokens: {int(ext.get(run_id) or 0)}", "  ")
        if run_id in pd_failed:
            console_text.print_text(console, f"FAILED: {pd_failed[run_id]}", "  ")
        cut = [f"{r.sessions} by {r.stop_reason} ({r.turns_not_sent} planned turns not sent)"
               for r in stopped[stopped.run_id == run_id].itertuples()]
        if cut:
            console_text.print_list(console, "  sessions stopped early: ", cut)
    print_bottom_line(store, run_ids)


def bottom_line_blocks(ratios: list) -> list[list[str]]:
    """The bottom line's text, one block of lines per comparison (``turnscope.analysis.headline.Ratio``):
    the comparison and history mode; the speed-up (``turnscope.analysis.speedup``: the same number, label
    and verdict as the Overview's cards) with its CI; medians and counts; for an undecided
    verdict, the forecast sessions per side (``turnscope.analysis.sample_size``)."""
    from turnscope.analysis import headline, speedup

    pct = round(headline.CONFIDENCE * 100)
    out = []
    for r in ratios:
        s = speedup.of(r)
        lines = [
            (f"{r.treatment} vs {r.baseline} (history {r.history_mode or 'unknown'}, "
            f"workload {r.workload or 'unnamed'})"),
            (f"  {speedup.LABEL} {speedup.fmt(s.value)}, {pct}% CI {speedup.fmt_ci(s.ci_low, s.ci_high)}: "
            f"{s.verdict.value}"),
            (f"  median TTFT {r.median_treatment_s * 1e3:.0f} vs {r.median_baseline_s * 1e3:.0f} ms over "
            f"{r.n_treatment} vs {r.n_baseline} turns ({r.sessions_treatment} vs {r.sessions_baseline} sessions)"),
        ]
        need = headline.sessions_needed(r)
        if need is not None:
            lines.append("  " + need.sentence())
        out.append(lines)
    return out


def print_bottom_line(store: Path, run_ids: list[str]) -> None:
    """Print the Overview page's headline for these runs: each pair of turnscope.analysis.headline.PAIRS
    with its speed-up (baseline / bidirectional median TTFT from the second turn on), 95% bootstrap
    CI by session, verdict and, when undecided, the sessions a decision needs (`bottom_line_blocks`)."""
    from dashboard import db, queries
    from turnscope.analysis import headline, speedup

    f = queries.TurnFilter(run_ids=tuple(run_ids))
    dstore = db.StoreLocation(store)
    samples = db.read(dstore, queries.ttft_samples, f, headline.MIN_TURN_INDEX, headline.MAX_CI_TURNS)
    stats = db.read(dstore, queries.ttft_stats, f, headline.MIN_TURN_INDEX)
    ratios = headline.headline_ratios(samples, stats=stats)
    if not ratios:
        return
    console.print()
    console_text.print_text(console, "Bottom line: TTFT from the second turn on (the dashboard's Overview)")
    console_text.print_text(console, speedup.MEANING + "; verdict: whether the 95% CI excludes 1")
    for line in schedule.describe_json(db.read(dstore, queries.run_schedules, run_ids)["schedule"]):
        console_text.print_text(console, line)
    for block in bottom_line_blocks(ratios):
        for line in block:
            console_text.print_text(console, line.strip(), "  " if line.startswith("  ") else "")


SWEEP_MODE_LIST = ",".join(SWEEP_MODES)
VENDOR_SWEEP = resources.shipped("workloads", "vendor-sweep.yaml")
CAPACITY_WORKLOAD = resources.shipped("workloads", "capacity.yaml")


@app.command()
def rollup(store: StoreOpt = None) -> None:
    """Roll up every finished run that has no fresh rollup: its run_summary, run_kv_transfer and
    run_handle_memory rows, stored beside the shards so the dashboard need not recompute them
    (dashboard/rollup.py; docs/schema.md, "Rollups"). A finished eval does this itself. It first
    recreates the store's views if they are of another schema version (a store written by an
    older turnscope); the shards are never changed."""
    from dashboard.rollup import Rollups
    from turnscope.store import Store

    root = store or settings().store
    if not (root / "turnscope.duckdb").exists():
        raise fail(f"no store at {root} (expected {root / 'turnscope.duckdb'}): run `turnscope demo` to make one")
    t0 = time.monotonic()
    try:
        Store(root).init()  # views of this schema version first (a store written by an older turnscope)
        written = Rollups(Store(root)).write_finished()
    except (OSError, RuntimeError, ValueError, duckdb.Error) as exc:
        raise fail(f"rollup of {root}: {exc}") from exc
    typer.echo(f"rolled up {len(written)} run(s) in {time.monotonic() - t0:.1f} s"
               + (f": {', '.join(written)}" if written else " (every finished run was fresh)"))


def roll_up_quietly(store: Path) -> None:
    """Roll up the store's finished runs after a run (`turnscope rollup`); a failure is said, not
    raised: the rows are stored and the dashboard reads the plain views meanwhile."""
    from dashboard.rollup import Rollups
    from turnscope.store import Store

    try:
        Rollups(Store(store)).write_finished()
    except (OSError, duckdb.Error) as exc:
        console.print(f"[yellow]rollup skipped[/yellow] ({exc}); `turnscope rollup` makes it later", highlight=False)


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
    go to the store (tables traffic_log, traffic_requests; views traffic_*; docs/schema.md), shown
    by the dashboard's Traffic page.
    """
    from loadgen.traces.errors import TraceFormatError
    from loadgen.traffic import build_report
    from turnscope.store import Store

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
                                   "(docs/planner.md, \"Queueing\", \"D's admission queue\").")] = True,
) -> None:
    """Forecast what KV reuse across turns would do on a traffic, model and hardware, without serving it.

    Per request: the proxy's outcome (with `miss_d_full` when D's KV space is full), tokens pulled / from
    P's own cache / recomputed, D's pinned KV over time, TTFT per mode. Prints the speed-up per mode
    pair, the TTL x D-memory frontier and the sessions whose pauses or edits defeat reuse; writes them to
    the store (plan_* tables, docs/schema.md). Every figure is a FORECAST labelled with its profile.
    """
    from turnscope.planner.cli_plan import run_plan

    s = settings()
    try:
        text = run_plan([shipped(p, "traces") for p in paths], profile_path=shipped(profile, "profiles"),
                        fit_runs=_split(fit_runs) if fit_runs else None,
                        format=format, store_root=store or s.store,
                        ttl_s=ttl_s if ttl_s is not None else float(s.connector.decoder_kv_blocks_ttl),
                        margin_s=margin_s,
                        threshold=threshold if threshold is not None else int(s.connector.kv_recompute_threshold),
                        prefill_workers=prefill_workers, decode_workers=decode_workers, routing=routing,
                        label=label, model=model, shared_prefix_tokens=shared_prefix_tokens, queue=queue)
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
) -> None:
    """Held-out check: fit a profile on one store or set of runs, forecast others it was not fitted on
    (each run planned alone, on its own clock), and print per mode the TTFT median absolute relative
    error and its p90, the forecast p90 TTFT against the measured one, the hit-rate error (pp) and the
    pulled-token error, with the split named
    (docs/planner.md, "Held-out check"). Checked runs that are steps of a capacity ramp also get the
    ramp's crossing forecast next to the measured one (docs/capacity.md). With ``--rerun-store`` the
    same figures for a second recording of the same workload as the forecast: what the machine's own
    repeatability allows (turnscope/planner/rerun_check.py)."""
    from turnscope import capacity_forecast
    from turnscope.planner import held_out
    from turnscope.planner.layer_timing import write_profile as write_yaml
    from turnscope.planner.profile import load_profile
    from turnscope.store import Store

    if rerun_store is not None:
        if profile is not None or write_profile is not None or fit_store is not None:
            raise fail("--rerun-store is the forecast itself: it takes no --profile, --write-profile or --fit-store")
        try:
            split = held_out.check_split(str(rerun_store), _split(fit_runs) if fit_runs else None, str(check_store),
                                         _split(check_runs) if check_runs else None, rerun=True)
            result, summ = held_out.rerun_check(split)
        except (ValueError, OSError, duckdb.Error) as exc:
            raise fail(str(exc)) from exc
        typer.echo(held_out.describe(split, summ, result.checks))
        typer.echo(result.describe())
        return
    fit_root = fit_store or check_store
    profile = shipped(profile, "profiles")
    try:
        split = held_out.check_split(str(fit_root), _split(fit_runs) if fit_runs else None, str(check_store),
                                     _split(check_runs) if check_runs else None,
                                     str(profile) if profile else None)
        given = load_profile(profile) if profile else None
        prof, checks, summ = held_out.held_out_check(split, given)
        if write_profile is not None:
            write_yaml(prof, write_profile, f"turnscope plan-check: {split.describe()}")
        ramps = capacity_forecast.measured_steps(Store(check_store), split.check_runs)
        # the ramp's intervals come from the profile's errors before this check (a fitted profile has
        # none yet): this check's errors are measured on the very steps being forecast
        before = prof.model_copy(update={"held_out": given.held_out if given else None})
        ramp_forecast = capacity_forecast.forecast_steps(Store(check_store), ramps, before)
    except (ValueError, OSError, duckdb.Error) as exc:
        raise fail(str(exc)) from exc
    typer.echo(held_out.describe(split, summ, checks))
    if not ramps.empty:
        typer.echo(capacity_forecast.describe(ramps, ramp_forecast))
    if write_profile is not None:
        typer.echo(f"Profile {prof.name} with its held-out errors written to {write_profile}.")


@app.command()
def recommend(
    paths: Annotated[list[Path], typer.Argument(
        help="Traffic: trace files or directories (as `turnscope plan` reads them).")],
    profile: Annotated[Path, typer.Option(help="Cost profile YAML, or a shipped one's name (embedded-cpu, vendor-h200).")],
    format: Annotated[str | None, typer.Option("--format", help="Read every path as this format.")] = None,
    current_strategy: Annotated[str, typer.Option(
        help="The current setting's strategy: recompute, pd, pd+host, pd-bidir or pd-bidir+host.")] = "pd-bidir",
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
    max_prefill_workers: Annotated[int, typer.Option(help="Search prefill workers 1..this.")] = 1,
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
    """Recommend what to deploy for a traffic (a FORECAST): the ledger of KV retention strategies
    (recompute, P's prefix cache, with a host tier, D-retention, both) and the best setting of TTL,
    threshold, D KV space, P count and routing as a diff of each role's `vllm serve` flags
    (docs/planner.md, "Ledger and recommendation")."""
    from turnscope.planner.cli_recommend import run_recommend
    from turnscope.planner.recommend import Setting

    try:
        text = run_recommend(
            [shipped(p, "traces") for p in paths], profile_path=shipped(profile, "profiles"), format=format,
            current=Setting(current_strategy, ttl_s, threshold,
                            None if current_d_kv_gib is None else current_d_kv_gib * 2**30, prefill_workers, 1,
                            routing),
            margin_s=margin_s, ttft_slo_s=ttft_slo_s, d_kv_gib=d_kv_gib, gpu_hour_usd=gpu_hour_usd,
            host_gib_hour_usd=host_gib_hour_usd, max_prefill_workers=max_prefill_workers, serve_model=serve_model,
            platform=platform, topology_path=topology, store_root=store, label=label,
            run_ids=_split(run_ids) if run_ids else None, write_topology=write_topology)
    except (ValueError, OSError, RuntimeError) as exc:
        raise fail(str(exc)) from exc
    typer.echo(text)


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
    (docs/planner.md, "Calibration over a wide prompt range")."""
    from turnscope.calibration import QUICK, CalibrationSettings, calibrated_profile, run_calibration
    from turnscope.planner.fit import FitError
    from turnscope.planner.layer_timing import write_profile as write_yaml

    s = settings()
    topo = _topology(topology)
    try:
        opts = QUICK if quick else {
            "lengths": [int(v) for v in _split(lengths)] if lengths else None,
            "extras": [int(v) for v in _split(extras)], "text_lengths": [int(v) for v in _split(text_lengths)],
            "repeats": repeats}
        cal = CalibrationSettings(topology=topo, modes=_split(modes), seed=seed, max_tokens=max_tokens,
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
    as a1 x + a2 x^2 and scaled by the layer count; every other figure from BASE (docs/planner.md,
    "Profiles: measured on a GPU")."""
    from turnscope.planner.layer_timing import PublishedTTFT, write_measured_profile

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
        points = [int(v) for v in _split(values)] if values else None
    except ValueError as exc:
        raise fail(f"--values takes comma-separated integers (tokens), got {values!r}") from exc
    sweep_id = sweep_id or f"{label}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}"
    try:
        plan = plan_sweep(workload, sweep_id=sweep_id, out_dir=LOG_DIR / "sweeps", scale=scale, values=points)
    except ValueError as exc:  # WorkloadError: the file, its sweep, the scale or the values
        raise fail(str(exc)) from exc
    topo = _topology(topology, prefill_routing, decode_routing)
    if not topo.launch and modes == SWEEP_MODE_LIST:
        modes = topo.attached_mode  # attached workers run one mode: the one they were started in
    store = store or s.store
    ev = default_settings(Path(topo.model), topology=topo, modes=_split(modes), histories=_split(histories),
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
    console.print(f"sweep finished in {time.monotonic() - t0:.0f} s; the dashboard's Sweep page draws it")
    print_sweep_summary(store, run_ids)


def print_sweep_summary(store: Path, run_ids: list[str]) -> None:
    """Print mean / p90 TTFT (ms) per point and mode, with hits and P's external_kv_transfer tokens:
    one row per (prefix, mode), so the table fits 80 columns whatever the number of modes."""
    df = report.sweep_summary(store, run_ids)
    for history, g in df.groupby("history_mode", sort=True):
        console_text.print_text(console, f"Sweep, history {history}: TTFT mean / p90 (ms) by prefix tokens; hits of "
                                         "later turns; P's external_kv_transfer tokens")
        modes = [m for m in SWEEP_MODES if m in set(g["mode"])] + sorted(set(g["mode"]) - set(SWEEP_MODES))
        table = Table()
        for col in ("prefix", "mode", "TTFT mean / p90", "hits", "P ext. tokens"):
            table.add_column(col, justify="left" if col == "mode" else "right", overflow="fold")
        for prefix, row in g.groupby("prefix_tokens", sort=True):
            for i, m in enumerate(modes):
                r = row[row["mode"] == m]
                if r.empty or r.iloc[0]["turns"] == 0:
                    table.add_row(str(prefix) if i == 0 else "", m, "-", "-", "-", end_section=i == len(modes) - 1)
                    continue
                r = r.iloc[0]
                table.add_row(str(prefix) if i == 0 else "", m, f"{r.ttft_mean_s * 1e3:.0f} / {r.ttft_p90_s * 1e3:.0f}",
                              f"{r.hits}/{r.later_turns}", f"{int(r.external_kv_tokens)}",
                              end_section=i == len(modes) - 1)
        console_text.print_table(console, table)


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
    from turnscope.capacity import plan_capacity, print_capacity_summary, run_capacity
    from turnscope.evaluation import Slo

    s = settings(prefill_routing=prefill_routing, decode_routing=decode_routing)
    workload = shipped(workload, "workloads")
    if not workload.exists():
        raise fail(f"workload file {workload} does not exist (the shipped one: data/workloads/capacity.yaml)")
    try:
        steps = [int(v) for v in _split(users)]
    except ValueError as exc:
        raise fail(f"--users takes comma-separated integers (concurrent sessions), got {users!r}") from exc
    try:
        slo = Slo(ttft_s=slo_ttft_s, tpot_s=slo_tpot_s)
    except ValueError as exc:
        raise fail(f"--slo-ttft-s and --slo-tpot-s must be > 0 seconds, got {slo_ttft_s} and {slo_tpot_s}") from exc
    if schedule_ not in schedule.SCHEDULES:
        raise fail(f"--schedule takes {' or '.join(schedule.SCHEDULES)}; got {schedule_!r}")
    topo = _topology(topology, prefill_routing, decode_routing)
    store = store or s.store
    ev = default_settings(Path(topo.model), topology=topo, modes=_split(modes), histories=[history], store=store,
                          label=label, max_tokens=32, turn_timeout_s=s.turn_timeout_s, operator_config=s.effective(),
                          schedule=schedule_, schedule_seed=schedule_seed)
    if s.kv_bytes_per_token:
        ev.kv_bytes_per_token = s.kv_bytes_per_token
    capacity_id = capacity_id or f"{label}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}"
    try:
        plan = plan_capacity(workload, capacity_id=capacity_id, users=steps, sessions_per_user=sessions_per_user,
                             slo=slo, topology=topo, kv_bytes_per_token=ev.kv_bytes_per_token,
                             decode_kv_tokens=decode_kv_tokens, ttl_s=ttl_s, handle_ttl_margin_s=handle_ttl_margin_s,
                             settle_s=settle_s)
    except ValueError as exc:  # WorkloadError, the steps, D's size, the TTL
        raise fail(str(exc)) from exc
    console.print(f"capacity {plan.capacity_id}: {plan.workload_name}, concurrent sessions "
                  f"{', '.join(str(st.users) for st in plan.steps)} ({sessions_per_user} sessions each per step); "
                  f"D KV {plan.decode_kv_cache_bytes / 2**20:.0f} MiB ({plan.decode_kv_tokens:,} tokens), TTL "
                  f"{plan.ttl_s} s; SLO TTFT <= {slo.ttft_s * 1e3:.0f} ms, TPOT <= {slo.tpot_s * 1e3:.0f} ms; "
                  f"modes {', '.join(ev.modes)}; history {history}", highlight=False)
    if dry_run:
        runs = plan.runs(ev, ev.modes, history)
        if schedule_ == schedule.INTERLEAVED and len(ev.modes) > 1:
            orders = schedule.step_orders(ev.modes, len(plan.steps), random.Random(schedule_seed))
            console.print(f"# {', '.join(ev.modes)}: workers started together, then step by step:", highlight=False)
            for i, order in enumerate(orders):
                console.print(f"#   step {i + 1}: " + ", ".join(runs[m][i].run_id for m in order), highlight=False)
            return
        for mode, rs in runs.items():
            console.print(f"# {mode}: one worker start, then " + ", ".join(r.run_id for r in rs), highlight=False)
        return
    t0 = time.monotonic()
    try:
        run_ids = run_capacity(ev, plan, history, console)
    except (ValueError, RuntimeError, OSError) as exc:  # bad input, a worker or port, the store
        raise fail(str(exc)) from exc
    console.print(f"capacity ramp finished in {time.monotonic() - t0:.0f} s; the dashboard's Memory page draws it")
    print_capacity_summary(store, run_ids, console)


@app.command()
def serve(
    mode: Annotated[str, typer.Option(help=f"Serving mode, one of: {', '.join(MODES)}.")] = "pd-bidir",
    topology: TopologyOpt = None,
    prefill_routing: PrefillRoutingOpt = None,
    decode_routing: DecodeRoutingOpt = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print each worker's command and environment.")
                       ] = False,
    prometheus_config: Annotated[bool, typer.Option(
        "--prometheus-config", help="Print a Prometheus scrape config for the proxy and the workers.")] = False,
    log_dir: Annotated[Path, typer.Option(help="Worker and proxy logs.")] = LOG_DIR,
    kubernetes: Annotated[bool, typer.Option(
        "--kubernetes", help="Print the Kubernetes objects that deploy the workers and the proxy "
                             "(docs/kubernetes.md).")] = False,
    image: Annotated[str | None, typer.Option(
        help="With --kubernetes: the image of the proxy and of `entry: turnscope` workers; it must have "
             "turnscope installed.")] = None,
    vllm_image: Annotated[str, typer.Option(
        help="With --kubernetes: the image of `entry: vllm` workers.")] = kube.STOCK_VLLM_IMAGE,
    namespace: Annotated[str, typer.Option(help="With --kubernetes: the objects' namespace.")] = "default",
    model_pvc: Annotated[str | None, typer.Option(
        help="With --kubernetes: the PersistentVolumeClaim holding the model (default <topology>-model).")] = None,
    nodes_per_worker: Annotated[int | None, typer.Option(
        help="With --kubernetes: nodes each worker spans, as a LeaderWorkerSet when over 1 (default: its "
             "--pipeline-parallel-size).")] = None,
) -> None:
    """Start (or attach to) the workers of one mode and the session-aware proxy; Ctrl-C stops them.

    Point Locust's web UI at the proxy: `locust -f loadgen/locustfile.py --host http://127.0.0.1:8200`.
    """
    topo = _topology(topology, prefill_routing, decode_routing)
    try:
        specs = mode_workers(mode, topo)
    except ValueError as exc:
        raise fail(str(exc)) from exc
    if kubernetes:
        options = kube.KubeOptions(image=image, vllm_image=vllm_image, namespace=namespace, model_pvc=model_pvc,
                                   nodes_per_worker=nodes_per_worker)
        try:
            print(kube.render(topo, mode, options), end="")
        except kube.KubernetesError as exc:
            raise fail(str(exc)) from exc
        return
    stack = ModeStack(mode, topo, log_dir)
    if prometheus_config:
        targets = [("turnscope-proxy", stack.proxy_url, "proxy")] + [("vllm", s.url, s.role) for s in specs]
        print(render_prometheus_config(targets), end="")
        return
    if dry_run:
        for spec in specs:
            argv, env = worker_command(spec)
            where = "already running (attach)" if not spec.launch else f"on {spec.host}"
            console.print(f"# {spec.name} ({spec.role}) {where}, {spec.url}", highlight=False)
            key = key_env_shell(spec)  # the key read where the topology says, never printed
            console.print(" ".join([f"{k}={shlex.quote(v)}" for k, v in env.items()] + ([key] if key else [])
                                   + [shlex.quote(a) for a in argv]), highlight=False, soft_wrap=True)
        console.print(f"# proxy on {stack.proxy_url}, prefill routing {topo.proxy.prefill_routing}, "
                      f"decode routing {topo.proxy.decode_routing}", highlight=False)
        console.print(" ".join(map(shlex.quote, stack.proxy_command(log_dir / f"{mode}-proxy.json"))),
                      highlight=False, soft_wrap=True)
        return
    if topo.platform == "gpu" and topo.launch and not _has_gpu():
        raise fail(f"topology {topo.name!r} is for GPUs but this machine has none (nvidia-smi found no device); "
                   "use --dry-run to print the commands for the GPU hosts")
    stack.progress = console.print
    try:
        with stack:
            console.print(f"mode {mode} serving through the proxy at {stack.proxy_url} (Ctrl-C to stop)")
            while all(w.proc is None or w.proc.poll() is None for w in stack.workers):
                time.sleep(1)
            gone = next(w for w in stack.workers if w.proc is not None and w.proc.poll() is not None)
            raise RuntimeError(f"worker {gone.spec.name} exited with {gone.proc.returncode}; stopped the others "
                               f"(its log: {gone.log_path})")
    except KeyboardInterrupt:
        console.print("stopping")
    except RuntimeError as exc:
        raise fail(str(exc)) from exc


def _has_gpu() -> bool:
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, check=False, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@app.command()
def dashboard(store: StoreOpt = None,
              port: Annotated[int, typer.Option(help="Port.")] = 8501,
              host: Annotated[str, typer.Option(help="Address to bind; anything but the loopback is warned "
                                                     "(the dashboard has no authentication).")] = "127.0.0.1",
              ) -> None:
    """Start the Streamlit dashboard over the store (Ctrl-C to stop)."""
    store = store or settings().store
    if not (store / "turnscope.duckdb").exists():
        console.print(f"no store at {store} yet: the dashboard will say so until `turnscope demo` writes one")
    if host not in ("127.0.0.1", "localhost", "::1"):
        console.print(f"[yellow]warning:[/yellow] binding {host}: the dashboard has no authentication; anyone "
                      "who reaches it can read every run", highlight=False)
    if port_in_use("127.0.0.1" if host in ("0.0.0.0", "::") else host, port):
        raise fail(f"port {port} on {host} is already in use (another dashboard? `ss -ltnp` shows who); "
                   "stop it or pass --port")
    env = os.environ | {"TURNSCOPE_STORE": str(store)}
    console.print(f"dashboard: http://{host}:{port}  (SQL: {DUCKDB} {store / 'turnscope.duckdb'})")
    try:
        # dashboard/serve.py: `streamlit run dashboard/app.py` with the pages' libraries imported first
        rc = subprocess.run([sys.executable, importlib.util.find_spec("dashboard.serve").origin,
                             "--server.headless", "true", "--server.address", host, "--server.port", str(port),
                             "--browser.gatherUsageStats", "false", "--client.toolbarMode", "viewer"], env=env, check=False).returncode
    except KeyboardInterrupt:
        return
    if rc != 0:
        raise fail(f"the dashboard (streamlit) exited with {rc}", code=1)


@app.command()
def demo(
    store: StoreOpt = None,
    sessions: Annotated[int, typer.Option(help="Sessions per run.")] = 3,
    max_turns: Annotated[int, typer.Option(help="Turns per session at most.")] = 4,
    no_dashboard: Annotated[bool, typer.Option("--no-dashboard", help="Do not start the dashboard.")] = False,
    schedule_: Annotated[str, typer.Option("--schedule", help=SCHEDULE_HELP)] = schedule.INTERLEAVED,
) -> None:
    """The main job on the embedded default: build the model if missing, evaluate every mode with
    both history modes on replayed tau-bench conversations, print the results, serve the dashboard."""
    store = store or settings().store
    evaluate(modes=",".join(MODES), histories="text,token_ids", workload=None, time_scale=1.0, sessions=sessions,
             users=1, max_turns=max_turns, max_tokens=32, gap_s=0.5, topology=None, store=store, label="demo",
             prefill_routing=None, decode_routing=None, schedule_=schedule_, rounds=0, schedule_seed=0)
    console.print(f"query it: {DUCKDB} {store / 'turnscope.duckdb'} -c \"select mode, history_mode, "
                  "turn_index, median(ttft_s) from turn_breakdown group by all order by all\"", highlight=False)
    if not no_dashboard:
        dashboard(store=store, port=8501)


if __name__ == "__main__":
    app()
