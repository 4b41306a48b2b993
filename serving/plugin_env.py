"""The setting turnscope's vLLM plugins read from a worker's environment (``serving.nixl_progress``,
``serving.engine_idle_wait``): a non-negative integer whose 0 or absence leaves vLLM as it is."""

from __future__ import annotations

import os


def positive_int(name: str, unit: str, environ: dict[str, str] | None = None) -> int | None:
    """The integer in ``environ[name]`` (default: ``os.environ``), in ``unit``; None when unset,
    empty or 0 (the plugin then changes nothing). Raises ValueError naming the variable and the unit
    for a value that is not a non-negative integer."""
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{name}={raw!r}: expected {unit}, a non-negative integer")
    return value or None
