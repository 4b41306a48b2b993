"""The commands that run things: ``model``, ``eval``, ``serve``, ``check``, ``dashboard``, ``rollup``, ``demo``."""

from __future__ import annotations

import importlib.util
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated

import duckdb
import typer

from core import resources
from core.contract import (
    ROUTING_POLICIES,
    Role,
)
from core.modes import MODES, PD_BIDIR
from serving import kubernetes as kube
from serving.embedded_model import DEFAULT_MODEL_DIR, ensure_model
from serving.prometheus_config import render_prometheus_config
from serving.stack import ModeStack
from serving.workers import key_env_shell, mode_workers, port_in_use, worker_command
from store.console import SHELL_EXAMPLE
from turnscope.commands.app import (
    ALL_MODES,
    DUCKDB,
    LOG_DIR,
    ROUTING_HELP,
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
    print_regimes,
    print_summary,
    roll_up_quietly,
)
from turnscope.conductor import schedule
from turnscope.conductor.evaluation import default_settings, run_eval
from turnscope.conductor.serve_metrics import ServeMetrics


@app.command()
def model(out: Annotated[Path, typer.Option(help="Where to write the model.")] = DEFAULT_MODEL_DIR) -> None:
    """Build the embedded tiny model (tokenizer + random-weight Llama, float32) if missing."""
    t0 = time.monotonic()
    with console.status("building the embedded model"):
        path = ensure_model(out)
    console.print(f"model ready at {path} ({time.monotonic() - t0:.1f} s)")


SCHEDULE_HELP = ("interleaved: the workers of the modes compared with one another up together (own ports), "
                 "their sessions played in rounds, the modes' order shuffled each round, so the machine's "
                 "drift falls on every side; sequential: one mode after another (docs/schedule.md).")


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
    prefill_routing: Annotated[str | None, typer.Option(help=ROUTING_HELP.format(role=Role.PREFILL) + " Several, "
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
    p_routings = split_csv(prefill_routing) if prefill_routing else []
    bad = [p for p in p_routings if p not in ROUTING_POLICIES]
    if bad or (prefill_routing is not None and not p_routings):
        raise fail(f"--prefill-routing takes policies of {', '.join(ROUTING_POLICIES)}, comma-separated; "
                   f"got {prefill_routing!r}")
    first = p_routings[0] if p_routings else None
    s = settings(prefill_routing=first, decode_routing=decode_routing)
    topo = resolve_topology(topology, first, decode_routing)
    if not topo.launch and modes == ALL_MODES:
        modes = topo.attached_mode  # attached workers run one mode: the one they were started in
    store = store or s.store
    workload = shipped(workload, "workloads")
    if workload is not None and not workload.exists():
        raise fail(f"workload file {workload} does not exist (shipped: {', '.join(resources.names('workloads'))})")
    ev = default_settings(Path(topo.model), topology=topo, modes=split_csv(modes), histories=split_csv(histories),
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


@app.command()
def rollup(store: StoreOpt = None) -> None:
    """Compact and roll up every finished run: its shards merged into one file per table
    (store/compact.py: the same rows, far fewer files to open), then, where it has no fresh rollup,
    its run_summary, run_kv_transfer and run_handle_memory rows stored beside the shards so the
    dashboard need not recompute them (store/rollup.py; docs/schema/overview.md). A finished eval
    does this itself. It first recreates the store's views if they are of another schema version
    (a store written by an older turnscope); no row is changed, a run still recording is not
    touched."""
    from planner.recorded_whatif import whatif_ttl_d_limit
    from store.compact import compact_finished
    from store.rollup import Rollups
    from store.writer import Store

    root = store or settings().store
    if not (root / "turnscope.duckdb").exists():
        raise fail(f"no store at {root} (expected {root / 'turnscope.duckdb'}): run `turnscope demo` to make one")
    t0 = time.monotonic()
    try:
        Store(root).init()  # views of this schema version first (a store written by an older turnscope)
        compacted = compact_finished(Store(root))
        written = Rollups(Store(root), whatif=whatif_ttl_d_limit).write_finished()
    except (OSError, RuntimeError, ValueError, duckdb.Error) as exc:
        raise fail(f"rollup of {root}: {exc}") from exc
    if compacted:
        typer.echo(f"compacted {sum(c.files for c in compacted)} shard(s) of {len({c.run_id for c in compacted})} "
                   f"finished run(s) into {len(compacted)} file(s) ({sum(c.rows for c in compacted)} rows)")
    typer.echo(f"rolled up {len(written)} run(s) in {time.monotonic() - t0:.1f} s"
               + (f": {', '.join(written)}" if written else " (every finished run was fresh)"))


@app.command()
def serve(
    mode: Annotated[str, typer.Option(help=f"Serving mode, one of: {', '.join(MODES)}.")] = PD_BIDIR,
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
    inference_pool: Annotated[str | None, typer.Option(
        help="With --kubernetes: also an InferencePool (inference.networking.k8s.io/v1) of the proxy's pods, "
             "whose endpoint picker is the Service NAME[:PORT] (port 9002 when not given).")] = None,
    store: StoreOpt = None,
    canary_every_s: Annotated[float, typer.Option(
        min=0, help="Run the known-answer canary (turnscope check) this often while serving, seconds; a "
                    "mismatch is printed and counted in turnscope_canary_mismatches_total (0: never).")] = 0.0,
) -> None:
    """Start (or attach to) the workers of one mode and the session-aware proxy; Ctrl-C stops them.

    Point Locust's web UI at the proxy: `locust -f loadgen/locustfile.py --host http://127.0.0.1:8200`.
    The prefill (or aggregated) worker is speed-probed once it is up and again at stop, into the
    store, so the runs recorded through the proxy can be checked on this machine's speed
    (docs/planner/calibration.md). While serving, the workers' and the proxy's metrics are scraped
    into the store every second: under each run Locust records through this proxy (same
    --turnscope-store), and between runs under the serve's own id (turnscope/conductor/serve_metrics.py).
    """
    topo = resolve_topology(topology, prefill_routing, decode_routing)
    try:
        specs = mode_workers(mode, topo)
    except ValueError as exc:
        raise fail(str(exc)) from exc
    if kubernetes:
        options = kube.KubeOptions(image=image, vllm_image=vllm_image, namespace=namespace, model_pvc=model_pvc,
                                   nodes_per_worker=nodes_per_worker, inference_pool_epp=inference_pool)
        try:
            print(kube.render(topo, mode, options), end="")
        except kube.KubernetesError as exc:
            raise fail(str(exc)) from exc
        return
    stack = ModeStack(mode, topo, log_dir)
    if prometheus_config:
        targets = [("turnscope-proxy", stack.proxy_url, Role.PROXY)] + [("vllm", s.url, s.role) for s in specs]
        print(render_prometheus_config(targets), end="")
        return
    if dry_run:
        _print_dry_run(specs, stack, topo, mode, log_dir)
        return
    if topo.platform == "gpu" and topo.launch and not _has_gpu():
        raise fail(f"topology {topo.name!r} is for GPUs but this machine has none (nvidia-smi found no device); "
                   "use --dry-run to print the commands for the GPU hosts")
    _serve_until_stopped(stack, topo, mode, store or settings().store, canary_every_s)


def _print_dry_run(specs, stack: ModeStack, topo, mode: str, log_dir: Path) -> None:
    """`serve --dry-run`: each worker's command and environment (keys read where the topology says,
    never printed), then the proxy's."""
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


def _serve_until_stopped(stack: ModeStack, topo, mode: str, root: Path, canary_every_s: float) -> None:
    """Start the mode's workers and the proxy, probe and scrape into the store at `root`, run the
    canary every `canary_every_s` (0: never) until Ctrl-C or a worker exits. Raises typer.Exit (via
    `fail`) naming the store or the worker that exited."""
    from store.writer import Store
    from turnscope.conductor.speed_probe import ServeProbes

    stack.progress = console.print
    try:
        Store(root).init()   # the store Locust records into by default; the probes' rows and the scrapes land there
    except (OSError, RuntimeError, ValueError) as exc:
        raise fail(f"store {root}: {exc}") from exc
    try:
        # the probes first and last, the scrapes between: a probe's requests are in no run's counters
        with stack, ServeProbes(Store(root), stack.endpoints(), topo.served_model_name or topo.model,
                                headers=stack.endpoint_headers(), verify=stack.tls_verify()) as probes, \
                ServeMetrics(Store(root), stack.endpoints(), stack.proxy_url, headers=stack.endpoint_headers(),
                             verify=stack.tls_verify()) as scrapes:
            console.print(f"mode {mode} serving through the proxy at {stack.proxy_url} (Ctrl-C to stop); "
                          f"speed probes into {root} as {probes.run_id} (again at stop); metrics into {root} "
                          f"(runs recorded through this proxy, else {scrapes.own_id})")
            next_canary = time.monotonic() + canary_every_s
            while all(w.proc is None or w.proc.poll() is None for w in stack.workers):
                time.sleep(1)
                if canary_every_s and time.monotonic() >= next_canary:
                    _serve_canary(stack)
                    next_canary = time.monotonic() + canary_every_s
            gone = next(w for w in stack.workers if w.proc is not None and w.proc.poll() is not None)
            raise RuntimeError(f"worker {gone.spec.name} exited with {gone.proc.returncode}; stopped the others "
                               f"(its log: {gone.log_path})")
    except KeyboardInterrupt:
        console.print("stopping")
    except RuntimeError as exc:
        raise fail(str(exc)) from exc


@app.command()
def check(
    proxy: Annotated[str, typer.Option(help="The proxy's base URL (`turnscope serve` prints it).")
                     ] = "http://127.0.0.1:8200",
    model: Annotated[str | None, typer.Option(help="The served model's name (default: the reference worker's "
                                                   "first model).")] = None,
    count: Annotated[int, typer.Option(min=1, help="Canaries to run, one after another.")] = 1,
) -> None:
    """Run the known-answer canary on a serving proxy: a fixed two-turn prompt answered greedily
    through the proxy (P and D, the second turn pulling D's blocks in pd-bidir) and by P alone,
    compared token by token. Exits 1 when the tokens differ (HTTP 200 with wrong tokens) or a
    request failed. The proxy counts it in turnscope_canaries_total and
    turnscope_canary_mismatches_total (docs/reliability.md). The proxy's key: TURNSCOPE_API_KEY.
    """
    from core.contract import client_auth_headers
    from turnscope.conductor.canary import describe, request_canary

    results = []
    for i in range(count):
        report = request_canary(proxy, model, client_auth_headers())
        results.append(report.result)
        console.print(f"canary {i + 1}/{count}: {describe(report)}", highlight=False, soft_wrap=True)
    if any(r != "match" for r in results):
        raise fail(f"{results.count('mismatch')} of {count} canaries answered wrong tokens, "
                   f"{results.count('error')} failed", code=1)


def _serve_canary(stack: ModeStack) -> None:
    """One known-answer canary through ``stack``'s proxy, said on the console."""
    from turnscope.conductor.canary import describe, request_canary

    report = request_canary(stack.proxy_url, headers=stack.client_headers())
    style = "" if report.result == "match" else "[red]"
    console.print(f"{style}canary: {describe(report)}", highlight=False, soft_wrap=True)


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
    elif os.access(store, os.W_OK):
        compact_quietly(store)  # an older store's finished runs: far fewer files for every query to open
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
    print_regimes()
    console.print(f"query it: {DUCKDB} {store / 'turnscope.duckdb'} -c \"{SHELL_EXAMPLE}\"", highlight=False)
    if not no_dashboard:
        dashboard(store=store, port=8501)
