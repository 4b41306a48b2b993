"""Latency the session-aware proxy adds per request, side by side with a plain pass-through.

A stub vLLM backend (``tests/integration/pd_stub.py``, its own process) answers the prefill leg
after ``--prefill-ms`` and streams decode tokens ``--itl-ms`` apart after ``--ttft-ms``. For 1, 64
and 256 concurrent streams the client measures TTFT (request sent -> first token event):

* ``direct``: prefill leg + decode leg sent by the client itself, back to back (the floor);
* ``passthrough``: through a plain FastAPI + httpx streaming pass-through (its own process);
* ``turnscope``: through the turnscope proxy in ``pd-bidir`` mode (its own process), every request
  a new session's first turn (P leg + D leg).

Added latency = proxy TTFT - direct TTFT, per percentile. Target (issue 3): <= 1 ms p50 and
<= 3 ms p99 added at 256 streams. All processes share this machine's cores, so absolute numbers
include contention; the ratios are measured in the same run.

    .venv/bin/python bench/proxy_overhead.py --requests 400
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from httpx_sse import aconnect_sse

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.integration.vllm_stack import free_port

STUB = """
import sys, uvicorn
from tests.integration.pd_stub import prefill_app, decode_app
from fastapi import FastAPI
role, port, delay_ms, ttft_ms, itl_ms = sys.argv[1], int(sys.argv[2]), *map(float, sys.argv[3:6])
app = prefill_app(delay_s=delay_ms / 1000) if role == "prefill" else decode_app(gen=8, itl_s=itl_ms / 1000)
uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
"""

PASSTHROUGH = """
import sys, httpx, uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
upstream, port = sys.argv[1], int(sys.argv[2])
app = FastAPI()
client = httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=None))
@app.post("/v1/completions")
async def completions(request: Request):
    req = client.build_request("POST", upstream + "/v1/completions", content=await request.body(),
                               headers={"content-type": "application/json"})
    r = await client.send(req, stream=True)
    async def body():
        async for chunk in r.aiter_raw():
            yield chunk
        await r.aclose()
    return StreamingResponse(body(), media_type="text/event-stream")
@app.get("/health")
async def health():
    return {}
uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
"""


def spawn(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, env=os.environ | {"PYTHONPATH": str(ROOT)})


def wait(url: str) -> None:
    for _ in range(200):
        try:
            httpx.get(url + "/health", timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not start")


async def first_token(client: httpx.AsyncClient, url: str, body: dict) -> float:
    """Seconds from send to the first event carrying a token; reads the stream to its end."""
    t0 = time.perf_counter()
    ttft = None
    async with aconnect_sse(client, "POST", url + "/v1/completions", json=body) as source:
        async for event in source.aiter_sse():
            if ttft is None and event.data != "[DONE]" and '"token_ids"' in event.data:
                ttft = time.perf_counter() - t0
    return ttft


async def direct(client: httpx.AsyncClient, p_url: str, d_url: str, body: dict) -> float:
    t0 = time.perf_counter()
    r = await client.post(p_url + "/v1/completions", json=body | {"stream": False, "max_tokens": 1})
    body = body | {"kv_transfer_params": r.json()["kv_transfer_params"]}
    return (time.perf_counter() - t0) + await first_token(client, d_url, body)


async def run(kind: str, streams: int, requests: int, urls: dict) -> np.ndarray:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    samples: list[float] = []
    counter = iter(range(requests))
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        async def worker():
            for i in counter:
                body = {"model": "m", "prompt": list(range(64)), "max_tokens": 8, "stream": True,
                        "conversation_id": f"{kind}-{streams}-{i}"}
                if kind == "direct":
                    samples.append(await direct(client, urls["p"], urls["d"], body))
                elif kind == "direct_d":
                    samples.append(await first_token(client, urls["d"], body))
                else:
                    samples.append(await first_token(client, urls[kind], body))
        await asyncio.gather(*(worker() for _ in range(streams)))
    return np.array(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="1,64,256")
    ap.add_argument("--requests", type=int, default=400, help="requests per (path, concurrency)")
    ap.add_argument("--prefill-ms", type=float, default=20.0)
    ap.add_argument("--ttft-ms", type=float, default=0.0)
    ap.add_argument("--itl-ms", type=float, default=5.0)
    args = ap.parse_args()
    ports = {k: free_port() for k in ("p", "d", "passthrough", "turnscope")}
    urls = {k: f"http://127.0.0.1:{v}" for k, v in ports.items()}
    procs = [spawn(STUB, "prefill", str(ports["p"]), str(args.prefill_ms), "0", "0"),
             spawn(STUB, "decode", str(ports["d"]), "0", str(args.ttft_ms), str(args.itl_ms)),
             spawn(PASSTHROUGH, urls["d"], str(ports["passthrough"]))]
    cfg = Path(tempfile.mkdtemp()) / "proxy.json"
    cfg.write_text(json.dumps({"mode": "pd-bidir", "prefill": [{"name": "p", "url": urls["p"]}],
                               "decode": [{"name": "d", "url": urls["d"]}]}))
    procs.append(subprocess.Popen([sys.executable, "-m", "serving.proxy_server", str(cfg), "--port",
                                   str(ports["turnscope"]), "--log-level", "warning"], cwd=ROOT))
    try:
        for url in urls.values():
            wait(url)
        print(f"stub: prefill {args.prefill_ms} ms, decode ITL {args.itl_ms} ms; {args.requests} requests each")
        print(f"{'streams':>7} {'path':>11} {'TTFT p50 ms':>12} {'p99 ms':>8} {'added p50':>10} {'added p99':>10}")
        # a plain pass-through forwards to D only, so it is compared with the client going to D directly;
        # the turnscope proxy runs both legs, so it is compared with the client running both legs
        pairs = (("direct_d", "passthrough"), ("direct", "turnscope"))
        for n in map(int, args.streams.split(",")):
            for base_kind, kind in pairs:
                b50, b99 = np.percentile(asyncio.run(run(base_kind, n, args.requests, urls)), [50, 99]) * 1000
                p50, p99 = np.percentile(asyncio.run(run(kind, n, args.requests, urls)), [50, 99]) * 1000
                print(f"{n:>7} {base_kind:>11} {b50:>12.2f} {b99:>8.2f}")
                print(f"{n:>7} {kind:>11} {p50:>12.2f} {p99:>8.2f} {p50 - b50:>+10.2f} {p99 - b99:>+10.2f}")
    finally:
        for p in procs:
            p.terminate()


if __name__ == "__main__":
    main()
