"""The fault suite through the real proxy, loadgen and store, with stub P/D workers that hold real
block memory (tests/integration/kv_stub.py): every fault is recorded as what it was, nothing is
lost, nothing is wrong.

Truths: the faults injected (by each stub worker's request index, or a SIGKILL at a known moment),
the stubs' own records (what each decode computed its output from, every read of blocks not held
for the reader), the stub servers' request logs, and outputs recomputed here from the prompt ids
(``kv_stub.gen_ids``: the output a worker gives when its KV is exactly the prompt's).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from core.tokenize_client import TokenizeClient
from dashboard import tables
from loadgen.scraper import MetricsScraper
from loadgen.session import SessionPlan, TurnPlan
from loadgen.session_player import run_session
from loadgen.stream_client import stream_turn
from serving.proxy import PREFILL_PARAMS, ProxyConfig, Worker
from store import queries
from store.writer import Store
from tests.integration.kv_stub import StubProcess, ThreadServer, gen_ids
from tests.integration.openai_stub import StubServer, StubState
from tests.integration.test_session_stub import _locust_cmd, _locust_env, rows
from tests.integration.vllm_stack import ProxyThread, free_port

pytestmark = pytest.mark.timing

REPO = Path(__file__).resolve().parents[2]
MAX_TOKENS = 8
REF = {"role": "assistant", "content": "ref"}


def proxy_config(p_url: str, d_url: str, **kw) -> ProxyConfig:
    """The proxy over stub workers: 4-token blocks, no prefix cache on P (the stub has none)."""
    cfg = {"mode": "pd-bidir", "prefill": [Worker(name="prefill-0", url=p_url)],
           "decode": [Worker(name="decode-0", url=d_url)], "block_size": 4, "kv_recompute_threshold": 2,
           "prefill_prefix_caching": False, "decoder_kv_blocks_ttl_s": 60.0, "handle_ttl_margin_s": 5.0,
           "kv_bytes_per_token": 16}
    return ProxyConfig(**(cfg | kw))


def write_trace(path: Path, conversations: int, turns: int, marker: str = "") -> Path:
    """A tau-bench trajectory file: ``conversations`` conversations of ``turns`` user/assistant
    exchanges after a system prompt (``marker`` is written into every message)."""
    trajs = []
    for c in range(conversations):
        traj = [{"role": "system", "content": f"You are agent {c}. {marker}"}]
        for t in range(turns):
            traj += [{"role": "user", "content": f"question {t} of conversation {c} {marker}"},
                     {"role": "assistant", "content": f"answer {t} {marker}"}]
        trajs.append({"task_id": c, "trial": 0, "traj": traj})
    path.write_text(json.dumps(trajs))
    return path


def plan(session_id: str, kinds: list[tuple[str, float, str]]) -> SessionPlan:
    """A session of turns ``(kind, gap_s, gap_kind)``; user texts are numbered."""
    turns = []
    for k, (kind, gap, gap_kind) in enumerate(kinds):
        if kind == "retry":
            turns.append(TurnPlan([], REF, gap, gap_kind, "retry"))
            continue
        msgs = [{"role": "user", "content": f"{session_id} asks {k}: what next?"}]
        if k == 0:
            msgs.insert(0, {"role": "system", "content": f"You are the agent of {session_id}."})
        edit = {"style": "compact", "target": "last", "keep": 0.5} if kind == "edit" else None
        turns.append(TurnPlan(msgs, REF, gap, gap_kind, kind, edit=edit))
    return SessionPlan(session_id, "test:faults", turns, archetype="faults")


def expected_output(rec) -> list[int]:
    """The output a correct worker gives for the prompt ids the server reported."""
    return gen_ids(rec.result.prompt_token_ids, MAX_TOKENS)


def decode_events(events) -> list[dict]:
    return [e for e in events if e["event"] == "decode"]


def invalid_reads(*servers) -> list[dict]:
    return [e for s in servers for e in s.events() if e["event"] == "invalid_read"]


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "store")
    s.init()
    return s


# ---------------------------------------------------------------- worker faults, through Locust


# Faults by each stub worker's request index (users=1, so requests arrive in a known order). The
# turns, in order (4 sessions x 3 turns), what P and D see, and what must be recorded:
#   t0  P0 D0                          ok       miss_first_turn
#   t1  P1: 500 with a handle; P2 (retry as plain recompute) D1
#                                      ok       miss_transfer_failed
#   t2  P3 D2                          ok       hit
#   t3  P4: 500, first turn            error    HTTP 500 (P's message passed on), no reuse
#   t4  P5 D3                          ok       miss_consumed (t3 used the session's first turn)
#   t5  P6 D4: connection dropped after 2 tokens (D killed mid-stream, as the proxy sees it)
#                                      error    "decode worker decode-0: RemoteProtocolError..."
#   t6  P7 D5                          ok       miss_first_turn
#   t7  P8: hangs 3 s > prefill timeout 1 s, with a handle; P9 (retry) D6
#                                      ok       miss_transfer_failed
#   t8  P10 D7: stops answering after 1 token for 6 s > the client's 2 s timeout
#                                      timeout  (the client's reason)
#   t9  P11: hangs 3 s, first turn     error    HTTP 502 "prefill worker prefill-0: ReadTimeout"
#   t10 P12 D8                         ok       miss_consumed
#   t11 P13 D9: 503                    error    HTTP 503 (D's message passed on)
P_FAULTS = {1: {"what": "status", "status": 500}, 4: {"what": "status", "status": 500},
            8: {"what": "hang", "hang_s": 3.0}, 11: {"what": "hang", "hang_s": 3.0}}
D_FAULTS = {4: {"what": "drop", "after": 2}, 7: {"what": "hang", "after": 1, "hang_s": 6.0},
            9: {"what": "status", "status": 503}}
EXPECTED = [  # (status, reuse, http_status, a piece of the error)
    ("ok", "miss_first_turn", 200, None),
    ("ok", "miss_transfer_failed", 200, None),
    ("ok", "hit", 200, None),
    ("error", None, 500, "HTTP 500: prefill worker prefill-0 answered HTTP 500: injected HTTP 500 by prefill-"),
    ("ok", "miss_consumed", 200, None),
    ("error", "hit", 200, "decode worker decode-0: RemoteProtocolError"),
    ("ok", "miss_first_turn", 200, None),
    ("ok", "miss_transfer_failed", 200, None),
    ("timeout", "hit", 200, "(timeout 2.0 s)"),
    ("error", None, 502, "HTTP 502: prefill worker prefill-0: ReadTimeout"),
    ("ok", "miss_consumed", 200, None),
    ("error", "hit", 503, "HTTP 503: injected HTTP 503 by decode-"),
]


def test_worker_faults_are_failed_turns_with_reasons_and_the_run_completes(store, tmp_path):
    trace = write_trace(tmp_path / "trace.json", conversations=4, turns=3)
    run_id = "faults-workers"
    with ThreadServer("prefill", faults=P_FAULTS) as p, ThreadServer("decode", faults=D_FAULTS) as d, \
            ProxyThread(proxy_config(p.url, d.url, prefill_timeout_s=1.0)) as proxy:
        proc = subprocess.run(
            _locust_cmd("--headless", "-u", "1", "-r", "1", "--run-time", "90s", "--host", proxy.url,
                        "--turnscope-store", str(store.root), "--turnscope-run-id", run_id,
                        "--turnscope-trace", str(trace), "--turnscope-max-turns", "3",
                        "--turnscope-gap-s", "0.05", "--turnscope-max-tokens", str(MAX_TOKENS),
                        "--turnscope-max-prompt-tokens", "100000", "--turnscope-timeout-s", "2",
                        "--turnscope-mode", "pd-bidir"),
            check=False, cwd=REPO, env=_locust_env(), capture_output=True, text=True, timeout=120)
        time.sleep(0.2)
        p_events, d_events = p.events(), d.events()
    out = proc.stdout + proc.stderr
    assert proc.returncode in (0, 1), out[-3000:]  # 1: Locust's exit code when requests failed
    assert "all 4 sessions played" in out, out[-3000:]

    turns = rows(store, f"SELECT * FROM turns WHERE run_id = '{run_id}' ORDER BY sent_at")
    assert len(turns) == len(EXPECTED) == 12  # every turn sent is stored, failed ones too
    for t, (status, reuse, http, why) in zip(turns, EXPECTED, strict=True):
        got = (t["status"], t["reuse"], t["http_status"])
        assert got == (status, reuse, http), (t["session_id"], t["turn_index"], got, t["error"])
        if why is None:
            assert t["error"] is None and t["ttft_s"] is not None
        else:
            assert why in t["error"], t["error"]
    # the sessions went on after their failures; each failed turn names its session's turn index
    assert [(t["session_id"][:6], t["turn_index"]) for t in turns] == [
        (s, i) for s in ("s00000", "s00001", "s00002", "s00003") for i in range(3)]
    sessions = {s["session_id"][:6]: s for s in rows(store, f"SELECT * FROM sessions WHERE run_id = '{run_id}'")}
    assert {k: (v["turns"], v["status"]) for k, v in sessions.items()} == {
        "s00000": (3, "ok"), "s00001": (3, "error"), "s00002": (3, "error"), "s00003": (3, "error")}

    # what the stubs injected is what was recorded: 4 P faults, 3 D faults, all fired
    assert sorted(e["index"] for e in p_events if e["event"] == "fault") == sorted(P_FAULTS)
    assert sorted(e["index"] for e in d_events if e["event"] == "fault") == sorted(D_FAULTS)
    # nothing wrong: every decode computed from its prompt's own KV, no read of anyone else's blocks
    decodes = decode_events(d_events)  # D0-D8 computed (D9 answered 503 before computing)
    assert [e["index"] for e in decodes] == list(range(9)) and all(e["kv_ok"] for e in decodes)
    assert not invalid_reads(p, d)

    # the run completed, and the dashboard's run table shows the failures
    (run,) = rows(store, f"SELECT status FROM runs WHERE run_id = '{run_id}'")
    assert run["status"] == "complete"
    con = store.connect()
    try:
        summary = tables.run_summary_table(queries.run_summary(con, [run_id]))
    finally:
        con.close()
    row = summary.iloc[0]
    assert (row["status"], row["turns"], row["ok"], row["failed"]) == ("complete", 12, 7, 5)


# ----------------------------------------------------------- workers killed (SIGKILL) mid-request


def _wait_dead(stub: StubProcess, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while stub.alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    return not stub.alive()


def _complete(url: str, ids: list[int], session: str) -> tuple[list[int], httpx.Response, dict]:
    body = {"model": "m", "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0, "conversation_id": session,
            "stream": True}
    with httpx.Client() as c:
        r = stream_turn(c, url + "/v1/completions", body, timeout_s=10)
    return r.token_ids, r, r.proxy_facts


def test_workers_killed_mid_request_are_failed_turns_and_sessions_go_on(store, tmp_path):
    """D is SIGKILLed mid-stream and P mid-prefill (each a process of its own), and each is
    restarted on its port; the session's failed turns are recorded with their reasons, its later
    turns run (as misses, then hits again), and a handle from before D's restart is never read."""
    # Requests in order: Z0 (side session) P0 D0 | t0 P1 D1 | t1 P2 D2 killed after 2 tokens ->
    # restart D | t2 P3 D0' | t3 P4 killed mid-prefill (and its plain retry refused) -> restart P |
    # t4 P0' D1' | t5 P1' D2' | Z1 P2' (handle of the old D: its engine is gone) D3'.
    p = StubProcess("prefill", free_port(), tmp_path / "p.jsonl").start(faults={4: {"what": "kill"}})
    d = StubProcess("decode", free_port(), tmp_path / "d.jsonl").start(faults={2: {"what": "kill", "after": 2}})
    restarts = []

    def restart_the_dead(rec) -> None:
        for stub in (p, d):
            if stub.proc is not None and _wait_dead(stub, 1.0):
                restarts.append((stub.role, rec.row["turn_index"]))
                stub.start()

    try:
        with ProxyThread(proxy_config(p.url, d.url, prefill_timeout_s=5.0)) as proxy:
            z = [20 + i for i in range(30)]
            z_gen, z_r, _ = _complete(proxy.url, z, "side")
            assert z_r.status == "ok" and z_r.headers["x-turnscope-reuse"] == "miss_first_turn"
            with httpx.Client() as client, store.writer("kills", "w") as writer:
                # one /tokenize retry: the failed turn's prompt is rendered while P is still dead
                tok = TokenizeClient(client, proxy.url, "m", retries=1)
                result = run_session(plan("s1", [("turn", 0, "none")] + [("turn", 0.05, "think")] * 5), client,
                                     proxy.url, "m", writer, "kills", "text", max_tokens=MAX_TOKENS,
                                     on_turn=restart_the_dead, tokenizer=tok)
            z2 = z + z_gen + [60, 61, 62]
            z2_gen, z2_r, z2_facts = _complete(proxy.url, z2, "side")
    finally:
        p.stop()
        d.stop()
    assert restarts == [("decode", 1), ("prefill", 3)]
    got = [(r.row["status"], r.row["reuse"], r.row["http_status"]) for r in result.turns]
    assert got == [("ok", "miss_first_turn", 200), ("error", "hit", 200), ("ok", "miss_no_handle_returned", 200),
                   ("error", None, 502), ("ok", "miss_consumed", 200), ("ok", "hit", 200)]
    assert "decode worker decode-0: RemoteProtocolError" in result.turns[1].row["error"]
    err = result.turns[3].row["error"]  # the retry finds P dead: refused, or reset on a pooled connection
    assert err.startswith("HTTP 502: prefill worker prefill-0: ") and any(
        k in err for k in ("ConnectError", "ReadError", "RemoteProtocolError")), err
    assert result.session_row["turns"] == 6 and result.session_row["status"] == "error"
    # the turn killed mid-stream kept what it measured before the kill: its first 2 tokens
    assert result.turns[1].result.token_ids == expected_output(result.turns[1])[:2]
    for rec in result.turns:
        if rec.row["status"] == "ok":
            assert rec.result.token_ids == expected_output(rec)
    # the side session's handle pointed at the killed D: the new D's first handle (s1's, under a new
    # engine id) showed the proxy the restart, so it dropped the side handle rather than send P a
    # pull of a dead engine; P recomputes
    assert z2_r.status == "ok" and z2_r.headers["x-turnscope-reuse"] == "miss_decode_restarted"
    assert z2_facts["reused_tokens"] == 0 and z2_gen == gen_ids(z2, MAX_TOKENS)
    p_events, d_events = p.events(), d.events()
    assert [e["index"] for e in p_events if e["event"] == "fault"] == [4]
    assert [e["index"] for e in d_events if e["event"] == "fault"] == [2]
    assert len({e["engine"] for e in d_events}) == 2 and len({e["engine"] for e in p_events}) == 2
    assert all(e["kv_ok"] for e in decode_events(d_events))
    assert not invalid_reads(p, d)
    stored = rows(store, "SELECT turn_index, status, error FROM turns WHERE run_id = 'kills' ORDER BY turn_index")
    assert [(t["turn_index"], t["status"]) for t in stored] == [(i, r.row["status"]) for i, r in enumerate(result.turns)]


# -------------------------------------------------------------------- proxy restarted mid-run


class ProxyProcess:
    """``python -m serving.proxy_server`` on a fixed port, SIGKILLed and started again at will."""

    def __init__(self, config: ProxyConfig, tmp: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cfg = tmp / "proxy.json"
        self.cfg.write_text(config.model_dump_json())
        self.log = tmp / "proxy.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> ProxyProcess:
        env = dict(os.environ, PYTHONPATH=str(REPO))
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "serving.proxy_server", str(self.cfg), "--port",
                                          str(self.port)], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-2000:]
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError("proxy did not start")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def test_proxy_restart_mid_run_misses_once_per_live_session_and_nothing_is_wrong(store, tmp_path):
    """Four sessions (two text, two token_ids) run while the proxy is SIGKILLed and restarted on its
    port: turns in flight or sent while it is down are failed turns with their reasons; each
    session's first turn through the new proxy is its one miss (``miss_first_turn``: the handle
    table died with the process); every output equals the one computed from the prompt."""
    n_turns = 7
    done = {f"r{i}": 0 for i in range(4)}
    lock = threading.Lock()
    results: dict[str, object] = {}

    def count(rec) -> None:
        with lock:
            done[rec.row["session_id"]] += 1

    with ThreadServer("prefill") as p, ThreadServer("decode") as d:
        proxy = ProxyProcess(proxy_config(p.url, d.url), tmp_path).start()

        def play(sid: str, mode: str) -> None:
            with httpx.Client() as client, store.writer("restart", f"w-{sid}") as writer:
                results[sid] = run_session(plan(sid, [("turn", 0, "none")] + [("turn", 0.4, "think")] * (n_turns - 1)),
                                           client, proxy.url, "m", writer, "restart", mode, max_tokens=MAX_TOKENS,
                                           on_turn=count)

        threads = [threading.Thread(target=play, args=(sid, "text" if i < 2 else "token_ids"))
                   for i, sid in enumerate(done)]
        try:
            for t in threads:
                t.start()
            deadline = time.monotonic() + 30
            while min(done.values()) < 2:  # every session is live: two turns each went through
                assert time.monotonic() < deadline, done
                time.sleep(0.02)
            killed_at = dt.datetime.now(dt.UTC)
            proxy.kill()
            time.sleep(0.3)
            proxy.start()
            restarted_at = dt.datetime.now(dt.UTC)
            for t in threads:
                t.join(60)
        finally:
            proxy.kill()
        d_events = d.events()
        assert not invalid_reads(p, d)

    assert set(results) == set(done)
    for sid, res in results.items():
        recs = res.turns
        assert len(recs) == n_turns and res.session_row["turns"] == n_turns, sid  # the session went on
        before = [r for r in recs if r.result.sent_at < killed_at and r.row["status"] == "ok"]
        assert len(before) >= 2
        assert before[0].row["reuse"] == "miss_first_turn"
        assert "miss_first_turn" not in [r.row["reuse"] for r in before[1:]]
        failed = [r for r in recs if r.row["status"] != "ok"]
        for r in failed:  # in flight at the kill, or sent while it was down
            assert r.result.sent_at < restarted_at, (sid, r.row)
            assert any(k in r.row["error"] for k in ("ConnectError", "RemoteProtocolError", "ReadError")), r.row
        after = [r for r in recs if r.result.sent_at >= killed_at and r.row["status"] == "ok"]
        assert after, sid
        assert after[0].row["reuse"] == "miss_first_turn", (sid, [r.row["reuse"] for r in after])
        assert all(r.row["reuse"] in ("hit", "miss_mismatch") for r in after[1:]), (sid, [r.row["reuse"] for r in after])
        for r in recs:
            if r.row["status"] == "ok":
                assert r.result.token_ids == expected_output(r), (sid, r.row["turn_index"])
    assert all(e["kv_ok"] for e in decode_events(d_events))
    stored = rows(store, "SELECT count(*) AS n, count(*) FILTER (WHERE status <> 'ok') AS failed FROM turns "
                         "WHERE run_id = 'restart'")
    assert stored[0]["n"] == 4 * n_turns
    assert stored[0]["failed"] >= 1  # the text sessions send every 0.4 s; the proxy is down > 0.3 s
    assert stored[0]["failed"] == sum(r.row["status"] != "ok" for res in results.values() for r in res.turns)


# ------------------------------------------------------------ handles: retries, edits, expiry


def _p_then_d(p_url: str, d_url: str, ids: list[int], handle: dict | None = None):
    """One request straight to the stubs, as the proxy would send it (no proxy in between)."""
    params = PREFILL_PARAMS | (handle or {})
    p_resp = httpx.post(p_url + "/v1/completions", json={"model": "m", "prompt": ids, "max_tokens": 1,
                                                         "stream": False, "kv_transfer_params": params}).json()
    with httpx.Client() as c:
        return stream_turn(c, d_url + "/v1/completions", {"model": "m", "prompt": ids, "max_tokens": MAX_TOKENS,
                                                          "kv_transfer_params": p_resp["kv_transfer_params"]})


def test_retries_edits_and_expired_handles_never_read_another_requests_blocks(store):
    """Six sessions with many retries, edits and pauses past the proxy's TTL, plus concurrent
    duplicates, through the proxy: no read of blocks not held for the reader, every output right.
    The control at the end shows the oracle catches a stale handle when one is used."""
    kinds = [("turn", 0, "none"), ("retry", 0, "none"), ("turn", 0.05, "think"), ("edit", 0.05, "tool"),
             ("retry", 0, "none"), ("resume", 1.3, "pause"), ("turn", 0.05, "think"), ("edit", 0.05, "tool"),
             ("retry", 0, "none"), ("resume", 1.3, "pause")]
    results = {}
    # D keeps blocks 1.5 s; the proxy offers a handle for 1.5 - 0.5 = 1.0 s; pauses last 1.3 s
    with ThreadServer("prefill", ttl_s=1.5) as p, ThreadServer("decode", ttl_s=1.5) as d, \
            ProxyThread(proxy_config(p.url, d.url, decoder_kv_blocks_ttl_s=1.5, handle_ttl_margin_s=0.5)) as proxy:

        def play(sid: str, mode: str) -> None:
            with httpx.Client() as client, store.writer("handles", f"w-{sid}") as writer:
                results[sid] = run_session(plan(sid, kinds), client, proxy.url, "m", writer, "handles", mode,
                                           max_tokens=MAX_TOKENS)

        threads = [threading.Thread(target=play, args=(f"h{i}", "text" if i % 2 else "token_ids")) for i in range(6)]
        for t in threads:
            t.start()
        # meanwhile: the same request twice at once, in three sessions (a client retrying too early)
        burst = []
        for k in range(3):
            ids = [30 + k] * 41
            gen, _, _ = _complete(proxy.url, ids, f"dup{k}")
            ids2 = ids + gen + [50, 51, 52]
            pair = [None, None]

            def send(j: int, ids2: list[int] = ids2, pair: list = pair, session: str = f"dup{k}") -> None:
                pair[j] = _complete(proxy.url, ids2, session)

            ts = [threading.Thread(target=send, args=(j,)) for j in range(2)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            burst.append((ids2, pair))
        for t in threads:
            t.join(60)
        assert not invalid_reads(p, d)
        assert all(e["kv_ok"] for e in decode_events(d.events()))

    # control: the oracle sees a stale handle when one is used. On fresh workers, A's handle
    # outlives D's TTL, B's blocks take A's freed block ids, then P is given A's handle anyway.
    with ThreadServer("prefill", ttl_s=1.5) as p, ThreadServer("decode", ttl_s=1.5) as d:
        a = list(range(100, 141))
        ra = _p_then_d(p.url, d.url, a)
        time.sleep(1.6)
        rb = _p_then_d(p.url, d.url, list(range(200, 260)))
        assert ra.status == rb.status == "ok"
        a2 = a + ra.token_ids + [7, 8, 9]
        stale = _p_then_d(p.url, d.url, a2, ra.kv_transfer_params)
        assert len(invalid_reads(p, d)) == 1
        assert stale.status == "ok" and stale.token_ids != gen_ids(a2, MAX_TOKENS)  # a wrong output
        assert decode_events(d.events())[-1]["kv_ok"] is False

    outcomes: dict[str, list[str]] = {"retry": [], "edit": [], "resume": [], "turn": []}
    for sid, res in results.items():
        assert [r.row["status"] for r in res.turns] == ["ok"] * len(kinds), sid
        for r, (kind, _, _) in zip(res.turns, kinds, strict=True):
            assert r.row["kind"] == kind
            outcomes[kind].append(r.row["reuse"])
            assert r.result.token_ids == expected_output(r), (sid, r.row["turn_index"], kind)
    assert len(outcomes["retry"]) == 18 and len(outcomes["edit"]) == 12 and len(outcomes["resume"]) == 12
    assert set(outcomes["resume"]) == {"miss_expired"}  # every pause outlived the proxy's TTL
    assert set(outcomes["retry"]) <= {"hit", "miss_mismatch"} and "hit" in outcomes["retry"]
    assert set(outcomes["edit"]) <= {"hit", "miss_mismatch"}
    for ids2, pair in burst:
        assert sorted(r.headers["x-turnscope-reuse"] for _, r, _ in pair) == ["hit", "miss_consumed"]
        assert all(gen == gen_ids(ids2, MAX_TOKENS) for gen, _, _ in pair)


# ------------------------------------------------------------------ loadgen killed with SIGKILL


def test_loadgen_sigkill_leaves_a_readable_store_an_aborted_run_and_loses_at_most_the_last_second(store, tmp_path):
    """Locust is SIGKILLed mid-run: the store reads (no half-written shard is visible), the run
    reads ``running`` while its heartbeat beats and ``aborted`` after, and every turn the server
    finished more than the flush interval (1 s, plus 0.5 s for writing it) before the kill is
    stored; nothing is stored that the server did not finish."""
    trace = write_trace(tmp_path / "trace.json", conversations=20, turns=4)
    state = StubState(ttft_s=0.02, itl_s=0.005)
    run_id = "killed"
    with StubServer(state) as srv:
        proc = subprocess.Popen(
            _locust_cmd("--headless", "-u", "4", "-r", "4", "--run-time", "120s", "--host", srv.url,
                        "--turnscope-store", str(store.root), "--turnscope-run-id", run_id,
                        "--turnscope-trace", str(trace), "--turnscope-sessions", "400", "--turnscope-gap-s", "0.05",
                        "--turnscope-max-tokens", "8", "--turnscope-max-prompt-tokens", "100000",
                        "--turnscope-heartbeat-s", "0.5"),
            cwd=REPO, env=_locust_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while len(state.finished) < 40:  # well into the run
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.05)
            statuses = []
            for _ in range(4):  # over 2 s (four heartbeats): running all along
                statuses.append(rows(store, f"SELECT status FROM runs WHERE run_id = '{run_id}'")[0]["status"])
                time.sleep(0.5)
            killed_at = time.time()
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            with state.lock:
                finished = list(state.finished)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert statuses == ["running"] * 4
    assert proc.returncode == -signal.SIGKILL
    time.sleep(max(0.0, killed_at + 2.0 - time.time()))  # > 3 heartbeats after the last one
    (run,) = rows(store, f"SELECT status, finished_at, heartbeat_s FROM runs WHERE run_id = '{run_id}'")
    assert run == {"status": "aborted", "finished_at": None, "heartbeat_s": 0.5}

    stored = rows(store, f"SELECT request_id, status FROM turns WHERE run_id = '{run_id}'")
    stored_idx = {int(r["request_id"].split("-")[1]) for r in stored}
    assert len(stored_idx) == len(stored)  # each turn stored once
    finished_at = dict(finished)
    assert stored_idx <= set(finished_at)  # nothing stored that the server did not finish
    old = {i for i, t in finished_at.items() if t < killed_at - 1.5}
    assert old and old <= stored_idx, sorted(old - stored_idx)
    missing = set(finished_at) - stored_idx
    assert all(finished_at[i] >= killed_at - 1.5 for i in missing)
    assert all(r["status"] == "ok" for r in stored)
    # every table still reads, and no temporary shard is visible to it
    con = store.connect()
    try:
        for table in ("runs_log", "turns", "sessions", "run_summary", "turn_breakdown"):
            con.execute(f"SELECT count(*) FROM {table}").fetchone()
    finally:
        con.close()


# ------------------------------------------------------------------ engine restarted mid-run


def test_engine_restart_mid_run_keeps_counter_increases_right_and_marks_the_restart(store):
    """An endpoint restarts between scrapes twice: once with its counter back below the old value,
    once already past it (only process_start_time_seconds shows that one). Every increase is >= 0,
    they add up to what was counted, and each restart is marked (``reset``) exactly once."""
    name = "turnscope_requests_total"

    def serve(start: float, port: int = 0):
        reg = CollectorRegistry()
        c = Counter("turnscope_requests", "Requests.", registry=reg)
        Gauge("process_start_time_seconds", "Start.", registry=reg).set(start)
        httpd, _ = start_http_server(port, addr="127.0.0.1", registry=reg)
        return httpd, c

    def values() -> list[float]:
        return [r["value"] for r in rows(store, f"SELECT value FROM metric_samples WHERE name = '{name}' "
                                                "ORDER BY scraped_at")]

    def wait_for(v: float) -> None:
        deadline = time.monotonic() + 10
        while v not in values():
            assert time.monotonic() < deadline, values()
            time.sleep(0.05)

    httpd, c = serve(1000.0)
    port = httpd.server_port
    url = f"http://127.0.0.1:{port}"
    writer = store.writer("restarts", "scraper", flush_interval_s=0.1)
    scraper = MetricsScraper([(url, "decode")], writer, "restarts", interval_s=0.1, timeout_s=1.0)
    counted = 0
    try:
        c.inc(5)
        scraper.start()
        wait_for(5.0)
        c.inc(25)
        counted += 25
        wait_for(30.0)
        for start, inc, then in ((2000.0, 4, 3), (3000.0, 40, 2)):  # back below 30; then past it
            httpd.shutdown()
            httpd.server_close()
            httpd, c = serve(start, port)
            c.inc(inc)
            counted += inc
            wait_for(float(inc))
            c.inc(then)
            counted += then
            wait_for(float(inc + then))
    finally:
        scraper.stop()
        writer.close()
        httpd.shutdown()
        httpd.server_close()
    got = rows(store, f"SELECT increase, reset FROM metric_increases WHERE name = '{name}' ORDER BY scraped_at")
    assert all(r["increase"] >= 0 for r in got)  # no negative or shrunken delta
    assert sum(r["increase"] for r in got) == counted == 25 + 4 + 3 + 40 + 2  # the first scrape counts 0
    assert sum(r["reset"] for r in got) == 2
