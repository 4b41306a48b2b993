"""Locust entry point: each Locust user is one agent session at a time (docs/design.md).

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
``--turnscope-slice FIRST:STOP`` plays only those sessions of the plan (the same ids and turns as in
the whole run; ``turnscope eval``'s interleaved schedule plays a run in such slices, one Locust
process each, ``turnscope.conductor.schedule``).

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

The parts: the options (:mod:`loadgen.locust_options`), the session dispenser
(:mod:`loadgen.session_dispenser`), the run recorder (:mod:`loadgen.run_recorder`) and the user
(:class:`AgentSession`, which plays each session with :func:`loadgen.session_player.run_session`);
this file wires them to Locust's events.

Locust statistics: one ``POST <kind>`` request event per turn (``turn``, ``retry``, ``edit``,
``fresh``, ``resume``), fired at stream end with response_time = E2E (ms), and one ``TTFT TTFT``
event with response_time = TTFT (ms); failed turns (errors, and timeouts, whose reason names the
timeout) fire both as failures with the reason; so does a turn cut off in flight when the test
stops (status ``cancelled``, stored too, with the proxy's facts of it asked for by its request id:
``loadgen.facts_lookup``, at most about 2 s per user before Locust's stop completes). Locust
rewrites its ``--csv`` files once a second and not at the end, so the last second's turns can be
missing there; ``--json-file`` is written after
the users stopped and holds every event. Locust's own percentiles are rounded: analyse the
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
import ssl
import time
from pathlib import Path
from typing import Any

import gevent
import httpx
from locust import User, constant, events, task
from locust.exception import StopUser
from locust.runners import MasterRunner, WorkerRunner

from core.contract import client_auth_headers
from core.tokenize_client import TokenizeClient, TokenizeError
from loadgen.locust_options import add_arguments, opt, warn_public_listeners
from loadgen.run_recorder import RunRecorder
from loadgen.session import SessionPlan
from loadgen.session_dispenser import MSG_DONE, MSG_SESSION, MSG_WANT, WANT_TIMEOUT_S, SessionDispenser
from loadgen.session_history import joiner_for
from loadgen.session_player import run_session
from loadgen.session_recorder import TurnRecord
from loadgen.stream_client import GeventClient
from loadgen.synth_text import SynthError
from loadgen.token_prompt import TemplateJoinError
from loadgen.traces.taubench import TraceFormatError
from loadgen.workload import WorkloadError
from store.writer import Store

log = logging.getLogger("turnscope.locust")
# httpx logs every request at INFO: at a thousand sessions that is measurable CPU on the event loop
# the turns are timed on. Its warnings and errors still show.
logging.getLogger("httpx").setLevel(logging.WARNING)

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


events.init_command_line_parser.add_listener(add_arguments)
#: This process's session dispenser and run recorder (module state: Locust loads this file once).
dispenser = SessionDispenser(on_all_played=_end_run)
recorder = RunRecorder(dispenser)

_SSL: list[ssl.SSLContext] = []


def _ssl_context() -> ssl.SSLContext:
    """One TLS context per process, shared by every user's client: building one (loading the CA
    bundle) takes tens of milliseconds, which a thousand users starting together cannot afford."""
    if not _SSL:
        _SSL.append(ssl.create_default_context())
    return _SSL[0]


_MAX_MODEL_LEN: dict[str, int | None] = {}


def _max_model_len(host: str) -> int | None:
    """The served model's ``max_model_len`` (tokens) from ``GET <host>/v1/models`` (vLLM's model
    card; the proxy forwards it), asked once per host; None when the server does not say."""
    if host not in _MAX_MODEL_LEN:
        try:
            cards = httpx.get(host.rstrip("/") + "/v1/models", timeout=10, verify=_ssl_context(),
                              headers=client_auth_headers()).json()["data"]
            _MAX_MODEL_LEN[host] = int(cards[0]["max_model_len"])
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
            _MAX_MODEL_LEN[host] = None
            log.warning("turnscope: %s/v1/models did not give max_model_len; sessions stop before prompts "
                        "over 4096 - max tokens (set --turnscope-max-prompt-tokens)", host)
    return _MAX_MODEL_LEN[host]


@events.init.add_listener
def _on_init(environment: Any, **_: Any) -> None:
    if environment.parsed_options is not None:
        warn_public_listeners(environment.parsed_options)
    runner = environment.runner
    if runner is None:
        return
    if not isinstance(runner, WorkerRunner):
        runner.register_message(MSG_WANT, dispenser.on_want)
        runner.register_message(MSG_DONE, dispenser.on_done)
    if not isinstance(runner, MasterRunner):
        runner.register_message(MSG_SESSION, dispenser.on_session)


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
        dispenser.build_plan(environment)
        dispenser.started_at = dt.datetime.now(dt.UTC)
        dispenser.t0_wall = time.time()
        try:
            Store(Path(o.turnscope_store)).init()
        except RuntimeError as e:  # the views file is held by a reader; the shards are still written
            log.warning("turnscope: store views not refreshed: %s", e)
        if o.turnscope_history == "token_ids":
            with httpx.Client(headers=client_auth_headers(), verify=_ssl_context()) as c:
                try:
                    joiner_for(TokenizeClient(c, environment.host, o.turnscope_model))
                except (TemplateJoinError, TokenizeError) as e:
                    raise ValueError(f"the token_ids history mode cannot be used against "
                                     f"{environment.host}: {e}") from e
    except (ValueError, OSError, WorkloadError, TraceFormatError, SynthError) as e:
        log.error("turnscope: cannot start the run: %s", e)
        environment.process_exit_code = 2
        dispenser.abandon()  # nothing was recorded for the run, and nothing will be
        gevent.spawn(_end_run, environment)
        return
    recorder.write_run_row(environment, "running")


@events.test_stop.add_listener
def _on_test_stop(environment: Any, **_: Any) -> None:
    if not isinstance(environment.runner, WorkerRunner) and dispenser.run_id:
        complete = len(dispenser.done) >= len(dispenser.plans) > 0
        recorder.write_run_row(environment, "complete" if complete else "stopped")
    if not isinstance(environment.runner, MasterRunner):
        recorder.close_writer()


@events.quitting.add_listener
def _on_quitting(environment: Any, **_: Any) -> None:
    # Locust fires `quitting` before it stops the users (locust/main.py: shutdown, e.g. on
    # SIGTERM): stop them first, so that each request in flight is recorded (a `cancelled` row, and
    # a failed Locust event) and the run row says `stopped` before the writers close.
    runner = environment.runner
    if runner is not None and not isinstance(runner, MasterRunner):
        runner.stop()
    recorder.close_writer()
    recorder.close_run_writer()


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
        self.http = httpx.Client(verify=_ssl_context(), limits=httpx.Limits(keepalive_expiry=_KEEPALIVE_S),
                                 headers=client_auth_headers())
        self.stream = GeventClient(ssl_context=_ssl_context(), headers=client_auth_headers())

    def on_stop(self) -> None:
        for name in ("http", "stream"):
            client = getattr(self, name, None)
            if client is not None:
                client.close()

    @task
    def play_session(self) -> None:
        env = self.environment
        try:
            answer = dispenser.want(env)
        except gevent.Timeout:
            log.error("turnscope: no session from the master within %s s; stopping this user", WANT_TIMEOUT_S)
            raise StopUser() from None
        if answer["plan"] is None:
            raise StopUser()
        plan = SessionPlan.from_dict(answer["plan"])
        writer = recorder.writer_for(env, answer["run_id"])
        if plan.start_at_s is not None:
            delay = answer["t0_wall"] + plan.start_at_s - time.time()
            if delay > 0:
                gevent.sleep(delay)  # a trace session starts at its arrival offset
        req = answer["request"]
        max_tokens = opt(env, "max_tokens")
        result = run_session(
            plan, self.http, self.host, opt(env, "model"), writer, answer["run_id"], opt(env, "history"),
            max_tokens=max_tokens,
            max_prompt_tokens=opt(env, "max_prompt_tokens") or max(1, (_max_model_len(self.host) or 4096) - max_tokens),
            timeout_s=req["timeout_s"],
            temperature=req["temperature"],
            extra_body=req["extra_body"],
            history_rewrite=req.get("history_rewrite"),
            on_turn=self._fire,
            keep_turns=False,
            stream_client=self.stream,
        )
        log.info("turnscope: session %s played: %s turns, %s (%s)", plan.session_id,
                 result.session_row["turns"] if result.session_row else "?",
                 result.session_row["status"] if result.session_row else "?", result.stopped)
        env.runner.send_message(MSG_DONE, {"index": answer["index"]})

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
