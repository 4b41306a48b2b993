"""The ``turnscope`` command: build the embedded model, run the evaluation matrix, show results.

Examples::

    turnscope demo                      # model if missing + short eval of all modes + dashboard
    turnscope eval --modes pd-nocache,pd-bidir-nocache --sessions 8
    turnscope model                     # (re)build the embedded tiny model
    turnscope dashboard                 # Streamlit over data/turnscope.duckdb
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from loadgen import report
from serving.embedded_model import DEFAULT_MODEL_DIR, ensure_model
from serving.stack import ModeStack
from serving.topology import MODES, Topology, TopologyError, load_topology
from serving.workers import mode_workers, worker_command
from turnscope.evaluation import REPO_ROOT, default_settings, run_eval

app = typer.Typer(help="Does reusing KV cache across the turns of agent sessions pay off on your traffic?",
                  no_args_is_help=True, pretty_exceptions_enable=False)
console = Console()
EMBEDDED_TOPOLOGY = REPO_ROOT / "data" / "topologies" / "embedded-cpu.yaml"

ALL_MODES = ",".join(MODES)
ModesOpt = Annotated[str, typer.Option(help=f"comma-separated serving modes, of: {', '.join(MODES)}")]
StoreOpt = Annotated[Path, typer.Option(help="store directory (Parquet shards + turnscope.duckdb views)")]
TopologyOpt = Annotated[Path | None, typer.Option(
    help="topology YAML (workers, model, connector settings); default: the embedded CPU default")]


def _topology(path: Path | None) -> Topology:
    """The topology at ``path``, or the embedded default (building its model if missing)."""
    if path is None:
        ensure_model()
        path = EMBEDDED_TOPOLOGY
    try:
        return load_topology(path)
    except TopologyError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc


def _split(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


@app.command()
def model(out: Annotated[Path, typer.Option(help="where to write the model")] = DEFAULT_MODEL_DIR) -> None:
    """Build the embedded tiny model (tokenizer + random-weight Llama, float32) if missing."""
    t0 = time.monotonic()
    with console.status("building the embedded model"):
        path = ensure_model(out)
    console.print(f"model ready at {path} ({time.monotonic() - t0:.1f} s)")


@app.command("eval")
def evaluate(
    modes: ModesOpt = ALL_MODES,
    histories: Annotated[str, typer.Option(help="history modes: text, token_ids")] = "text,token_ids",
    sessions: Annotated[int, typer.Option(help="sessions per run (tau-bench conversations)")] = 4,
    users: Annotated[int, typer.Option(help="concurrent sessions (Locust users)")] = 2,
    max_turns: Annotated[int, typer.Option(help="turns per session at most")] = 6,
    max_tokens: Annotated[int, typer.Option(help="output tokens per turn")] = 32,
    gap_s: Annotated[float, typer.Option(help="seconds between turns (tool/think gap)")] = 1.0,
    topology: TopologyOpt = None,
    store: StoreOpt = REPO_ROOT / "data",
    label: Annotated[str, typer.Option(help="label of these runs")] = "eval",
) -> None:
    """Run the same agent sessions against each serving mode and print TTFT and reuse per mode.

    Example: turnscope eval --modes pd-nocache,pd-bidir-nocache --sessions 8 --label nightly
    """
    topo = _topology(topology)
    settings = default_settings(Path(topo.model), topology=topo, modes=_split(modes), histories=_split(histories),
                                sessions=sessions,
                                users=users, max_turns=max_turns, max_tokens=max_tokens, gap_s=gap_s,
                                store=store, label=label)
    t0 = time.monotonic()
    try:
        run_ids = run_eval(settings, console)
    except ValueError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc
    console.print(f"evaluation finished in {time.monotonic() - t0:.0f} s")
    print_summary(store, run_ids)


def print_summary(store: Path, run_ids: list[str]) -> None:
    """Print TTFT p50/p90 by turn index, reuse outcomes and P's external KV tokens per run."""
    ttft = report.ttft_by_turn(store, run_ids)
    outs = report.outcomes(store, run_ids)
    ext = report.external_kv_tokens(store, run_ids).set_index("run_id")["external_kv_tokens"].to_dict()
    for run_id in run_ids:
        rows = ttft[ttft.run_id == run_id]
        table = Table(title=run_id, show_lines=False)
        for col in ("turn", "turns", "TTFT p50 (ms)", "TTFT p90 (ms)"):
            table.add_column(col, justify="right")
        for r in rows.itertuples():
            table.add_row(str(r.turn_index), str(r.turns), f"{r.ttft_p50_s * 1000:.0f}", f"{r.ttft_p90_s * 1000:.0f}")
        console.print(table)
        o = outs[outs.run_id == run_id]
        console.print("  reuse: " + ", ".join(f"{r.reuse}={r.turns}" for r in o.itertuples())
                      + f"; prefill external_kv_transfer tokens: {int(ext.get(run_id) or 0)}")


@app.command()
def serve(
    mode: Annotated[str, typer.Option(help=f"serving mode, one of: {', '.join(MODES)}")] = "pd-bidir",
    topology: TopologyOpt = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="print each worker's command and environment")] = False,
    log_dir: Annotated[Path, typer.Option(help="worker and proxy logs")] = REPO_ROOT / "data" / "runs" / "_logs",
) -> None:
    """Start (or attach to) the workers of one mode and the session-aware proxy; Ctrl-C stops them.

    Example: turnscope serve --topology data/topologies/vendor-h200-1p1d.yaml --mode pd-bidir --dry-run
    """
    topo = _topology(topology)
    try:
        specs = mode_workers(mode, topo)
    except ValueError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc
    if dry_run:
        for spec in specs:
            argv, env = worker_command(spec)
            where = "already running (attach)" if not spec.launch else f"on {spec.host}"
            console.print(f"# {spec.name} ({spec.role}) {where}, {spec.url}", highlight=False)
            console.print(" ".join([f"{k}={shlex.quote(v)}" for k, v in env.items()] + [shlex.quote(a) for a in argv]),
                          highlight=False, soft_wrap=True)
        stack = ModeStack(mode, topo, log_dir)
        console.print(f"# proxy on {stack.proxy_url}", highlight=False)
        console.print(" ".join(map(shlex.quote, stack.proxy_command(log_dir / f"{mode}-proxy.json"))),
                      highlight=False, soft_wrap=True)
        return
    with ModeStack(mode, topo, log_dir, progress=console.print) as stack:
        console.print(f"mode {mode} serving through the proxy at {stack.proxy_url} (Ctrl-C to stop)")
        try:
            while all(w.proc is None or w.proc.poll() is None for w in stack.workers):
                time.sleep(1)
            console.print("[red]a worker exited[/red]; stopping")
        except KeyboardInterrupt:
            console.print("stopping")


@app.command()
def dashboard(store: StoreOpt = REPO_ROOT / "data",
              port: Annotated[int, typer.Option(help="port (binds 127.0.0.1)")] = 8501) -> None:
    """Start the Streamlit dashboard over the store (Ctrl-C to stop)."""
    env = os.environ | {"TURNSCOPE_STORE": str(store)}
    console.print(f"dashboard: http://127.0.0.1:{port}  (duckdb {store / 'turnscope.duckdb'} for SQL)")
    subprocess.run([sys.executable, "-m", "streamlit", "run", str(REPO_ROOT / "dashboard" / "app.py"),
                    "--server.headless", "true", "--server.address", "127.0.0.1", "--server.port", str(port),
                    "--browser.gatherUsageStats", "false"], env=env, check=False)


@app.command()
def demo(
    store: StoreOpt = REPO_ROOT / "data",
    sessions: Annotated[int, typer.Option(help="sessions per run")] = 3,
    max_turns: Annotated[int, typer.Option(help="turns per session at most")] = 4,
    no_dashboard: Annotated[bool, typer.Option("--no-dashboard", help="do not start the dashboard")] = False,
) -> None:
    """The main job on the embedded default: build the model if missing, run a short evaluation of
    every mode with both history modes, print the results, then serve the dashboard."""
    evaluate(modes=",".join(MODES), histories="text,token_ids", sessions=sessions, users=1, max_turns=max_turns,
             max_tokens=32, gap_s=0.5, topology=None, store=store, label="demo")
    console.print(f"query it: duckdb {store / 'turnscope.duckdb'} -c \"select mode, count(*) from turn_breakdown "
                  "group by mode\"")
    if not no_dashboard:
        dashboard(store=store)


if __name__ == "__main__":
    app()
