"""The locustfile's command-line options (``--turnscope-*``) and how they are read.

Registered on Locust's ``init_command_line_parser`` event by ``loadgen/locustfile.py``; the
README's tour, docs/workloads.md and the locustfile's docstring describe what each one does.
"""

from __future__ import annotations

import logging
from typing import Any

from core import resources
from core.contract import HISTORY_MODES
from core.modes import ATTACH_MODE
from loadgen.traces.taubench import DEFAULT_TRACE

log = logging.getLogger("turnscope.locust")


def add_arguments(parser: Any) -> None:
    """Add the ``--turnscope-*`` options to Locust's parser (and bind listeners to the loopback)."""
    g = parser.add_argument_group("turnscope", "turnscope agent-session workload")
    g.add_argument("--turnscope-store", type=str, default=str(resources.home()),
                   help="store root: shards go to <store>/runs/<run_id>/ (default: data/ of the checkout, "
                        "./turnscope-data installed)")
    g.add_argument("--turnscope-run-id", type=str, default="",
                   help="run id (letters, digits, . _ -); default: locust-<UTC time>-<random>")
    g.add_argument("--turnscope-trace", type=str, default=str(DEFAULT_TRACE),
                   help="tau-bench trajectory file to replay (default: the shipped airline trace)")
    g.add_argument("--turnscope-sessions", type=int, default=0,
                   help="sessions to play; 0 = one per conversation in the trace (default); more than "
                        "the trace holds cycles through it again under new session ids. With a workload: "
                        "archetype sessions to draw (0 = the workload's)")
    g.add_argument("--turnscope-slice", type=str, default="",
                   help="FIRST:STOP: play only sessions FIRST .. STOP-1 of the run's plan (the same sessions, "
                        "ids and turns as in the whole run; arrival offsets counted from the slice's first), "
                        "e.g. one round of an interleaved `turnscope eval` (default: every session)")
    g.add_argument("--turnscope-max-turns", type=int, default=0,
                   help="at most this many turns per session (0 = all)")
    g.add_argument("--turnscope-history", type=str, default="text", choices=list(HISTORY_MODES),
                   help="how a session carries its history (docs/workloads.md)")
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
    g.add_argument("--turnscope-mode", type=str, default=ATTACH_MODE,
                   help="serving mode recorded in runs_log.mode (aggregated, pd, pd-bidir, ...; default attach)")
    g.add_argument("--turnscope-no-run-row", action="store_true", default=False,
                   help="do not write runs_log rows (the caller records the run)")
    g.add_argument("--turnscope-heartbeat-s", type=float, default=5.0,
                   help="rewrite the running run's row this often (seconds); a run whose row is older than "
                        "three heartbeats reads 'aborted' (its Locust process died)")
    # Every listener binds the loopback interface unless told otherwise (Locust's own defaults are
    # all interfaces): the web UI and the master have no authentication.
    parser.set_defaults(web_host="127.0.0.1", master_bind_host="127.0.0.1")


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def warn_public_listeners(options: Any) -> None:
    """Warn for a web UI or master bound beyond the loopback interface (an explicit choice)."""
    for flag, attr in (("--web-host", "web_host"), ("--master-bind-host", "master_bind_host")):
        value = getattr(options, attr, None)
        if attr == "web_host" and getattr(options, "headless", False):
            continue
        if attr == "master_bind_host" and not getattr(options, "master", False):
            continue
        if value is not None and value not in LOOPBACK:
            log.warning("turnscope: %s %s binds beyond the loopback interface (%s); Locust has no "
                        "authentication: anyone who reaches it can start load", flag, value or "*",
                        "all interfaces" if value in ("", "*", "0.0.0.0", "::") else value)


def opt(env: Any, name: str) -> Any:
    """The value of ``--turnscope-<name>`` (``name`` with underscores)."""
    return getattr(env.parsed_options, f"turnscope_{name}")
