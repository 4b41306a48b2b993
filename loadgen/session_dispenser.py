"""The session dispenser: hands every planned session to exactly one Locust user.

The plan (which sessions, their turns and gaps) is built once, on the master (or the single local
process), at test start. Users ask the master for their next session over Locust's custom messages
(``turnscope_want`` -> ``turnscope_session``) and report it played (``turnscope_done``); see the
locustfile's docstring for what that guarantees.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gevent
import httpx
from gevent.event import AsyncResult

from core.contract import client_auth_headers
from loadgen.session import SessionPlan, plan_from_conversation
from loadgen.synth_text import TextSynth, counter_from
from loadgen.traces.taubench import load_taubench
from loadgen.workload import Workload, describe, load_workload, plan_workload

log = logging.getLogger("turnscope.locust")

MSG_WANT = "turnscope_want"
MSG_SESSION = "turnscope_session"
MSG_DONE = "turnscope_done"
WANT_TIMEOUT_S = 120.0


def slice_plans(plans: list[SessionPlan], spec: str) -> list[SessionPlan]:
    """The sessions ``FIRST .. STOP-1`` of ``plans`` for ``spec`` = ``"FIRST:STOP"`` (all of them for
    ``""``), their arrival offsets (``start_at_s``, seconds) moved so that the slice's earliest is 0.
    Raises ValueError for a malformed spec or a range outside ``0 .. len(plans)``."""
    if not spec:
        return plans
    try:
        first, stop = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"--turnscope-slice takes FIRST:STOP (session indices), got {spec!r}") from None
    if not 0 <= first < stop <= len(plans):
        raise ValueError(f"--turnscope-slice {spec}: the plan has sessions 0..{len(plans) - 1}")
    out = plans[first:stop]
    offsets = [p.start_at_s for p in out if p.start_at_s is not None]
    if offsets and min(offsets) > 0:
        shift = min(offsets)
        out = [dataclasses.replace(p, start_at_s=p.start_at_s - shift) if p.start_at_s is not None else p
               for p in out]
    return out


class SessionDispenser:
    """Per-process state of the hand-out: the plan and the played sessions (master/local side),
    the users' pending asks (user side).

    Args:
        on_all_played: called (in its own greenlet) when every planned session was reported played.
    """

    def __init__(self, on_all_played: Callable[[Any], None]) -> None:
        self.on_all_played = on_all_played
        # master / local side
        self.plans: list[dict[str, Any]] = []
        self.next_index = 0
        self.done: set[int] = set()
        self.run_id = ""
        self.workload: Workload | None = None
        self.t0_wall = 0.0
        self.started_at: dt.datetime | None = None
        self.finished = False
        # user side
        self.pending: dict[str, AsyncResult] = {}

    # -- master / local --------------------------------------------------------------------------

    def build_plan(self, env: Any) -> None:
        """Plan the run's sessions from the options (a workload file, or the tau-bench replay)."""
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
        plans = slice_plans(plans, o.turnscope_slice)
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
        with httpx.Client(headers=client_auth_headers()) as client:
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
        environment.runner.send_message(MSG_SESSION, data, client_id=msg.node_id)

    def on_done(self, environment: Any, msg: Any, **_: Any) -> None:
        """Master side: count played sessions; end the run when all are."""
        self.done.add(msg.data["index"])
        if len(self.done) >= len(self.plans) and not self.finished:
            self.finished = True
            log.info("turnscope: all %d sessions played", len(self.plans))
            gevent.spawn(self.on_all_played, environment)

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
                "timeout_s": self.timeout_s(env),
                "history_rewrite": w.history_rewrite.model_dump() if w is not None and w.history_rewrite.active()
                else None}

    def abandon(self) -> None:
        """The run could not start: nothing is planned, recorded or handed out."""
        self.plans = []
        self.run_id = ""
        self.finished = True

    # -- user side -------------------------------------------------------------------------------

    def on_session(self, environment: Any, msg: Any, **_: Any) -> None:
        """User side: deliver the master's answer to the waiting user."""
        waiter = self.pending.pop(msg.data["req"], None)
        if waiter is not None:
            waiter.set(msg.data)

    def want(self, env: Any) -> dict[str, Any]:
        """User side: ask the master for the next session; its answer (``plan`` None: none left)."""
        req = uuid.uuid4().hex
        waiter = AsyncResult()
        self.pending[req] = waiter
        env.runner.send_message(MSG_WANT, {"req": req})
        try:
            return waiter.get(timeout=WANT_TIMEOUT_S)
        finally:
            self.pending.pop(req, None)
