"""Locust entry point: each Locust user is one agent session at a time (DESIGN §4).

Run it headless, with the web UI, or distributed::

    locust -f loadgen/locustfile.py --headless -u 4 -r 4 --host http://127.0.0.1:8000 \\
        --turnscope-store data --turnscope-run-id demo1 --turnscope-sessions 20 --turnscope-history text
    locust -f loadgen/locustfile.py --master --master-bind-host 0.0.0.0 --headless -u 8 -r 8 --expect-workers 2 --host ...
    locust -f loadgen/locustfile.py --worker --master-host 10.0.0.5      # on each load machine
    locust -f loadgen/locustfile.py --headless -u 16 -r 16 --host ... \
        --turnscope-workload data/workloads/mixed.yaml --turnscope-time-scale 0.05 \
        --turnscope-tokenizer data/models/turnscope-tiny

What is played: with ``--turnscope-workload`` a workload file (``loadgen.workload``: archetypes and
trace replays, planned from the workload's seed, gaps and arrival offsets multiplied by
``--turnscope-time-scale``, text synthesized for the tokenizer given by ``--turnscope-tokenizer``
or, without it, the server's ``/tokenize``); without it the shipped tau-bench airline trace is
replayed (the default), with ``--turnscope-gap-s`` (times the time scale) between turns.

How sessions are handed out: the plan (which sessions, their turns and gaps) is built once, on the
master (or the single local process), at test start. Users ask the master for their next session
over Locust's custom messages (``turnscope_want`` -> ``turnscope_session``) and report it played
(``turnscope_done``). So every session is played exactly once however Locust spreads users over
workers (a worker may get no user at all: ``-u 2`` with 3 workers), and long and short sessions
balance across users. A user that is told the plan is exhausted stops; when every session has been
reported played, a headless run quits by itself (with the web UI, the test stops). A trace session
with an arrival offset is started no earlier than that offset after the master's test start (wall
clock, shared with the workers); the user holding it waits, like the agent would.

Each Locust process opens its own store writer (``writer_id`` = ``locust-<host>-<pid>``) when its
first session arrives and closes it on test stop and on quit. The master (or local process) also
initialises the store's views and writes the ``runs_log`` rows (status ``running``, rewritten every
``--turnscope-heartbeat-s`` seconds, then ``complete``, or ``stopped`` when the test is stopped
(web UI's STOP, Ctrl-C, SIGTERM) before every planned session was played) unless
``--turnscope-no-run-row`` is given (e.g. when the turnscope CLI writes them itself). A process
killed outright (SIGKILL) writes no final row: its run reads ``aborted`` once three heartbeats
are missed, and the rows it flushed (at most about a second old) stay readable.

Listeners: the web UI (``--web-host``) and the master (``--master-bind-host``) bind 127.0.0.1
unless given another address, which is logged as a warning (Locust has no authentication); a
distributed run across machines passes ``--master-bind-host 0.0.0.0`` (or the machine's address).

Locust statistics: one ``POST <kind>`` request event per turn (``turn``, ``retry``, ``edit``,
``fresh``, ``resume``), fired at stream end with response_time = E2E (ms), and one ``TTFT TTFT``
event with response_time = TTFT (ms); failed turns (errors, and timeouts, whose reason names the
timeout) fire both as failures with the reason. Locust's own percentiles are rounded: analyse the
store.

Timeouts: each turn may take up to ``--turnscope-timeout-s`` (default: the workload's
``timeout_s``, 300 s, or 120 s for the tau-bench replay) between bytes and in total; set it above
the longest turn you expect (long prompts on slow workers), since a timed-out turn is recorded as
failed (status ``timeout``).
"""

from __future__ import annotations

import datetime as dt
import gc
import logging
import os
import re
import socket
import ssl
import threading
import time
import uuid
from importlib import metadata
from pathlib import Path
from typing import Any

import gevent
import httpx
from gevent.event import AsyncResult
from locust import User, constant, events, task
from locust.exception import StopUser
from locust.runners import MasterRunner, WorkerRunner

from loadgen.session import SessionPlan, plan_from_conversation
from loadgen.session_history import joiner_for
from loadgen.session_player import run_session
from loadgen.session_recorder import TurnRecord
from loadgen.store import Store
from loadgen.stream_client import GeventClient
from loadgen.synth_text import SynthError, TextSynth, counter_from
from loadgen.token_prompt import TemplateJoinError
from loadgen.traces.taubench import DEFAULT_TRACE, TraceFormatError, load_taubench
from loadgen.workload import Workload, WorkloadError, describe, load_workload, plan_workload
from turnscope.tokenize_client import TokenizeClient, TokenizeError

log = logging.getLogger("turnscope.locust")
# httpx logs every request at INFO: at a thousand sessions that is measurable CPU on the event loop
# the turns are timed on. Its warnings and errors still show.
logging.getLogger("httpx").setLevel(logging.WARNING)

_MSG_WANT = "turnscope_want"
_MSG_SESSION = "turnscope_session"
_MSG_DONE = "turnscope_done"
_WANT_TIMEOUT_S = 120.0
# gen0 allocations, gen0 collections per gen1, gen1 per automatic full collection (CPython: 700,
# 10, 10); the last is out of reach, full collections run every _FULL_GC_S seconds instead.
_GC_THRESHOLDS = (5_000, 10, 1_000_000_000)
_FULL_GC_S = 120.0
_full_gc: Any = None


def _full_gc_loop() -> None:
    """Collect reference cycles that outlived the young generations, every ``_FULL_GC_S`` s."""
    while True:
        gevent.sleep(_FULL_GC_S)
        gc.collect()
# Idle connections are dropped by the client before servers close them: uvicorn (vLLM, the proxy)
# closes idle keep-alive connections after 5 s, and a request sent on one as it closes fails with
# "Server disconnected without sending a response" (an artefact of the client, not the server's).
_KEEPALIVE_S = 2.0


# ------------------------------------------------------------------------------------ options


@events.init_command_line_parser.add_listener
def _add_arguments(parser: Any) -> None:
    g = parser.add_argument_group("turnscope", "turnscope agent-session workload")
    g.add_argument("--turnscope-store", type=str, default="data",
                   help="store root: shards go to <store>/runs/<run_id>/ (default: data)")
    g.add_argument("--turnscope-run-id", type=str, default="",
                   help="run id (letters, digits, . _ -); default: locust-<UTC time>-<random>")
    g.add_argument("--turnscope-trace", type=str, default=str(DEFAULT_TRACE),
                   help="tau-bench trajectory file to replay (default: the shipped airline trace)")
    g.add_argument("--turnscope-sessions", type=int, default=0,
                   help="sessions to play; 0 = one per conversation in the trace (default); more than "
                        "the trace holds cycles through it again under new session ids. With a workload: "
                        "archetype sessions to draw (0 = the workload's)")
    g.add_argument("--turnscope-max-turns", type=int, default=0,
                   help="at most this many turns per session (0 = all)")
    g.add_argument("--turnscope-history", type=str, default="text", choices=["text", "token_ids"],
                   help="how a session carries its history (DESIGN §4)")
    g.add_argument("--turnscope-model", type=str, default="turnscope-tiny", help="model name for the requests")
    g.add_argument("--turnscope-max-tokens", type=int, default=64, help="output tokens per turn")
    g.add_argument("--turnscope-max-prompt-tokens", type=int, default=0,
                   help="stop a session before a prompt longer than this (tokens); 0 = the server's "
                        "max_model_len (GET /v1/models) - max tokens")
    g.add_argument("--turnscope-gap-s", type=float, default=1.0,
                   help="seconds before each turn after the first (tool and think gaps alike)")
    g.add_argument("--turnscope-timeout-s", type=float, default=0.0,
                   help="per-turn timeout, seconds; 0 = the workload's timeout_s (tau-bench replay: 120)")
    g.add_argument("--turnscope-workload", type=str, default="",
                   help="workload YAML (data/workloads/*.yaml, or a name there, e.g. mixed); default: replay "
                        "the tau-bench trace")
    g.add_argument("--turnscope-time-scale", type=float, default=1.0,
                   help="multiply every gap and trace arrival offset by this (e.g. 0.01 turns minutes into "
                        "seconds); recorded with the run")
    g.add_argument("--turnscope-token-scale", type=float, default=0.0,
                   help="multiply the workload archetypes' token counts (0 = the workload's token_scale)")
    g.add_argument("--turnscope-tokenizer", type=str, default="",
                   help="tokenizer.json (or model directory) the workload's text is synthesized for; default: "
                        "the server's /tokenize")
    g.add_argument("--turnscope-seed", type=int, default=-1, help="workload seed (default: the workload's)")
    g.add_argument("--turnscope-cache-salt", type=str, default="",
                   help="vLLM cache_salt sent with every request, so this run shares no prefix cache with "
                        "other runs on the same workers (default: none)")
    g.add_argument("--turnscope-label", type=str, default="", help="run label (runs_log.label)")
    g.add_argument("--turnscope-mode", type=str, default="attach",
                   help="serving mode recorded in runs_log.mode (aggregated, pd, pd-bidir, ...; default attach)")
    g.add_argument("--turnscope-no-run-row", action="store_true", default=False,
                   help="do not write runs_log rows (the caller records the run)")
    g.add_argument("--turnscope-heartbeat-s", type=float, default=5.0,
                   help="rewrite the running run's row this often (seconds); a run whose row is older than "
                        "three heartbeats reads 'aborted' (its Locust process died)")
    # Every listener binds the loopback interface unless told otherwise (Locust's own defaults are
    # all interfaces): the web UI and the master have no authentication.
    parser.set_defaults(web_host="127.0.0.1", master_bind_host="127.0.0.1")


_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _warn_public_listeners(options: Any) -> None:
    """Warn for a web UI or master bound beyond the loopback interface (an explicit choice)."""
    for flag, attr in (("--web-host", "web_host"), ("--master-bind-host", "master_bind_host")):
        value = getattr(options, attr, None)
        if attr == "web_host" and getattr(options, "headless", False):
            continue
        if attr == "master_bind_host" and not getattr(options, "master", False):
            continue
        if value is not None and value not in _LOOPBACK:
            log.warning("turnscope: %s %s binds beyond the loopback interface (%s); Locust has no "
                        "authentication: anyone who reaches it can start load", flag, value or "*",
                        "all interfaces" if value in ("", "*", "0.0.0.0", "::") else value)


def _opt(env: Any, name: str) -> Any:
    return getattr(env.parsed_options, f"turnscope_{name}")


_MAX_MODEL_LEN: dict[str, int | None] = {}


def _max_model_len(host: str) -> int | None:
    """The served model's ``max_model_len`` (tokens) from ``GET <host>/v1/models`` (vLLM's model
    card; the proxy forwards it), asked once per host; None when the server does not say."""
    if host not in _MAX_MODEL_LEN:
        try:
            cards = httpx.get(host.rstrip("/") + "/v1/models", timeout=10, verify=_ssl_context()).json()["data"]
            _MAX_MODEL_LEN[host] = int(cards[0]["max_model_len"])
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
            _MAX_MODEL_LEN[host] = None
            log.warning("turnscope: %s/v1/models did not give max_model_len; sessions stop before prompts "
                        "over 4096 - max tokens (set --turnscope-max-prompt-tokens)", host)
    return _MAX_MODEL_LEN[host]


def _safe(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "-", s).strip("-.")[:100] or "x"


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


# ------------------------------------------------------------------------------ coordination


class _Coordinator:
    """Per-process state: the plan (master/local), pending requests and the store writer (users)."""

    def __init__(self) -> None:
        self.env: Any = None
        # master / local side
        self.plans: list[dict[str, Any]] = []
        self.next_index = 0
        self.done: set[int] = set()
        self.run_id = ""
        self.workload: Workload | None = None
        self.t0_wall = 0.0
        self.started_at: dt.datetime | None = None
        self.finished = False
        self.run_writer: Any = None
        # user side
        self.pending: dict[str, AsyncResult] = {}
        self.writer: Any = None
        self.writer_run_id = ""
        self.writer_lock = threading.RLock()

    # -- master / local --------------------------------------------------------------------------

    def build_plan(self, env: Any) -> None:
        o = env.parsed_options
        if o.turnscope_time_scale <= 0:
            raise ValueError(f"--turnscope-time-scale must be > 0, got {o.turnscope_time_scale}")
        if o.turnscope_sessions < 0:
            raise ValueError(f"--turnscope-sessions must be >= 0, got {o.turnscope_sessions}")
        self.workload = None
        if o.turnscope_workload:
            plans = self._plan_workload(env)
            source = f"workload {self.workload.name}"
        else:
            max_turns = o.turnscope_max_turns or None
            convs = load_taubench(Path(o.turnscope_trace), max_turns=max_turns)
            if not convs:
                raise ValueError(f"{o.turnscope_trace}: no conversation with an assistant turn")
            n = o.turnscope_sessions or len(convs)
            gap = o.turnscope_gap_s * o.turnscope_time_scale
            plans = []
            for i in range(n):
                conv = convs[i % len(convs)]
                plans.append(plan_from_conversation(conv, session_id=f"s{i:05d}-{conv.id}",
                                                    tool_gap_s=gap, think_gap_s=gap))
            source = o.turnscope_trace
        self.plans = [p.to_dict() for p in plans]
        self.next_index = 0
        self.done = set()
        self.finished = False
        self.run_id = o.turnscope_run_id or (
            f"locust-{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:6]}")
        log.info("turnscope: run %s plans %d sessions (%d requests) from %s, history %s: %s",
                 self.run_id, len(plans), sum(len(p.turns) for p in plans), source, o.turnscope_history,
                 describe(plans))

    def _plan_workload(self, env: Any) -> list[SessionPlan]:
        o = env.parsed_options
        w = load_workload(o.turnscope_workload)
        if o.turnscope_seed >= 0:
            w = w.model_copy(update={"seed": o.turnscope_seed})
        self.workload = w
        with httpx.Client() as client:
            counter = counter_from(o.turnscope_tokenizer or None, client=client, base_url=env.host,
                                   model=o.turnscope_model)
            synth = TextSynth(counter, seed=w.seed)
            return plan_workload(w, synth, time_scale=o.turnscope_time_scale,
                                 sessions=o.turnscope_sessions or None,
                                 token_scale=o.turnscope_token_scale or None)

    def timeout_s(self, env: Any) -> float:
        """Per-turn timeout: the option, else the workload's, else 120 s (tau-bench replay)."""
        o = env.parsed_options
        if o.turnscope_timeout_s > 0:
            return o.turnscope_timeout_s
        return self.workload.timeout_s if self.workload is not None else 120.0

    def on_want(self, environment: Any, msg: Any, **_: Any) -> None:
        """Master side: hand the next session to the asking user (or None when exhausted)."""
        if self.next_index < len(self.plans) and not self.finished:
            idx = self.next_index
            self.next_index += 1
            data = {"req": msg.data["req"], "index": idx, "plan": self.plans[idx], "run_id": self.run_id,
                    "t0_wall": self.t0_wall, "request": self.request_settings(environment)}
        else:
            data = {"req": msg.data["req"], "index": None, "plan": None, "run_id": self.run_id}
        environment.runner.send_message(_MSG_SESSION, data, client_id=msg.node_id)

    def on_done(self, environment: Any, msg: Any, **_: Any) -> None:
        """Master side: count played sessions; end the run when all are."""
        self.done.add(msg.data["index"])
        if len(self.done) >= len(self.plans) and not self.finished:
            self.finished = True
            log.info("turnscope: all %d sessions played", len(self.plans))
            gevent.spawn(_end_run, environment)

    def request_settings(self, env: Any) -> dict[str, Any]:
        """What every request of the run carries beyond the plan (sent to the users with each session)."""
        o = env.parsed_options
        extra: dict[str, Any] = {}
        if o.turnscope_cache_salt:
            extra["cache_salt"] = o.turnscope_cache_salt
        w = self.workload
        if w is not None and w.ignore_eos:
            extra["ignore_eos"] = True
        return {"extra_body": extra or None, "temperature": w.temperature if w is not None else 0.0,
                "timeout_s": self.timeout_s(env)}

    def write_run_row(self, env: Any, status: str) -> None:
        """Append the run's row with ``status``; while ``running`` the writer rewrites it every
        ``--turnscope-heartbeat-s`` seconds (see ``ShardWriter.keep_alive``)."""
        o = env.parsed_options
        if o.turnscope_no_run_row or not self.run_id:
            return
        if self.run_writer is None or self.run_writer.run_id != self.run_id:
            if self.run_writer is not None:
                self.run_writer.close()
            self.run_writer = Store(Path(o.turnscope_store)).writer(self.run_id, _writer_id("run"))
        self.run_writer.stop_keep_alive()  # before the new row's updated_at: no beat can come after it
        now = dt.datetime.now(dt.UTC)
        config = {k: v for k, v in vars(o).items() if k.startswith("turnscope_")}
        config.update(host=env.host, users=getattr(o, "num_users", None))
        heartbeat = o.turnscope_heartbeat_s if o.turnscope_heartbeat_s > 0 else None
        row = {
            "run_id": self.run_id,
            "label": o.turnscope_label or None,
            "mode": o.turnscope_mode,
            "workload": self.workload.name if self.workload is not None else f"trace:{Path(o.turnscope_trace).stem}",
            "workload_spec": self.workload_spec(env),
            "history_mode": o.turnscope_history,
            "versions": {"turnscope": _version("turnscope"), "locust": _version("locust")},
            "model": o.turnscope_model,
            "config": config,
            "started_at": self.started_at,
            "finished_at": None if status == "running" else now,
            "status": status,
            "updated_at": now,
            "heartbeat_s": heartbeat if status == "running" else None,
        }
        self.run_writer.append("runs_log", row)
        self.run_writer.flush()
        if status == "running" and heartbeat is not None:
            self.run_writer.keep_alive("runs_log", row, heartbeat)

    def workload_spec(self, env: Any) -> dict[str, Any]:
        """The workload as run: the validated workload file (includes resolved) or the tau-bench
        replay settings, plus the time scale, sessions planned and per-turn timeout."""
        o = env.parsed_options
        common = {"time_scale": o.turnscope_time_scale, "sessions_planned": len(self.plans),
                  "turn_timeout_s": self.timeout_s(env)}
        if self.workload is not None:
            return {"kind": "workload", **self.workload.model_dump(mode="json"), **common,
                    "token_scale_override": o.turnscope_token_scale or None,
                    "tokenizer": o.turnscope_tokenizer or f"{env.host}/tokenize"}
        return {"kind": "tau-bench", "trace": Path(o.turnscope_trace).name, "sessions": len(self.plans),
                "max_turns": o.turnscope_max_turns or None, "gap_s": o.turnscope_gap_s,
                "max_tokens": o.turnscope_max_tokens, **common}

    # -- user side -------------------------------------------------------------------------------

    def on_session(self, environment: Any, msg: Any, **_: Any) -> None:
        """User side: deliver the master's answer to the waiting user."""
        waiter = self.pending.pop(msg.data["req"], None)
        if waiter is not None:
            waiter.set(msg.data)

    def want(self, env: Any) -> dict[str, Any]:
        req = uuid.uuid4().hex
        waiter = AsyncResult()
        self.pending[req] = waiter
        env.runner.send_message(_MSG_WANT, {"req": req})
        try:
            return waiter.get(timeout=_WANT_TIMEOUT_S)
        finally:
            self.pending.pop(req, None)

    def writer_for(self, env: Any, run_id: str) -> Any:
        # Under a lock: opening a writer starts its flusher thread, which yields to other users
        # (gevent), and two users must not both open one (the loser's rows would be orphaned).
        with self.writer_lock:
            if self.writer is None or self.writer_run_id != run_id:
                self._close_writer()
                self.writer = Store(Path(_opt(env, "store"))).writer(run_id, _writer_id("users"))
                self.writer_run_id = run_id
            return self.writer

    def close_writer(self) -> None:
        with self.writer_lock:
            self._close_writer()

    def _close_writer(self) -> None:
        if self.writer is not None:
            try:
                self.writer.close()
            finally:
                self.writer = None


def _writer_id(role: str) -> str:
    return _safe(f"locust-{role}-{socket.gethostname()}-{os.getpid()}")


def _end_run(env: Any) -> None:
    """All sessions played: quit a headless run; with the web UI stop the test, and quit too after
    ``--autoquit`` seconds when ``--autostart --autoquit`` were given (as Locust does at --run-time)."""
    o = env.parsed_options
    if o.headless:
        env.runner.quit()
        return
    env.runner.stop()
    if getattr(o, "autostart", False) and getattr(o, "autoquit", -1) != -1:
        gevent.sleep(o.autoquit)
        env.runner.quit()
        if env.web_ui is not None:
            env.web_ui.stop()


_coord = _Coordinator()
_SSL: list[ssl.SSLContext] = []


def _ssl_context() -> ssl.SSLContext:
    """One TLS context per process, shared by every user's client: building one (loading the CA
    bundle) takes tens of milliseconds, which a thousand users starting together cannot afford."""
    if not _SSL:
        _SSL.append(ssl.create_default_context())
    return _SSL[0]


@events.init.add_listener
def _on_init(environment: Any, **_: Any) -> None:
    _coord.env = environment
    if environment.parsed_options is not None:
        _warn_public_listeners(environment.parsed_options)
    runner = environment.runner
    if runner is None:
        return
    if not isinstance(runner, WorkerRunner):
        runner.register_message(_MSG_WANT, _coord.on_want)
        runner.register_message(_MSG_DONE, _coord.on_done)
    if not isinstance(runner, MasterRunner):
        runner.register_message(_MSG_SESSION, _coord.on_session)


@events.test_start.add_listener
def _on_test_start(environment: Any, **_: Any) -> None:
    try:
        _start_run(environment)
    finally:
        # The garbage collector stalls every user while it runs, and a stall shows up in the TTFTs
        # measured meanwhile. Long-lived objects (the plan, Locust's own state) are frozen out of
        # its reach; young collections stay small (a few milliseconds); full collections, which
        # walk every live session's state (50-90 ms of CPU at a thousand sessions), run only on a
        # slow timer (_full_gc_loop) instead of whenever CPython's counters say.
        gc.collect()
        gc.freeze()
        gc.set_threshold(*_GC_THRESHOLDS)
        global _full_gc
        if _full_gc is None:
            _full_gc = gevent.spawn(_full_gc_loop)


def _start_run(environment: Any) -> None:
    if isinstance(environment.runner, WorkerRunner):
        return
    o = environment.parsed_options
    try:
        if not environment.host:
            raise ValueError("no --host given (the proxy or server root, e.g. http://127.0.0.1:8000)")
        _coord.build_plan(environment)
        _coord.started_at = dt.datetime.now(dt.UTC)
        _coord.t0_wall = time.time()
        try:
            Store(Path(o.turnscope_store)).init()
        except RuntimeError as e:  # the views file is held by a reader; the shards are still written
            log.warning("turnscope: store views not refreshed: %s", e)
        if o.turnscope_history == "token_ids":
            with httpx.Client() as c:
                try:
                    joiner_for(TokenizeClient(c, environment.host, o.turnscope_model))
                except (TemplateJoinError, TokenizeError) as e:
                    raise ValueError(f"the token_ids history mode cannot be used against "
                                     f"{environment.host}: {e}") from e
    except (ValueError, OSError, WorkloadError, TraceFormatError, SynthError) as e:
        log.error("turnscope: cannot start the run: %s", e)
        environment.process_exit_code = 2
        _coord.plans = []
        _coord.run_id = ""  # nothing was recorded for it, and nothing will be
        _coord.finished = True
        gevent.spawn(_end_run, environment)
        return
    _coord.write_run_row(environment, "running")


@events.test_stop.add_listener
def _on_test_stop(environment: Any, **_: Any) -> None:
    if not isinstance(environment.runner, WorkerRunner) and _coord.run_id:
        complete = len(_coord.done) >= len(_coord.plans) > 0
        _coord.write_run_row(environment, "complete" if complete else "stopped")
    if not isinstance(environment.runner, MasterRunner):
        _coord.close_writer()


@events.quitting.add_listener
def _on_quitting(environment: Any, **_: Any) -> None:
    _coord.close_writer()
    if _coord.run_writer is not None:
        _coord.run_writer.close()
        _coord.run_writer = None


# ------------------------------------------------------------------------------------- users


class AgentSession(User):
    """One agent session at a time: asks the master for a session, plays it, repeats.

    Streams its turns with a :class:`loadgen.stream_client.GeventClient` (geventhttpclient, the
    engine of Locust's FastHttpUser, a third of httpx's CPU per turn) and calls ``/tokenize`` with
    an ``httpx.Client``; the turn is timed by ``loadgen.stream_client``, not by Locust. Waits
    between turns hold the user, like a real agent.
    """

    wait_time = constant(0)

    def on_start(self) -> None:
        self.http = httpx.Client(verify=_ssl_context(), limits=httpx.Limits(keepalive_expiry=_KEEPALIVE_S))
        self.stream = GeventClient(ssl_context=_ssl_context())

    def on_stop(self) -> None:
        for name in ("http", "stream"):
            client = getattr(self, name, None)
            if client is not None:
                client.close()

    @task
    def play_session(self) -> None:
        env = self.environment
        try:
            answer = _coord.want(env)
        except gevent.Timeout:
            log.error("turnscope: no session from the master within %s s; stopping this user", _WANT_TIMEOUT_S)
            raise StopUser() from None
        if answer["plan"] is None:
            raise StopUser()
        plan = SessionPlan.from_dict(answer["plan"])
        writer = _coord.writer_for(env, answer["run_id"])
        if plan.start_at_s is not None:
            delay = answer["t0_wall"] + plan.start_at_s - time.time()
            if delay > 0:
                gevent.sleep(delay)  # a trace session starts at its arrival offset
        req = answer["request"]
        max_tokens = _opt(env, "max_tokens")
        result = run_session(
            plan, self.http, self.host, _opt(env, "model"), writer, answer["run_id"], _opt(env, "history"),
            max_tokens=max_tokens,
            max_prompt_tokens=_opt(env, "max_prompt_tokens") or max(1, (_max_model_len(self.host) or 4096) - max_tokens),
            timeout_s=req["timeout_s"],
            temperature=req["temperature"],
            extra_body=req["extra_body"],
            on_turn=self._fire,
            keep_turns=False,
            stream_client=self.stream,
        )
        log.info("turnscope: session %s played: %s turns, %s (%s)", plan.session_id,
                 result.session_row["turns"] if result.session_row else "?",
                 result.session_row["status"] if result.session_row else "?", result.stopped)
        env.runner.send_message(_MSG_DONE, {"index": answer["index"]})

    def _fire(self, rec: TurnRecord) -> None:
        r = rec.result
        ok = r.status == "ok"
        exc = None if ok else RuntimeError(f"{r.status}: {r.error}")
        ctx = {"session_id": rec.row["session_id"], "turn_index": rec.row["turn_index"], "kind": rec.row["kind"]}
        fire = self.environment.events.request.fire
        fire(request_type="POST", name=rec.row["kind"], response_time=(r.e2e_s or 0.0) * 1000.0,
             response_length=r.completion_tokens or 0, exception=exc, context=ctx, url=self.host)
        fire(request_type="TTFT", name="TTFT",
             response_time=((r.ttft_s if r.ttft_s is not None else r.e2e_s) or 0.0) * 1000.0,
             response_length=0, exception=None if r.ttft_s is not None else exc, context=ctx, url=self.host)
