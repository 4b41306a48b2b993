"""Latency the session-aware proxy adds per request, where the harness is not the bottleneck.

Cores (this machine has 2): each proxy under test runs pinned to core 1, alone there while it is
measured; the stub workers and this client are pinned to core 0. Stub (``tests/integration/pd_stub.py``,
its own processes): P answers the prefill leg after ``--prefill-ms``; D streams ``--tokens`` token
events ``--itl-ms`` apart, the first one ``--itl-ms`` after the request. Three paths, measured in
interleaved rounds at each concurrency (1, 64, 256 streams, closed loop: a stream sends its next
request when the last one ended):

* ``direct``: the client runs the prefill leg and then the decode stream itself: the harness alone.
  Its TTFT minus the injected ``prefill-ms + itl-ms`` is the **harness's own cost** (client, stubs,
  loopback) at that concurrency;
* ``passthrough``: a plain two-leg P/D proxy (FastAPI + httpx: P's leg, then D's stream relayed
  byte for byte), what any P/D deployment runs (vLLM's ``toy_proxy_server.py`` does the same);
* ``turnscope``: ``serving.proxy_server`` in ``pd-bidir`` mode, every request a new session's first
  turn (no handle: no token guard, which ``bench/guard_cost.py`` measures).

TTFT is request sent -> first SSE event carrying a token (httpx-sse). Added latency of a proxy =
its TTFT minus ``direct``'s, per percentile, per round; the table gives the median over rounds and
the spread (min..max) as the uncertainty, since the harness's own cost is in both terms and varies
from round to round. ``turnscope - passthrough`` is what turnscope adds beyond a plain proxy. Each
proxy's CPU time per request (user + sys of its process over the measurement / requests) and core
0's load (the harness's processes' CPU time / wall time) are printed next to them: a proxy near
1000 ms of CPU per second of wall time is saturated, and so is a harness near it.

Target (the proxy's budget, docs/log/serving.md): <= 1 ms p50 and <= 3 ms p99 added at 256 streams.

    .venv/bin/python bench/proxy_overhead.py
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
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import psutil
from httpx_sse import aconnect_sse

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.integration.vllm_stack import free_port

HARNESS_CORE, PROXY_CORE = 0, 1

STUB = """
import sys, uvicorn
from tests.integration.pd_stub import prefill_app, decode_app
role, port, delay_ms, tokens, itl_ms = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
app = prefill_app(delay_s=delay_ms / 1000) if role == "prefill" else decode_app(gen=tokens, itl_s=itl_ms / 1000)
uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, backlog=4096,
            timeout_keep_alive=300)
"""

PASSTHROUGH = """
import sys, httpx, uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
p_url, d_url, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
app = FastAPI()
client = httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))
@app.post("/v1/completions")
async def completions(request: Request):
    body = await request.json()
    p = await client.post(p_url + "/v1/completions", json=body | {"stream": False, "max_tokens": 1})
    req = client.build_request("POST", d_url + "/v1/completions",
                               json=body | {"kv_transfer_params": p.json()["kv_transfer_params"]})
    r = await client.send(req, stream=True)
    async def relay():
        try:
            async for chunk in r.aiter_raw():
                yield chunk
        finally:
            await r.aclose()
    return StreamingResponse(relay(), media_type="text/event-stream")
@app.get("/health")
async def health():
    return {}
uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, backlog=4096,
            timeout_keep_alive=300)
"""


def spawn(argv: list[str], core: int) -> subprocess.Popen:
    """Start ``argv`` pinned to ``core`` (``taskset`` execs it: the pid is the program's own)."""
    return subprocess.Popen(["taskset", "-c", str(core), *argv], cwd=ROOT, env=os.environ | {"PYTHONPATH": str(ROOT)})


def wait(url: str) -> None:
    for _ in range(300):
        try:
            httpx.get(url + "/health", timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not start")


def cpu_s(proc: psutil.Process) -> float:
    """User + system CPU seconds of ``proc`` itself so far (not its children: this client's
    children are the stubs and proxies, counted on their own)."""
    t = proc.cpu_times()
    return t.user + t.system


async def first_token(client: httpx.AsyncClient, url: str, body: dict, t0: float) -> float:
    """Seconds from ``t0`` to the first event carrying a token; reads the stream to its end."""
    ttft = None
    async with aconnect_sse(client, "POST", url + "/v1/completions", json=body) as source:
        async for event in source.aiter_sse():
            if ttft is None and event.data != "[DONE]" and '"token_ids"' in event.data:
                ttft = time.perf_counter() - t0
    if ttft is None:
        raise RuntimeError(f"{url}: a stream ended without a token event")
    return ttft


async def one_request(client: httpx.AsyncClient, path: str, urls: dict, body: dict) -> float:
    t0 = time.perf_counter()
    if path == "direct":
        r = await client.post(urls["p"] + "/v1/completions", json=body | {"stream": False, "max_tokens": 1})
        body = body | {"kv_transfer_params": r.json()["kv_transfer_params"]}
        return await first_token(client, urls["d"], body, t0)
    return await first_token(client, urls[path], body, t0)


async def measure(path: str, streams: int, requests: int, urls: dict, tag: str) -> tuple[np.ndarray, int]:
    """TTFT samples (seconds) of ``requests`` requests over ``streams`` closed-loop streams, and
    how many requests failed (an HTTP error: counted, not sampled)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    samples: list[float] = []
    failed = 0
    counter = iter(range(requests))
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        async def stream():
            nonlocal failed
            for i in counter:
                body = {"model": "m", "prompt": list(range(64)), "max_tokens": 8, "stream": True,
                        "conversation_id": f"{tag}-{i}"}
                try:
                    samples.append(await one_request(client, path, urls, body))
                except httpx.HTTPError:
                    failed += 1

        await asyncio.gather(*(stream() for _ in range(streams)))
    return np.array(samples), failed


@dataclass
class Round:
    """One path's measurement: TTFT p50/p99 (ms), its proxy's CPU ms per request, core 0's load."""

    p50_ms: float
    p99_ms: float
    proxy_cpu_ms_per_request: float | None
    harness_load: float
    failed: int


def run_path(path: str, streams: int, requests: int, urls: dict, procs: dict, tag: str) -> Round:
    proxy = procs.get(path)
    harness = [procs["p"], procs["d"], psutil.Process()]
    p_cpu0 = cpu_s(proxy) if proxy else 0.0
    h_cpu0 = sum(cpu_s(p) for p in harness)
    t0 = time.perf_counter()
    ttft, failed = asyncio.run(measure(path, streams, requests, urls, tag))
    wall = time.perf_counter() - t0
    p50, p99 = np.percentile(ttft, [50, 99]) * 1000
    return Round(float(p50), float(p99),
                 (cpu_s(proxy) - p_cpu0) * 1000 / requests if proxy else None,
                 (sum(cpu_s(p) for p in harness) - h_cpu0) / wall, failed)


def spread(values: list[float]) -> str:
    """The median of ``values`` with its min..max over rounds."""
    return f"{np.median(values):+.2f} ({min(values):+.2f}..{max(values):+.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="1,64,256", help="concurrent streams, comma-separated")
    ap.add_argument("--requests", default="40,512,1024", help="requests per path and round, per concurrency")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the three paths")
    ap.add_argument("--prefill-ms", type=float, default=50.0, help="the stub P's prefill time")
    ap.add_argument("--tokens", type=int, default=16, help="token events the stub D streams per request")
    ap.add_argument("--itl-ms", type=float, default=50.0, help="the stub D's inter-token latency")
    ap.add_argument("--json", type=Path, help="also write the rounds here")
    args = ap.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("needs 2 cores: the proxy on core 1, the harness on core 0")
    os.sched_setaffinity(0, {HARNESS_CORE})
    ports = {k: free_port() for k in ("p", "d", "passthrough", "turnscope")}
    urls = {k: f"http://127.0.0.1:{v}" for k, v in ports.items()}
    procs = {
        "p": spawn([sys.executable, "-c", STUB, "prefill", str(ports["p"]), str(args.prefill_ms), "0", "0"],
                   HARNESS_CORE),
        "d": spawn([sys.executable, "-c", STUB, "decode", str(ports["d"]), "0", str(args.tokens), str(args.itl_ms)],
                   HARNESS_CORE),
        "passthrough": spawn([sys.executable, "-c", PASSTHROUGH, urls["p"], urls["d"], str(ports["passthrough"])],
                             PROXY_CORE),
    }
    cfg = Path(tempfile.mkdtemp()) / "proxy.json"
    cfg.write_text(json.dumps({"mode": "pd-bidir", "prefill": [{"name": "p", "url": urls["p"]}],
                               "decode": [{"name": "d", "url": urls["d"]}]}))
    procs["turnscope"] = spawn([sys.executable, "-m", "serving.proxy_server", str(cfg), "--port",
                                str(ports["turnscope"]), "--log-level", "warning"], PROXY_CORE)
    ps = {k: psutil.Process(p.pid) for k, p in procs.items()}
    results: dict = {}
    try:
        for url in urls.values():
            wait(url)
        floor_ms = args.prefill_ms + args.itl_ms
        print(f"stub: prefill {args.prefill_ms:g} ms, {args.tokens} tokens {args.itl_ms:g} ms apart (TTFT floor "
              f"{floor_ms:g} ms); proxies on core {PROXY_CORE}, stubs + client on core {HARNESS_CORE}; "
              f"{args.rounds} interleaved rounds")
        for n, requests in zip(map(int, args.streams.split(",")), map(int, args.requests.split(",")), strict=True):
            asyncio.run(measure("turnscope", n, min(n, requests), urls, f"warm-{n}"))  # connections, imports
            asyncio.run(measure("passthrough", n, min(n, requests), urls, f"warm-{n}"))
            rounds: dict[str, list[Round]] = {k: [] for k in ("direct", "passthrough", "turnscope")}
            for r in range(args.rounds):
                for path, samples in rounds.items():
                    samples.append(run_path(path, n, requests, urls, ps, f"{path}-{n}-{r}"))
            results[n] = {k: [vars(x) for x in v] for k, v in rounds.items()}
            print(f"\n{n} stream(s), {requests} requests per path and round")
            print(f"  {'path':<12} {'TTFT p50':>9} {'p99':>9}  {'added p50 vs direct':>24} {'added p99 vs direct':>24}"
                  f"  {'proxy CPU/req':>13} {'core 0 load':>11} {'failed':>6}")
            for path, rs in rounds.items():
                d = rounds["direct"]
                add50 = [x.p50_ms - y.p50_ms for x, y in zip(rs, d, strict=True)]
                add99 = [x.p99_ms - y.p99_ms for x, y in zip(rs, d, strict=True)]
                cpu = [x.proxy_cpu_ms_per_request for x in rs if x.proxy_cpu_ms_per_request is not None]
                added = ("harness " + spread([x.p50_ms - floor_ms for x in rs]),
                         "harness " + spread([x.p99_ms - floor_ms for x in rs])) if path == "direct" \
                    else (spread(add50), spread(add99))
                print(f"  {path:<12} {np.median([x.p50_ms for x in rs]):>9.2f} {np.median([x.p99_ms for x in rs]):>9.2f}"
                      f"  {added[0]:>24} {added[1]:>24}  {(f'{np.median(cpu):.2f} ms' if cpu else '-'):>13}"
                      f" {np.median([x.harness_load for x in rs]):>10.0%} {sum(x.failed for x in rs):>6}")
            t, p = rounds["turnscope"], rounds["passthrough"]
            print(f"  turnscope - passthrough: p50 {spread([x.p50_ms - y.p50_ms for x, y in zip(t, p, strict=True)])}"
                  f" ms, p99 {spread([x.p99_ms - y.p99_ms for x, y in zip(t, p, strict=True)])} ms")
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            p.wait(10)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
