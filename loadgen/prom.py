"""Reading Prometheus /metrics text the way vLLM exposes it (pure functions, no I/O).

Parsing is prometheus_client's (``prometheus_client.parser``). On top of it, three rules that a
naive reader gets wrong on vLLM's output (cases in ``shared/cases/prometheus/``):

- ``<counter>_created`` series hold a Unix time, not a count: never returned, never summed.
  prometheus_client's text parser does not attach ``foo_total`` / ``foo_created`` to the
  ``# TYPE foo counter`` family (they come back as "unknown" families), so the rule is by name:
  ``X_created`` is dropped when ``X`` is declared counter/histogram/summary or when ``X_total``,
  ``X_count`` or ``X_sum`` is present.
- Histogram ``_bucket`` series (a sample with an ``le`` label) are dropped; ``_sum``/``_count`` kept.
- Per-pid gauges (see :func:`gauge_value`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

_CUMULATIVE_TYPES = {"counter", "histogram", "summary", "gaugehistogram"}


@dataclass(frozen=True)
class Sample:
    """One exposed series at one scrape: ``name`` as exposed (e.g. ``vllm:prefix_cache_hits_total``),
    its ``labels``, and its ``value`` (float; unit per the metric's name)."""

    name: str
    labels: dict[str, str]
    value: float


def parse_samples(text: str, source: str = "<metrics text>") -> list[Sample]:
    """Parse Prometheus text exposition into samples, without ``_created`` and ``_bucket`` series.

    Args:
        text: the body of a ``/metrics`` response.
        source: what to call the text in errors (e.g. the URL).

    Returns:
        Samples in exposition order.

    Raises:
        ValueError: the text does not parse; the message names ``source``.
    """
    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, TypeError, IndexError, KeyError) as e:
        raise ValueError(f"{source}: not Prometheus text exposition: {e}") from e
    cumulative = {f.name for f in families if f.type in _CUMULATIVE_TYPES}
    raw = [s for f in families for s in f.samples]
    names = {s.name for s in raw}
    out = []
    for s in raw:
        if s.name.endswith("_created"):
            base = s.name[: -len("_created")]
            if base in cumulative or names & {base + "_total", base + "_count", base + "_sum"}:
                continue
        if s.name.endswith("_bucket") and "le" in s.labels:
            continue
        out.append(Sample(s.name, dict(s.labels), float(s.value)))
    return out


def _matching(samples: Iterable[Sample], name: str, labels: dict[str, str] | None) -> list[Sample]:
    want = labels or {}
    return [s for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in want.items())]


def gauge_value(samples: Sequence[Sample], name: str, labels: dict[str, str] | None = None) -> float:
    """The current value of gauge ``name``, resolving per-pid copies.

    Rule for series that differ only in the ``pid`` label: they are per-process copies of one gauge
    (prometheus_client multiprocess mode "all", as with several vLLM API-server processes). Only
    the process that receives the engine's stats ever sets it; the others keep the initial 0.0.
    So the live value is the non-zero copy; 0.0 when every copy is 0. Taking the first copy would
    read an idle process (0.0) and summing would double-count. When several copies are non-zero
    and differ, the text cannot tell a live process from a dead one (mode "all" keeps a dead
    process's last value), so this raises instead of guessing.

    Args:
        samples: from :func:`parse_samples`.
        name: the exact sample name, e.g. ``vllm:kv_cache_usage_perc``.
        labels: optional label filter (e.g. ``{"engine": "0"}``) when several gauges share the name.

    Raises:
        KeyError: no series of that name (and labels).
        ValueError: several series remain that differ in labels other than ``pid`` (pass
            ``labels``), or several non-zero per-pid copies disagree.
    """
    found = _matching(samples, name, labels)
    if not found:
        raise KeyError(f"gauge {name!r} with labels {labels or {}} not in the scrape")
    groups = {tuple(sorted((k, v) for k, v in s.labels.items() if k != "pid")) for s in found}
    if len(groups) > 1:
        raise ValueError(f"gauge {name!r}: {len(groups)} series differ in more than pid "
                         f"({[dict(g) for g in sorted(groups)][:4]}); pass labels= to pick one")
    nonzero = [s for s in found if s.value != 0.0 and not math.isnan(s.value)]
    if not nonzero:
        return 0.0
    if len({s.value for s in nonzero}) > 1:
        copies = ", ".join(f"pid {s.labels.get('pid')}={s.value}" for s in nonzero)
        raise ValueError(f"gauge {name!r}: per-pid copies disagree ({copies}); "
                         "cannot tell the live process from the text")
    return nonzero[0].value


def counter_total(samples: Sequence[Sample], name: str, labels: dict[str, str] | None = None) -> float:
    """The current value of counter ``name``: the sum of its ``<name>_total`` series.

    ``name`` may be given with or without ``_total``; the ``_created`` series is never read.
    Several matching series (other labels, or per-process copies) are summed: each counts its own
    events. A deprecated twin (e.g. ``vllm:gpu_prefix_cache_queries``) is a different name and is
    only read when asked for.

    Raises:
        KeyError: no ``<name>_total`` series (message lists similar names seen).
    """
    base = name.removesuffix("_total")
    found = _matching(samples, base + "_total", labels)
    if not found:
        similar = sorted({s.name for s in samples if base.split(":")[-1] in s.name})[:6]
        raise KeyError(f"counter {base + '_total'!r} with labels {labels or {}} not in the scrape"
                       + (f"; similar: {similar}" if similar else ""))
    return math.fsum(s.value for s in found)


def counter_increase(scrapes: Sequence[tuple[float | None, float]]) -> tuple[float, int]:
    """Increase of a counter over successive scrapes, across resets and restarts.

    Args:
        scrapes: ``(process_start_time_seconds or None, counter value)`` per scrape, in scrape
            order.

    Returns:
        ``(increase, restarts)``. Between consecutive scrapes: if the process start time changed
        (a restart, detected even when the new value already exceeds the old one) or the value
        dropped (a reset), the counter restarted from 0, so the new value is all increase;
        otherwise the difference. This is Prometheus ``increase()``'s reset handling
        ("breaks in monotonicity ... are automatically adjusted for", Prometheus docs, Query
        functions; ``extrapolatedRate`` in promql/functions.go) without its extrapolation to the
        range edges: the result is the increase between the first and the last scrape.
    """
    increase, restarts = 0.0, 0
    for (start0, v0), (start1, v1) in itertools.pairwise(scrapes):
        restarted = start0 is not None and start1 is not None and start1 != start0
        if restarted or v1 < v0:
            restarts += 1
            increase += v1
        else:
            increase += v1 - v0
    return increase, restarts
