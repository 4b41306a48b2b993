"""How the proxy sees a decode worker (D) restart: the lifetime of each D engine.

A handle names blocks of one D *engine*: vLLM gives every launch a new ``engine_id`` (a uuid4
unless configured, ``KVTransferConfig`` in ``vllm/config/kv_transfer.py``) and P's NIXL handshake
refuses a peer whose engine id is not the one the handle names ("Remote NIXL agent engine ID
mismatch", ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py``). So once D has
restarted, every handle it issued before is stale: its blocks are gone and it can never be pulled.

Two signs of a new lifetime, whichever comes first:

* D's ``process_start_time_seconds`` on its ``/metrics`` changed (:meth:`DecodeLifetimes.probe`,
  polled by the proxy every ``decode_probe_interval_s``); the text is read with prometheus_client's
  parser, stopping at that family (it comes first, from the process collector);
* a handle returned by D names another ``remote_engine_id`` than D's earlier handles
  (:meth:`DecodeLifetimes.saw_engine_id`).

A probe that fails (D down, restarting) changes nothing: a restart is only declared on a new value.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger("turnscope.proxy")

START_METRIC = "process_start_time_seconds"


def process_start_s(text: str) -> float | None:
    """``process_start_time_seconds`` (Unix s) from /metrics text, or None when absent or the
    text does not parse up to it."""
    try:
        for family in text_string_to_metric_families(text):
            if family.name == START_METRIC and family.samples:
                return float(family.samples[0].value)
    except (ValueError, TypeError, IndexError, KeyError):
        return None
    return None


@dataclass
class _Lifetime:
    start_s: float | None = None
    engine_id: str | None = None


class DecodeLifetimes:
    """The current lifetime of each decode worker, by worker name.

    Args:
        on_restart: called with ``(worker name, new engine id or None)`` when a worker is seen in
            a new lifetime (the proxy drops that worker's older handles).
    """

    def __init__(self, on_restart: Callable[[str, str | None], None]):
        self._on_restart = on_restart
        self._lifetimes: dict[str, _Lifetime] = {}

    def _get(self, worker: str) -> _Lifetime:
        return self._lifetimes.setdefault(worker, _Lifetime())

    def saw_start(self, worker: str, start_s: float) -> bool:
        """Record ``worker``'s process start (Unix s); True (and ``on_restart``) when it changed."""
        life = self._get(worker)
        previous, life.start_s = life.start_s, start_s
        if previous is None or previous == start_s:
            return False
        life.engine_id = None  # the new engine's id is learnt from its first handle
        log.warning("decode worker %s restarted (process start %.3f -> %.3f): dropping its handles",
                    worker, previous, start_s)
        self._on_restart(worker, None)
        return True

    def saw_engine_id(self, worker: str, engine_id: str | None) -> bool:
        """Record the ``remote_engine_id`` of a handle ``worker`` returned; True (and
        ``on_restart``) when it differs from the one its earlier handles named."""
        if not engine_id:
            return False
        life = self._get(worker)
        previous, life.engine_id = life.engine_id, engine_id
        if previous is None or previous == engine_id:
            return False
        log.warning("decode worker %s answers as engine %s, was %s: dropping its older handles",
                    worker, engine_id, previous)
        self._on_restart(worker, engine_id)
        return True

    async def probe(self, client: httpx.AsyncClient, worker: str, url: str, timeout_s: float,
                    headers: dict[str, str] | None = None) -> bool:
        """GET ``url``/metrics (with the worker's ``headers``: its API key) and record its process
        start; True when that shows a restart. A failed probe (connection, HTTP status, no such
        metric) records nothing."""
        try:
            r = await client.get(url.rstrip("/") + "/metrics", timeout=timeout_s, headers=headers)
        except httpx.HTTPError:
            return False
        start = process_start_s(r.text) if r.status_code == 200 else None
        return False if start is None else self.saw_start(worker, start)
