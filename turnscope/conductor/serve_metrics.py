"""`turnscope serve`'s workers' metrics in the store: under each run recorded through its proxy, and
between runs under the serve's own id.

`turnscope serve` starts one mode's workers and the proxy; Locust (the README's tour) records the
run, its ``runs`` row and its turns, but scrapes nothing. `ServeMetrics` watches the store's
``runs`` for a run that is recording (status ``running``) through this serve's proxy (its
``config.host``, Locust's ``--host``, names the proxy's address) and, while there is one, scrapes
every endpoint of the stack (``ModeStack.endpoints``: the workers and the proxy) into that run's
``metric_samples`` with `loadgen.scraper.MetricsScraper`, as ``turnscope eval`` does for its own
runs. So the Memory page of such a run has D's KV usage and the proxy's live handle bytes. When the
run ends, its scraper takes the final scrapes until the counters settle (the run's increases then
hold its last turn) and stops. While no run is recording, the same endpoints are scraped under the
serve's own id (`serve_id`: ``serve-<UTC time>-<hex>``), which has no ``runs`` row: its samples are
there for SQL (``select * from metric_samples where run_id like 'serve-%'``), and nothing is lost
between runs.

A run is found at the first look after its ``running`` row lands: the store's ``runs_log`` folders
are checked every `interval_s` (one ``stat`` per run), the ``runs`` view is read only when one of
them changed. So up to about `interval_s` of a run's start is scraped under the serve's id. Two
runs recording through the proxy at once are each scraped (the same samples under both ids).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Self
from urllib.parse import urlsplit

import duckdb

from loadgen.scraper import MetricsScraper
from store.queries.serve_runs import recording_hosts
from store.writer import ShardWriter, Store

log = logging.getLogger(__name__)

#: Seconds of final scrapes at most when a run ends (as `turnscope eval` settles its runs' counters).
FINAL_SETTLE_S = 5.0
#: Seconds after which the runs are read again while one is scraped, though no run row changed: a
#: Locust killed outright writes no last row, and its run reads ``aborted`` three heartbeats on.
REREAD_S = 30.0
#: Host names that all mean this machine's loopback.
_LOOPBACK = {"127.0.0.1", "localhost", "::1", "0.0.0.0", "::"}


def serve_id(now: dt.datetime | None = None) -> str:
    """A new id for a serve's own scrapes: ``serve-<UTC %Y%m%dT%H%M%SZ>-<6 hex>`` (a valid run id)."""
    return f"serve-{(now or dt.datetime.now(dt.UTC)):%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:6]}"


def _address(url: str) -> tuple[str, int | None]:
    """(host, port) of `url`, the loopback's names as one; ('', None) for a URL without a host."""
    try:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        host, port = (parts.hostname or "").lower(), parts.port
    except ValueError:
        return "", None
    if port is None:
        port = {"http": 80, "https": 443}.get(parts.scheme)
    return ("127.0.0.1" if host in _LOOPBACK else host), port


def same_server(a: str, b: str) -> bool:
    """Whether URLs `a` and `b` name one server (host and port; ``localhost`` is ``127.0.0.1``)."""
    host, port = _address(a)
    return bool(host) and (host, port) == _address(b)


class ServeMetrics:
    """Scrapes a serving stack into `store` for as long as it runs (the module's docstring).

    Args:
        store: the store Locust records into (``--turnscope-store``; `turnscope serve --store`).
        endpoints: ``(base_url, role)`` of the workers and the proxy (``ModeStack.endpoints()``).
        proxy_url: the proxy's URL, which a run's ``config.host`` names when it ran through it.
        interval_s: seconds between scrapes, and between looks at the store for runs (> 0).
        headers, verify: per endpoint headers (API keys) and TLS verification, as `MetricsScraper` takes.
        own_id: the id of the scrapes between runs (default: `serve_id()`).

    Raises ValueError for a non-positive interval or a role `MetricsScraper` refuses.
    """

    def __init__(self, store: Store, endpoints: Sequence[tuple[str, str]], proxy_url: str, interval_s: float = 1.0,
                 headers: Mapping[str, dict[str, str]] | None = None, verify: object = True,
                 own_id: str | None = None):
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0 s, got {interval_s}")
        self.store, self.endpoints, self.proxy_url = store, list(endpoints), proxy_url
        self.interval_s, self.headers, self.verify = float(interval_s), headers, verify
        self.own_id = own_id or serve_id()
        self._writers: dict[str, ShardWriter] = {}
        self._scrapers: dict[str, MetricsScraper] = {}  # run id (or own_id) -> its running scraper
        self._marks: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: the runs scraped so far, in the order they were found
        self.runs_seen: list[str] = []

    # -- what is recording -------------------------------------------------------------------------
    def _runs_log_marks(self) -> dict[str, int]:
        """Per run folder, the modification time (ns) of its ``runs_log`` shard folder."""
        marks: dict[str, int] = {}
        try:
            with os.scandir(self.store.root / "runs") as it:
                for e in it:
                    try:
                        marks[e.name] = os.stat(os.path.join(e.path, "runs_log")).st_mtime_ns
                    except OSError:
                        continue
        except OSError:
            pass
        return marks

    def recording(self) -> list[str]:
        """The ids of the runs recording (``runs.status = 'running'``) through this serve's proxy."""
        try:
            con = self.store.connect()
        except (duckdb.Error, OSError) as exc:
            log.warning("serve metrics: cannot read the store's runs (%s); scraping under %s", exc, self.own_id)
            return []
        try:
            rows = recording_hosts(con).itertuples(index=False)
        except duckdb.Error as exc:
            log.warning("serve metrics: cannot read the store's runs (%s); scraping under %s", exc, self.own_id)
            return []
        finally:
            con.close()
        return sorted(run_id for run_id, host in rows if isinstance(host, str) and same_server(host, self.proxy_url))

    # -- scrapers ----------------------------------------------------------------------------------
    def _start(self, run_id: str) -> None:
        writer = self._writers.get(run_id) or self.store.writer(run_id, f"serve-scraper-{os.getpid()}")
        self._writers[run_id] = writer
        scraper = MetricsScraper(self.endpoints, writer, run_id, interval_s=self.interval_s,
                                 headers=self.headers, verify=self.verify)
        scraper.start()
        self._scrapers[run_id] = scraper

    def _end(self, run_id: str, settle_s: float) -> None:
        scraper = self._scrapers.pop(run_id, None)
        if scraper is not None:
            scraper.stop(final_settle_s=settle_s)
        if run_id != self.own_id and (writer := self._writers.pop(run_id, None)) is not None:
            writer.close()

    def _switch(self, runs: list[str]) -> None:
        """Scrape exactly `runs` (or, when empty, the serve's own id)."""
        want = set(runs) or {self.own_id}
        for run_id in [r for r in self._scrapers if r not in want]:
            # a run that ended: settle its counters (its last turn counted) before the next id starts
            self._end(run_id, FINAL_SETTLE_S if run_id != self.own_id else 0.0)
        for run_id in sorted(want - set(self._scrapers)):
            if run_id != self.own_id:
                self.runs_seen.append(run_id)
                log.info("serve metrics: scraping run %s", run_id)
            self._start(run_id)

    def _loop(self) -> None:
        runs: list[str] = []
        read_at = float("-inf")
        while not self._stop.is_set():
            try:
                marks = self._runs_log_marks()
                if marks != self._marks or (runs and time.monotonic() - read_at > REREAD_S):
                    self._marks, read_at = marks, time.monotonic()
                    runs = self.recording()
                self._switch(runs)
            except Exception:  # the serve goes on; its scrapes are not worth its workers
                log.exception("serve metrics: a round failed")
            self._stop.wait(self.interval_s)

    def start(self) -> None:
        """Start scraping (a background thread). Raises RuntimeError if started."""
        if self._thread is not None:
            raise RuntimeError("ServeMetrics already started")
        self._thread = threading.Thread(target=self._loop, name="serve-metrics", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop every scraper (a run still recording gets its final scrapes) and close the writers;
        idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        for run_id in list(self._scrapers):
            self._end(run_id, FINAL_SETTLE_S if run_id != self.own_id else 0.0)
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
