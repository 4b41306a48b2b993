"""How fast is the traffic report, and does its memory stay flat as the trace grows?

Two measurements, each in a fresh Python process (so its peak RSS, ``resource.getrusage``
``ru_maxrss``, is the report's own and not the generator's):

* ``corpus``: ``loadgen.traffic.build_report`` over the shipped data: the 24 kv-cache-tester
  traces, the TraceLab file, Mooncake (12,031 requests) and Azure (19,366). Target: seconds.
* ``generated N``: a trace of N requests in the kv-cache-tester shape (same fields and nesting:
  conversations as ``trace_*.json`` files, 64-token ``hash_ids`` scoped per conversation, growing
  prompts with occasional compactions, ``api_time``/``think_time``, one sub-agent in every tenth
  conversation), written to a temporary directory by a seeded numpy Generator, then reported.
  Prompts are kept small (median about 2,000 tokens, about 30 hash ids per request) so a
  1,000,000-request trace is about 200 MB on disk rather than the real traces' 100k-token contexts
  (100 GB); the report's cost per request does not depend on the context length beyond the ids.
  Target: 1,000,000 requests in < 60 s on the 2-core machine, peak memory not growing with N
  (printed side by side for N/10 and N).

Usage: ``python bench/traffic_report.py [--requests 1000000] [--keep DIR]``. Not part of the test
suite; run it when nothing else loads the machine.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data" / "traces"


def _session(rng: np.random.Generator, n: int, next_id: list[int]) -> list[dict]:
    """``n`` requests of one session: prompts growing by tool results, a compaction now and then."""
    out = []
    ids: list[int] = []
    t = 0.0
    n_in = int(rng.integers(600, 3000))
    for k in range(n):
        if k:
            if rng.random() < 0.03:  # compaction: keep the first 5 blocks, start over from there
                ids = ids[:5]
                n_in = len(ids) * 64 + int(rng.integers(200, 800))
            else:
                n_in += int(rng.lognormal(np.log(60), 1.0))
        full = n_in // 64
        while len(ids) < full:
            ids.append(next_id[0])
            next_id[0] += 1
        ids = ids[:full]
        api = round(float(rng.lognormal(np.log(4), 0.6)), 2)
        think = round(float(rng.lognormal(np.log(9), 1.5)), 1) if k else 0.0
        t = t + think
        out.append({"t": round(t, 3), "type": "n", "in": n_in, "out": int(rng.integers(20, 600)),
                    "hash_ids": list(ids), "api_time": api, "think_time": think,
                    "input_types": ["tool_result"] if k and rng.random() < 0.8 else ["text"]})
        t += api
    return out


def generate(root: Path, requests: int, seed: int = 7) -> int:
    """Write conversations of ~50 requests until ``requests`` are written; returns files written."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    done = files = 0
    while done < requests:
        n = int(min(requests - done, max(1, rng.lognormal(np.log(40), 0.7))))
        next_id = [1]
        sub_n = min(int(rng.integers(3, 12)), n // 2) if (files % 10 == 9 and n > 6) else 0
        parent = _session(rng, n - sub_n, next_id)
        if sub_n:
            at = parent[len(parent) // 2]["t"] + 1.0
            parent.insert(len(parent) // 2 + 1, {"t": at, "type": "subagent", "agent_id": "agent_001",
                                                   "requests": _session(rng, sub_n, next_id)})
        (root / f"trace_{files:06d}.json").write_text(json.dumps({"id": f"trace_{files:06d}", "block_size": 64,
                                                                   "requests": parent}))
        done += n
        files += 1
    return files


def _child(paths: list[str], store: str) -> None:
    """In the measured process: build the report, print JSON with seconds and peak RSS."""
    from loadgen.traffic import build_report
    from store.writer import Store

    t0 = time.perf_counter()
    rep = build_report(Store(Path(store)), paths)
    dt = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"seconds": dt, "peak_bytes": peak, "requests": int(rep.summary["requests"]),
                      "sessions": int(rep.summary["sessions"])}))


def measure(paths: list[Path], store: Path) -> dict:
    """Run :func:`_child` in a fresh interpreter; its JSON line as a dict."""
    out = subprocess.run([sys.executable, __file__, "--child", str(store), *map(str, paths)], cwd=REPO,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--keep", type=Path, default=None, help="generate into this directory and keep it")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        _child(a.child[1:], a.child[0])
        return 0
    with tempfile.TemporaryDirectory(prefix="traffic-bench-") as tmp:
        tmp = Path(tmp)
        corpus = [DATA / "kv-cache-tester", DATA / "tracelab_round_trace.jsonl", DATA / "conversation_trace.jsonl",
                  DATA / "AzureLLMInferenceTrace_conv.csv"]
        c = measure(corpus, tmp / "store-corpus")
        print(f"corpus (24 kv-cache-tester + TraceLab + Mooncake + Azure): {c['requests']:,} requests, "
              f"{c['sessions']:,} sessions in {c['seconds']:.1f} s, peak RSS {c['peak_bytes'] / 2**20:.0f} MiB")
        rows = []
        for n in (a.requests // 10, a.requests):
            d = (a.keep / f"gen-{n}") if a.keep else tmp / f"gen-{n}"
            t0 = time.perf_counter()
            files = generate(d, n)
            gen_s = time.perf_counter() - t0
            mb = sum(f.stat().st_size for f in d.iterdir()) / 2**20
            r = measure([d], tmp / f"store-{n}")
            rows.append((n, r))
            print(f"generated {n:,} requests in {files:,} files ({mb:.0f} MiB, {gen_s:.0f} s to write): report "
                  f"{r['seconds']:.1f} s ({n / r['seconds']:,.0f} requests/s), peak RSS "
                  f"{r['peak_bytes'] / 2**20:.0f} MiB, {r['sessions']:,} sessions")
        (n1, r1), (n2, r2) = rows
        print(f"side by side: {n2 / n1:.0f}x the requests -> {r2['seconds'] / r1['seconds']:.1f}x the time, "
              f"{r2['peak_bytes'] / r1['peak_bytes']:.2f}x the peak memory; target < 60 s at {n2:,}: "
              f"{'met' if r2['seconds'] < 60 else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
