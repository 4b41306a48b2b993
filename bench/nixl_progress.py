"""NIXL's progress thread on the CPU platform: polling without a pause (nixl's default) against a
pause between polls (``serving.nixl_progress``), side by side in one run.

Each round starts a ``pd-bidir`` stack of the embedded default (P on core 0, D on core 1, every
thread of a worker pinned to its core as ``serving.workers`` does) once per variant, in the order
A B, then B A, ... (``--rounds``), and measures on it:

* **idle CPU**: the CPU seconds each worker's processes use over ``--idle-s`` seconds with no
  request (psutil), as % of one core;
* **P's prefill**: TTFT of streamed completions sent straight to P of fresh token-id prompts (a
  ``cache_salt`` of their own: no prefix-cache hit) of 256 and 2,048 tokens, ``max_tokens`` 1;
* **a pull, through the proxy**: two-turn sessions (turn 0: 1,500 fresh token ids; turn 1 appends
  the reply and 100 more), turn 1's TTFT when it is a ``hit`` and the tokens it pulled, and the
  decode's mean inter-token latency of both turns (32 tokens, ``ignore_eos``);
* **outputs**: the greedy token ids of every turn must be equal across variants, token for token.

It prints the medians per variant (min..max over all samples) and each variant's ratio to the
first. The machine is shared: read medians and the spread, and prefer runs with nothing else on.

    .venv/bin/python bench/nixl_progress.py --rounds 2 --variants 0,100
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
from httpx_sse import connect_sse

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serving import nixl_progress
from tests.integration.vllm_stack import ProxyThread, VllmStack

MODEL = "turnscope-tiny"


@dataclass
class Launch:
    """One stack start with one delay: the figures measured on it."""

    delay_us: int
    idle_pct: dict[str, float] = field(default_factory=dict)
    prefill_s: dict[str, list[float]] = field(default_factory=dict)
    pull_ttft_s: list[float] = field(default_factory=list)
    pulled_tokens: list[int] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)


def idle_cpu_pct(stack: VllmStack, seconds: float) -> dict[str, float]:
    """% of one core each worker's process tree used over ``seconds`` with no request."""
    trees = {w.spec.name: [psutil.Process(w.proc.pid), *psutil.Process(w.proc.pid).children(recursive=True)]
             for w in stack.workers}

    def cpu(procs):
        total = 0.0
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total

    before = {k: cpu(v) for k, v in trees.items()}
    time.sleep(seconds)
    return {k: round((cpu(v) - before[k]) / seconds * 100, 1) for k, v in trees.items()}


def streamed(url: str, body: dict) -> tuple[float, list[float], list[int], dict]:
    """(TTFT s, token arrival times s, token ids, the last chunk's ``turnscope`` facts) of one
    streamed completion."""
    body = body | {"stream": True, "return_token_ids": True}
    stamps, ids, facts = [], [], {}
    t0 = time.monotonic()
    with httpx.Client(timeout=300) as client, connect_sse(client, "POST", url + "/v1/completions", json=body) as es:
        if es.response.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {es.response.status_code}: {es.response.read()[:500]!r}")
        for sse in es.iter_sse():
            if sse.data == "[DONE]":
                break
            chunk = json.loads(sse.data)
            facts = chunk.get("turnscope") or facts
            for c in chunk.get("choices", []):
                if c.get("token_ids"):
                    stamps.append(time.monotonic() - t0)
                    ids += c["token_ids"]
    return stamps[0], stamps, ids, facts


def play_two_turn_sessions(proxy_url: str, sessions: int, seed: int, out) -> None:
    """``sessions`` two-turn sessions through the proxy (turn 0: 1,500 fresh token ids; turn 1 appends
    the reply and 100 more; 32 tokens, ``ignore_eos``), the same ones for the same ``seed``; appends
    to ``out`` (a launch's record): ``outputs`` (every turn's greedy ids), ``itl_s`` (each turn's mean
    inter-token latency, s), ``pull_ttft_s`` and ``pulled_tokens`` (turn 1, when a ``hit``)."""
    seeds = random.Random(seed)  # the same sessions in every launch: outputs comparable
    for s in range(sessions):
        rng = random.Random(seeds.getrandbits(32))
        ids = [rng.randrange(10, 4000) for _ in range(1500)]
        session = f"bench-{s}-{time.monotonic_ns()}"
        for turn in range(2):
            body = {"model": MODEL, "prompt": ids, "max_tokens": 32, "temperature": 0, "ignore_eos": True,
                    "conversation_id": session}
            ttft, stamps, gen, facts = streamed(proxy_url, body)
            out.outputs.append(gen)
            if len(stamps) > 1:
                out.itl_s.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
            if turn == 1 and facts.get("reuse") == "hit":
                out.pull_ttft_s.append(ttft)
                out.pulled_tokens.append(int(facts.get("reused_tokens") or 0))
            ids = ids + gen + [rng.randrange(10, 4000) for _ in range(100)]


def measure(delay: int, rounds_rng: random.Random, args: argparse.Namespace, log_dir: Path) -> Launch:
    stack = VllmStack("pd-bidir", log_dir / f"delay-{delay}-{time.monotonic_ns()}", reference=False)
    for w in stack.workers:
        w.spec.env[nixl_progress.ENV] = str(delay)
    out = Launch(delay)
    try:
        stack.start()
        time.sleep(3)
        out.idle_pct = idle_cpu_pct(stack, args.idle_s)
        p_url = stack.worker("prefill").url
        for n in (256, 2048):
            for _ in range(args.repeats):
                ids = [rounds_rng.randrange(10, 4000) for _ in range(n)]
                ttft, *_ = streamed(p_url, {"model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0,
                                            "cache_salt": f"probe-{rounds_rng.getrandbits(64):x}"})
                out.prefill_s.setdefault(str(n), []).append(ttft)
        with ProxyThread(stack.proxy_config()) as proxy:
            play_two_turn_sessions(proxy.url, args.sessions, args.seed, out)
    finally:
        stack.stop()
    return out


def med(xs) -> str:
    return f"{statistics.median(xs) * 1e3:8.1f} ms ({min(xs) * 1e3:.0f}..{max(xs) * 1e3:.0f})" if xs else "n/a"


def abba_order(variants: list[int], rounds: int) -> list[tuple[int, int]]:
    """(round, variant) in the order the launches run: every variant once per round, the order
    reversed every other round (A B, B A, ...), so the machine's drift falls on each alike."""
    return [(r, v) for r in range(rounds) for v in (variants if r % 2 == 0 else variants[::-1])]


def side_by_side(by: dict, variants: list[int], label, rows, cpu_label: str, cpu_of) -> None:
    """Print each figure of ``rows`` (name, launch -> samples) per variant as median (min..max) and its
    ratio to the first variant, then each role's CPU (``cpu_of(launch, role)``, % of a core), the hits
    of turn 1 and whether every launch's greedy outputs equal the first launch's. ``by``: variant ->
    its launches (each with ``pull_ttft_s``, ``pulled_tokens`` and ``outputs``); ``label(v)``: the
    column heading of variant ``v``."""
    base = variants[0]

    def pooled(v, get):
        return [x for la in by[v] for x in get(la)]

    print(f"\nmedian (min..max) over every sample of every launch; ratio to {label(base)}")
    print(f"  {'figure':30s}" + "".join(f"{label(v):>40s}" for v in variants))
    for name, get in rows:
        b = pooled(base, get)
        cells = []
        for v in variants:
            xs = pooled(v, get)
            ratio = statistics.median(xs) / statistics.median(b) if xs and b else float("nan")
            cells.append(f"{med(xs)} x{ratio:4.2f}")
        print(f"  {name:30s}" + "".join(f"{c:>40s}" for c in cells))
    for role in ("prefill-0", "decode-0"):
        print(f"  {cpu_label + role:30s}" + "".join(
            f"{str([cpu_of(la, role) for la in by[v]]) + ' % of a core':>40s}" for v in variants))
    print("  hits / turns 1:", {v: f"{len(pooled(v, lambda la: la.pull_ttft_s))}/"
                                  f"{sum(len(la.outputs) // 2 for la in by[v])}" for v in variants},
          " pulled tokens:", {v: sorted(set(pooled(v, lambda la: la.pulled_tokens))) for v in variants})
    ref = by[base][0].outputs
    print("  greedy outputs equal to the first launch's:", {v: all(la.outputs == ref for la in by[v]) for v in variants})


def report(launches: list[Launch], delays: list[int]) -> None:
    side_by_side({d: [la for la in launches if la.delay_us == d] for d in delays}, delays,
                 lambda d: f"delay {d} us",
                 [("P prefill, 256 tokens", lambda la: la.prefill_s.get("256", [])),
                  ("P prefill, 2,048 tokens", lambda la: la.prefill_s.get("2048", [])),
                  ("turn 1 TTFT, pulled from D", lambda la: la.pull_ttft_s),
                  ("decode ITL", lambda la: la.itl_s)],
                 "idle CPU ", lambda la, role: la.idle_pct.get(role))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="0,100", help="comma list of delays, microseconds (0: nixl's own)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="P prefill requests per prompt length per launch")
    ap.add_argument("--sessions", type=int, default=4, help="two-turn sessions through the proxy per launch")
    ap.add_argument("--idle-s", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json", type=Path, help="write every launch's numbers here")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` stops it: the workers are stopped too
    delays = [int(v) for v in args.variants.split(",")]
    log_dir = Path(tempfile.mkdtemp(prefix="turnscope-nixl-progress-"))
    rng = random.Random()
    launches: list[Launch] = []
    for r, d in abba_order(delays, args.rounds):
        t = time.monotonic()
        launches.append(measure(d, rng, args, log_dir))
        print(f"round {r + 1} delay {d} us: {time.monotonic() - t:.0f} s, idle {launches[-1].idle_pct}", flush=True)
        if args.json:
            args.json.write_text(json.dumps([la.__dict__ for la in launches], indent=1))
    report(launches, delays)
    print(f"\nworker logs: {log_dir}")


if __name__ == "__main__":
    main()
