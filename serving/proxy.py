"""The session-aware P/D proxy (DESIGN §3): decides per request whether a session's KV comes back
from the decode worker, and reports what happened in the response.

Flow of one generate request (``/v1/chat/completions`` or ``/v1/completions``):

1. The session key is the body field ``conversation_id`` (popped) or the ``X-Session-ID`` header.
   Client-supplied ``kv_transfer_params`` (top level, or inside ``vllm_xargs``) are dropped: they
   could read another session's blocks.
2. Under the session's lock the handle is popped (single use). If there is one, the request's
   rendered ids (the prefill worker's ``/tokenize``, or the prompt ids themselves) are compared
   with the ids D holds KV for, and the handle is trimmed to whole blocks before any divergence
   (``serving.handles.fit_handle``); with no whole block left the outcome is ``miss_mismatch``.
3. Prefill leg: P gets the request with ``max_tokens=1``, ``stream=false`` and
   ``kv_transfer_params={do_remote_decode: true, ...}`` plus D's handle when there is one. A leg
   that fails or passes its timeout while carrying a handle is retried once without it (a plain
   recompute) and the outcome is ``miss_transfer_failed``.
4. Decode leg: D gets the request with P's returned params, streamed to the client. The final
   chunk's ``kv_transfer_params`` (D's handle for the next turn) is kept in the table and replaced,
   on the wire, by a ``turnscope`` field with this request's facts.

Headers carry what is known before the stream (``x-request-id``, ``x-turnscope-reuse``,
``x-turnscope-prefill-ms``, ``x-turnscope-prefill-engine``, ``x-turnscope-decode-engine``); the
final chunk's ``turnscope`` field carries token counts. One JSON log line per request is written to
the ``turnscope.proxy`` logger for clients that are not turnscope's.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
import uuid
from collections import OrderedDict
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from httpx_sse import aconnect_sse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field

from serving import handles as h
from serving import reuse_rules as rules
from serving.proxy_metrics import ProxyMetrics

log = logging.getLogger("turnscope.proxy")

# What P gets on every prefill leg (vLLM's reference P/D proxies send the same).
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
HANDLE_KEYS = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host", "remote_port",
               "remote_num_tokens", "remote_blocks_expiry_time", "tp_size", "dcp_size", "pp_size",
               "transfer_mode")


class Worker(BaseModel):
    """One vLLM worker the proxy routes to: a name (used in facts and logs) and its base URL."""

    name: str
    url: str


class ProxyConfig(BaseModel):
    """Everything the proxy needs; times in seconds, sizes in tokens.

    ``handle_ttl_margin_s`` is subtracted from ``decoder_kv_blocks_ttl_s`` to get the proxy TTL
    (vLLM's reference multi-turn proxy keeps 450 s against D's 480 s; P itself also declines a
    read within 5 s of D's deadline, ``_KV_BLOCKS_EXPIRY_SAFETY_MARGIN`` in ``pull_worker.py``).
    ``block_size`` is the KV block size of the workers (128 on vLLM's CPU backend).
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


def classify_prefill(offered: int, prompt_len: int, cached: int | None, local_estimate: int,
                     threshold: int) -> tuple[str, int]:
    """Decide, from P's report, whether P pulled the offered KV. Returns ``(outcome, reused_tokens)``.

    ``offered`` is the handle's usable tokens, ``prompt_len`` P's prompt length, ``cached`` P's
    ``remote_prefill_cached_tokens`` (local prefix hits + tokens pulled; vLLM ``PrefillStats``),
    ``local_estimate`` the tokens P can have in its own prefix cache for this session. vLLM's rule
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


class _PrefillFailed(Exception):
    """The prefill leg failed; ``response`` is what to send the client."""

    def __init__(self, response: Response):
        super().__init__("prefill leg failed")
        self.response = response


def create_app(config: ProxyConfig) -> FastAPI:
    """Build the proxy's FastAPI app for ``config``."""
    table = h.HandleTable(ttl_s=rules.proxy_handle_ttl_s(config.decoder_kv_blocks_ttl_s, config.handle_ttl_margin_s),
                          max_sessions=config.max_sessions)
    metrics = ProxyMetrics(table.live_handles, config.kv_bytes_per_token, handle_ttl_s=table.ttl_s)
    prefill_cycle = itertools.cycle(config.prefill or config.aggregated)
    decode_cycle = itertools.cycle(config.decode or config.aggregated)
    # Which P served each session last, and its prompt length: P's prefix cache can hold that much.
    # Bounded like the handle table (least recently served out first).
    last_prefill: OrderedDict[str, tuple[str, int]] = OrderedDict()
    state: dict = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=1024)
        state["client"] = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(config.decode_timeout_s))
        yield
        await state["client"].aclose()

    app = FastAPI(title="turnscope proxy", lifespan=lifespan)
    app.state.table = table
    app.state.metrics = metrics

    def client() -> httpx.AsyncClient:
        return state["client"]

    @app.get("/health")
    async def health():
        return {"status": "ok", "mode": config.mode, "sessions": len(table),
                "handles_live": len(table.live_handles()), "handles_held": table.held_handles()}

    @app.get("/metrics")
    async def prom():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        worker = (config.decode or config.aggregated)[0]
        r = await client().get(worker.url + "/v1/models")
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    @app.post("/tokenize")
    async def tokenize(request: Request):
        worker = (config.prefill or config.aggregated)[0]
        r = await client().post(worker.url + "/tokenize", content=await request.body(),
                                headers={"content-type": "application/json"})
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    async def rendered_ids(endpoint: str, body: dict, worker: Worker) -> list[int]:
        """The token ids the worker will see for this request."""
        prompt = body.get("prompt")
        if endpoint == "/v1/completions" and isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        if endpoint == "/v1/completions":
            req = {"model": body.get("model"), "prompt": prompt}
        else:
            req = {k: body[k] for k in ("model", "messages", "tools", "chat_template",
                                        "chat_template_kwargs", "add_generation_prompt",
                                        "continue_final_message") if k in body}
            req.setdefault("add_generation_prompt", True)
        r = await client().post(worker.url + "/tokenize", json=req, timeout=config.prefill_timeout_s)
        r.raise_for_status()
        return r.json()["tokens"]

    async def prefill_leg(endpoint: str, body: dict, worker: Worker, handle_params: dict | None) -> dict:
        p_body = {k: v for k, v in body.items()
                  if k not in ("stream", "stream_options", "max_completion_tokens", "min_tokens")}
        p_body.update(max_tokens=1, stream=False,
                      kv_transfer_params=PREFILL_PARAMS | ({k: handle_params[k] for k in HANDLE_KEYS
                                                             if k in handle_params} if handle_params else {}))
        r = await client().post(worker.url + endpoint, json=p_body, timeout=config.prefill_timeout_s)
        if r.status_code != 200:
            raise _PrefillFailed(Response(r.content, status_code=r.status_code, media_type="application/json"))
        return r.json()

    async def generate(endpoint: str, request: Request):
        t_arrival = time.perf_counter()
        waited = 0.0  # time spent waiting on workers before the decode leg
        body = await request.json()
        session = body.pop("conversation_id", None) or request.headers.get("x-session-id")
        body.pop("kv_transfer_params", None)
        if isinstance(body.get("vllm_xargs"), dict):  # vLLM copies vllm_xargs into the params' source too
            body["vllm_xargs"].pop("kv_transfer_params", None)
        request_id = request.headers.get("x-request-id") or f"ts-{uuid.uuid4().hex}"
        prefill, decode = next(prefill_cycle), next(decode_cycle)
        facts: dict = {"request_id": request_id, "mode": config.mode, "prefill_engine": prefill.name,
                       "decode_engine": decode.name, "remote_tokens": 0, "reused_tokens": 0,
                       "prefill_cached_tokens": 0, "handle_age_s": None, "divergence_position": None}

        if config.mode == "aggregated":
            facts.update(reuse=None, prefill_engine=None, prefill_leg_s=None)
            return await decode_leg(endpoint, body, decode, None, session, facts, t_arrival, waited, [])

        handle_params, new_ids, outcome, handle = None, None, None, None
        prev = last_prefill.get(session) if session else None  # P's cache for this session, as of now
        if not session:
            outcome = h.MISS_NO_SESSION_ID
        else:
            async with table.lock(session):
                handle, outcome = table.take(session)
                age = table.age_of_last_taken(session)
                if age is not None:
                    metrics.handle_age_at_use.observe(age)
                if handle is not None:
                    t0 = time.perf_counter()
                    try:
                        new_ids = await rendered_ids(endpoint, body, prefill)
                    except (httpx.HTTPError, KeyError, ValueError) as exc:
                        log.warning("tokenize failed, dropping the handle: %s", exc)
                        new_ids = []
                    waited += time.perf_counter() - t0
                    fit = h.fit_handle(handle, new_ids, config.block_size)
                    facts["divergence_position"] = fit.divergence_position
                    facts["handle_age_s"] = round(time.monotonic() - handle.created_at, 3)
                    if fit.params is None:
                        outcome = h.MISS_MISMATCH
                    else:
                        handle_params = fit.params
                        facts["remote_tokens"] = fit.usable_tokens

        t_p = time.perf_counter()
        attempts = 1
        try:
            try:
                p_resp = await prefill_leg(endpoint, body, prefill, handle_params)
            except (httpx.HTTPError, _PrefillFailed) as exc:
                if handle_params is None:
                    raise
                log.warning("prefill leg with a handle failed (%s); retrying as a plain recompute",
                            type(exc).__name__)
                metrics.prefill_attempts.inc()
                attempts, handle_params, outcome = 2, None, h.MISS_TRANSFER_FAILED
                p_resp = await prefill_leg(endpoint, body, prefill, None)
        except (_PrefillFailed, httpx.HTTPError) as exc:
            # the request's identity goes back with the failure, so the recorded turn names the worker
            fail_headers = {"x-request-id": request_id, "x-turnscope-prefill-engine": prefill.name,
                            "x-turnscope-decode-engine": decode.name}
            log.info(json.dumps({"event": "request", "status": "prefill_failed", **facts}))
            if isinstance(exc, _PrefillFailed):
                exc.response.headers.update(fail_headers)
                return exc.response
            return JSONResponse({"error": {"message": f"prefill worker {prefill.name}: {type(exc).__name__}: {exc}",
                                           "type": "prefill_failed"}}, status_code=502, headers=fail_headers)
        prefill_leg_s = time.perf_counter() - t_p
        waited += prefill_leg_s
        metrics.prefill_leg.observe(prefill_leg_s)
        p_params = p_resp.get("kv_transfer_params") or {}
        usage = p_resp.get("usage") or {}
        prompt_len = int(usage.get("prompt_tokens") or 0)
        cached = p_params.get("remote_prefill_cached_tokens")
        local_estimate = 0
        if config.prefill_prefix_caching and prev and prev[0] == prefill.name and new_ids is not None:
            local_estimate = rules.local_prefix_tokens(prev[1], len(new_ids), config.block_size)
        if session:
            last_prefill[session] = (prefill.name, prompt_len)
            last_prefill.move_to_end(session)
            while len(last_prefill) > config.max_sessions:
                last_prefill.popitem(last=False)
        if handle_params is not None:
            outcome, reused = classify_prefill(facts["remote_tokens"], prompt_len, cached, local_estimate,
                                               config.kv_recompute_threshold)
            facts["reused_tokens"] = reused
        cached_n = int(cached or 0)
        facts["prefill_cached_tokens"] = max(cached_n - facts["reused_tokens"], 0)
        facts["recomputed_tokens"] = max(prompt_len - cached_n, 0)
        facts.update(reuse=outcome, prefill_leg_s=round(prefill_leg_s, 6), prefill_attempts=attempts)
        metrics.reused_tokens.labels(config.mode, "remote_decode").inc(facts["reused_tokens"])
        metrics.reused_tokens.labels(config.mode, "local_prefix").inc(facts["prefill_cached_tokens"])
        metrics.reused_tokens.labels(config.mode, "recomputed").inc(facts["recomputed_tokens"])
        return await decode_leg(endpoint, body, decode, p_params, session, facts, t_arrival, waited,
                                new_ids)

    async def decode_leg(endpoint, body, decode: Worker, p_params, session, facts, t_arrival, waited,
                         new_ids):
        d_body = dict(body)
        d_body["return_token_ids"] = True
        if p_params is not None:
            d_body["kv_transfer_params"] = p_params
        headers = {"x-request-id": facts["request_id"]}
        if facts.get("reuse"):
            headers["x-turnscope-reuse"] = facts["reuse"]
        if facts.get("prefill_leg_s") is not None:
            headers["x-turnscope-prefill-ms"] = f"{facts['prefill_leg_s'] * 1000:.3f}"
            headers["x-turnscope-prefill-engine"] = facts["prefill_engine"]
        headers["x-turnscope-decode-engine"] = decode.name
        outcome_label = facts.get("reuse") or "none"
        metrics.requests.labels(config.mode, outcome_label).inc()

        def finish(d_handle: dict | None, prompt_ids: list[int], gen_ids: list[int], status: str):
            if session and p_params is not None:
                if d_handle and d_handle.get("remote_block_ids"):
                    table.put(session, d_handle, decode.name, (prompt_ids or new_ids or []) + gen_ids)
                else:
                    table.mark_no_handle(session)
            log.info(json.dumps({"event": "request", "status": status,
                                 "handle_returned": bool(d_handle), **facts}))

        if not body.get("stream"):
            t0 = time.perf_counter()
            r = await client().post(decode.url + endpoint, json=d_body, timeout=config.decode_timeout_s)
            metrics.overhead.observe(max(t0 - t_arrival - waited, 0.0))
            if r.status_code != 200:
                finish(None, [], [], f"http_{r.status_code}")
                return Response(r.content, status_code=r.status_code, headers=headers,
                                media_type="application/json")
            data = r.json()
            d_handle = data.pop("kv_transfer_params", None)
            choice = (data.get("choices") or [{}])[0]
            finish(d_handle, data.get("prompt_token_ids") or choice.get("prompt_token_ids") or [],
                   choice.get("token_ids") or [], "ok")
            data["turnscope"] = public_facts(facts)
            return JSONResponse(data, headers=headers)

        body_stream = stream_decode(endpoint, d_body, decode, facts, t_arrival, waited, finish)
        first = await anext(body_stream)  # surfaces D's HTTP status before the headers go out
        if isinstance(first, Response):
            first.headers.update(headers)
            return first

        async def chain():
            yield first
            async for piece in body_stream:
                yield piece

        return StreamingResponse(chain(), media_type="text/event-stream", headers=headers)

    async def stream_decode(endpoint, d_body, decode: Worker, facts, t_arrival, waited, finish):
        prompt_ids: list[int] = []
        gen_ids: list[int] = []
        d_handle = None
        first_token_seen = False
        finished = False
        t0 = time.perf_counter()
        metrics.overhead.observe(max(t0 - t_arrival - waited, 0.0))
        try:
            async with aconnect_sse(client(), "POST", decode.url + endpoint, json=d_body,
                                    timeout=config.decode_timeout_s) as source:
                if source.response.status_code != 200:
                    content = await source.response.aread()
                    finished = True
                    finish(None, [], [], f"http_{source.response.status_code}")
                    yield Response(content, status_code=source.response.status_code,
                                   media_type="application/json")
                    return
                yield b": turnscope\n\n"  # an SSE comment: sends the headers, ignored by clients
                async for event in source.aiter_sse():
                    if event.data == "[DONE]":
                        # Keep the handle before the client can hang up on [DONE] (which cancels us).
                        finished = True
                        finish(d_handle, prompt_ids, gen_ids, "ok")
                        if d_handle is None:
                            yield sse({"object": "turnscope.facts", "choices": [],
                                       "turnscope": public_facts(facts)})
                        yield b"data: [DONE]\n\n"
                        continue
                    chunk = json.loads(event.data)
                    if "kv_transfer_params" in chunk:
                        d_handle = chunk.pop("kv_transfer_params")
                        chunk["turnscope"] = public_facts(facts)
                        yield sse(chunk)
                        continue
                    if chunk.get("prompt_token_ids"):
                        prompt_ids = chunk["prompt_token_ids"]
                    for choice in chunk.get("choices") or ():
                        if choice.get("prompt_token_ids"):
                            prompt_ids = choice["prompt_token_ids"]
                        if choice.get("token_ids"):
                            gen_ids.extend(choice["token_ids"])
                            if not first_token_seen:
                                first_token_seen = True
                                metrics.ttft.labels(config.mode, facts.get("reuse") or "none").observe(
                                    time.perf_counter() - t_arrival)
                    yield f"data: {event.data}\n\n".encode()
        except httpx.HTTPError as exc:
            if not finished:
                finished = True
                finish(None, [], [], f"error: {type(exc).__name__}")
                yield sse({"error": {"message": f"decode worker {decode.name}: {type(exc).__name__}: {exc}",
                                     "type": "decode_failed"}})
        finally:
            if not finished:  # client went away mid-stream, or D ended without [DONE]
                finish(None, [], [], "incomplete")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await generate("/v1/chat/completions", request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate("/v1/completions", request)

    return app


def public_facts(facts: dict) -> dict:
    """The per-request facts sent to the client in the final chunk's ``turnscope`` field."""
    keys = ("reuse", "prefill_cached_tokens", "remote_tokens", "reused_tokens", "recomputed_tokens",
            "handle_age_s", "divergence_position", "prefill_leg_s", "prefill_attempts")
    return {k: facts.get(k) for k in keys}


def sse(obj: dict) -> bytes:
    """One SSE ``data:`` event holding ``obj`` as JSON."""
    return f"data: {json.dumps(obj)}\n\n".encode()
