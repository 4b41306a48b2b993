"""Prefill of N tokens vs pulling the same history's KV over NIXL, side by side in one run.

Starts a ``pd-bidir-nocache`` stack (P's prefix cache off, so nothing is reused locally) on the
embedded model and, for each history length N: turn 1 (N tokens) through the proxy, then turn 2
(N + generated + 64 new tokens) twice, interleaved: once carrying D's handle (P pulls the
history over NIXL and computes only the rest) and once as a fresh session (P recomputes all of
it). Prints the prefill-leg times, P's NIXL transfer time and bytes (``vllm:nixl_xfer_time_seconds``
and ``vllm:nixl_bytes_transferred`` deltas) and the ratio.

    .venv/bin/python bench/prefill_vs_pull.py --lengths 1000,2000,4000 --reps 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.integration.vllm_stack import ProxyThread, VllmStack, metric

MODEL = "turnscope-tiny"


def call(url: str, ids: list[int], session: str, max_tokens: int = 16) -> tuple[list[int], httpx.Response]:
    r = httpx.post(url + "/v1/completions", timeout=300, json={
        "model": MODEL, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "conversation_id": session, "return_token_ids": True})
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"], r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="1000,2000,4000")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    rng = random.Random(1)
    stack = VllmStack("pd-bidir-nocache", Path(tempfile.mkdtemp(prefix="ts-bench-")))
    stack.start()
    p_url = stack.worker("prefill").url
    try:
        with ProxyThread(stack.proxy_config()) as proxy:
            call(proxy.url, [rng.randrange(10, 4000) for _ in range(300)], "warm")  # handshakes, compile
            print(f"{'history':>8} {'recompute ms':>13} {'pull ms':>8} {'xfer ms':>8} {'MiB':>6} {'ratio':>6}")
            for n in map(int, args.lengths.split(",")):
                recompute, pull, xfer, mib = [], [], [], []
                for rep in range(args.reps):
                    ids = [rng.randrange(10, 4000) for _ in range(n)]
                    sid = f"b{n}-{rep}"
                    gen, _ = call(proxy.url, ids, sid)
                    ids2 = ids + gen + [rng.randrange(10, 4000) for _ in range(64)]
                    t_before = metric(p_url, "vllm:nixl_xfer_time_seconds_sum")
                    b_before = metric(p_url, "vllm:nixl_bytes_transferred_sum")
                    _, r = call(proxy.url, ids2, sid)
                    assert r.headers["x-turnscope-reuse"] == "hit", r.headers
                    pull.append(float(r.headers["x-turnscope-prefill-ms"]))
                    xfer.append((metric(p_url, "vllm:nixl_xfer_time_seconds_sum") - t_before) * 1000)
                    mib.append((metric(p_url, "vllm:nixl_bytes_transferred_sum") - b_before) / 2**20)
                    _, r = call(proxy.url, ids2, f"fresh-{sid}")
                    recompute.append(float(r.headers["x-turnscope-prefill-ms"]))
                rc, pl = statistics.median(recompute), statistics.median(pull)
                print(f"{n:>8} {rc:>13.0f} {pl:>8.0f} {statistics.median(xfer):>8.1f} "
                      f"{statistics.median(mib):>6.1f} {rc / pl:>5.1f}x")
    finally:
        stack.stop()


if __name__ == "__main__":
    main()
