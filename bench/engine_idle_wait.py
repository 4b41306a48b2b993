"""vLLM's idle loops on the CPU platform while a worker holds finished requests' KV: stepping back
to back (vLLM's loop) against waiting for input (``serving.engine_idle_wait``), side by side.

Each round starts a ``pd-bidir`` stack of the embedded default once per variant of
``TURNSCOPE_ENGINE_IDLE_WAIT_MS`` (0: vLLM's own loops), in the order A B, then B A, ...
(``--rounds``), and measures on it:

* **two-turn sessions through the proxy** (turn 0: 1,500 fresh token ids; turn 1 appends the reply
  and 100 more): turn 1's TTFT when it is a ``hit`` (D's KV pulled back), the decode's mean
  inter-token latency (32 tokens, ``ignore_eos``), and the greedy token ids, which must be equal
  across variants token for token;
* **CPU while D holds**: once the sessions are done D still holds their last turns for its TTL
  (480 s), and the CPU seconds each worker's processes use over ``--held-s`` seconds (psutil) are
  taken as % of one core.

It prints the medians per variant (min..max over all samples) and each variant's ratio to the
first. The machine is shared: read medians and the spread, and prefer runs with nothing else on.

    .venv/bin/python bench/engine_idle_wait.py --rounds 2 --variants 0,50
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.nixl_progress import abba_order, idle_cpu_pct, play_two_turn_sessions, side_by_side
from serving import engine_idle_wait
from tests.integration.vllm_stack import ProxyThread, VllmStack


@dataclass
class Launch:
    """One stack start with one wait: the figures measured on it."""

    wait_ms: int
    held_pct: dict[str, float] = field(default_factory=dict)
    pull_ttft_s: list[float] = field(default_factory=list)
    pulled_tokens: list[int] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)


def measure(wait: int, args: argparse.Namespace, log_dir: Path) -> Launch:
    stack = VllmStack("pd-bidir", log_dir / f"wait-{wait}-{time.monotonic_ns()}", reference=False)
    for w in stack.workers:
        w.spec.env[engine_idle_wait.ENV] = str(wait)
    out = Launch(wait)
    try:
        stack.start()
        with ProxyThread(stack.proxy_config()) as proxy:
            play_two_turn_sessions(proxy.url, args.sessions, args.seed, out)
        out.held_pct = idle_cpu_pct(stack, args.held_s)  # D holds every session's last turn for its TTL
    finally:
        stack.stop()
    return out


def report(launches: list[Launch], waits: list[int]) -> None:
    side_by_side({w: [la for la in launches if la.wait_ms == w] for w in waits}, waits, lambda w: f"wait {w} ms",
                 [("turn 1 TTFT, pulled from D", lambda la: la.pull_ttft_s), ("decode ITL", lambda la: la.itl_s)],
                 "CPU while D holds, ", lambda la, role: la.held_pct.get(role))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="0,50", help="comma list of waits, milliseconds (0: vLLM's own loops)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sessions", type=int, default=4, help="two-turn sessions through the proxy per launch")
    ap.add_argument("--held-s", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` stops it: the workers are stopped too
    waits = [int(v) for v in args.variants.split(",")]
    log_dir = Path(tempfile.mkdtemp(prefix="turnscope-engine-idle-wait-"))
    launches: list[Launch] = []
    for r, w in abba_order(waits, args.rounds):
        t = time.monotonic()
        launches.append(measure(w, args, log_dir))
        print(f"round {r + 1} wait {w} ms: {time.monotonic() - t:.0f} s, held {launches[-1].held_pct}", flush=True)
    report(launches, waits)
    print(f"\nworker logs: {log_dir}")


if __name__ == "__main__":
    main()
