"""``turnscope calibrate``: measure every cost the planner uses over a wide prompt range, the modes
interleaved, and fit a profile from it (docs/planner/calibration.md).

Only wiring: the schedule is :mod:`turnscope.conductor.calibration_schedule`, the sessions are played by
:func:`loadgen.session_player.run_session` (the recorder of every run's ``turns`` rows), the stacks
are :class:`serving.stack.ModeStack`, the speed probe :mod:`turnscope.conductor.speed_probe`, the fit
:func:`planner.fit.fit_profile` (each fitted figure's residuals and range in its source).

1. Every mode's stack is started once and kept up for the whole calibration (each on its own ports:
   the topology's worker, side-channel and proxy ports plus 10 x the mode's index), warmed up
   (:func:`turnscope.conductor.evaluation.warm_up`).
2. One run per (mode, history): its ``runs`` row (``workload`` ``calibration``, the schedule in
   ``workload_spec.calibration``), one metrics scraper per stack (its rows under the mode's first
   run: the stack's counters cover all of that mode's runs, which take turns on the same workers).
3. Block by block: a speed probe of each run (``run_probes``, phase ``block<b>-start``), the
   block's sends in the schedule's order (each point a two-turn session through the mode's proxy,
   ``cache_salt`` = run id + session id), a probe of each run (``block<b>-end``).
4. The runs' rows closed (``complete``; a P/D mode's runs ``failed`` when its D computed its prompts
   itself, :func:`pd_failures`), the stacks stopped.

The store then holds ordinary runs: ``turnscope plan-check --fit-store CAL`` fits on it as on any
store; :func:`calibrated_profile` fits it and writes the profile with its provenance.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import subprocess
import time
from pathlib import Path

import httpx
from pydantic import BaseModel, Field
from rich.console import Console

from analysis.pd_check import decode_computed_prompts
from core import resources
from core.contract import WORKER_ROLES
from core.modes import AGGREGATED, PD_BIDIR_NOCACHE, PD_NOCACHE, serving_mode
from loadgen.scraper import MetricsScraper
from loadgen.session import SessionPlan, TurnPlan
from loadgen.session_player import run_session
from loadgen.synth_text import TextSynth, counter_from
from planner.fit import fit_profile
from planner.profile import CostProfile
from serving.stack import ModeStack
from serving.topology import Topology
from store.queries import planner_runs
from store.queries.overview import decode_prompt_sources
from store.writer import Store, connect_read_only
from turnscope.conductor import console_text, speed_probe
from turnscope.conductor.calibration_schedule import CalPoint, Send, default_lengths, points, schedule
from turnscope.conductor.evaluation import HEARTBEAT_S, default_log_dir, versions, warm_up

#: Port offset between the stacks of two modes kept up together.
PORT_STRIDE = 10
#: The modes calibrated by default: the aggregated worker's c(x), P's c(x) (full prefills and
#: computed-after-cached), pulls of several sizes, and the default b0 (``pd-nocache``'s).
DEFAULT_MODES = (AGGREGATED, PD_NOCACHE, PD_BIDIR_NOCACHE)


class CalibrationSettings(BaseModel):
    """What ``turnscope calibrate`` measures (tokens, seconds): modes, turn-0 lengths (None: 128
    doubling up to the model's limit, :func:`turnscope.conductor.calibration_schedule.default_lengths`), turn-1
    extra tokens, lengths also sent as ``text`` history, repeats (blocks), the shuffle's seed."""

    topology: Topology
    modes: list[str] = Field(default_factory=lambda: list(DEFAULT_MODES))
    lengths: list[int] | None = None
    extras: list[int] = Field(default_factory=lambda: [128, 1024])
    text_lengths: list[int] = Field(default_factory=lambda: [512, 2048])
    repeats: int = Field(default=3, ge=1)
    seed: int = 0
    max_tokens: int = Field(default=16, ge=2)
    store: Path = Field(default_factory=lambda: resources.home() / "calibration")
    label: str = "calibrate"
    log_dir: Path = Field(default_factory=lambda: default_log_dir())
    kv_bytes_per_token: int | None = None
    turn_timeout_s: float = 180.0
    operator_config: dict = Field(default_factory=dict)

    def block_points(self) -> list[list[CalPoint]]:
        """Every block's points (:func:`turnscope.conductor.calibration_schedule.points`)."""
        lengths = self.lengths or default_lengths(self.topology.max_model_len, self.max_tokens)
        return [points(lengths, self.extras, self.text_lengths, r, self.topology.max_model_len, self.max_tokens)
                for r in range(self.repeats)]

    def sends(self) -> list[list[Send]]:
        """The schedule (:func:`turnscope.conductor.calibration_schedule.schedule`)."""
        return schedule(self.modes, self.block_points(), self.seed)


#: ``--quick``: two lengths, one extra, one text length, two repeats (for tests and a first look).
QUICK = {"lengths": [128, 1024], "extras": [128], "text_lengths": [512], "repeats": 2}


def mode_topology(topology: Topology, index: int) -> Topology:
    """``topology`` with every port moved up by :data:`PORT_STRIDE` x ``index`` (the stacks of
    several modes up together)."""
    if index == 0:
        return topology
    shift = PORT_STRIDE * index

    def moved(entries):
        return [e.model_copy(update={"port": e.port + shift,
                                     "side_channel_port": e.side_channel_port + shift if e.side_channel_port else None})
                for e in entries]

    return topology.model_copy(update={  # its fields: a list of workers per role, and the proxy
        **{role: moved(getattr(topology, role)) for role in WORKER_ROLES},
        "proxy": topology.proxy.model_copy(update={"port": topology.proxy.port + shift})})


def session_plan(point: CalPoint, synth: TextSynth, seed: int) -> SessionPlan:
    """The point's two-turn session: user messages of exactly ``prefix_tokens`` and
    ``extra_tokens`` tokens of text (:class:`loadgen.synth_text.TextSynth`, keyed by seed and
    session id: every point and repeat its own text), no gap."""
    sid = point.session_id
    reply = {"role": "assistant", "content": "ok"}
    return SessionPlan(session_id=sid, source="calibration", turns=[
        TurnPlan(new_messages=[{"role": "user", "content": synth.text(point.prefix_tokens, f"{seed}:{sid}:0")}],
                 reference_reply=reply),
        TurnPlan(new_messages=[{"role": "user", "content": synth.text(point.extra_tokens, f"{seed}:{sid}:1")}],
                 reference_reply=reply, gap_kind="tool")])


def git_commit() -> str | None:
    """The checkout's short commit (None outside a git checkout)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=resources.CODE_ROOT, capture_output=True, text=True,
                             check=False, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


class _Run:
    """One (mode, history) run of the calibration: its id, row and writer."""

    def __init__(self, store: Store, run_id: str, row: dict):
        self.run_id, self.row = run_id, row
        self.writer = store.writer(run_id, f"calibrate-{os.getpid()}")
        self.writer.append("runs_log", row)
        self.writer.flush()
        self.writer.keep_alive("runs_log", row, HEARTBEAT_S)

    def close(self, status: str) -> None:
        self.writer.stop_keep_alive()
        now = dt.datetime.now(dt.UTC)
        self.writer.append("runs_log", self.row | {"finished_at": now, "status": status, "updated_at": now,
                                                   "heartbeat_s": None})
        self.writer.close()


def run_calibration(s: CalibrationSettings, console: Console | None = None) -> list[str]:
    """Run the calibration (module doc); return its run ids. Raises ValueError for an unknown mode,
    one the topology cannot run or a missing model, before anything starts."""
    console = console or Console()
    for mode in s.modes:
        serving_mode(mode)
        if mode not in s.topology.modes():
            raise ValueError(f"topology {s.topology.name!r} cannot run mode {mode!r} "
                             f"(it runs: {', '.join(s.topology.modes())})")
    if s.topology.launch and not Path(s.topology.model).is_dir():
        raise ValueError(f"model path {s.topology.model} does not exist (build it with `turnscope model`)")
    blocks = s.sends()
    histories = sorted({x.point.history for b in blocks for x in b}, key=("token_ids", "text").index)
    model = s.topology.served_model_name or s.topology.model
    synth = TextSynth(counter_from(s.topology.model), seed=s.seed)
    s.log_dir.mkdir(parents=True, exist_ok=True)
    store = Store(s.store)
    store.init()
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S")
    lengths = sorted({x.point.prefix_tokens for b in blocks for x in b if x.point.history == "token_ids"})
    spec = {"calibration": s.model_dump(mode="json", include={"modes", "extras", "text_lengths", "repeats",
                                                              "seed", "max_tokens"}) | {"lengths": lengths}
            | {"sends": sum(len(b) for b in blocks)}, "loadavg_start": list(os.getloadavg()), "commit": git_commit()}
    runs: dict[tuple[str, str], _Run] = {}
    scrapers: list[tuple[MetricsScraper, object]] = []
    with contextlib.ExitStack() as stack_of:
        stacks: dict[str, ModeStack] = {}
        for i, mode in enumerate(s.modes):
            console.print(f"[bold]mode {mode}[/bold]: starting workers")
            stacks[mode] = stack_of.enter_context(
                ModeStack(mode, mode_topology(s.topology, i), s.log_dir, s.kv_bytes_per_token, console.print))
        longest = max((x.point.prefix_tokens for b in blocks for x in b), default=600)  # first of its size: slower
        for mode, st in stacks.items():
            console_text.print_list(console, f"  [{mode}] warm-up outcomes: ",
                                    warm_up(st.proxy_url, model, longest, headers=st.client_headers()))
        status = "aborted"
        try:
            for mode, st in stacks.items():
                config = {"topology": st.topology.model_dump(mode="json"), "kv_bytes_per_token": s.kv_bytes_per_token,
                          "calibration": spec["calibration"], "operator_config": s.operator_config}
                for history in histories:
                    run_id = f"{s.label}-{stamp}-{mode}-{history}"
                    now = dt.datetime.now(dt.UTC)
                    runs[(mode, history)] = _Run(store, run_id, {
                        "run_id": run_id, "label": s.label, "mode": mode, "workload": "calibration",
                        "workload_spec": spec, "history_mode": history, "topology": st.topology_row(),
                        "versions": versions(), "model": s.topology.model, "config": config, "started_at": now,
                        "status": "running", "updated_at": now, "heartbeat_s": HEARTBEAT_S})
                first = runs[(mode, histories[0])].run_id
                writer = store.writer(first, f"scraper-{mode}-{os.getpid()}")
                scraper = MetricsScraper(st.endpoints(), writer, first, interval_s=2.0,
                                         headers=st.endpoint_headers(), verify=st.tls_verify())
                scraper.start()
                scrapers.append((scraper, writer))
            _play(s, blocks, stacks, runs, synth, model, console)
            status = "complete"
        finally:
            for scraper, writer in scrapers:
                scraper.stop(final_settle_s=2.0)
                writer.close()
            failed = pd_failures(s.store, [[r.run_id for (m, _), r in runs.items() if m == mode] for mode in stacks])
            for run in runs.values():
                if status == "complete" and run.run_id in failed:
                    console_text.print_text(console, f"[{run.run_id}] failed: {failed[run.run_id]}")
                run.close("failed" if status == "complete" and run.run_id in failed else status)
    return [r.run_id for r in runs.values()]


def pd_failures(store: Path, mode_runs: list[list[str]]) -> dict[str, str]:
    """Run id -> why P/D did not happen (:mod:`analysis.pd_check`), each mode's runs checked
    together: its scraped run's decode counters cover the turns of all of them (one scraper per
    stack), so the turns the proxy sent through P are counted over all of them."""
    out = {}
    with connect_read_only(store) as con:
        for ids in mode_runs:
            src = decode_prompt_sources(con, ids)
            pd_turns = int(src["pd_turns"].sum())
            for r in src.dropna(subset=["local_compute"]).itertuples():
                problem = decode_computed_prompts(str(r.mode), pd_turns, r.local_compute, r.external_kv)
                if problem is not None:
                    out |= {run_id: problem for run_id in ids}
    return out


def _probe(st: ModeStack, model: str, salt: str) -> dict:
    """A speed probe of the stack's prefill (or aggregated) worker: a ``run_probes`` row, ``target`` set."""
    url, role = speed_probe.probe_target(st.endpoints())
    return {"target": role} | speed_probe.probe(url, model, salt=salt, headers=st.endpoint_headers().get(url),
                                                verify=st.tls_verify())


def _play(s: CalibrationSettings, blocks: list[list[Send]], stacks: dict[str, ModeStack],
          runs: dict[tuple[str, str], _Run], synth: TextSynth, model: str, console: Console) -> None:
    """Send every block (module doc, step 3); a probe of every run before and after each block."""
    t0 = time.monotonic()
    clients = {m: httpx.Client(timeout=s.turn_timeout_s, headers=st.client_headers()) for m, st in stacks.items()}
    try:
        for b, block in enumerate(blocks):
            for (mode, _), run in runs.items():
                run.writer.append("run_probes", {"run_id": run.run_id, "phase": f"block{b}-start"}
                                  | _probe(stacks[mode], model, f"{run.run_id}-b{b}-start"))
            for x in block:
                run = runs[(x.mode, x.point.history)]
                res = run_session(session_plan(x.point, synth, s.seed), clients[x.mode], stacks[x.mode].proxy_url,
                                  model, run.writer, run.run_id, x.point.history, max_tokens=s.max_tokens,
                                  timeout_s=s.turn_timeout_s,
                                  extra_body={"cache_salt": f"{run.run_id}-{x.point.session_id}"})
                if res.stopped != "complete":
                    console.print(f"  \\[{x.mode}] {x.point.session_id} ({x.point.history}) stopped: {res.stopped}",
                                  highlight=False)
            for (mode, _), run in runs.items():
                run.writer.append("run_probes", {"run_id": run.run_id, "phase": f"block{b}-end"}
                                  | _probe(stacks[mode], model, f"{run.run_id}-b{b}-end"))
            console.print(f"  block {b + 1}/{len(blocks)}: {len(block)} sessions sent "
                          f"({time.monotonic() - t0:.0f} s, load average {os.getloadavg()[0]:.2f})", highlight=False)
    finally:
        for c in clients.values():
            c.close()


def calibrated_profile(store: Path, run_ids: list[str], name: str) -> CostProfile:
    """The profile fitted on the calibration's runs (:func:`planner.fit.fit_profile`:
    each fitted figure's residuals and range in its source), named ``name``, its description the
    provenance (date, commit, load average, the runs). Raises FitError."""
    prof = fit_profile(Store(store), run_ids, name=name)
    (spec, started, finished), spread = planner_runs.provenance(Store(store), run_ids)
    spec_d = json.loads(spec) if isinstance(spec, str) else (spec or {})
    cal = spec_d.get("calibration", {})
    load = spec_d.get("loadavg_start")
    probes = (f"; speed probes {spread[3]}: {spread[0] * 1e3:.1f} / {spread[1] * 1e3:.1f} / {spread[2] * 1e3:.1f} ms "
              "(min / median / max)" if spread and spread[3] else "")
    prof.description = (
        f"Calibrated by `turnscope calibrate` ({started:%Y-%m-%d %H:%M}-{finished:%H:%M} UTC, commit "
        f"{spec_d.get('commit') or 'unknown'}, load average at start {', '.join(f'{x:.2f}' for x in load or [])}): "
        f"modes {', '.join(cal.get('modes', []))} interleaved, {cal.get('repeats')} shuffled blocks (seed "
        f"{cal.get('seed')}), two-turn sessions of {cal.get('lengths') or 'default'} turn-0 tokens and "
        f"{cal.get('extras')} turn-1 tokens (text history also at {cal.get('text_lengths')}), "
        f"{cal.get('max_tokens')}-token replies{probes}; runs {', '.join(run_ids)}.")
    return prof
