"""run_session and the locustfile against a local stub OpenAI server with injected delays and ids.

Checks the stored rows (DuckDB over the store) against what the stub injected: TTFT and ITL, gap
kinds and lengths, expected reusable tokens computed by hand, the exact token-id prompt of turn 2,
failures, the prompt limit, and that Locust plays every session exactly once and exits by itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from loadgen.session import plan_from_conversation
from loadgen.session_player import run_session
from loadgen.traces.taubench import Conversation
from store import db
from store.queries import run_report
from store.writer import Store
from tests.integration.openai_stub import CHAR_BASE, IM_END, XY, StubServer, StubState, encode, render

pytestmark = pytest.mark.timing

REPO = Path(__file__).resolve().parents[2]
NL = CHAR_BASE + ord("\n")
TTFT_S, ITL_S, THINK_S, TOOL_S = 0.15, 0.03, 0.3, 0.5
REPLY = encode("ok") + [XY] + encode(".")        # text "okxy.", which re-encodes as o k x y .

TOOL_CALL = {"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"to": "SEA"}'}}
CONV = Conversation(id="hand", source="test:hand", messages=[
    {"role": "system", "content": "You are a test agent."},
    {"role": "user", "content": "Book a flight."},
    {"role": "assistant", "content": "Sure."},
    {"role": "user", "content": "To Seattle."},
    {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
    {"role": "tool", "tool_call_id": "c1", "name": "search", "content": '{"flights": []}'},
    {"role": "assistant", "content": "No flights."},
])


def chatml_len(messages: list[dict], generation_prompt: bool = True) -> int:
    """Tokens of a ChatML render under the stub's tokenizer, counted by hand: per message
    <|im_start|> + role + \\n + content + <|im_end|> + \\n; then <|im_start|> assistant \\n."""
    n = sum(1 + len(m["role"]) + 1 + len(m["content"]) + 1 + 1 for m in messages)
    return n + (1 + len("assistant") + 1 if generation_prompt else 0)


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "store")
    s.init()
    return s


def play(store, state, mode, run_id="r1", **kw):
    with StubServer(state) as srv, httpx.Client() as client:
        plan = plan_from_conversation(CONV, session_id=f"s-{mode}", tool_gap_s=TOOL_S, think_gap_s=THINK_S)
        with store.writer(run_id, f"w-{mode}") as writer:
            return run_session(plan, client, srv.url, "stub-model", writer, run_id, mode,
                               max_tokens=kw.pop("max_tokens", 16), **kw)


def rows(store, sql):
    con = store.connect()
    try:
        cur = con.execute(sql)
        names = [d[0] for d in cur.description]
        return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]
    finally:
        con.close()


@pytest.mark.parametrize("mode", ["text", "token_ids"])
def test_three_turn_session_rows_match_injected_truth(store, mode):
    state = StubState(ttft_s=TTFT_S, itl_s=ITL_S, reply_ids=lambda i: list(REPLY))
    result = play(store, state, mode)
    assert result.stopped == "complete"
    turns = rows(store, f"SELECT * FROM turns WHERE session_id = 's-{mode}' ORDER BY turn_index")
    assert [t["turn_index"] for t in turns] == [0, 1, 2]
    sent = [r["prompt_ids"] for r in state.requests]
    assert len(sent) == 3 and all(r["path"].endswith("completions") for r in state.requests)

    for t, ids in zip(turns, sent, strict=True):
        assert t["status"] == "ok" and t["error"] is None and t["http_status"] == 200
        assert TTFT_S <= t["ttft_s"] < TTFT_S + 0.1
        assert t["ttfc_s"] == pytest.approx(t["ttft_s"], abs=1e-9)
        assert t["itl_samples"] == len(REPLY) - 1
        assert ITL_S <= t["itl_p50_s"] < ITL_S + 0.03 and ITL_S <= t["itl_p90_s"] < ITL_S + 0.05
        assert t["e2e_s"] >= TTFT_S + (len(REPLY) - 1) * ITL_S
        # TPOT to the last token: the stub spaces the reply's tokens ITL_S apart.
        assert ITL_S <= t["tpot_s"] < ITL_S + 0.03
        assert t["last_token_s"] <= t["e2e_s"]
        assert t["prompt_tokens"] == len(ids) and t["completion_tokens"] == len(REPLY)
        assert t["prompt_sha256"] == hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()
        assert t["request_id"].startswith("stub-")
        assert t["prefill_leg_s"] == pytest.approx(0.0125)
        assert (t["prefill_engine"], t["decode_engine"], t["kind"]) == ("stub-p0", "stub-d0", "turn")
    assert [t["reuse"] for t in turns] == ["miss_first_turn", "hit", "hit"]
    assert [t["remote_tokens"] for t in turns] == [0, len(sent[1]), len(sent[2])]
    assert [t["handle_age_s"] for t in turns] == [None, 0.5, 0.5]
    assert [t["cached_tokens"] for t in turns] == [0, len(sent[1]) // 2, len(sent[2]) // 2]

    # gaps: kinds from the trace (a user message, then a tool result), lengths as injected
    assert [t["gap_kind"] for t in turns] == ["none", "think", "tool"]
    assert turns[0]["gap_before_s"] == 0.0
    assert THINK_S <= turns[1]["gap_before_s"] < THINK_S + 0.05
    assert TOOL_S <= turns[2]["gap_before_s"] < TOOL_S + 0.05
    assert turns[0]["sent_at"] < turns[1]["sent_at"] < turns[2]["sent_at"]

    # the prompts, and the reuse a perfect cache could get, by hand
    m = CONV.messages
    p0 = chatml_len(m[:2])
    assert len(sent[0]) == p0
    if mode == "text":
        # history is re-rendered from the returned text "okxy.": the generated XY comes back as x, y
        sent_reply = {"role": "assistant", "content": "okxy."}
        p1 = chatml_len(m[:2] + [sent_reply] + [m[3]])
        assert len(sent[1]) == p1
        assert state.requests[1]["messages"][2] == sent_reply
        assert [t["expected_reusable_tokens"] for t in turns] == [0, p0 + 2, p1 + 2]  # 0: nothing before turn 0
        assert [t["divergence_position"] for t in turns] == [None, p0 + 2, p1 + 2]
    else:
        # prompt = previous prompt + generated ids + <|im_end|> + "\n" + the new messages rendered
        assert sent[1] == sent[0] + REPLY + [IM_END, NL] + encode(render([m[3]], True))
        assert sent[2] == sent[1] + REPLY + [IM_END, NL] + encode(render([m[5]], True))
        assert [t["expected_reusable_tokens"] for t in turns] == [0, p0 + 4, len(sent[1]) + 4]
        assert [t["divergence_position"] for t in turns] == [None, None, None]
        assert all("prompt" in r and "messages" not in r for r in state.requests)
    for r in state.requests:
        assert r["conversation_id"] == f"r1/s-{mode}" and r["return_token_ids"] is True
        assert r["temperature"] == 0 and r["max_tokens"] == 16 and r["stream"] is True

    (s,) = rows(store, f"SELECT * FROM sessions WHERE session_id = 's-{mode}'")
    assert (s["turns"], s["status"], s["source"], s["archetype"]) == (3, "ok", "test:hand", "trace")
    assert s["llm_s"] == pytest.approx(sum(t["e2e_s"] for t in turns))
    assert s["think_s"] == pytest.approx(turns[1]["gap_before_s"])
    assert s["tool_wait_s"] == pytest.approx(turns[2]["gap_before_s"])
    assert s["pause_s"] == 0.0
    assert s["task_latency_s"] == pytest.approx(s["llm_s"] + s["think_s"] + s["tool_wait_s"], abs=0.02)
    assert s["started_at"] == turns[0]["sent_at"]


@pytest.mark.parametrize("mode", ["text", "token_ids"])
def test_failed_turn_is_recorded_and_the_trace_reply_stands_in(store, mode):
    state = StubState(ttft_s=0.01, itl_s=0.0, reply_ids=lambda i: list(REPLY), fail_requests={1})
    result = play(store, state, mode)
    turns = rows(store, "SELECT * FROM turns ORDER BY turn_index")
    assert [t["status"] for t in turns] == ["ok", "error", "ok"]
    assert turns[1]["http_status"] == 500 and "injected failure of request 1" in turns[1]["error"]
    assert turns[1]["ttft_s"] is None
    ref = CONV.messages[4]  # the trace's tool-call reply for turn 1
    if mode == "text":
        assert state.requests[2]["messages"][4] == ref
    else:
        rendered_ref = json.dumps(ref["tool_calls"])  # the stub's template renders tool calls as JSON
        expected = (state.requests[1]["prompt_ids"] + encode(rendered_ref) + [IM_END, NL]
                    + encode(render([CONV.messages[5]], True)))
        assert state.requests[2]["prompt_ids"] == expected
    # nothing was generated for turn 1: the next turn can reuse at most turn 1's prompt, all of it
    p1 = len(state.requests[1]["prompt_ids"])
    assert (turns[2]["expected_reusable_tokens"], turns[2]["divergence_position"]) == (p1, None)
    (s,) = rows(store, "SELECT * FROM sessions")
    assert (s["status"], s["turns"]) == ("error", 3)
    assert result.session_row["status"] == "error"


def test_interrupted_session_is_recorded_as_cancelled(store):
    class Interrupt(BaseException):  # what gevent's GreenletExit is to Locust stopping a user
        pass

    def on_turn(rec):
        if rec.row["turn_index"] == 1:
            raise Interrupt

    state = StubState(ttft_s=0.01, itl_s=0.0, reply_ids=lambda i: list(REPLY))
    with pytest.raises(Interrupt):
        play(store, state, "text", on_turn=on_turn)
    (s,) = rows(store, "SELECT turns, status, planned_turns, stop_reason FROM sessions")
    assert s == {"turns": 2, "status": "cancelled", "planned_turns": 3, "stop_reason": "cancelled"}
    assert len(rows(store, "SELECT * FROM turns")) == 2


def test_timeouts_are_recorded(store):
    state = StubState(ttft_s=1.0, reply_ids=lambda i: list(REPLY))
    play(store, state, "text", timeout_s=0.3)
    turns = rows(store, "SELECT status, error, ttft_s, e2e_s FROM turns ORDER BY turn_index")
    assert [t["status"] for t in turns] == ["timeout"] * 3
    assert all(t["ttft_s"] is None and 0.25 < t["e2e_s"] < 0.9 and "timeout" in t["error"].lower() for t in turns)


def test_session_stops_before_a_prompt_over_the_limit(store):
    state = StubState(ttft_s=0.01, itl_s=0.0, reply_ids=lambda i: list(REPLY))
    limit = chatml_len(CONV.messages[:2] + [{"role": "assistant", "content": "okxy."}, CONV.messages[3]])
    result = play(store, state, "text", max_prompt_tokens=limit)  # turn 1 fits exactly, turn 2 does not
    assert result.stopped == "max_prompt_tokens" and len(state.requests) == 2
    (s,) = rows(store, "SELECT turns, status, planned_turns, stop_reason FROM sessions")
    # the hand conversation has 3 user/tool turns; the third was not sent
    assert s == {"turns": 2, "status": "ok", "planned_turns": 3, "stop_reason": "max_prompt_tokens"}
    # what `turnscope eval` prints for the run: one session stopped early, one planned turn not sent
    cut = db.read(db.StoreLocation(store.root), run_report.stopped_early, ["r1"]).to_dict("records")
    assert cut == [{"run_id": "r1", "stop_reason": "max_prompt_tokens", "sessions": 1, "turns_not_sent": 1}]


# ----------------------------------------------------------------------------------- Locust


def _locust_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _locust_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "locust", "-f", str(REPO / "loadgen" / "locustfile.py"), *args]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_run(store, state, run_id, n_sessions, turns_per_session):
    turns = rows(store, f"SELECT session_id, turn_index, status, request_id FROM turns WHERE run_id = '{run_id}'")
    keys = [(t["session_id"], t["turn_index"]) for t in turns]
    assert len(keys) == len(set(keys)) == n_sessions * turns_per_session  # every turn stored exactly once
    assert len({t["session_id"] for t in turns}) == n_sessions
    assert all(t["status"] == "ok" for t in turns)
    assert len({t["request_id"] for t in turns}) == len(turns)
    assert len(state.requests) == len(turns)                                # and sent exactly once
    sessions = rows(store, f"SELECT session_id, turns, status FROM sessions WHERE run_id = '{run_id}'")
    assert sorted(s["session_id"] for s in sessions) == sorted({t["session_id"] for t in turns})
    assert all(s["turns"] == turns_per_session and s["status"] == "ok" for s in sessions)
    (run,) = rows(store, f"SELECT status, history_mode, mode FROM runs WHERE run_id = '{run_id}'")
    return run


@pytest.mark.parametrize("mode", ["text", "token_ids"])
def test_locust_headless_plays_every_session_once_and_quits(store, mode):
    state = StubState(ttft_s=0.02, itl_s=0.005)
    run_id = f"locust-{mode}"
    with StubServer(state) as srv:
        t0 = time.monotonic()
        proc = subprocess.run(
            _locust_cmd("--headless", "-u", "2", "-r", "2", "--run-time", "60s", "--host", srv.url,
                        "--turnscope-store", str(store.root), "--turnscope-run-id", run_id,
                        "--turnscope-sessions", "3", "--turnscope-max-turns", "3",
                        "--turnscope-gap-s", "0.2", "--turnscope-history", mode, "--turnscope-max-tokens", "8",
                        "--turnscope-max-prompt-tokens", "100000"),
            check=False, cwd=REPO, env=_locust_env(), capture_output=True, text=True, timeout=120)
        elapsed = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert elapsed < 45, f"locust did not quit by itself ({elapsed:.0f} s)\n{out[-2000:]}"
    assert "all 3 sessions played" in out
    run = _check_run(store, state, run_id, n_sessions=3, turns_per_session=3)
    assert run == {"status": "complete", "history_mode": mode, "mode": "attach"}
    # Locust's own stats: one "turn" and one "TTFT" event per turn
    assert "POST" in out and " turn" in out and "TTFT" in out


def test_locust_distributed_hands_out_sessions_across_workers(store):
    """Master + 2 workers with 3 users (uneven spread): each of 5 sessions is played once."""
    state = StubState(ttft_s=0.02, itl_s=0.005)
    run_id = "locust-dist"
    port = str(_free_port())
    with StubServer(state) as srv:
        master = subprocess.Popen(
            _locust_cmd("--master", "--master-bind-host", "127.0.0.1", "--master-bind-port", port,
                        "--expect-workers", "2", "--headless", "-u", "3", "-r", "3", "--run-time", "60s",
                        "--host", srv.url, "--turnscope-store", str(store.root), "--turnscope-run-id", run_id,
                        "--turnscope-sessions", "5", "--turnscope-max-turns", "2", "--turnscope-gap-s", "0.1",
                        "--turnscope-max-prompt-tokens", "100000"),
            cwd=REPO, env=_locust_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        workers = [subprocess.Popen(
            _locust_cmd("--worker", "--master-host", "127.0.0.1", "--master-port", port),
            cwd=REPO, env=_locust_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for _ in range(2)]
        try:
            out, _ = master.communicate(timeout=90)
            wouts = [w.communicate(timeout=30)[0] for w in workers]
        finally:
            for p in (master, *workers):
                if p.poll() is None:
                    p.kill()
    assert master.returncode == 0, out[-3000:]
    assert all(w.returncode == 0 for w in workers), "\n".join(o[-1500:] for o in wouts)
    run = _check_run(store, state, run_id, n_sessions=5, turns_per_session=2)
    assert run["status"] == "complete"
    # both workers wrote shards of their own
    shards = list((store.root / "runs" / run_id / "turns").glob("*.parquet"))
    assert len({p.name.rsplit("-", 2)[0] for p in shards}) == 2


def test_locust_web_ui_stop_records_a_stopped_run_with_every_finished_turn(store):
    """Driven through the web UI's own HTTP API (POST /swarm, POST /stop), stopped before its 50
    sessions are played: the run reads `stopped` (not `aborted`, which means its writer died), and
    every turn the stub answered is stored."""
    state = StubState(ttft_s=0.02, itl_s=0.005)
    web_port = _free_port()
    run_id = "locust-web-stop"
    with StubServer(state) as srv:
        proc = subprocess.Popen(
            _locust_cmd("--web-port", str(web_port), "--host", srv.url, "--turnscope-store", str(store.root),
                        "--turnscope-run-id", run_id, "--turnscope-sessions", "50", "--turnscope-max-turns", "3",
                        "--turnscope-gap-s", "0.3", "--turnscope-max-tokens", "8",
                        "--turnscope-max-prompt-tokens", "100000"),
            cwd=REPO, env=_locust_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            ui = f"http://127.0.0.1:{web_port}"
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    httpx.get(ui, timeout=1)
                    break
                except httpx.HTTPError:
                    time.sleep(0.3)
            r = httpx.post(ui + "/swarm", data={"user_count": 2, "spawn_rate": 2, "host": srv.url}, timeout=10)
            assert r.status_code == 200 and r.json()["success"], r.text
            while len(state.requests) < 6 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert httpx.post(ui + "/stop", timeout=10).status_code == 200
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not rows(
                    store, f"SELECT 1 FROM runs_log WHERE run_id = '{run_id}' AND status <> 'running'"):
                time.sleep(0.2)
            answered = len(state.requests)
        finally:
            proc.terminate()
            out = proc.communicate(timeout=30)[0]
    (run,) = rows(store, f"SELECT status FROM runs WHERE run_id = '{run_id}'")
    assert run == {"status": "stopped"}, out[-3000:]
    (n,) = rows(store, f"SELECT count(*) AS n, count(*) FILTER (WHERE status = 'cancelled') AS cancelled "
                       f"FROM turns WHERE run_id = '{run_id}'")
    # stopping kills the users mid-turn: a turn in flight when STOP came is stored `cancelled`, so
    # every request the stub got is a row, plus at most one per user (2) cut off before reaching it
    assert answered <= n["n"] <= answered + 2 and n["cancelled"] <= 2, (n, answered)


@pytest.mark.parametrize("max_model_len, sessions_with_turns", [(100_000, 2), (20, 0)])
def test_locust_stops_sessions_at_the_servers_max_model_len(store, max_model_len, sessions_with_turns):
    """Without --turnscope-max-prompt-tokens, the prompt limit is the server's max_model_len
    (GET /v1/models) less the output tokens: the tau-bench first prompts (thousands of
    characters, one stub token each, more than the old fixed 4096) fit 100,000 - 8 and are
    sent; none fits 20 - 8 = 12, so no turn is sent."""
    state = StubState(ttft_s=0.01, itl_s=0.002, max_model_len=max_model_len)
    run_id = f"locust-mml-{max_model_len}"
    with StubServer(state) as srv:
        proc = subprocess.run(
            _locust_cmd("--headless", "-u", "1", "-r", "1", "--run-time", "60s", "--host", srv.url,
                        "--turnscope-store", str(store.root), "--turnscope-run-id", run_id,
                        "--turnscope-sessions", "2", "--turnscope-max-turns", "1", "--turnscope-gap-s", "0",
                        "--turnscope-max-tokens", "8"),
            check=False, cwd=REPO, env=_locust_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    (n,) = rows(store, f"SELECT count(DISTINCT session_id) AS n FROM turns WHERE run_id = '{run_id}'")
    assert n["n"] == sessions_with_turns
    assert len(state.requests) == sessions_with_turns


THINKING = encode("<think>why</think>Sure.")   # a reply whose reasoning precedes the answer


@pytest.mark.parametrize("mode", ["text", "token_ids"])
@pytest.mark.parametrize("rewrite, reply", [
    (None, THINKING),
    ({"strip_reasoning": True}, THINKING),
    ({"strip_reasoning": True, "reasoning_share": 0.4}, encode("okxy.")),  # the stand-in: "ok" dropped
])
def test_history_that_drifts_shares_only_the_previous_prompt(store, mode, rewrite, reply):
    """Truth by hand: the stub's char-level ChatML tokenizer re-encodes a reply's text to its ids, so
    a reply sent back as returned is shared whole (previous prompt + reply); one whose reasoning
    (or its stand-in) is stripped diverges where the reply begins: only the previous prompt is."""
    state = StubState(reply_ids=lambda i: list(reply))
    assert play(store, state, mode, history_rewrite=rewrite, max_tokens=len(reply)).stopped == "complete"
    turns = rows(store, f"SELECT * FROM turns WHERE session_id = 's-{mode}' ORDER BY turn_index")
    sent = [r["prompt_ids"] for r in state.requests]
    expected = [t["expected_reusable_tokens"] for t in turns]
    if rewrite is None:
        assert expected[1] >= len(sent[0]) + len(reply)  # the whole reply (token_ids: and the joiner)
        assert sent[1][:len(sent[0]) + len(reply)] == sent[0] + reply
    else:
        assert expected == [0, len(sent[0]), len(sent[1])]
        assert [t["divergence_position"] for t in turns[1:]] == [len(sent[0]), len(sent[1])]
        sent_back = state.requests[1]["messages"][2]["content"] if mode == "text" else None
        assert sent_back in (None, "Sure.", "xy.")
