"""Reading Prometheus /metrics text the way vLLM exposes it (pure functions, no I/O).

Parsing is prometheus_client's (``prometheus_client.parser``). On top of it, the rules that a
naive reader gets wrong on vLLM's output (cases in ``tests/cases/prometheus/``):

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
- Renamed metrics (:data:`RENAMED_METRICS`, :func:`resolve_names`; handed cases
  ``renamed_metrics_old_names``, ``renamed_metrics_both_names``): a metric vLLM renamed is read
  under its current name, else under its deprecated one, never both added; which name was read is
  reported, and a metric found under neither is missing (None), never 0.
- Inter-token latency per output event (:func:`itl_reading`; handed case ``itl_per_output_event``):
  ``vllm:inter_token_latency_seconds`` observes one value per streamed output *event*, which holds
  several tokens under speculative decoding, so it is reported per event with tokens per event
  beside it, and per token only divided by that.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

_CUMULATIVE_TYPES = {"counter", "histogram", "summary", "gaugehistogram"}


@dataclass(frozen=True)
class RenamedMetric:
    """A metric turnscope reads that vLLM renamed: its ``current`` family name and its
    ``deprecated`` ones (newest first), and its ``kind`` (gauge, counter or histogram), which says
    which exposed series belong to a family (a counter's ``<name>_total``, a histogram's
    ``<name>_count`` and ``<name>_sum``)."""

    current: str
    deprecated: tuple[str, ...]
    kind: str

    @property
    def series(self) -> str:
        """The name the store and the reports use for it: the counter's ``_total`` series, the
        family name otherwise (e.g. ``vllm:prefix_cache_queries_total``)."""
        return self.current + "_total" if self.kind == "counter" else self.current


#: The renamed metrics turnscope reads, current name first. Current names: vLLM 0.32's
#: ``vllm/v1/metrics/loggers.py`` (``vllm:kv_cache_usage_perc``, ``vllm:prefix_cache_queries``,
#: ``vllm:prefix_cache_hits``, ``vllm:inter_token_latency_seconds``); the deprecated ones are those
#: earlier V1 loggers registered beside them with help text ending "DEPRECATED: Use <current>
#: instead." (v0.9.2 to v0.10 expose both, v0.11 the old ones only with
#: ``--show-hidden-metrics-for-version=0.10``, per vLLM's deprecation policy in
#: ``vllm/config/observability.py``: ``show_hidden_metrics_for_version``; v0.12 on only the
#: current ones). 0.32's source no longer names them; the handed cases record both generations.
RENAMED_METRICS: tuple[RenamedMetric, ...] = (
    RenamedMetric("vllm:kv_cache_usage_perc", ("vllm:gpu_cache_usage_perc",), "gauge"),
    RenamedMetric("vllm:prefix_cache_queries", ("vllm:gpu_prefix_cache_queries",), "counter"),
    RenamedMetric("vllm:prefix_cache_hits", ("vllm:gpu_prefix_cache_hits",), "counter"),
    RenamedMetric("vllm:inter_token_latency_seconds", ("vllm:time_per_output_token_seconds",), "histogram"),
)


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


def _family_series(family: str, kind: str) -> set[str]:
    """The exposed sample names of a family of ``kind`` (buckets are never stored)."""
    return {"counter": {family + "_total"}, "histogram": {family + "_count", family + "_sum"}}.get(kind, {family})


@dataclass(frozen=True)
class ResolvedNames:
    """One scrape with renamed metrics read under their current names.

    ``samples``: every sample of the scrape, a deprecated family renamed to its current name when
    the current one is absent and dropped when it is present (the two are one measurement).
    ``sources``: per :attr:`RenamedMetric.series`, the family name the values came from, or None
    when the scrape has the metric under none of its names (missing, not 0)."""

    samples: list[Sample]
    sources: dict[str, str | None]

    @property
    def missing(self) -> list[str]:
        """The metrics found under no name, by their current series name, in table order."""
        return [name for name, source in self.sources.items() if source is None]


def resolve_names(samples: Sequence[Sample], metrics: Sequence[RenamedMetric] = RENAMED_METRICS) -> ResolvedNames:
    """Read each metric of ``metrics`` under its current name, else its deprecated names.

    Rule (handed cases ``renamed_metrics_old_names`` and ``renamed_metrics_both_names``): the
    current name wins whenever the scrape has it; otherwise the first deprecated name present is
    renamed to the current one (labels and values unchanged); the other names of the metric are
    dropped, never added to it (a transitional server exposes one value twice). Samples of other
    metrics pass unchanged.

    Returns:
        :class:`ResolvedNames`: the samples in exposition order, and the name used per metric.
    """
    names = {s.name for s in samples}
    rename: dict[str, str] = {}
    drop: set[str] = set()
    sources: dict[str, str | None] = {}
    for m in metrics:
        families = (m.current, *m.deprecated)
        present = [f for f in families if _family_series(f, m.kind) & names]
        sources[m.series] = present[0] if present else None
        for f in present[1:]:
            drop |= _family_series(f, m.kind)
        if present and present[0] != m.current:
            suffix = {"counter": ("_total",), "histogram": ("_count", "_sum")}.get(m.kind, ("",))
            rename |= {present[0] + x: m.current + x for x in suffix}
    out = [Sample(rename.get(s.name, s.name), s.labels, s.value) for s in samples if s.name not in drop]
    return ResolvedNames(out, sources)


@dataclass(frozen=True)
class ItlReading:
    """Server-side inter-token latency of a decode worker over some interval (seconds, counts).

    ``per_event_s``: mean of ``vllm:inter_token_latency_seconds``, one observation per streamed
    output event (vllm#52853: an event holds several tokens under speculative decoding).
    ``tokens_per_event``: decode tokens per event, ``(generation tokens - finished requests) /
    events`` (each request's first token comes from its prefill, vllm#55283's TPOT design:
    ``decode_time / (num_generation_tokens - 1)``); None without events.
    ``per_token_s``: ``per_event_s / tokens_per_event``, comparable with TPOT.
    ``tpot_s``: mean of ``vllm:request_time_per_output_token_seconds`` (one per request), None
    where the scrape has no such histogram. ``source``: the ITL family read (:func:`resolve_names`).
    """

    events: float
    per_event_s: float | None
    tokens_per_event: float | None
    per_token_s: float | None
    tpot_s: float | None
    source: str | None


def _sum_named(samples: Sequence[Sample], name: str) -> float | None:
    found = [s.value for s in samples if s.name == name]
    return math.fsum(found) if found else None


def itl_reading(samples: Sequence[Sample]) -> ItlReading:
    """The inter-token latency of one scrape (cumulative since the engine started), per output
    event and per token, after :func:`resolve_names` (so an old server's
    ``vllm:time_per_output_token_seconds`` is read too). Sums over engines and labels.

    Raises:
        KeyError: the scrape has the ITL histogram under none of its names.
    """
    resolved = resolve_names(samples)
    itl = "vllm:inter_token_latency_seconds"
    source = resolved.sources[itl]
    if source is None:
        raise KeyError(f"histogram {itl!r} (or its deprecated names) not in the scrape")
    s = resolved.samples
    events, total = _sum_named(s, itl + "_count") or 0.0, _sum_named(s, itl + "_sum") or 0.0
    per_event = total / events if events else None
    generated = _sum_named(s, "vllm:generation_tokens_total")
    requests = _sum_named(s, "vllm:request_success_total")
    tokens_per_event = ((generated - requests) / events
                        if events and generated is not None and requests is not None else None)
    per_token = per_event / tokens_per_event if per_event is not None and tokens_per_event else None
    tpot_n = _sum_named(s, "vllm:request_time_per_output_token_seconds_count")
    tpot = _sum_named(s, "vllm:request_time_per_output_token_seconds_sum") / tpot_n if tpot_n else None
    return ItlReading(events, per_event, tokens_per_event, per_token, tpot, source)


@dataclass(frozen=True)
class SpecDecodeSettings:
    """What a scrape says of a worker's speculative decoding. ``enabled``: vLLM registers its
    ``vllm:spec_decode_*`` counters only with a speculative config (``SpecDecodingProm`` in
    ``vllm/v1/spec_decode/metrics.py``). ``draft_tokens_per_draft``: the draft length, from the
    positions of ``vllm:spec_decode_num_accepted_tokens_per_pos`` (one per speculative token),
    else draft tokens / drafts; None before the first draft. ``mean_acceptance_length``: tokens per
    decode step, ``1 + accepted / drafts`` (vLLM's own spec-decode logger); None without drafts."""

    enabled: bool
    draft_tokens_per_draft: float | None
    mean_acceptance_length: float | None


def spec_decode_settings(samples: Sequence[Sample]) -> SpecDecodeSettings:
    """:class:`SpecDecodeSettings` of one scrape (summed over engines)."""
    drafts = _sum_named(samples, "vllm:spec_decode_num_drafts_total")
    if drafts is None:
        return SpecDecodeSettings(False, None, None)
    positions = {s.labels.get("position") for s in samples
                 if s.name == "vllm:spec_decode_num_accepted_tokens_per_pos_total"}
    draft_tokens = _sum_named(samples, "vllm:spec_decode_num_draft_tokens_total")
    accepted = _sum_named(samples, "vllm:spec_decode_num_accepted_tokens_total")
    per_draft = (float(len(positions)) if positions
                 else draft_tokens / drafts if drafts and draft_tokens is not None else None)
    acceptance = 1 + accepted / drafts if drafts and accepted is not None else None
    return SpecDecodeSettings(True, per_draft, acceptance)
