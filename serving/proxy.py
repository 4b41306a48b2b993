"""The session-aware P/D proxy: decides per request whether a session's KV comes back from the
decode worker, and reports what happened in the response (docs/design.md follows one turn).

:class:`SessionProxy` holds the handle table, the metrics, the HTTP client and the routing; one
generate request (``/v1/chat/completions`` or ``/v1/completions``) goes through its methods:

1. :meth:`~SessionProxy.admit`: the session key is the body field ``conversation_id`` (popped) or
   the ``X-Session-ID`` header (:mod:`core.contract`). Client-supplied
   ``kv_transfer_params`` (top level, or inside ``vllm_xargs``) are dropped: they could read
   another session's blocks. P and D are picked by the configured policies (``serving.routing``).
2. :meth:`~SessionProxy.match_handle`: under the session's lock the handle is popped (single use).
   If there is one, the request's rendered ids (the prefill worker's ``/tokenize``, or the prompt
   ids themselves) are compared with the ids D holds KV for, and the handle is trimmed to whole
   blocks before any divergence (``serving.handles.fit_handle``); with no whole block left the
   outcome is ``miss_mismatch``.
3. :meth:`~SessionProxy.prefill_leg`: P gets the request with ``max_tokens=1``, ``stream=false``
   and ``kv_transfer_params={do_remote_decode: true, ...}`` plus D's handle when there is one. A
   leg that fails or passes its timeout while carrying a handle is retried once without it (a
   plain recompute) and the outcome is ``miss_transfer_failed``. :meth:`~SessionProxy.account_prefill`
   reads P's answer into the request's facts (:func:`classify_prefill`).
4. :meth:`~SessionProxy.decode_leg`: D gets the request with P's returned params, streamed to the
   client (:meth:`~SessionProxy.relay_stream`). The final chunk's ``kv_transfer_params`` (D's
   handle for the next turn) is kept in the table (:meth:`~SessionProxy.finish_request`) and
   replaced, on the wire, by a ``turnscope`` field with this request's public facts.

A decode worker's handles live no longer than its engine: the proxy polls each D's
``process_start_time_seconds`` every ``decode_probe_interval_s`` and watches the engine id of the
handles D returns (``serving.decode_lifetimes``); when either changes, D restarted and every handle
it issued before is dropped, so the sessions' next turns read ``miss_decode_restarted``.

The facts (:class:`serving.proxy_request.RequestFacts`) render the headers known before the stream
(``x-request-id``, ``x-turnscope-reuse``, ``x-turnscope-prefill-ms``, ``x-turnscope-prefill-engine``,
``x-turnscope-decode-engine``) and the final chunk's ``turnscope`` field (token counts). One JSON
log line per request is written to the ``turnscope.proxy`` logger for clients that are not
turnscope's. The facts of the last few thousand requests stay readable by request id
(``GET /v1/turnscope/requests/{request_id}``, ``serving.recent_requests``): a client that left
before they reached it (a load generator stopping) asks there. The route functions of :func:`create_app` only delegate to the proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager

import httpx
import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from httpx_sse import aconnect_sse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field

from core import reuse_rules as rules
from core.contract import (
    DECODE_WORKER_HEADER,
    FACTS_FIELD,
    REQUEST_FACTS_ROUTE,
    REQUEST_ID_HEADER,
    SESSION,
    SESSION_FIELD,
    SESSION_HEADER,
    RoutingPolicy,
    error_body_text,
)
from core.modes import AGGREGATED
from core.tokenize_client import TokenizeError, render_request, tokenize_async
from serving import handles as h
from serving import prefill_split_patch
from serving.api_keys import SecretRef, bearer, resolve_optional
from serving.canary import CanaryReport, canary_max_tokens, run_canary
from serving.client_disconnect import run_until_client_gone
from serving.decode_lifetimes import DecodeLifetimes
from serving.prefix_index import DEFAULT_CAPACITY_BLOCKS, BlockChains, PrefixIndex
from serving.prompt_render import IncrementalRenderer
from serving.proxy_metrics import ProxyMetrics
from serving.proxy_request import (
    CLIENT_DISCONNECTED,
    PHASE_BEFORE_FIRST_TOKEN,
    PHASE_STREAMING,
    ProxiedRequest,
    RequestFacts,
)
from serving.recent_requests import DEFAULT_CAPACITY as RECENT_REQUESTS_DEFAULT
from serving.recent_requests import RecentRequests
from serving.routing import Router
from serving.upstream_tls import UpstreamTLS

log = logging.getLogger("turnscope.proxy")

# What P gets on every prefill leg (vLLM's reference P/D proxies send the same).
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
HANDLE_KEYS = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host", "remote_port",
               "remote_num_tokens", "remote_blocks_expiry_time", "tp_size", "dcp_size", "pp_size",
               "transfer_mode")

#: First item of :meth:`SessionProxy.relay_stream` when D answered 200: tells the caller to send the
#: headers. A sentinel, never written to the client.
STREAM_OPEN = object()


class Worker(BaseModel):
    """One vLLM worker the proxy routes to: a name (used in facts and logs), its base URL, and where
    its role's API key is read from (``serving.api_keys``; None: the worker demands none)."""

    name: str
    url: str
    api_key: SecretRef | None = None


class ProxyConfig(BaseModel):
    """Everything the proxy needs; times in seconds, sizes in tokens.

    ``handle_ttl_margin_s`` is subtracted from ``decoder_kv_blocks_ttl_s`` to get the proxy TTL
    (vLLM's reference multi-turn proxy keeps 450 s against D's 480 s; P itself also declines a
    read within 5 s of D's deadline, ``_KV_BLOCKS_EXPIRY_SAFETY_MARGIN`` in ``pull_worker.py``).
    ``block_size`` is the KV block size of the workers (128 on vLLM's CPU backend).
    ``tokenizer_dir``: the served model's directory; when set (and it holds a fast tokenizer with
    a chat template) the token guard renders chat requests in-process, incrementally per session
    (``serving.prompt_render``); None: every guard render goes through P's ``/tokenize``.
    ``prefill_routing`` / ``decode_routing``: how P and D are picked (``serving.routing``:
    ``round-robin``, ``session``, ``prefix-aware``; docs/configuration.md).
    ``prefill_cache_blocks``: KV blocks of each P's prefix cache the proxy's prefix index keeps
    (``serving.prefix_index``; default the embedded topology's P, 1,024 blocks of 128 tokens).
    ``decode_probe_interval_s``: how often the proxy reads each D's ``process_start_time_seconds``
    to see a restart (``serving.decode_lifetimes``); 0: only from the engine id of D's handles.
    ``api_key``: where the key the proxy demands of its clients is read from (None: it demands none;
    ``/health`` and ``/metrics`` stay open, as vLLM's do). ``tls``: how ``https://`` workers'
    certificates are verified (``serving.upstream_tls``).
    ``canary_reference``: the worker ``POST /canary`` compares the serving path with
    (``serving.canary``; None: the first prefill worker, P alone, or the aggregated one).
    ``recent_requests``: requests whose facts the look-up route keeps (``serving.recent_requests``).
    """

    mode: str
    prefill: list[Worker] = Field(default_factory=list)
    decode: list[Worker] = Field(default_factory=list)
    aggregated: list[Worker] = Field(default_factory=list)
    decoder_kv_blocks_ttl_s: float = 480.0
    handle_ttl_margin_s: float = 30.0
    kv_recompute_threshold: int = 64
    block_size: int = 128
    prefill_prefix_caching: bool = True
    prefill_timeout_s: float = 30.0
    decode_timeout_s: float = 300.0
    kv_bytes_per_token: int | None = None
    max_sessions: int = 100_000
    tokenizer_dir: str | None = None
    prefill_cache_blocks: int = Field(DEFAULT_CAPACITY_BLOCKS, gt=0)
    prefill_routing: RoutingPolicy = SESSION
    decode_routing: RoutingPolicy = SESSION
    decode_probe_interval_s: float = Field(1.0, ge=0)
    api_key: SecretRef | None = None
    tls: UpstreamTLS = Field(default_factory=UpstreamTLS)
    canary_reference: Worker | None = None
    recent_requests: int = Field(RECENT_REQUESTS_DEFAULT, gt=0)


#: Paths the proxy serves without its API key: the health check and Prometheus' scrape (vLLM guards
#: only ``/v1`` and a few other prefixes, ``vllm/entrypoints/serve/middleware/authenticate.py``).
OPEN_PATHS = ("/health", "/metrics")


def classify_prefill(offered: int, prompt_len: int, cached: int | None, local_estimate: int,
                     threshold: int) -> tuple[str, int]:
    """Decide, from P's report, whether P pulled the offered KV. Returns ``(outcome, reused_tokens)``.

    ``offered`` is the handle's usable tokens, ``prompt_len`` P's prompt length, ``cached`` P's
    ``remote_prefill_cached_tokens`` (local prefix hits + tokens pulled; vLLM ``PrefillStats``),
    ``local_estimate`` the tokens of this prompt P can have in its own prefix cache (from any
    session: ``serving.prefix_index``). vLLM's rule
    (``nixl/pull_scheduler.py: get_num_new_matched_tokens``): P pulls
    ``min(offered, prompt_len) - local_hit`` tokens unless that count is below
    ``kv_recompute_threshold``. So a report reaching ``min(offered, prompt_len)`` (one token of
    slack: the scheduler may recompute the last one) is a pull (``hit``); a report above it, or an
    estimate covering it, is P's own prefix cache (``miss_below_threshold``, nothing pulled); a
    shortfall below the threshold is ``miss_below_threshold``; a larger shortfall means the pull
    failed or was declined (``miss_transfer_failed``). ``local_estimate`` must be taken when the
    request arrives: a concurrent request of the same session may warm P's cache meanwhile.
    """
    reachable = rules.reachable_tokens(offered, prompt_len)
    if cached is None:
        return h.MISS_TRANSFER_FAILED, 0
    # P's own cache already covers the handle: nothing to pull. A pull makes P's report exactly
    # `reachable` (local hit + pulled), so a report above it is a local hit alone, e.g. one warmed
    # by a concurrent request of the same session after the estimate was taken.
    if reachable - local_estimate <= 0 or cached > reachable:
        return h.MISS_BELOW_THRESHOLD, 0
    if cached >= reachable - 1:
        return h.HIT, max(cached - local_estimate, 0)
    if rules.below_recompute_threshold(reachable - cached, threshold):
        return h.MISS_BELOW_THRESHOLD, 0
    return h.MISS_TRANSFER_FAILED, 0


def split_prefill(offered: int, prompt_len: int, cached: int | None, external: int,
                  threshold: int) -> tuple[str, int]:
    """Like :func:`classify_prefill`, with the tokens P pulled as vLLM itself counted them for the
    request (``external``: ``PrefillStats.num_external_cached_tokens``, which P's answer carries
    through ``serving.prefill_split_patch``; what P's counter
    ``prompt_tokens_by_source_total{source="external_kv_transfer"}`` adds up). Returns
    ``(outcome, reused_tokens)`` with ``reused_tokens == external``: a positive count is a pull
    (``hit``); none is P's own prefix cache or a shortfall below ``threshold``
    (``miss_below_threshold``) or a failed or declined pull (``miss_transfer_failed``), by the
    same reading of ``cached`` as :func:`classify_prefill` with a local hit of ``cached``."""
    if external > 0:
        return h.HIT, external
    if cached is None:
        return h.MISS_TRANSFER_FAILED, 0
    shortfall = rules.reachable_tokens(offered, prompt_len) - cached
    if shortfall <= 1 or rules.below_recompute_threshold(shortfall, threshold):
        return h.MISS_BELOW_THRESHOLD, 0
    return h.MISS_TRANSFER_FAILED, 0


class _PrefillFailed(Exception):
    """P answered the prefill leg with HTTP ``status``; ``body`` is its answer (bytes)."""

    def __init__(self, status: int, body: bytes):
        super().__init__(f"prefill worker answered HTTP {status}")
        self.status = status
        self.body = body


class SessionProxy:
    """The session-aware proxy: handle table, metrics, HTTP client and routing, and one method per
    step of a request (the module doc lists the steps; docs/design.md follows one turn).

    Args:
        config: the proxy's configuration.

    Raises:
        serving.api_keys.CredentialError: a worker's or the proxy's own API key cannot be read.

    The async HTTP client exists between :meth:`start` and :meth:`close` (the app's lifespan).
    """

    def __init__(self, config: ProxyConfig):
        self.config = config
        workers = config.prefill + config.decode + config.aggregated + (
            [config.canary_reference] if config.canary_reference else [])
        self.worker_headers = {w.name: bearer(resolve_optional(w.api_key, f"worker {w.name}'s api_key"))
                               for w in workers}
        key = resolve_optional(config.api_key, "the proxy's api_key")
        self.client_key_digest = hashlib.sha256(key.encode()).digest() if key else None
        self.table = h.HandleTable(ttl_s=rules.proxy_handle_ttl_s(config.decoder_kv_blocks_ttl_s,
                                                                  config.handle_ttl_margin_s),
                                   max_sessions=config.max_sessions)
        self.metrics = ProxyMetrics(self.table.live_handles, config.kv_bytes_per_token,
                                    handle_ttl_s=self.table.ttl_s)
        self.block_chains = BlockChains(config.block_size, config.max_sessions)
        self.prefix_indexes: dict[str, PrefixIndex] = {}
        self.prefill_router = Router(config.prefill or config.aggregated, config.prefill_routing,
                                     max_sessions=config.max_sessions)
        self.decode_router = Router(config.decode or config.aggregated, config.decode_routing,
                                    max_sessions=config.max_sessions)
        self.client: httpx.AsyncClient | None = None
        self.renderer = self._renderer(config)
        self.lifetimes = DecodeLifetimes(self.decode_restarted)
        self.recent = RecentRequests(config.recent_requests)
        self._probe_task: asyncio.Task | None = None

    @staticmethod
    def _renderer(config: ProxyConfig) -> IncrementalRenderer | None:
        """The in-process incremental renderer of the guard, or None (no usable tokenizer)."""
        if not config.tokenizer_dir or config.mode == AGGREGATED:
            return None
        try:
            return IncrementalRenderer(config.tokenizer_dir, config.max_sessions)
        except (OSError, ValueError) as exc:
            log.warning("no in-process renderer (%s); the token guard renders through P's /tokenize", exc)
            return None

    async def start(self) -> None:
        """Open the HTTP client the legs use (decode timeout as its default)."""
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=1024)
        self.client = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(self.config.decode_timeout_s),
                                        verify=self.config.tls.httpx_verify())
        if self.config.mode != AGGREGATED and self.config.decode and self.config.decode_probe_interval_s > 0:
            self._probe_task = asyncio.create_task(self._probe_decodes())

    async def close(self) -> None:
        """Stop the decode probe and close the HTTP client."""
        if self._probe_task is not None:
            self._probe_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe_task
        if self.client is not None:
            await self.client.aclose()

    async def _probe_decodes(self) -> None:
        """Every ``decode_probe_interval_s``: each D's process start (a change drops its handles)."""
        interval = self.config.decode_probe_interval_s
        while True:
            for worker in self.config.decode:
                await self.lifetimes.probe(self.client, worker.name, worker.url, min(interval, 2.0),
                                           self.auth(worker))
            await asyncio.sleep(interval)

    def decode_restarted(self, worker: str, new_engine_id: str | None) -> None:
        """Decode worker ``worker`` is in a new lifetime: drop the handles it issued before (all
        but those naming ``new_engine_id``) and count it."""
        dropped = self.table.drop_decode(worker, keep_engine_id=new_engine_id)
        self.metrics.decode_restarts.labels(worker).inc()
        self.metrics.handles_dropped_restart.inc(dropped)

    def auth(self, worker: Worker) -> dict[str, str]:
        """The headers every request to ``worker`` carries: its role's Bearer key, if any."""
        return dict(self.worker_headers.get(worker.name, {}))  # a copy: httpx-sse adds to the dict it gets

    def client_authorized(self, path: str, authorization: str | None) -> bool:
        """Whether a client's request may pass: no key demanded, an open path (:data:`OPEN_PATHS`),
        or ``Authorization: Bearer <the proxy's key>`` (compared in constant time, as vLLM does).
        A refusal is counted in ``turnscope_proxy_unauthorized_requests_total``."""
        if self.client_key_digest is None or path in OPEN_PATHS:
            return True
        scheme, _, token = (authorization or "").partition(" ")
        ok = scheme.lower() == "bearer" and hmac.compare_digest(
            hashlib.sha256(token.encode()).digest(), self.client_key_digest)
        if not ok:
            self.metrics.unauthorized.inc()
        return ok

    # -- small routes ----------------------------------------------------------------------------

    def health(self) -> dict:
        """``/health``: mode, sessions remembered, handles live and held."""
        return {"status": "ok", "mode": self.config.mode, "sessions": len(self.table),
                "handles_live": len(self.table.live_handles()), "handles_held": self.table.held_handles()}

    def request_facts(self, request_id: str) -> Response:
        """``GET /v1/turnscope/requests/{request_id}`` (:data:`core.contract.REQUEST_FACTS_ROUTE`):
        the request's :class:`core.contract.RequestFactsAnswer`, or a 404 in OpenAI's error shape
        when it is not kept (``serving.recent_requests``)."""
        answer = self.recent.answer(request_id)
        if answer is None:
            return JSONResponse({"error": {"message": f"no recent request with id {request_id!r} (this proxy keeps the "
                                           f"last {self.recent.capacity})", "type": "NotFoundError", "code": 404}},
                                status_code=404)
        return JSONResponse(answer)

    def prometheus(self) -> Response:
        """``/metrics`` in Prometheus text format."""
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self) -> Response:
        """``/v1/models``, relayed from the first decode (or aggregated) worker."""
        worker = (self.config.decode or self.config.aggregated)[0]
        r = await self.client.get(worker.url + "/v1/models", headers=self.auth(worker))
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    async def tokenize(self, raw_body: bytes) -> Response:
        """``/tokenize``, relayed to the first prefill (or aggregated) worker."""
        worker = (self.config.prefill or self.config.aggregated)[0]
        r = await self.client.post(worker.url + "/tokenize", content=raw_body,
                                   headers={"content-type": "application/json"} | self.auth(worker))
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    async def canary(self, served: httpx.AsyncClient, authorization: str | None, model: str | None) -> CanaryReport:
        """``POST /canary``: the known-answer canary (``serving.canary``) through ``served`` (a client
        of this proxy's own app, so the canary takes every step a client's request takes) against
        the reference worker; counted in ``turnscope_canaries_total{result}`` and, when the tokens
        differ, ``turnscope_canary_mismatches_total``; logged as one ``canary`` line."""
        ref = self.config.canary_reference or (self.config.prefill or self.config.aggregated)[0]
        if model is None:  # the reference's served model (a failed look-up makes the canary an error)
            try:
                r = await self.client.get(ref.url + "/v1/models", headers=self.auth(ref))
                model = r.json()["data"][0]["id"]
            except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
                model = "unknown"
        headers = {"authorization": authorization} if authorization else {}
        max_tokens = canary_max_tokens(self.config.block_size, self.config.kv_recompute_threshold)
        report = await run_canary(served, self.client, ref.url, ref.name, model, max_tokens,
                                  served_headers=headers, reference_headers=self.auth(ref))
        self.table.forget(report.session)  # no client turn follows: its handle is no live handle
        self.metrics.canaries.labels(report.result).inc()
        if report.result == "mismatch":
            self.metrics.canary_mismatches.inc()
        log.info(json.dumps({"event": "canary", "result": report.result, "reference": ref.name,
                             "first_mismatch": [t.first_mismatch for t in report.turns],
                             "reuse": [t.reuse for t in report.turns], "error": report.error}))
        return report

    # -- a generate request, step by step -----------------------------------------------------------

    async def generate(self, endpoint: str, request: Request) -> Response:
        """One generate request: admit, then :meth:`serve` it unless the client goes away first.

        In P/D modes a request P/D cannot serve (:func:`pd_request_error`) is answered 400 first,
        with neither worker called and the session's handle left in place. A client that
        disconnects before the response starts (during the prefill leg, or before D's stream
        opens, or during a non-streamed decode leg) has the legs in flight cancelled, which closes
        their connections to the workers (``serving.client_disconnect``): :meth:`client_left`."""
        req = await self.admit(endpoint, request)
        if req.decode is None:
            names = ", ".join(w.name for w in self.decode_router.workers)
            return self.reject(req, DECODE_WORKER_HEADER, f"the header {DECODE_WORKER_HEADER} names decode worker "
                               f"{req.facts.decode_engine!r}, which this proxy does not have (it has: {names})")
        if self.config.mode == AGGREGATED:
            req.facts.prefill_engine = None
        else:
            problem = pd_request_error(req.body)
            if problem is not None:
                return self.reject(req, *problem)
        gone, response = await run_until_client_gone(request.receive, self.serve(req))
        if gone:
            self.client_left(req)
            return Response(status_code=499)  # nobody reads it: the client is gone (nginx's 499)
        return response

    def client_left(self, req: ProxiedRequest) -> None:
        """The client went away before the request ended: counted by the phase it was in
        (``turnscope_proxy_client_disconnects_total{phase}``, apart from errors), logged
        ``client_disconnected``, and no handle kept for it. Once per request."""
        if req.finished:
            return
        self.metrics.client_disconnects.labels(req.phase).inc()
        self.finish_request(req, None, [], [], CLIENT_DISCONNECTED)

    async def serve(self, req: ProxiedRequest) -> Response:
        """Aggregated: the decode leg alone. P/D: match the handle, prefill leg, decode leg."""
        if self.config.mode == AGGREGATED:
            return await self.decode_leg(req)
        await self.match_handle(req)
        self.estimate_local_hit(req)
        try:
            p_resp = await self.prefill_leg(req)
        except (_PrefillFailed, httpx.HTTPError) as exc:
            if isinstance(exc, httpx.TransportError):
                self.prefill_router.mark_failed(req.prefill.name)
            return self.prefill_failed(req, exc)
        self.account_prefill(req, p_resp)
        req.phase = PHASE_BEFORE_FIRST_TOKEN  # P has answered: its blocks wait for D
        return await self.decode_leg(req)

    def reject(self, req: ProxiedRequest, param: str, message: str) -> Response:
        """A 400 in OpenAI's error shape naming the body field ``param`` (as vLLM's own 400s do),
        counted in ``turnscope_rejected_requests_total{param}`` and logged; no worker is called."""
        self.metrics.rejected.labels(param).inc()
        self.recent.ended(req.facts, "rejected")
        log.info(json.dumps({"event": "request", "status": "rejected", "param": param, **req.facts.log_fields()}))
        return JSONResponse({"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}},
                            status_code=400, headers={REQUEST_ID_HEADER: req.facts.request_id})

    async def admit(self, endpoint: str, request: Request) -> ProxiedRequest:
        """Read the body, take the session key out of it, drop client-supplied
        ``kv_transfer_params`` (they could read another session's blocks), pick the workers: D the
        one :data:`DECODE_WORKER_HEADER` names, if any (None when no D has that name)."""
        t_arrival = time.perf_counter()
        body = await request.json()
        session = body.pop(SESSION_FIELD, None) or request.headers.get(SESSION_HEADER.lower())
        body.pop("kv_transfer_params", None)
        if isinstance(body.get("vllm_xargs"), dict):  # vLLM copies vllm_xargs into the params' source too
            body["vllm_xargs"].pop("kv_transfer_params", None)
        request_id = request.headers.get(REQUEST_ID_HEADER) or f"ts-{uuid.uuid4().hex}"
        pinned = request.headers.get(DECODE_WORKER_HEADER)  # a named D (None: an unknown name, refused)
        prefill = self.prefill_router.pick(session)
        decode = self.decode_router.pick(session) if pinned is None else self.decode_router.named(pinned)
        facts = RequestFacts(request_id=request_id, mode=self.config.mode, prefill_engine=prefill.name,
                             decode_engine=decode.name if decode is not None else pinned)
        self.recent.admitted(facts)  # the look-up route reads the facts as the steps fill them in
        return ProxiedRequest(endpoint=endpoint, body=body, session=session, prefill=prefill, decode=decode,
                              facts=facts, t_arrival=t_arrival)

    async def match_handle(self, req: ProxiedRequest) -> None:
        """Under the session's lock, pop its handle (single use) and fit it to the request's ids."""
        if not req.session:
            req.outcome = h.MISS_NO_SESSION_ID
            return
        async with self.table.lock(req.session):
            handle, req.outcome = self.table.take(req.session)
            age = self.table.age_of_last_taken(req.session)
            if age is not None:
                self.metrics.handle_age_at_use.observe(age)
            if handle is None:
                if req.outcome == h.MISS_DECODE_RESTARTED and age is not None:
                    req.facts.handle_age_s = round(age, 3)  # the store ties it to D's lifetimes
                return
            t0 = time.perf_counter()
            req.new_ids = await self.rendered_ids(req)
            req.waited_s += time.perf_counter() - t0
            fit = h.fit_handle(handle, req.new_ids, self.config.block_size)
            req.facts.divergence_position = fit.divergence_position
            req.facts.handle_age_s = round(time.monotonic() - handle.created_at, 3)
            if fit.params is None:
                req.outcome = h.MISS_MISMATCH
            else:
                req.handle_params = fit.params
                req.facts.remote_tokens = fit.usable_tokens

    def prefix_index(self, worker: str) -> PrefixIndex:
        """The prefix index of prefill worker ``worker`` (made on first use: workers can join)."""
        index = self.prefix_indexes.get(worker)
        if index is None:
            index = self.prefix_indexes[worker] = PrefixIndex(self.config.block_size,
                                                              self.config.prefill_cache_blocks)
        return index

    def estimate_local_hit(self, req: ProxiedRequest) -> None:
        """Before the prefill leg: the tokens of the request's ids P's own prefix cache can hold,
        from any session (:class:`serving.prefix_index.PrefixIndex`), into ``req.local_estimate``.
        Needs the ids (rendered when a handle was matched) and P's prefix caching on; else 0.
        Taken before P is asked: a concurrent request may warm P's cache meanwhile
        (:func:`classify_prefill` reads a report above the reachable tokens as a local hit)."""
        if not self.config.prefill_prefix_caching or req.new_ids is None or len(req.new_ids) == 0:
            return
        req.chain = self.block_chains.chain(req.session, req.new_ids, req.cache_salt)
        held = self.prefix_index(req.prefill.name).held_tokens(req.chain)
        req.local_estimate = rules.local_prefix_tokens(held, len(req.new_ids), self.config.block_size,
                                                       prompt_tokens=len(req.new_ids))

    def record_prefill(self, req: ProxiedRequest, prompt_ids) -> None:
        """P computed (or pulled) ``prompt_ids``: its prefix index keeps their full blocks, once
        per request (the rendered ids when the request had them, else the prompt ids D returned:
        the same request, the same tokenizer)."""
        if req.recorded or not self.config.prefill_prefix_caching or req.prefill is None:
            return
        if req.chain is None:
            if prompt_ids is None or len(prompt_ids) == 0:
                return
            req.chain = self.block_chains.chain(req.session, prompt_ids, req.cache_salt)
        self.prefix_index(req.prefill.name).record(req.chain)
        req.recorded = True

    async def rendered_ids(self, req: ProxiedRequest) -> list[int]:
        """The token ids the worker will see for the request ([] when ``/tokenize`` fails).

        A chat request of a session whose previous render is kept is rendered in-process from
        that render plus the new tail (``serving.prompt_render``: cost follows the new tokens);
        otherwise through P's ``/tokenize``, and that render is kept for the next request when
        the in-process render agrees with it.
        """
        prompt = req.body.get("prompt")
        if req.endpoint == "/v1/completions" and isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        chat = self.renderer is not None and req.endpoint == "/v1/chat/completions"
        if chat:
            ids = self.renderer.render(req.session, req.body)
            if ids is not None:
                return ids
        try:
            ids = await tokenize_async(self.client, req.prefill.url, render_request(req.endpoint, req.body),
                                       self.config.prefill_timeout_s, self.auth(req.prefill))
        except TokenizeError as exc:
            log.warning("tokenize failed, dropping the handle: %s", exc)
            return []
        if chat:
            self.renderer.keep(req.session, req.body, ids)
        return ids

    async def prefill_leg(self, req: ProxiedRequest) -> dict:
        """P computes the prompt (pulling D's KV when offered a handle). A leg with a handle that
        fails is retried once without it, as a plain recompute (``miss_transfer_failed``).

        Raises:
            _PrefillFailed: P answered an HTTP error (without a handle to drop).
            httpx.HTTPError: P could not be reached (without a handle to drop).
        """
        t0 = time.perf_counter()
        req.facts.prefill_attempts = 1
        try:
            p_resp = await self._post_prefill(req)
        except (httpx.HTTPError, _PrefillFailed) as exc:
            if req.handle_params is None:
                raise
            log.warning("prefill leg with a handle failed (%s); retrying as a plain recompute", type(exc).__name__)
            self.metrics.prefill_attempts.inc()
            req.facts.prefill_attempts, req.handle_params, req.outcome = 2, None, h.MISS_TRANSFER_FAILED
            p_resp = await self._post_prefill(req)
        req.facts.prefill_leg_s = time.perf_counter() - t0
        return p_resp

    async def _post_prefill(self, req: ProxiedRequest) -> dict:
        """POST the request to P with ``max_tokens=1``, no stream, and the prefill params (+ handle)."""
        p_body = {k: v for k, v in req.body.items()
                  if k not in ("stream", "stream_options", "max_completion_tokens", "min_tokens")}
        handle = {k: req.handle_params[k] for k in HANDLE_KEYS if k in req.handle_params} if req.handle_params else {}
        p_body.update(max_tokens=1, stream=False, kv_transfer_params=PREFILL_PARAMS | handle)
        r = await self.client.post(req.prefill.url + req.endpoint, json=p_body, timeout=self.config.prefill_timeout_s,
                                   headers=self.auth(req.prefill))
        if r.status_code != 200:
            raise _PrefillFailed(r.status_code, r.content)
        return r.json()

    def prefill_failed(self, req: ProxiedRequest, exc: Exception) -> Response:
        """The client's answer when the prefill leg failed; D is never called, so the turn is not
        served by D alone as if P/D had happened (a reported bug of vLLM's router: its prefill leg
        kept ``stream_options`` with ``stream=false``, vLLM answered 400, and the router decoded
        anyway). P's HTTP error keeps
        P's status, its message prefixed with the worker's name and status (``prefill worker
        prefill-0 answered HTTP 400: ...``); an unreachable or timed-out P is a 502 naming it. No
        reuse header: there was no reuse. Counted in ``turnscope_prefill_failures_total{reason}``."""
        if isinstance(exc, _PrefillFailed):
            status, reason = exc.status, f"http_{exc.status}"
            message = f"prefill worker {req.prefill.name} answered " + error_body_text(
                exc.status, exc.body.decode("utf-8", errors="replace"))
        else:
            status, reason = 502, type(exc).__name__
            message = f"prefill worker {req.prefill.name}: {type(exc).__name__}: {exc}"
        self.metrics.prefill_failures.labels(reason).inc()
        req.finished = True
        self.recent.ended(req.facts, "prefill_failed")
        log.info(json.dumps({"event": "request", "status": "prefill_failed", "error": message,
                             **req.facts.log_fields()}))
        return JSONResponse({"error": {"message": message, "type": "prefill_failed", "code": status}},
                            status_code=status, headers=req.facts.identity_headers())

    def account_prefill(self, req: ProxiedRequest, p_resp: dict) -> None:
        """From P's answer: the reuse outcome and token counts, metrics, and P's prefix index
        (:meth:`record_prefill`, when the ids are known already). The tokens pulled from D are
        vLLM's own per-request count where P's answer carries it (:func:`split_prefill`; workers
        turnscope starts, ``serving.prefill_split_patch``; the key is taken out before D sees
        P's params), else P's local hit is estimated by :meth:`estimate_local_hit`
        (:func:`classify_prefill`)."""
        cfg, facts = self.config, req.facts
        leg_s = facts.prefill_leg_s or 0.0
        req.waited_s += leg_s
        self.metrics.prefill_leg.observe(leg_s)
        req.p_params = p_resp.get("kv_transfer_params") or {}
        prompt_len = int((p_resp.get("usage") or {}).get("prompt_tokens") or 0)
        cached = req.p_params.get("remote_prefill_cached_tokens")
        external = req.p_params.pop(prefill_split_patch.EXTERNAL_KEY, None)
        req.p_params.pop(prefill_split_patch.LOCAL_KEY, None)
        if req.chain is not None:
            self.record_prefill(req, req.new_ids)
        if req.session:
            self.prefill_router.served(req.session, req.prefill.name, prompt_len)
        if req.handle_params is not None and isinstance(external, int):
            req.outcome, facts.reused_tokens = split_prefill(facts.remote_tokens, prompt_len, cached, external,
                                                             cfg.kv_recompute_threshold)
        elif req.handle_params is not None:
            req.outcome, facts.reused_tokens = classify_prefill(facts.remote_tokens, prompt_len, cached,
                                                                req.local_estimate, cfg.kv_recompute_threshold)
        cached_n = int(cached or 0)
        facts.prefill_cached_tokens = max(cached_n - facts.reused_tokens, 0)
        facts.recomputed_tokens = max(prompt_len - cached_n, 0)
        facts.reuse, facts.prefill_leg_s = req.outcome, round(leg_s, 6)
        self.metrics.reused_tokens.labels(cfg.mode, "remote_decode").inc(facts.reused_tokens)
        self.metrics.reused_tokens.labels(cfg.mode, "local_prefix").inc(facts.prefill_cached_tokens)
        self.metrics.reused_tokens.labels(cfg.mode, "recomputed").inc(facts.recomputed_tokens)

    async def decode_leg(self, req: ProxiedRequest) -> Response:
        """D generates with P's params; its answer goes to the client with the facts' headers,
        streamed (:meth:`relay_stream`) or whole."""
        req.phase = PHASE_BEFORE_FIRST_TOKEN
        d_body = dict(req.body)
        d_body["return_token_ids"] = True
        if req.p_params is not None:
            d_body["kv_transfer_params"] = req.p_params
        headers = req.facts.headers()
        self.metrics.requests.labels(self.config.mode, req.facts.reuse or "none").inc()
        if not req.body.get("stream"):
            return await self._decode_whole(req, d_body, headers)
        body_stream = self.relay_stream(req, d_body)
        first = await anext(body_stream)  # surfaces D's HTTP status before the headers go out
        if isinstance(first, Response):
            first.headers.update(headers)
            return first

        async def chain():
            try:
                if first is not STREAM_OPEN:  # the sentinel itself is never sent
                    yield first
                async for piece in body_stream:
                    yield piece
            finally:  # the client left at a yield of ours: close D's stream now, not at garbage collection
                await body_stream.aclose()

        return StreamingResponse(chain(), media_type="text/event-stream", headers=headers)

    async def _decode_whole(self, req: ProxiedRequest, d_body: dict, headers: dict[str, str]) -> Response:
        """The decode leg of a non-streamed request."""
        t0 = time.perf_counter()
        r = await self.client.post(req.decode.url + req.endpoint, json=d_body, timeout=self.config.decode_timeout_s,
                                   headers=self.auth(req.decode))
        self.metrics.overhead.observe(max(t0 - req.t_arrival - req.waited_s, 0.0))
        if r.status_code != 200:
            self.finish_request(req, None, [], [], f"http_{r.status_code}")
            return Response(r.content, status_code=r.status_code, headers=headers, media_type="application/json")
        data = r.json()
        d_handle = data.pop("kv_transfer_params", None)
        req.facts.handle_tokens = held_handle_tokens(d_handle)
        choice = (data.get("choices") or [{}])[0]
        self.finish_request(req, d_handle, data.get("prompt_token_ids") or choice.get("prompt_token_ids") or [],
                    choice.get("token_ids") or [], "ok")
        data[FACTS_FIELD] = req.facts.public()
        return JSONResponse(data, headers=headers)

    async def relay_stream(self, req: ProxiedRequest, d_body: dict):
        """D's SSE stream relayed to the client, event for event and byte for byte, plus only the
        additive ``turnscope`` field (:class:`_StreamRelay`).

        The first item is D's error :class:`Response` (D answered an HTTP error: the client gets
        that status) or :data:`STREAM_OPEN` (D answered 200: the caller sends the headers); the
        sentinel is never sent, so the client reads exactly D's events (vLLM never sends SSE
        comments, and vLLM's ``bench serve`` reader breaks on one, docs/design.md).
        D's handle is kept (:meth:`finish_request`) and replaced on the wire by the request's
        public facts."""
        relay = _StreamRelay(self, req)
        self.metrics.overhead.observe(max(time.perf_counter() - req.t_arrival - req.waited_s, 0.0))
        try:
            async with aconnect_sse(self.client, "POST", req.decode.url + req.endpoint, json=d_body,
                                    timeout=self.config.decode_timeout_s, headers=self.auth(req.decode)) as source:
                if source.response.status_code != 200:
                    content = await source.response.aread()
                    relay.fail(f"http_{source.response.status_code}")
                    yield Response(content, status_code=source.response.status_code, media_type="application/json")
                    return
                yield STREAM_OPEN
                async for event in source.aiter_sse():
                    for piece in relay.on_event(event.data):
                        yield piece
        except (asyncio.CancelledError, GeneratorExit):
            # Starlette cancels the response when its client disconnects (or closes this relay
            # at a yield); leaving `aconnect_sse` closes D's stream, so D aborts the request.
            self.client_left(req)
            raise
        except httpx.HTTPError as exc:
            if isinstance(exc, httpx.TransportError):
                self.decode_router.mark_failed(req.decode.name)
            if not relay.finished:
                relay.fail(f"error: {type(exc).__name__}")
                yield sse({"error": {"message": f"decode worker {req.decode.name}: {type(exc).__name__}: {exc}",
                                     "type": "decode_failed"}})
        finally:
            if not relay.finished:  # client went away mid-stream, or D ended without [DONE]
                relay.fail("incomplete")

    def finish_request(self, req: ProxiedRequest, d_handle: dict | None, prompt_ids: list[int], gen_ids: list[int],
               status: str) -> None:
        """Keep D's handle for the session's next turn (or note that none came) and log the request.
        Once per request (later calls do nothing)."""
        if req.finished:
            return
        req.finished = True
        self.recent.ended(req.facts, status)
        prompt = prompt_ids if prompt_ids else (req.new_ids if req.new_ids is not None else [])
        if req.p_params is not None:
            self.record_prefill(req, prompt)
        if req.session and status == "ok":
            self.decode_router.served(req.session, req.decode.name, len(prompt) + len(gen_ids))
        if req.session and req.p_params is not None:
            if d_handle and d_handle.get("remote_block_ids"):
                self.lifetimes.saw_engine_id(req.decode.name, d_handle.get("remote_engine_id"))
                self.table.put(req.session, d_handle, req.decode.name, np.concatenate(
                    (np.asarray(prompt, dtype=np.int64), np.asarray(gen_ids, dtype=np.int64))))
            else:
                self.table.mark_no_handle(req.session)
        log.info(json.dumps({"event": "request", "status": status, "handle_returned": bool(d_handle),
                             **req.facts.log_fields()}))


class _StreamRelay:
    """What the streamed relay has seen of D's stream: prompt and generated ids, D's handle, TTFT.

    Every event of D's goes to the client with its bytes unchanged, except two, which get the
    additive ``turnscope`` field (:data:`core.contract.FACTS_FIELD`) spliced in before their
    closing brace (D's own bytes stay a prefix): the chunk where choice 0 finishes (its
    ``finish_reason`` set: every vLLM stream has one) and the chunk carrying D's
    ``kv_transfer_params`` (``serving.stream_handle_patch``), whose params are replaced by the
    facts. Clients that know the field merge it (``loadgen.stream_client``); others ignore an
    unknown key, as OpenAI clients do. No event is added, except when D's stream ends with
    neither chunk: then one usage-shaped chunk (``choices: []``) carries the facts before
    ``[DONE]``.
    """

    def __init__(self, proxy: SessionProxy, req: ProxiedRequest):
        self.proxy = proxy
        self.req = req
        self.prompt_ids: list[int] = []
        self.gen_ids: list[int] = []
        self.d_handle: dict | None = None
        self.first_token_seen = False
        self.facts_sent = False
        self.last_chunk: dict = {}

    @property
    def finished(self) -> bool:
        """Whether the request has ended (answered, failed, or left by its client)."""
        return self.req.finished

    def fail(self, status: str) -> None:
        """The request ended without D's answer: no handle (:meth:`SessionProxy.finish_request`)."""
        self.proxy.finish_request(self.req, None, [], [], status)

    def done(self) -> None:
        """D sent ``[DONE]``: keep its handle with the ids it holds KV for."""
        self.proxy.finish_request(self.req, self.d_handle, self.prompt_ids, self.gen_ids, "ok")

    def with_facts(self, data: str) -> bytes:
        """D's event ``data`` (a JSON object) with the ``turnscope`` field added before its last ``}``."""
        self.facts_sent = True
        facts = json.dumps(self.req.facts.public(), separators=(",", ":"))
        body = data.rstrip()
        return f"data: {body[:-1]},\"{FACTS_FIELD}\":{facts}}}\n\n".encode()

    def on_event(self, data: str) -> list[bytes]:
        """The bytes to send the client for one SSE event of D's."""
        if data == "[DONE]":
            # Keep the handle before the client can hang up on [DONE] (which cancels us).
            self.done()
            out = []
            if not self.facts_sent:
                chunk = {k: self.last_chunk[k] for k in ("id", "object", "created", "model") if k in self.last_chunk}
                out.append(sse(chunk | {"choices": [], FACTS_FIELD: self.req.facts.public()}))
            return out + [b"data: [DONE]\n\n"]
        chunk = json.loads(data)
        self.last_chunk = chunk
        if "kv_transfer_params" in chunk:
            self.d_handle = chunk.pop("kv_transfer_params")
            self.req.facts.handle_tokens = held_handle_tokens(self.d_handle)
            chunk[FACTS_FIELD] = self.req.facts.public()
            self.facts_sent = True
            return [sse(chunk)]
        if chunk.get("prompt_token_ids"):
            self.prompt_ids = chunk["prompt_token_ids"]
        finishes = False
        for choice in chunk.get("choices") or ():
            if choice.get("prompt_token_ids"):
                self.prompt_ids = choice["prompt_token_ids"]
            if choice.get("token_ids"):
                self.gen_ids.extend(choice["token_ids"])
                if not self.first_token_seen:
                    self.first_token_seen = True
                    self.req.phase = PHASE_STREAMING
                    self.proxy.metrics.ttft.labels(self.proxy.config.mode, self.req.facts.reuse or "none").observe(
                        time.perf_counter() - self.req.t_arrival)
            finishes = finishes or (choice.get("index", 0) == 0 and choice.get("finish_reason") is not None)
        if finishes:
            return [self.with_facts(data)]
        return [f"data: {data}\n\n".encode()]


def pd_request_error(body: dict) -> tuple[str, str] | None:
    """``(param, message)`` when P/D cannot serve the request body, else None.

    ``n`` above 1: P would split the request into ``n`` child requests whose KV blocks one
    ``kv_transfer_params`` cannot describe, so D would get the blocks of one child, or none (vLLM
    issue "[Bug] n>1 with PD disaggregation", vllm-project/vllm#38900). A non-integer ``n`` is left
    to the workers' own validation.
    """
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > 1:
        return "n", (f"n={n}: this proxy serves one choice per request in P/D modes (n must be 1); P/D "
                     "disaggregation cannot hand the KV of several choices from the prefill to the decode worker. "
                     "Send n separate requests, or serve aggregated.")
    return None


def held_handle_tokens(d_handle: dict | None) -> int | None:
    """Tokens of KV D keeps pinned for a finished request's handle (its ``remote_num_tokens``), or
    None when D returned no handle (no ``remote_block_ids``): the ``handle_tokens`` fact."""
    if not d_handle or not d_handle.get("remote_block_ids"):
        return None
    return int(d_handle.get("remote_num_tokens") or 0)


def create_app(config: ProxyConfig) -> FastAPI:
    """Build the proxy's FastAPI app for ``config``: a :class:`SessionProxy` behind thin routes.

    ``app.state.proxy`` is the proxy; ``app.state.table`` and ``app.state.metrics`` its handle
    table and metrics.
    """
    proxy = SessionProxy(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await proxy.start()
        yield
        await proxy.close()

    app = FastAPI(title="turnscope proxy", lifespan=lifespan)
    app.state.proxy, app.state.table, app.state.metrics = proxy, proxy.table, proxy.metrics

    @app.middleware("http")
    async def require_key(request: Request, call_next):
        if not proxy.client_authorized(request.url.path, request.headers.get("authorization")):
            return JSONResponse({"error": {"message": "this turnscope proxy needs Authorization: Bearer <its api_key>",
                                           "type": "unauthorized", "code": 401}}, status_code=401)
        return await call_next(request)

    @app.get("/health")
    async def health():
        return proxy.health()

    @app.get("/metrics")
    async def prom():
        return proxy.prometheus()

    @app.get(REQUEST_FACTS_ROUTE.replace("{request_id}", "{request_id:path}"))  # an id may hold a '/'
    async def request_facts(request_id: str):
        return proxy.request_facts(request_id)

    @app.get("/v1/models")
    async def models():
        return await proxy.models()

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await proxy.tokenize(await request.body())

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await proxy.generate("/v1/chat/completions", request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await proxy.generate("/v1/completions", request)

    @app.post("/canary")
    async def canary(request: Request):
        body = await request.json() if await request.body() else {}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as served:
            report = await proxy.canary(served, request.headers.get("authorization"), body.get("model"))
        return JSONResponse(report.model_dump())

    return app


def sse(obj: dict) -> bytes:
    """One SSE ``data:`` event holding ``obj`` as JSON."""
    return f"data: {json.dumps(obj)}\n\n".encode()
