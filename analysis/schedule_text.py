"""How recorded runs were scheduled, in words: the line under the CLI's bottom line and the Overview's
headline. Reads what each run recorded under ``runs.workload_spec.schedule`` (written by
``turnscope.conductor.schedule``: ``{"kind": "sequential"}`` or ``{"kind": "interleaved", "group": [...],
"rounds": N, "seed": S, ...}``)."""

from __future__ import annotations

import json
from collections.abc import Iterable

INTERLEAVED = "interleaved"
SEQUENTIAL = "sequential"


def describe(specs: Iterable[dict | None]) -> list[str]:
    """One sentence per schedule among ``specs`` (each run's ``workload_spec.schedule``; None for a
    run that recorded none, read as sequential), e.g. ``Interleaved: aggregated, pd, pd-bidir up
    together, sessions in 3 rounds per history mode, the order shuffled each round (seed 0).``;
    ``One mode after another (sequential schedule).`` Runs of one group, rounds and seed give one
    sentence, in the order first seen."""
    seen: dict[tuple, str] = {}
    for spec in specs:
        if not spec or spec.get("kind") != INTERLEAVED:
            reason = (spec or {}).get("reason")
            seen.setdefault((SEQUENTIAL, reason), "One mode after another (sequential schedule)"
                            + (f": {reason}" if reason else "") + ".")
            continue
        group = tuple(spec.get("group") or ())
        key = (INTERLEAVED, group, spec.get("rounds"), spec.get("seed"), spec.get("by"))
        if spec.get("by") == "run":
            seen.setdefault(key, f"Interleaved: {', '.join(group)} up together, their runs played step by step "
                                 f"({spec.get('rounds')} steps), the order shuffled each step (seed {spec.get('seed')}).")
            continue
        seen.setdefault(key, f"Interleaved: {', '.join(group)} up together, sessions in {spec.get('rounds')} "
                             f"round(s) per history mode, the order shuffled each round (seed {spec.get('seed')}).")
    return list(seen.values())


def describe_json(texts: Iterable[str | None]) -> list[str]:
    """:func:`describe` of schedules as stored (``runs.workload_spec.schedule`` as JSON text, None)."""
    return describe(json.loads(t) if isinstance(t, str) and t else None for t in texts)
