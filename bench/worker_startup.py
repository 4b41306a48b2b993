"""Where a vLLM worker's start-up goes, per phase, and what compilation settings cost or save.

Starts the P and D workers of ``pd-bidir`` on the embedded default (``serving.topology.
embedded_topology``, free ports, P on core 0 and D on core 1, both launched at once as
``serving.stack.ModeStack`` does) once per variant and round, in the order A B A B (``--rounds``
rounds; the order within a round alternates, so neither variant always goes first). Every log line
a worker writes is stamped with the seconds since its launch as this bench reads it (vLLM's own
timestamps have 1 s resolution), and the start-up is cut into phases at the first line matching
each marker of :data:`PHASES`; a marker a variant never logs (compilation under
``--enforce-eager``) makes its phase 0 s. "health" ends when ``/health`` first answers 200.

Once both workers are healthy, each is asked, directly (no proxy):

* **outputs**: greedy completions (temperature 0, ``--max-tokens``) of fixed prompts; their token
  ids must be equal across variants, token for token;
* **TTFT**: streamed completions of fresh prompts (a random prefix per request, so no prefix-cache
  hit) of 300 and 1,500 words, ``max_tokens`` 16; TTFT is request sent -> first SSE event
  carrying text (httpx-sse), ITL the mean gap between the later ones.

The table gives the median over rounds per variant and the ratio to the first variant. The
machine is shared: read medians and the spread over rounds, not single numbers.

    .venv/bin/python bench/worker_startup.py --variants baseline,eager --rounds 2
"""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from httpx_sse import connect_sse

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from serving.embedded_model import ensure_model
from serving.topology import WorkerEntry, embedded_topology
from serving.workers import WorkerProcess, mode_workers
from tests.integration.vllm_stack import free_port

# (phase, regex of the log line that ends it), in the order vLLM 0.32 logs them on the CPU platform.
PHASES = [
    ("imports (API server)", r"turnscope: streamed kv_transfer_params"),
    ("config + engine-core process", r"Initializing a V1 LLM engine"),
    ("worker process", r"Starting to load model"),
    ("model load", r"Loading weights took"),
    ("compilation (warm-up)", r"Warming up done"),
    ("KV cache + NIXL registration", r"init engine \(profile, create kv cache"),
]
HEALTH = "API server up (health)"

VARIANTS = {
    "baseline": ([], {}),
    "eager": (["--enforce-eager"], {}),
    "no-compile-cache": ([], {"VLLM_DISABLE_COMPILE_CACHE": "1"}),
}

FIXED_PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Summarise the meeting notes: alpha beta gamma",
                 "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30"]
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "lambda", "sigma", "omega", "river", "stone", "cloud", "table"]


class LogFollower(threading.Thread):
    """Reads a log file as it grows; ``lines`` holds ``(seconds since t0, line)``."""

    def __init__(self, path: Path, t0: float):
        super().__init__(daemon=True)
        self.path, self.t0 = path, t0
        self.lines: list[tuple[float, str]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.path.exists() and not self.done.is_set():
            time.sleep(0.05)
        with open(self.path, errors="replace") as f:
            f.seek(0, 2)  # the log is appended to: only this launch's lines
            while not self.done.is_set():
                line = f.readline()
                if line:
                    self.lines.append((time.monotonic() - self.t0, line.rstrip()))
                else:
                    time.sleep(0.05)

    def first(self, pattern: str) -> float | None:
        rx = re.compile(pattern)
        return next((t for t, line in self.lines if rx.search(line)), None)


def phase_times(follower: LogFollower, healthy_s: float) -> dict[str, float]:
    """Seconds per phase: from the previous marker found to this one's first line (0 when absent)."""
    out, prev = {}, 0.0
    for name, pattern in PHASES:
        t = follower.first(pattern)
        out[name] = (t - prev) if t is not None and t >= prev else 0.0
        prev = t if t is not None and t >= prev else prev
    out[HEALTH] = max(healthy_s - prev, 0.0)
    out["total"] = healthy_s
    return out


def greedy_ids(url: str, model: str, max_tokens: int) -> list[list[int] | str]:
    """Token ids (or the text, where the server gives no ids) of greedy completions of FIXED_PROMPTS."""
    out = []
    for prompt in FIXED_PROMPTS:
        r = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, "ignore_eos": True})
        r.raise_for_status()
        choice = r.json()["choices"][0]
        out.append(choice.get("token_ids") or choice["text"])
    return out


def timed_stream(url: str, model: str, prompt: str) -> tuple[float, float | None]:
    """(TTFT s, mean ITL s or None) of one streamed completion of ``prompt``."""
    body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "stream": True,
            "ignore_eos": True}
    stamps = []
    t0 = time.monotonic()
    with httpx.Client(timeout=300) as client, connect_sse(client, "POST", url + "/v1/completions", json=body) as es:
        if es.response.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {es.response.status_code}: {es.response.read()[:500]!r}")
        for sse in es.iter_sse():
            if sse.data == "[DONE]":
                break
            if any(c.get("text") for c in json.loads(sse.data).get("choices", [])):
                stamps.append(time.monotonic() - t0)
    itl = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None
    return stamps[0], itl


def fresh_prompt(rng: random.Random, words: int) -> str:
    return " ".join([f"n{rng.getrandbits(48):x}"] + [rng.choice(WORDS) for _ in range(words)])


@dataclass
class Launch:
    """One start of P and D with one variant: phases per worker, outputs, TTFT and ITL samples."""

    variant: str
    phases: dict[str, dict[str, float]] = field(default_factory=dict)
    outputs: dict[str, list] = field(default_factory=dict)
    ttft: dict[str, list[float]] = field(default_factory=dict)
    itl: list[float] = field(default_factory=list)


def launch(variant: str, model: str, log_dir: Path, args: argparse.Namespace, rng: random.Random) -> Launch:
    extra_args, extra_env = VARIANTS[variant]
    topo = embedded_topology(model)
    topo.prefill = [WorkerEntry(port=free_port(), side_channel_port=free_port(), cores=[0])]
    topo.decode = [WorkerEntry(port=free_port(), side_channel_port=free_port(), cores=[1])]
    workers = []
    for spec in mode_workers("pd-bidir", topo):
        spec.args, spec.env = spec.args + extra_args, spec.env | extra_env
        workers.append(WorkerProcess(spec, log_dir / f"{variant}-{spec.name}.log"))
    result = Launch(variant)
    t0 = time.monotonic()
    followers = [LogFollower(w.log_path, t0) for w in workers]
    for f in followers:
        f.start()
    try:
        for w in workers:
            w.start()
        healthy = {}
        for w in workers:
            w.wait_healthy(900)
            healthy[w.spec.name] = time.monotonic() - t0
        for w in workers:
            w.pin()
        time.sleep(0.5)
        for w, f in zip(workers, followers):
            result.phases[w.spec.name] = phase_times(f, healthy[w.spec.name])
        name = topo.served_model_name
        for w in workers:
            result.outputs[w.spec.name] = greedy_ids(w.spec.url, name, args.max_tokens)
        p_url = workers[0].spec.url
        for words in (300, 1500):
            for _ in range(args.ttft_repeats):
                ttft, itl = timed_stream(p_url, name, fresh_prompt(rng, words))
                result.ttft.setdefault(f"~{words} words", []).append(ttft)
                if itl is not None:
                    result.itl.append(itl)
    finally:
        for f in followers:
            f.done.set()
        for w in workers:
            w.stop()
    return result


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def report(launches: list[Launch], variants: list[str]) -> None:
    """Phase medians per variant and role, ratios to the first variant, output equality, TTFT."""
    by = {v: [la for la in launches if la.variant == v] for v in variants}
    base = variants[0]
    for role in ("prefill-0", "decode-0"):
        print(f"\n{role}: seconds per phase, median over rounds (min..max); ratio to {base}")
        print(f"  {'phase':32s}" + "".join(f"{v:>26s}" for v in variants))
        for phase in [p for p, _ in PHASES] + [HEALTH, "total"]:
            row = f"  {phase:32s}"
            for v in variants:
                xs = [la.phases[role][phase] for la in by[v]]
                ratio = median(xs) / median([la.phases[role][phase] for la in by[base]]) \
                    if median([la.phases[role][phase] for la in by[base]]) > 0 else float("nan")
                row += f"{median(xs):8.1f} ({min(xs):5.1f}..{max(xs):5.1f}) x{ratio:4.2f}"
            print(row)
    ref = by[base][0].outputs
    print("\ngreedy outputs (token ids of", len(FIXED_PROMPTS), "prompts, P and D) equal to the first", base,
          "launch:")
    for v in variants:
        print(f"  {v:20s}", all(la.outputs == ref for la in by[v]))
    print("\nTTFT (P, fresh prompts) and ITL, median (min..max) over all requests of all rounds, ms")
    keys = sorted({k for la in launches for k in la.ttft})
    for v in variants:
        cells = []
        for k in keys:
            xs = [x for la in by[v] for x in la.ttft.get(k, [])]
            cells.append(f"TTFT {k}: {median(xs) * 1e3:7.1f} ({min(xs) * 1e3:.0f}..{max(xs) * 1e3:.0f})")
        itl = [x for la in by[v] for x in la.itl]
        print(f"  {v:20s}", "  ".join(cells), f"  ITL: {median(itl) * 1e3:6.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="baseline,eager", help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--first", choices=["given", "reversed"], default="given",
                    help="order of the variants in the first round (the next rounds alternate)")
    ap.add_argument("--ttft-repeats", type=int, default=3, help="TTFT requests per prompt length per launch")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/turnscope-worker-startup"))
    ap.add_argument("--json", type=Path, help="append every launch's numbers here and report all launches in it")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` stops it: the workers are stopped too
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant(s) {unknown}; expected {list(VARIANTS)}")
    args.log_dir.mkdir(parents=True, exist_ok=True)
    model, rng = str(ensure_model()), random.Random()
    # runs split over several invocations (each under the lock) are reported together
    launches = [Launch(**d) for d in json.loads(args.json.read_text())] if args.json and args.json.exists() else []
    for r in range(args.rounds):
        for v in (variants if (r + (args.first == 'reversed')) % 2 == 0 else variants[::-1]):
            t = time.monotonic()
            launches.append(launch(v, model, args.log_dir, args, rng))
            print(f"round {r + 1} {v}: healthy in {max(p['total'] for p in launches[-1].phases.values()):.0f} s "
                  f"(launch + checks {time.monotonic() - t:.0f} s)", flush=True)
            if args.json:  # after every launch: a run cut short keeps what it measured
                args.json.write_text(json.dumps([la.__dict__ for la in launches], indent=1))
    report(launches, variants)


if __name__ == "__main__":
    main()
