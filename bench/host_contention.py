"""Host contention: a request's TTFT alone and beside k other requests streaming their replies,
side by side in one run (k interleaved, 0 1 2 0 1 2 ...; ``--streams``).

Starts one mode's stack on the embedded default the way ``turnscope eval`` does (``ModeStack``: the
workers pinned to their cores, the proxy its own process, unpinned), warms it up, then per rep and
per k: k background requests (``--stream-prompt-tokens`` prompt, ``--stream-tokens`` output, each
read to its end by a client thread, as the load generator reads a turn) are started, and after
``--lead-s`` (they are decoding by then) the measured request (``--prompt-tokens`` fresh token ids,
one output token) is sent; its TTFT is the time to its first streamed event, its P leg the proxy's
``x-turnscope-prefill-ms``. Prints per k the median TTFT and P leg and their ratio to k = 0, and the
growth per stream: the least-squares slope through the origin of (median TTFT at k / median TTFT
at 0 - 1) on k. With ``--pin-host-to CORE`` the proxy and this client are pinned to that core
(``os.sched_setaffinity``), to see where the contention comes from.

Measured on the embedded default (2 cores, P on core 0, D on core 1), ``pd-nocache``, 1,000-token
prompts beside 300-token prompts decoding 400 tokens, 2026-12-05 (docs/log/held-out.md, what the model lacks):

* k = 0..4, 10 reps: TTFT 98.2 / 117.7 / 121.8 / 131.5 / 132.7 ms (1.20x, 1.24x, 1.34x, 1.35x), P
  leg 82.3 / 96.0 / 96.0 / 102.7 / 103.3 ms: the first stream costs most, the later ones less;
* k = 0..2, 12 reps: TTFT 106.2 / 123.4 / 129.1 ms (1.16x, 1.22x), P leg 89.8 / 101.9 / 105.1 ms;
* with the proxy and the client pinned to D's core (k = 0..2, 12 reps), P's leg 107.0 / 107.0 /
  110.2 ms, flat: the proxy and the client relaying the other streams' tokens take P's core, not
  D's decoding beside it.

    .venv/bin/python bench/host_contention.py --reps 12
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from httpx_sse import connect_sse

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serving.embedded_model import ensure_model
from serving.stack import ModeStack
from serving.topology import embedded_topology
from turnscope.conductor.evaluation import warm_up
from turnscope.conductor.settings import TurnscopeSettings

#: The numbers of other requests streaming beside the measured one, interleaved in this order.
STREAMS = (0, 1, 2)


class Client:
    """Streamed ``/v1/completions`` requests of fresh random token ids through one proxy."""

    def __init__(self, proxy_url: str, model: str, seed: int = 1):
        self.url, self.model = proxy_url + "/v1/completions", model
        self.rng = random.Random(seed)
        self.lock = threading.Lock()

    def ids(self, n: int) -> list[int]:
        with self.lock:
            return [self.rng.randrange(10, 2000) for _ in range(n)]

    def stream(self, prompt_tokens: int, max_tokens: int) -> tuple[float, float | None]:
        """Send one request and read its stream to the end: (TTFT s, the proxy's P leg s or None)."""
        body = {"model": self.model, "prompt": self.ids(prompt_tokens), "max_tokens": max_tokens,
                "temperature": 0, "stream": True, "ignore_eos": True}
        with httpx.Client(timeout=300) as c:
            t0 = time.perf_counter()
            with connect_sse(c, "POST", self.url, json=body) as source:
                source.response.raise_for_status()
                first = None
                for _ in source.iter_sse():
                    if first is None:
                        first = time.perf_counter() - t0
                leg = source.response.headers.get("x-turnscope-prefill-ms")
        return first, float(leg) / 1000 if leg else None


def growth_per_stream(median_ttft: dict[int, float]) -> float:
    """Least-squares slope through the origin of (TTFT at k / TTFT at 0 - 1) on k, k > 0."""
    ks = [k for k in median_ttft if k > 0]
    return sum(k * (median_ttft[k] / median_ttft[0] - 1) for k in ks) / sum(k * k for k in ks)


def measure(client: Client, reps: int, prompt_tokens: int, stream_prompt_tokens: int, stream_tokens: int,
            lead_s: float, streams: tuple[int, ...] = STREAMS) -> dict[int, list[tuple[float, float | None]]]:
    """Per k of ``streams`` (0 first), ``reps`` (TTFT, P leg) of the measured request, k interleaved."""
    out: dict[int, list[tuple[float, float | None]]] = {k: [] for k in streams}
    for _ in range(reps):
        for k in streams:
            background = [threading.Thread(target=client.stream, args=(stream_prompt_tokens, stream_tokens))
                          for _ in range(k)]
            for t in background:
                t.start()
            if k:
                time.sleep(lead_s)
            out[k].append(client.stream(prompt_tokens, 1))
            for t in background:
                t.join()
            time.sleep(0.3)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default="pd-nocache")
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--streams", default=",".join(map(str, STREAMS)),
                    help="numbers of other streams, comma-separated, 0 first")
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--stream-prompt-tokens", type=int, default=300)
    ap.add_argument("--stream-tokens", type=int, default=400)
    ap.add_argument("--lead-s", type=float, default=0.5, help="seconds the background streams start ahead")
    ap.add_argument("--pin-host-to", type=int, default=None, help="pin the proxy and this client to this core")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    a = ap.parse_args(argv)
    settings = TurnscopeSettings.load()
    topo = embedded_topology(str(ensure_model(settings.model)))
    model = topo.served_model_name or topo.model
    with ModeStack(a.mode, topo, Path(tempfile.mkdtemp(prefix="ts-contention-"))) as stack:
        if a.pin_host_to is not None:
            for pid in (0, stack.proxy.pid):
                for tid in os.listdir(f"/proc/{pid or os.getpid()}/task"):
                    os.sched_setaffinity(int(tid), {a.pin_host_to})
        print("warm-up:", ", ".join(warm_up(stack.proxy_url, model, a.prompt_tokens)), flush=True)
        client = Client(stack.proxy_url, model)
        streams = tuple(int(k) for k in a.streams.split(","))
        if streams[0] != 0:
            ap.error("--streams must start with 0 (the reference)")
        res = measure(client, a.reps, a.prompt_tokens, a.stream_prompt_tokens, a.stream_tokens, a.lead_s, streams)
    ttft = {k: statistics.median(t for t, _ in v) for k, v in res.items()}
    leg = {k: statistics.median(p for _, p in v if p is not None) for k, v in res.items() if any(p for _, p in v)}
    for k in streams:
        print(f"{k} other stream(s): TTFT median {1e3 * ttft[k]:.1f} ms ({ttft[k] / ttft[0]:.3f}x)"
              + (f", P leg median {1e3 * leg[k]:.1f} ms ({leg[k] / leg[0]:.3f}x)" if k in leg else "")
              + f", n={len(res[k])}")
    k_ttft = growth_per_stream(ttft)
    print(f"growth per stream (TTFT): {k_ttft:.3f}" + (f"; P leg: {growth_per_stream(leg):.3f}" if leg else ""))
    if a.json:
        a.json.write_text(json.dumps({"mode": a.mode, "reps": a.reps, "prompt_tokens": a.prompt_tokens,
                                      "ttft_median_s": ttft, "prefill_leg_median_s": leg,
                                      "ttft_growth_per_stream": k_ttft}, indent=1))


if __name__ == "__main__":
    main()
