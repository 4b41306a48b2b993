"""Periodic /metrics scraper into the store's ``metric_samples`` table (docs/monitoring.md,
docs/schema/tables.md).

One thread GETs ``<base_url>/metrics`` of every endpoint each interval, parses it with
:func:`loadgen.prom.parse_samples` (no ``_created`` or ``_bucket`` series) and appends one row per
sample: ``(run_id, scraped_at UTC, endpoint, role, name, labels JSON, value)``. Values are stored
raw (per-pid copies and counters as exposed); readers apply :mod:`loadgen.prom`'s rules or the
``metric_increases`` view. A failing endpoint is logged (once per failure streak) and skipped.

Worker endpoints (every role but ``proxy``) are read version-aware: a metric vLLM renamed is stored
under its current name (:func:`loadgen.prom.resolve_names`: the current name when exposed, else
the deprecated one, never both), and the names read are stored in ``metric_sources`` (a metric
found under no name has a NULL source: missing, not 0) at the first scrape and whenever they
change. Each worker lifetime (``process_start_time_seconds``) gets an ``engine_info`` row with the
server's vLLM version (``GET /version``) and its speculative decoding settings
(:func:`loadgen.prom.spec_decode_settings`).
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import threading
import time
from collections.abc import Mapping, Sequence

import httpx

from core.contract import ENDPOINT_ROLES, Role
from loadgen.prom import Sample, parse_samples, resolve_names, spec_decode_settings
from store.writer import ShardWriter

log = logging.getLogger(__name__)

#: Seconds between final scrapes: counters read equal twice this far apart are settled (vLLM and
#: the proxy count a request within milliseconds of its end).
FINAL_SCRAPE_PAUSE_S = 0.25


#: Marks a version read by :meth:`MetricsScraper.start`, before any lifetime was seen.
_BEFORE_FIRST_SCRAPE = object()


def _get_version(client: httpx.Client, url: str) -> str | None:
    """vLLM's ``GET /version`` answer (``{"version": "0.32.0"}``), or None when the server does not
    answer it with that (not reachable, another server)."""
    try:
        resp = client.get(url + "/version")
        version = resp.json().get("version") if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return str(version) if version is not None else None


class MetricsScraper:
    """Scrapes endpoints every ``interval_s`` seconds on a background thread.

    Args:
        endpoints: ``(base_url, role)`` pairs, e.g. ``("http://127.0.0.1:8100", "prefill")``;
            role is one of prefill, decode, aggregated, proxy.
        writer: the run's ShardWriter (not closed by the scraper; the caller owns it).
        run_id: must equal ``writer.run_id``.
        interval_s: seconds between scrape starts (> 0); a round that overruns skips missed ticks.
        timeout_s: seconds allowed per GET (connect and read).
        headers: per base_url, the headers each GET of it carries (a worker's API key, where the
            deployment guards ``/metrics``); others get none.
        verify: httpx's TLS verification for ``https://`` endpoints (``serving.upstream_tls``).

    Raises:
        ValueError: bad role, run_id that is not the writer's, or non-positive interval/timeout.
    """

    def __init__(self, endpoints: Sequence[tuple[str, str]], writer: ShardWriter, run_id: str,
                 interval_s: float = 1.0, timeout_s: float = 2.0,
                 headers: Mapping[str, dict[str, str]] | None = None, verify: object = True):
        for i, (url, role) in enumerate(endpoints):
            if role not in ENDPOINT_ROLES:
                raise ValueError(f"endpoints[{i}] ({url}): role {role!r} is not one of {', '.join(ENDPOINT_ROLES)}")
        if run_id != writer.run_id:
            raise ValueError(f"run_id {run_id!r} differs from the writer's run_id {writer.run_id!r}")
        if not interval_s > 0 or not timeout_s > 0:
            raise ValueError(f"interval_s and timeout_s must be > 0 s, got {interval_s}, {timeout_s}")
        self.endpoints = [(url.rstrip("/"), role) for url, role in endpoints]
        self.headers = {url.rstrip("/"): h for url, h in (headers or {}).items()}
        self.verify = verify
        self.writer = writer
        self.run_id = run_id
        self.interval_s = float(interval_s)
        self.timeout_s = float(timeout_s)
        #: per base_url: successful and failed scrapes so far
        self.ok: dict[str, int] = {url: 0 for url, _ in self.endpoints}
        self.failed: dict[str, int] = {url: 0 for url, _ in self.endpoints}
        self._failing: set[str] = set()
        self._last_counters: dict[str, float] = {}  # per base_url: sum of *_total values, last scrape
        self._sources: dict[str, dict] = {}  # per base_url: the metric names last stored in metric_sources
        self._info: dict[str, tuple] = {}  # per base_url: (start, settings) of the last engine_info row
        self._versions: dict[str, tuple[object, str | None]] = {}  # per base_url: (start, GET /version)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._client: httpx.Client | None = None

    def _new_client(self) -> httpx.Client:
        return httpx.Client(timeout=self.timeout_s, verify=self.verify)

    def scrape_once(self) -> int:
        """Scrape every endpoint once now; returns the number of rows appended. Never raises for
        an endpoint's failure (connection, HTTP status, unparseable text): it is logged."""
        client = self._client or self._new_client()
        rows = 0
        try:
            for url, role in self.endpoints:
                rows += self._scrape(client, url, role)
        finally:
            if client is not self._client:
                client.close()
        return rows

    def _scrape(self, client: httpx.Client, url: str, role: str) -> int:
        scraped_at = dt.datetime.now(dt.UTC)
        try:
            resp = client.get(url + "/metrics", headers=self.headers.get(url))
            resp.raise_for_status()
            samples = parse_samples(resp.text, source=url + "/metrics")
        except (httpx.HTTPError, ValueError) as e:
            self.failed[url] += 1
            if url not in self._failing:
                self._failing.add(url)
                log.warning("scrape of %s/metrics (%s) failed, skipping until it recovers: %s", url, role, e)
            return 0
        if url in self._failing:
            self._failing.discard(url)
            log.info("scrape of %s/metrics (%s) recovered", url, role)
        self._last_counters[url] = math.fsum(s.value for s in samples if s.name.endswith("_total"))
        if role != Role.PROXY:
            samples = self._read_worker(client, url, role, scraped_at, samples)
        for s in samples:
            self.writer.append("metric_samples", {
                "run_id": self.run_id, "scraped_at": scraped_at, "endpoint": url, "role": role,
                "name": s.name, "labels": s.labels, "value": s.value,
            })
        self.ok[url] += 1
        return len(samples)

    def _read_worker(self, client: httpx.Client, url: str, role: str, scraped_at: dt.datetime,
                     samples: list[Sample]) -> list[Sample]:
        """A worker's scrape with renamed metrics under their current names; writes its
        ``metric_sources`` rows when the names changed and its ``engine_info`` row when the
        lifetime or its settings did. Returns the samples to store."""
        resolved = resolve_names(samples)
        base = {"run_id": self.run_id, "scraped_at": scraped_at, "endpoint": url, "role": role}
        if resolved.sources != self._sources.get(url):
            self._sources[url] = resolved.sources
            for metric, source in resolved.sources.items():
                self.writer.append("metric_sources", base | {"metric": metric, "source": source})
        start = next((s.value for s in samples if s.name == "process_start_time_seconds"), None)
        spec = spec_decode_settings(samples)
        info = (start, spec.enabled, spec.draft_tokens_per_draft)
        if info != self._info.get(url):
            self._info[url] = info
            self.writer.append("engine_info", base | {
                "process_start_s": start, "vllm_version": self._version(client, url, start),
                "spec_decode": spec.enabled, "spec_decode_draft_tokens": spec.draft_tokens_per_draft})
        return resolved.samples

    def _version(self, client: httpx.Client, url: str, start: float | None) -> str | None:
        """The server's version from vLLM's ``GET /version`` (``{"version": "0.32.0"}``), once per
        lifetime (a version read before the first scrape, by :meth:`start`, counts for the first
        lifetime); None when it does not answer that (another server, an old proxy)."""
        known = self._versions.get(url)
        if known is not None and (known[0] == start or (known[0] is _BEFORE_FIRST_SCRAPE and known[1] is not None)):
            self._versions[url] = (start, known[1])
            return known[1]
        self._versions[url] = (start, _get_version(client, url))
        return self._versions[url][1]

    def _loop(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            try:
                self.scrape_once()
            except Exception:  # e.g. the writer is closed; the thread must not die silently
                log.exception("metrics scrape round failed")
            next_at += self.interval_s
            now = time.monotonic()
            if next_at < now:  # overran: skip the missed ticks
                next_at = now + self.interval_s - (now - next_at) % self.interval_s
            self._stop.wait(next_at - now)

    def start(self) -> None:
        """Start the background thread (first scrape immediately). Raises RuntimeError if started."""
        if self._thread is not None:
            raise RuntimeError("MetricsScraper already started")
        self._client = self._new_client()
        for url, role in self.endpoints:  # off the first round's clock: rounds keep their interval
            if role != Role.PROXY:
                self._versions[url] = (_BEFORE_FIRST_SCRAPE, _get_version(self._client, url))
        self._thread = threading.Thread(target=self._loop, name="metrics-scraper", daemon=True)
        self._thread.start()

    def stop(self, final_settle_s: float = 0.0) -> None:
        """Stop the thread after its current round and close its HTTP client; idempotent.

        Args:
            final_settle_s: when > 0, after the thread stopped, take final scrapes (every
                ``interval_s``, at most ``final_settle_s`` seconds) until two consecutive rounds read
                the same counters on every endpoint, so that the run's last scrape comes after its
                last turn was counted by the workers and the proxy. The caller calls this once the
                run's last turn has finished (the client saw its end): a counter still moving then
                is that turn being accounted (the proxy counts after the stream's last byte). A
                run's counter increases then contain exactly its own turns (without it the last
                turn's pull fell into the next run's first sample).
        """
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if final_settle_s > 0:
            self.final_scrape(final_settle_s)
        if self._client is not None:
            self._client.close()
            self._client = None

    def final_scrape(self, settle_s: float) -> int:
        """Scrape every endpoint until two consecutive rounds read the same counter values (sum of
        the ``*_total`` series per endpoint), or ``settle_s`` seconds have passed; returns the
        rounds taken (at least 1). Each round's rows are stored like any scrape."""
        deadline = time.monotonic() + settle_s
        pause = min(self.interval_s, FINAL_SCRAPE_PAUSE_S)
        previous, rounds = None, 0
        while True:
            self._last_counters = {}
            self.scrape_once()
            rounds += 1
            current = dict(self._last_counters)
            if current == previous or time.monotonic() + pause > deadline:
                return rounds
            previous = current
            time.sleep(pause)
