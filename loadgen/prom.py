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
- Per-engine series (data-parallel engines of one server, told apart only by the ``engine``
  label; handed case ``per_engine_series``): counters, histograms and request counts add across
  engines; KV usage stays per engine (:func:`gauge_by_engine`), and one figure for the server is
  the maximum (:func:`gauge_max_over_engines`), never the last series read nor the sum.
- Prompt tokens by source (:func:`prompt_token_sources`): reuse fractions come from
  ``vllm:prompt_tokens_by_source_total``, whose sources add up to ``vllm:prompt_tokens_total``,
  which counts n x the prompt for a request with ``n`` > 1 (handed case ``prompt_tokens_by_source``).
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


def engines(samples: Sequence[Sample]) -> list[str]:
    """The values of the ``engine`` label seen in a scrape, sorted (``[]`` for a server that does
    not label engines)."""
    return sorted({s.labels["engine"] for s in samples if "engine" in s.labels})


def gauge_by_engine(samples: Sequence[Sample], name: str, labels: dict[str, str] | None = None) -> dict[str, float]:
    """Gauge ``name`` per data-parallel engine: ``{engine label: value}``, each engine's value
    resolved with :func:`gauge_value`'s per-pid rule. A server without ``engine`` labels gives one
    entry under ``""``.

    Raises:
        KeyError: no series of that name (and labels).
        ValueError: as :func:`gauge_value`, within one engine.
    """
    found = _matching(samples, name, labels)
    if not found:
        raise KeyError(f"gauge {name!r} with labels {labels or {}} not in the scrape")
    out = {}
    for engine in sorted({s.labels.get("engine", "") for s in found}):
        want = {**(labels or {}), "engine": engine} if engine else labels
        same_engine = [s for s in found if s.labels.get("engine", "") == engine]
        out[engine] = gauge_value(same_engine, name, want)
    return out


def gauge_max_over_engines(samples: Sequence[Sample], name: str, labels: dict[str, str] | None = None) -> float:
    """One figure for a per-engine gauge such as ``vllm:kv_cache_usage_perc`` (fraction 0..1): the
    fullest engine. A server is as full as its fullest engine (a request routed there waits or is
    preempted whatever the others hold), so neither the sum nor the last series read is right
    (volcano-sh/kthena#1782, gateway-api-inference-extension#2950).

    Raises:
        KeyError, ValueError: as :func:`gauge_by_engine`.
    """
    return max(gauge_by_engine(samples, name, labels).values())


def gauge_sum_over_engines(samples: Sequence[Sample], name: str, labels: dict[str, str] | None = None) -> float:
    """One figure for a per-engine count such as ``vllm:num_requests_running`` or ``_waiting``
    (requests): the sum over engines, each engine's per-pid copies resolved first.

    Raises:
        KeyError, ValueError: as :func:`gauge_by_engine`.
    """
    return math.fsum(gauge_by_engine(samples, name, labels).values())


@dataclass(frozen=True)
class PromptTokenSources:
    """Prompt tokens by source, from vLLM's ``vllm:prompt_tokens_by_source_total`` (vllm#33290):
    ``local_compute`` (prefilled here), ``local_cache_hit`` (this worker's prefix cache) and
    ``external_kv_transfer`` (pulled over the KV connector, e.g. NIXL from D). Tokens; the three add
    up to ``vllm:prompt_tokens_total``, which counts n x the prompt for a request with ``n`` > 1
    (vllm#56923), so fractions are taken against their own sum, never against client usage."""

    local_compute: float
    local_cache_hit: float
    external_kv_transfer: float

    @property
    def total(self) -> float:
        """All prompt tokens the worker accounted for (== ``vllm:prompt_tokens_total``)."""
        return self.local_compute + self.local_cache_hit + self.external_kv_transfer

    def _fraction(self, part: float) -> float | None:
        return part / self.total if self.total > 0 else None

    @property
    def reused_fraction(self) -> float | None:
        """Share of prompt tokens not computed here (cache hit + external), 0..1; None without tokens."""
        return self._fraction(self.local_cache_hit + self.external_kv_transfer)

    @property
    def external_fraction(self) -> float | None:
        """Share of prompt tokens pulled over the connector, 0..1; None without tokens."""
        return self._fraction(self.external_kv_transfer)

    @property
    def computed_fraction(self) -> float | None:
        """Share of prompt tokens prefilled here, 0..1; None without tokens."""
        return self._fraction(self.local_compute)


def prompt_token_sources(samples: Sequence[Sample], labels: dict[str, str] | None = None) -> PromptTokenSources:
    """The current ``vllm:prompt_tokens_by_source_total`` counters of one scrape, summed over
    engines and other labels (``labels`` filters, e.g. ``{"model_name": ...}``). A source the
    worker has not exposed counts 0.

    Raises:
        KeyError: the scrape has no ``vllm:prompt_tokens_by_source_total`` series at all (a vLLM
            older than vllm#33290, or not a vLLM worker).
    """
    name = "vllm:prompt_tokens_by_source_total"
    if not _matching(samples, name, labels):
        raise KeyError(f"counter {name!r} with labels {labels or {}} not in the scrape")

    def source(src: str) -> float:
        return math.fsum(s.value for s in _matching(samples, name, {**(labels or {}), "source": src}))

    return PromptTokenSources(source("local_compute"), source("local_cache_hit"), source("external_kv_transfer"))


@dataclass(frozen=True)
class HistogramTotals:
    """A histogram summed over every label set but ``le``: ``count`` observations, ``sum`` (the
    metric's unit, e.g. seconds), and ``buckets`` as ``(upper bound, cumulative count)`` sorted by
    bound (``+Inf`` last)."""

    count: float
    sum: float
    buckets: tuple[tuple[float, float], ...]

    @property
    def mean(self) -> float | None:
        """``sum / count``; None without observations."""
        return self.sum / self.count if self.count else None

    def fraction_at_or_below(self, bound: float) -> float | None:
        """Share of observations <= ``bound``, which must be one of the bucket bounds (no
        interpolation inside a bucket); None without observations.

        Raises:
            ValueError: ``bound`` is not a bucket bound.
        """
        for le, cumulative in self.buckets:
            if le == bound:
                return cumulative / self.count if self.count else None
        raise ValueError(f"{bound} is not a bucket bound of this histogram ({[b for b, _ in self.buckets]})")


def histogram_totals(text: str, name: str, source: str = "<metrics text>") -> HistogramTotals:
    """Histogram ``name`` (e.g. ``vllm:time_to_first_token_seconds``) from /metrics text, its
    ``_bucket``, ``_sum`` and ``_count`` series added across engines and other labels (a scrape
    stores no buckets: :func:`parse_samples` drops them, so this reads the text itself).

    Raises:
        ValueError: the text does not parse (names ``source``).
        KeyError: no histogram of that name.
    """
    parts = {name + "_bucket", name + "_count", name + "_sum"}
    try:
        families = [f for f in text_string_to_metric_families(text) if f.name == name or f.name in parts]
    except (ValueError, TypeError, IndexError, KeyError) as e:
        raise ValueError(f"{source}: not Prometheus text exposition: {e}") from e
    if not any(f.name == name and f.type == "histogram" for f in families):
        raise KeyError(f"histogram {name!r} not in {source}")
    count = total = 0.0
    buckets: dict[float, float] = {}
    # Once another series interrupts a histogram's samples (vLLM's ``_created`` line between two
    # engines), prometheus_client returns the rest as "unknown" families named ``<name>_bucket``,
    # ``_count``, ``_sum``: read the samples by name, from every such family.
    for s in (s for f in families for s in f.samples):
        if s.name == name + "_count":
            count += s.value
        elif s.name == name + "_sum":
            total += s.value
        elif s.name == name + "_bucket":
            le = float(s.labels["le"])
            buckets[le] = buckets.get(le, 0.0) + s.value
    return HistogramTotals(count, total, tuple(sorted(buckets.items())))
