"""The speed probe: a small fixed prefill sent at a run's start and end, so a forecast of the run
can be put on that run's machine speed from a measurement that is not the turns being forecast
(docs/planner/calibration.md).

One probe = one streamed ``/v1/completions`` request of :data:`PROBE_TOKENS` fixed token ids
(:func:`probe_ids`, the same every time), ``max_tokens`` 1, temperature 0, sent straight to the
run's prefill worker (P/D modes) or aggregated worker, with a ``cache_salt`` of its own so that
no prefix cache holds it (vLLM adds the salt to the first block's hash): every probe is a full
prefill of the same prompt; except the cached-prefix probe
(:data:`core.contract.CACHED_PROBE_TOKENS`), sent after each compute probe with its salt,
which finds the compute probe's blocks cached and computes only its last ``PROBE_TOKENS`` (on a
worker with its prefix cache on). After each round of those, the **path probe**
(:data:`core.contract.PATH_PROBE_TARGET`): the short probe's prompt with a salt of its own, sent
through the run's proxy as a turn goes, left after its first token (as a release turn is:
``serving.handle_check.release_turn``), so a bidirectional D frees its blocks at once instead of
pinning them for ``decoder_kv_blocks_ttl`` in the run's KV space. Its TTFT holds the fixed costs
of the turn's whole path (the proxy, D's frontend and the hand-off), on the run's machine and code.
A probe's TTFT is the time from sending to the first streamed token (``httpx_sse``). Probes are
sent before the run's metrics scraper starts and after it stops, so the run's counters do not
count them. Rows: the store's ``run_probes`` table (docs/schema/tables.md).
"""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Mapping, Sequence
from typing import Self

import httpx
from httpx_sse import SSEError, connect_sse

from core.contract import CACHED_PROBE_TOKENS, COMPUTE_PROBE_TOKENS, PATH_PROBE_TARGET, PROBE_TOKENS, Role
from serving.handle_check import RELEASE_MAX_TOKENS, proxy_client_disconnects, wait_disconnects_counted

#: The lengths sent at each phase, in this order, :data:`PROBES_PER_PHASE` times (the cached-prefix
#: probe right after the compute probe, whose blocks it finds).
PROBE_LENGTHS = (PROBE_TOKENS, COMPUTE_PROBE_TOKENS, CACHED_PROBE_TOKENS)
#: Seconds a probe may take before it is recorded as an error.
PROBE_TIMEOUT_S = 60.0
#: Probes sent back to back at each phase of a run: the run's factor is the median of its probes,
#: so one probe caught by a transient (15-25 ms on a 45 ms probe, measured: docs/log/calibration.md)
#: cannot move it.
PROBES_PER_PHASE = 3
#: Roles a probe goes to, in order of preference (the first a run's workers have).
PROBE_ROLES = (Role.PREFILL, Role.AGGREGATED)


def probe_ids(tokens: int = PROBE_TOKENS) -> list[int]:
    """The probe's prompt: ``tokens`` fixed token ids (10 + 7 i mod 1000: ordinary vocabulary ids
    of any tokenizer, no special tokens)."""
    return [10 + (7 * i) % 1000 for i in range(tokens)]


def probe_target(endpoints: Sequence[tuple[str, str]]) -> tuple[str, str] | None:
    """The (url, role) a probe goes to: the first ``prefill`` worker, else the first ``aggregated``
    one; None when the run has neither (e.g. an attached deployment seen only through its proxy)."""
    for role in PROBE_ROLES:
        for url, r in endpoints:
            if r == role:
                return url, r
    return None


def path_target(endpoints: Sequence[tuple[str, str]]) -> str | None:
    """The URL the path probe goes to: the run's proxy (role ``proxy``); None without one."""
    return next((url for url, role in endpoints if role == PATH_PROBE_TARGET), None)


def probe(url: str, model: str, salt: str, tokens: int = PROBE_TOKENS,
          timeout_s: float = PROBE_TIMEOUT_S, headers: dict[str, str] | None = None, verify: object = True,
          max_tokens: int = 1) -> dict:
    """Send one probe to ``url`` (a worker, or the proxy for the path probe; with its ``headers``: its
    API key; ``verify``: its TLS verification), asking for ``max_tokens`` tokens and leaving after the
    first; returns a ``run_probes`` row without ``run_id``/``phase``/``target``:
    sent_at, endpoint, prompt_tokens, ttft_s (None on error), status (``ok`` | ``error``), error.
    Never raises for a network or HTTP failure (the row says it)."""
    body = {"model": model, "prompt": probe_ids(tokens), "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "cache_salt": salt}
    row = {"sent_at": dt.datetime.now(dt.UTC), "endpoint": url, "prompt_tokens": tokens, "ttft_s": None,
           "status": "error", "error": None}
    t0 = time.perf_counter()
    try:
        with httpx.Client(timeout=timeout_s, headers=headers or {}, verify=verify) as client, \
                connect_sse(client, "POST", url + "/v1/completions", json=body) as source:
            source.response.raise_for_status()
            for event in source.iter_sse():
                if event.data == "[DONE]":
                    break
                choices = json.loads(event.data).get("choices") or []
                if any(c.get("text") or c.get("token_ids") for c in choices):
                    row |= {"ttft_s": time.perf_counter() - t0, "status": "ok"}
                    break
            else:
                row["error"] = "the stream ended without a token"
    except (httpx.HTTPError, SSEError, ValueError) as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"
    if row["status"] == "error" and row["error"] is None:
        row["error"] = "no token before [DONE]"
    return row


def probe_run(writer, run_id: str, phase: str, endpoints: Sequence[tuple[str, str]], model: str,
              probes: int = PROBES_PER_PHASE, headers: Mapping[str, dict[str, str]] | None = None,
              verify: object = True, lengths: Sequence[int] = PROBE_LENGTHS) -> list[dict]:
    """Probe the run's target worker (:func:`probe_target`) ``probes`` times back to back, each time
    one probe of each of ``lengths`` (prompt tokens: the short probe, the compute probe, then the
    cached-prefix probe with the compute probe's salt), each other with a salt of its own, then the
    path probe through the run's proxy (:func:`path_target`, when ``endpoints`` has one and
    ``lengths`` the short probe; target :data:`core.contract.PATH_PROBE_TARGET`, salt ``...-path``,
    left after its first token); append one ``run_probes`` row per probe (``phase``: ``start`` |
    ``end``) with ``writer`` (a store writer of the run); returns the rows (none when the run has no
    worker to probe). Before returning it waits (at most ``serving.handle_check.RELEASE_SETTLE_S``)
    until turnscope's proxy has counted the path probes' disconnects, so they end before the run's
    first scrape. ``headers``: per base URL, what a request to it carries (its API key, the
    proxy's client key); ``verify``: TLS verification."""
    target = probe_target(endpoints)
    if target is None:
        return []
    url, role = target
    proxy = path_target(endpoints) if PROBE_TOKENS in lengths else None
    rows = []

    def send(k: int, tokens: int, at: str, as_role: str, salt_end: str, max_tokens: int = 1) -> dict:
        row = {"run_id": run_id, "phase": phase, "target": as_role} | probe(
            at, model, salt=f"turnscope-probe-{run_id}-{phase}-{k}{salt_end}", tokens=tokens,
            headers=(headers or {}).get(at), verify=verify, max_tokens=max_tokens)
        writer.append("run_probes", row)
        rows.append(row)
        return row

    with httpx.Client(timeout=5, headers=(headers or {}).get(proxy) or {}, verify=verify) as client:
        before = proxy_client_disconnects(client, proxy) if proxy else None
        left = 0
        for k in range(probes):
            for tokens in lengths:
                same = COMPUTE_PROBE_TOKENS if tokens == CACHED_PROBE_TOKENS else tokens   # the compute probe's blocks
                send(k, tokens, url, role, "" if same == PROBE_TOKENS else f"-{same}")
            if proxy:
                left += send(k, PROBE_TOKENS, proxy, PATH_PROBE_TARGET, "-path", RELEASE_MAX_TOKENS)["status"] == "ok"
        wait_disconnects_counted(client, proxy, before, left)   # no proxy: before is None, nothing to wait for
    return rows


def serve_probe_id(now: dt.datetime | None = None) -> str:
    """The run id of a ``turnscope serve``'s own probes: ``serve-probes-<UTC %Y%m%dT%H%M%SZ>-<6 hex>``
    (no ``runs`` row: :func:`store.queries.planner_runs.probe_ttft_s` gives them to the runs recorded
    through that serve, between its start and its stop)."""
    import uuid

    return f"serve-probes-{(now or dt.datetime.now(dt.UTC)):%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:6]}"


class ServeProbes:
    """The speed probes of a ``turnscope serve``: :func:`probe_run` (phase ``start``) once the workers
    are up, and again (phase ``end``) when it stops, under :func:`serve_probe_id`'s id in ``store``
    (a :class:`store.writer.Store`). A Locust run recorded through the serve has no probes of its
    own; the planner puts it on the speed these give (``store.queries.planner_runs``). Costs about what an
    eval's probes cost, at each end (docs/planner/calibration.md)."""

    def __init__(self, store, endpoints: Sequence[tuple[str, str]], model: str,
                 headers: Mapping[str, dict[str, str]] | None = None, verify: object = True,
                 run_id: str | None = None):
        self.store, self.endpoints, self.model = store, list(endpoints), model
        self.headers, self.verify = headers, verify
        self.run_id = run_id or serve_probe_id()
        self.rows: list[dict] = []

    def _probe(self, phase: str) -> None:
        with self.store.writer(self.run_id, f"probes-{phase}") as w:
            self.rows += probe_run(w, self.run_id, phase, self.endpoints, self.model, headers=self.headers,
                                   verify=self.verify)

    def __enter__(self) -> Self:
        self._probe("start")
        return self

    def __exit__(self, *exc) -> None:
        self._probe("end")

