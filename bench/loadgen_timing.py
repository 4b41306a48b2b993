"""How exact is loadgen's TTFT at scale? Measured TTFT vs a stub server's injected TTFT.

Runs, for each concurrency level (default 100, 500 and 1,000 sessions):

* a stub OpenAI-compatible server (a raw ASGI app under uvicorn with uvloop and httptools, its own
  process, 127.0.0.1) that answers ``/tokenize`` (ChatML, one stand-in id per 4 characters) and
  streams ``/v1/chat/completions``: headers and a role-only chunk at once, the first token
  ``injected TTFT`` after the request arrived (uniform in ``--ttft-ms``, drawn per request from a
  seeded numpy Generator), then one token every ``--itl-ms`` with per-chunk usage, then
  ``[DONE]``. It records, per request id, the injected TTFT, the arrival instant and the instant it
  actually wrote the first token (``time.perf_counter``, CLOCK_MONOTONIC, one clock for all
  processes of the machine);
* one Locust process (``locust -f loadgen/locustfile.py --headless``, the product's own user and
  store writer) with N users, each playing sessions of a generated workload (``--turns`` turns of
  ``--output-tokens`` tokens, exponential think gaps of mean ``--gap-s``), for ``--duration-s``
  seconds after the spawn ramp.

Then it joins the store's ``turns`` rows (measured TTFT) with the server's records by request id,
keeps the turns sent after every user was spawned, and prints per level the p50/p99 (numpy
linear-interpolation percentiles) of

* ``measured - injected``: the end-to-end error of the recorded TTFT;
* ``server late``: how late the stub itself wrote the first token (its sleep overshoot and loop
  delay; a truth the client cannot be blamed for);
* ``client``: ``measured - (first write - arrival)``: what the client adds: the request's transit
  to the server and the delay between the token's arrival and its timestamp in the client;
* ``server on time``: ``measured - injected`` over the turns whose first token the stub wrote
  within 1 ms of its schedule (when the stub is late, the machine is short of CPU for every
  process, the client's too: on a shared machine this separates the client from the machine).

Usage: ``python bench/loadgen_timing.py [--users 100 500 1000] [--duration-s 40] [--gap-s 5]``.
Not part of the test suite. Target: p99 of ``measured - injected`` <= 2 ms at 1,000 sessions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# ----------------------------------------------------------------------------------- the server


def _encode(text: str) -> list[int]:
    """Stand-in token ids, one per 4 characters (about what a BPE tokenizer gives for English):
    ``16 + ord(c)`` of every 4th character. Prefix-stable for prefixes of a multiple of 4 characters;
    the bench only needs realistic counts."""
    return [16 + ord(c) for c in text[::4]]


def _render(messages: list[dict], add_generation_prompt: bool) -> str:
    s = "".join(f"<|im_start|>{m['role']}\n{m.get('content') or ''}<|im_end|>\n" for m in messages)
    return s + ("<|im_start|>assistant\n" if add_generation_prompt else "")


class StubApp:
    """Raw ASGI app: ``/tokenize`` and streamed ``/v1/chat/completions`` with injected delays.

    Args:
        ttft_ms: (low, high) of the injected TTFT, milliseconds (uniform).
        itl_ms: injected inter-token latency, milliseconds.
        seed: seed of the TTFT draws.
    """

    def __init__(self, ttft_ms: tuple[float, float], itl_ms: float, seed: int = 0, out: Path | None = None):
        self.out = out
        self.ttft = ttft_ms
        self.itl_s = itl_ms / 1000.0
        self.rng = np.random.default_rng(seed)
        self.records: dict[str, tuple[float, float, float]] = {}  # id -> (injected_s, arrival, first_sent)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    if self.out is not None:  # uvicorn re-raises SIGTERM after shutdown: write now
                        self.out.write_text(json.dumps(self.records))
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        arrival = time.perf_counter()
        req = json.loads(body or b"{}")
        if scope["path"] == "/tokenize":
            ids = _encode(_render(req["messages"], req.get("add_generation_prompt", True))
                          if "messages" in req else req.get("prompt", ""))
            data = json.dumps({"tokens": ids, "count": len(ids)}).encode()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": data})
            return
        rid = f"b-{uuid.uuid4().hex[:12]}"
        injected = float(self.rng.uniform(*self.ttft)) / 1000.0
        n_prompt = len(_encode(_render(req["messages"], True)))
        n_out = int(req.get("max_tokens") or 16)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"x-request-id", rid.encode())]})

        def chunk(delta: dict, n: int, finish: str | None = None) -> bytes:
            c = {"id": rid, "object": "chat.completion.chunk",
                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
                 "usage": {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n}}
            return b"data: " + json.dumps(c).encode() + b"\n\n"

        first = json.loads(chunk({"role": "assistant", "content": ""}, 0)[6:])
        if req.get("return_token_ids"):  # vLLM: the rendered prompt's ids on the first chunk (chat)
            first["prompt_token_ids"] = _encode(_render(req["messages"], True))
        await send({"type": "http.response.body", "body": b"data: " + json.dumps(first).encode() + b"\n\n",
                    "more_body": True})
        deadline = arrival + injected
        for i in range(n_out):
            await asyncio.sleep(max(deadline - time.perf_counter(), 0.0))
            await send({"type": "http.response.body", "body": chunk({"content": " w"}, i + 1,
                                                                     "length" if i == n_out - 1 else None),
                        "more_body": True})
            if i == 0:
                self.records[rid] = (injected, arrival, time.perf_counter())
            deadline += self.itl_s
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


def serve(port: int, out: Path, ttft_ms: tuple[float, float], itl_ms: float, seed: int) -> None:
    """Run the stub on 127.0.0.1:``port`` until SIGTERM, then write its records to ``out`` (JSON)."""
    import uvicorn

    app = StubApp(ttft_ms, itl_ms, seed, out)
    config = uvicorn.Config(app, host="127.0.0.1", port=port, loop="uvloop", http="httptools",
                            log_level="warning", access_log=False, backlog=4096, lifespan="on")
    uvicorn.Server(config).run()


# ----------------------------------------------------------------------------------- the driver


WORKLOAD = """\
name: timing-bench
seed: 1
ttl_s: 480
ignore_eos: true
mix:
  - archetype:
      name: bench
      turns: {turns}
      first_prompt_tokens: 30
      new_tokens: {{think: 10}}
      output_tokens: {out}
      gaps: {{think: {{p: 1.0, seconds: {{kind: exponential, mean: {gap}, max: {gap_max}}}}}}}
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, timeout_s: float = 30.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"stub server did not open port {port}")


def run_level(users: int, a: argparse.Namespace, work: Path) -> dict:
    """One concurrency level: returns the joined measurements and process facts."""
    import psutil

    from store.writer import Store

    port = _free_port()
    rec_file = work / f"server-{users}.json"
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--records", str(rec_file),
                               "--ttft-ms", str(a.ttft_ms[0]), str(a.ttft_ms[1]), "--itl-ms", str(a.itl_ms)],
                              cwd=REPO)
    _wait_port(port)
    store_root = work / "store"
    run_id = f"timing-{users}-{uuid.uuid4().hex[:6]}"
    spawn_s = users / a.spawn_rate
    sessions = int(users * (a.duration_s / (a.turns * (a.gap_s + 0.5)) + 2))
    wl = work / "bench.yaml"
    wl.write_text(WORKLOAD.format(out=a.output_tokens, gap=a.gap_s, gap_max=a.gap_s * 10, turns=a.turns))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "locust", "-f", os.environ.get("TS_LOCUSTFILE", str(REPO / "loadgen" / "locustfile.py")), "--headless",
           "-u", str(users), "-r", str(a.spawn_rate), "--run-time", f"{int(spawn_s + a.duration_s + 20)}s",
           "--host", f"http://127.0.0.1:{port}", "--only-summary", "--loglevel", "WARNING",
           "--turnscope-store", str(store_root), "--turnscope-run-id", run_id, "--turnscope-workload", str(wl),
           "--turnscope-sessions", str(sessions), "--turnscope-tokenizer", str(a.tokenizer),
           "--turnscope-max-prompt-tokens", "1000000", "--turnscope-timeout-s", "60"]
    t_start = time.time()
    loc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ps_loc, ps_srv = psutil.Process(loc.pid), psutil.Process(server.pid)
    cpu0 = (ps_loc.cpu_times(), ps_srv.cpu_times())
    cpu_loc = cpu_srv = 0.0
    while loc.poll() is None:
        try:
            t = ps_loc.cpu_times()
            cpu_loc = t.user + t.system - cpu0[0].user - cpu0[0].system
            t = ps_srv.cpu_times()
            cpu_srv = t.user + t.system - cpu0[1].user - cpu0[1].system
        except psutil.NoSuchProcess:
            break
        time.sleep(0.5)
    out = loc.stdout.read() if loc.stdout else ""
    if os.environ.get("TS_LOCUSTFILE"):
        print([ln for ln in out.splitlines() if "LAG" in ln])
    wall = time.time() - t_start
    server.send_signal(signal.SIGTERM)
    server.wait(30)
    records = json.loads(rec_file.read_text())
    con = Store(store_root).connect()
    try:
        rows = con.execute("SELECT request_id, ttft_s, epoch(sent_at) AS sent, status FROM turns WHERE run_id = ?",
                           [run_id]).fetchall()
    finally:
        con.close()
    first_sent = min((sent for _, _, sent, _ in rows), default=t_start)   # users start when planning is done
    t_measure = first_sent + spawn_s + a.warmup_s
    ok = [(rid, ttft) for rid, ttft, sent, status in rows
          if status == "ok" and rid in records and sent >= t_measure]
    sent_s = np.array([sent for rid, ttft, sent, status in rows
                       if status == "ok" and rid in records and sent >= t_measure]) - t_measure
    con = Store(store_root).connect()
    try:
        errors = con.execute("SELECT status, error, count(*) FROM turns WHERE run_id = ? AND status <> 'ok' "
                             "GROUP BY ALL", [run_id]).fetchall()
    finally:
        con.close()
    inj = np.array([records[r][0] for r, _ in ok])
    arr = np.array([records[r][1] for r, _ in ok])
    first = np.array([records[r][2] for r, _ in ok])
    meas = np.array([t for _, t in ok])
    return {"users": users, "turns": len(ok), "all_turns": len(rows),
            "failed": sum(1 for r in rows if r[3] != "ok"), "wall_s": wall,
            "rate": len(ok) / max(max((sent for _, _, sent, _ in rows), default=0) - t_measure, 1e-9),
            "err": meas - inj, "late": first - arr - inj, "client": meas - (first - arr), "sent_s": sent_s,
            "errors": errors,
            "cpu_locust": cpu_loc / wall, "cpu_server": cpu_srv / wall, "locust_rc": loc.returncode,
            "locust_tail": out[-1500:]}


def _ms(x: np.ndarray, q: float) -> str:
    return f"{np.percentile(x, q) * 1000:7.2f}" if x.size else "    n/a"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--users", type=int, nargs="+", default=[100, 500, 1000])
    ap.add_argument("--duration-s", type=float, default=40.0, help="seconds of load after the spawn ramp")
    ap.add_argument("--warmup-s", type=float, default=5.0, help="seconds after the ramp not measured")
    ap.add_argument("--spawn-rate", type=float, default=100.0, help="users started per second")
    ap.add_argument("--gap-s", type=float, default=5.0, help="mean think gap between turns, seconds")
    ap.add_argument("--ttft-ms", type=float, nargs=2, default=[50.0, 250.0], help="injected TTFT range, ms")
    ap.add_argument("--itl-ms", type=float, default=20.0, help="injected inter-token latency, ms")
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6, help="turns per session")
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="tokenizer.json for the workload text (default: the embedded model's, built if missing)")
    ap.add_argument("--dump", type=Path, default=None, help="write every measured turn as JSON here")
    ap.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--records", type=Path, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.serve is not None:
        serve(a.serve, a.records, tuple(a.ttft_ms), a.itl_ms, seed=a.serve)
        return 0
    if a.tokenizer is None:
        from tests.embedded_tokenizer import tokenizer_json

        a.tokenizer = tokenizer_json()
    print(f"loadgen TTFT timing: injected TTFT uniform {a.ttft_ms[0]:g}-{a.ttft_ms[1]:g} ms, ITL {a.itl_ms:g} ms, "
          f"{a.output_tokens} output tokens, think gaps exponential mean {a.gap_s:g} s, {a.turns}-turn sessions, "
          f"{a.duration_s:g} s per level; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    results = []
    with tempfile.TemporaryDirectory(prefix="turnscope-timing-") as d:
        for users in a.users:
            r = run_level(users, a, Path(d))
            results.append(r)
            if r["locust_rc"] not in (0, 1) or not r["turns"]:
                print(f"locust exited {r['locust_rc']}:\n{r['locust_tail']}")
    print()
    print("sessions  turns  turns/s  failed | measured-injected ms p50    p99 | server late ms p50    p99 |"
          " client ms p50    p99 | server on time: turns  m-i p99 | CPU locust server")
    for r in results:
        on_time = r["late"] < 0.001  # the stub wrote the token within 1 ms of its schedule
        print(f"{r['users']:8d} {r['turns']:6d} {r['rate']:8.1f} {r['failed']:7d} |"
              f"                   {_ms(r['err'], 50)} {_ms(r['err'], 99)} |"
              f"              {_ms(r['late'], 50)} {_ms(r['late'], 99)} |"
              f"        {_ms(r['client'], 50)} {_ms(r['client'], 99)} |"
              f"                {int(on_time.sum()):6d} {_ms(r['err'][on_time], 99)} |"
              f"   {r['cpu_locust'] * 100:4.0f}%  {r['cpu_server'] * 100:4.0f}%")
    print("\n'server on time': only the turns whose first token the stub wrote within 1 ms of its schedule;"
          "\na late stub means the machine was not giving its processes the CPU (other load), which delays"
          "\nthe client's timestamps too. Compare with the load averages.")
    for r in results:
        if r["errors"]:
            print(f"{r['users']} sessions, failed turns: {r['errors']}")
    if a.dump:
        a.dump.write_text(json.dumps([{k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in r.items()}
                                      for r in results]))
    print(f"\nload average after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
