"""The run recorder: what one Locust process writes to the store.

The master (or local process) writes the run's ``runs_log`` rows: ``running`` (rewritten every
``--turnscope-heartbeat-s`` seconds), then ``complete`` or ``stopped``. Each process's users share
one store writer (``writer_id`` = ``locust-users-<host>-<pid>``) for their ``turns`` and
``sessions`` rows. See the locustfile's docstring and docs/schema/overview.md.
"""

from __future__ import annotations

import datetime as dt
import os
import re
import socket
import threading
from importlib import metadata
from pathlib import Path
from typing import Any

from loadgen.locust_options import opt
from loadgen.session_dispenser import SessionDispenser
from store.writer import Store


def _safe(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "-", s).strip("-.")[:100] or "x"


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def writer_id(role: str) -> str:
    """A store writer id unique to this process: ``locust-<role>-<host>-<pid>`` (path-safe)."""
    return _safe(f"locust-{role}-{socket.gethostname()}-{os.getpid()}")


class RunRecorder:
    """The run row (master/local side) and the users' store writer (user side) of one process.

    Args:
        plan: the session dispenser, whose run id, workload and plan the run row records.
    """

    def __init__(self, plan: SessionDispenser) -> None:
        self.plan = plan
        self.run_writer: Any = None
        self.writer: Any = None
        self.writer_run_id = ""
        self.writer_lock = threading.RLock()

    def write_run_row(self, env: Any, status: str) -> None:
        """Append the run's row with ``status``; while ``running`` the writer rewrites it every
        ``--turnscope-heartbeat-s`` seconds (see ``ShardWriter.keep_alive``)."""
        o = env.parsed_options
        if o.turnscope_no_run_row or not self.plan.run_id:
            return
        if self.run_writer is None or self.run_writer.run_id != self.plan.run_id:
            if self.run_writer is not None:
                self.run_writer.close()
            self.run_writer = Store(Path(o.turnscope_store)).writer(self.plan.run_id, writer_id("run"))
        self.run_writer.stop_keep_alive()  # before the new row's updated_at: no beat can come after it
        now = dt.datetime.now(dt.UTC)
        config = {k: v for k, v in vars(o).items() if k.startswith("turnscope_")}
        config.update(host=env.host, users=getattr(o, "num_users", None))
        heartbeat = o.turnscope_heartbeat_s if o.turnscope_heartbeat_s > 0 else None
        row = {
            "run_id": self.plan.run_id,
            "label": o.turnscope_label or None,
            "mode": o.turnscope_mode,
            "workload": self.plan.workload.name if self.plan.workload is not None else f"trace:{Path(o.turnscope_trace).stem}",
            "workload_spec": self.workload_spec(env),
            "history_mode": o.turnscope_history,
            "versions": {"turnscope": _version("turnscope"), "locust": _version("locust")},
            "model": o.turnscope_model,
            "config": config,
            "started_at": self.plan.started_at,
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
        common = {"time_scale": o.turnscope_time_scale, "sessions_planned": len(self.plan.plans),
                  "turn_timeout_s": self.plan.timeout_s(env)}
        if self.plan.workload is not None:
            return {"kind": "workload", **self.plan.workload.model_dump(mode="json"), **common,
                    "token_scale_override": o.turnscope_token_scale or None,
                    "tokenizer": o.turnscope_tokenizer or f"{env.host}/tokenize"}
        return {"kind": "tau-bench", "trace": Path(o.turnscope_trace).name, "sessions": len(self.plan.plans),
                "max_turns": o.turnscope_max_turns or None, "gap_s": o.turnscope_gap_s,
                "max_tokens": o.turnscope_max_tokens, **common}

    def close_run_writer(self) -> None:
        """Close the run row's writer."""
        if self.run_writer is not None:
            self.run_writer.close()
            self.run_writer = None

    def writer_for(self, env: Any, run_id: str) -> Any:
        """The users' store writer for ``run_id`` (opened on first use, reopened for a new run)."""
        # Under a lock: opening a writer starts its flusher thread, which yields to other users
        # (gevent), and two users must not both open one (the loser's rows would be orphaned).
        with self.writer_lock:
            if self.writer is None or self.writer_run_id != run_id:
                self._close_writer()
                self.writer = Store(Path(opt(env, "store"))).writer(run_id, writer_id("users"))
                self.writer_run_id = run_id
            return self.writer

    def close_writer(self) -> None:
        """Close the users' writer (flushing its rows)."""
        with self.writer_lock:
            self._close_writer()

    def _close_writer(self) -> None:
        if self.writer is not None:
            try:
                self.writer.close()
            finally:
                self.writer = None
