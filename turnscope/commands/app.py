"""The ``turnscope`` command's application: its options shared by every command, the settings of an
invocation (``turnscope.conductor.settings``) and how a command fails (an actionable message, exit 2)."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from core import resources
from core.contract import (
    ROUTING_POLICIES,
    Role,
    RoutingPolicy,
)
from core.modes import MODES
from serving.embedded_model import DEFAULT_MODEL_DIR, ensure_model
from serving.topology import ProxySettings, Topology, TopologyError, embedded_topology, load_topology
from turnscope.conductor.evaluation import default_log_dir
from turnscope.conductor.settings import SettingsError, TurnscopeSettings

EPILOG = """Examples:

  turnscope demo                                        # the main job on the embedded default

  turnscope eval --modes pd-nocache,pd-bidir-nocache --sessions 8

  turnscope eval --workload data/workloads/mixed.yaml --time-scale 0.05

  turnscope sweep                                       # the vendor's prefix sweep, 5 modes x 4 points (~13 min)

  turnscope traffic data/traces/kv-cache-tester          # what the shipped Claude Code traces say about reuse

  turnscope plan data/traces/kv-cache-tester --profile vendor-h200 --sessions-per-hour 100   # a FORECAST at a load

  turnscope plan-check --fit-store OLD --check-store NEW --write-profile p.yaml   # forecast runs not fitted on

  turnscope calibrate --out cal.yaml                    # measure every planner cost, 128 tokens to the model's limit

  turnscope serve --mode pd-bidir                       # then: locust -f loadgen/locustfile.py --host http://127.0.0.1:8200

  turnscope serve --topology data/topologies/vendor-h200-1p1d.yaml --mode pd-bidir --dry-run
"""


app = typer.Typer(help="Does reusing KV cache across the turns of agent sessions pay off on your traffic?",
                  epilog=EPILOG, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode="markdown")


console = Console()


invocation: dict = {}


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


#: The help of the routing options (`--prefill-routing`, `--decode-routing`), `{role}` filled in.
ROUTING_HELP = (f"How the proxy picks the {{role}} worker of a request: {', '.join(ROUTING_POLICIES)} "
                "(docs/configuration.md). Default: settings `{role}_routing` (session); "
                "wins over a topology file's `proxy.{role}_routing`. Recorded with each run.")


PrefillRoutingOpt = Annotated[RoutingPolicy | None, typer.Option(help=ROUTING_HELP.format(role=Role.PREFILL))]


DecodeRoutingOpt = Annotated[RoutingPolicy | None, typer.Option(help=ROUTING_HELP.format(role=Role.DECODE))]


def shipped(path: Path | None, kind: str) -> Path | None:
    """``path`` as given, or the shipped file of that name when it does not exist (``--profile
    embedded-cpu``, ``data/workloads/mixed.yaml`` from any directory; core.resources.find)."""
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
    invocation["config"] = config
    try:
        invocation["settings"] = TurnscopeSettings.load(config)
    except SettingsError as exc:
        raise fail(str(exc)) from exc


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def settings(**options: object) -> TurnscopeSettings:
    """The settings of this invocation; ``options`` are command-line options that override them
    (None: not given), so ``effective()`` records what the run used."""
    given = {k: v for k, v in options.items() if v is not None}
    if not given:
        return invocation.get("settings") or TurnscopeSettings.load()
    try:
        return TurnscopeSettings.load(invocation.get("config"), **given)
    except SettingsError as exc:
        raise fail(str(exc)) from exc


def resolve_topology(path: Path | None, prefill_routing: str | None = None, decode_routing: str | None = None) -> Topology:
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


def split_csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]
