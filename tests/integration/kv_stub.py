"""Stub prefill (P) and decode (D) workers with real block memory, a KV oracle and injected faults.

For reliability tests of turnscope's proxy and loadgen without vLLM. It speaks what the proxy uses
of vLLM with the NixlConnector's bidirectional KV transfer:

* ``POST /tokenize``: the char-level ChatML tokenizer of ``tests/integration/openai_stub.py``.
* ``POST /v1/chat/completions`` and ``/v1/completions``:

  - a *prefill leg* (``kv_transfer_params.do_remote_decode``; ``max_tokens`` 1, not streamed):
    P computes the prompt's KV into blocks of its own. With a handle (``remote_block_ids``) it first
    pulls D's blocks (``POST <remote_host>:<remote_port>/_pull``) and uses their contents for the
    first ``min(remote_num_tokens, prompt length)`` positions, without checking that they match
    the prompt (vLLM does not either). It answers with its params; ``remote_prefill_cached_tokens``
    is the number of tokens pulled.
  - a *decode leg* (``kv_transfer_params.do_remote_prefill``): D pulls P's blocks, generates
    ``max_tokens`` ids from that KV (:func:`gen_ids`, a hash of the KV ids), streams them (token ids,
    per-chunk usage, prompt ids in the first chunk), then a chunk with its handle (the streamed
    handle of vLLM PR 40186) and ``[DONE]``. It holds blocks with the KV of prompt + generated[:-1]
    until they are read once or ``ttl_s`` passes (``decoder_kv_blocks_ttl``).
  - a request without params: computed from the prompt alone, streamed.

* Memory is memory: a freed block goes back to a free list and is reused lowest id first, so a read
  of freed blocks returns whatever occupies them now. Each process start has a new engine id; a
  pull that names another engine id fails (as NIXL's handshake does) and the puller recomputes.

The oracle, independent of the proxy and the client: the output of a request is
``gen_ids(prompt ids, max_tokens)`` exactly when its KV equals its prompt's ids; every decode
records whether it did (``kv_ok``), and every pull of blocks not held for the named request
(freed, expired, or another request's) is an ``invalid_read``. Events go to ``events`` (and, with
``stats_file``, to a JSON-lines file that survives a SIGKILL of the process).

Faults, by this worker's generate-request index (0-based since its start; prefill legs, decode
legs and plain requests alike): ``{"what": "status", "status": 500}`` answers that status;
``{"what": "hang", "hang_s": s, "after": k}`` stops answering for ``s`` seconds (a decode leg after
``k`` tokens); ``{"what": "drop", "after": k}`` closes the connection after ``k`` tokens (decode);
``{"what": "kill", "after": k}`` SIGKILLs the whole process (a prefill leg: on receipt; a decode
leg: after ``k`` tokens); ``{"what": "corrupt_kv"}`` makes the KV a leg pulls wrong at one position
(the leg answers 200; its tokens, or the next leg's, are then wrong: ``kv_ok`` false). Run as a process: ``python -m tests.integration.kv_stub --role decode
--port N [--ttl-s S] [--block-size B] [--stats-file F] [--faults JSON]``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import heapq
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Self

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tests.integration.openai_stub import CHAR_BASE, XY, encode, render

REPO = Path(__file__).resolve().parents[2]
ALPHABET = "abcdefgh "


def gen_ids(kv_ids: list[int], n: int) -> list[int]:
    """The ``n`` ids a worker generates from KV ``kv_ids``: a pure function of the ids (so the
    same prompt KV always gives the same output and any other KV, almost surely, another). About
    one id in six is ``XY``, which decodes to ``"xy"`` but re-encodes as two ids (x, y): the text
    history then diverges from the generated ids, as with a real BPE model."""
    rng = random.Random(hashlib.sha256(",".join(map(str, kv_ids)).encode()).digest())
    return [XY if rng.random() < 0.16 else CHAR_BASE + ord(rng.choice(ALPHABET)) for _ in range(n)]


def decode_text(ids: list[int]) -> str:
    return "".join("xy" if t == XY else chr(t - CHAR_BASE) if t >= CHAR_BASE else "" for t in ids)


def prompt_ids_of(body: dict[str, Any], chat: bool) -> list[int]:
    if chat:
        return encode(render(body["messages"], True))
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return [int(t) for t in prompt]
    return encode(str(prompt))


class Memory:
    """Block memory of one worker: ``blocks`` (id -> token ids held), a lowest-first free list,
    and the requests holding blocks (id -> (block ids, expiry monotonic s))."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.blocks: dict[int, list[int]] = {}
        self.free: list[int] = []
        self.next_id = 0
        self.held: dict[str, tuple[list[int], float]] = {}

    def alloc(self, ids: list[int]) -> list[int]:
        out = []
        for i in range(0, max(len(ids), 1), self.block_size):
            b = heapq.heappop(self.free) if self.free else self._new()
            self.blocks[b] = list(ids[i:i + self.block_size])
            out.append(b)
        return out

    def _new(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def hold(self, request_id: str, ids: list[int], ttl_s: float) -> list[int]:
        blocks = self.alloc(ids)
        self.held[request_id] = (blocks, time.monotonic() + ttl_s)
        return blocks

    def release(self, request_id: str) -> None:
        blocks, _ = self.held.pop(request_id, ([], 0.0))
        for b in blocks:
            heapq.heappush(self.free, b)

    def expire(self) -> None:
        now = time.monotonic()
        for rid in [r for r, (_, exp) in self.held.items() if exp <= now]:
            self.release(rid)

    def read(self, request_id: str, block_ids: list[int], num_tokens: int) -> tuple[list[int], bool]:
        """Contents of ``block_ids`` (up to ``num_tokens``) and whether they are ``request_id``'s
        live blocks (a prefix of them); a valid read frees the request's blocks (single use)."""
        self.expire()
        held = self.held.get(request_id)
        valid = held is not None and held[0][: len(block_ids)] == list(block_ids)
        tokens: list[int] = []
        for b in block_ids:
            tokens.extend(self.blocks.get(b, [-1] * self.block_size))
        if valid:
            self.release(request_id)
        return tokens[:num_tokens], valid


def kv_app(role: str, port: int, *, block_size: int = 4, ttl_s: float = 480.0, stats_file: str | None = None,
           faults: dict[int, dict[str, Any]] | None = None, itl_s: float = 0.0, prefill_s: float = 0.0) -> FastAPI:
    """The stub worker app. ``role`` is ``prefill`` or ``decode`` (names only: both serve both
    legs); ``port`` is where it listens (it is put in the params it returns)."""
    app = FastAPI()
    engine_id = f"{role}-{uuid.uuid4().hex[:8]}"
    mem = Memory(block_size)
    st = app.state
    st.engine_id, st.memory, st.events, st.requests = engine_id, mem, [], 0
    st.faults = dict(faults or {})
    lock = asyncio.Lock()

    def event(**e: Any) -> None:
        e.update(engine=engine_id, at=time.time())
        st.events.append(e)
        if stats_file:
            with open(stats_file, "a") as f:
                f.write(json.dumps(e) + "\n")
                f.flush()

    async def pull(params: dict[str, Any], num_tokens: int) -> list[int] | None:
        """Read the remote blocks named by ``params``; None when the transfer fails."""
        url = f"http://{params.get('remote_host')}:{params.get('remote_port')}/_pull"
        req = {"engine_id": params.get("remote_engine_id"), "request_id": params.get("remote_request_id"),
               "block_ids": (params.get("remote_block_ids") or [[]])[0], "num_tokens": num_tokens}
        try:
            async with httpx.AsyncClient(timeout=10) as c:
                r = await c.post(url, json=req)
            data = r.json()
        except (httpx.HTTPError, ValueError) as e:
            event(event="pull_failed", reason=f"{type(e).__name__}: {e}")
            return None
        if not data.get("ok"):
            event(event="pull_failed", reason=data.get("reason"))
            return None
        return data["tokens"]

    @app.post("/_pull")
    async def serve_pull(request: Request):
        body = await request.json()
        if body.get("engine_id") != engine_id:
            return {"ok": False, "reason": f"engine id {body.get('engine_id')} is not {engine_id} (restarted?)"}
        async with lock:
            tokens, valid = mem.read(body.get("request_id"), body.get("block_ids") or [], int(body["num_tokens"]))
        if not valid:
            event(event="invalid_read", request_id=body.get("request_id"), block_ids=body.get("block_ids"))
        return {"ok": True, "tokens": tokens, "valid": valid}

    @app.post("/_fault")
    async def set_fault(request: Request):
        body = await request.json()
        st.faults[int(body.pop("at"))] = body
        return {"ok": True}

    @app.get("/_stats")
    async def stats():
        return {"engine_id": engine_id, "requests": st.requests, "held": len(mem.held), "events": st.events}

    @app.get("/health")
    async def health():
        return {}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await request.json()
        if "messages" in body:
            ids = encode(render(body["messages"], bool(body.get("add_generation_prompt", True))))
        else:
            ids = encode(body.get("prompt") or "")
        return {"tokens": ids, "count": len(ids), "max_model_len": 1 << 20}

    def corrupted(pulled: list[int], fault: dict[str, Any] | None) -> list[int]:
        """The pulled KV, its middle token's KV wrong under a ``corrupt_kv`` fault (a pull that
        "recovered" with garbage: the request still answers 200)."""
        if not fault or fault["what"] != "corrupt_kv" or not pulled:
            return pulled
        out = list(pulled)
        out[len(out) // 2] += 1
        return out

    async def generate(request: Request, chat: bool):
        body = await request.json()
        idx = st.requests
        st.requests += 1
        fault = st.faults.pop(idx, None)
        params = body.get("kv_transfer_params") or {}
        prompt = prompt_ids_of(body, chat)
        leg = "prefill" if params.get("do_remote_decode") else "decode" if params.get("do_remote_prefill") else "plain"
        if fault:
            event(event="fault", index=idx, leg=leg, **fault)
            if fault["what"] == "status":
                return JSONResponse({"error": {"message": f"injected HTTP {fault['status']} by {engine_id}"}},
                                    status_code=fault["status"])
            if leg == "prefill" and fault["what"] == "kill":
                await asyncio.sleep(fault.get("delay_s", 0.2))  # the leg is under way
                os.kill(os.getpid(), signal.SIGKILL)
            if leg == "prefill" and fault["what"] == "hang":
                await asyncio.sleep(fault["hang_s"])
        if leg == "prefill":
            return await prefill(body, params, prompt, idx, fault)
        return await decode(body, params, prompt, chat, idx, leg, fault)

    async def prefill(body, params, prompt, idx, fault):
        await asyncio.sleep(prefill_s)
        kv, pulled = list(prompt), 0
        if params.get("remote_block_ids"):
            n = min(int(params.get("remote_num_tokens") or 0), len(prompt))
            got = await pull(params, n)
            if got is not None:
                pulled = len(got)
                kv = corrupted(got, fault) + prompt[pulled:]
        rid = f"p-{idx}-{uuid.uuid4().hex[:6]}"
        async with lock:
            mem.expire()
            blocks = mem.hold(rid, kv, ttl_s)
        event(event="prefill", index=idx, prompt_len=len(prompt), pulled=pulled,
              kv_ok=kv == prompt, handle=bool(params.get("remote_block_ids")))
        first = gen_ids(kv, 1)
        return {"id": f"cmpl-{rid}", "object": "text_completion", "model": body.get("model"),
                "choices": [{"index": 0, "text": decode_text(first), "token_ids": first, "finish_reason": "length"}],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": 1, "total_tokens": len(prompt) + 1},
                "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False,
                                       "remote_block_ids": [blocks], "remote_engine_id": engine_id,
                                       "remote_request_id": rid, "remote_host": "127.0.0.1", "remote_port": port,
                                       "remote_num_tokens": len(kv), "remote_prefill_cached_tokens": pulled}}

    async def decode(body, params, prompt, chat, idx, leg, fault):
        kv = list(prompt)
        if leg == "decode":
            got = await pull(params, len(prompt))
            if got is not None:
                kv = corrupted(got, fault) + prompt[len(got):]
        n = int(body.get("max_tokens") or 16)
        gen = gen_ids(kv, n)
        rid = f"d-{idx}-{uuid.uuid4().hex[:6]}"
        event(event="decode", index=idx, leg=leg, prompt_len=len(prompt), kv_ok=kv == prompt,
              prompt_sha=hashlib.sha256(",".join(map(str, prompt)).encode()).hexdigest(), gen=gen)
        obj = "chat.completion.chunk" if chat else "text_completion"
        P = len(prompt)

        def keep_blocks() -> dict[str, Any] | None:
            """D's handle (bidirectional): its blocks with the KV of prompt + generated[:-1]."""
            if leg != "decode" or not params:
                return None
            mem.expire()
            kept = kv + gen[:-1]
            blocks = mem.hold(rid, kept, ttl_s)
            return {"do_remote_prefill": False, "do_remote_decode": True, "remote_block_ids": [blocks],
                    "remote_engine_id": engine_id, "remote_request_id": rid, "remote_host": "127.0.0.1",
                    "remote_port": port, "remote_num_tokens": len(kept), "remote_blocks_expiry_time": time.time() + ttl_s}

        if not body.get("stream"):
            async with lock:
                handle = keep_blocks()
            choice: dict[str, Any] = {"index": 0, "token_ids": gen, "finish_reason": "length"}
            if chat:
                choice["message"] = {"role": "assistant", "content": decode_text(gen)}
            else:
                choice.update(text=decode_text(gen), prompt_token_ids=prompt)
            resp = {"id": rid, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
                    "usage": {"prompt_tokens": P, "completion_tokens": n, "total_tokens": P + n},
                    "kv_transfer_params": handle}
            if chat:
                resp["prompt_token_ids"] = prompt
            return JSONResponse(resp)

        def chunk(i: int, t: int | None, finish: str | None = None) -> str:
            choice: dict[str, Any] = {"index": 0, "token_ids": [] if t is None else [t], "finish_reason": finish}
            piece = "" if t is None else decode_text([t])
            if chat:
                choice["delta"] = {"content": piece} if t is not None else {}
            else:
                choice["text"] = piece
                if i == 0:
                    choice["prompt_token_ids"] = prompt
            c: dict[str, Any] = {"id": rid, "object": obj, "choices": [choice],
                                 "usage": {"prompt_tokens": P, "completion_tokens": i + (t is not None),
                                           "total_tokens": P + i + (t is not None)}}
            if chat and i == 0:
                c["prompt_token_ids"] = prompt
            return f"data: {json.dumps(c)}\n\n"

        async def events():
            for i, t in enumerate(gen):
                if fault and i == fault.get("after", 0):
                    if fault["what"] == "drop":
                        raise ConnectionAbortedError("injected: connection dropped mid-stream")
                    if fault["what"] == "kill":
                        os.kill(os.getpid(), signal.SIGKILL)
                    if fault["what"] == "hang":
                        await asyncio.sleep(fault["hang_s"])
                if i:
                    await asyncio.sleep(itl_s)
                yield chunk(i, t)
            yield chunk(len(gen), None, "length")
            async with lock:
                handle = keep_blocks()
            if handle is not None:
                yield f"data: {json.dumps({'id': rid, 'object': obj, 'choices': [], 'kv_transfer_params': handle})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, False)

    return app


def read_events(stats_file: Path) -> list[dict[str, Any]]:
    """Every event a stub process wrote to ``stats_file`` (across restarts)."""
    if not Path(stats_file).exists():
        return []
    return [json.loads(line) for line in Path(stats_file).read_text().splitlines() if line.strip()]


class StubProcess:
    """A stub worker in a process of its own (so that it can be SIGKILLed and restarted on the
    same port); events go to ``stats_file``."""

    def __init__(self, role: str, port: int, stats_file: Path, *, block_size: int = 4, ttl_s: float = 480.0,
                 itl_s: float = 0.0, prefill_s: float = 0.0):
        self.role, self.port, self.stats_file = role, port, Path(stats_file)
        self.args = ["--block-size", str(block_size), "--ttl-s", str(ttl_s), "--itl-s", str(itl_s),
                     "--prefill-s", str(prefill_s)]
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self, faults: dict[int, dict[str, Any]] | None = None, timeout_s: float = 30.0) -> StubProcess:
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        argv = [sys.executable, "-m", "tests.integration.kv_stub", "--role", self.role, "--port", str(self.port),
                "--stats-file", str(self.stats_file), "--faults", json.dumps(faults or {}), *self.args]
        self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.starts += 1
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"stub {self.role} exited with {self.proc.returncode} while starting")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError(f"stub {self.role} did not start on port {self.port}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait(10)

    def events(self) -> list[dict[str, Any]]:
        return read_events(self.stats_file)


class ThreadServer:
    """The stub app served by uvicorn in a background thread on ``port`` (a free one by default)."""

    def __init__(self, role: str, port: int | None = None, **kw: Any):
        from tests.integration.vllm_stack import free_port

        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = kv_app(role, self.port, **kw)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                    log_level="critical"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Self:
        self.thread.start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError("stub did not start")

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def events(self) -> list[dict[str, Any]]:
        return list(self.app.state.events)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--ttl-s", type=float, default=480.0)
    ap.add_argument("--itl-s", type=float, default=0.0)
    ap.add_argument("--prefill-s", type=float, default=0.0)
    ap.add_argument("--stats-file")
    ap.add_argument("--faults", default="{}")
    a = ap.parse_args(argv)
    faults = {int(k): v for k, v in json.loads(a.faults).items()}
    app = kv_app(a.role, a.port, block_size=a.block_size, ttl_s=a.ttl_s, stats_file=a.stats_file, faults=faults,
                 itl_s=a.itl_s, prefill_s=a.prefill_s)
    uvicorn.run(app, host="127.0.0.1", port=a.port, log_level="critical")


if __name__ == "__main__":
    main()
